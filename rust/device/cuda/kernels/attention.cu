// Grouped-query attention over the paged K/V cache, for decode rows and prefill rows alike (CPU
// twin: paged_attention in rust/model/kernels/cpu/attention.rs; layouts, offsets and
// block_stride as in kv_write.cu).
//
// out[t, h] = softmax over visible keys j of (q[t, h] . k[j, g]) * scale, applied to v[j, g],
// with g = h / (n_heads / kv_heads). Visible: j <= pos (causal by absolute position) and, with a
// sliding window w > 0, pos - j < w.
//
// One block per (row, query head), ATTN_WARPS warps. Keys are taken in tiles of 32 aligned by
// absolute position, tile i to warp i % ATTN_WARPS: a lane scores one key, reading its K down
// the transposed block (lanes of one block read consecutive addresses), then the warp updates
// its online-softmax state (running max, sum, and the output accumulator, lanes over head_dim)
// with the tile. The warps' states are merged at the end. All arithmetic is f32; expf, not a
// fast exp. The results equal the CPU's up to f32 rounding (summation order differs).
#include "strata_common.cuh"

#define ATTN_MAX_HEAD_DIM 256
#define ATTN_WARPS 4
#define ATTN_TILE 32
#define ATTN_ACC_PER_LANE (ATTN_MAX_HEAD_DIM / 32)

// rows: [n_rows, 3] u32 (pos, table_start, table_len), the CPU's AttnRow; tables: the block
// tables of all rows, concatenated (tables_len entries); q, out: [n_rows, n_heads, head_dim].
// Grid: (n_rows, n_heads) blocks of ATTN_WARPS * 32 threads. A row whose geometry is invalid
// (head_dim past ATTN_MAX_HEAD_DIM, a position past its block table, a table past `tables`, a
// block id past the cache) gets NaN: the kernel never reads out of bounds, and the caller's bug
// stays visible.
template <typename Load>
__device__ __forceinline__ void attend(const float* q, const u32* rows, const u32* tables,
                                       u32 tables_len, Load cache, u64 k_offset, u64 v_offset,
                                       u64 block_stride, float* out, u32 n_rows, u32 n_heads,
                                       u32 kv_heads, u32 head_dim, u32 block_size, u32 num_blocks,
                                       float scale, u32 window) {
    const u32 t = blockIdx.x, h = blockIdx.y;
    if (t >= n_rows || h >= n_heads) return;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = h / (n_heads / kv_heads);
    const u32 pos = rows[3 * t], table_start = rows[3 * t + 1], table_len = rows[3 * t + 2];
    float* out_h = out + ((u64)t * n_heads + h) * head_dim;

    if (head_dim > ATTN_MAX_HEAD_DIM || pos / block_size >= table_len ||
        (u64)table_start + table_len > tables_len) {
        for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) out_h[d] = quiet_nan();
        return;
    }

    __shared__ float q_s[ATTN_MAX_HEAD_DIM];
    __shared__ float max_s[ATTN_WARPS], sum_s[ATTN_WARPS];
    __shared__ float acc_s[ATTN_WARPS][ATTN_MAX_HEAD_DIM];
    __shared__ int bad_block_s;
    const float* q_h = q + ((u64)t * n_heads + h) * head_dim;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = q_h[d];
    if (threadIdx.x == 0) bad_block_s = 0;
    __syncthreads();

    const u32 lo = (window > 0 && pos + 1 > window) ? pos + 1 - window : 0;
    const u32* table = tables + table_start;
    float run_max = neg_inf(), run_sum = 0.0f;
    float acc[ATTN_ACC_PER_LANE];
#pragma unroll
    for (int i = 0; i < ATTN_ACC_PER_LANE; ++i) acc[i] = 0.0f;
    bool bad_block = false;

    // The loop bounds depend on the warp only: every lane runs every iteration, so the
    // full-warp shuffles and ballots below are well defined.
    for (u32 tile = lo / ATTN_TILE + warp; tile <= pos / ATTN_TILE; tile += ATTN_WARPS) {
        const u32 j = tile * ATTN_TILE + lane;
        bool visible = j >= lo && j <= pos;
        float score = neg_inf();
        u64 v_base = 0;
        if (visible) {
            const u32 block = table[j / block_size];
            if (block >= num_blocks) {
                bad_block = true;
                visible = false;
            } else {
                const u64 r = j % block_size;
                const u64 k_base =
                    k_offset + (u64)block * block_stride + (u64)g * head_dim * block_size + r;
                v_base = v_offset + (u64)block * block_stride + (r * kv_heads + g) * head_dim;
                float dot = 0.0f;
                for (u32 d = 0; d < head_dim; ++d)
                    dot = fmaf(q_s[d], cache(k_base + (u64)d * block_size), dot);
                score = dot * scale;
            }
        }
        u32 pending = __ballot_sync(FULL_WARP, visible);
        if (pending == 0) continue;
        const float new_max = fmaxf(run_max, warp_max(score));
        const float p = visible ? expf(score - new_max) : 0.0f;
        // exp(-inf) = 0: the first tile scales the empty state by 0.
        const float rescale = expf(run_max - new_max);
        run_sum = run_sum * rescale + warp_sum(p);
#pragma unroll
        for (int i = 0; i < ATTN_ACC_PER_LANE; ++i) acc[i] *= rescale;
        // Keys in order; each key's weight and V row are broadcast to the lanes, which own
        // elements d = lane + 32 i (consecutive addresses across the warp).
        while (pending != 0) {
            const int src = __ffs(pending) - 1;
            pending &= pending - 1;
            const float weight = __shfl_sync(FULL_WARP, p, src);
            const u64 v_row = __shfl_sync(FULL_WARP, v_base, src);
#pragma unroll
            for (int i = 0; i < ATTN_ACC_PER_LANE; ++i) {
                const u32 d = lane + 32 * i;
                if (d < head_dim) acc[i] = fmaf(weight, cache(v_row + d), acc[i]);
            }
        }
        run_max = new_max;
    }

    if (__any_sync(FULL_WARP, bad_block) && lane == 0) bad_block_s = 1;
    if (lane == 0) {
        max_s[warp] = run_max;
        sum_s[warp] = run_sum;
    }
#pragma unroll
    for (int i = 0; i < ATTN_ACC_PER_LANE; ++i) {
        const u32 d = lane + 32 * i;
        if (d < head_dim) acc_s[warp][d] = acc[i];
    }
    __syncthreads();

    // Merge the warps' states. Key pos is always visible, so the max is finite unless its
    // block was bad (then the row is NaN anyway). A warp that saw no key has max -inf and
    // contributes exp(-inf) = 0.
    float max_all = neg_inf();
    for (int w = 0; w < ATTN_WARPS; ++w) max_all = fmaxf(max_all, max_s[w]);
    float sum_all = 0.0f;
    for (int w = 0; w < ATTN_WARPS; ++w) sum_all += sum_s[w] * expf(max_s[w] - max_all);
    const bool bad = bad_block_s != 0;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) o += acc_s[w][d] * expf(max_s[w] - max_all);
        out_h[d] = bad ? quiet_nan() : o / sum_all;
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
    paged_attention_f32(const float* q, const u32* rows, const u32* tables, u32 tables_len,
                        const float* cache, u64 k_offset, u64 v_offset, u64 block_stride,
                        float* out, u32 n_rows, u32 n_heads, u32 kv_heads, u32 head_dim,
                        u32 block_size, u32 num_blocks, float scale, u32 window) {
    attend(q, rows, tables, tables_len, LoadF32{cache}, k_offset, v_offset, block_stride, out,
           n_rows, n_heads, kv_heads, head_dim, block_size, num_blocks, scale, window);
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
    paged_attention_f16(const float* q, const u32* rows, const u32* tables, u32 tables_len,
                        const unsigned short* cache, u64 k_offset, u64 v_offset, u64 block_stride,
                        float* out, u32 n_rows, u32 n_heads, u32 kv_heads, u32 head_dim,
                        u32 block_size, u32 num_blocks, float scale, u32 window) {
    attend(q, rows, tables, tables_len, LoadF16{cache}, k_offset, v_offset, block_stride, out,
           n_rows, n_heads, kv_heads, head_dim, block_size, num_blocks, scale, window);
}
