// ReLU and its gradient, on the stored values (no rounding: a value is kept or becomes +0).
// CPU twin and descriptors: src/ops/relu.rs. Storage f32, f16 or bf16.
// relu_forward_<t>(x, y, ReluParams): y = x where x > 0, else +0 (NaN and -0 give +0).
// relu_backward_<t>(x, dy, dx, ReluParams): dx = dy where x > 0, else +0 (x may be the
// forward's output: it is positive exactly where the input is).
#include "common.cuh"

#include "relu.cuh"

template <typename T>
__device__ __forceinline__ void relu_forward(const T* __restrict__ x, T* __restrict__ y,
                                             unsigned long long n) {
    GRID_STRIDE(i, n) {
        const T v = x[i];
        if (to_f32(v) > 0.0f) {
            y[i] = v;
        } else {
            store_f32(y, i, 0.0f);
        }
    }
}

template <typename T>
__device__ __forceinline__ void relu_backward(const T* __restrict__ x, const T* __restrict__ dy,
                                              T* __restrict__ dx, unsigned long long n) {
    GRID_STRIDE(i, n) {
        if (to_f32(x[i]) > 0.0f) {
            dx[i] = dy[i];
        } else {
            store_f32(dx, i, 0.0f);
        }
    }
}

extern "C" __global__ void relu_forward_f32(const float* x, float* y, ReluParams p) {
    relu_forward(x, y, p.n);
}
extern "C" __global__ void relu_forward_f16(const __half* x, __half* y, ReluParams p) {
    relu_forward(x, y, p.n);
}
extern "C" __global__ void relu_forward_bf16(const __nv_bfloat16* x, __nv_bfloat16* y,
                                             ReluParams p) {
    relu_forward(x, y, p.n);
}
extern "C" __global__ void relu_backward_f32(const float* x, const float* dy, float* dx,
                                             ReluParams p) {
    relu_backward(x, dy, dx, p.n);
}
extern "C" __global__ void relu_backward_f16(const __half* x, const __half* dy, __half* dx,
                                             ReluParams p) {
    relu_backward(x, dy, dx, p.n);
}
extern "C" __global__ void relu_backward_bf16(const __nv_bfloat16* x, const __nv_bfloat16* dy,
                                              __nv_bfloat16* dx, ReluParams p) {
    relu_backward(x, dy, dx, p.n);
}
