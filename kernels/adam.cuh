// Parameters of the Adam kernels (kernels/adam.cu); mirrored by `AdamScalars` and `AdamParams`
// in src/ops/adam/mod.rs (a test compares sizes and offsets on both sides).
#pragma once

// What one step needs per element (src/optim/adam.rs has the arithmetic).
struct AdamScalars {
    float grad_scale;       // multiplies every gradient
    float l2;               // L2 weight decay (0 for AdamW)
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float inv_sqrt_bc2;     // 1 / sqrt(1 - beta2^t)
    float eps;
    float decoupled;        // lr * wd for AdamW
    float step_size;        // lr / (1 - beta1^t)
};

struct AdamParams {
    unsigned long long n;  // elements
    AdamScalars s;
};
