// Parameters of the encoder kernels (kernels/encoder.cu); mirrored by `EncoderParams` and
// `EncoderBackwardParams` in src/ops/encoder.rs.
#pragma once

struct EncoderParams {
    unsigned long long n;      // positions (B·T)
    unsigned long long t;      // sequence length
    unsigned long long c;      // channels
    unsigned long long v;      // rows of wte
    unsigned long long max_t;  // rows of wpe
};

struct EncoderBackwardParams {
    unsigned long long n;
    unsigned long long t;
    unsigned long long c;
    unsigned long long v;
    unsigned long long max_t;
    unsigned long long distinct;  // distinct tokens of the plan
};
