// Linear-layer bias helpers. CPU twin and descriptors: src/ops/bias.rs, which adds in the same
// order with the same single roundings, so the two agree bit for bit. Storage f32, f16 or bf16.
//
// bias_rows_<t>(b, y, BiasParams): y[r, c] = b[c] (a copy of the stored value) or, with
// accumulate, y[r, c] = y[r, c] + b[c] in f32, rounded once.
//
// bias_grad_partial_<t>(dy, db, scratch, BiasGradParams): one block per chunk of P.chunk_rows
// rows; its threads own columns and write scratch[chunk][c] = Σ dy[r, c] over the chunk's rows
// in order (f32, from 0).
// bias_grad_reduce_<g>(dy, db, scratch, P): s = Σ_chunks scratch[k][c] in chunk order (from 0),
// then db[c] = s or db[c] + s, rounded once to db's type g.
#include "common.cuh"

#include "bias.cuh"

typedef unsigned long long u64;

template <typename T>
__device__ __forceinline__ void bias_rows(const T* b, T* y, const BiasParams& p) {
    const u64 C = p.cols;
    GRID_STRIDE(i, p.rows * C) {
        const u64 c = i % C;
        if (p.accumulate) {
            store_f32(y, i, __fadd_rn(to_f32(y[i]), to_f32(b[c])));
        } else {
            y[i] = b[c];
        }
    }
}

template <typename T>
__device__ __forceinline__ void bias_grad_partial(const T* dy, float* scratch,
                                                  const BiasGradParams& p) {
    const u64 C = p.cols;
    const u64 first = blockIdx.x * p.chunk_rows;
    const u64 end = first + p.chunk_rows < p.rows ? first + p.chunk_rows : p.rows;
    for (u64 c = threadIdx.x; c < C; c += blockDim.x) {
        float s = 0.0f;
        for (u64 r = first; r < end; ++r) s = __fadd_rn(s, to_f32(dy[r * C + c]));
        scratch[blockIdx.x * C + c] = s;
    }
}

template <typename G>
__device__ __forceinline__ void bias_grad_reduce(G* db, const float* scratch,
                                                 const BiasGradParams& p) {
    const u64 C = p.cols;
    GRID_STRIDE(c, C) {
        float s = 0.0f;
        for (u64 k = 0; k < p.chunks; ++k) s = __fadd_rn(s, scratch[k * C + c]);
        if (p.accumulate) s = __fadd_rn(to_f32(db[c]), s);
        store_f32(db, c, s);
    }
}

// Entries per type (spelled out: the emulator finds entries by their literal names).

extern "C" __global__ void bias_rows_f32(const float* b, float* y, BiasParams p) {
    bias_rows(b, y, p);
}
extern "C" __global__ void bias_grad_partial_f32(const float* dy, void* /* db */, float* scratch,
                                               BiasGradParams p) {
    bias_grad_partial(dy, scratch, p);
}
// Named for db's type.
extern "C" __global__ void bias_grad_reduce_f32(const void* /* dy */, float* db,
                                              const float* scratch, BiasGradParams p) {
    bias_grad_reduce(db, scratch, p);
}
extern "C" __global__ void bias_rows_f16(const __half* b, __half* y, BiasParams p) {
    bias_rows(b, y, p);
}
extern "C" __global__ void bias_grad_partial_f16(const __half* dy, void* /* db */, float* scratch,
                                               BiasGradParams p) {
    bias_grad_partial(dy, scratch, p);
}
// Named for db's type.
extern "C" __global__ void bias_grad_reduce_f16(const void* /* dy */, __half* db,
                                              const float* scratch, BiasGradParams p) {
    bias_grad_reduce(db, scratch, p);
}
extern "C" __global__ void bias_rows_bf16(const __nv_bfloat16* b, __nv_bfloat16* y, BiasParams p) {
    bias_rows(b, y, p);
}
extern "C" __global__ void bias_grad_partial_bf16(const __nv_bfloat16* dy, void* /* db */,
                                                float* scratch, BiasGradParams p) {
    bias_grad_partial(dy, scratch, p);
}
// Named for db's type.
extern "C" __global__ void bias_grad_reduce_bf16(const void* /* dy */, __nv_bfloat16* db,
                                              const float* scratch, BiasGradParams p) {
    bias_grad_reduce(db, scratch, p);
}
