// What every kernel file shares: the grid-stride loop and exact conversions between the model
// floats and f32 (widening is exact; narrowing rounds to nearest even, as the CPU twins do).
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Grid-stride loop: any grid size covers any n.
#define GRID_STRIDE(i, n) \
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; \
         i < (n); i += (unsigned long long)gridDim.x * blockDim.x)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ void store_f32(float* p, unsigned long long i, float x) { p[i] = x; }
__device__ __forceinline__ void store_f32(__half* p, unsigned long long i, float x) {
    p[i] = __float2half_rn(x);
}
__device__ __forceinline__ void store_f32(__nv_bfloat16* p, unsigned long long i, float x) {
    p[i] = __float2bfloat16_rn(x);
}
