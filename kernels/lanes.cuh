// Reductions of the row kernels (softmax.cu, cross_entropy.cu, layernorm.cu) in a fixed order,
// mirrored by src/ops/lanes.rs: a warp's 32 partials combine by the xor butterfly (every lane
// ends with the same value); a block adds its warps' totals in warp order from warp 0. Sums use
// __fadd_rn (never contracted); maxima are exact in any order (fmaxf ignores NaN, as the twins'
// f32::max does).
#pragma once

#define TM_FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(TM_FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(TM_FULL_MASK, v, o));
    return v;
}

// The sum over the block (blockDim.x a multiple of 32); `red` is shared memory of one float per
// warp. Every thread of the block calls it and gets the total.
__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = red[0];
    for (unsigned w = 1; w < (blockDim.x >> 5); ++w) total = __fadd_rn(total, red[w]);
    __syncthreads();  // `red` may be reused at once
    return total;
}

// The maximum over the block, as block_sum.
__device__ __forceinline__ float block_max(float v, float* red) {
    v = warp_max(v);
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = red[0];
    for (unsigned w = 1; w < (blockDim.x >> 5); ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    return m;
}
