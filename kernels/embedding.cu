// Embedding-bag kernels. CPU twins: src/ops/embedding/mod.rs; descriptors and wrappers:
// src/ops/embedding/device.rs. Each entry takes its op's operands in signature order (an absent
// optional operand is null), then its parameter struct (embedding.cuh).
//
// Tables are f32 rows of `stride` floats, the first `dim` the embedding, the rest the row's
// optimizer state. One block per bag / distinct row / moved row (grid-stride over them), threads
// over the `dim` columns. Every sum runs sequentially in the CPU twin's order with explicitly
// rounded operations (__fmul_rn, __fadd_rn, ...: never contracted into FMA), so results are
// bitwise those of the CPU. Index values out of range are skipped; offsets and row starts are
// clamped to their arrays, so malformed indices never read or write out of bounds.

#include "embedding.cuh"

typedef unsigned long long u64;

extern "C" __global__ void emb_bag(const float* table, const unsigned* idx, const unsigned* off,
                                   const float* weights, float* out, EmbBagParams p) {
    const u64 rows = p.rows, stride = p.stride, dim = p.dim, n = p.n, bags = p.bags;
    const int mean = p.mean;
    for (u64 b = blockIdx.x; b < bags; b += gridDim.x) {
        u64 e = off[b + 1] < n ? off[b + 1] : n;
        u64 s = off[b] < e ? off[b] : e;
        for (u64 k = threadIdx.x; k < dim; k += blockDim.x) {
            float acc = 0.0f;
            for (u64 i = s; i < e; ++i) {
                u64 r = idx[i];
                if (r >= rows) continue;
                float w = weights ? weights[i] : 1.0f;
                acc = __fadd_rn(acc, __fmul_rn(w, table[r * stride + k]));
            }
            if (mean && e > s) acc = __fdiv_rn(acc, (float)(e - s));
            out[b * dim + k] = acc;
        }
    }
}

extern "C" __global__ void emb_backward(const float* gout, const unsigned* row_ptr,
                                        const unsigned* entries, const float* scale,
                                        float* grads, EmbBackwardParams p) {
    const u64 nrows = p.nrows, dim = p.dim, bags = p.bags, nentries = p.nentries;
    for (u64 u = blockIdx.x; u < nrows; u += gridDim.x) {
        u64 e1 = row_ptr[u + 1] < nentries ? row_ptr[u + 1] : nentries;
        u64 e0 = row_ptr[u] < e1 ? row_ptr[u] : e1;
        for (u64 k = threadIdx.x; k < dim; k += blockDim.x) {
            float acc = 0.0f;
            for (u64 e = e0; e < e1; ++e) {
                u64 b = entries[e];
                if (b >= bags) continue;
                acc = __fadd_rn(acc, __fmul_rn(scale[e], gout[b * dim + k]));
            }
            grads[u * dim + k] = acc;
        }
    }
}

// kind: 0 SGD, 1 row-wise Adagrad, 2 Adam.
extern "C" __global__ void emb_step(float* table, const unsigned* rows, const float* grads,
                                    EmbStepParams p) {
    const u64 table_rows = p.table_rows, stride = p.stride, dim = p.dim, n = p.n;
    const int kind = p.kind;
    const float lr = p.lr, eps = p.eps, beta1 = p.beta1, beta2 = p.beta2, bias1 = p.bias1,
                bias2 = p.bias2;
    __shared__ float denom;
    for (u64 u = blockIdx.x; u < n; u += gridDim.x) {
        u64 r = rows[u];
        if (r >= table_rows) continue;  // the same for every thread of the block
        float* row = table + r * stride;
        const float* g = grads + u * dim;
        if (kind == 0) {
            for (u64 k = threadIdx.x; k < dim; k += blockDim.x)
                row[k] = __fsub_rn(row[k], __fmul_rn(lr, g[k]));
        } else if (kind == 1) {
            if (threadIdx.x == 0) {
                float sq = 0.0f;
                for (u64 k = 0; k < dim; ++k) sq = __fadd_rn(sq, __fmul_rn(g[k], g[k]));
                float s = __fadd_rn(row[dim], __fdiv_rn(sq, (float)dim));
                row[dim] = s;
                denom = __fadd_rn(__fsqrt_rn(s), eps);
            }
            __syncthreads();
            for (u64 k = threadIdx.x; k < dim; k += blockDim.x)
                row[k] = __fsub_rn(row[k], __fdiv_rn(__fmul_rn(lr, g[k]), denom));
            __syncthreads();
        } else {
            float* m = row + dim;
            float* v = row + 2 * dim;
            for (u64 k = threadIdx.x; k < dim; k += blockDim.x) {
                float gk = g[k];
                float mk = __fadd_rn(__fmul_rn(beta1, m[k]), __fmul_rn(__fsub_rn(1.0f, beta1), gk));
                float vk = __fadd_rn(__fmul_rn(beta2, v[k]),
                                     __fmul_rn(__fsub_rn(1.0f, beta2), __fmul_rn(gk, gk)));
                m[k] = mk;
                v[k] = vk;
                float mhat = __fdiv_rn(mk, bias1);
                float vhat = __fdiv_rn(vk, bias2);
                row[k] = __fsub_rn(row[k],
                                   __fdiv_rn(__fmul_rn(lr, mhat), __fadd_rn(__fsqrt_rn(vhat), eps)));
            }
        }
    }
}

// Row i of dst = row index[i] of src, rows of `words` 32-bit words.
extern "C" __global__ void emb_gather(const unsigned* src, const unsigned* index, unsigned* dst,
                                      EmbRowsParams p) {
    const u64 src_rows = p.rows, words = p.words, n = p.n;
    for (u64 i = blockIdx.x; i < n; i += gridDim.x) {
        u64 r = index[i];
        if (r >= src_rows) continue;
        for (u64 k = threadIdx.x; k < words; k += blockDim.x) dst[i * words + k] = src[r * words + k];
    }
}

// Row index[i] of dst = row i of src.
extern "C" __global__ void emb_scatter(const unsigned* src, const unsigned* index, unsigned* dst,
                                       EmbRowsParams p) {
    const u64 dst_rows = p.rows, words = p.words, n = p.n;
    for (u64 i = blockIdx.x; i < n; i += gridDim.x) {
        u64 r = index[i];
        if (r >= dst_rows) continue;
        for (u64 k = threadIdx.x; k < words; k += blockDim.x) dst[r * words + k] = src[i * words + k];
    }
}
