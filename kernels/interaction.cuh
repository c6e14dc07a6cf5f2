// Parameters of the dot-interaction kernels (kernels/interaction.cu); mirrored by
// `InteractionParams` in src/ops/interaction.rs.
#pragma once

struct InteractionParams {
    unsigned long long batch;     // samples (B)
    unsigned long long features;  // sparse features (F); T stacks F + 1 rows of dim values
    unsigned long long dim;       // values per row (D)
};
