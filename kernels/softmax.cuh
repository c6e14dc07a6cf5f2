// Parameters of the causal softmax kernels (kernels/softmax.cu); mirrored by `SoftmaxParams` in
// src/ops/softmax.rs.
#pragma once

struct SoftmaxParams {
    unsigned long long bh;      // matrices (batch · heads)
    unsigned long long rows;    // rows of each matrix (query positions of the block)
    unsigned long long cols;    // columns of each matrix (key positions)
    unsigned long long offset;  // global position of row 0: row i sees columns j ≤ offset + i
    float scale;                // applied to the scores before the softmax, to dx after it
    unsigned int pad;
};
