//! Matrix products through cuBLAS: `y = x · Wᵀ` for every projection of the model (CPU twin:
//! `linear` in `rust/model/kernels/cpu/matmul/mod.rs`).
//!
//! Rows are row-major on both sides, as the CPU keeps them: `x` is `[n, cols]` f32, `W` is
//! `[rows, cols]` in the weights' dtype, `y` is `[n, rows]` f32. cuBLAS is column-major, and a
//! row-major matrix is the column-major view of its transpose, so `y` (column-major
//! `[rows, n]`) = `Wᵀ` applied to `x`: `gemm(op_T, op_N, m = rows, n, k = cols, A = W, lda =
//! cols, B = x, ldb = cols, C = y, ldc = rows)`.
//!
//! A product's operands share a type in cuBLAS, so for f16/bf16 weights the activations are first
//! rounded to that type (the `cast` kernel, into `Scratch`); accumulation and output stay f32
//! (`CUBLAS_COMPUTE_32F`). f32 weights multiply f32 activations with f32 arithmetic (no TF32:
//! the default math mode does not use it for that compute type). So a GPU product differs from
//! the CPU's (f32 activations times widened weights) by the activations' rounding for half
//! weights, and by summation order only for f32 ones; `gpu_tests.rs` states each tolerance.
//!
//! libcublas is found as `libraries.rs` says (`STRATA_CUBLAS_PATH`, the loader, the virtual
//! environment's `nvidia-cublas` wheel); the handle is created under `catch_unwind`, as every
//! call into a library opened at run time is guarded elsewhere: a missing library or symbol is
//! an error, never a panic.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use cudarc::cublas::result as blas;
use cudarc::cublas::sys;
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use half::{bf16, f16};

use super::kernels::{CudaKernelError, CudaKernels};
use crate::model::weights::DType;

/// Bytes of the workspace cuBLAS gets (set once, so that a captured graph never makes cuBLAS
/// allocate): NVIDIA's recommendation for Hopper is 32 MiB.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// libcublas, found and opened on first use; the error says where it was looked for.
pub fn cublas_library() -> Result<&'static str, String> {
    static FOUND: OnceLock<Result<String, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            super::libraries::CUBLAS.find(
                |name| std::env::var_os(name),
                // SAFETY: only tries to open the library by cudarc's names.
                || unsafe { sys::is_culib_present() },
            )
        })
        .as_ref()
        .map(String::as_str)
        .map_err(Clone::clone)
}

/// A weight matrix on the device, `[rows, cols]` row-major, in its file's dtype.
pub struct DeviceMatrix {
    pub data: CudaSlice<u8>,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

impl DeviceMatrix {
    pub fn bytes(&self) -> usize {
        self.data.len()
    }
}

/// The device buffer the activations are rounded into before a product with half weights:
/// sized at load for the step's largest input (`max_tokens * max(cols)`).
pub struct Scratch {
    half: CudaSlice<u16>,
}

impl Scratch {
    pub fn new(stream: &Arc<CudaStream>, elems: usize) -> Result<Scratch, CudaKernelError> {
        let half =
            stream
                .alloc_zeros::<u16>(elems.max(1))
                .map_err(|source| CudaKernelError::Driver {
                    what: format!("allocating {elems} elements of matmul scratch"),
                    source,
                })?;
        Ok(Scratch { half })
    }

    pub fn bytes(&self) -> usize {
        self.half.len() * 2
    }
}

/// A cuBLAS handle bound to one stream, with its workspace.
pub struct Blas {
    handle: sys::cublasHandle_t,
    /// Kept alive for as long as cuBLAS may use it.
    _workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
}

// SAFETY: the handle is used only through &self methods that enqueue on `stream`, from the one
// thread that owns the engine's device state (a cuBLAS handle may move between threads; it must
// not be used by two at once, which `&mut`-free sharing across threads would need Sync for).
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // A failure here leaks the handle; the guard keeps a panic out of drop.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: the handle came from create_handle and is destroyed once.
            unsafe { blas::destroy_handle(self.handle) }
        }));
    }
}

fn blas_error(what: &str) -> impl FnOnce(blas::CublasError) -> CudaKernelError + '_ {
    move |e| CudaKernelError::Shape(format!("{what}: cuBLAS {e:?}"))
}

impl Blas {
    /// A handle on `stream` with a [`WORKSPACE_BYTES`] workspace.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Blas, CudaKernelError> {
        cublas_library().map_err(CudaKernelError::Shape)?;
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|source| CudaKernelError::Driver {
                what: "allocating the cuBLAS workspace".into(),
                source,
            })?;
        let created = catch_unwind(AssertUnwindSafe(
            || -> Result<sys::cublasHandle_t, CudaKernelError> {
                let handle = blas::create_handle().map_err(blas_error("cublasCreate"))?;
                let (ptr, _sync) = workspace.device_ptr(stream);
                // SAFETY: a live handle; the stream and the workspace outlive it (both are held
                // by the Blas that owns the handle).
                let set = unsafe {
                    blas::set_stream(handle, stream.cu_stream() as _)
                        .map_err(blas_error("cublasSetStream"))
                        .and_then(|()| {
                            sys::cublasSetWorkspace_v2(handle, ptr as *mut c_void, WORKSPACE_BYTES)
                                .result()
                                .map_err(blas_error("cublasSetWorkspace"))
                        })
                };
                if let Err(e) = set {
                    // SAFETY: created above, destroyed once.
                    let _ = unsafe { blas::destroy_handle(handle) };
                    return Err(e);
                }
                Ok(handle)
            },
        ))
        .unwrap_or_else(|_| {
            Err(CudaKernelError::Shape(
                "libcublas is incomplete (a cuBLAS call panicked)".into(),
            ))
        })?;
        Ok(Blas {
            handle: created,
            _workspace: workspace,
            stream: stream.clone(),
        })
    }

    pub fn workspace_bytes(&self) -> usize {
        WORKSPACE_BYTES
    }

    /// `y = x · wᵀ` for `n` rows of `x` (`[n, w.cols]` f32) into `y` (`[n, w.rows]` f32). Half
    /// weights round `x` into `scratch` first.
    pub fn linear(
        &self,
        kernels: &CudaKernels,
        x: &CudaView<f32>,
        n: usize,
        w: &DeviceMatrix,
        scratch: &mut Scratch,
        y: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaKernelError> {
        self.linear_group(kernels, x, n, &mut [(w, y)], scratch)
    }

    /// `y_i = x · w_iᵀ` for each `(w_i, y_i)`: the products of one input (q/k/v, gate/up), as
    /// [`Blas::linear`] each, with `x` rounded for half weights once for all of them (the
    /// weights of a group share their dtype and `cols`).
    pub fn linear_group(
        &self,
        kernels: &CudaKernels,
        x: &CudaView<f32>,
        n: usize,
        products: &mut [(&DeviceMatrix, &mut CudaViewMut<f32>)],
        scratch: &mut Scratch,
    ) -> Result<(), CudaKernelError> {
        let Some((first, _)) = products.first() else {
            return Ok(());
        };
        let (dtype, cols) = (first.dtype, first.cols);
        for (w, y) in products.iter() {
            let rows = w.rows;
            if w.dtype != dtype || w.cols != cols {
                return Err(CudaKernelError::Shape(format!(
                    "linear: a group's weights are [{rows}, {}] {}, not [_, {cols}] {}",
                    w.cols,
                    w.dtype.name(),
                    dtype.name()
                )));
            }
            if x.len() != n * cols || y.len() != n * rows {
                return Err(CudaKernelError::Shape(format!(
                    "linear: x {} and y {} are not {n} rows of {cols} and {rows}",
                    x.len(),
                    y.len()
                )));
            }
            if w.data.len() != rows * cols * w.dtype.size() {
                return Err(CudaKernelError::Shape(format!(
                    "linear: the weights hold {} bytes, not [{rows}, {cols}] {}",
                    w.data.len(),
                    w.dtype.name()
                )));
            }
        }
        if n == 0 {
            return Ok(());
        }
        let int = |what: &str, v: usize| {
            i32::try_from(v)
                .map_err(|_| CudaKernelError::Shape(format!("linear: {what} = {v} exceeds i32")))
        };
        let (nn, k) = (int("n", n)?, int("cols", cols)?);
        let stream = &self.stream;
        // cuBLAS runs in the calling thread's current context (the engine thread is not the one
        // that created the handle).
        stream
            .context()
            .bind_to_thread()
            .map_err(|source| CudaKernelError::Driver {
                what: "binding the context for cuBLAS".into(),
                source,
            })?;
        // Half weights: the activations rounded to their type first, into the scratch.
        let b_type = match dtype {
            DType::F32 => sys::cudaDataType::CUDA_R_32F,
            DType::Bf16 | DType::F16 => {
                if scratch.half.len() < x.len() {
                    return Err(CudaKernelError::Shape(format!(
                        "linear: {} elements of matmul scratch for an input of {}",
                        scratch.half.len(),
                        x.len()
                    )));
                }
                let mut dst = scratch.half.slice_mut(..x.len());
                let view = || CudaKernelError::Shape("linear: the scratch's typed view".into());
                if dtype == DType::Bf16 {
                    // SAFETY: bf16 and u16 have one size, and any bits are a bf16.
                    let mut typed =
                        unsafe { dst.transmute_mut::<bf16>(x.len()) }.ok_or_else(view)?;
                    kernels.cast(stream, x, &mut typed)?;
                    sys::cudaDataType::CUDA_R_16BF
                } else {
                    // SAFETY: as above, for f16.
                    let mut typed =
                        unsafe { dst.transmute_mut::<f16>(x.len()) }.ok_or_else(view)?;
                    kernels.cast(stream, x, &mut typed)?;
                    sys::cudaDataType::CUDA_R_16F
                }
            }
            DType::Quant(q) => return Err(quantized(q)),
        };
        let a_type = match dtype {
            DType::F32 => sys::cudaDataType::CUDA_R_32F,
            DType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            DType::F16 => sys::cudaDataType::CUDA_R_16F,
            DType::Quant(q) => return Err(quantized(q)),
        };
        // Event tracking is off on the engine's contexts (one compute stream orders everything),
        // so these pointers come with nothing to synchronize.
        let (x_ptr, _x) = x.device_ptr(stream);
        let (half_ptr, _h) = scratch.half.device_ptr(stream);
        let b_ptr = if dtype == DType::F32 { x_ptr } else { half_ptr };
        for (w, y) in products.iter_mut() {
            if w.rows == 0 {
                continue;
            }
            let m = int("rows", w.rows)?;
            let (a_ptr, _a) = w.data.device_ptr(stream);
            let (y_ptr, _y) = y.device_ptr_mut(stream);
            let (alpha, beta) = (1.0f32, 0.0f32);
            let run = || {
                // SAFETY: the pointers are live device buffers of the sizes checked above (A
                // holds m * k, B n * k, C n * m elements); alpha and beta are host f32s, as the
                // default pointer mode and the 32F compute type want; the handle is bound to
                // `stream`.
                unsafe {
                    blas::gemm_ex(
                        self.handle,
                        sys::cublasOperation_t::CUBLAS_OP_T,
                        sys::cublasOperation_t::CUBLAS_OP_N,
                        m,
                        nn,
                        k,
                        (&alpha as *const f32).cast(),
                        a_ptr as *const c_void,
                        a_type,
                        k,
                        b_ptr as *const c_void,
                        b_type,
                        k,
                        (&beta as *const f32).cast(),
                        y_ptr as *mut c_void,
                        sys::cudaDataType::CUDA_R_32F,
                        m,
                        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
            };
            match catch_unwind(AssertUnwindSafe(run)) {
                Ok(result) => result.map_err(blas_error("cublasGemmEx"))?,
                Err(_) => {
                    return Err(CudaKernelError::Shape(
                        "cublasGemmEx: libcublas is incomplete (a call panicked)".into(),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// The CUDA backend refuses quantized models at load; a quantized matrix here is a bug.
fn quantized(q: crate::model::kernels::cpu::quant::QuantType) -> CudaKernelError {
    CudaKernelError::Shape(format!("linear: {} weights on the CUDA backend", q.name()))
}
