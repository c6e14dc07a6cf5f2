// Parameters of the row copy (kernels/copy_rows.cu); mirrored by `CopyRowsParams` in
// src/ops/copy_rows.rs.
#pragma once

struct CopyRowsParams {
    unsigned long long n;           // rows copied
    unsigned long long width;       // 32-bit words per row copied
    unsigned long long src_stride;  // words between source rows
    unsigned long long dst_stride;  // words between destination rows
    unsigned long long src_rows;    // rows the source holds
    unsigned long long dst_rows;    // rows the destination holds
};
