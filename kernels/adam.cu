// Adam / AdamW steps. CPU twin: src/ops/adam/ (the arithmetic and its order:
// src/optim/adam.rs). Descriptor and wrapper: src/ops/adam/mod.rs.
//
// Entries adam_g<grad>_c<copy>, grad in {f32, f16, bf16}, copy in {none, f16, bf16}, and
// adam_g<grad>_inplace (grad in {f16, bf16}: the copy of the new parameters replaces the
// gradient). Operands, in order: float* p, m, v (fp32 parameters, momentum, variance, read and
// written), the gradient, the copy (null for _cnone; absent for _inplace); then AdamParams
// (adam.cuh). Every operation is an explicitly rounded intrinsic (no contraction), in the order
// of the CPU vector paths, so finite results equal theirs bit for bit.
#include "common.cuh"

#include "adam.cuh"

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
                                          const AdamParams& a) {
    const AdamScalars& s = a.s;
    const float grad_scale = s.grad_scale, l2 = s.l2, beta1 = s.beta1,
                one_minus_beta1 = s.one_minus_beta1, beta2 = s.beta2,
                one_minus_beta2 = s.one_minus_beta2, inv_sqrt_bc2 = s.inv_sqrt_bc2, eps = s.eps,
                decoupled = s.decoupled, step_size = s.step_size;
    GRID_STRIDE(i, a.n) {
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

// Operands in the order of the signature (src/ops/adam/mod.rs): p, m, v, g, copy (null when
// left out), then the parameters. The _inplace entries write the copy over the gradient: each
// thread loads g[i] before it stores copy[i], and neither pointer is __restrict__.

extern "C" __global__ void adam_gf32_cnone(float* p, float* m, float* v, const float* g,
        NoCopy* copy, AdamParams a) {
    adam_body(p, m, v, g, copy, a);
}

extern "C" __global__ void adam_gf32_cf16(float* p, float* m, float* v, const float* g,
        __half* copy, AdamParams a) {
    adam_body(p, m, v, g, copy, a);
}

extern "C" __global__ void adam_gf32_cbf16(float* p, float* m, float* v, const float* g,
        __nv_bfloat16* copy, AdamParams a) {
    adam_body(p, m, v, g, copy, a);
}

extern "C" __global__ void adam_gf16_cnone(float* p, float* m, float* v, const __half* g,
        NoCopy* copy, AdamParams a) {
    adam_body(p, m, v, g, copy, a);
}

extern "C" __global__ void adam_gf16_cf16(float* p, float* m, float* v, const __half* g,
        __half* copy, AdamParams a) {
    adam_body(p, m, v, g, copy, a);
}

extern "C" __global__ void adam_gf16_cbf16(float* p, float* m, float* v, const __half* g,
        __nv_bfloat16* copy, AdamParams a) {
    adam_body(p, m, v, g, copy, a);
}

extern "C" __global__ void adam_gbf16_cnone(float* p, float* m, float* v, const __nv_bfloat16* g,
        NoCopy* copy, AdamParams a) {
    adam_body(p, m, v, g, copy, a);
}

extern "C" __global__ void adam_gbf16_cf16(float* p, float* m, float* v, const __nv_bfloat16* g,
        __half* copy, AdamParams a) {
    adam_body(p, m, v, g, copy, a);
}

extern "C" __global__ void adam_gbf16_cbf16(float* p, float* m, float* v, const __nv_bfloat16* g,
        __nv_bfloat16* copy, AdamParams a) {
    adam_body(p, m, v, g, copy, a);
}

extern "C" __global__ void adam_gf16_inplace(float* p, float* m, float* v, __half* g,
        AdamParams a) {
    adam_body(p, m, v, g, g, a);
}

extern "C" __global__ void adam_gbf16_inplace(float* p, float* m, float* v, __nv_bfloat16* g,
        AdamParams a) {
    adam_body(p, m, v, g, g, a);
}
