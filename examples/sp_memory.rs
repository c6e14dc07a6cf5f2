//! Activation memory per rank under sequence parallelism and under 1D tensor parallelism at
//! the same rank count, measured on simulated devices: one forward and backward of a GPT-2
//! small-width model (C 768, 12 heads) per scheme, the pool's peak (everything but the model
//! data) read from each rank's manager. From the per-sample and per-position slopes it prints
//! the longest sequence and the largest batch a 16 GiB device holds for 12 such layers once
//! the model data (counted from the layers' shapes, 14 bytes a parameter) is placed, beside the sequence-parallelism paper's 3.0× (sequence length) and
//! 13.7× (batch) on 64 P100s.
//!
//! ```sh
//! cargo run --release --example sp_memory
//! cargo run --release --example sp_memory -- --ranks 4 --json
//! ```
//!
//! The probe runs each rank's iteration on a `ChunkManager` of its own and skips the sum of the
//! sequence ranks' gradients (a ZeRO store's job in training), which holds no activation.

use clap::Parser;
use serde_json::json;
use tidemem::comm::Communicator;
use tidemem::models::gpt::{default_init, Gpt, GptBatch, GptConfig, Plan};
use tidemem::parallel::{GridSpec, ProcessGrid, TensorMode};
use tidemem::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Activation memory per rank: sequence parallelism vs 1D tensor parallelism")]
struct Args {
    /// Ranks of each scheme (must divide the 12 heads for 1D).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Blocks in the probe (the figures scale them to 12).
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Device memory of the extrapolation, GiB.
    #[arg(long, default_value_t = 16.0)]
    device_gib: f64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scheme {
    Tensor1D,
    Sequence,
}

fn config(layers: usize, max_seq: usize) -> GptConfig {
    GptConfig {
        layers,
        channels: 768,
        heads: 12,
        vocab: 8192,
        max_seq,
        eps: 1e-5,
    }
}

/// Parameters a rank holds of GPT-2 small's 12 blocks (1024 positions, vocabulary 8192):
/// under 1D the blocks' matrices, the column-split biases and `wte` split over `n`, the rest
/// whole; under sequence parallelism all of them (replicated, as in the paper; a ZeRO store
/// over the ring would hold `1/n` of the optimizer state).
fn params_per_rank(scheme: Scheme, n: usize) -> f64 {
    let (c, v, t, l) = (768.0, 8192.0, 1024.0, 12.0);
    let n = match scheme {
        Scheme::Tensor1D => n as f64,
        Scheme::Sequence => 1.0,
    };
    let split = (12.0 * c * c + 7.0 * c) / n; // c_attn, c_proj, c_fc, mlp c_proj; their biases
    let whole = 2.0 * c + 4.0 * c; // the row-parallel biases, the two LayerNorms
    l * (split + whole) + v * c / n + t * c + 2.0 * c
}

/// Rank 0's non-model peak for one iteration at `batch × seq`.
fn probe(a: &Args, scheme: Scheme, batch: usize, seq: usize) -> tidemem::Result<u64> {
    let n = a.ranks;
    let devices = (0..n)
        .map(|_| Device::sim(SimConfig::with_capacity(48 << 30)))
        .collect::<tidemem::Result<Vec<_>>>()?;
    let comms = Communicator::local(devices)?;
    let cfg = config(a.layers, seq);
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let cfg = &cfg;
                s.spawn(move || -> tidemem::Result<u64> {
                    let mut mc = ManagerConfig::new(8 << 20, Policy::Tide);
                    mc.param_dtype = DType::F16;
                    let mut m = ChunkManager::new(c.device().clone(), mc)?;
                    m.set_non_model_allocator(CachingAllocator::new(c.device().clone()));
                    let tensor = match scheme {
                        Scheme::Tensor1D => TensorMode::OneD { size: n },
                        Scheme::Sequence => TensorMode::None,
                    };
                    let sequence = if tensor == TensorMode::None { n } else { 1 };
                    let spec = GridSpec {
                        data: 1,
                        pipeline: 1,
                        sequence,
                        tensor,
                    };
                    let grid = ProcessGrid::new(&c, spec)?;
                    let plan = Plan::on(&grid);
                    let local = seq / sequence;
                    let tokens: Vec<i32> = (0..batch * local).map(|i| (i % 8000) as i32).collect();
                    let b = GptBatch {
                        tokens: &tokens,
                        targets: &tokens,
                        batch,
                        seq: local,
                    };
                    tidemem::with_placement!(tensor, |P| {
                        let gpt: Gpt<P> = Gpt::register_on(&mut m, &plan, cfg, |name, _| {
                            Ok(default_init(cfg, name, 1))
                        })?;
                        gpt.forward_backward(&mut m, &plan, &b, 1.0)?
                    });
                    m.skip_step()?;
                    Ok(m.non_model_peak())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect::<tidemem::Result<Vec<_>>>()
    })?;
    Ok(out[0])
}

/// The largest `x` with `fixed + slope·x + square·x² ≤ room` (0 if none).
fn largest(room: f64, slope: f64, square: f64) -> f64 {
    if square <= 0.0 {
        return (room / slope).max(0.0);
    }
    ((-slope + (slope * slope + 4.0 * square * room).sqrt()) / (2.0 * square)).max(0.0)
}

fn main() -> tidemem::Result<()> {
    let a = Args::parse();
    if a.ranks == 0 || 12 % a.ranks != 0 {
        return Err(tidemem::Error::InvalidArgument(format!(
            "--ranks {}: 1D needs a divisor of the 12 heads",
            a.ranks
        )));
    }
    let (t0, b0) = (128 * a.ranks, 1);
    let mut rows = Vec::new();
    for scheme in [Scheme::Tensor1D, Scheme::Sequence] {
        // the peak at (B, T), (2B, T) and (B, 2T): per sample, and the T and T² terms
        let p11 = probe(&a, scheme, b0, t0)?;
        let p21 = probe(&a, scheme, 2 * b0, t0)?;
        let p12 = probe(&a, scheme, b0, 2 * t0)?;
        let per_sample = (p21 - p11) as f64; // at T = t0
                                             // peak(T) ≈ u·T + w·T² for one sample: two points
        let (x1, x2) = (t0 as f64, 2.0 * t0 as f64);
        let (y1, y2) = (p11 as f64, p12 as f64);
        let w = ((y2 / x2 - y1 / x1) / (x2 - x1)).max(0.0);
        let u = y1 / x1 - w * x1;
        // 12 layers: the activations scale with the blocks; the model data is f16 parameters
        // and their f32 master, momentum and variance, 14 bytes each
        let scale = 12.0 / a.layers as f64;
        let model_12 = 14.0 * params_per_rank(scheme, a.ranks);
        let room = a.device_gib * f64::from(1u32 << 30) - model_12;
        let max_batch = (room / (per_sample * scale)).floor().max(0.0);
        let max_seq = largest(room, u * scale, w * scale).floor();
        rows.push(json!({
            "scheme": match scheme { Scheme::Tensor1D => "1d", Scheme::Sequence => "sequence" },
            "ranks": a.ranks,
            "peak_bytes_b1": p11,
            "activation_bytes_per_sample": per_sample,
            "model_data_bytes_12_layers": model_12,
            "max_batch_at_seq": max_batch,
            "seq": t0,
            "max_seq_batch_1": max_seq,
        }));
    }
    let ratio = |k: &str| rows[1][k].as_f64().unwrap_or(0.0) / rows[0][k].as_f64().unwrap_or(1.0);
    let (rb, rs) = (ratio("max_batch_at_seq"), ratio("max_seq_batch_1"));
    if a.json {
        println!(
            "{}",
            json!({ "rows": rows, "batch_ratio": rb, "seq_ratio": rs })
        );
        return Ok(());
    }
    println!(
        "GPT-2 small width (C 768, 12 heads), {} ranks, f16, measured on {} blocks and scaled to 12",
        a.ranks, a.layers
    );
    println!(
        "{:<10} {:>18} {:>16} {:>14} {:>14}",
        "scheme", "act MiB/sample", "model data GiB", "max batch", "max seq (B=1)"
    );
    for r in &rows {
        println!(
            "{:<10} {:>18.1} {:>16.2} {:>14} {:>14}",
            r["scheme"].as_str().unwrap_or(""),
            r["activation_bytes_per_sample"].as_f64().unwrap_or(0.0) / f64::from(1u32 << 20),
            r["model_data_bytes_12_layers"].as_f64().unwrap_or(0.0) / f64::from(1u32 << 30),
            r["max_batch_at_seq"],
            r["max_seq_batch_1"],
        );
    }
    println!(
        "sequence / 1D: max batch {rb:.2}× (at T = {t0}), max sequence {rs:.2}× (paper, 64 P100s: \
         13.7× batch, 3.0× sequence)"
    );
    Ok(())
}
