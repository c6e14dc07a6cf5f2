// Element-type conversions between fp32, fp16 and bf16, round-to-nearest-even.
// CPU twin and descriptor: src/ops/cast.rs. Operands: src, dst; then CastParams (cast.cuh).
// Grid-stride loops: any grid size covers any n.
#include "common.cuh"

#include "cast.cuh"

extern "C" __global__ void cast_f32_f16(const float* __restrict__ src, __half* __restrict__ dst,
                                        CastParams p) {
    GRID_STRIDE(i, p.n) { dst[i] = __float2half_rn(src[i]); }
}

extern "C" __global__ void cast_f16_f32(const __half* __restrict__ src, float* __restrict__ dst,
                                        CastParams p) {
    GRID_STRIDE(i, p.n) { dst[i] = __half2float(src[i]); }
}

extern "C" __global__ void cast_f32_bf16(const float* __restrict__ src,
                                         __nv_bfloat16* __restrict__ dst, CastParams p) {
    GRID_STRIDE(i, p.n) { dst[i] = __float2bfloat16_rn(src[i]); }
}

extern "C" __global__ void cast_bf16_f32(const __nv_bfloat16* __restrict__ src,
                                         float* __restrict__ dst, CastParams p) {
    GRID_STRIDE(i, p.n) { dst[i] = __bfloat162float(src[i]); }
}

extern "C" __global__ void cast_f16_bf16(const __half* __restrict__ src,
                                         __nv_bfloat16* __restrict__ dst, CastParams p) {
    GRID_STRIDE(i, p.n) { dst[i] = __float2bfloat16_rn(__half2float(src[i])); }
}

extern "C" __global__ void cast_bf16_f16(const __nv_bfloat16* __restrict__ src,
                                         __half* __restrict__ dst, CastParams p) {
    GRID_STRIDE(i, p.n) { dst[i] = __float2half_rn(__bfloat162float(src[i])); }
}
