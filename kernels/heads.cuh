// Parameters of the attention layout kernels (kernels/heads.cu); mirrored by `HeadsParams` in
// src/ops/heads.rs.
#pragma once

struct HeadsParams {
    unsigned long long batch;     // B
    unsigned long long seq;       // T
    unsigned long long heads;     // H
    unsigned long long head_dim;  // D; channels C = H·D
};
