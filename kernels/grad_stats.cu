// Gradient statistics: the sum of squares (in f64) and whether an element is infinite or NaN.
// CPU twin and descriptor: src/ops/grad_stats.rs.
//
// Operands: the source (f32, f16 or bf16), then `out` (f64): out[0] the sum, out[1] 1.0 when an
// element is inf or NaN (else 0.0), out[2..2 + 2 * GS_PARTIALS] scratch. grad_stats_partial_<t>
// runs on exactly GS_PARTIALS blocks of GS_THREADS threads and writes one (sum, flag) pair per
// block; grad_stats_final runs on one block of GS_PARTIALS threads and reduces the pairs in a
// fixed order. No atomics: a result is the same from run to run.
#include "common.cuh"

#include "grad_stats.cuh"

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
                                                  double* __restrict__ out, GradStatsParams p) {
    grad_stats_partial_body(src, p.n, out);
}

extern "C" __global__ void grad_stats_partial_f16(const __half* __restrict__ src,
                                                  double* __restrict__ out, GradStatsParams p) {
    grad_stats_partial_body(src, p.n, out);
}

extern "C" __global__ void grad_stats_partial_bf16(const __nv_bfloat16* __restrict__ src,
                                                   double* __restrict__ out, GradStatsParams p) {
    grad_stats_partial_body(src, p.n, out);
}

// The source is not read here; it is in the signature because every entry of an op takes the
// op's operands.
extern "C" __global__ void grad_stats_final(const void* /* src */, double* out,
                                         GradStatsParams /* p */) {
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
