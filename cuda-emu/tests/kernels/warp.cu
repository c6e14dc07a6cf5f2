// Test kernels of the emulator's warp operations (cuda-emu/tests/warp.rs). Compiled into the
// emulator with the crate's kernels (build.rs), and by NVRTC in tests/nvrtc.rs: this file must
// stay valid CUDA.

__device__ __forceinline__ unsigned emu_test_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

__device__ __forceinline__ double emu_test_warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

// One sum per block of x[0..n): each thread sums a grid-stride slice, warps reduce with
// __shfl_down_sync into dynamic shared memory (blockDim.x / 32 doubles at launch), and the first
// warp reduces those with __shfl_xor_sync. blockDim.x is a multiple of 32.
extern "C" __global__ void emu_test_block_sum(const double* x, double* out, unsigned long long n) {
    extern __shared__ double warp_sums[];
    double v = 0.0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        v += x[i];
    v = emu_test_warp_sum(v);
    const unsigned lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const unsigned warps = blockDim.x / warpSize;
        double s = lane < warps ? warp_sums[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) out[blockIdx.x] = s;
    }
}

// Every shuffle flavour with a width, and the votes. Thread t holds 100 + t; it writes
// out[t * 16 + k] for the k-th operation.
extern "C" __global__ void emu_test_warp_ops(int* out, float* fout, long long* lout) {
    const unsigned t = emu_test_tid();
    const unsigned lane = t % 32;
    const int v = 100 + (int)t;
    const unsigned full = 0xffffffffu;
    int* o = out + t * 16;
    o[0] = __shfl_sync(full, v, 3, 8);
    o[1] = __shfl_sync(full, v, 37);  // the source lane is taken modulo 32
    o[2] = __shfl_down_sync(full, v, 2, 8);
    o[3] = __shfl_up_sync(full, v, 3, 16);
    o[4] = __shfl_xor_sync(full, v, 5);
    o[5] = __shfl_xor_sync(full, v, 8, 4);  // earlier segments only
    o[6] = (int)__ballot_sync(full, lane % 3 == 0);
    o[7] = __all_sync(full, v >= 100);
    o[8] = __all_sync(full, lane != 7);
    o[9] = __any_sync(full, lane == 31);
    o[10] = __any_sync(full, v < 0);
    o[11] = (int)__activemask();
    __syncwarp();
    o[12] = __shfl_up_sync(full, v, 1);
    o[13] = __shfl_down_sync(full, v, 31);
    o[14] = (int)__shfl_sync(full, (unsigned)v, (int)(31 - lane));
    o[15] = warpSize;
    fout[t] = __shfl_xor_sync(full, 0.5f + (float)v, 1);
    lout[t] = __shfl_sync(full, (long long)v << 33, 0, 2);
}

// Threads at or past `live` return at once; the others shuffle with `mask` (0: __activemask())
// and write what they read from lane 0 to out[t].
extern "C" __global__ void emu_test_shfl_mask(int* out, unsigned mask, unsigned live) {
    const unsigned t = emu_test_tid();
    if (t >= live) return;
    const unsigned m = mask == 0 ? __activemask() : mask;
    out[t] = __shfl_sync(m, 1000 + (int)t, 0);
}

// Lanes that disagree: mode 0, lane 5 makes one more shuffle than the others, which end; mode 1,
// the same, but the others wait at __syncthreads(); mode 2, odd lanes vote where even lanes
// shuffle; mode 3, every lane shuffles with width 3; mode 4, odd threads return while even ones
// wait at __syncthreads().
extern "C" __global__ void emu_test_divergent(int* out, int mode) {
    const unsigned t = emu_test_tid();
    const unsigned lane = t % 32;
    int v = (int)t;
    if (mode == 0 || mode == 1) {
        const int rounds = lane == 5 ? 2 : 1;
        for (int r = 0; r < rounds; ++r) v += __shfl_xor_sync(0xffffffffu, v, 1);
        if (mode == 1) __syncthreads();
    } else if (mode == 2) {
        if (lane % 2 == 0)
            v = __shfl_xor_sync(0xffffffffu, v, 2);
        else
            v = (int)__ballot_sync(0xffffffffu, 1);
    } else if (mode == 3) {
        v = __shfl_sync(0xffffffffu, v, 0, 3);
    } else {
        if (t % 2 == 1) return;
        __syncthreads();
    }
    out[t] = v;
}
