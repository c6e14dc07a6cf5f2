// Warp operations (shim/emu_warp.h) as warp barriers of the fiber scheduler: a lane records its
// operation and operand in its fiber and switches out; once every lane the mask names waits at
// the same operation, the scheduler (runtime.cpp) calls resolve_warps(), which hands each lane
// its result and makes it runnable again. The rules, and what is a fault, are in
// cuda-emu/src/lib.rs ("Warps").
#include "emu.h"

#include <cstdio>
#include <cstdlib>

namespace emu {
namespace {

const char* op_name(int kind) {
    switch (kind) {
        case EMU_WARP_SHFL_IDX: return "__shfl_sync";
        case EMU_WARP_SHFL_UP: return "__shfl_up_sync";
        case EMU_WARP_SHFL_DOWN: return "__shfl_down_sync";
        case EMU_WARP_SHFL_XOR: return "__shfl_xor_sync";
        case EMU_WARP_SYNC: return "__syncwarp";
        case EMU_WARP_BALLOT: return "__ballot_sync";
        case EMU_WARP_ALL: return "__all_sync";
        case EMU_WARP_ANY: return "__any_sync";
        case EMU_WARP_ACTIVE: return "__activemask";
        default: return "an unknown warp operation";
    }
}

bool is_shuffle(int kind) { return kind >= EMU_WARP_SHFL_IDX && kind <= EMU_WARP_SHFL_XOR; }

// The same operation: intrinsic, mask and, for shuffles, width and number of 32-bit words (a
// 64-bit shuffle is two 32-bit ones on a GPU). The source lane or offset may differ by lane.
bool same_op(const WarpOp& a, const WarpOp& b) {
    if (a.kind != b.kind || a.mask != b.mask) return false;
    if (!is_shuffle(a.kind)) return true;
    return a.width == b.width && (a.size + 3) / 4 == (b.size + 3) / 4;
}

// Describes an operation into `buf`, e.g. "__shfl_xor_sync(mask 0xffffffff, width 32, 4 bytes)".
const char* describe(const WarpOp& op, char* buf, size_t len) {
    if (is_shuffle(op.kind))
        snprintf(buf, len, "%s(mask %#010x, width %d, %d bytes)", op_name(op.kind), op.mask,
                 op.width, op.size);
    else
        snprintf(buf, len, "%s(mask %#010x)", op_name(op.kind), op.mask);
    return buf;
}

// The lane a shuffle reads, as PTX's shfl.sync computes it from the lane, b (source lane,
// delta or lane mask; its low 5 bits) and the clamp operand CUDA passes for `width`:
// ((32 - width) << 8) | 31, or (32 - width) << 8 for __shfl_up_sync. A lane whose source falls
// outside its segment reads its own value.
int source_lane(int kind, int lane, int b, int width) {
    const int segmask = (32 - width) & 31;
    const int cval = kind == EMU_WARP_SHFL_UP ? 0 : 31;
    const int bval = b & 31;
    const int max_lane = (lane & segmask) | (cval & ~segmask);
    const int min_lane = lane & segmask;
    int j;
    bool in;
    switch (kind) {
        case EMU_WARP_SHFL_UP:
            j = lane - bval;
            in = j >= max_lane;
            break;
        case EMU_WARP_SHFL_DOWN:
            j = lane + bval;
            in = j <= max_lane;
            break;
        case EMU_WARP_SHFL_XOR:
            j = lane ^ bval;
            in = j <= max_lane;
            break;
        default:
            j = min_lane | (bval & ~segmask);
            in = j <= max_lane;
            break;
    }
    return in ? j : lane;
}

// Hands every lane of `mask` in the warp starting at thread `base` its result.
void complete(unsigned base, unsigned mask) {
    unsigned ballot = 0;
    for (unsigned j = 0; j < kWarpSize; ++j)
        if ((mask >> j & 1u) && fibers[base + j].op.value != 0) ballot |= 1u << j;
    for (unsigned l = 0; l < kWarpSize; ++l) {
        if (!(mask >> l & 1u)) continue;
        Fiber& f = fibers[base + l];
        switch (f.op.kind) {
            case EMU_WARP_SYNC: f.result = 0; break;
            case EMU_WARP_BALLOT: f.result = ballot; break;
            case EMU_WARP_ALL: f.result = ballot == mask; break;
            case EMU_WARP_ANY: f.result = ballot != 0; break;
            default: {
                const int j = source_lane(f.op.kind, (int)l, f.op.b, f.op.width);
                // A lane outside the mask is not taking part: what it holds is undefined.
                f.result = (mask >> j & 1u) ? fibers[base + (unsigned)j].op.value : ~0ull;
                break;
            }
        }
        f.state = kReady;
    }
}

}  // namespace

int resolve_warps() {
    int released = 0;
    const unsigned n = block_threads;
    for (unsigned t = 0; t < n; ++t) {
        const Fiber& f = fibers[t];
        if (f.state != kWarp) continue;
        const unsigned base = t & ~(kWarpSize - 1);
        if (f.op.kind == EMU_WARP_ACTIVE) {
            // Every lane of the warp waiting at __activemask() now is active with the others.
            unsigned active = 0;
            for (unsigned j = 0; j < kWarpSize && base + j < n; ++j)
                if (fibers[base + j].state == kWarp && fibers[base + j].op.kind == EMU_WARP_ACTIVE)
                    active |= 1u << j;
            for (unsigned j = 0; j < kWarpSize; ++j) {
                if (!(active >> j & 1u)) continue;
                fibers[base + j].result = active;
                fibers[base + j].state = kReady;
            }
            ++released;
            continue;
        }
        bool ready = true;
        for (unsigned j = 0; j < kWarpSize; ++j) {
            if (!(f.op.mask >> j & 1u)) continue;
            const unsigned u = base + j;
            char d[96];
            if (u >= n) {
                fault("thread %u (warp %u, lane %u) calls %s, which names lane %u, but the "
                      "block's %u threads leave that lane empty",
                      t, t / kWarpSize, t % kWarpSize, describe(f.op, d, sizeof d), j, n);
                return -1;
            }
            if (fibers[u].state == kDone) {
                fault("thread %u (warp %u, lane %u) calls %s, which names lane %u (thread %u), "
                      "which has exited",
                      t, t / kWarpSize, t % kWarpSize, describe(f.op, d, sizeof d), j, u);
                return -1;
            }
            if (fibers[u].state != kWarp || !same_op(fibers[u].op, f.op)) ready = false;
        }
        if (ready) {
            complete(base, f.op.mask);
            ++released;
        }
    }
    return released;
}

bool stuck_warps() {
    const unsigned n = block_threads;
    for (unsigned t = 0; t < n; ++t) {
        const Fiber& f = fibers[t];
        if (f.state != kWarp) continue;
        const unsigned base = t & ~(kWarpSize - 1);
        char d[96], e[96];
        for (unsigned j = 0; j < kWarpSize; ++j) {
            const unsigned u = base + j;
            if (!(f.op.mask >> j & 1u) || u >= n) continue;
            const Fiber& g = fibers[u];
            if (g.state == kBarrier) {
                fault("thread %u (warp %u, lane %u) waits at %s for lane %u (thread %u), which "
                      "waits at __syncthreads()",
                      t, t / kWarpSize, t % kWarpSize, describe(f.op, d, sizeof d), j, u);
                return true;
            }
            if (g.state == kWarp && !same_op(g.op, f.op)) {
                fault("lanes %u and %u of warp %u reach different warp operations, %s and %s: "
                      "every lane a mask names must make the same warp calls in the same order",
                      t % kWarpSize, j, t / kWarpSize, describe(f.op, d, sizeof d),
                      describe(g.op, e, sizeof e));
                return true;
            }
        }
        fault("thread %u waits at %s, which cannot complete", t, describe(f.op, d, sizeof d));
        return true;
    }
    return false;
}

}  // namespace emu

using namespace emu;

extern "C" __attribute__((visibility("hidden"))) const int warpSize = 32;

extern "C" unsigned long long emu_warp_op(int kind, unsigned mask, unsigned long long value,
                                          int size, int b, int width) {
    Fiber* f = current;
    if (f == nullptr) std::abort();  // called outside a kernel
    const unsigned t = (unsigned)(f - fibers);
    const unsigned lane = t % kWarpSize;
    if (!(mask >> lane & 1u))
        fault("thread %u (warp %u, lane %u) calls %s with mask %#010x, which does not name its "
              "own lane",
              t, t / kWarpSize, lane, op_name(kind), mask);
    if (is_shuffle(kind) && (width < 1 || width > 32 || (width & (width - 1)) != 0))
        fault("thread %u calls %s with width %d: it must be a power of 2 from 1 to 32", t,
              op_name(kind), width);
    f->op = WarpOp{kind, mask, b, width, size, value};
    f->state = kWarp;
    yield_to_scheduler();
    return f->result;
}

extern "C" unsigned emu_activemask(void) {
    Fiber* f = current;
    if (f == nullptr) std::abort();  // called outside a kernel
    const unsigned t = (unsigned)(f - fibers);
    return (unsigned)emu_warp_op(EMU_WARP_ACTIVE, 1u << (t % kWarpSize), 0, 0, 0, warpSize);
}
