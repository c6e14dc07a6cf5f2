// Adam / AdamW steps and gradient statistics.
// CPU twin: src/optim/cpu_adam.rs (the arithmetic and its order: src/optim/adam.rs).
//
// Adam kernels: adam_g<grad>_c<copy>, grad in {f32, f16, bf16}, copy in {none, f16, bf16}.
// Parameters, in order:
//   float* p, float* m, float* v     fp32 parameters, momentum, variance (read and written)
//   const G* g                       the gradient
//   C* copy                          the fp16/bf16 copy of the new parameters (absent for _cnone)
//   unsigned long long n             number of elements
//   10 floats, the fields of AdamScalars in declaration order:
//     grad_scale, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bc2, eps,
//     decoupled, step_size
// The copy may be exactly the gradient range (the gradient is replaced by the new parameter):
// each thread loads g[i] before it stores copy[i], and neither pointer is __restrict__.
// Every operation is an explicitly rounded intrinsic (no contraction), in the order of the CPU
// vector paths, so finite results equal theirs bit for bit.
//
// Gradient statistics: grad_stats_partial_<dtype> runs on exactly GS_PARTIALS blocks of
// GS_THREADS threads and writes one (sum of squares, nonfinite flag) pair of doubles per block to
// out[2 + 2 * block]; grad_stats_final runs on one block of GS_PARTIALS threads and reduces the
// pairs, in a fixed order, into out[0] (sum) and out[1] (1.0 when an element is inf or NaN,
// else 0.0). No atomics: a result is the same from run to run.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define GRID_STRIDE(i, n) \
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; \
         i < (n); i += (unsigned long long)gridDim.x * blockDim.x)

// Must match GRAD_STATS_PARTIALS (src/device/mod.rs) and GRAD_STATS_THREADS (src/device/cuda.rs).
#define GS_PARTIALS 256
#define GS_THREADS 1024

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// The copy: nothing, fp16 or bf16, round to nearest even.
struct NoCopy {};
__device__ __forceinline__ void store_copy(NoCopy*, unsigned long long, float) {}
__device__ __forceinline__ void store_copy(__half* c, unsigned long long i, float x) {
    c[i] = __float2half_rn(x);
}
__device__ __forceinline__ void store_copy(__nv_bfloat16* c, unsigned long long i, float x) {
    c[i] = __float2bfloat16_rn(x);
}

template <typename G, typename C>
__device__ __forceinline__ void adam_body(float* __restrict__ p, float* __restrict__ m,
                                          float* __restrict__ v, const G* g, C* copy,
                                          unsigned long long n, float grad_scale, float l2,
                                          float beta1, float one_minus_beta1, float beta2,
                                          float one_minus_beta2, float inv_sqrt_bc2, float eps,
                                          float decoupled, float step_size) {
    GRID_STRIDE(i, n) {
        float gi = to_f32(g[i]);
        float pi = p[i];
        float mi = m[i];
        float vi = v[i];
        gi = __fmaf_rn(l2, pi, __fmul_rn(gi, grad_scale));
        mi = __fmaf_rn(beta1, mi, __fmul_rn(one_minus_beta1, gi));
        vi = __fmaf_rn(beta2, vi, __fmul_rn(one_minus_beta2, __fmul_rn(gi, gi)));
        const float d = __fmaf_rn(__fsqrt_rn(vi), inv_sqrt_bc2, eps);
        pi = __fsub_rn(pi, __fmaf_rn(decoupled, pi, __fmul_rn(step_size, __fdiv_rn(mi, d))));
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        store_copy(copy, i, pi);
    }
}

#define ADAM_SCALAR_PARAMS                                                                    \
    float grad_scale, float l2, float beta1, float one_minus_beta1, float beta2,             \
        float one_minus_beta2, float inv_sqrt_bc2, float eps, float decoupled, float step_size
#define ADAM_SCALAR_ARGS                                                                     \
    grad_scale, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bc2, eps,      \
        decoupled, step_size

extern "C" __global__ void adam_gf32_cnone(float* p, float* m, float* v, const float* g,
                                           unsigned long long n, ADAM_SCALAR_PARAMS) {
    adam_body(p, m, v, g, (NoCopy*)nullptr, n, ADAM_SCALAR_ARGS);
}

extern "C" __global__ void adam_gf32_cf16(float* p, float* m, float* v, const float* g,
                                          __half* copy, unsigned long long n,
                                          ADAM_SCALAR_PARAMS) {
    adam_body(p, m, v, g, copy, n, ADAM_SCALAR_ARGS);
}

extern "C" __global__ void adam_gf32_cbf16(float* p, float* m, float* v, const float* g,
                                           __nv_bfloat16* copy, unsigned long long n,
                                           ADAM_SCALAR_PARAMS) {
    adam_body(p, m, v, g, copy, n, ADAM_SCALAR_ARGS);
}

extern "C" __global__ void adam_gf16_cnone(float* p, float* m, float* v, const __half* g,
                                           unsigned long long n, ADAM_SCALAR_PARAMS) {
    adam_body(p, m, v, g, (NoCopy*)nullptr, n, ADAM_SCALAR_ARGS);
}

extern "C" __global__ void adam_gf16_cf16(float* p, float* m, float* v, const __half* g,
                                          __half* copy, unsigned long long n,
                                          ADAM_SCALAR_PARAMS) {
    adam_body(p, m, v, g, copy, n, ADAM_SCALAR_ARGS);
}

extern "C" __global__ void adam_gf16_cbf16(float* p, float* m, float* v, const __half* g,
                                           __nv_bfloat16* copy, unsigned long long n,
                                           ADAM_SCALAR_PARAMS) {
    adam_body(p, m, v, g, copy, n, ADAM_SCALAR_ARGS);
}

extern "C" __global__ void adam_gbf16_cnone(float* p, float* m, float* v,
                                            const __nv_bfloat16* g, unsigned long long n,
                                            ADAM_SCALAR_PARAMS) {
    adam_body(p, m, v, g, (NoCopy*)nullptr, n, ADAM_SCALAR_ARGS);
}

extern "C" __global__ void adam_gbf16_cf16(float* p, float* m, float* v,
                                           const __nv_bfloat16* g, __half* copy,
                                           unsigned long long n, ADAM_SCALAR_PARAMS) {
    adam_body(p, m, v, g, copy, n, ADAM_SCALAR_ARGS);
}

extern "C" __global__ void adam_gbf16_cbf16(float* p, float* m, float* v,
                                            const __nv_bfloat16* g, __nv_bfloat16* copy,
                                            unsigned long long n, ADAM_SCALAR_PARAMS) {
    adam_body(p, m, v, g, copy, n, ADAM_SCALAR_ARGS);
}

// Tree reduction over THREADS entries of shared memory, in a fixed order; the result is in
// entry 0. Every thread of the block must call it.
template <int THREADS>
__device__ __forceinline__ void block_reduce(double* sum, unsigned int* flag) {
    const unsigned int t = threadIdx.x;
    __syncthreads();
#pragma unroll
    for (unsigned int s = THREADS / 2; s > 0; s >>= 1) {
        if (t < s) {
            sum[t] = __dadd_rn(sum[t], sum[t + s]);
            flag[t] |= flag[t + s];
        }
        __syncthreads();
    }
}

template <typename T>
__device__ __forceinline__ void grad_stats_partial_body(const T* __restrict__ src,
                                                        unsigned long long n,
                                                        double* __restrict__ out) {
    __shared__ double sum[GS_THREADS];
    __shared__ unsigned int flag[GS_THREADS];
    double acc = 0.0;
    unsigned int bad = 0;
    GRID_STRIDE(i, n) {
        const float x = to_f32(src[i]);
        bad |= isfinite(x) ? 0u : 1u;
        const double d = (double)x;
        acc = __dadd_rn(acc, __dmul_rn(d, d));
    }
    sum[threadIdx.x] = acc;
    flag[threadIdx.x] = bad;
    block_reduce<GS_THREADS>(sum, flag);
    if (threadIdx.x == 0) {
        out[2 + 2 * blockIdx.x] = sum[0];
        out[3 + 2 * blockIdx.x] = flag[0] ? 1.0 : 0.0;
    }
}

extern "C" __global__ void grad_stats_partial_f32(const float* __restrict__ src,
                                                  unsigned long long n,
                                                  double* __restrict__ out) {
    grad_stats_partial_body(src, n, out);
}

extern "C" __global__ void grad_stats_partial_f16(const __half* __restrict__ src,
                                                  unsigned long long n,
                                                  double* __restrict__ out) {
    grad_stats_partial_body(src, n, out);
}

extern "C" __global__ void grad_stats_partial_bf16(const __nv_bfloat16* __restrict__ src,
                                                   unsigned long long n,
                                                   double* __restrict__ out) {
    grad_stats_partial_body(src, n, out);
}

extern "C" __global__ void grad_stats_final(double* out) {
    __shared__ double sum[GS_PARTIALS];
    __shared__ unsigned int flag[GS_PARTIALS];
    const unsigned int t = threadIdx.x;
    sum[t] = out[2 + 2 * t];
    flag[t] = out[3 + 2 * t] != 0.0 ? 1u : 0u;
    block_reduce<GS_PARTIALS>(sum, flag);
    if (t == 0) {
        out[0] = sum[0];
        out[1] = flag[0] ? 1.0 : 0.0;
    }
}
