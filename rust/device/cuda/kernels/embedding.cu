// Token embedding gather: row `token` of the [vocab, hidden] table, widened to f32 (CPU twin:
// rust/model/kernels/cpu/embedding.rs). Widening is exact for every dtype.
#include "strata_common.cuh"

// tokens: [rows]; out: [rows, hidden]. A token past the vocabulary writes a NaN row (the caller
// checks tokens). Grid: rows blocks.
template <typename Load>
__device__ __forceinline__ void embed_rows(Load table, const u32* tokens, float* out, u32 rows,
                                           u32 hidden, u32 vocab) {
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    const u32 token = tokens[row];
    float* o = out + (u64)row * hidden;
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x)
        o[i] = token < vocab ? table((u64)token * hidden + i) : quiet_nan();
}

extern "C" __global__ void embedding_f32(const float* table, const u32* tokens, float* out,
                                         u32 rows, u32 hidden, u32 vocab) {
    embed_rows(LoadF32{table}, tokens, out, rows, hidden, vocab);
}

extern "C" __global__ void embedding_f16(const unsigned short* table, const u32* tokens,
                                         float* out, u32 rows, u32 hidden, u32 vocab) {
    embed_rows(LoadF16{table}, tokens, out, rows, hidden, vocab);
}

extern "C" __global__ void embedding_bf16(const unsigned short* table, const u32* tokens,
                                          float* out, u32 rows, u32 hidden, u32 vocab) {
    embed_rows(LoadBf16{table}, tokens, out, rows, hidden, vocab);
}
