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
#include "quant8_code.cuh"

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

// A row's 8-bit moments of one element after the step (kind 3), from their codes before it.
__device__ __forceinline__ void emb8_moments(unsigned char mq, unsigned char vq, float ms,
                                             float vs, float gk, float beta1, float beta2,
                                             float* m, float* v) {
    const float m0 = __fmul_rn(QUANT8_SIGNED_TABLE[mq], ms);
    const float v0 = __fmul_rn(QUANT8_UNSIGNED_TABLE[vq], vs);
    *m = __fadd_rn(__fmul_rn(beta1, m0), __fmul_rn(__fsub_rn(1.0f, beta1), gk));
    *v = __fadd_rn(__fmul_rn(beta2, v0), __fmul_rn(__fsub_rn(1.0f, beta2), __fmul_rn(gk, gk)));
}

// kind: 0 SGD, 1 row-wise Adagrad, 2 Adam, 3 Adam on 8-bit moments (one block a row: the
// threads a multiple of 32, at most 128).
extern "C" __global__ void emb_step(float* table, const unsigned* rows, const float* grads,
                                    EmbStepParams p) {
    const u64 table_rows = p.table_rows, stride = p.stride, dim = p.dim, n = p.n;
    const int kind = p.kind;
    const float lr = p.lr, eps = p.eps, beta1 = p.beta1, beta2 = p.beta2, bias1 = p.bias1,
                bias2 = p.bias2;
    __shared__ float denom;
    __shared__ unsigned red8[2][32];
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
        } else if (kind == 3) {
            // Adam on 8-bit moments: the codes of m then v after the weights, then the two
            // scales (src/ops/embedding/mod.rs); the moments recomputed from the old codes
            // for the new ones, under the row's new largest magnitudes
            unsigned char* mc = (unsigned char*)(row + dim);
            unsigned char* vc = mc + dim;
            float* sc = row + dim + (2 * dim + 3) / 4;
            const float ms = sc[0], vs = sc[1];
            unsigned bm = 0u, bv = 0u;
            for (u64 k = threadIdx.x; k < dim; k += blockDim.x) {
                float mk, vk;
                emb8_moments(mc[k], vc[k], ms, vs, g[k], beta1, beta2, &mk, &vk);
                float mhat = __fdiv_rn(mk, bias1);
                float vhat = __fdiv_rn(vk, bias2);
                row[k] = __fsub_rn(row[k],
                                   __fdiv_rn(__fmul_rn(lr, mhat), __fadd_rn(__fsqrt_rn(vhat), eps)));
                const unsigned am = __float_as_uint(mk) & 0x7fffffffu;
                const unsigned av = __float_as_uint(vk) & 0x7fffffffu;
                bm = am > bm ? am : bm;
                bv = av > bv ? av : bv;
            }
            for (int o = 16; o > 0; o >>= 1) {
                const unsigned xm = __shfl_xor_sync(0xffffffffu, bm, o);
                const unsigned xv = __shfl_xor_sync(0xffffffffu, bv, o);
                bm = xm > bm ? xm : bm;
                bv = xv > bv ? xv : bv;
            }
            if (threadIdx.x % 32 == 0) {
                red8[0][threadIdx.x / 32] = bm;
                red8[1][threadIdx.x / 32] = bv;
            }
            __syncthreads();
            bm = 0u;
            bv = 0u;
            for (unsigned w = 0; w < blockDim.x / 32; ++w) {
                bm = red8[0][w] > bm ? red8[0][w] : bm;
                bv = red8[1][w] > bv ? red8[1][w] : bv;
            }
            const float am = __uint_as_float(bm), av = __uint_as_float(bv);
            const float im = am > 0.0f ? __fdiv_rn(1.0f, am) : 0.0f;
            const float iv = av > 0.0f ? __fdiv_rn(1.0f, av) : 0.0f;
            for (u64 k = threadIdx.x; k < dim; k += blockDim.x) {
                float mk, vk;
                emb8_moments(mc[k], vc[k], ms, vs, g[k], beta1, beta2, &mk, &vk);
                mc[k] = quant8_signed(__fmul_rn(mk, im));
                vc[k] = quant8_unsigned(__fmul_rn(vk, iv));
            }
            if (threadIdx.x == 0) {
                sc[0] = am;
                sc[1] = av;
            }
            // the maxima are read before the next row writes them
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
