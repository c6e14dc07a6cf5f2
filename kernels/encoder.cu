// GPT encoder: out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :], and its backward accumulated into
// dwte and dwpe without atomics. CPU twins and descriptors: src/ops/encoder.rs, which sum in the
// same order, so the two agree bit for bit. Storage f32, f16 or bf16; math in f32.
//
// Forward: one block per position (grid-stride), threads over the C channels. A token outside
// 0..v is no error the device can report: its row of `out` is NaN.
// Backward: the plan (u32 words, built on the host: EncoderPlan) is `distinct` rows (tokens),
// `distinct + 1` row starts, then the B·T positions grouped by token. encoder_backward_wte gives
// each distinct token one block whose threads sum, per channel, dout over the token's positions
// in plan order from 0, and add the sum to dwte once; the rows are distinct, so no two blocks
// touch one row. encoder_backward_wpe: one thread per (t, channel) sums dout over the batch in
// order and adds it to dwpe. Rows, starts and positions out of range are skipped or clamped, so a
// malformed plan never reads or writes out of bounds.
// Operands: encoder_forward_<t>(tokens, wte, wpe, out, EncoderParams);
// encoder_backward_{wte,wpe}_<t>(dout, plan, dwte, dwpe, EncoderBackwardParams).
#include "common.cuh"

#include "encoder.cuh"

typedef unsigned long long u64;

template <typename T>
__device__ __forceinline__ void encoder_forward(const int* __restrict__ tokens,
                                                const T* __restrict__ wte,
                                                const T* __restrict__ wpe, T* __restrict__ out,
                                                EncoderParams p) {
    const u64 c = p.c;
    for (u64 pos = blockIdx.x; pos < p.n; pos += gridDim.x) {
        const int tok = tokens[pos];
        const bool ok = tok >= 0 && (u64)tok < p.v;
        const T* e = wte + (ok ? (u64)tok : 0) * c;
        const T* w = wpe + (pos % p.t) * c;
        for (u64 k = threadIdx.x; k < c; k += blockDim.x) {
            const float v = ok ? __fadd_rn(to_f32(e[k]), to_f32(w[k])) : __int_as_float(0x7fc00000);
            store_f32(out, pos * c + k, v);
        }
    }
}

template <typename T>
__device__ __forceinline__ void encoder_backward_wte(const T* __restrict__ dout,
                                                     const unsigned* __restrict__ plan,
                                                     T* __restrict__ dwte, EncoderBackwardParams p) {
    const u64 c = p.c, n = p.n, u_count = p.distinct;
    const unsigned* rows = plan;
    const unsigned* row_ptr = plan + u_count;
    const unsigned* entries = plan + 2 * u_count + 1;
    for (u64 u = blockIdx.x; u < u_count; u += gridDim.x) {
        const u64 r = rows[u];
        if (r >= p.v) continue;  // the same for every thread of the block
        const u64 e1 = row_ptr[u + 1] < n ? row_ptr[u + 1] : n;
        const u64 e0 = row_ptr[u] < e1 ? row_ptr[u] : e1;
        for (u64 k = threadIdx.x; k < c; k += blockDim.x) {
            float acc = 0.0f;
            for (u64 e = e0; e < e1; ++e) {
                const u64 pos = entries[e];
                if (pos >= n) continue;
                acc = __fadd_rn(acc, to_f32(dout[pos * c + k]));
            }
            store_f32(dwte, r * c + k, __fadd_rn(to_f32(dwte[r * c + k]), acc));
        }
    }
}

template <typename T>
__device__ __forceinline__ void encoder_backward_wpe(const T* __restrict__ dout,
                                                     T* __restrict__ dwpe, EncoderBackwardParams p) {
    const u64 t = p.t, c = p.c, batch = p.n / p.t;
    GRID_STRIDE(i, t * c) {
        const u64 tt = i / c, k = i % c;
        float acc = 0.0f;
        for (u64 b = 0; b < batch; ++b) acc = __fadd_rn(acc, to_f32(dout[(b * t + tt) * c + k]));
        store_f32(dwpe, i, __fadd_rn(to_f32(dwpe[i]), acc));
    }
}

extern "C" __global__ void encoder_forward_f32(const int* tokens, const float* wte,
                                               const float* wpe, float* out, EncoderParams p) {
    encoder_forward(tokens, wte, wpe, out, p);
}
extern "C" __global__ void encoder_forward_f16(const int* tokens, const __half* wte,
                                               const __half* wpe, __half* out, EncoderParams p) {
    encoder_forward(tokens, wte, wpe, out, p);
}
extern "C" __global__ void encoder_forward_bf16(const int* tokens, const __nv_bfloat16* wte,
                                                const __nv_bfloat16* wpe, __nv_bfloat16* out,
                                                EncoderParams p) {
    encoder_forward(tokens, wte, wpe, out, p);
}

// dwpe is not touched by the wte entries, nor dwte by the wpe entries: every entry of an op takes
// the op's operands.
extern "C" __global__ void encoder_backward_wte_f32(const float* dout, const unsigned* plan,
                                                    float* dwte, float* /* dwpe */,
                                                    EncoderBackwardParams p) {
    encoder_backward_wte(dout, plan, dwte, p);
}
extern "C" __global__ void encoder_backward_wte_f16(const __half* dout, const unsigned* plan,
                                                    __half* dwte, __half* /* dwpe */,
                                                    EncoderBackwardParams p) {
    encoder_backward_wte(dout, plan, dwte, p);
}
extern "C" __global__ void encoder_backward_wte_bf16(const __nv_bfloat16* dout,
                                                     const unsigned* plan, __nv_bfloat16* dwte,
                                                     __nv_bfloat16* /* dwpe */,
                                                     EncoderBackwardParams p) {
    encoder_backward_wte(dout, plan, dwte, p);
}
extern "C" __global__ void encoder_backward_wpe_f32(const float* dout, const unsigned* /* plan */,
                                                    float* /* dwte */, float* dwpe,
                                                    EncoderBackwardParams p) {
    encoder_backward_wpe(dout, dwpe, p);
}
extern "C" __global__ void encoder_backward_wpe_f16(const __half* dout, const unsigned* /* plan */,
                                                    __half* /* dwte */, __half* dwpe,
                                                    EncoderBackwardParams p) {
    encoder_backward_wpe(dout, dwpe, p);
}
extern "C" __global__ void encoder_backward_wpe_bf16(const __nv_bfloat16* dout,
                                                     const unsigned* /* plan */,
                                                     __nv_bfloat16* /* dwte */,
                                                     __nv_bfloat16* dwpe,
                                                     EncoderBackwardParams p) {
    encoder_backward_wpe(dout, dwpe, p);
}
