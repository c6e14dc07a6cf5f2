// Runs one kernel launch on the CPU: blocks one after another, the threads of a block as fibers
// of the calling OS thread, switched at __syncthreads(), at warp operations (warp.cpp) and at
// the end of the kernel.
//
// The switch is a few instructions of x86-64 assembly (callee-saved registers and the stack
// pointer), not swapcontext, which makes a system call per switch.
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "emu.h"

extern "C" {
uint3 emu_thread_idx;
uint3 emu_block_idx;
dim3 emu_block_dim;
dim3 emu_grid_dim;
}

namespace emu {

Fiber fibers[kMaxThreads];
unsigned block_threads = 0;
Fiber* current = nullptr;

namespace {

constexpr size_t kStack = 64 * 1024;
constexpr size_t kGuard = 4096;  // an inaccessible page below each stack
constexpr size_t kSlot = kStack + kGuard;

char* stacks = nullptr;
void* sched_sp = nullptr;
const EmuKernel* kernel = nullptr;
void** params = nullptr;
unsigned long long launches = 0;

// The fault that ends the current launch (return code 3), if any.
char fault_msg[512];
bool fault_pending = false;

}  // namespace
}  // namespace emu

using namespace emu;

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
    f->state = kDone;
    emu_switch(&f->sp, sched_sp);
    std::abort();  // a finished fiber is never resumed
}

void emu::yield_to_scheduler() {
    if (current == nullptr) std::abort();
    emu_switch(&current->sp, sched_sp);
}

void emu::fault(const char* fmt, ...) {
    const int n = snprintf(fault_msg, sizeof fault_msg, "block (%u, %u, %u): ", emu_block_idx.x,
                           emu_block_idx.y, emu_block_idx.z);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fault_msg + n, sizeof fault_msg - (size_t)n, fmt, ap);
    va_end(ap);
    fault_pending = true;
    if (current != nullptr) {
        current->state = kDone;
        emu_switch(&current->sp, sched_sp);
        std::abort();  // a faulted fiber is never resumed
    }
}

extern "C" void emu_syncthreads(void) {
    if (current == nullptr) std::abort();
    current->state = kBarrier;
    yield_to_scheduler();
}

extern "C" const char* emu_fault_message(void) { return fault_msg; }

// Prepares fiber i to start the kernel at its first switch: the stack holds six callee-saved
// register slots (r12 carries the fiber) and the trampoline as the return address, placed so
// that the trampoline starts with a 16-byte aligned stack.
static void start_fiber(unsigned i) {
    char* top = stacks + (size_t)(i + 1) * kSlot;
    void** sp = (void**)(top - 72);
    for (int k = 0; k < 6; ++k) sp[k] = nullptr;
    sp[3] = &fibers[i];  // r12
    sp[6] = (void*)&emu_fiber_trampoline;
    fibers[i].sp = sp;
    fibers[i].state = kReady;
}

// ---------------------------------------------------------------------------------------------
// Dynamic shared memory: one region at a fixed address, so that `extern __shared__` arrays can
// be references bound once (emu_rt.h). The launch's bytes start on a page boundary, after an
// inaccessible page; the pages after its size, rounded up to a page, are inaccessible too, and
// the bytes between its end and that page boundary are checked after each block.

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kDynMax = 227 * 1024;  // sm_90's opt-in maximum per block
constexpr size_t kDynSpan = (kDynMax + kPage - 1) / kPage * kPage;
static_assert(kPage == 4096, "the .set below places the buffer one page into the region");
size_t dyn_bytes = 0;          // this launch's
size_t dyn_open = (size_t)-1;  // the accessible bytes (a multiple of kPage); unknown at first

}  // namespace

extern "C" {
__attribute__((aligned(4096), visibility("hidden"))) unsigned char
    emu_dyn_region[kPage + kDynSpan + kPage];
}
asm(R"(
    .globl emu_dynamic_shared
    .hidden emu_dynamic_shared
    .set emu_dynamic_shared, emu_dyn_region + 4096
)");

static unsigned char* dyn_data() { return emu_dyn_region + kPage; }

// Opens the first `bytes` (rounded up to a page) of the region and closes the rest.
static bool open_dynamic_shared(size_t bytes) {
    const size_t open = (bytes + kPage - 1) / kPage * kPage;
    if (open == dyn_open) return true;
    if (dyn_open == (size_t)-1 && mprotect(emu_dyn_region, kPage, PROT_NONE) != 0) return false;
    if (open > 0 && mprotect(dyn_data(), open, PROT_READ | PROT_WRITE) != 0) return false;
    if (mprotect(dyn_data() + open, kDynSpan + kPage - open, PROT_NONE) != 0) return false;
    dyn_open = open;
    return true;
}

// After a block: the bytes past the launch's size up to the page boundary must still be 0xff.
static bool dynamic_shared_intact() {
    for (size_t i = dyn_bytes; i < dyn_open; ++i) {
        if (dyn_data()[i] != 0xff) {
            fault("a thread wrote byte %zu of dynamic shared memory, past the launch's %zu bytes "
                  "(sharedMemBytes)",
                  i, dyn_bytes);
            return false;
        }
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// Memory faults of a kernel thread: an access to the inaccessible pages around the dynamic
// shared memory, or a stack overflow (when the thread has an alternate signal stack to report
// it on, as Rust's threads do), ends the launch with a fault instead of the process.

namespace {

sigjmp_buf launch_jump;
volatile sig_atomic_t in_launch = 0;
struct sigaction previous_segv;

void on_segv(int, siginfo_t* si, void*) {
    const unsigned char* a = (const unsigned char*)si->si_addr;
    const unsigned char* stack_lo = (const unsigned char*)stacks;
    if (in_launch && current != nullptr) {
        const unsigned t = (unsigned)(current - fibers);
        const unsigned char* data = dyn_data();
        bool ours = true;
        current = nullptr;  // fault() records the message and returns
        if (a >= emu_dyn_region && a < data)
            fault("thread %u accessed dynamic shared memory %zu bytes before its start", t,
                  (size_t)(data - a));
        else if (a >= data + dyn_open && a < data + kDynSpan + kPage)
            fault("thread %u accessed byte %zu of dynamic shared memory, past the launch's %zu "
                  "bytes (sharedMemBytes)",
                  t, (size_t)(a - data), dyn_bytes);
        else if (stack_lo != nullptr && a >= stack_lo && a < stack_lo + kSlot * kMaxThreads &&
                 (size_t)(a - stack_lo) % kSlot < kGuard)
            fault("thread %zu overflowed its %zu KiB stack", (size_t)(a - stack_lo) / kSlot,
                  kStack / 1024);
        else
            ours = false;
        if (ours) siglongjmp(launch_jump, 1);
    }
    // Not the kernel's: fault again under the handler there was before.
    sigaction(SIGSEGV, &previous_segv, nullptr);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Blocks and launches.

// Runs the block `emu_block_idx`. Returns 0; 2 when some threads end while others wait at
// __syncthreads(); 3 after a fault (fault_msg).
static int run_block(const unsigned* block) {
    const unsigned n = block_threads;
    for (unsigned i = 0; i < n; ++i) start_fiber(i);
    unsigned live = n;
    unsigned ended = 0;  // since the last barrier
    // Each pass runs every runnable thread to its next barrier, warp operation or end, in
    // ascending order in even passes and descending in odd ones, so a thread that reads
    // another's write without a barrier between sees it missing in one of them.
    for (unsigned pass = 0;; ++pass) {
        for (unsigned k = 0; k < n; ++k) {
            const unsigned i = (pass & 1) ? n - 1 - k : k;
            Fiber& f = fibers[i];
            if (f.state != kReady) continue;
            emu_thread_idx =
                uint3{i % block[0], (i / block[0]) % block[1], i / (block[0] * block[1])};
            current = &f;
            emu_switch(&sched_sp, f.sp);
            current = nullptr;
            if (fault_pending) return 3;
            if (f.state == kDone) {
                --live;
                ++ended;
            }
        }
        if (live == 0) return 0;
        const int released = resolve_warps();
        if (released < 0) return 3;
        if (released > 0) continue;
        if (stuck_warps()) return 3;
        // Every live thread waits at __syncthreads(): the barrier completes unless a thread
        // ended since the last one (it will never reach it).
        if (ended != 0) return 2;
        for (unsigned i = 0; i < n; ++i)
            if (fibers[i].state == kBarrier) fibers[i].state = kReady;
    }
}

// Bounds of the shared-memory section (emu_rt.h), defined by the linker.
extern "C" char __start_emu_shared __attribute__((weak));
extern "C" char __stop_emu_shared __attribute__((weak));

static int run_grid(const unsigned* grid, const unsigned* block) {
    const unsigned long long blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    // Every other launch runs its blocks in reverse order, so a result that depends on the
    // order of blocks (of atomics across blocks, say) changes from launch to launch.
    const bool reverse = (launches & 1) != 0;
    for (unsigned long long q = 0; q < blocks; ++q) {
        const unsigned long long b = reverse ? blocks - 1 - q : q;
        emu_block_idx = uint3{(unsigned)(b % grid[0]), (unsigned)(b / grid[0] % grid[1]),
                              (unsigned)(b / ((unsigned long long)grid[0] * grid[1]))};
        if (&__stop_emu_shared > &__start_emu_shared)
            memset(&__start_emu_shared, 0xff, &__stop_emu_shared - &__start_emu_shared);
        memset(dyn_data(), 0xff, dyn_open);
        const int r = run_block(block);
        if (r != 0) return r;
        if (!dynamic_shared_intact()) return 3;
    }
    return 0;
}

// Returns 0; 1 when the launch shape is not one this runtime can run; 2 when the threads of a
// block disagree on __syncthreads(); 3 after another fault, which emu_fault_message() describes.
extern "C" int emu_launch(const EmuKernel* k, const unsigned* grid, const unsigned* block,
                          void** kernel_params, unsigned shared_bytes) {
    const unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
    if (threads == 0 || threads > kMaxThreads || grid[0] == 0 || grid[1] == 0 || grid[2] == 0 ||
        shared_bytes > kDynMax)
        return 1;
    if (stacks == nullptr) {
        void* m = mmap(nullptr, kSlot * kMaxThreads, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return 1;
        // Stack i is [i * kSlot + kGuard, (i + 1) * kSlot): an overflow faults on the guard.
        for (unsigned i = 0; i < kMaxThreads; ++i)
            if (mprotect((char*)m + (size_t)i * kSlot, kGuard, PROT_NONE) != 0) return 1;
        stacks = (char*)m;
    }
    if (!open_dynamic_shared(shared_bytes)) return 1;
    dyn_bytes = shared_bytes;
    kernel = k;
    params = kernel_params;
    emu_grid_dim = dim3{grid[0], grid[1], grid[2]};
    emu_block_dim = dim3{block[0], block[1], block[2]};
    block_threads = (unsigned)threads;
    fault_pending = false;
    fault_msg[0] = 0;

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &previous_segv);
    volatile int r = 3;
    if (sigsetjmp(launch_jump, 1) == 0) {
        in_launch = 1;
        r = run_grid(grid, block);
    }
    // Here after the launch, or after a memory fault of a thread (its fibers are abandoned;
    // their stacks are reused).
    in_launch = 0;
    sigaction(SIGSEGV, &previous_segv, nullptr);
    current = nullptr;
    kernel = nullptr;
    params = nullptr;
    ++launches;
    return r;
}

// The shims' conversions, for the emulator's own tests against the `half` crate.
extern "C" unsigned short emu_f32_to_f16(float x) { return __float2half_rn(x).x; }
extern "C" float emu_f16_to_f32(unsigned short x) { return __half2float(__half{x}); }
extern "C" unsigned short emu_f32_to_bf16(float x) { return __float2bfloat16_rn(x).x; }
extern "C" float emu_bf16_to_f32(unsigned short x) { return __bfloat162float(__nv_bfloat16{x}); }
