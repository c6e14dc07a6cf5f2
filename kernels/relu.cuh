// Parameters of the ReLU kernels (kernels/relu.cu); mirrored by `ReluParams` in src/ops/relu.rs.
#pragma once

struct ReluParams {
    unsigned long long n;  // elements
};
