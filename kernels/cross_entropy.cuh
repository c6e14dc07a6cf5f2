// Parameters of the cross-entropy kernels (kernels/cross_entropy.cu); mirrored by
// `CrossEntropyParams` in src/ops/cross_entropy.rs.
#pragma once

// Threads per block (one block per row): the reduction order depends on it
// (`CROSS_ENTROPY_THREADS` on the Rust side).
#define CE_THREADS 256

struct CrossEntropyParams {
    unsigned long long n;   // rows
    unsigned long long v;   // vocabulary: the first v columns of each row
    unsigned long long vp;  // elements per row (vp >= v; the rest is padding)
    int ignore_index;       // rows with this target: loss 0, gradient 0
    float grad_scale;       // factor of the gradient
};
