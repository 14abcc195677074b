// Writes each row's K and V into its slot of the paged cache (CPU twin: BlockPool::write in
// rust/kv/blocks.rs). Layouts, per layer and block: K is [kv_heads, head_dim, block_size] (the
// block's keys transposed: element d of consecutive keys is contiguous, what attention reads), V
// is [block_size, kv_heads, head_dim]. One buffer holds them: block b's K of this layer starts at
// cache + k_offset + b * block_stride, its V at cache + v_offset + b * block_stride. The CPU
// pool's layout (a layer's K array, then its V array) is k_offset 0, v_offset num_blocks * E,
// block_stride E (E = block_size * kv_heads * head_dim); the engine's device pool keeps a block's
// every layer together (block_stride = layers * 2E, k_offset = layer * 2E, v_offset = k_offset +
// E), so a block's bytes are contiguous. An f16 cache rounds to nearest even, as
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
__device__ __forceinline__ void write_rows(const float* k, const float* v, Store cache,
                                           u64 k_offset, u64 v_offset, u64 block_stride,
                                           const u32* slots, u32 rows, u32 kv_heads, u32 head_dim,
                                           u32 block_size, u32 num_blocks) {
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    const u32 slot = slots[row];
    if (slot == SLOT_SKIP || slot / block_size >= num_blocks) return;
    const u32 width = kv_heads * head_dim;
    const u64 block = slot / block_size, r = slot % block_size;
    // Element e = g * head_dim + d of the row lands at k0 + e * block_size.
    const u64 k0 = k_offset + block * block_stride + r;
    const u64 v0 = v_offset + block * block_stride + r * width;
    const float* kr = k + (u64)row * width;
    const float* vr = v + (u64)row * width;
    for (u32 e = threadIdx.x; e < width; e += blockDim.x) {
        cache(k0 + (u64)e * block_size, kr[e]);
        cache(v0 + e, vr[e]);
    }
}

extern "C" __global__ void kv_write_f32(const float* k, const float* v, float* cache,
                                        u64 k_offset, u64 v_offset, u64 block_stride,
                                        const u32* slots, u32 rows, u32 kv_heads, u32 head_dim,
                                        u32 block_size, u32 num_blocks) {
    write_rows(k, v, StoreF32{cache}, k_offset, v_offset, block_stride, slots, rows, kv_heads,
               head_dim, block_size, num_blocks);
}

extern "C" __global__ void kv_write_f16(const float* k, const float* v, unsigned short* cache,
                                        u64 k_offset, u64 v_offset, u64 block_stride,
                                        const u32* slots, u32 rows, u32 kv_heads, u32 head_dim,
                                        u32 block_size, u32 num_blocks) {
    write_rows(k, v, StoreF16{cache}, k_offset, v_offset, block_stride, slots, rows, kv_heads,
               head_dim, block_size, num_blocks);
}
