// Parameters of the vocab-parallel kernels (kernels/vocab_parallel.cu); mirrored by
// `VocabEmbeddingParams`, `VocabEmbeddingBackwardParams` and `VocabCeParams` in
// src/ops/vocab_parallel/.
#pragma once

// Threads per block (one block per row) of the cross-entropy kernels: the reduction order
// depends on it (`VOCAB_CE_THREADS` on the Rust side).
#define VP_CE_THREADS 256

struct VocabEmbeddingParams {
    unsigned long long n;      // positions (tokens)
    unsigned long long c;      // channels
    unsigned long long rows;   // rows of the local table (V_r)
    unsigned long long start;  // the first token the local table holds
    unsigned long long vocab;  // the whole vocabulary (V)
};

struct VocabEmbeddingBackwardParams {
    unsigned long long n;         // positions (rows of dout)
    unsigned long long c;         // channels
    unsigned long long rows;      // rows of the local table gradient (V_r)
    unsigned long long distinct;  // distinct local rows of the plan (U)
    unsigned long long owned;     // positions the plan holds (M)
    unsigned accumulate;          // 1: dtable += sums; 0: dtable = sums, other rows 0
    unsigned pad;                 // zero
};

struct VocabCeParams {
    unsigned long long n;       // rows
    unsigned long long rows;    // local vocabulary columns of each row (V_r)
    unsigned long long stride;  // elements per row (>= rows; the rest is padding)
    unsigned long long start;   // the first token of the local columns
    unsigned long long vocab;   // the whole vocabulary (V)
    int ignore_index;           // rows with this target: nothing counted
    float grad_scale;           // factor of the gradient
};
