// Parameters of the GEMM (src/ops/gemm/): mirrored by `GemmParams` there. The CUDA side is a
// cuBLAS call, so no kernel includes this header; the layout test checks it against Rust's.
#pragma once

struct GemmParams {
    unsigned long long m;         // rows of op(A) and C
    unsigned long long n;         // columns of op(B) and C
    unsigned long long k;         // columns of op(A), rows of op(B)
    unsigned long long batch;     // matrices in the batch
    unsigned long long lda;       // leading dimensions, row-major, in elements
    unsigned long long ldb;
    unsigned long long ldc;
    unsigned long long stride_a;  // elements from one batch's matrix to the next (0: shared)
    unsigned long long stride_b;
    unsigned long long stride_c;
    float alpha;                  // C = alpha·op(A)·op(B) + beta·C
    float beta;                   // 0: C is not read
    unsigned int flags;           // 1: A transposed, 2: B transposed, 4: TF32 allowed (f32)
    unsigned int pad;
};
