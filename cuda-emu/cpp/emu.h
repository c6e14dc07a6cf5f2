// The runtime's own declarations, shared by runtime.cpp (fibers, blocks, launches) and warp.cpp
// (warp operations).
#pragma once

namespace emu {

enum State : unsigned char {
    kReady,    // runs at the next pass
    kBarrier,  // waits at __syncthreads()
    kWarp,     // waits at a warp operation (`op`)
    kDone,     // returned from the kernel
};

struct WarpOp {
    int kind;   // EMU_WARP_* (shim/emu_warp.h)
    unsigned mask;
    int b;      // source lane, delta or lane mask (shuffles)
    int width;  // shuffle segment width
    int size;   // operand bytes (shuffles)
    unsigned long long value;
};

struct Fiber {
    void* sp;
    State state;
    WarpOp op;
    unsigned long long result;
};

constexpr unsigned kMaxThreads = 1024;
constexpr unsigned kWarpSize = 32;

extern Fiber fibers[kMaxThreads];
// The threads of the running block, and the running fiber (null in the scheduler).
extern unsigned block_threads;
extern Fiber* current;

// Switches from the running fiber to the scheduler; returns when the scheduler resumes it.
void yield_to_scheduler();

// Ends the launch with a fault saying `fmt` (printf-style): from a fiber, it never returns; from
// the scheduler, it records the message and returns (the scheduler then abandons the block).
void fault(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Completes the warp operations whose lanes have all arrived. Returns how many groups of lanes
// it released, or -1 after a fault (an operation that can never complete).
int resolve_warps();

// Called when no fiber can run and no warp operation can complete: faults when a fiber waits at
// a warp operation (returns true), else returns false.
bool stuck_warps();

}  // namespace emu
