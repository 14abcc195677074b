//! CPU kernels, one file per kernel, each with its scalar reference and its tests.
//!
//! Every kernel works on f32 activations. Weight matrices are read in their stored dtype
//! (f32, f16, bf16 or a ggml block format) straight from the memory map: no f32 copy of the
//! weights exists.

pub mod attention;
pub mod embedding;
pub mod geglu;
pub mod isa;
pub mod kv_q8;
pub mod matmul;
pub mod matmul_bf16dot;
pub mod quant;
pub mod rmsnorm;
pub mod rope;
pub mod router;
pub mod swiglu;
#[cfg(test)]
pub(crate) mod test_rng;

use half::{bf16, f16};

/// Raw output pointer shared by the parallel tasks of one kernel call, each writing a disjoint
/// set of its elements (its own output rows).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: the kernels that share one hand each task a disjoint set of indices.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    // A method (not field access) so closures capture the whole Send wrapper.
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// The elements of a weight tensor, in the dtype they were stored in.
#[derive(Clone, Copy, Debug)]
pub enum WeightData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
    /// Rows of ggml blocks (`rows * ty.row_bytes(cols)` bytes), read by the `quant` kernels.
    Quant(quant::QuantType, &'a [u8]),
    /// The same blocks interleaved by groups of 16 rows ([`quant::interleave`]), made at load
    /// for the AVX-512 kernels.
    Interleaved(quant::QuantType, &'a [u8]),
}

/// A row-major `[rows, cols]` weight matrix in PyTorch `Linear` layout (out_features x in_features).
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub data: WeightData<'a>,
    pub rows: usize,
    pub cols: usize,
}
