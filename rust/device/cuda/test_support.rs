//! What the CUDA tests share: finding NVRTC and a GPU, or saying why a test did not run.
//!
//! Outside CI a machine without libnvrtc skips the NVRTC tests, and one without a GPU skips the
//! GPU tests, each with a line on stderr. CI must not skip silently: `scripts/test` installs
//! `nvidia-cuda-nvrtc`, points `STRATA_NVRTC_PATH` at it and sets `STRATA_REQUIRE_NVRTC=1`, which
//! turns a missing NVRTC into a failure; `STRATA_REQUIRE_GPU=1` does the same for the GPU (set
//! it on a machine that has one).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaStream};

use super::kernels::CudaKernels;
use super::nvrtc::{nvrtc, KernelCache, NvrtcLibrary};

fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

/// libnvrtc, or `None` after printing why the test is skipped (a panic under
/// `STRATA_REQUIRE_NVRTC=1`).
pub fn nvrtc_or_skip(test: &str) -> Option<&'static NvrtcLibrary> {
    match nvrtc() {
        Ok(lib) => Some(lib),
        Err(e) if required("STRATA_REQUIRE_NVRTC") => {
            panic!("{test}: STRATA_REQUIRE_NVRTC=1, but {e}")
        }
        Err(e) => {
            eprintln!("skipping {test}: {e}");
            None
        }
    }
}

/// GPU 0's context and stream, and every kernel loaded into it.
pub struct Gpu {
    pub stream: Arc<CudaStream>,
    pub kernels: CudaKernels,
}

/// GPU 0 with the kernels loaded, or `None` after printing why the test is skipped (a panic
/// under `STRATA_REQUIRE_GPU=1`). The kernels compile once, into a cache in the temp folder.
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    let found = match super::probe() {
        Ok(found) if !found.is_empty() => found,
        Ok(_) | Err(_) if required("STRATA_REQUIRE_GPU") => {
            panic!(
                "{test}: STRATA_REQUIRE_GPU=1, but no GPU: {:?}",
                super::probe()
            )
        }
        Ok(_) => {
            eprintln!("skipping {test}: the CUDA driver sees no GPU");
            return None;
        }
        Err(why) => {
            eprintln!("skipping {test}: no GPU ({why})");
            return None;
        }
    };
    nvrtc_or_skip(test)?;
    static CACHE: OnceLock<KernelCache> = OnceLock::new();
    // Keyed by source and NVRTC version like any kernel cache, so test runs can share it.
    let cache =
        CACHE.get_or_init(|| KernelCache::at(std::env::temp_dir().join("strata-rs-test-kernels")));
    let ctx =
        CudaContext::new(0).unwrap_or_else(|e| panic!("{test}: a context on {found:?}: {e:?}"));
    let kernels = CudaKernels::load(&ctx, cache)
        .unwrap_or_else(|e| panic!("{test}: loading the kernels: {e}"));
    Some(Gpu {
        stream: ctx.default_stream(),
        kernels,
    })
}
