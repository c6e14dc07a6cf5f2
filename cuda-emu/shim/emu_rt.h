// The CUDA C++ dialect on the host, for running kernels/*.cu on the CPU.
//
// Every thread of a block runs as a fiber of one OS thread; __syncthreads() and the warp
// intrinsics (emu_warp.h) switch to the next fiber of the block, so a block's threads meet at
// each barrier as on a GPU. Blocks run one after another, so `__shared__` variables are function
// statics (one copy, reused by each block, refilled with garbage before each), and atomics
// (emu_atomic.h) are plain read-modify-writes. The explicitly rounded intrinsics are the plain
// IEEE operations of the host (the file is compiled with -ffp-contract=off, so nothing is fused
// behind their back).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

using std::isfinite;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// Constant memory: a file-scope table, read-only by use.
#define __constant__ static
// Shared memory: statics in their own section, which the runtime fills with 0xff bytes before
// every block (a GPU's shared memory starts as garbage, not zeros). GCC ignores the section of
// a static in a function template: those keep a static's zeros and the last block's values.
#define __shared__ static __attribute__((section("emu_shared")))
#define __align__(n) __attribute__((aligned(n)))

// Dynamic shared memory: build.rs rewrites `extern __shared__ T name[];` into
// `T (&name)[] = EmuDynamicShared{};`, a reference to the launch's buffer (cpp/runtime.cpp),
// which starts on a page boundary: aligned for any type.
extern "C" __attribute__((visibility("hidden"))) unsigned char emu_dynamic_shared[];
struct EmuDynamicShared {
    template <typename T>
    operator T&() const {
        return *reinterpret_cast<T*>(emu_dynamic_shared);
    }
};

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};

extern "C" {
extern uint3 emu_thread_idx;
extern uint3 emu_block_idx;
extern dim3 emu_block_dim;
extern dim3 emu_grid_dim;
void emu_syncthreads(void);
}

#define threadIdx emu_thread_idx
#define blockIdx emu_block_idx
#define blockDim emu_block_dim
#define gridDim emu_grid_dim

inline void __syncthreads() { emu_syncthreads(); }

#include "emu_atomic.h"
#include "emu_warp.h"

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }

// A kernel's entry: its name, how to call it with cuLaunchKernel's parameter array, and the
// size of each parameter (the driver copies the values at launch, as CUDA does).
struct EmuKernel {
    const char* name;
    void (*invoke)(void** params);
    size_t nparams;
    const size_t* param_sizes;
    const unsigned char* param_is_ptr;
};

#include <type_traits>
#include <utility>

template <typename... A, size_t... I>
inline void emu_call_impl(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[I])...);
}

template <typename... A>
inline void emu_call(void (*f)(A...), void** p) {
    emu_call_impl(f, p, std::index_sequence_for<A...>{});
}

template <typename F>
struct EmuSizes;
template <typename... A>
struct EmuSizes<void (*)(A...)> {
    static_assert(((alignof(A) <= 8) && ...), "a kernel parameter needs more than 8-byte alignment");
    static constexpr size_t n = sizeof...(A);
    static constexpr size_t sizes[sizeof...(A) + 1] = {sizeof(A)..., 0};
    static constexpr unsigned char is_ptr[sizeof...(A) + 1] = {
        (unsigned char)std::is_pointer<A>::value..., 0};
};

#define EMU_KERNEL(f)                                                              \
    EmuKernel {                                                                    \
        #f, [](void** p) { emu_call(&f, p); }, EmuSizes<decltype(&f)>::n,          \
            EmuSizes<decltype(&f)>::sizes, EmuSizes<decltype(&f)>::is_ptr          \
    }

// Bit casts between float and int, as the CUDA intrinsics.
#include <cstring>
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, sizeof i);
    return i;
}
