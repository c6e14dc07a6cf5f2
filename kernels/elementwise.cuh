// Parameters of the elementwise kernels (kernels/elementwise.cu); mirrored by `AddParams`,
// `ScaleParams` and `FillParams` in src/ops/elementwise.rs.
#pragma once

struct AddParams {
    unsigned long long n;  // elements
    float alpha;           // scale of a (of z in place)
    float beta;            // scale of b
};

struct ScaleParams {
    unsigned long long n;  // elements
    float alpha;
    unsigned int pad;
};

struct FillParams {
    unsigned long long n;     // elements
    unsigned long long bits;  // the value's bit pattern in the element type (low bytes)
};
