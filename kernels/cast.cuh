// Parameters of the cast kernels (kernels/cast.cu); mirrored by `CastParams` in
// src/ops/cast.rs.
#pragma once

struct CastParams {
    unsigned long long n;  // elements
};
