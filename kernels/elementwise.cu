// Elementwise ops. CPU twin and descriptors: src/ops/elementwise.rs, which computes the same
// single roundings, so the two agree bit for bit. Storage f32, f16 or bf16, math in f32.
// add_<t>(a, b, z, AddParams): z = alpha·a + beta·b (each product rounded, then the sum).
// add_in_place_<t>(b, z, AddParams): z = alpha·z + beta·b.
// scale_<t>(x, ScaleParams): x = alpha·x.
// fill_<16|32|64>(x, FillParams): every element = the bit pattern (any float type of that size).
#include "common.cuh"

#include "elementwise.cuh"

template <typename T>
__device__ __forceinline__ float axpby(float alpha, T a, float beta, T b) {
    return __fadd_rn(__fmul_rn(alpha, to_f32(a)), __fmul_rn(beta, to_f32(b)));
}

template <typename T>
__device__ __forceinline__ void add(const T* __restrict__ a, const T* __restrict__ b,
                                    T* __restrict__ z, const AddParams& p) {
    GRID_STRIDE(i, p.n) { store_f32(z, i, axpby(p.alpha, a[i], p.beta, b[i])); }
}

template <typename T>
__device__ __forceinline__ void add_in_place(const T* __restrict__ b, T* __restrict__ z,
                                             const AddParams& p) {
    GRID_STRIDE(i, p.n) { store_f32(z, i, axpby(p.alpha, z[i], p.beta, b[i])); }
}

template <typename T>
__device__ __forceinline__ void scale(T* x, const ScaleParams& p) {
    GRID_STRIDE(i, p.n) { store_f32(x, i, __fmul_rn(p.alpha, to_f32(x[i]))); }
}

template <typename U>
__device__ __forceinline__ void fill(U* x, const FillParams& p) {
    const U v = (U)p.bits;
    GRID_STRIDE(i, p.n) { x[i] = v; }
}

// Entries per type (spelled out: the emulator finds entries by their literal names).

extern "C" __global__ void add_f32(const float* a, const float* b, float* z, AddParams p) {
    add(a, b, z, p);
}
extern "C" __global__ void add_in_place_f32(const float* b, float* z, AddParams p) {
    add_in_place(b, z, p);
}
extern "C" __global__ void scale_f32(float* x, ScaleParams p) { scale(x, p); }
extern "C" __global__ void add_f16(const __half* a, const __half* b, __half* z, AddParams p) {
    add(a, b, z, p);
}
extern "C" __global__ void add_in_place_f16(const __half* b, __half* z, AddParams p) {
    add_in_place(b, z, p);
}
extern "C" __global__ void scale_f16(__half* x, ScaleParams p) { scale(x, p); }
extern "C" __global__ void add_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b,
                                    __nv_bfloat16* z, AddParams p) {
    add(a, b, z, p);
}
extern "C" __global__ void add_in_place_bf16(const __nv_bfloat16* b, __nv_bfloat16* z,
                                             AddParams p) {
    add_in_place(b, z, p);
}
extern "C" __global__ void scale_bf16(__nv_bfloat16* x, ScaleParams p) { scale(x, p); }
extern "C" __global__ void fill_16(unsigned short* x, FillParams p) { fill(x, p); }
extern "C" __global__ void fill_32(unsigned int* x, FillParams p) { fill(x, p); }
extern "C" __global__ void fill_64(unsigned long long* x, FillParams p) { fill(x, p); }
