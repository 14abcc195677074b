// Residual add: x += y, in f32 (CPU twin: add_in_place in rust/model/forward.rs). Exact.
#include "strata_common.cuh"

// x, y: [n]. Grid-stride loop: any grid size covers n.
extern "C" __global__ void add_inplace_f32(float* x, const float* y, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        x[i] += y[i];
}
