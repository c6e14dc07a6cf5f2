// Warp-level intrinsics on the host: shuffles, votes, __syncwarp and __activemask.
//
// Each *_sync call is a warp barrier in the fiber scheduler (cpp/warp.cpp): the lane deposits its
// operand and switches out; when every lane its mask names has arrived at the same operation
// (same intrinsic, mask, width and operand width), each reads what it asked for. The runtime
// turns what CUDA leaves undefined into faults (see cuda-emu/src/lib.rs, "Warps"), except reads
// of a lane outside the mask, which return all-ones bits (NaN, -1), as garbage would.
#pragma once
#include <cstring>
#include <type_traits>

// A variable, not a constant, as in CUDA: `int a[warpSize]` does not compile with NVRTC either.
extern "C" __attribute__((visibility("hidden"))) const int warpSize;

extern "C" {
// kind: one of EMU_WARP_*; value: the lane's operand (its low `size` bytes); b: source lane,
// delta or lane mask; width: the shuffle's segment width. Returns the lane's result.
unsigned long long emu_warp_op(int kind, unsigned mask, unsigned long long value, int size, int b,
                               int width);
unsigned emu_activemask(void);
}

#define EMU_WARP_SHFL_IDX 0
#define EMU_WARP_SHFL_UP 1
#define EMU_WARP_SHFL_DOWN 2
#define EMU_WARP_SHFL_XOR 3
#define EMU_WARP_SYNC 4
#define EMU_WARP_BALLOT 5
#define EMU_WARP_ALL 6
#define EMU_WARP_ANY 7
#define EMU_WARP_ACTIVE 8  // __activemask(), called through emu_activemask()

template <typename T>
inline T emu_shfl(int kind, unsigned mask, T var, int b, int width) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                  "a shuffled value is at most 8 bytes");
    unsigned long long bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    bits = emu_warp_op(kind, mask, bits, (int)sizeof(T), b, width);
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}

// The overloads CUDA declares (sm_30_intrinsics.h); the fp16 and bf16 ones are in the shims of
// cuda_fp16.h and cuda_bf16.h.
#define EMU_SHUFFLES(T)                                                                   \
    inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize) {       \
        return emu_shfl(EMU_WARP_SHFL_IDX, mask, var, srcLane, width);                    \
    }                                                                                     \
    inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) { \
        return emu_shfl(EMU_WARP_SHFL_UP, mask, var, (int)(delta & 31u), width);          \
    }                                                                                     \
    inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) { \
        return emu_shfl(EMU_WARP_SHFL_DOWN, mask, var, (int)(delta & 31u), width);        \
    }                                                                                     \
    inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize) {  \
        return emu_shfl(EMU_WARP_SHFL_XOR, mask, var, laneMask, width);                   \
    }

EMU_SHUFFLES(int)
EMU_SHUFFLES(unsigned int)
EMU_SHUFFLES(long)
EMU_SHUFFLES(unsigned long)
EMU_SHUFFLES(long long)
EMU_SHUFFLES(unsigned long long)
EMU_SHUFFLES(float)
EMU_SHUFFLES(double)

inline void __syncwarp(unsigned mask = 0xffffffffu) {
    emu_warp_op(EMU_WARP_SYNC, mask, 0, 0, 0, warpSize);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    return (unsigned)emu_warp_op(EMU_WARP_BALLOT, mask, pred != 0, 0, 0, warpSize);
}
inline int __all_sync(unsigned mask, int pred) {
    return (int)emu_warp_op(EMU_WARP_ALL, mask, pred != 0, 0, 0, warpSize);
}
inline int __any_sync(unsigned mask, int pred) {
    return (int)emu_warp_op(EMU_WARP_ANY, mask, pred != 0, 0, 0, warpSize);
}
// The lanes of the calling warp that are at this point with it: those waiting at __activemask()
// once no lane of the warp can run on (see lib.rs, "Warps").
inline unsigned __activemask() { return emu_activemask(); }
