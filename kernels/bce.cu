// Sigmoid + binary cross-entropy on logits, fused forward and backward. CPU twin and
// descriptor: src/ops/bce.rs, which computes in the same order with the same single roundings
// (tm_exp and tm_log are math.cuh's, bitwise the twin's), so the two agree bit for bit.
// Per element, u = e^{-|x|}, v = 1 + u, r = 1 / v: sigma = x >= 0 ? r : u * r;
// loss = (max(x, 0) - x*y) + (ln(v) + (u - (v - 1)) * r) (ln(1 + u) with what rounding 1 + u
// lost put back); dlogits = (sigma - y) * scale.
// Operands: bce_with_logits_<t>(logits, labels, loss, dlogits (or null), probs (or null),
// BceParams); logits and dlogits of type <t>, the others f32.
#include "common.cuh"

#include "bce.cuh"
#include "math.cuh"

template <typename T>
__device__ __forceinline__ void bce_body(const T* __restrict__ logits,
                                         const float* __restrict__ labels,
                                         float* __restrict__ loss, T* __restrict__ dlogits,
                                         float* __restrict__ probs, const BceParams& p) {
    GRID_STRIDE(i, p.n) {
        const float x = to_f32(logits[i]);
        const float y = labels[i];
        const float u = tm_exp(-fabsf(x));
        const float v = __fadd_rn(1.0f, u);
        const float r = __fdiv_rn(1.0f, v);
        const float sigma = x >= 0.0f ? r : __fmul_rn(u, r);
        const float ln_1p = __fadd_rn(tm_log(v), __fmul_rn(__fsub_rn(u, __fsub_rn(v, 1.0f)), r));
        const float relu = x > 0.0f ? x : 0.0f;
        loss[i] = __fadd_rn(__fsub_rn(relu, __fmul_rn(x, y)), ln_1p);
        if (dlogits) store_f32(dlogits, i, __fmul_rn(__fsub_rn(sigma, y), p.scale));
        if (probs) probs[i] = sigma;
    }
}

extern "C" __global__ void bce_with_logits_f32(const float* logits, const float* labels,
                                               float* loss, float* dlogits, float* probs,
                                               BceParams p) {
    bce_body(logits, labels, loss, dlogits, probs, p);
}
extern "C" __global__ void bce_with_logits_f16(const __half* logits, const float* labels,
                                               float* loss, __half* dlogits, float* probs,
                                               BceParams p) {
    bce_body(logits, labels, loss, dlogits, probs, p);
}
extern "C" __global__ void bce_with_logits_bf16(const __nv_bfloat16* logits, const float* labels,
                                                float* loss, __nv_bfloat16* dlogits, float* probs,
                                                BceParams p) {
    bce_body(logits, labels, loss, dlogits, probs, p);
}
