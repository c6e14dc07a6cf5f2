// Parameters of the gradient statistics kernels (kernels/grad_stats.cu); mirrored by
// `GradStatsParams` in src/ops/grad_stats.rs.
#pragma once

// Must match GRAD_STATS_PARTIALS and GRAD_STATS_THREADS (src/ops/grad_stats.rs).
#define GS_PARTIALS 256
#define GS_THREADS 1024

struct GradStatsParams {
    unsigned long long n;  // source elements
};
