//! K/V memory: the per-device block pool, its prefix index and its sliding-window slots.

pub mod blocks;
pub mod prefix;
pub mod window;
