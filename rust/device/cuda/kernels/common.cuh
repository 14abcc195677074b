// What every kernel shares. NVRTC receives this file as an in-memory header named
// "strata_common.cuh" (rust/device/cuda/kernels.rs), so no CUDA toolkit header is needed at run
// time: f16 conversions are single PTX instructions instead of cuda_fp16.h.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_WARP 0xffffffffu

// A quiet NaN: what a kernel writes where its input was out of range (a token past the
// vocabulary, a position past the RoPE table, a block id past the cache), so that the caller's
// bug shows in the output instead of as an out-of-bounds read.
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// -inf without math.h's INFINITY (not defined without the toolkit's headers).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// IEEE half (stored as its 16 bits) to f32: exact.
__device__ __forceinline__ float f16_to_f32(unsigned short bits) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
}

// f32 to IEEE half, rounded to nearest even (overflow gives +-inf), as half::f16::from_f32 on the
// CPU.
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(f));
    return bits;
}

// f32 to bfloat16, rounded to nearest even (overflow gives +-inf, NaN stays NaN), as
// half::bf16::from_f32 on the CPU. sm_80 and later have the instruction.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned short bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(f));
    return bits;
}

// bfloat16 is the top half of an f32: widening is a shift, exact.
__device__ __forceinline__ float bf16_to_f32(unsigned short bits) {
    return __uint_as_float(((u32)bits) << 16);
}

// Element loaders, so one template body serves every storage dtype.
struct LoadF32 {
    const float* p;
    __device__ __forceinline__ float operator()(u64 i) const { return p[i]; }
};
struct LoadF16 {
    const unsigned short* p;
    __device__ __forceinline__ float operator()(u64 i) const { return f16_to_f32(p[i]); }
};
struct LoadBf16 {
    const unsigned short* p;
    __device__ __forceinline__ float operator()(u64 i) const { return bf16_to_f32(p[i]); }
};

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_WARP, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1)
        v = fmaxf(v, __shfl_xor_sync(FULL_WARP, v, offset));
    return v;
}

// The sum of `v` over the block, returned to every thread. blockDim.x must be a multiple of 32
// (full-warp shuffles); `scratch` is 32 floats of shared memory, not used by the caller until
// every thread has returned from here.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < warps ? scratch[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) scratch[0] = t;
    }
    __syncthreads();
    return scratch[0];
}
