// Host stand-in for <cuda_fp16.h>: the fp16 type and the conversions the kernels use, with the
// results of the GPU's cvt instructions (round to nearest even; any NaN becomes 0x7fff).
#pragma once
#include <cstdint>
#include <cstring>

struct __half {
    unsigned short x;
};

inline float __half2float(__half h) {
    const uint32_t sign = (uint32_t)(h.x & 0x8000u) << 16;
    const uint32_t exp = (h.x >> 10) & 0x1fu;
    uint32_t mant = h.x & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {
        // Subnormal: normalise.
        uint32_t e = 113u;
        while ((mant & 0x400u) == 0) {
            mant <<= 1;
            --e;
        }
        bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline __half __float2half_rn(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t u = x & 0x7fffffffu;
    __half h;
    if (u > 0x7f800000u) {
        h.x = 0x7fffu;
        return h;
    }
    if (u == 0x7f800000u) {
        h.x = (unsigned short)(sign | 0x7c00u);
        return h;
    }
    if (u >= 0x477ff000u) {  // rounds to infinity
        h.x = (unsigned short)(sign | 0x7c00u);
        return h;
    }
    if (u >= 0x38800000u) {  // normal in fp16
        const uint32_t r = u - 0x38000000u;
        uint32_t v = r >> 13;
        const uint32_t rem = r & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (v & 1u))) ++v;
        h.x = (unsigned short)(sign | v);
        return h;
    }
    if (u < 0x33000001u) {  // rounds to zero (0x33000000 is exactly half the least subnormal)
        h.x = (unsigned short)sign;
        return h;
    }
    // Subnormal in fp16.
    const uint32_t e = u >> 23;
    const uint32_t m = (u & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // m * 2^(e-150) / 2^-24 = m >> (126 - e)
    uint32_t v = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (v & 1u))) ++v;
    h.x = (unsigned short)(sign | v);
    return h;
}

// Warp shuffles of one value (emu_warp.h, force-included before this header).
EMU_SHUFFLES(__half)
