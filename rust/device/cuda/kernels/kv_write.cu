// Writes each row's K and V into its slot of the paged cache (CPU twin: BlockPool::write in
// rust/kv/blocks.rs). Layouts, per layer: K is [num_blocks, kv_heads, head_dim, block_size] (each
// block's keys transposed: element d of consecutive keys is contiguous, what attention reads), V
// is [num_blocks, block_size, kv_heads, head_dim]. An f16 cache rounds to nearest even, as
// half::f16::from_f32 does, so both twins store the same bits.
#include "strata_common.cuh"

// A slot that means "no row here" (a padded row of a captured decode step): nothing is written.
#define SLOT_SKIP 0xffffffffu

struct StoreF32 {
    float* p;
    __device__ __forceinline__ void operator()(u64 i, float x) const { p[i] = x; }
};
struct StoreF16 {
    unsigned short* p;
    __device__ __forceinline__ void operator()(u64 i, float x) const { p[i] = f32_to_f16(x); }
};

// k, v: [rows, kv_heads * head_dim]; slots: [rows] (block * block_size + row in block). A slot
// past the cache (block >= num_blocks) is not written: the kernel never writes out of bounds;
// the caller's slots come from the block pool. Grid: rows blocks.
template <typename Store>
__device__ __forceinline__ void write_rows(const float* k, const float* v, Store k_cache,
                                           Store v_cache, const u32* slots, u32 rows,
                                           u32 kv_heads, u32 head_dim, u32 block_size,
                                           u32 num_blocks) {
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    const u32 slot = slots[row];
    if (slot == SLOT_SKIP || slot / block_size >= num_blocks) return;
    const u32 width = kv_heads * head_dim;
    const u64 block = slot / block_size, r = slot % block_size;
    // Element e = g * head_dim + d of the row lands at k0 + e * block_size.
    const u64 k0 = block * width * block_size + r;
    const float* kr = k + (u64)row * width;
    const float* vr = v + (u64)row * width;
    for (u32 e = threadIdx.x; e < width; e += blockDim.x) {
        k_cache(k0 + (u64)e * block_size, kr[e]);
        v_cache((u64)slot * width + e, vr[e]);
    }
}

extern "C" __global__ void kv_write_f32(const float* k, const float* v, float* k_cache,
                                        float* v_cache, const u32* slots, u32 rows, u32 kv_heads,
                                        u32 head_dim, u32 block_size, u32 num_blocks) {
    write_rows(k, v, StoreF32{k_cache}, StoreF32{v_cache}, slots, rows, kv_heads, head_dim,
               block_size, num_blocks);
}

extern "C" __global__ void kv_write_f16(const float* k, const float* v, unsigned short* k_cache,
                                        unsigned short* v_cache, const u32* slots, u32 rows,
                                        u32 kv_heads, u32 head_dim, u32 block_size,
                                        u32 num_blocks) {
    write_rows(k, v, StoreF16{k_cache}, StoreF16{v_cache}, slots, rows, kv_heads, head_dim,
               block_size, num_blocks);
}
