//! Compute kernels by backend.

pub mod cpu;
