// Parameters of the GELU kernels (kernels/gelu.cu); mirrored by `GeluParams` in src/ops/gelu.rs.
#pragma once

struct GeluParams {
    unsigned long long n;  // elements
};
