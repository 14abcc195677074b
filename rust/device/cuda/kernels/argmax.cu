// Greedy decoding's argmax over each row of logits, on the device, so that a greedy step copies
// one u32 per row back instead of the whole vocabulary. Semantics as the CPU sampler's argmax
// (rust/engine/sampler.rs): the first index of the largest value; NaN never wins; a row with
// nothing above -inf gives 0.
#include "strata_common.cuh"

// Keeps the better of two candidates: a larger value, or an equal value at a lower index.
__device__ __forceinline__ void keep_better(float& value, u32& index, float other_value,
                                            u32 other_index) {
    if (other_value > value || (other_value == value && other_index < index)) {
        value = other_value;
        index = other_index;
    }
}

// logits: [rows, vocab]; out: [rows]. Grid: rows blocks; blockDim.x a multiple of 32.
extern "C" __global__ void argmax_f32(const float* logits, u32* out, u32 rows, u32 vocab) {
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    const float* x = logits + (u64)row * vocab;
    // Each thread scans its indices in increasing order, so a strict > keeps the first maximum.
    float best = neg_inf();
    u32 best_index = 0;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (x[i] > best) {
            best = x[i];
            best_index = i;
        }
    }
    // An all -inf (or NaN) thread keeps index 0: it ties with every other such thread at -inf,
    // and the lowest index, 0, wins, as on the CPU.
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(FULL_WARP, best, offset);
        const u32 other_index = __shfl_xor_sync(FULL_WARP, best_index, offset);
        keep_better(best, best_index, other, other_index);
    }
    __shared__ float warp_best[32];
    __shared__ u32 warp_index[32];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) {
        warp_best[warp] = best;
        warp_index[warp] = best_index;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < warps ? warp_best[lane] : neg_inf();
        best_index = lane < warps ? warp_index[lane] : 0;
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(FULL_WARP, best, offset);
            const u32 other_index = __shfl_xor_sync(FULL_WARP, best_index, offset);
            keep_better(best, best_index, other, other_index);
        }
        if (lane == 0) out[row] = best_index;
    }
}
