// Vocab-parallel (tensor-parallel) token embedding and cross-entropy: a rank holds the rows
// [start, start + rows) of a vocabulary of `vocab` tokens. CPU twins and descriptors:
// src/ops/vocab_parallel/, which keep this order of operations and reductions
// (src/ops/lanes.rs), so the two agree bit for bit. Storage f32, f16 or bf16; math and
// statistics in f32.
//
// Embedding forward: one block per position (grid-stride), threads over the C channels; the
// row is copied when this rank owns the token, zeros otherwise. A token outside 0..vocab is no
// error the device can report: its row of `out` is NaN.
// Embedding backward: the plan (u32 words, built on the host: VocabPlan) is `distinct` local
// rows, `distinct + 1` row starts, then the `owned` positions grouped by row. When writing,
// vocab_embedding_backward_zero first zeroes the whole gradient; vocab_embedding_backward_rows
// gives each planned row one block whose threads sum, per channel, dout over the row's
// positions in plan order from 0 and store the sum (or add it to the gradient once). Rows,
// starts and positions out of range are skipped or clamped, so a malformed plan never reads or
// writes out of bounds.
// Cross-entropy, three steps between which the caller all-reduces the row statistics over the
// ranks: one block of VP_CE_THREADS threads per row (grid-stride over rows); thread k takes
// the columns k, k + VP_CE_THREADS, ...; block_max / block_sum (lanes.cuh) reduce in a fixed
// order. A target outside 0..vocab that is not the ignore index: NaN statistics, loss and
// gradient (over the local columns; the padding gets 0).
// Operands: vocab_embedding_forward_<t>(tokens, table, out, VocabEmbeddingParams);
// vocab_embedding_backward_{zero,rows}_<t>(dout, plan, dtable, VocabEmbeddingBackwardParams);
// vocab_ce_max_<t>(logits, row_max, VocabCeParams);
// vocab_ce_sums_<t>(logits, targets, global_max, sum_exp, target_logit, VocabCeParams);
// vocab_ce_grad_<t>(logits, targets, global_max, global_sum, global_target, losses,
// VocabCeParams) (global_target and losses both null or both present).
#include "common.cuh"

#include "lanes.cuh"
#include "math.cuh"
#include "vocab_parallel.cuh"

typedef unsigned long long u64;

#define VP_NAN __int_as_float(0x7fc00000)

template <typename T>
__device__ __forceinline__ void vocab_embedding_forward(const int* __restrict__ tokens,
                                                        const T* __restrict__ table,
                                                        T* __restrict__ out,
                                                        VocabEmbeddingParams p) {
    const u64 c = p.c;
    for (u64 pos = blockIdx.x; pos < p.n; pos += gridDim.x) {
        const int tok = tokens[pos];
        const bool ok = tok >= 0 && (u64)tok < p.vocab;
        const bool owned = ok && (u64)tok >= p.start && (u64)tok - p.start < p.rows;
        const T* e = table + (owned ? (u64)tok - p.start : 0) * c;
        for (u64 k = threadIdx.x; k < c; k += blockDim.x) {
            if (owned)
                out[pos * c + k] = e[k];
            else
                store_f32(out, pos * c + k, ok ? 0.0f : VP_NAN);
        }
    }
}

template <typename T>
__device__ __forceinline__ void vocab_embedding_backward_zero(T* __restrict__ dtable,
                                                              VocabEmbeddingBackwardParams p) {
    GRID_STRIDE(i, p.rows * p.c) store_f32(dtable, i, 0.0f);
}

template <typename T>
__device__ __forceinline__ void vocab_embedding_backward_rows(const T* __restrict__ dout,
                                                              const unsigned* __restrict__ plan,
                                                              T* __restrict__ dtable,
                                                              VocabEmbeddingBackwardParams p) {
    const u64 c = p.c, n = p.n, m = p.owned, u_count = p.distinct;
    const unsigned* rows = plan;
    const unsigned* row_ptr = plan + u_count;
    const unsigned* entries = plan + 2 * u_count + 1;
    for (u64 u = blockIdx.x; u < u_count; u += gridDim.x) {
        const u64 r = rows[u];
        if (r >= p.rows) continue;  // the same for every thread of the block
        const u64 e1 = row_ptr[u + 1] < m ? row_ptr[u + 1] : m;
        const u64 e0 = row_ptr[u] < e1 ? row_ptr[u] : e1;
        for (u64 k = threadIdx.x; k < c; k += blockDim.x) {
            float acc = 0.0f;
            for (u64 e = e0; e < e1; ++e) {
                const u64 pos = entries[e];
                if (pos >= n) continue;
                acc = __fadd_rn(acc, to_f32(dout[pos * c + k]));
            }
            const float g = p.accumulate ? __fadd_rn(to_f32(dtable[r * c + k]), acc) : acc;
            store_f32(dtable, r * c + k, g);
        }
    }
}

// Whether `tgt` is neither in 0..vocab nor the ignore index.
__device__ __forceinline__ bool vp_bad_target(int tgt, const VocabCeParams& p) {
    return tgt != p.ignore_index && (tgt < 0 || (u64)tgt >= p.vocab);
}

// The local column of target `tgt` (in 0..vocab), or p.rows when another rank owns it.
__device__ __forceinline__ u64 vp_local(int tgt, const VocabCeParams& p) {
    const u64 t = (u64)tgt;
    return t >= p.start && t - p.start < p.rows ? t - p.start : p.rows;
}

template <typename T>
__device__ __forceinline__ void vocab_ce_max(const T* __restrict__ logits,
                                             float* __restrict__ row_max, VocabCeParams p) {
    __shared__ float red[VP_CE_THREADS / 32];
    const unsigned k = threadIdx.x;
    for (u64 r = blockIdx.x; r < p.n; r += gridDim.x) {
        const T* x = logits + r * p.stride;
        float m = -__int_as_float(0x7f800000);
        for (u64 j = k; j < p.rows; j += VP_CE_THREADS) m = fmaxf(m, to_f32(x[j]));
        m = block_max(m, red);
        // + 0: a maximum of -0 and +0 may be either; the sum is +0 for both.
        if (k == 0) row_max[r] = __fadd_rn(m, 0.0f);
    }
}

template <typename T>
__device__ __forceinline__ void vocab_ce_sums(const T* __restrict__ logits,
                                              const int* __restrict__ targets,
                                              const float* __restrict__ global_max,
                                              float* __restrict__ sum_exp,
                                              float* __restrict__ target_logit, VocabCeParams p) {
    __shared__ float red[VP_CE_THREADS / 32];
    const unsigned k = threadIdx.x;
    for (u64 r = blockIdx.x; r < p.n; r += gridDim.x) {
        const T* x = logits + r * p.stride;
        const int tgt = targets[r];
        if (tgt == p.ignore_index || vp_bad_target(tgt, p)) {
            const float v = tgt == p.ignore_index ? 0.0f : VP_NAN;
            if (k == 0) {
                sum_exp[r] = v;
                target_logit[r] = v;
            }
            continue;
        }
        const float m = global_max[r];
        float s = 0.0f;
        for (u64 j = k; j < p.rows; j += VP_CE_THREADS)
            s = __fadd_rn(s, tm_exp(__fsub_rn(to_f32(x[j]), m)));
        s = block_sum(s, red);
        if (k == 0) {
            const u64 t = vp_local(tgt, p);
            sum_exp[r] = s;
            target_logit[r] = t < p.rows ? __fsub_rn(to_f32(x[t]), m) : 0.0f;
        }
    }
}

template <typename T>
__device__ __forceinline__ void vocab_ce_grad(T* __restrict__ logits,
                                              const int* __restrict__ targets,
                                              const float* __restrict__ global_max,
                                              const float* __restrict__ global_sum,
                                              const float* __restrict__ global_target,
                                              float* __restrict__ losses, VocabCeParams p) {
    const unsigned k = threadIdx.x;
    const u64 v = p.rows;
    for (u64 r = blockIdx.x; r < p.n; r += gridDim.x) {
        T* x = logits + r * p.stride;
        const int tgt = targets[r];
        if (tgt == p.ignore_index) {
            if (k == 0 && losses) losses[r] = 0.0f;
            for (u64 j = k; j < p.stride; j += VP_CE_THREADS) store_f32(x, j, 0.0f);
            continue;
        }
        if (vp_bad_target(tgt, p)) {
            if (k == 0 && losses) losses[r] = VP_NAN;
            for (u64 j = k; j < p.stride; j += VP_CE_THREADS) store_f32(x, j, j < v ? VP_NAN : 0.0f);
            continue;
        }
        const float m = global_max[r], s = global_sum[r];
        if (k == 0 && losses) losses[r] = __fsub_rn(tm_log(s), global_target[r]);
        const float inv = __fdiv_rn(1.0f, s);
        const u64 t = vp_local(tgt, p);
        for (u64 j = k; j < v; j += VP_CE_THREADS) {
            const float e = tm_exp(__fsub_rn(to_f32(x[j]), m));
            const float onehot = j == t ? 1.0f : 0.0f;
            store_f32(x, j, __fmul_rn(__fsub_rn(__fmul_rn(e, inv), onehot), p.grad_scale));
        }
        for (u64 j = v + k; j < p.stride; j += VP_CE_THREADS) store_f32(x, j, 0.0f);
    }
}

// The entries, one per storage type (spelt out: the emulator's build finds them by name).
extern "C" __global__ void vocab_embedding_forward_f32(const int* tokens, const float* table,
                                                    float* out, VocabEmbeddingParams p) {
    vocab_embedding_forward(tokens, table, out, p);
}
extern "C" __global__ void vocab_embedding_backward_zero_f32(const float* /* dout */,
                                                          const unsigned* /* plan */, float* dtable,
                                                          VocabEmbeddingBackwardParams p) {
    vocab_embedding_backward_zero(dtable, p);
}
extern "C" __global__ void vocab_embedding_backward_rows_f32(const float* dout, const unsigned* plan,
                                                          float* dtable,
                                                          VocabEmbeddingBackwardParams p) {
    vocab_embedding_backward_rows(dout, plan, dtable, p);
}
extern "C" __global__ void vocab_ce_max_f32(const float* logits, float* row_max, VocabCeParams p) {
    vocab_ce_max(logits, row_max, p);
}
extern "C" __global__ void vocab_ce_sums_f32(const float* logits, const int* targets,
                                          const float* global_max, float* sum_exp,
                                          float* target_logit, VocabCeParams p) {
    vocab_ce_sums(logits, targets, global_max, sum_exp, target_logit, p);
}
extern "C" __global__ void vocab_ce_grad_f32(float* logits, const int* targets,
                                          const float* global_max, const float* global_sum,
                                          const float* global_target, float* losses,
                                          VocabCeParams p) {
    vocab_ce_grad(logits, targets, global_max, global_sum, global_target, losses, p);
}
extern "C" __global__ void vocab_embedding_forward_f16(const int* tokens, const __half* table,
                                                    __half* out, VocabEmbeddingParams p) {
    vocab_embedding_forward(tokens, table, out, p);
}
extern "C" __global__ void vocab_embedding_backward_zero_f16(const __half* /* dout */,
                                                          const unsigned* /* plan */, __half* dtable,
                                                          VocabEmbeddingBackwardParams p) {
    vocab_embedding_backward_zero(dtable, p);
}
extern "C" __global__ void vocab_embedding_backward_rows_f16(const __half* dout, const unsigned* plan,
                                                          __half* dtable,
                                                          VocabEmbeddingBackwardParams p) {
    vocab_embedding_backward_rows(dout, plan, dtable, p);
}
extern "C" __global__ void vocab_ce_max_f16(const __half* logits, float* row_max, VocabCeParams p) {
    vocab_ce_max(logits, row_max, p);
}
extern "C" __global__ void vocab_ce_sums_f16(const __half* logits, const int* targets,
                                          const float* global_max, float* sum_exp,
                                          float* target_logit, VocabCeParams p) {
    vocab_ce_sums(logits, targets, global_max, sum_exp, target_logit, p);
}
extern "C" __global__ void vocab_ce_grad_f16(__half* logits, const int* targets,
                                          const float* global_max, const float* global_sum,
                                          const float* global_target, float* losses,
                                          VocabCeParams p) {
    vocab_ce_grad(logits, targets, global_max, global_sum, global_target, losses, p);
}
extern "C" __global__ void vocab_embedding_forward_bf16(const int* tokens, const __nv_bfloat16* table,
                                                    __nv_bfloat16* out, VocabEmbeddingParams p) {
    vocab_embedding_forward(tokens, table, out, p);
}
extern "C" __global__ void vocab_embedding_backward_zero_bf16(const __nv_bfloat16* /* dout */,
                                                          const unsigned* /* plan */, __nv_bfloat16* dtable,
                                                          VocabEmbeddingBackwardParams p) {
    vocab_embedding_backward_zero(dtable, p);
}
extern "C" __global__ void vocab_embedding_backward_rows_bf16(const __nv_bfloat16* dout, const unsigned* plan,
                                                          __nv_bfloat16* dtable,
                                                          VocabEmbeddingBackwardParams p) {
    vocab_embedding_backward_rows(dout, plan, dtable, p);
}
extern "C" __global__ void vocab_ce_max_bf16(const __nv_bfloat16* logits, float* row_max, VocabCeParams p) {
    vocab_ce_max(logits, row_max, p);
}
extern "C" __global__ void vocab_ce_sums_bf16(const __nv_bfloat16* logits, const int* targets,
                                          const float* global_max, float* sum_exp,
                                          float* target_logit, VocabCeParams p) {
    vocab_ce_sums(logits, targets, global_max, sum_exp, target_logit, p);
}
extern "C" __global__ void vocab_ce_grad_bf16(__nv_bfloat16* logits, const int* targets,
                                          const float* global_max, const float* global_sum,
                                          const float* global_target, float* losses,
                                          VocabCeParams p) {
    vocab_ce_grad(logits, targets, global_max, global_sum, global_target, losses, p);
}
