// What the row-wise kernels share (layernorm.cu, bias.cu): the warp reduction of a kernel that
// gives one warp to a row, mirrored by `lane_sums` and `butterfly` in src/ops/rows.rs. Column
// sums run in fixed row chunks (`column_chunks` there; the chunk size comes in the parameters).
#pragma once

#define ROWS_FULL_MASK 0xffffffffu

// Every lane of a full warp ends with the sum of the 32 lanes' `v`, added in the butterfly
// order (xor 16, 8, 4, 2, 1), correctly rounded at each step.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v = __fadd_rn(v, __shfl_xor_sync(ROWS_FULL_MASK, v, o));
    }
    return v;
}
