// f32 activations to a half type, the input cuBLAS takes for half-precision weights (a matrix
// product's operands share a type; its accumulation and output stay f32). Rounded to nearest
// even, as half::f16::from_f32 and half::bf16::from_f32 do on the CPU (tested bit for bit).
// No CPU twin in the forward pass: the CPU multiplies f32 activations by widened weights.
#include "strata_common.cuh"

// x: [n] f32; out: [n] bf16 bits. Grid-stride loop: any grid size covers n.
extern "C" __global__ void cast_f32_to_bf16(const float* x, unsigned short* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(x[i]);
}

// x: [n] f32; out: [n] f16 bits.
extern "C" __global__ void cast_f32_to_f16(const float* x, unsigned short* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_f16(x[i]);
}
