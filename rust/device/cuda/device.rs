//! One GPU as the engine uses it: its context, its compute stream, the kernels, a cuBLAS handle,
//! and its memory pool (the cache tiers' copy stream belongs to its K/V part, `kv.rs`).
//!
//! **Streams and ordering.** Every kernel, product and step-buffer upload of a step goes on the
//! compute stream, in order, so nothing within a step needs an event. cudarc's per-buffer event
//! tracking is turned off on the context (it would record an event per buffer access, and those
//! recordings would also land in captured graphs); the one place two streams meet is a tier move
//! on the K/V part's copy stream, ordered after compute with an explicit event and waited for
//! before the move returns.
//!
//! **Memory.** The pool's capacity is the free memory `cuMemGetInfo` reports once the context
//! exists, minus `vram_reserve_mib`: what other processes and the driver hold is never counted as
//! ours, and the reserve stays free for what the pool does not see (the driver's own allocations
//! for graphs and streams, fragmentation).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::blas::Blas;
use super::kernels::CudaKernels;
use super::nvrtc::KernelCache;
use crate::device::memory_pool::{MemoryPool, Purpose, Reservation};
use crate::error::{Result, StrataError};

pub struct CudaDevice {
    /// "cuda:0": the name in messages, stats and metrics.
    pub name: String,
    pub ctx: Arc<CudaContext>,
    /// Where every step's work runs, in order.
    pub stream: Arc<CudaStream>,
    pub kernels: CudaKernels,
    pub blas: Blas,
    pub memory: MemoryPool,
    /// Free and total device memory when the pool was sized (`cuMemGetInfo`, bytes).
    pub free_at_open: usize,
    pub total: usize,
    /// cuBLAS's workspace, accounted as workspace.
    _blas_workspace: Reservation,
}

/// A failure to use the device at all: the engine cannot load on it.
fn unavailable(name: &str, what: &str, why: impl std::fmt::Display) -> StrataError {
    StrataError::DeviceUnavailable(format!("device {name}: {what}: {why}"))
}

impl CudaDevice {
    /// Opens GPU `index` with a pool of its free memory minus `reserve` bytes (at least 0), at
    /// most `cap` bytes when given, the kernels compiled for it (or read from `cache`), and
    /// cuBLAS. A failure is DeviceUnavailable naming the device and the step; a panic in a
    /// library opened at run time is one too.
    pub fn open(
        index: usize,
        reserve: u64,
        cap: Option<u64>,
        cache: &KernelCache,
    ) -> Result<CudaDevice> {
        let name = format!("cuda:{index}");
        catch_unwind(AssertUnwindSafe(|| {
            Self::open_unguarded(&name, index, reserve, cap, cache)
        }))
        .unwrap_or_else(|_| {
            Err(unavailable(
                &name,
                "opening it",
                "a CUDA library call panicked (an incomplete driver or library)",
            ))
        })
    }

    fn open_unguarded(
        name: &str,
        index: usize,
        reserve: u64,
        cap: Option<u64>,
        cache: &KernelCache,
    ) -> Result<CudaDevice> {
        let ctx = CudaContext::new(index)
            .map_err(|e| unavailable(name, "creating a context", format!("{e:?}")))?;
        // SAFETY: called before any buffer or stream of this context exists; from here on the
        // engine orders its streams itself (module docs).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| unavailable(name, "creating the compute stream", format!("{e:?}")))?;
        let (free, total) = ctx
            .mem_get_info()
            .map_err(|e| unavailable(name, "reading its free memory", format!("{e:?}")))?;
        let capacity = (free as u64).saturating_sub(reserve);
        let memory = MemoryPool::new(name, Some(cap.map_or(capacity, |c| c.min(capacity))));
        let kernels = CudaKernels::load(&ctx, cache)
            .map_err(|e| unavailable(name, "loading the kernels", e))?;
        let blas_workspace = memory
            .reserve(Purpose::Workspace, super::blas::WORKSPACE_BYTES as u64)
            .map_err(|r| StrataError::invalid("vram_reserve_mib", r.to_string()))?;
        let blas = Blas::new(&stream).map_err(|e| unavailable(name, "starting cuBLAS", e))?;
        Ok(CudaDevice {
            name: name.to_string(),
            ctx,
            stream,
            kernels,
            blas,
            memory,
            free_at_open: free,
            total,
            _blas_workspace: blas_workspace,
        })
    }

    /// Free and total device memory now (`cuMemGetInfo`).
    pub fn memory_info(&self) -> std::result::Result<(usize, usize), String> {
        self.ctx.mem_get_info().map_err(|e| format!("{e:?}"))
    }
}
