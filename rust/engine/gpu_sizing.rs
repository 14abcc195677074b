//! What the engine asks of its GPUs at load: opening them, and how many K/V blocks fit beside the
//! weights, the step buffers and the graph budget (feature "cuda").

use crate::device::cuda::device::CudaDevice;
use crate::device::cuda::nvrtc::KernelCache;
use crate::device::cuda::runner::{workspace_bytes, StepLimits};
use crate::device::graphs::{padded_sizes, GraphCacheLimits};
use crate::device::split;
use crate::error::{Result, StrataError};
use crate::model::Model;

use super::{EngineOptions, BLOCK_SIZE};

/// Device bytes the captured decode graphs may hold on a GPU.
pub const GRAPH_BUDGET_BYTES: u64 = 256 << 20;

/// Opens each GPU of the list with a pool of its free memory minus `vram_reserve_mib`, capped by
/// `device_memory_mib` where that was given. The kernels compile into the user's kernel cache.
pub fn open_gpus(
    ids: &[usize],
    capacities: &[Option<u64>],
    vram_reserve_mib: usize,
) -> Result<Vec<CudaDevice>> {
    let cache = KernelCache::user_default();
    let reserve = (vram_reserve_mib as u64) << 20;
    ids.iter()
        .zip(capacities)
        .map(|(&id, &cap)| CudaDevice::open(id, reserve, cap, &cache))
        .collect()
}

/// The step buffers' sizes for these options (before `max_batch_tokens` and `max_batch` are cut
/// to the context, which only makes them smaller).
pub fn limits(opts: &EngineOptions, max_context: usize) -> StepLimits {
    StepLimits {
        max_tokens: opts.max_batch_tokens.min(max_context).max(1),
        max_seqs: opts.max_batch.max(1),
        max_context,
        block_size: BLOCK_SIZE,
    }
}

/// The graph cache's bounds: a graph per padded batch size within [`GRAPH_BUDGET_BYTES`], on a
/// single GPU (a split runs uncaptured); `STRATA_CUDA_GRAPHS=0` turns graphs off (for comparing
/// the two paths).
pub fn graph_limits(max_batch: usize, devices: usize) -> GraphCacheLimits {
    let off = devices != 1 || std::env::var("STRATA_CUDA_GRAPHS").is_ok_and(|v| v == "0");
    GraphCacheLimits {
        max_batch,
        max_graphs: if off {
            0
        } else {
            padded_sizes(max_batch).len()
        },
        max_bytes: GRAPH_BUDGET_BYTES,
    }
}

/// The K/V blocks the GPUs hold when `kv_memory_mib` is not given: on each device, what is left
/// of its pool after what is reserved already (cuBLAS's workspace), its layers' weights, its step
/// buffers and RoPE table, and (on a single GPU) the graph budget, over its part of a block; the
/// smallest over the devices, since the block table is shared.
pub fn kv_blocks(
    model: &Model,
    gpus: &[CudaDevice],
    layer_split: &[usize],
    part_bytes: &[usize],
    limits: StepLimits,
    max_context: usize,
) -> Result<usize> {
    let c = &model.config;
    let ranges = split::ranges(layer_split);
    let last = gpus.len().saturating_sub(1);
    let graphs = if gpus.len() == 1 {
        GRAPH_BUDGET_BYTES
    } else {
        0
    };
    let mut blocks = usize::MAX;
    for (d, gpu) in gpus.iter().enumerate() {
        let capacity = gpu.memory.capacity().unwrap_or(0);
        let weights = model.stage_weight_bytes(ranges[d].clone(), d == 0, d == last) as u64;
        let workspace = workspace_bytes(c, limits, d == last, model.dtype, max_context) as u64;
        let taken = gpu
            .memory
            .total_in_use()
            .saturating_add(weights)
            .saturating_add(workspace)
            .saturating_add(graphs);
        let left = capacity.saturating_sub(taken);
        let fit = (left / part_bytes[d].max(1) as u64) as usize;
        if fit == 0 {
            return Err(StrataError::invalid(
                "vram_reserve_mib",
                format!(
                    "device {} has {capacity} bytes for the engine ({} free at load, less the \
                     reserve); its weights ({weights}), step buffers ({workspace}) and graph \
                     budget ({graphs}) leave no room for one K/V block of {}",
                    gpu.name, gpu.free_at_open, part_bytes[d]
                ),
            ));
        }
        blocks = blocks.min(fit);
    }
    Ok(blocks)
}
