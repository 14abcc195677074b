// SwiGLU: gate = silu(gate) * up, silu(g) = g / (1 + exp(-g)) (CPU twin:
// rust/model/kernels/cpu/swiglu.rs, which uses a polynomial exp; this one uses expf).
#include "strata_common.cuh"

// gate, up: [n]. Grid-stride loop: any grid size covers n.
extern "C" __global__ void silu_mul_f32(float* gate, const float* up, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}
