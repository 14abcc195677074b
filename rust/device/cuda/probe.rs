//! The CUDA driver probe, through cudarc with dynamic loading.
//!
//! cudarc panics when a driver symbol is called without the library present, so the library is
//! looked for first, and every driver call runs under `catch_unwind` as a second guard: a machine
//! without a driver must get a clear error, never a panic.

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use crate::device::CudaDeviceInfo;

/// The visible GPUs, or why there are none usable.
pub fn probe() -> Result<Vec<CudaDeviceInfo>, String> {
    // SAFETY: only tries to open the driver library by its known names.
    if !unsafe { sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so.1) was not found".into());
    }
    catch_unwind(AssertUnwindSafe(
        || -> Result<Vec<CudaDeviceInfo>, String> {
            cu::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
            let count =
                cu::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))?;
            let mut found = Vec::with_capacity(count.max(0) as usize);
            for index in 0..count {
                let dev =
                    cu::device::get(index).map_err(|e| format!("cuDeviceGet({index}): {e:?}"))?;
                let name =
                    cu::device::get_name(dev).map_err(|e| format!("cuDeviceGetName: {e:?}"))?;
                // SAFETY: `dev` came from cuDeviceGet above.
                let total_memory = unsafe { cu::device::total_mem(dev) }
                    .map_err(|e| format!("cuDeviceTotalMem: {e:?}"))?;
                found.push(CudaDeviceInfo {
                    index: index as usize,
                    name,
                    total_memory,
                });
            }
            Ok(found)
        },
    ))
    .unwrap_or_else(|_| {
        Err("the CUDA driver library is incomplete (a driver call panicked)".into())
    })
}
