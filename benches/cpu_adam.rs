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

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use half::f16;
use half::slice::HalfFloatSliceExt;
use tidemem::optim::stream::{stream_4r3w, BYTES_PER_ELEM};
use tidemem::optim::{AdamConfig, AdamScalars, CpuAdam, Grad, GradInPlace, ParamCopy};

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

/// Bytes per element of fp16-gradient Adam without a copy (p, m, v read and written; g read).
const ADAM_F16_BYTES: usize = 26;
/// Bytes per element of the cast pass (fp32 read, fp16 written).
const CAST_BYTES: usize = 6;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// `stream_4r3w` over (p, g, m, v).
    Stream,
    /// Adam, fp32 gradients, no copy.
    AdamF32,
    /// Adam, fp16 gradients replaced by the fp16 parameters in the same pass.
    Fused,
    /// Adam, fp16 gradients, no copy.
    AdamF16,
    /// fp32 parameters → fp16 (into the gradient buffer, as the fused step does).
    Cast,
}

const KERNELS: [Kernel; 5] = [
    Kernel::Stream,
    Kernel::AdamF32,
    Kernel::Fused,
    Kernel::AdamF16,
    Kernel::Cast,
];

/// One set of operands, shared by every kernel.
struct Bufs {
    p: Vec<f32>,
    g: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    g16: Vec<f16>,
}

impl Bufs {
    /// Non-zero fills, so every page is written (zeroed vectors would be mapped lazily).
    fn new(n: usize) -> Self {
        Bufs {
            p: vec![1.0; n],
            g: vec![1e-3; n],
            m: vec![1e-4; n],
            v: vec![1e-6; n],
            g16: vec![f16::from_f32(1e-3); n],
        }
    }

    fn run(&mut self, k: Kernel, adam: &CpuAdam, s: &AdamScalars) {
        let b = self;
        match k {
            Kernel::Stream => stream_4r3w(
                adam.isa(),
                adam.threads(),
                &mut b.p,
                &b.g,
                &mut b.m,
                &mut b.v,
            )
            .unwrap(),
            Kernel::AdamF32 => adam
                .step(
                    s,
                    &mut b.p,
                    &mut b.m,
                    &mut b.v,
                    Grad::F32(&b.g),
                    ParamCopy::None,
                )
                .unwrap(),
            Kernel::Fused => adam
                .step_in_place(
                    s,
                    &mut b.p,
                    &mut b.m,
                    &mut b.v,
                    GradInPlace::F16(&mut b.g16),
                )
                .unwrap(),
            Kernel::AdamF16 => adam
                .step(
                    s,
                    &mut b.p,
                    &mut b.m,
                    &mut b.v,
                    Grad::F16(&b.g16),
                    ParamCopy::None,
                )
                .unwrap(),
            Kernel::Cast => cast(adam.threads(), &b.p, &mut b.g16),
        }
        black_box(&b.p);
    }
}

/// `dst = f16(src)`, split over threads as the CPU Adam splits a step (parts aligned to 64
/// elements, at least 65536 elements each, the first on this thread).
fn cast(threads: usize, src: &[f32], dst: &mut [f16]) {
    let n = src.len();
    let parts = threads.min(n >> 16).max(1);
    let per = n.div_ceil(parts).div_ceil(64) * 64;
    if parts == 1 {
        dst.convert_from_f32_slice(src);
        return;
    }
    std::thread::scope(|scope| {
        let mut pairs = src.chunks(per).zip(dst.chunks_mut(per));
        let (s0, d0) = pairs.next().unwrap();
        for (s, d) in pairs {
            scope.spawn(move || d.convert_from_f32_slice(s));
        }
        d0.convert_from_f32_slice(s0);
    });
}

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

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|x, y| x.partial_cmp(y).unwrap());
    v[v.len() / 2]
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
}

fn measure(n: usize, reps: usize, adam: &CpuAdam, s: &AdamScalars, bufs: &mut Bufs) -> Row {
    let t = interleaved(reps, &KERNELS, |k| bufs.run(k, adam, s));
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
    }
}

fn print_summary(isa: &str, rows: &[Row]) {
    let gbs = |n: usize, b: usize, t: f64| (n * b) as f64 / t / 1e9;
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
                g.bench_function(id(name), |b| b.iter(|| bufs.run(k, &adam, &s)));
            }
            g.throughput(Throughput::Bytes(
                (n * (ADAM_F16_BYTES + CAST_BYTES)) as u64,
            ));
            g.bench_function(id("adam_then_cast_f16"), |b| {
                b.iter(|| {
                    bufs.run(Kernel::AdamF16, &adam, &s);
                    bufs.run(Kernel::Cast, &adam, &s);
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
