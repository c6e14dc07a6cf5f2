// Parameters of the accumulate kernels (kernels/accumulate.cu); mirrored by `AccumulateParams`
// in src/ops/accumulate.rs.
#pragma once

struct AccumulateParams {
    unsigned long long n;  // elements
};
