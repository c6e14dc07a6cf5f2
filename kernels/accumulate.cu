// acc += x elementwise: an fp32 accumulator and an f32, f16 or bf16 addend (widened exactly),
// one rounded add per element, so the result is bitwise the CPU twin's (src/ops/accumulate.rs).
// Operands: accumulate_<x>(x, acc, AccumulateParams).
#include "common.cuh"

#include "accumulate.cuh"

template <typename T>
__device__ __forceinline__ void accumulate(const T* __restrict__ x, float* __restrict__ acc,
                                           unsigned long long n) {
    GRID_STRIDE(i, n) { acc[i] = __fadd_rn(acc[i], to_f32(x[i])); }
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
