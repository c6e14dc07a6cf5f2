// Adam / AdamW on 8-bit block-wise moments. CPU twin: src/ops/adam/cpu8.rs (the arithmetic and
// its order); the maps: quant8.cuh, generated from src/ops/adam/quant8.rs. Descriptor and
// wrapper: src/ops/adam/device8.rs.
//
// Entries adam8_g<grad>_c<copy> (grad in {f32, f16, bf16}, copy in {none, f16, bf16}) and
// adam8_g<grad>_inplace (grad in {f16, bf16}: the copy replaces the gradient). Operands, in
// order: float* p (fp32 parameters), unsigned char* m, v (the moments' codes), float* ms, vs
// (their block scales), the gradient, the copy (null for _cnone; absent for _inplace); then
// AdamParams (adam.cuh).
//
// One thread block of QUANT8_BLOCK threads steps one block of values at a time (blocks strided
// over the grid): each thread dequantizes its element's moments, steps it as adam.cu does, and
// the block's new largest magnitudes (an integer maximum of the bits) scale the codes written
// back. Every operation is an explicitly rounded intrinsic or a comparison, as on the CPU, so
// the codes, scales and parameters equal the twin's bit for bit.
#include "common.cuh"

#include "adam.cuh"
#include "quant8_code.cuh"

struct Adam8NoCopy {};
__device__ __forceinline__ void adam8_store(Adam8NoCopy*, unsigned long long, float) {}
__device__ __forceinline__ void adam8_store(__half* c, unsigned long long i, float x) {
    c[i] = __float2half_rn(x);
}
__device__ __forceinline__ void adam8_store(__nv_bfloat16* c, unsigned long long i, float x) {
    c[i] = __float2bfloat16_rn(x);
}

__device__ __forceinline__ unsigned adam8_max(unsigned a, unsigned b) { return a > b ? a : b; }

template <typename G, typename C>
__device__ __forceinline__ void adam8_body(float* __restrict__ p, unsigned char* __restrict__ mq,
                                           unsigned char* __restrict__ vq,
                                           float* __restrict__ ms, float* __restrict__ vs,
                                           const G* g, C* copy, const AdamParams& a) {
    __shared__ unsigned red_m[QUANT8_BLOCK / 32];
    __shared__ unsigned red_v[QUANT8_BLOCK / 32];
    const AdamScalars& s = a.s;
    const float grad_scale = s.grad_scale, l2 = s.l2, beta1 = s.beta1,
                one_minus_beta1 = s.one_minus_beta1, beta2 = s.beta2,
                one_minus_beta2 = s.one_minus_beta2, inv_sqrt_bc2 = s.inv_sqrt_bc2, eps = s.eps,
                decoupled = s.decoupled, step_size = s.step_size;
    const unsigned long long blocks = (a.n + QUANT8_BLOCK - 1) / QUANT8_BLOCK;
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (unsigned long long b = blockIdx.x; b < blocks; b += gridDim.x) {
        const unsigned long long i = b * QUANT8_BLOCK + threadIdx.x;
        const bool live = i < a.n;
        float mi = 0.0f, vi = 0.0f;
        if (live) {
            float gi = to_f32(g[i]);
            float pi = p[i];
            mi = __fmul_rn(QUANT8_SIGNED_TABLE[mq[i]], ms[b]);
            vi = __fmul_rn(QUANT8_UNSIGNED_TABLE[vq[i]], vs[b]);
            gi = __fmaf_rn(l2, pi, __fmul_rn(gi, grad_scale));
            mi = __fmaf_rn(beta1, mi, __fmul_rn(one_minus_beta1, gi));
            vi = __fmaf_rn(beta2, vi, __fmul_rn(one_minus_beta2, __fmul_rn(gi, gi)));
            const float d = __fmaf_rn(__fsqrt_rn(vi), inv_sqrt_bc2, eps);
            pi = __fsub_rn(pi, __fmaf_rn(decoupled, pi, __fmul_rn(step_size, __fdiv_rn(mi, d))));
            p[i] = pi;
            adam8_store(copy, i, pi);
        }
        // the block's largest magnitudes: the largest bits with the sign cleared
        unsigned bm = live ? (__float_as_uint(mi) & 0x7fffffffu) : 0u;
        unsigned bv = live ? (__float_as_uint(vi) & 0x7fffffffu) : 0u;
        for (int o = 16; o > 0; o >>= 1) {
            bm = adam8_max(bm, __shfl_xor_sync(0xffffffffu, bm, o));
            bv = adam8_max(bv, __shfl_xor_sync(0xffffffffu, bv, o));
        }
        if (lane == 0) {
            red_m[warp] = bm;
            red_v[warp] = bv;
        }
        __syncthreads();
        bm = red_m[0];
        bv = red_v[0];
        for (int k = 1; k < QUANT8_BLOCK / 32; ++k) {
            bm = adam8_max(bm, red_m[k]);
            bv = adam8_max(bv, red_v[k]);
        }
        const float am = __uint_as_float(bm), av = __uint_as_float(bv);
        const float im = am > 0.0f ? __fdiv_rn(1.0f, am) : 0.0f;
        const float iv = av > 0.0f ? __fdiv_rn(1.0f, av) : 0.0f;
        if (live) {
            mq[i] = quant8_signed(__fmul_rn(mi, im));
            vq[i] = quant8_unsigned(__fmul_rn(vi, iv));
        }
        if (threadIdx.x == 0) {
            ms[b] = am;
            vs[b] = av;
        }
        // every thread has read the scales and the maxima before the next block writes them
        __syncthreads();
    }
}

extern "C" __global__ void adam8_gf32_cnone(float* p, unsigned char* m, unsigned char* v,
        float* ms, float* vs, const float* g, Adam8NoCopy* copy, AdamParams a) {
    adam8_body(p, m, v, ms, vs, g, copy, a);
}

extern "C" __global__ void adam8_gf32_cf16(float* p, unsigned char* m, unsigned char* v,
        float* ms, float* vs, const float* g, __half* copy, AdamParams a) {
    adam8_body(p, m, v, ms, vs, g, copy, a);
}

extern "C" __global__ void adam8_gf32_cbf16(float* p, unsigned char* m, unsigned char* v,
        float* ms, float* vs, const float* g, __nv_bfloat16* copy, AdamParams a) {
    adam8_body(p, m, v, ms, vs, g, copy, a);
}

extern "C" __global__ void adam8_gf16_cnone(float* p, unsigned char* m, unsigned char* v,
        float* ms, float* vs, const __half* g, Adam8NoCopy* copy, AdamParams a) {
    adam8_body(p, m, v, ms, vs, g, copy, a);
}

extern "C" __global__ void adam8_gf16_cf16(float* p, unsigned char* m, unsigned char* v,
        float* ms, float* vs, const __half* g, __half* copy, AdamParams a) {
    adam8_body(p, m, v, ms, vs, g, copy, a);
}

extern "C" __global__ void adam8_gf16_cbf16(float* p, unsigned char* m, unsigned char* v,
        float* ms, float* vs, const __half* g, __nv_bfloat16* copy, AdamParams a) {
    adam8_body(p, m, v, ms, vs, g, copy, a);
}

extern "C" __global__ void adam8_gbf16_cnone(float* p, unsigned char* m, unsigned char* v,
        float* ms, float* vs, const __nv_bfloat16* g, Adam8NoCopy* copy, AdamParams a) {
    adam8_body(p, m, v, ms, vs, g, copy, a);
}

extern "C" __global__ void adam8_gbf16_cf16(float* p, unsigned char* m, unsigned char* v,
        float* ms, float* vs, const __nv_bfloat16* g, __half* copy, AdamParams a) {
    adam8_body(p, m, v, ms, vs, g, copy, a);
}

extern "C" __global__ void adam8_gbf16_cbf16(float* p, unsigned char* m, unsigned char* v,
        float* ms, float* vs, const __nv_bfloat16* g, __nv_bfloat16* copy, AdamParams a) {
    adam8_body(p, m, v, ms, vs, g, copy, a);
}

// The copy replaces the gradient: each thread loads g[i] before it stores the copy there.
extern "C" __global__ void adam8_gf16_inplace(float* p, unsigned char* m, unsigned char* v,
                                              float* ms, float* vs, __half* g, AdamParams a) {
    adam8_body(p, m, v, ms, vs, g, g, a);
}

extern "C" __global__ void adam8_gbf16_inplace(float* p, unsigned char* m, unsigned char* v,
                                               float* ms, float* vs, __nv_bfloat16* g,
                                               AdamParams a) {
    adam8_body(p, m, v, ms, vs, g, g, a);
}
