// Bias add after a matrix product: y[r, c] += bias[c], in f32 (CPU twin: the bias term of
// `linear` in rust/model/kernels/cpu/matmul.rs, added after the product as here). Exact.
#include "strata_common.cuh"

// y: [rows, cols]; bias: [cols]. Grid-stride loop over rows * cols.
extern "C" __global__ void add_bias_f32(float* y, const float* bias, u64 n, u32 cols) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        y[i] += bias[i % cols];
}
