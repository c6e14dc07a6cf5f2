// Causal softmax over [BH, T, T] scores, forward and backward. CPU twin and descriptor:
// src/ops/softmax.rs, which keeps this order of operations and reductions (src/ops/lanes.rs), so
// the two agree bit for bit. Storage f32, f16 or bf16; math in f32.
//
// One warp per row (row i of a matrix holds i + 1 live elements): lane l takes the elements
// l, l + 32, ... up to the diagonal, the warp reduces by the xor butterfly (lanes.cuh), and every
// lane writes its columns of the whole row, 0 above the diagonal. Elements above the diagonal
// are never read.
// Operands: softmax_forward_<t>(x, y, SoftmaxParams); softmax_backward_<t>(y, dy, dx, SoftmaxParams).
#include "common.cuh"

#include "lanes.cuh"
#include "math.cuh"
#include "softmax.cuh"

typedef unsigned long long u64;

// The rows of this warp: warp w of block b takes rows b·W + w, then every gridDim.x·W rows.
#define SOFTMAX_ROWS(r, rows)                                                           \
    for (u64 r = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < (rows); \
         r += (u64)gridDim.x * (blockDim.x >> 5))

template <typename T>
__device__ __forceinline__ void softmax_forward(const T* __restrict__ x, T* __restrict__ y,
                                                SoftmaxParams p) {
    const u64 t = p.t;
    const float scale = p.scale;
    const unsigned lane = threadIdx.x & 31u;
    SOFTMAX_ROWS(r, p.bh * t) {
        const u64 n = r % t + 1;  // live elements of the row
        const T* xr = x + r * t;
        T* yr = y + r * t;
        float m = -__int_as_float(0x7f800000);
        for (u64 j = lane; j < n; j += 32) m = fmaxf(m, __fmul_rn(scale, to_f32(xr[j])));
        m = warp_max(m);
        float s = 0.0f;
        for (u64 j = lane; j < n; j += 32)
            s = __fadd_rn(s, tm_exp(__fsub_rn(__fmul_rn(scale, to_f32(xr[j])), m)));
        const float inv = __fdiv_rn(1.0f, warp_sum(s));
        for (u64 j = lane; j < t; j += 32) {
            float v = 0.0f;
            if (j < n) v = __fmul_rn(tm_exp(__fsub_rn(__fmul_rn(scale, to_f32(xr[j])), m)), inv);
            store_f32(yr, j, v);
        }
    }
}

template <typename T>
__device__ __forceinline__ void softmax_backward(const T* __restrict__ y, const T* __restrict__ dy,
                                                 T* __restrict__ dx, SoftmaxParams p) {
    const u64 t = p.t;
    const float scale = p.scale;
    const unsigned lane = threadIdx.x & 31u;
    SOFTMAX_ROWS(r, p.bh * t) {
        const u64 n = r % t + 1;
        const T* yr = y + r * t;
        const T* dyr = dy + r * t;
        T* dxr = dx + r * t;
        float d = 0.0f;
        for (u64 j = lane; j < n; j += 32) d = __fadd_rn(d, __fmul_rn(to_f32(dyr[j]), to_f32(yr[j])));
        d = warp_sum(d);
        for (u64 j = lane; j < t; j += 32) {
            float v = 0.0f;
            if (j < n) v = __fmul_rn(scale, __fmul_rn(to_f32(yr[j]), __fsub_rn(to_f32(dyr[j]), d)));
            store_f32(dxr, j, v);
        }
    }
}

extern "C" __global__ void softmax_forward_f32(const float* x, float* y, SoftmaxParams p) {
    softmax_forward(x, y, p);
}
extern "C" __global__ void softmax_forward_f16(const __half* x, __half* y, SoftmaxParams p) {
    softmax_forward(x, y, p);
}
extern "C" __global__ void softmax_forward_bf16(const __nv_bfloat16* x, __nv_bfloat16* y,
                                                SoftmaxParams p) {
    softmax_forward(x, y, p);
}
extern "C" __global__ void softmax_backward_f32(const float* y, const float* dy, float* dx,
                                                SoftmaxParams p) {
    softmax_backward(y, dy, dx, p);
}
extern "C" __global__ void softmax_backward_f16(const __half* y, const __half* dy, __half* dx,
                                                SoftmaxParams p) {
    softmax_backward(y, dy, dx, p);
}
extern "C" __global__ void softmax_backward_bf16(const __nv_bfloat16* y, const __nv_bfloat16* dy,
                                                 __nv_bfloat16* dx, SoftmaxParams p) {
    softmax_backward(y, dy, dx, p);
}
