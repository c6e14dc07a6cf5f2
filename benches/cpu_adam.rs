//! The CPU Adam against the memory ceiling.
//!
//! * `adam_f32` (fp32 gradients, no copy) against `stream_4r3w`, a kernel that reads four fp32
//!   arrays and writes three with no real arithmetic (the same 28 bytes per element as Adam, the
//!   same vector width and thread split), measured on the same buffers in the same run. Printed
//!   as `fraction = adam GB/s / ceiling GB/s` (target >= 0.9).
//! * The fused mixed-precision step (`step_in_place`: fp16 gradient in, fp16 parameter out in the
//!   same pass) against Adam with fp16 gradients followed by a separate fp32 → fp16 cast of the
//!   parameters (`half`'s slice conversion, split over the same threads). Printed as
//!   `ratio = separate time / fused time`. The fused step moves 28 bytes per element, the
//!   separate one 32 (26 + 6), so bytes alone give 32/28 ≈ 1.14; the ratio is higher where the
//!   cast pass runs below the ceiling (its stores allocate lines that were never read, and
//!   `half`'s conversion is not free).
//!
//! Every figure comes from medians of interleaved repetitions (one repetition runs each kernel
//! once), so drift of a shared machine hits every kernel alike. The buffers are written once
//! before any timing (first touch), and every kernel runs once before its repetitions.
//!
//! Sizes default to 10M and 100M elements, threads to 1 and 2.
//! `TIDEMEM_BENCH_ADAM_ELEMS` overrides the sizes (comma-separated element counts) and
//! `TIDEMEM_BENCH_ADAM_REPS` the repetitions. 100M elements hold 1.8 GB of buffers.

#[path = "common/adam_kernels.rs"]
mod adam_kernels;
#[path = "common/stream.rs"]
mod stream;

use std::time::{Duration, Instant};

use adam_kernels::{median, Bufs, Kernel, ADAM8_BYTES, ADAM_F16_BYTES, CAST_BYTES, KERNELS};
use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use stream::BYTES_PER_ELEM;
use tidemem::ops::{AdamScalars, CpuAdam};
use tidemem::optim::AdamConfig;

fn env_list(name: &str) -> Option<Vec<usize>> {
    std::env::var(name).ok().map(|v| {
        v.split(',')
            .filter_map(|s| s.trim().replace('_', "").parse().ok())
            .collect()
    })
}

fn sizes() -> Vec<usize> {
    env_list("TIDEMEM_BENCH_ADAM_ELEMS").unwrap_or_else(|| vec![10_000_000, 100_000_000])
}

fn reps_for(n: usize) -> usize {
    env_list("TIDEMEM_BENCH_ADAM_REPS")
        .and_then(|v| v.first().copied())
        .unwrap_or_else(|| (6_000_000_000 / (BYTES_PER_ELEM * n).max(1)).clamp(7, 51))
        .max(1)
}

const THREADS: [usize; 2] = [1, 2];

/// Seconds of each repetition of each kernel in `kernels`, interleaved.
fn interleaved(reps: usize, kernels: &[Kernel], mut run: impl FnMut(Kernel)) -> Vec<Vec<f64>> {
    let mut t = vec![Vec::with_capacity(reps); kernels.len()];
    for &k in kernels {
        run(k);
    }
    for _ in 0..reps {
        for (i, &k) in kernels.iter().enumerate() {
            let t0 = Instant::now();
            run(k);
            t[i].push(t0.elapsed().as_secs_f64());
        }
    }
    t
}

/// Medians of one size and thread count.
struct Row {
    n: usize,
    threads: usize,
    stream: f64,
    adam: f64,
    fused: f64,
    adam16: f64,
    cast: f64,
    /// Median over repetitions of (Adam fp16 + cast).
    separate: f64,
    /// The fused step on 8-bit moments.
    fused8: f64,
}

fn measure(n: usize, reps: usize, adam: &CpuAdam, s: &AdamScalars, bufs: &mut Bufs) -> Row {
    let t = interleaved(reps, &KERNELS, |k| bufs.run(k, adam, s).unwrap());
    let at = |k: Kernel| &t[KERNELS.iter().position(|&x| x == k).unwrap()];
    let sums: Vec<f64> = at(Kernel::AdamF16)
        .iter()
        .zip(at(Kernel::Cast))
        .map(|(a, c)| a + c)
        .collect();
    Row {
        n,
        threads: adam.threads(),
        stream: median(at(Kernel::Stream)),
        adam: median(at(Kernel::AdamF32)),
        fused: median(at(Kernel::Fused)),
        adam16: median(at(Kernel::AdamF16)),
        cast: median(at(Kernel::Cast)),
        separate: median(&sums),
        fused8: median(at(Kernel::Fused8)),
    }
}

fn print_summary(isa: &str, rows: &[Row]) {
    let gbs = |n: usize, b: usize, t: f64| (n * b) as f64 / t / 1e9;
    println!(
        "\ncpu_adam ({isa}): speedup = fused step on fp32 moments / on 8-bit moments ({BYTES_PER_ELEM} against {ADAM8_BYTES} B/elem; target >= 1.5)"
    );
    for r in rows {
        println!(
            "  {:>10} elems  {} thr  fp32 moments {:7.2} ms  8-bit {:7.2} ms ({:6.2} GB/s, fraction of the ceiling {:.3})  speedup {:.2}  ({:.1} ms per 100M elements)",
            r.n,
            r.threads,
            r.fused * 1e3,
            r.fused8 * 1e3,
            gbs(r.n, ADAM8_BYTES, r.fused8),
            gbs(r.n, ADAM8_BYTES, r.fused8) / gbs(r.n, BYTES_PER_ELEM, r.stream),
            r.fused / r.fused8,
            r.fused8 * 1e3 * 1e8 / r.n as f64
        );
    }
    println!(
        "\ncpu_adam ({isa}): fraction = Adam GB/s / 4R3W stream GB/s, {BYTES_PER_ELEM} B/elem (target >= 0.9)"
    );
    for r in rows {
        println!(
            "  {:>10} elems  {} thr  adam {:6.2} GB/s  ceiling {:6.2} GB/s  fraction {:.3}",
            r.n,
            r.threads,
            gbs(r.n, BYTES_PER_ELEM, r.adam),
            gbs(r.n, BYTES_PER_ELEM, r.stream),
            r.stream / r.adam
        );
    }
    println!(
        "cpu_adam ({isa}): ratio = (Adam fp16 grads + separate cast) time / fused in-place fp16 step time (bytes alone: 32/28 = 1.14)"
    );
    for r in rows {
        println!(
            "  {:>10} elems  {} thr  fused {:7.2} ms ({:6.2} GB/s, fraction {:.3})  separate {:7.2} ms (adam {:.2} + cast {:.2} ms, cast {:5.2} GB/s)  ratio {:.3}",
            r.n,
            r.threads,
            r.fused * 1e3,
            gbs(r.n, BYTES_PER_ELEM, r.fused),
            r.stream / r.fused,
            r.separate * 1e3,
            r.adam16 * 1e3,
            r.cast * 1e3,
            gbs(r.n, CAST_BYTES, r.cast),
            r.separate / r.fused
        );
    }
}

fn cpu_adam(c: &mut Criterion) {
    let s = AdamConfig::adamw(1e-3, 0.01).scalars(1, 1.0).unwrap();
    let base = CpuAdam::new();
    let isa = base.isa().name();
    let mut g = c.benchmark_group("cpu_adam");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let mut summary = Vec::new();
    for n in sizes() {
        let mut bufs = Bufs::new(n);
        for threads in THREADS {
            let adam = base.with_threads(threads);
            let id = |name: &str| BenchmarkId::new(name, format!("{n}/{threads}t"));
            for (k, name, bytes) in [
                (Kernel::Stream, "stream_4r3w", BYTES_PER_ELEM),
                (Kernel::AdamF32, "adam_f32", BYTES_PER_ELEM),
                (Kernel::Fused, "adam_fused_f16", BYTES_PER_ELEM),
            ] {
                g.throughput(Throughput::Bytes((n * bytes) as u64));
                g.bench_function(id(name), |b| b.iter(|| bufs.run(k, &adam, &s).unwrap()));
            }
            g.throughput(Throughput::Bytes(
                (n * (ADAM_F16_BYTES + CAST_BYTES)) as u64,
            ));
            g.bench_function(id("adam_then_cast_f16"), |b| {
                b.iter(|| {
                    bufs.run(Kernel::AdamF16, &adam, &s).unwrap();
                    bufs.run(Kernel::Cast, &adam, &s).unwrap();
                })
            });
            summary.push(measure(n, reps_for(n), &adam, &s, &mut bufs));
        }
    }
    g.finish();
    print_summary(isa, &summary);
}

criterion_group!(benches, cpu_adam);
criterion_main!(benches);
