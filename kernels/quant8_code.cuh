// The nearest code of a value in the 8-bit dynamic maps (src/ops/adam/quant8.rs: `code` and
// `magnitude_code`, the same operations in the same order): comparisons, explicitly rounded
// products and a truncation, so the codes equal the CPU's.
#pragma once

#include "quant8.cuh"

// The magnitude code of `a` in [0, 1] (quant8.rs: `magnitude_code`).
__device__ __forceinline__ unsigned quant8_magnitude(const Quant8Consts& c, float a) {
    int d = 0;
    for (int k = 1; k < QUANT8_DECADES; ++k) {
        if (a >= QUANT8_EDGES[k]) d = k;
    }
    float t = __fmul_rn(__fsub_rn(__fmul_rn(a, c.up[d]), 0.1f), c.per[d]);
    t = fminf(fmaxf(t, 0.0f), (float)(c.count[d] - 1));
    const unsigned j = (unsigned)(int)t;
    unsigned mag = c.base[d] + j;
    if (j == 0 && !(a >= c.low[d])) mag -= 1;
    if (mag == c.top - 1 && a > c.high) mag = c.top;
    return mag;
}

__device__ __forceinline__ unsigned char quant8_signed(float x) {
    const unsigned mag = quant8_magnitude(QUANT8_SIGNED, fabsf(x));
    if (x < 0.0f) return (unsigned char)(127u - (mag < 127u ? mag : 127u));
    return (unsigned char)(127u + mag);
}

// (a positive value never rounds to 0: as a variance, the step would divide by eps alone)
__device__ __forceinline__ unsigned char quant8_unsigned(float x) {
    if (!(x > 0.0f)) return 0;
    const unsigned mag = quant8_magnitude(QUANT8_UNSIGNED, x);
    return (unsigned char)(mag < 1u ? 1u : mag);
}
