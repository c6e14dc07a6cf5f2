//! The GEMM's throughput against what the hardware can do, measured in the same run.
//!
//! * **CPU** (`ops::gemm_host`, the twin the simulated device runs, f32): GFLOP/s as a
//!   fraction of the FMA peak, measured here by a register-only loop of independent fused
//!   multiply-add chains (16 per thread, AVX-512 when the CPU has it, else AVX2 + FMA) on one
//!   thread per core. The figure is `fraction = GEMM GFLOP/s / FMA peak GFLOP/s` (target ≥
//!   0.75), the median over [`PAIRS`] back-to-back pairs (a peak loop of 0.1 s, then GEMM
//!   calls for at least as long), so drift of a shared machine hits both sides of a pair
//!   alike. Beside it: the best and mean GEMM GFLOP/s of criterion's samples and the best
//!   peak.
//! * **GPU** (when a CUDA GPU is present; skipped with a message otherwise, and on the CPU
//!   emulator): the device layer's GEMM (`ops::gemm`, cuBLAS through `Device::launch`) against
//!   cudarc's own `CudaBlas` on the same shapes, f32 and bf16, as TFLOP/s and
//!   `ratio = device-layer time / CudaBlas time` (medians of interleaved repetitions of
//!   [`BATCH`] calls and one synchronisation).
//!
//! Shapes: square 1024, 2048, 4096, and GPT-2 small's linear layers at B·T = 4096 rows and
//! C = 768: `x·Wᵀ` with `W` stored `out × in` for out = 3C (qkv), C (attention projection),
//! 4C (MLP up) and the MLP's 4C → C. A GEMM of `m × n × k` is `2·m·n·k` flops.

#[path = "common/mean.rs"]
#[allow(dead_code)] // `ratio`: this bench prints fractions of a measured peak instead
mod mean;

use std::time::{Duration, Instant};

use tidemem::profile::{fma_isa, fma_peak};

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use mean::Mean;
use tidemem::ops::{self, Gemm};

/// A benchmarked shape: `op(A)` is `m × k`, `op(B)` `k × n`; `trans_b`: `B` stored `n × k`.
#[derive(Clone, Copy)]
struct Shape {
    label: &'static str,
    m: usize,
    n: usize,
    k: usize,
    trans_b: bool,
}

const SHAPES: [Shape; 7] = [
    Shape {
        label: "square 1024",
        m: 1024,
        n: 1024,
        k: 1024,
        trans_b: false,
    },
    Shape {
        label: "square 2048",
        m: 2048,
        n: 2048,
        k: 2048,
        trans_b: false,
    },
    Shape {
        label: "square 4096",
        m: 4096,
        n: 4096,
        k: 4096,
        trans_b: false,
    },
    Shape {
        label: "gpt2 qkv x·Wᵀ 768→2304",
        m: 4096,
        n: 2304,
        k: 768,
        trans_b: true,
    },
    Shape {
        label: "gpt2 proj x·Wᵀ 768→768",
        m: 4096,
        n: 768,
        k: 768,
        trans_b: true,
    },
    Shape {
        label: "gpt2 fc x·Wᵀ 768→3072",
        m: 4096,
        n: 3072,
        k: 768,
        trans_b: true,
    },
    Shape {
        label: "gpt2 fcproj x·Wᵀ 3072→768",
        m: 4096,
        n: 768,
        k: 3072,
        trans_b: true,
    },
];

impl Shape {
    fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
    fn gemm(&self) -> Gemm {
        Gemm::new(self.m, self.n, self.k).trans_b(self.trans_b)
    }
}

/// (FMA peak, GEMM) pairs per shape for the fraction.
const PAIRS: usize = 7;

/// One shape's CPU figures in GFLOP/s.
struct Row {
    s: Shape,
    /// Over every call criterion made.
    mean: f64,
    /// The fastest sample.
    best: f64,
    /// The best FMA peak of the pairs.
    peak: f64,
    /// Median over the pairs of GEMM GFLOP/s / FMA peak GFLOP/s.
    fraction: f64,
}

/// The median over [`PAIRS`] of (GEMM GFLOP/s / FMA peak GFLOP/s), each pair a peak loop of
/// 0.1 s then `run` repeated for at least as long; and the best peak.
fn paired(flops: f64, lanes: usize, threads: usize, mut run: impl FnMut()) -> (f64, f64) {
    let (mut ratios, mut best) = (Vec::with_capacity(PAIRS), 0.0f64);
    for _ in 0..PAIRS {
        let peak = fma_peak(lanes, threads, 0.1);
        let (t, mut calls) = (Instant::now(), 0);
        while calls == 0 || t.elapsed().as_secs_f64() < 0.1 {
            run();
            calls += 1;
        }
        let gflops = flops * calls as f64 / t.elapsed().as_secs_f64() / 1e9;
        ratios.push(gflops / peak);
        best = best.max(peak);
    }
    ratios.sort_by(|x, y| x.total_cmp(y));
    (ratios[PAIRS / 2], best)
}

/// GPU calls per timed repetition, then one synchronisation.
const BATCH: usize = 10;

/// Physical cores (distinct (package, core) pairs), or the available parallelism.
fn cores() -> usize {
    let mut seen = std::collections::HashSet::new();
    for cpu in 0.. {
        let dir = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
        let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).ok();
        match (read("physical_package_id"), read("core_id")) {
            (Some(p), Some(c)) => seen.insert((p.trim().to_owned(), c.trim().to_owned())),
            _ => break,
        };
    }
    if seen.is_empty() {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        seen.len()
    }
}

fn cpu(c: &mut Criterion) {
    let Some((isa, lanes)) = fma_isa() else {
        println!("gemm: no AVX2/AVX-512 FMA on this CPU; the CPU bench is skipped");
        return;
    };
    let threads = cores();
    let mut g = c.benchmark_group("gemm_cpu");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1));
    let mut rows = vec![];
    for s in SHAPES {
        let (sa, sb) = (s.m * s.k, s.k * s.n);
        let a: Vec<f32> = (0..sa).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
        let b: Vec<f32> = (0..sb).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
        let mut out = vec![0.0f32; s.m * s.n];
        let gm = s.gemm();
        let (mut mean, mut best) = (Mean::default(), f64::INFINITY);
        g.throughput(Throughput::Elements(s.flops() as u64));
        g.bench_function(BenchmarkId::new("f32", s.label), |bch| {
            bch.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    ops::gemm_host(&gm, &a, &b, &mut out).unwrap();
                }
                let t = t.elapsed();
                best = best.min(t.as_secs_f64() / iters.max(1) as f64);
                mean.add(t, iters)
            })
        });
        let (fraction, peak) = paired(s.flops(), lanes, threads, || {
            ops::gemm_host(&gm, &a, &b, &mut out).unwrap();
        });
        rows.push(Row {
            s,
            mean: s.flops() / mean.per_iter() / 1e9,
            best: s.flops() / best / 1e9,
            peak,
            fraction,
        });
    }
    g.finish();
    println!(
        "\ngemm cpu ({isa}, {threads} thread(s), one per core, 16 FMA chains a thread): \
         fraction = GEMM GFLOP/s / FMA peak GFLOP/s, median of {PAIRS} back-to-back pairs \
         (target >= 0.75); GEMM best (mean) of criterion's samples; best peak"
    );
    for r in rows {
        println!(
            "  {:<28} {:>5}×{:<5}×{:>5}  {:6.1} ({:6.1}) GFLOP/s  peak {:6.1}  fraction {:.3}",
            r.s.label, r.s.m, r.s.n, r.s.k, r.best, r.mean, r.peak, r.fraction
        );
    }
}

mod gpu {
    use std::sync::Arc;
    use std::time::Instant;

    use cudarc::cublas::{sys::cublasOperation_t as Op, CudaBlas, Gemm as _, GemmConfig};
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use half::bf16;
    use tidemem::device::{Device, DeviceBuffer, Stream};
    use tidemem::ops::{self};
    use tidemem::DType;

    use super::{Shape, BATCH, SHAPES};

    /// Median seconds of `a` and of `b` over `reps` interleaved runs.
    fn interleaved(reps: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
        a();
        b();
        let (mut ta, mut tb) = (vec![], vec![]);
        for _ in 0..reps {
            let t = Instant::now();
            a();
            ta.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            b();
            tb.push(t.elapsed().as_secs_f64());
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(|x, y| x.total_cmp(y));
            v[v.len() / 2]
        };
        (med(&mut ta), med(&mut tb))
    }

    struct Ours {
        dev: Device,
        s: Stream,
        a: DeviceBuffer,
        b: DeviceBuffer,
        c: DeviceBuffer,
    }

    struct Theirs<T> {
        stream: Arc<CudaStream>,
        blas: CudaBlas,
        a: CudaSlice<T>,
        b: CudaSlice<T>,
        c: CudaSlice<T>,
    }

    fn run<T>(
        dev: &Device,
        ctx: &Arc<CudaContext>,
        dtype: DType,
        (one, zero): (T, T),
    ) -> Vec<(Shape, f64, f64)>
    where
        T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy,
        CudaBlas: cudarc::cublas::Gemm<T>,
    {
        let mut rows = vec![];
        for sh in SHAPES {
            let es = dtype.size();
            let s = dev.new_stream().unwrap();
            let alloc = |n: usize| {
                let b = dev.alloc(n * es).unwrap();
                dev.memset(&s, &b, 0x3c).unwrap();
                b
            };
            let ours = Ours {
                a: alloc(sh.m * sh.k),
                b: alloc(sh.k * sh.n),
                c: alloc(sh.m * sh.n),
                dev: dev.clone(),
                s,
            };
            let stream = ctx.new_stream().unwrap();
            let theirs = Theirs {
                blas: CudaBlas::new(stream.clone()).unwrap(),
                a: stream.alloc_zeros::<T>(sh.m * sh.k).unwrap(),
                b: stream.alloc_zeros::<T>(sh.k * sh.n).unwrap(),
                c: stream.alloc_zeros::<T>(sh.m * sh.n).unwrap(),
                stream,
            };
            let g = sh.gemm();
            let mut theirs = theirs;
            // Row-major C = A·op(B) as column-major Cᵀ = op(B)ᵀ·Aᵀ.
            let cfg = GemmConfig {
                transa: if sh.trans_b {
                    Op::CUBLAS_OP_T
                } else {
                    Op::CUBLAS_OP_N
                },
                transb: Op::CUBLAS_OP_N,
                m: sh.n as i32,
                n: sh.m as i32,
                k: sh.k as i32,
                alpha: one,
                lda: if sh.trans_b { sh.k } else { sh.n } as i32,
                ldb: sh.k as i32,
                beta: zero,
                ldc: sh.n as i32,
            };
            let (t_ours, t_theirs) = interleaved(
                7,
                || {
                    for _ in 0..BATCH {
                        ops::gemm(&ours.dev, &ours.s, &g, &ours.a, &ours.b, &ours.c, dtype)
                            .unwrap();
                    }
                    ours.dev.sync_stream(&ours.s).unwrap();
                },
                || {
                    let t = &mut theirs;
                    for _ in 0..BATCH {
                        // SAFETY: the slices hold the shapes' elements (column-major view of
                        // the row-major operands, leading dimensions as allocated).
                        unsafe { t.blas.gemm(cfg, &t.b, &t.a, &mut t.c) }.unwrap();
                    }
                    t.stream.synchronize().unwrap();
                },
            );
            rows.push((sh, t_ours / BATCH as f64, t_theirs / BATCH as f64));
        }
        rows
    }

    pub fn bench() {
        let dev = match Device::cuda(0) {
            Ok(d) if d.name().contains("CUDA emulator") => {
                println!("gemm gpu: skipped: the CUDA device is the CPU emulator");
                return;
            }
            Ok(d) => d,
            Err(e) => {
                println!("gemm gpu: skipped: no CUDA GPU ({e})");
                return;
            }
        };
        if !ops::cublas_available() {
            println!("gemm gpu: skipped: cuBLAS cannot be loaded");
            return;
        }
        let ctx = CudaContext::new(0).unwrap();
        println!(
            "\ngemm gpu ({}): ratio = device-layer time / cudarc CudaBlas time (medians of 7 × {BATCH} calls)",
            dev.name()
        );
        let f32_rows = run::<f32>(&dev, &ctx, DType::F32, (1.0, 0.0));
        let bf16_rows = run::<bf16>(&dev, &ctx, DType::BF16, (bf16::ONE, bf16::ZERO));
        for (d, rows) in [("f32", f32_rows), ("bf16", bf16_rows)] {
            for (s, ours, theirs) in rows {
                println!(
                    "  {d:<4} {:<28} ours {:7.1} TFLOP/s  cudarc {:7.1} TFLOP/s  ratio {:.3}",
                    s.label,
                    s.flops() / ours / 1e12,
                    s.flops() / theirs / 1e12,
                    ours / theirs
                );
            }
        }
    }
}

fn gpu(_: &mut Criterion) {
    gpu::bench();
}

criterion_group!(benches, cpu, gpu);
criterion_main!(benches);
