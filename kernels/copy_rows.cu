// Strided, indexed row copy. CPU twin and descriptor: src/ops/copy_rows.rs.
// copy_rows(src, src_index, dst, dst_index, CopyRowsParams): for i < n, row dst_index[i] of dst
// (row i when dst_index is null) = row src_index[i] of src (row i when src_index is null),
// `width` words of rows `src_stride` / `dst_stride` words apart. An index at or past its
// side's rows is skipped. The words are moved as 32-bit integers: a copy, bit for bit.
// Destination indices must be distinct (two writes of one row race).
#include "common.cuh"

#include "copy_rows.cuh"

extern "C" __global__ void copy_rows(const unsigned* __restrict__ src,
                                     const unsigned* __restrict__ src_index,
                                     unsigned* __restrict__ dst,
                                     const unsigned* __restrict__ dst_index, CopyRowsParams p) {
    for (unsigned long long i = blockIdx.x; i < p.n; i += gridDim.x) {
        const unsigned long long s = src_index ? (unsigned long long)src_index[i] : i;
        const unsigned long long d = dst_index ? (unsigned long long)dst_index[i] : i;
        if (s >= p.src_rows || d >= p.dst_rows) continue;
        const unsigned* from = src + s * p.src_stride;
        unsigned* to = dst + d * p.dst_stride;
        for (unsigned long long k = threadIdx.x; k < p.width; k += blockDim.x) to[k] = from[k];
    }
}
