// Parameters of the causal softmax kernels (kernels/softmax.cu); mirrored by `SoftmaxParams` in
// src/ops/softmax.rs.
#pragma once

struct SoftmaxParams {
    unsigned long long bh;  // matrices (batch · heads)
    unsigned long long t;   // rows and columns of each matrix
    float scale;            // applied to the scores before the softmax, to dx after it
    unsigned int pad;
};
