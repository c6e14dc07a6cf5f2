// Fused softmax cross-entropy over the vocabulary: per row the loss ln Σ exp(x_j − m) − (x_t − m)
// and, in the fused entries, the gradient (softmax − onehot)·grad_scale written over the logits
// (0 in the padding columns v..vp and on ignored rows). CPU twin and descriptors:
// src/ops/cross_entropy.rs, which keeps this order of operations and reductions
// (src/ops/lanes.rs), so the two agree bit for bit. Storage f32, f16 or bf16; math in f32.
//
// One block of CE_THREADS threads per row (grid-stride over rows): thread k takes the columns
// k, k + CE_THREADS, ...; block_max / block_sum (lanes.cuh) reduce in a fixed order. A target
// outside 0..v that is not the ignore index is no error the device can report: that row's loss is
// NaN and its gradient NaN over the v columns (0 in the padding); nothing out of bounds is read.
// Operands: cross_entropy_forward_<t>(logits, targets, losses, CrossEntropyParams) and
// cross_entropy_forward_backward_<t>(logits, targets, losses, CrossEntropyParams).
#include "common.cuh"

#include "cross_entropy.cuh"
#include "lanes.cuh"
#include "math.cuh"

typedef unsigned long long u64;

// GRAD: write the gradient over the logits (only then is `logits` written).
template <typename T, bool GRAD>
__device__ __forceinline__ void cross_entropy(T* __restrict__ logits, const int* __restrict__ targets,
                                              float* __restrict__ losses, CrossEntropyParams p) {
    __shared__ float red[CE_THREADS / 32];
    const u64 v = p.v, vp = p.vp;
    const unsigned k = threadIdx.x;
    const float nan = __int_as_float(0x7fc00000);
    for (u64 r = blockIdx.x; r < p.n; r += gridDim.x) {
        T* x = logits + r * vp;
        const int tgt = targets[r];
        if (tgt == p.ignore_index) {
            if (k == 0) losses[r] = 0.0f;
            if (GRAD)
                for (u64 j = k; j < vp; j += CE_THREADS) store_f32(x, j, 0.0f);
            continue;
        }
        if (tgt < 0 || (u64)tgt >= v) {
            if (k == 0) losses[r] = nan;
            if (GRAD)
                for (u64 j = k; j < vp; j += CE_THREADS) store_f32(x, j, j < v ? nan : 0.0f);
            continue;
        }
        // Read before any thread of the block writes the row (block_max synchronises first).
        const float xt = to_f32(x[tgt]);
        float m = -__int_as_float(0x7f800000);
        for (u64 j = k; j < v; j += CE_THREADS) m = fmaxf(m, to_f32(x[j]));
        m = block_max(m, red);
        float s = 0.0f;
        for (u64 j = k; j < v; j += CE_THREADS) s = __fadd_rn(s, tm_exp(__fsub_rn(to_f32(x[j]), m)));
        s = block_sum(s, red);
        if (k == 0) losses[r] = __fsub_rn(tm_log(s), __fsub_rn(xt, m));
        if (GRAD) {
            const float inv = __fdiv_rn(1.0f, s);
            for (u64 j = k; j < v; j += CE_THREADS) {
                const float e = tm_exp(__fsub_rn(to_f32(x[j]), m));
                const float onehot = j == (u64)tgt ? 1.0f : 0.0f;
                store_f32(x, j, __fmul_rn(__fsub_rn(__fmul_rn(e, inv), onehot), p.grad_scale));
            }
            for (u64 j = v + k; j < vp; j += CE_THREADS) store_f32(x, j, 0.0f);
        }
    }
}

// The forward entries never write the logits (GRAD = false): the const is cast away only to
// share the body.
extern "C" __global__ void cross_entropy_forward_f32(const float* logits, const int* targets,
                                                float* losses, CrossEntropyParams p) {
    cross_entropy<float, false>(const_cast<float*>(logits), targets, losses, p);
}
extern "C" __global__ void cross_entropy_forward_backward_f32(float* logits, const int* targets,
                                                         float* losses, CrossEntropyParams p) {
    cross_entropy<float, true>(logits, targets, losses, p);
}
extern "C" __global__ void cross_entropy_forward_f16(const __half* logits, const int* targets,
                                                float* losses, CrossEntropyParams p) {
    cross_entropy<__half, false>(const_cast<__half*>(logits), targets, losses, p);
}
extern "C" __global__ void cross_entropy_forward_backward_f16(__half* logits, const int* targets,
                                                         float* losses, CrossEntropyParams p) {
    cross_entropy<__half, true>(logits, targets, losses, p);
}
extern "C" __global__ void cross_entropy_forward_bf16(const __nv_bfloat16* logits, const int* targets,
                                                float* losses, CrossEntropyParams p) {
    cross_entropy<__nv_bfloat16, false>(const_cast<__nv_bfloat16*>(logits), targets, losses, p);
}
extern "C" __global__ void cross_entropy_forward_backward_bf16(__nv_bfloat16* logits, const int* targets,
                                                         float* losses, CrossEntropyParams p) {
    cross_entropy<__nv_bfloat16, true>(logits, targets, losses, p);
}
