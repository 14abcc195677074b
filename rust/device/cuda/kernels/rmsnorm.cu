// RMSNorm as in HF Llama: out = x * 1/sqrt(mean(x^2) + eps) * w, in f32 (CPU twin:
// rust/model/kernels/cpu/rmsnorm.rs). One block per row; the block's threads stride over it.
#include "strata_common.cuh"

__device__ __forceinline__ void rmsnorm_row(const float* x, const float* w, float* out, u32 d,
                                            float eps) {
    __shared__ float scratch[32];
    float sum_sq = 0.0f;
    for (u32 i = threadIdx.x; i < d; i += blockDim.x) sum_sq = fmaf(x[i], x[i], sum_sq);
    sum_sq = block_sum(sum_sq, scratch);
    const float inv = 1.0f / sqrtf(sum_sq / (float)d + eps);
    // Each element is read and written by the same thread after the sum, so out may be x.
    for (u32 i = threadIdx.x; i < d; i += blockDim.x) out[i] = x[i] * inv * w[i];
}

// x, out: [rows, d]; w: [d]. Grid: rows blocks.
extern "C" __global__ void rmsnorm_f32(const float* x, const float* w, float* out, u32 rows,
                                       u32 d, float eps) {
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    rmsnorm_row(x + (u64)row * d, w, out + (u64)row * d, d, eps);
}

// In place (Qwen3's per-head q/k norm: rows = tokens * heads, d = head_dim).
extern "C" __global__ void rmsnorm_inplace_f32(float* x, const float* w, u32 rows, u32 d,
                                               float eps) {
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    rmsnorm_row(x + (u64)row * d, w, x + (u64)row * d, d, eps);
}

// Gathered: out[r] = rmsnorm(x[index[r]]) * w, the final norm of the rows that want logits
// (CPU: `Model::logits`, which norms those rows into `picked`). index: [rows]; x: [x_rows, d];
// out: [rows, d]. An index past x_rows gives a NaN row.
extern "C" __global__ void rmsnorm_rows_f32(const float* x, const float* w, const u32* index,
                                            float* out, u32 rows, u32 x_rows, u32 d, float eps) {
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    float* o = out + (u64)row * d;
    const u32 src = index[row];
    if (src >= x_rows) {
        for (u32 i = threadIdx.x; i < d; i += blockDim.x) o[i] = quiet_nan();
        return;
    }
    rmsnorm_row(x + (u64)src * d, w, o, d, eps);
}
