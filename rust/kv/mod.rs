//! K/V memory: the per-device block pool.

pub mod blocks;
