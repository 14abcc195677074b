//! K/V memory: the per-device block pool and its prefix index.

pub mod blocks;
pub mod prefix;
