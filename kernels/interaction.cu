// DLRM's dot interaction, forward and backward. CPU twin and descriptor: src/ops/interaction.rs.
//
// The rows of sample s: T[0] = dense[s] and T[1 + f] = emb[s][f], n = features + 1 rows of dim
// values. Forward: out[s] = dense[s] (each element copied as stored), then Z[i][j] = T[i]·T[j]
// for every i > j in row-major order (1,0), (2,0), (2,1), (3,0), ..., Z[i][j] at position
// dim + i(i-1)/2 + j: facebookresearch/dlrm's `interact_features` ("dot", without self
// interaction). Each Z[i][j] is one chain of fused multiply-adds in f32,
// acc = fma(T[i][d], T[j][d], acc) for d = 0, 1, ..., dim - 1 from acc = 0.
// Backward: G = dZ + dZᵀ (n x n, zero diagonal; dZ is the strict lower triangle of dout) and
// dT[k][c] = fma(G[k][m], T[m][c], acc) for m = 0, 1, ..., n - 1 (the diagonal included, with
// G[k][k] = 0), from acc = dout[s][c] for k = 0 (the pass-through part of the dense input) and
// acc = 0 otherwise; d_dense[s] = dT[0], d_emb[s][f] = dT[1 + f].
//
// One block per sample (a block-stride loop over samples when the grid is smaller). The
// `_shared` entries stage a sample in dynamic shared memory as f32 (the plan picks them when it
// fits in 48 KiB); the `_global` entries read the operands where they are. Both give the same
// bits, and so does the twin: every value is an exact widening or one correctly rounded fma.
// Operands: interaction_forward_<t>_<where>(dense, emb, out, InteractionParams);
// interaction_backward_<t>_<where>(dense, emb, dout, d_dense, d_emb, InteractionParams).
#include "common.cuh"

#include "interaction.cuh"

// Row r of a sample: its dense vector for r = 0, else its embedding r - 1.
template <typename T>
__device__ __forceinline__ const T* ia_row(const T* x, const T* e, unsigned r, unsigned dim) {
    return r == 0 ? x : e + (unsigned long long)(r - 1) * dim;
}

// Position of Z[i][j], i > j, in the strict lower triangle (row-major).
__device__ __forceinline__ unsigned ia_tri(unsigned i, unsigned j) { return i * (i - 1) / 2 + j; }

// The pair (i, j), i > j, at position q of the strict lower triangle.
__device__ __forceinline__ void ia_pair(unsigned q, unsigned* i, unsigned* j) {
    const float root = __fsqrt_rn(__fadd_rn(1.0f, __fmul_rn(8.0f, (float)q)));
    unsigned r = (unsigned)__fmul_rn(__fadd_rn(1.0f, root), 0.5f);
    while (r > 1 && r * (r - 1) / 2 > q) --r;
    while ((r + 1) * r / 2 <= q) ++r;
    *i = r;
    *j = q - r * (r - 1) / 2;
}

template <typename T, bool SHARED>
__device__ __forceinline__ void ia_forward(const T* __restrict__ dense, const T* __restrict__ emb,
                                           T* __restrict__ out, const InteractionParams& p) {
    extern __shared__ float ia_fwd_rows[];  // n rows of dim + 1 (no bank conflicts across rows)
    const unsigned n = (unsigned)p.features + 1, dim = (unsigned)p.dim;
    const unsigned pairs = n * (n - 1) / 2, width = dim + pairs, ld = dim + 1;
    for (unsigned long long s = blockIdx.x; s < p.batch; s += gridDim.x) {
        const T* x = dense + s * dim;
        const T* e = emb + s * p.features * dim;
        T* o = out + s * width;
        for (unsigned c = threadIdx.x; c < dim; c += blockDim.x) o[c] = x[c];
        if (SHARED) {
            for (unsigned k = threadIdx.x; k < n * dim; k += blockDim.x) {
                const unsigned r = k / dim, c = k - r * dim;
                ia_fwd_rows[r * ld + c] = to_f32(ia_row(x, e, r, dim)[c]);
            }
            __syncthreads();
        }
        for (unsigned q = threadIdx.x; q < pairs; q += blockDim.x) {
            unsigned i, j;
            ia_pair(q, &i, &j);
            float acc = 0.0f;
            if (SHARED) {
                const float* a = ia_fwd_rows + i * ld;
                const float* b = ia_fwd_rows + j * ld;
                for (unsigned d = 0; d < dim; ++d) acc = __fmaf_rn(a[d], b[d], acc);
            } else {
                const T* a = ia_row(x, e, i, dim);
                const T* b = ia_row(x, e, j, dim);
                for (unsigned d = 0; d < dim; ++d) acc = __fmaf_rn(to_f32(a[d]), to_f32(b[d]), acc);
            }
            store_f32(o, dim + q, acc);
        }
        if (SHARED) __syncthreads();
    }
}

// G[k][m] of a sample read from its output gradient `dy`.
template <typename T>
__device__ __forceinline__ float ia_grad(const T* dy, unsigned dim, unsigned k, unsigned m) {
    if (k == m) return 0.0f;
    return to_f32(dy[dim + (k > m ? ia_tri(k, m) : ia_tri(m, k))]);
}

template <typename T, bool SHARED>
__device__ __forceinline__ void ia_backward(const T* __restrict__ dense,
                                            const T* __restrict__ emb,
                                            const T* __restrict__ dout, T* __restrict__ d_dense,
                                            T* __restrict__ d_emb, const InteractionParams& p) {
    extern __shared__ float ia_bwd_smem[];  // G (n x n), then T (n rows of dim)
    const unsigned n = (unsigned)p.features + 1, dim = (unsigned)p.dim;
    const unsigned pairs = n * (n - 1) / 2, width = dim + pairs;
    float* g = ia_bwd_smem;
    float* rows = ia_bwd_smem + n * n;
    for (unsigned long long s = blockIdx.x; s < p.batch; s += gridDim.x) {
        const T* x = dense + s * dim;
        const T* e = emb + s * p.features * dim;
        const T* dy = dout + s * width;
        T* dx = d_dense + s * dim;
        T* de = d_emb + s * p.features * dim;
        if (SHARED) {
            for (unsigned k = threadIdx.x; k < n * n; k += blockDim.x) {
                const unsigned r = k / n;
                g[k] = ia_grad(dy, dim, r, k - r * n);
            }
            for (unsigned k = threadIdx.x; k < n * dim; k += blockDim.x) {
                const unsigned r = k / dim;
                rows[k] = to_f32(ia_row(x, e, r, dim)[k - r * dim]);
            }
            __syncthreads();
        }
        for (unsigned k = threadIdx.x; k < n * dim; k += blockDim.x) {
            const unsigned r = k / dim, c = k - r * dim;
            float acc = r == 0 ? to_f32(dy[c]) : 0.0f;
            for (unsigned m = 0; m < n; ++m) {
                const float gm = SHARED ? g[r * n + m] : ia_grad(dy, dim, r, m);
                const float t = SHARED ? rows[m * dim + c] : to_f32(ia_row(x, e, m, dim)[c]);
                acc = __fmaf_rn(gm, t, acc);
            }
            if (r == 0) {
                store_f32(dx, c, acc);
            } else {
                store_f32(de, (unsigned long long)(r - 1) * dim + c, acc);
            }
        }
        if (SHARED) __syncthreads();
    }
}

extern "C" __global__ void interaction_forward_f32_shared(
    const float* dense, const float* emb, float* out, InteractionParams p) {
    ia_forward<float, true>(dense, emb, out, p);
}
extern "C" __global__ void interaction_forward_f32_global(
    const float* dense, const float* emb, float* out, InteractionParams p) {
    ia_forward<float, false>(dense, emb, out, p);
}
extern "C" __global__ void interaction_forward_f16_shared(
    const __half* dense, const __half* emb, __half* out, InteractionParams p) {
    ia_forward<__half, true>(dense, emb, out, p);
}
extern "C" __global__ void interaction_forward_f16_global(
    const __half* dense, const __half* emb, __half* out, InteractionParams p) {
    ia_forward<__half, false>(dense, emb, out, p);
}
extern "C" __global__ void interaction_forward_bf16_shared(
    const __nv_bfloat16* dense, const __nv_bfloat16* emb, __nv_bfloat16* out, InteractionParams p) {
    ia_forward<__nv_bfloat16, true>(dense, emb, out, p);
}
extern "C" __global__ void interaction_forward_bf16_global(
    const __nv_bfloat16* dense, const __nv_bfloat16* emb, __nv_bfloat16* out, InteractionParams p) {
    ia_forward<__nv_bfloat16, false>(dense, emb, out, p);
}
extern "C" __global__ void interaction_backward_f32_shared(
    const float* dense, const float* emb, const float* dout, float* d_dense, float* d_emb,
    InteractionParams p) {
    ia_backward<float, true>(dense, emb, dout, d_dense, d_emb, p);
}
extern "C" __global__ void interaction_backward_f32_global(
    const float* dense, const float* emb, const float* dout, float* d_dense, float* d_emb,
    InteractionParams p) {
    ia_backward<float, false>(dense, emb, dout, d_dense, d_emb, p);
}
extern "C" __global__ void interaction_backward_f16_shared(
    const __half* dense, const __half* emb, const __half* dout, __half* d_dense, __half* d_emb,
    InteractionParams p) {
    ia_backward<__half, true>(dense, emb, dout, d_dense, d_emb, p);
}
extern "C" __global__ void interaction_backward_f16_global(
    const __half* dense, const __half* emb, const __half* dout, __half* d_dense, __half* d_emb,
    InteractionParams p) {
    ia_backward<__half, false>(dense, emb, dout, d_dense, d_emb, p);
}
extern "C" __global__ void interaction_backward_bf16_shared(
    const __nv_bfloat16* dense, const __nv_bfloat16* emb, const __nv_bfloat16* dout,
    __nv_bfloat16* d_dense, __nv_bfloat16* d_emb, InteractionParams p) {
    ia_backward<__nv_bfloat16, true>(dense, emb, dout, d_dense, d_emb, p);
}
extern "C" __global__ void interaction_backward_bf16_global(
    const __nv_bfloat16* dense, const __nv_bfloat16* emb, const __nv_bfloat16* dout,
    __nv_bfloat16* d_dense, __nv_bfloat16* d_emb, InteractionParams p) {
    ia_backward<__nv_bfloat16, false>(dense, emb, dout, d_dense, d_emb, p);
}
