// Parameters of the LayerNorm kernels (kernels/layernorm.cu); mirrored by `LayerNormParams` and
// `LayerNormBackwardParams` in src/ops/layernorm.rs.
#pragma once

struct LayerNormParams {
    unsigned long long rows;  // N
    unsigned long long cols;  // C
    float eps;                // added to the variance
    unsigned int pad;
};

struct LayerNormBackwardParams {
    unsigned long long rows;        // N
    unsigned long long cols;        // C
    unsigned long long chunk_rows;  // rows per chunk of the dγ/dβ column sums
    unsigned long long chunks;      // ⌈rows / chunk_rows⌉
    unsigned int accumulate;        // 1: dx += the gradient; 0: dx = the gradient
    unsigned int pad;
};
