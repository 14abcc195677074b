//! The CUDA backend (feature "cuda"), through cudarc with dynamic loading: it builds with no CUDA
//! toolkit, and a machine without a driver or without NVRTC gets a clear error, never a panic.
//!
//! - `probe`: finds the driver and the GPUs.
//! - `nvrtc`: compiles kernel sources for a GPU architecture at load, cached on disk.
//! - `kernels`: the `.cu` sources (`kernels/*.cu`, one per kernel, each with a CPU twin in
//!   `rust/model/kernels/cpu/`) and their launch wrappers.
//!
//! - `runner`: the model on the GPU when an engine is loaded with `device="cuda:N"`: the step's
//!   plan, the forward through these kernels and cuBLAS, decode steps captured as CUDA graphs.
//!
//! It has never run on a GPU (none was lent to the project): the kernels' tests run against
//! their CPU twins where a GPU answers, and the build and NVRTC compiles are tested everywhere.

pub mod blas;
pub mod device;
pub mod kernels;
pub mod kv;
pub mod libraries;
pub mod nvrtc;
mod probe;
pub mod runner;
pub mod weights;

pub use probe::probe;

#[cfg(test)]
mod gpu_tests;
#[cfg(test)]
mod test_support;
