// exp and ln in f32, the same sequence of correctly rounded operations as src/ops/math.rs, so
// the kernels and the CPU twins agree bit for bit (NVRTC compiles with --fmad=false; the
// __f*_rn intrinsics are never fused either way). Accuracy and edges: see src/ops/math.rs.
#pragma once

#define TM_LOG2E 1.44269504f
#define TM_LN2_HI 0.693359375f
#define TM_LN2_LO -2.12194440e-4f
#define TM_EXP_MAX 88.72283f
#define TM_EXP_MIN -87.33654f
#define TM_SQRT_HALF 0.70710677f

// 2^e for e in -126..=127.
__device__ __forceinline__ float tm_pow2(int e) {
    return __int_as_float((int)((unsigned)(e + 127) << 23));
}

__device__ __forceinline__ float tm_exp(float x) {
    const float xc = fminf(fmaxf(x, TM_EXP_MIN), TM_EXP_MAX);
    const float n = floorf(__fadd_rn(__fmul_rn(xc, TM_LOG2E), 0.5f));
    const float r = __fsub_rn(__fsub_rn(xc, __fmul_rn(n, TM_LN2_HI)), __fmul_rn(n, TM_LN2_LO));
    float p = 1.9875691e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 5.0000001e-1f);
    const float y = __fadd_rn(__fadd_rn(__fmul_rn(p, __fmul_rn(r, r)), r), 1.0f);
    const int ni = (int)n;
    const int n1 = ni < 127 ? ni : 127;
    const float out = __fmul_rn(__fmul_rn(y, tm_pow2(n1)), tm_pow2(ni - n1));
    if (x != x) return x;
    if (x > TM_EXP_MAX) return __int_as_float(0x7f800000);
    if (x < TM_EXP_MIN) return 0.0f;
    return out;
}

__device__ __forceinline__ float tm_log(float x) {
    const bool sub = x < 1.17549435e-38f;
    const float xs = sub ? __fmul_rn(x, 8388608.0f) : x;
    const unsigned bits = (unsigned)__float_as_int(xs);
    int e = (int)((bits >> 23) & 0xffu) - 126 - (sub ? 23 : 0);
    float m = __int_as_float((int)((bits & 0x007fffffu) | 0x3f000000u));
    if (m < TM_SQRT_HALF) {
        e -= 1;
        m = __fsub_rn(__fadd_rn(m, m), 1.0f);
    } else {
        m = __fsub_rn(m, 1.0f);
    }
    const float z = __fmul_rn(m, m);
    float p = 7.0376836e-2f;
    p = __fsub_rn(__fmul_rn(p, m), 1.151461e-1f);
    p = __fadd_rn(__fmul_rn(p, m), 1.1676999e-1f);
    p = __fsub_rn(__fmul_rn(p, m), 1.2420141e-1f);
    p = __fadd_rn(__fmul_rn(p, m), 1.4249323e-1f);
    p = __fsub_rn(__fmul_rn(p, m), 1.6668058e-1f);
    p = __fadd_rn(__fmul_rn(p, m), 2.0000714e-1f);
    p = __fsub_rn(__fmul_rn(p, m), 2.4999994e-1f);
    p = __fadd_rn(__fmul_rn(p, m), 3.3333331e-1f);
    const float fe = (float)e;
    float y = __fmul_rn(__fmul_rn(p, m), z);
    y = __fadd_rn(y, __fmul_rn(fe, TM_LN2_LO));
    y = __fsub_rn(y, __fmul_rn(0.5f, z));
    const float r = __fadd_rn(__fadd_rn(m, y), __fmul_rn(fe, TM_LN2_HI));
    if (x != x || x < 0.0f) return __int_as_float(0x7fc00000);
    if (x == 0.0f) return __int_as_float((int)0xff800000u);
    if (x == __int_as_float(0x7f800000)) return x;
    return r;
}

// tanh from tm_exp: sign(x)·(1 − 2/(e^{2|x|} + 1)), as math::tanh.
__device__ __forceinline__ float tm_tanh(float x) {
    const float t = __fsub_rn(1.0f, __fdiv_rn(2.0f, __fadd_rn(tm_exp(__fmul_rn(2.0f, fabsf(x))), 1.0f)));
    if (x != x) return x;
    return copysignf(t, x);
}
