//! Memory-bound ops against a copy of the same bytes, on the CPU and on a GPU.
//!
//! Every entry is data (`ops/entry.rs`): a name, the bytes the op must read and write at least
//! once, the op's `KernelDesc`, its parameter bytes and its operands in signature order (read,
//! written or absent, each with its bytes and type). Entries by family: `ops/llm.rs` (GELU,
//! softmax, cross-entropy, encoder), `ops/recsys.rs` (interaction, BCE), `ops/norm.rs`
//! (LayerNorm, bias, ReLU, elementwise).
//!
//! * **CPU**: each op's CPU twin (what the simulated device runs) is timed on host buffers of
//!   GPT-2-small activation size (B·T = 4096 rows of C = 768 by default), against
//!   `copy_from_slice` moving the same number of bytes (half read, half written) in the same
//!   run. Printed per op as `fraction = op bytes/s ÷ copy bytes/s` (target ≥ 0.7). Figures are
//!   medians of interleaved repetitions (each repetition runs the copy and the op once), so
//!   drift of a shared machine hits both alike.
//! * **GPU** (`ops/gpu.rs`; when CUDA device 0 is a real GPU, skipped with a message otherwise
//!   and on the CPU emulator): the operands uploaded once, each op launched with
//!   `Device::launch` against `Device::copy_d2d` of the same bytes (a buffer of half of them
//!   copied into another), each synchronised with the stream per repetition, interleaved
//!   medians; printed as GB/s and `GPU fraction = op bytes/s ÷ d2d bytes/s` (target ≥ 0.8). The
//!   rows are 4 × the CPU's (the CPU shape is too small to time on a GPU).
//!
//! `TIDEMEM_BENCH_OPS_ROWS` / `TIDEMEM_BENCH_OPS_COLS` override the shape,
//! `TIDEMEM_BENCH_OPS_GPU_ROWS` the GPU's rows, `TIDEMEM_BENCH_OPS_REPS` the repetitions,
//! `TIDEMEM_BENCH_OPS` filters ops by substring.

use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};

#[path = "ops/entry.rs"]
mod entry;
#[path = "ops/gpu.rs"]
mod gpu;
#[path = "ops/llm.rs"]
mod llm;
#[path = "ops/norm.rs"]
mod norm;
#[path = "ops/recsys.rs"]
mod recsys;
#[path = "ops/vocab_parallel.rs"]
mod vocab_parallel;

use entry::{median, Entry};

/// The shape, repetitions and filter, from the environment.
pub struct Config {
    pub rows: usize,
    pub cols: usize,
    pub gpu_rows: usize,
    pub reps: usize,
    pub filter: String,
}

impl Config {
    fn from_env() -> Config {
        let rows = env_usize("TIDEMEM_BENCH_OPS_ROWS", 4096);
        Config {
            rows,
            cols: env_usize("TIDEMEM_BENCH_OPS_COLS", 768),
            gpu_rows: env_usize("TIDEMEM_BENCH_OPS_GPU_ROWS", 4 * rows),
            reps: env_usize("TIDEMEM_BENCH_OPS_REPS", 15).max(1),
            filter: std::env::var("TIDEMEM_BENCH_OPS").unwrap_or_default(),
        }
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Every op of the bench.
pub fn entries(rows: usize, cols: usize) -> Vec<Entry> {
    let mut v = Vec::new();
    llm::gelu_entries(rows, cols, &mut v);
    llm::softmax_entries(rows, cols, &mut v);
    llm::softmax_block_entries(rows, cols, &mut v);
    llm::cross_entropy_entries(rows, cols, &mut v);
    llm::encoder_entries(rows, cols, &mut v);
    recsys::interaction_entries(&mut v);
    recsys::bce_entries(&mut v);
    recsys::copy_rows_entries(&mut v);
    norm::norm_entries(rows, cols, &mut v);
    vocab_parallel::vocab_parallel_entries(rows, cols, &mut v);
    v
}

fn cpu(c: &mut Criterion) {
    let Config {
        rows,
        cols,
        reps,
        filter,
        ..
    } = Config::from_env();
    let mut group = c.benchmark_group("ops");
    group.sample_size(10);
    println!("ops on the CPU, [{rows}, {cols}], against copy_from_slice of the same bytes (target >= 0.7)");
    for mut e in entries(rows, cols)
        .into_iter()
        .filter(|e| e.name.contains(&filter))
    {
        let half = e.bytes / 2;
        let src = vec![1u8; half];
        let mut dst = vec![0u8; half];
        e.run_host();
        dst.copy_from_slice(&src);
        let (mut tc, mut to) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
        for _ in 0..reps {
            let t0 = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            tc.push(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            e.run_host();
            to.push(t0.elapsed().as_secs_f64());
        }
        let (copy, op) = (median(tc), median(to));
        let gbs = |t: f64| e.bytes as f64 / t / 1e9;
        println!(
            "{:<32} {:>9} B  op {:>6.2} GB/s  copy {:>6.2} GB/s  fraction = {:.3}",
            e.name,
            e.bytes,
            gbs(op),
            gbs(copy),
            copy / op
        );
        group.bench_function(e.name.clone(), |b| b.iter(|| e.run_host()));
    }
    group.finish();
}

fn gpu(_: &mut Criterion) {
    gpu::bench(&Config::from_env());
}

criterion_group!(benches, cpu, gpu);
criterion_main!(benches);
