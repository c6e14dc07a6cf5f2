// LayerNorm over the rows of [N, C], fused with the residual add (as llm.c's fused residual
// forward), forward and backward. CPU twin and descriptors: src/ops/layernorm.rs, which adds in
// the same order with the same single roundings, so the two agree bit for bit. Storage f32, f16
// or bf16; math, mean and rstd in f32.
//
// layernorm_forward_<t>(x, r, gamma, beta, h, y, mean, rstd, LayerNormParams): one warp per
// row. With a residual (r and h non-null) h = x + r is rounded to the storage type, written,
// and normalised; else x is. mean = Σh / C; rstd = 1 / √(Σ(h − mean)² / C + eps) (two passes);
// y = ((h − mean)·rstd)·γ + β.
//
// layernorm_backward_<t>(dy, h, mean, rstd, gamma, dx, dgamma, dbeta, scratch, P): one block
// per chunk of P.chunk_rows rows. Its warps own rows: with n = (h − mean)·rstd, w = γ·dy,
// a = Σw / C, b = Σ(w·n) / C, dx (+)= ((w − a) − n·b)·rstd. Then its threads own columns and
// write the chunk's column sums Σ n·dy and Σ dy, over its rows in order, to
// scratch[chunk][0..C] and scratch[chunk][C..2C].
// layernorm_backward_reduce_<g>(same operands): dγ += Σ_chunks scratch[k][c], dβ += Σ
// scratch[k][C + c], in chunk order, added to dγ and dβ (of type g) with one rounding.
#include "common.cuh"

#include "layernorm.cuh"
#include "lanes.cuh"

#define LN_WARPS 8  // warps per block: rows at a time

typedef unsigned long long u64;

template <typename T>
__device__ __forceinline__ void ln_forward(const T* x, const T* r, const T* g, const T* b, T* h,
                                           T* y, float* mean, float* rstd,
                                           const LayerNormParams& p) {
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u64 C = p.cols;
    const float cf = (float)C;
    for (u64 row = blockIdx.x * (u64)LN_WARPS + warp; row < p.rows;
         row += (u64)gridDim.x * LN_WARPS) {
        const T* src = x + row * C;
        if (r != nullptr) {
            const T* rr = r + row * C;
            T* hr = h + row * C;
            for (u64 c = lane; c < C; c += 32) {
                store_f32(hr, c, __fadd_rn(to_f32(src[c]), to_f32(rr[c])));
            }
            // Each lane reads back only the elements it wrote.
            src = hr;
        }
        float s = 0.0f;
        for (u64 c = lane; c < C; c += 32) s = __fadd_rn(s, to_f32(src[c]));
        const float m = __fdiv_rn(warp_sum(s), cf);
        float v = 0.0f;
        for (u64 c = lane; c < C; c += 32) {
            const float d = __fsub_rn(to_f32(src[c]), m);
            v = __fadd_rn(v, __fmul_rn(d, d));
        }
        const float var = __fdiv_rn(warp_sum(v), cf);
        const float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, p.eps)));
        T* yr = y + row * C;
        for (u64 c = lane; c < C; c += 32) {
            const float n = __fmul_rn(__fsub_rn(to_f32(src[c]), m), rs);
            store_f32(yr, c, __fadd_rn(__fmul_rn(n, to_f32(g[c])), to_f32(b[c])));
        }
        if (lane == 0) {
            mean[row] = m;
            rstd[row] = rs;
        }
    }
}

template <typename T>
__device__ __forceinline__ void ln_backward(const T* dy, const T* h, const float* mean,
                                            const float* rstd, const T* g, T* dx,
                                            float* scratch, const LayerNormBackwardParams& p) {
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u64 C = p.cols;
    const float cf = (float)C;
    const u64 first = blockIdx.x * p.chunk_rows;
    const u64 end = first + p.chunk_rows < p.rows ? first + p.chunk_rows : p.rows;
    for (u64 row = first + warp; row < end; row += LN_WARPS) {
        const T* hr = h + row * C;
        const T* dyr = dy + row * C;
        T* dxr = dx + row * C;
        const float m = mean[row], rs = rstd[row];
        float a = 0.0f, b = 0.0f;
        for (u64 c = lane; c < C; c += 32) {
            const float n = __fmul_rn(__fsub_rn(to_f32(hr[c]), m), rs);
            const float w = __fmul_rn(to_f32(g[c]), to_f32(dyr[c]));
            a = __fadd_rn(a, w);
            b = __fadd_rn(b, __fmul_rn(w, n));
        }
        a = __fdiv_rn(warp_sum(a), cf);
        b = __fdiv_rn(warp_sum(b), cf);
        for (u64 c = lane; c < C; c += 32) {
            const float n = __fmul_rn(__fsub_rn(to_f32(hr[c]), m), rs);
            const float w = __fmul_rn(to_f32(g[c]), to_f32(dyr[c]));
            float d = __fmul_rn(__fsub_rn(__fsub_rn(w, a), __fmul_rn(n, b)), rs);
            if (p.accumulate) d = __fadd_rn(to_f32(dxr[c]), d);
            store_f32(dxr, c, d);
        }
    }
    // The chunk's column sums: each thread owns columns, over the chunk's rows in order.
    float* sg = scratch + blockIdx.x * 2 * C;
    for (u64 c = threadIdx.x; c < C; c += blockDim.x) {
        float gs = 0.0f, bs = 0.0f;
        for (u64 row = first; row < end; ++row) {
            const float n = __fmul_rn(__fsub_rn(to_f32(h[row * C + c]), mean[row]), rstd[row]);
            const float d = to_f32(dy[row * C + c]);
            gs = __fadd_rn(gs, __fmul_rn(n, d));
            bs = __fadd_rn(bs, d);
        }
        sg[c] = gs;
        sg[C + c] = bs;
    }
}

template <typename G>
__device__ __forceinline__ void ln_backward_reduce(G* dgamma, G* dbeta, const float* scratch,
                                                   const LayerNormBackwardParams& p) {
    const u64 C = p.cols;
    GRID_STRIDE(c, C) {
        float gs = 0.0f, bs = 0.0f;
        for (u64 k = 0; k < p.chunks; ++k) {
            gs = __fadd_rn(gs, scratch[k * 2 * C + c]);
            bs = __fadd_rn(bs, scratch[k * 2 * C + C + c]);
        }
        store_f32(dgamma, c, __fadd_rn(to_f32(dgamma[c]), gs));
        store_f32(dbeta, c, __fadd_rn(to_f32(dbeta[c]), bs));
    }
}

// Entries per storage type (spelled out: the emulator finds entries by their literal names).
typedef __half f16;
typedef __nv_bfloat16 bf16;

extern "C" __global__ void layernorm_forward_f32(const float* x, const float* r,
                                              const float* gamma, const float* beta, float* h,
                                              float* y, float* mean, float* rstd,
                                              LayerNormParams p) {
    ln_forward(x, r, gamma, beta, h, y, mean, rstd, p);
}
extern "C" __global__ void layernorm_backward_f32(const float* dy, const float* h,
                                               const float* mean, const float* rstd,
                                               const float* gamma, float* dx, void* /* dgamma */,
                                               void* /* dbeta */, float* scratch,
                                               LayerNormBackwardParams p) {
    ln_backward(dy, h, mean, rstd, gamma, dx, scratch, p);
}
// Named for the type of dγ and dβ; reads only them and scratch.
extern "C" __global__ void layernorm_backward_reduce_f32(
    const void* /* dy */, const void* /* h */, const float* /* mean */, const float* /* rstd */,
    const void* /* gamma */, void* /* dx */, float* dgamma, float* dbeta, const float* scratch,
    LayerNormBackwardParams p) {
    ln_backward_reduce(dgamma, dbeta, scratch, p);
}
extern "C" __global__ void layernorm_forward_f16(const f16* x, const f16* r,
                                              const f16* gamma, const f16* beta, f16* h,
                                              f16* y, float* mean, float* rstd,
                                              LayerNormParams p) {
    ln_forward(x, r, gamma, beta, h, y, mean, rstd, p);
}
extern "C" __global__ void layernorm_backward_f16(const f16* dy, const f16* h,
                                               const float* mean, const float* rstd,
                                               const f16* gamma, f16* dx, void* /* dgamma */,
                                               void* /* dbeta */, float* scratch,
                                               LayerNormBackwardParams p) {
    ln_backward(dy, h, mean, rstd, gamma, dx, scratch, p);
}
// Named for the type of dγ and dβ; reads only them and scratch.
extern "C" __global__ void layernorm_backward_reduce_f16(
    const void* /* dy */, const void* /* h */, const float* /* mean */, const float* /* rstd */,
    const void* /* gamma */, void* /* dx */, f16* dgamma, f16* dbeta, const float* scratch,
    LayerNormBackwardParams p) {
    ln_backward_reduce(dgamma, dbeta, scratch, p);
}
extern "C" __global__ void layernorm_forward_bf16(const bf16* x, const bf16* r,
                                              const bf16* gamma, const bf16* beta, bf16* h,
                                              bf16* y, float* mean, float* rstd,
                                              LayerNormParams p) {
    ln_forward(x, r, gamma, beta, h, y, mean, rstd, p);
}
extern "C" __global__ void layernorm_backward_bf16(const bf16* dy, const bf16* h,
                                               const float* mean, const float* rstd,
                                               const bf16* gamma, bf16* dx, void* /* dgamma */,
                                               void* /* dbeta */, float* scratch,
                                               LayerNormBackwardParams p) {
    ln_backward(dy, h, mean, rstd, gamma, dx, scratch, p);
}
// Named for the type of dγ and dβ; reads only them and scratch.
extern "C" __global__ void layernorm_backward_reduce_bf16(
    const void* /* dy */, const void* /* h */, const float* /* mean */, const float* /* rstd */,
    const void* /* gamma */, void* /* dx */, bf16* dgamma, bf16* dbeta, const float* scratch,
    LayerNormBackwardParams p) {
    ln_backward_reduce(dgamma, dbeta, scratch, p);
}
