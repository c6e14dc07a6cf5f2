//! A GPT-2-small-shaped training step on the CPU (the simulated device), against what the
//! hardware can do and against itself with everything resident, measured in the same run.
//!
//! * **MFU**: tokens/s × llm.c's FLOPs per token (`6N + 6·L·C·T`) over the FMA peak measured
//!   at the start (16 register-only FMA chains per thread, one thread per core). Target ≥ 0.4.
//! * **Streaming**: the same model on a simulated device holding at most a third of its model
//!   data (fp32 parameters, masters, momentum and variance: 16 bytes a parameter), so chunks are
//!   evicted and reloaded every step under the tide scheduler, against the all-resident step:
//!   `ratio = streamed time / resident time` (target ≤ 1.1: transfers hidden behind compute).
//!
//! Shape: GPT-2 small's blocks (C = 768, 12 heads) with `TIDEMEM_BENCH_GPT_LAYERS` blocks
//! (default 6) and a vocabulary of `TIDEMEM_BENCH_GPT_VOCAB` (default 8,192: GPT-2's 50,257
//! would make `wte` one chunk of half the model and its logits most of the activations),
//! `TIDEMEM_BENCH_GPT_BATCH` × `…_SEQ` tokens (default 2 × 256), f32, activation checkpointing
//! off for the MFU and on for the streamed run and its resident baseline (the non-model peak
//! must leave room for chunks in a third of the model data), AdamW on the host.

#[path = "common/mean.rs"]
mod mean;

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use mean::Mean;
use tidemem::models::gpt::{train_step, Gpt, GptBatch, GptConfig, Plan};
use tidemem::optim::DevicePlacement;
use tidemem::prelude::*;
use tidemem::profile::{fma_isa, fma_peak};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Setup {
    cfg: GptConfig,
    batch: usize,
    seq: usize,
}

/// A manager on a simulated device of `capacity` bytes (`None`: room for everything), the
/// model, the optimizer.
fn trainer(
    s: &Setup,
    capacity: Option<u64>,
    warmup: Option<u64>,
) -> (ChunkManager, Gpt, HybridAdam) {
    let largest = s
        .cfg
        .param_shapes()
        .iter()
        .map(|(_, x)| x.iter().product::<usize>())
        .max();
    let chunk = largest.unwrap_or(1).div_ceil(1024) * 1024;
    let mut cfg = ManagerConfig::new(chunk, Policy::Tide);
    cfg.param_dtype = DType::F32;
    let cap = capacity.unwrap_or(1 << 40);
    cfg.scheduler.capacity = cap;
    cfg.scheduler.overall_fraction = 1.0;
    if let Some(peak) = warmup {
        cfg.scheduler.warmup_chunk_fraction = cap.saturating_sub(peak) as f64 / cap as f64;
    }
    let dev = Device::sim(SimConfig::with_capacity(cap as usize)).expect("sim device");
    let mut m = ChunkManager::new(dev.clone(), cfg).expect("manager");
    m.set_non_model_allocator(CachingAllocator::new(dev));
    let gpt = Gpt::register(&mut m, &s.cfg, 1).expect("register");
    let adam = HybridAdam::new(HybridConfig {
        placement: DevicePlacement::HostOnly,
        ..HybridConfig::new(AdamConfig::adamw(1e-4, 0.0))
    })
    .expect("adam");
    (m, gpt, adam)
}

fn step(s: &Setup, m: &mut ChunkManager, gpt: &Gpt, adam: &mut HybridAdam, k: u64, ckpt: bool) {
    let n = s.batch * s.seq;
    let v = s.cfg.vocab as u64;
    let tok: Vec<i32> = (0..=n as u64)
        .map(|i| ((i * 2654435761 + k * 97) % v) as i32)
        .collect();
    let b = GptBatch {
        tokens: &tok[..n],
        targets: &tok[1..],
        batch: s.batch,
        seq: s.seq,
    };
    train_step(
        gpt,
        m,
        &Plan {
            checkpoint: ckpt,
            ..Plan::default()
        },
        adam,
        &[b],
    )
    .expect("step");
}

fn bench(c: &mut Criterion) {
    let mut cfg = GptConfig::preset("gpt2").expect("preset");
    cfg.layers = env("TIDEMEM_BENCH_GPT_LAYERS", 6);
    cfg.vocab = env("TIDEMEM_BENCH_GPT_VOCAB", 8192);
    let s = Setup {
        cfg,
        batch: env("TIDEMEM_BENCH_GPT_BATCH", 2),
        seq: env("TIDEMEM_BENCH_GPT_SEQ", 256),
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let peak = fma_isa().map(|(_, lanes)| fma_peak(lanes, threads, 0.5) * 1e9);

    // all resident without checkpointing: the MFU
    let (mut p, pgpt, mut padam) = trainer(&s, None, None);
    for k in 0..2 {
        step(&s, &mut p, &pgpt, &mut padam, k, false);
    }
    // all resident with checkpointing: the streamed run's baseline
    let (mut m, gpt, mut adam) = trainer(&s, None, None);
    for k in 0..2 {
        step(&s, &mut m, &gpt, &mut adam, k, true);
    }
    let non_model = m.non_model_peak();
    let model_data = m.param_footprint() / 4 * 16;
    // a third of the model data
    let capacity = model_data / 3;
    assert!(
        capacity > non_model,
        "the non-model peak ({non_model} B) leaves no room for chunks in a third of the model \
         data ({model_data} B): more layers or fewer tokens"
    );
    let (mut small, sgpt, mut sadam) = trainer(&s, Some(capacity), Some(non_model));
    for k in 0..2 {
        step(&s, &mut small, &sgpt, &mut sadam, k, true);
    }

    let (mut plain, mut resident, mut streamed) =
        (Mean::default(), Mean::default(), Mean::default());
    let mut g = c.benchmark_group("gpt");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1));
    let mut k = 2;
    g.bench_function("resident_plain", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                step(&s, &mut p, &pgpt, &mut padam, k, false);
                k += 1;
            }
            plain.add(t.elapsed(), iters)
        })
    });
    g.bench_function("resident", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                step(&s, &mut m, &gpt, &mut adam, k, true);
                k += 1;
            }
            resident.add(t.elapsed(), iters)
        })
    });
    let mut moved = 0u64;
    g.bench_function("streamed", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                step(&s, &mut small, &sgpt, &mut sadam, k, true);
                moved = small.last_iteration().h2d_bytes;
                k += 1;
            }
            streamed.add(t.elapsed(), iters)
        })
    });
    g.finish();
    let tokens = (s.batch * s.seq) as f64;
    let tps = tokens / plain.per_iter();
    let flops = tps * s.cfg.flops_per_token(s.seq);
    println!(
        "\ngpt cpu: {} blocks × {} channels, vocabulary {}, {} × {} tokens, f32 ({} parameters)",
        s.cfg.layers,
        s.cfg.channels,
        s.cfg.vocab,
        s.batch,
        s.seq,
        s.cfg.params()
    );
    match peak {
        Some(p) => println!(
            "  resident, no checkpointing: {tps:.0} tokens/s, {:.1} GFLOP/s, MFU {:.3} of the FMA \
             peak {:.1} GFLOP/s (target ≥ 0.4)",
            flops / 1e9,
            flops / p,
            p / 1e9
        ),
        None => println!("  resident: {tps:.0} tokens/s (no FMA peak on this CPU)"),
    }
    println!(
        "  checkpointing on, resident {:.0} tokens/s; streamed: model data {:.1} MiB on a {:.1} MiB device ({:.2}×), h2d {:.1} MiB a step; \
         ratio = streamed / resident time {:.3} (target ≤ 1.1)",
        tokens / resident.per_iter(),
        model_data as f64 / (1 << 20) as f64,
        capacity as f64 / (1 << 20) as f64,
        model_data as f64 / capacity as f64,
        moved as f64 / (1 << 20) as f64,
        streamed.ratio(&resident)
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
