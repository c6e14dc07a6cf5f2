// Causal softmax over a block of score rows [BH, rows, cols], forward and backward: row i of a
// matrix is global position offset + i and sees the columns j ≤ offset + i, so it holds
// n = min(offset + i + 1, cols) live elements (the square [BH, T, T] is rows = cols = T,
// offset 0). CPU twin and descriptor: src/ops/softmax.rs, which keeps this order of operations
// and reductions (src/ops/lanes.rs), so the two agree bit for bit. Storage f32, f16 or bf16;
// math in f32.
//
// One warp per row: lane l takes the live elements l, l + 32, ... of its row, the warp reduces
// by the xor butterfly (lanes.cuh), and every lane writes its columns of the whole row, 0 past
// the live ones. Elements past the live ones are never read.
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

// The live elements of row r (counted over all matrices): min(offset + r % rows + 1, cols).
// The host checks that offset + rows does not overflow.
__device__ __forceinline__ u64 live(const SoftmaxParams& p, u64 r) {
    const u64 n = p.offset + r % p.rows + 1;
    return n < p.cols ? n : p.cols;
}

template <typename T>
__device__ __forceinline__ void softmax_forward(const T* __restrict__ x, T* __restrict__ y,
                                                SoftmaxParams p) {
    const u64 rows = p.rows, cols = p.cols;
    const float scale = p.scale;
    const unsigned lane = threadIdx.x & 31u;
    SOFTMAX_ROWS(r, p.bh * rows) {
        const u64 n = live(p, r);
        const T* xr = x + r * cols;
        T* yr = y + r * cols;
        float m = -__int_as_float(0x7f800000);
        for (u64 j = lane; j < n; j += 32) m = fmaxf(m, __fmul_rn(scale, to_f32(xr[j])));
        m = warp_max(m);
        float s = 0.0f;
        for (u64 j = lane; j < n; j += 32)
            s = __fadd_rn(s, tm_exp(__fsub_rn(__fmul_rn(scale, to_f32(xr[j])), m)));
        const float inv = __fdiv_rn(1.0f, warp_sum(s));
        for (u64 j = lane; j < cols; j += 32) {
            float v = 0.0f;
            if (j < n) v = __fmul_rn(tm_exp(__fsub_rn(__fmul_rn(scale, to_f32(xr[j])), m)), inv);
            store_f32(yr, j, v);
        }
    }
}

template <typename T>
__device__ __forceinline__ void softmax_backward(const T* __restrict__ y, const T* __restrict__ dy,
                                                 T* __restrict__ dx, SoftmaxParams p) {
    const u64 rows = p.rows, cols = p.cols;
    const float scale = p.scale;
    const unsigned lane = threadIdx.x & 31u;
    SOFTMAX_ROWS(r, p.bh * rows) {
        const u64 n = live(p, r);
        const T* yr = y + r * cols;
        const T* dyr = dy + r * cols;
        T* dxr = dx + r * cols;
        float d = 0.0f;
        for (u64 j = lane; j < n; j += 32) d = __fadd_rn(d, __fmul_rn(to_f32(dyr[j]), to_f32(yr[j])));
        d = warp_sum(d);
        for (u64 j = lane; j < cols; j += 32) {
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
