//! strata-rs: an LLM inference engine with a tiered conversation cache.
//!
//! Module map (no logic here):
//! - `device`: CPU and CUDA devices, the CUDA probe, the CUDA kernels and their NVRTC build.
//! - `model`: config, weights, tokenizer, the forward pass and its kernels.
//! - `kv`: the paged K/V block pool.
//! - `cache`: the conversation cache below the device: host tier, disk tier, moves.
//! - `engine`: the engine thread and its request channel.
//! - `rng`: deterministic pseudo-random numbers for tests, benches and fault injection.
//! - `bench`: the timing harness behind `strata-rs bench` and the criterion benches.
//! - `python` (feature "python"): the PyO3 binding layer, one file per exposed type.

pub mod bench;
pub mod cache;
pub mod device;
pub mod engine;
pub mod error;
pub mod kv;
pub mod model;
pub mod rng;
pub mod sync;

#[cfg(feature = "python")]
mod python;
