// Host stand-in for <cuda_bf16.h>: the bf16 type and the conversions the kernels use, with the
// results of the GPU's cvt instructions (round to nearest even; any NaN becomes 0x7fff).
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    unsigned short x;
};

inline float __bfloat162float(__nv_bfloat16 b) {
    const uint32_t bits = (uint32_t)b.x << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    __nv_bfloat16 b;
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        b.x = 0x7fffu;
        return b;
    }
    const uint32_t lsb = (x >> 16) & 1u;
    b.x = (unsigned short)((x + 0x7fffu + lsb) >> 16);
    return b;
}

// Warp shuffles of one value (emu_warp.h, force-included before this header).
EMU_SHUFFLES(__nv_bfloat16)
