// GELU, tanh approximation (as GPT-2): y = x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³))), and its
// gradient. CPU twin and descriptor: src/ops/gelu.rs, which computes in the same order in f32
// (no contraction: NVRTC runs with --fmad=false); storage f32, f16 or bf16, math in f32.
// Operands: gelu_forward_<t>(x, y, GeluParams); gelu_backward_<t>(x, dy, dx, GeluParams).
#include "common.cuh"

#include "gelu.cuh"
#include "math.cuh"

#define GELU_K0 0.7978845608028654f  // √(2/π)
#define GELU_K1 0.044715f

__device__ __forceinline__ float gelu_tanh_arg(float x) {
    const float x3 = __fmul_rn(__fmul_rn(x, x), x);
    return __fmul_rn(GELU_K0, __fadd_rn(x, __fmul_rn(GELU_K1, x3)));
}

template <typename T>
__device__ __forceinline__ void gelu_forward(const T* __restrict__ x, T* __restrict__ y,
                                             unsigned long long n) {
    GRID_STRIDE(i, n) {
        const float xi = to_f32(x[i]);
        const float t = tm_tanh(gelu_tanh_arg(xi));
        store_f32(y, i, __fmul_rn(__fmul_rn(0.5f, xi), __fadd_rn(1.0f, t)));
    }
}

template <typename T>
__device__ __forceinline__ void gelu_backward(const T* __restrict__ x, const T* __restrict__ dy,
                                              T* __restrict__ dx, unsigned long long n) {
    GRID_STRIDE(i, n) {
        const float xi = to_f32(x[i]);
        const float t = tm_tanh(gelu_tanh_arg(xi));
        const float du = __fmul_rn(
            GELU_K0, __fadd_rn(1.0f, __fmul_rn(__fmul_rn(3.0f, GELU_K1), __fmul_rn(xi, xi))));
        const float sech2 = __fsub_rn(1.0f, __fmul_rn(t, t));
        const float left = __fmul_rn(0.5f, __fadd_rn(1.0f, t));
        const float right = __fmul_rn(__fmul_rn(__fmul_rn(0.5f, xi), sech2), du);
        store_f32(dx, i, __fmul_rn(to_f32(dy[i]), __fadd_rn(left, right)));
    }
}

extern "C" __global__ void gelu_forward_f32(const float* x, float* y, GeluParams p) {
    gelu_forward(x, y, p.n);
}
extern "C" __global__ void gelu_forward_f16(const __half* x, __half* y, GeluParams p) {
    gelu_forward(x, y, p.n);
}
extern "C" __global__ void gelu_forward_bf16(const __nv_bfloat16* x, __nv_bfloat16* y,
                                             GeluParams p) {
    gelu_forward(x, y, p.n);
}
extern "C" __global__ void gelu_backward_f32(const float* x, const float* dy, float* dx,
                                             GeluParams p) {
    gelu_backward(x, dy, dx, p.n);
}
extern "C" __global__ void gelu_backward_f16(const __half* x, const __half* dy, __half* dx,
                                             GeluParams p) {
    gelu_backward(x, dy, dx, p.n);
}
extern "C" __global__ void gelu_backward_bf16(const __nv_bfloat16* x, const __nv_bfloat16* dy,
                                              __nv_bfloat16* dx, GeluParams p) {
    gelu_backward(x, dy, dx, p.n);
}
