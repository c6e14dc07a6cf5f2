// Atomic functions on the host. The blocks of a launch run one after another and the threads of
// a block switch only at barriers and warp operations, so a plain read-modify-write is atomic
// here; each returns the value the memory held before, as CUDA's do. Integer arithmetic wraps.
// The fp32 add rounds to nearest even and flushes subnormal operands and results to zero of the
// same sign, as PTX documents for atom.add.f32; the fp64 add is the plain IEEE add. There is no
// fp32 atomicMax/atomicMin: CUDA has none either.
#pragma once
#include <cstdint>
#include <cstring>

inline float emu_ftz(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    std::memcpy(&x, &u, 4);
    return x;
}

#define EMU_ATOMIC(name, T, expr)   \
    inline T name(T* address, T val) { \
        const T old = *address;     \
        *address = (expr);          \
        return old;                 \
    }

// Wrapping integer add and subtract, through the unsigned type.
#define EMU_WRAP(T, U, op) (T)((U)old op (U)val)

EMU_ATOMIC(atomicAdd, int, EMU_WRAP(int, unsigned, +))
EMU_ATOMIC(atomicAdd, unsigned int, old + val)
EMU_ATOMIC(atomicAdd, unsigned long long, old + val)
EMU_ATOMIC(atomicAdd, float, emu_ftz(emu_ftz(old) + emu_ftz(val)))
EMU_ATOMIC(atomicAdd, double, old + val)
EMU_ATOMIC(atomicSub, int, EMU_WRAP(int, unsigned, -))
EMU_ATOMIC(atomicSub, unsigned int, old - val)
EMU_ATOMIC(atomicExch, int, val)
EMU_ATOMIC(atomicExch, unsigned int, val)
EMU_ATOMIC(atomicExch, unsigned long long, val)
EMU_ATOMIC(atomicExch, float, val)
EMU_ATOMIC(atomicMin, int, val < old ? val : old)
EMU_ATOMIC(atomicMin, unsigned int, val < old ? val : old)
EMU_ATOMIC(atomicMin, long long, val < old ? val : old)
EMU_ATOMIC(atomicMin, unsigned long long, val < old ? val : old)
EMU_ATOMIC(atomicMax, int, val > old ? val : old)
EMU_ATOMIC(atomicMax, unsigned int, val > old ? val : old)
EMU_ATOMIC(atomicMax, long long, val > old ? val : old)
EMU_ATOMIC(atomicMax, unsigned long long, val > old ? val : old)
EMU_ATOMIC(atomicAnd, int, old & val)
EMU_ATOMIC(atomicAnd, unsigned int, old & val)
EMU_ATOMIC(atomicAnd, unsigned long long, old & val)
EMU_ATOMIC(atomicOr, int, old | val)
EMU_ATOMIC(atomicOr, unsigned int, old | val)
EMU_ATOMIC(atomicOr, unsigned long long, old | val)
EMU_ATOMIC(atomicXor, int, old ^ val)
EMU_ATOMIC(atomicXor, unsigned int, old ^ val)
EMU_ATOMIC(atomicXor, unsigned long long, old ^ val)
// ((old >= val) ? 0 : (old + 1)) and (((old == 0) || (old > val)) ? val : (old - 1)).
EMU_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
EMU_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)

#undef EMU_WRAP
#undef EMU_ATOMIC

#define EMU_CAS(T)                                                \
    inline T atomicCAS(T* address, T compare, T val) {            \
        const T old = *address;                                   \
        if (old == compare) *address = val;                       \
        return old;                                               \
    }
EMU_CAS(int)
EMU_CAS(unsigned int)
EMU_CAS(unsigned long long)
EMU_CAS(unsigned short)
#undef EMU_CAS

// Memory fences order nothing here: every access is seen at once by whatever runs next.
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
