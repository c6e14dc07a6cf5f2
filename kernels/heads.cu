// The layouts around attention, pure data movement (bitwise on every backend). CPU twins and
// descriptors: src/ops/heads.rs. Element types by size: _b2 (f16, bf16), _b4 (f32).
//   qkv_split:  qkv [B, T, 3, H, D] → q, k, v [B, H, T, D]      (forward)
//   qkv_merge:  dq, dk, dv [B, H, T, D] → dqkv [B, T, 3, H, D]  (its backward)
//   heads_merge: y [B, H, T, D] → out [B, T, H, D]              (forward)
//   heads_split: dout [B, T, H, D] → dy [B, H, T, D]            (its backward)
// Each thread walks the [B, H, T, D] index space (grid-stride) and moves one element.
#include "common.cuh"

#include "heads.cuh"

// For index i of [B, H, T, D]: the offset of the same element in [B, T, H, D] (times `parts`
// interleaved tensors, `part` selecting one).
__device__ __forceinline__ unsigned long long heads_offset(unsigned long long i, const HeadsParams& p,
                                                           unsigned long long parts,
                                                           unsigned long long part) {
    const unsigned long long d = i % p.head_dim;
    const unsigned long long t = (i / p.head_dim) % p.seq;
    const unsigned long long h = (i / (p.head_dim * p.seq)) % p.heads;
    const unsigned long long b = i / (p.head_dim * p.seq * p.heads);
    const unsigned long long c = p.heads * p.head_dim;
    return ((b * p.seq + t) * parts + part) * c + h * p.head_dim + d;
}

template <typename T>
__device__ __forceinline__ void qkv_split(const T* qkv, T* q, T* k, T* v, const HeadsParams& p) {
    const unsigned long long n = p.batch * p.heads * p.seq * p.head_dim;
    GRID_STRIDE(i, n) {
        q[i] = qkv[heads_offset(i, p, 3, 0)];
        k[i] = qkv[heads_offset(i, p, 3, 1)];
        v[i] = qkv[heads_offset(i, p, 3, 2)];
    }
}

template <typename T>
__device__ __forceinline__ void qkv_merge(const T* dq, const T* dk, const T* dv, T* dqkv,
                                          const HeadsParams& p) {
    const unsigned long long n = p.batch * p.heads * p.seq * p.head_dim;
    GRID_STRIDE(i, n) {
        dqkv[heads_offset(i, p, 3, 0)] = dq[i];
        dqkv[heads_offset(i, p, 3, 1)] = dk[i];
        dqkv[heads_offset(i, p, 3, 2)] = dv[i];
    }
}

template <typename T>
__device__ __forceinline__ void heads_merge(const T* y, T* out, const HeadsParams& p) {
    const unsigned long long n = p.batch * p.heads * p.seq * p.head_dim;
    GRID_STRIDE(i, n) { out[heads_offset(i, p, 1, 0)] = y[i]; }
}

template <typename T>
__device__ __forceinline__ void heads_split(const T* dout, T* dy, const HeadsParams& p) {
    const unsigned long long n = p.batch * p.heads * p.seq * p.head_dim;
    GRID_STRIDE(i, n) { dy[i] = dout[heads_offset(i, p, 1, 0)]; }
}

extern "C" __global__ void qkv_split_b2(const unsigned short* qkv, unsigned short* q, unsigned short* k, unsigned short* v,
                                        HeadsParams p) {
    qkv_split(qkv, q, k, v, p);
}
extern "C" __global__ void qkv_merge_b2(const unsigned short* dq, const unsigned short* dk, const unsigned short* dv,
                                        unsigned short* dqkv, HeadsParams p) {
    qkv_merge(dq, dk, dv, dqkv, p);
}
extern "C" __global__ void heads_merge_b2(const unsigned short* y, unsigned short* out, HeadsParams p) {
    heads_merge(y, out, p);
}
extern "C" __global__ void heads_split_b2(const unsigned short* dout, unsigned short* dy, HeadsParams p) {
    heads_split(dout, dy, p);
}

extern "C" __global__ void qkv_split_b4(const unsigned int* qkv, unsigned int* q, unsigned int* k, unsigned int* v,
                                        HeadsParams p) {
    qkv_split(qkv, q, k, v, p);
}
extern "C" __global__ void qkv_merge_b4(const unsigned int* dq, const unsigned int* dk, const unsigned int* dv,
                                        unsigned int* dqkv, HeadsParams p) {
    qkv_merge(dq, dk, dv, dqkv, p);
}
extern "C" __global__ void heads_merge_b4(const unsigned int* y, unsigned int* out, HeadsParams p) {
    heads_merge(y, out, p);
}
extern "C" __global__ void heads_split_b4(const unsigned int* dout, unsigned int* dy, HeadsParams p) {
    heads_split(dout, dy, p);
}
