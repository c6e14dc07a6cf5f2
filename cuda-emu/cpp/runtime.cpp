// Runs one kernel launch on the CPU: blocks one after another, the threads of a block as fibers
// of the calling OS thread, switched at __syncthreads() and at the end of the kernel.
//
// The switch is a few instructions of x86-64 assembly (callee-saved registers and the stack
// pointer), not swapcontext, which makes a system call per switch.
#include <sys/mman.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

extern "C" {
uint3 emu_thread_idx;
uint3 emu_block_idx;
dim3 emu_block_dim;
dim3 emu_grid_dim;
}

namespace {

constexpr size_t kStack = 64 * 1024;
constexpr size_t kGuard = 4096;  // an inaccessible page below each stack
constexpr unsigned kMaxThreads = 1024;

struct Fiber {
    void* sp;
    bool done;
};

Fiber fibers[kMaxThreads];
char* stacks = nullptr;
void* sched_sp = nullptr;
Fiber* current = nullptr;
const EmuKernel* kernel = nullptr;
void** params = nullptr;

}  // namespace

extern "C" __attribute__((visibility("hidden"))) void emu_switch(void** save, void* to);
extern "C" __attribute__((visibility("hidden"))) void emu_fiber_trampoline(void);

asm(R"(
    .text
    .globl emu_switch
    .hidden emu_switch
    .type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch

    .globl emu_fiber_trampoline
    .hidden emu_fiber_trampoline
    .type emu_fiber_trampoline,@function
emu_fiber_trampoline:
    movq %r12, %rdi
    call emu_fiber_main
    ud2
    .size emu_fiber_trampoline, .-emu_fiber_trampoline
)");

extern "C" __attribute__((visibility("hidden"), used)) void emu_fiber_main(Fiber* f) {
    kernel->invoke(params);
    f->done = true;
    emu_switch(&f->sp, sched_sp);
    std::abort();  // a finished fiber is never resumed
}

extern "C" void emu_syncthreads(void) {
    if (current == nullptr) std::abort();
    emu_switch(&current->sp, sched_sp);
}

// Prepares fiber i to start the kernel at its first switch: the stack holds six callee-saved
// register slots (r12 carries the fiber) and the trampoline as the return address, placed so
// that the trampoline starts with a 16-byte aligned stack.
static void start_fiber(unsigned i) {
    char* top = stacks + (size_t)(i + 1) * (kStack + kGuard);
    void** sp = (void**)(top - 72);
    for (int k = 0; k < 6; ++k) sp[k] = nullptr;
    sp[3] = &fibers[i];  // r12
    sp[6] = (void*)&emu_fiber_trampoline;
    fibers[i].sp = sp;
    fibers[i].done = false;
}

// Bounds of the shared-memory section (emu_rt.h), defined by the linker.
extern "C" char __start_emu_shared __attribute__((weak));
extern "C" char __stop_emu_shared __attribute__((weak));

// Returns 0; 1 when the launch shape is not one this runtime can run; 2 when the threads of a
// block disagree on __syncthreads().
extern "C" int emu_launch(const EmuKernel* k, const unsigned* grid, const unsigned* block,
                          void** kernel_params) {
    const unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
    if (threads == 0 || threads > kMaxThreads || grid[0] == 0 || grid[1] == 0 || grid[2] == 0)
        return 1;
    if (stacks == nullptr) {
        const size_t slot = kStack + kGuard;
        void* m = mmap(nullptr, slot * kMaxThreads, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return 1;
        // Stack i is [i * slot + kGuard, (i + 1) * slot): an overflow faults on the guard.
        for (unsigned i = 0; i < kMaxThreads; ++i)
            if (mprotect((char*)m + (size_t)i * slot, kGuard, PROT_NONE) != 0) return 1;
        stacks = (char*)m;
    }
    kernel = k;
    params = kernel_params;
    emu_grid_dim = dim3{grid[0], grid[1], grid[2]};
    emu_block_dim = dim3{block[0], block[1], block[2]};
    const unsigned n = (unsigned)threads;
    for (unsigned bz = 0; bz < grid[2]; ++bz)
        for (unsigned by = 0; by < grid[1]; ++by)
            for (unsigned bx = 0; bx < grid[0]; ++bx) {
                emu_block_idx = uint3{bx, by, bz};
                if (&__stop_emu_shared > &__start_emu_shared)
                    memset(&__start_emu_shared, 0xff, &__stop_emu_shared - &__start_emu_shared);
                for (unsigned i = 0; i < n; ++i) start_fiber(i);
                unsigned alive = n;
                // Each phase runs every live thread to its next barrier or its end, in
                // ascending order in even phases and descending in odd ones, so a thread that
                // reads another's write without a barrier between sees it missing in one of
                // them. In a phase, either every live thread reaches the barrier or every one
                // ends: anything else is a __syncthreads() not reached by the whole block.
                for (unsigned phase = 0; alive > 0; ++phase) {
                    unsigned ended = 0;
                    for (unsigned k = 0; k < n; ++k) {
                        const unsigned i = (phase & 1) ? n - 1 - k : k;
                        Fiber& f = fibers[i];
                        if (f.done) continue;
                        emu_thread_idx = uint3{i % block[0], (i / block[0]) % block[1],
                                               i / (block[0] * block[1])};
                        current = &f;
                        emu_switch(&sched_sp, f.sp);
                        current = nullptr;
                        if (f.done) ++ended;
                    }
                    if (ended != 0 && ended != alive) {
                        // Abandon the waiting fibers (their stacks are reused).
                        kernel = nullptr;
                        params = nullptr;
                        return 2;
                    }
                    alive -= ended;
                }
            }
    kernel = nullptr;
    params = nullptr;
    return 0;
}

// The shims' conversions, for the emulator's own tests against the `half` crate.
extern "C" unsigned short emu_f32_to_f16(float x) { return __float2half_rn(x).x; }
extern "C" float emu_f16_to_f32(unsigned short x) { return __half2float(__half{x}); }
extern "C" unsigned short emu_f32_to_bf16(float x) { return __float2bfloat16_rn(x).x; }
extern "C" float emu_bf16_to_f32(unsigned short x) { return __bfloat162float(__nv_bfloat16{x}); }
