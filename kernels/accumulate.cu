// acc += x elementwise: an fp32 accumulator and an f32, f16 or bf16 addend (widened exactly),
// one rounded add per element, so the result is bitwise the CPU twin's (src/ops/accumulate.rs).
// Operands: accumulate_<x>(x, acc, AccumulateParams).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "accumulate.cuh"

#define GRID_STRIDE(i, n) \
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; \
         i < (n); i += (unsigned long long)gridDim.x * blockDim.x)

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ void accumulate(const T* __restrict__ x, float* __restrict__ acc,
                                           unsigned long long n) {
    GRID_STRIDE(i, n) { acc[i] = __fadd_rn(acc[i], widen(x[i])); }
}

extern "C" __global__ void accumulate_f32(const float* x, float* acc, AccumulateParams p) {
    accumulate(x, acc, p.n);
}
extern "C" __global__ void accumulate_f16(const __half* x, float* acc, AccumulateParams p) {
    accumulate(x, acc, p.n);
}
extern "C" __global__ void accumulate_bf16(const __nv_bfloat16* x, float* acc,
                                           AccumulateParams p) {
    accumulate(x, acc, p.n);
}
