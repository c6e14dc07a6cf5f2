// Test kernels of the emulator's atomics and dynamic shared memory (cuda-emu/tests/memory.rs).
// Compiled into the emulator with the crate's kernels (build.rs), and by NVRTC in
// tests/nvrtc.rs: this file must stay valid CUDA.

struct EmuTestAtomics {
    unsigned counter;
    int imin, imax;
    unsigned umin, umax;
    unsigned long long ullmax, ullmin, ullsum;
    float fsum;
    double dsum;
    int icas;  // incremented by a CAS loop
    unsigned ucas;
    unsigned long long ullcas;
    unsigned short scas[2];
    unsigned exch;
    int isum;
};

// Thread g (of the whole grid) takes a ticket from `counter` into tickets[g], and folds g into
// every other field; exch_seen[g] is what atomicExch replaced.
extern "C" __global__ void emu_test_atomics(EmuTestAtomics* a, unsigned* tickets,
                                            unsigned* exch_seen) {
    const unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
    tickets[g] = atomicAdd(&a->counter, 1u);
    atomicMin(&a->imin, (int)g - 100);
    atomicMax(&a->imax, (int)g - 100);
    atomicMin(&a->umin, g + 7);
    atomicMax(&a->umax, g + 7);
    atomicMax(&a->ullmax, (unsigned long long)g << 40);
    atomicMin(&a->ullmin, ((unsigned long long)g + 1) << 40);
    atomicAdd(&a->ullsum, (unsigned long long)g << 32);
    atomicAdd(&a->fsum, (float)g);
    atomicAdd(&a->dsum, 0.25 * g);
    atomicAdd(&a->isum, -(int)g);
    int old = a->icas, seen;
    while ((seen = atomicCAS(&a->icas, old, old + 2)) != old) old = seen;
    unsigned uold = a->ucas, useen;
    while ((useen = atomicCAS(&a->ucas, uold, uold + 3u)) != uold) uold = useen;
    unsigned long long lold = a->ullcas, lseen;
    while ((lseen = atomicCAS(&a->ullcas, lold, lold + 5ull)) != lold) lold = lseen;
    unsigned short sold = a->scas[0], sseen;
    while ((sseen = atomicCAS(&a->scas[0], sold, (unsigned short)(sold + 1))) != sold) sold = sseen;
    exch_seen[g] = atomicExch(&a->exch, g);
}

// out[block] = the order in which the block ran (a ticket from `counter`).
extern "C" __global__ void emu_test_block_order(unsigned* counter, unsigned* out) {
    if (threadIdx.x == 0) out[blockIdx.x] = atomicAdd(counter, 1u);
}

// Dynamic shared memory declared at file scope, and read through another type (build.rs
// rewrites each `extern __shared__ T name[];` outside comments, like this one, and strings).
extern __shared__ unsigned emu_test_dyn_words[];

// `words` unsigned words of dynamic shared memory per block (blockDim.x <= words): thread t
// records in before[block * blockDim.x + t] the word it finds at t before anyone writes, then
// writes 1000 * block + t there; after a barrier it reads the word of thread blockDim.x - 1 - t
// (into after[...]) and the last word of the buffer through a byte view (into last[block]).
// Thread 0 of the last block then stores 0 at word `poke`, when poke is not ~0u.
extern "C" __global__ void emu_test_dynamic_shared(unsigned* before, unsigned* after,
                                                   unsigned* last, unsigned words, unsigned poke) {
    extern __shared__ unsigned char emu_test_dyn_bytes[];
    const unsigned t = threadIdx.x, b = blockIdx.x;
    before[b * blockDim.x + t] = emu_test_dyn_words[t];
    emu_test_dyn_words[t] = 1000 * b + t;
    __syncthreads();
    after[b * blockDim.x + t] = emu_test_dyn_words[blockDim.x - 1 - t];
    if (t == 0) {
        const unsigned* w = reinterpret_cast<const unsigned*>(emu_test_dyn_bytes);
        last[b] = w[words - 1];
        if (poke != ~0u && b == gridDim.x - 1) emu_test_dyn_words[poke] = 0;
    }
}

// Reads word `at` of dynamic shared memory into out[0].
extern "C" __global__ void emu_test_dynamic_read(unsigned* out, unsigned long long at) {
    out[0] = emu_test_dyn_words[at];
}

__device__ unsigned emu_test_deep(volatile unsigned* pad_out, unsigned n) {
    volatile unsigned pad[64];
    pad[n % 64] = n;
    if (n == 0) return pad[0];
    return emu_test_deep(pad_out, n - 1) + pad[n % 64];
}

// Recurses `n` deep, with a 256-byte frame each: deep enough overflows the emulator's stacks.
extern "C" __global__ void emu_test_recurse(unsigned* out, unsigned n) {
    out[0] = emu_test_deep(out, n);
}
