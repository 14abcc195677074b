// Rotary position embeddings, HF "rotate_half" (non-interleaved) convention, from the cos/sin
// table precomputed at load (CPU twin: RopeTable::apply in rust/model/kernels/cpu/rope.rs).
// Element i of each head pairs with element i + half:
//   a' = a*cos - b*sin,  b' = b*cos + a*sin.
// The products and the sum are rounded separately (no FMA contraction), as the CPU does, so the
// result is bit-for-bit the CPU's.
#include "strata_common.cuh"

// x: [rows, n_heads, 2*half], rotated in place; cos_table, sin_table: [max_positions, half];
// positions: [rows]. A position past the table writes NaN (the caller checks positions).
// Grid: rows blocks.
extern "C" __global__ void rope_f32(float* x, const float* cos_table, const float* sin_table,
                                    const u32* positions, u32 rows, u32 n_heads, u32 half,
                                    u32 max_positions) {
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    const u32 pos = positions[row];
    float* xr = x + (u64)row * n_heads * 2 * half;
    for (u32 e = threadIdx.x; e < n_heads * half; e += blockDim.x) {
        const u32 head = e / half, i = e % half;
        float* a = xr + (u64)head * 2 * half + i;
        float* b = a + half;
        if (pos >= max_positions) {
            *a = quiet_nan();
            *b = quiet_nan();
            continue;
        }
        const float c = cos_table[(u64)pos * half + i], s = sin_table[(u64)pos * half + i];
        const float u = *a, v = *b;
        *a = __fsub_rn(__fmul_rn(u, c), __fmul_rn(v, s));
        *b = __fadd_rn(__fmul_rn(v, c), __fmul_rn(u, s));
    }
}
