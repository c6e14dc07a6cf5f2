// Parameters of the embedding kernels (kernels/embedding.cu); mirrored in
// src/ops/embedding/device.rs (a test compares sizes and offsets on both sides).
#pragma once

struct EmbBagParams {
    unsigned long long rows;    // table rows
    unsigned long long stride;  // floats per row
    unsigned long long dim;     // floats per embedding
    unsigned long long n;       // indices
    unsigned long long bags;
    int mean;                   // 1: mean, 0: sum
    int pad;
};

struct EmbBackwardParams {
    unsigned long long nrows;     // distinct rows (row_ptr holds nrows + 1 entries)
    unsigned long long dim;
    unsigned long long bags;      // rows of the output gradient
    unsigned long long nentries;
};

struct EmbStepParams {
    unsigned long long table_rows;
    unsigned long long stride;
    unsigned long long dim;
    unsigned long long n;  // rows stepped
    int kind;              // 0 SGD, 1 row-wise Adagrad, 2 Adam
    float lr;
    float eps;
    float beta1;
    float beta2;
    float bias1;
    float bias2;
    int pad;
};

struct EmbRowsParams {
    unsigned long long rows;   // rows of the table indexed (source of a gather, target of a scatter)
    unsigned long long words;  // 32-bit words per row
    unsigned long long n;      // indices
};
