// Parameters of the linear-layer bias kernels (kernels/bias.cu); mirrored by `BiasParams` and
// `BiasGradParams` in src/ops/bias.rs.
#pragma once

struct BiasParams {
    unsigned long long rows;  // N
    unsigned long long cols;  // C
    unsigned int accumulate;  // 1: y += b; 0: y = b
    unsigned int pad;
};

struct BiasGradParams {
    unsigned long long rows;        // N
    unsigned long long cols;        // C
    unsigned long long chunk_rows;  // rows per chunk of the column sums
    unsigned long long chunks;      // ⌈rows / chunk_rows⌉
    unsigned int accumulate;        // 1: db += Σ dy; 0: db = Σ dy
    unsigned int pad;
};
