// Parameters of the sigmoid + binary cross-entropy kernels (kernels/bce.cu); mirrored by
// `BceParams` in src/ops/bce.rs.
#pragma once

struct BceParams {
    unsigned long long n;  // elements
    float scale;           // dlogits = (sigmoid(x) - y) * scale
    unsigned int pad;
};
