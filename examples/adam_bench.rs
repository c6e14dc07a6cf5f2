//! Measures the CPU Adam against the memory ceiling of this machine and prints the figures as a
//! table or as one JSON object.
//!
//! ```sh
//! cargo run --release --example adam_bench -- --json
//! cargo run --release --example adam_bench -- --sizes 10000000 --threads 1,2 --isa avx2 --reps 15
//! ```
//!
//! The ceiling is `stream_4r3w` (`benches/common/stream.rs`), which reads four fp32 arrays and writes
//! three with no real arithmetic: the bytes of an fp32 Adam step (28 per element), with the same
//! vector width and thread split. All kernels run on one set of buffers, written before any
//! timing (first touch); each kernel runs once before the repetitions, and every repetition runs
//! each kernel once in turn (interleaved), so drift hits every kernel alike. Times are medians.
//!
//! JSON output (keys are stable):
//! - `isa`: the instruction-set path (`avx512`, `avx2`, `scalar`)
//! - `reps`: repetitions per size (`null` when chosen per size: see each result)
//! - `results`: one object per size, thread count and kernel:
//!   - `size`: elements; `threads`: threads; `reps`: repetitions
//!   - `kernel`: one of
//!     - `stream_4r3w`: the ceiling itself (28 B/elem; `fraction` is 1)
//!     - `adam_f32`: Adam with fp32 gradients, no copy (28 B/elem)
//!     - `adam_fused_f16`: Adam with fp16 gradients replaced in the same pass by the fp16
//!       parameters (`step_in_place`; 28 B/elem)
//!     - `adam_f16`: Adam with fp16 gradients, no copy (26 B/elem)
//!     - `cast_f16`: fp32 parameters → fp16 with `half`'s slice conversion, split over the same
//!       threads (6 B/elem)
//!     - `adam_then_cast_f16`: `adam_f16` followed by `cast_f16`, the unfused equivalent of
//!       `adam_fused_f16` (32 B/elem; time = median of the per-repetition sums)
//!     - `adam8_fused_f16`: `adam_fused_f16` on 8-bit block-wise moments (`step8_in_place`;
//!       16 B/elem and the block scales)
//!   - `bytes_per_elem`: bytes the kernel moves per element, as counted above
//!   - `seconds`: median time of one pass
//!   - `gbps`: `size · bytes_per_elem / seconds / 1e9`
//!   - `ceiling_gbps`: `gbps` of `stream_4r3w` at the same size and thread count
//!   - `fraction`: `gbps / ceiling_gbps` (target ≥ 0.9 for `adam_f32`)
//!   - `speedup_vs_separate` (only on `adam_fused_f16`): `adam_then_cast_f16` seconds /
//!     `adam_fused_f16` seconds (32/28 ≈ 1.14 from the bytes alone; higher where `cast_f16`
//!     runs below the ceiling)
//!   - `speedup_vs_fp32_moments` (only on `adam8_fused_f16`): `adam_fused_f16` seconds /
//!     `adam8_fused_f16` seconds (target ≥ 1.5; 28/16 = 1.75 from the bytes alone)

#[path = "../benches/common/adam_kernels.rs"]
mod adam_kernels;
#[path = "../benches/common/stream.rs"]
mod stream;

use std::time::Instant;

use adam_kernels::{median, Bufs, Kernel, ADAM8_BYTES, ADAM_F16_BYTES, CAST_BYTES, KERNELS};
use clap::Parser;
use serde::Serialize;
use stream::BYTES_PER_ELEM;
use tidemem::ops::{AdamScalars, CpuAdam, Isa};
use tidemem::optim::AdamConfig;

#[derive(Parser, Debug)]
#[command(about = "CPU Adam throughput against a 4-read/3-write memory ceiling")]
struct Args {
    /// Element counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10000000,100000000")]
    sizes: Vec<usize>,
    /// Thread counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Instruction-set path (avx512, avx2, scalar); the fastest supported one by default.
    #[arg(long)]
    isa: Option<String>,
    /// Repetitions per size and thread count (by default about 6 GB of Adam traffic, 7 to 51).
    #[arg(long)]
    reps: Option<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Record {
    size: usize,
    threads: usize,
    reps: usize,
    kernel: &'static str,
    bytes_per_elem: usize,
    seconds: f64,
    gbps: f64,
    ceiling_gbps: f64,
    fraction: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    speedup_vs_separate: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    speedup_vs_fp32_moments: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    isa: &'static str,
    reps: Option<usize>,
    results: Vec<Record>,
}

/// Interleaved repetitions of every kernel at one size and thread count.
fn measure(
    n: usize,
    reps: usize,
    adam: &CpuAdam,
    s: &AdamScalars,
    bufs: &mut Bufs,
) -> tidemem::Result<Vec<Record>> {
    let mut t = vec![Vec::with_capacity(reps); KERNELS.len()];
    for k in KERNELS {
        bufs.run(k, adam, s)?;
    }
    for _ in 0..reps {
        for (i, k) in KERNELS.into_iter().enumerate() {
            let t0 = Instant::now();
            bufs.run(k, adam, s)?;
            t[i].push(t0.elapsed().as_secs_f64());
        }
    }
    let at = |k: Kernel| &t[KERNELS.iter().position(|&x| x == k).unwrap()];
    let separate: Vec<f64> = at(Kernel::AdamF16)
        .iter()
        .zip(at(Kernel::Cast))
        .map(|(a, c)| a + c)
        .collect();
    let gbps = |bytes: usize, secs: f64| (n * bytes) as f64 / secs / 1e9;
    let ceiling = gbps(BYTES_PER_ELEM, median(at(Kernel::Stream)));
    let fused = median(at(Kernel::Fused));
    let separate = median(&separate);
    let record = |kernel, bytes_per_elem, seconds: f64| Record {
        size: n,
        threads: adam.threads(),
        reps,
        kernel,
        bytes_per_elem,
        seconds,
        gbps: gbps(bytes_per_elem, seconds),
        ceiling_gbps: ceiling,
        fraction: gbps(bytes_per_elem, seconds) / ceiling,
        speedup_vs_separate: None,
        speedup_vs_fp32_moments: None,
    };
    let fused8 = median(at(Kernel::Fused8));
    Ok(vec![
        record("stream_4r3w", BYTES_PER_ELEM, median(at(Kernel::Stream))),
        record("adam_f32", BYTES_PER_ELEM, median(at(Kernel::AdamF32))),
        Record {
            speedup_vs_separate: Some(separate / fused),
            ..record("adam_fused_f16", 28, fused)
        },
        record("adam_f16", ADAM_F16_BYTES, median(at(Kernel::AdamF16))),
        record("cast_f16", CAST_BYTES, median(at(Kernel::Cast))),
        record("adam_then_cast_f16", ADAM_F16_BYTES + CAST_BYTES, separate),
        Record {
            speedup_vs_fp32_moments: Some(fused / fused8),
            ..record("adam8_fused_f16", ADAM8_BYTES, fused8)
        },
    ])
}

fn main() {
    if let Err(e) = run() {
        eprintln!("adam_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> tidemem::Result<()> {
    let args = Args::parse();
    let mut base = CpuAdam::new();
    if let Some(name) = &args.isa {
        base = base.with_isa(Isa::parse(name)?)?;
    }
    if args.threads.contains(&0) || args.reps == Some(0) || args.sizes.contains(&0) {
        return Err(tidemem::Error::BadValue {
            what: format!(
                "--threads {:?} --reps {:?} --sizes {:?}",
                args.threads, args.reps, args.sizes
            ),
            value: 0.0,
            want: "at least 1 each: 0 threads, repetitions or elements measure nothing",
        });
    }
    for &n in &args.sizes {
        // the buffers of one size: four f32 lists and an f16 copy, and the 8-bit step's own
        // f32 parameters, f16 gradients and two code lists
        tidemem::limits::host_bytes(|| format!("--sizes {n}: the buffers"), &[n, 26])?;
    }
    let s = AdamConfig::adamw(1e-3, 0.01).scalars(1, 1.0)?;
    let mut results = Vec::new();
    for &n in &args.sizes {
        let reps = args
            .reps
            .unwrap_or_else(|| (6_000_000_000 / (BYTES_PER_ELEM * n).max(1)).clamp(7, 51))
            .max(1);
        let mut bufs = Bufs::new(n);
        for &threads in &args.threads {
            let adam = base.with_threads(threads);
            let rows = measure(n, reps, &adam, &s, &mut bufs)?;
            if !args.json {
                print_rows(&rows);
            }
            results.extend(rows);
        }
    }
    if args.json {
        let report = Report {
            isa: base.isa().name(),
            reps: args.reps,
            results,
        };
        println!(
            "{}",
            serde_json::to_string(&report).expect("plain numbers and strings serialize")
        );
    }
    Ok(())
}

fn print_rows(rows: &[Record]) {
    let r0 = &rows[0];
    println!(
        "{} elements, {} thread(s), {} reps, ceiling {:.2} GB/s",
        r0.size, r0.threads, r0.reps, r0.ceiling_gbps
    );
    for r in rows {
        let extra = match (r.speedup_vs_separate, r.speedup_vs_fp32_moments) {
            (Some(x), _) => format!("  separate/fused {x:.3}"),
            (_, Some(x)) => format!("  fp32 moments/8-bit {x:.3}"),
            _ => String::new(),
        };
        println!(
            "  {:<20} {:>2} B/elem {:9.2} ms {:7.2} GB/s  fraction {:.3}{extra}",
            r.kernel,
            r.bytes_per_elem,
            r.seconds * 1e3,
            r.gbps,
            r.fraction
        );
    }
}
