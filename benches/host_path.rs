//! The host's own time a training step, with the device's arithmetic taken out: the trainers
//! run on a timing-only simulated device ([`SimConfig::timing_only`]), which checks, orders and
//! counts every launch, copy and allocation but runs none, so what is timed is the host's
//! critical path (launch checks, the tide's decisions, plans, allocation, the optimizer's
//! host side, the embedding cache's decisions and row gathers). A GPU can only be fed faster
//! than it computes if this is well under the step's arithmetic. **The losses are meaningless**.
//!
//! * **GPT-2 124M**, bf16, 8 × 1024 tokens, resident (a device with room for every chunk),
//!   activation checkpointing on, Adam placed by PatrickStar's rule (on the device). Target
//!   ≤ 3 ms a step: an H100 needs about 13 ms of arithmetic for it at 50% of its bf16 peak.
//! * **DLRM**, `d = 128` ([`DlrmConfig::torchrec`]'s MLPs) over the 26 Criteo-Kaggle tables at
//!   cardinalities × `TIDEMEM_BENCH_HOST_DLRM_SCALE` (default 0.1: the full tables' 17 GB of
//!   rows exceed this machine kind's memory), batch 16,384, a cache of 1% of the rows, SGD on
//!   the rows; the batches built ahead on worker threads ([`Ahead`]), so the training thread's
//!   time is the step's, which prepares the cache for the next batch as `dlrm_train` does
//!   ([`dlrm::train_step`] with `StepPlan::next`). Target ≤ 4 ms a step (TorchRec's 81 it/s leave 12.3 ms in
//!   all).
//!
//! Prints each step's host time against its target, the device's counts a step
//! ([`DeviceStats`]), and the DLRM step's profile (`Device::start_profile`).
//!
//! ```sh
//! cargo bench --bench host_path
//! ```

#[path = "common/mean.rs"]
#[allow(dead_code)] // `ratio`: this bench prints fractions of its targets instead
mod mean;

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use mean::Mean;
use tidemem::data::criteo::{Batch, Dataset, Synthetic, SyntheticConfig};
use tidemem::data::Ahead;
use tidemem::device::DeviceStats;
use tidemem::embedding::{bincount, CachedEmbeddingCollection};
use tidemem::models::dlrm::{self, Dlrm, DlrmConfig};
use tidemem::models::gpt::{train_step, Gpt, GptBatch, GptConfig, Plan};
use tidemem::ops::embedding::BagMode;
use tidemem::ops::embedding::EmbeddingOptimizer;
use tidemem::optim::DevicePlacement;
use tidemem::prelude::*;

const GPT_TARGET_MS: f64 = 3.0;
const DLRM_TARGET_MS: f64 = 4.0;

fn timing_only(capacity: usize) -> Device {
    Device::sim(SimConfig::with_capacity(capacity).timing_only()).expect("sim device")
}

struct GptRun {
    m: ChunkManager,
    gpt: Gpt,
    adam: HybridAdam,
    ckpt: bool,
    tokens: Vec<i32>,
    batch: usize,
    seq: usize,
}

impl GptRun {
    fn new() -> GptRun {
        let cfg = GptConfig::preset("gpt2").expect("preset");
        let largest = cfg
            .param_shapes()
            .iter()
            .map(|(_, x)| x.iter().product::<usize>())
            .max()
            .unwrap_or(1);
        let mut mc = ManagerConfig::new(largest.div_ceil(1024) * 1024, Policy::Tide);
        mc.param_dtype = DType::BF16;
        let cap: u64 = 64 << 30;
        mc.scheduler.capacity = cap;
        let dev = timing_only(cap as usize);
        let mut m = ChunkManager::new(dev.clone(), mc).expect("manager");
        m.set_non_model_allocator(CachingAllocator::new(dev));
        let gpt = Gpt::register(&mut m, &cfg, 1).expect("register");
        let adam = HybridAdam::new(HybridConfig {
            placement: DevicePlacement::Auto { fraction: 0.8 },
            ..HybridConfig::new(AdamConfig::adamw(1e-4, 0.0))
        })
        .expect("adam");
        let (batch, seq) = (8, 1024);
        let tokens = (0..=(batch * seq) as u64)
            .map(|i| ((i * 2654435761) % cfg.vocab as u64) as i32)
            .collect();
        GptRun {
            ckpt: cfg.layers >= 12,
            m,
            gpt,
            adam,
            tokens,
            batch,
            seq,
        }
    }

    fn step(&mut self) -> DeviceStats {
        let before = self.m.device().stats();
        let n = self.batch * self.seq;
        let b = GptBatch {
            tokens: &self.tokens[..n],
            targets: &self.tokens[1..],
            batch: self.batch,
            seq: self.seq,
        };
        train_step(
            &self.gpt,
            &mut self.m,
            &Plan {
                checkpoint: self.ckpt,
                ..Plan::default()
            },
            &mut self.adam,
            &[b],
        )
        .expect("step");
        self.m.device().stats().since(&before)
    }
}

struct DlrmRun {
    store: ChunkManager,
    model: Dlrm,
    adam: HybridAdam,
    emb: CachedEmbeddingCollection,
    batches: Ahead<Batch>,
    /// The batch the next step trains on (each step prepares the cache for the one after).
    upcoming: Batch,
    rows: usize,
    capacity: usize,
}

impl DlrmRun {
    fn new(scale: f64, batch: usize) -> DlrmRun {
        let gen = Synthetic::new(
            SyntheticConfig::new(Dataset::CriteoKaggle)
                .with_scale(scale)
                .with_zipf(1.0),
        )
        .expect("synthetic data");
        let rows: Vec<usize> = gen.cardinalities().iter().map(|&n| n as usize).collect();
        let total: usize = rows.iter().sum();
        let (mut counted, mut largest) = (Vec::new(), 0);
        for i in 0..8 {
            let mut ids = gen.concat_ids(&gen.batch(i, batch)).expect("32-bit ids");
            counted.extend_from_slice(&ids);
            ids.sort_unstable();
            ids.dedup();
            largest = largest.max(ids.len());
        }
        let capacity = ((0.01 * total as f64).ceil() as usize)
            .max(2 * largest)
            .min(total);
        let cfg = DlrmConfig::torchrec();
        let dev = timing_only(64 << 30);
        let mut mc = ManagerConfig::new(1 << 20, Policy::Tide);
        mc.param_dtype = DType::F32;
        let mut store = ChunkManager::new(dev.clone(), mc).expect("manager");
        let model = Dlrm::register(&mut store, &cfg, 0).expect("model");
        let mut emb = CachedEmbeddingCollection::new(
            dev,
            &rows,
            cfg.dim,
            capacity,
            BagMode::Sum,
            EmbeddingOptimizer::Sgd { lr: 0.5 },
            // a batch's moves fit the staging buffers: the host never waits to reuse them
            |c| c.staging_rows(largest.max(4096)),
            |_, id, row| row.fill(1e-3 * (id % 17) as f32),
        )
        .expect("collection");
        let cache = emb.bag_mut().cache_mut();
        cache
            .reorder(&bincount(total, [counted.as_slice()]).expect("counts"))
            .expect("reorder");
        cache.warm_up(0.7).expect("warm-up");
        let adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-3))).expect("adam");
        let workers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .saturating_sub(1)
            .clamp(1, 4);
        let mut batches = Ahead::indexed(8..u64::MAX, 4, workers, move |i| gen.try_batch(i, batch))
            .expect("data workers");
        let upcoming = batches.recv().expect("batch").expect("endless");
        DlrmRun {
            store,
            model,
            adam,
            emb,
            batches,
            upcoming,
            rows: total,
            capacity,
        }
    }

    /// A step, as `dlrm_train` runs it (the cache prepared for the next batch while the device
    /// computes this one); the time the training thread spent in it, waiting for its batch
    /// excluded, and the device's counts.
    fn step(&mut self) -> (Duration, DeviceStats) {
        let next = self.batches.recv().expect("batch").expect("endless");
        let b = std::mem::replace(&mut self.upcoming, next);
        let before = self.store.device().stats();
        let t = Instant::now();
        let plan = dlrm::StepPlan {
            next: Some(&self.upcoming),
            ..Default::default()
        };
        dlrm::train_step(
            &self.model,
            &mut self.store,
            &mut self.adam,
            &mut self.emb,
            &b,
            plan,
        )
        .expect("step");
        (t.elapsed(), self.store.device().stats().since(&before))
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("host_path");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(2));

    let mut gpt = GptRun::new();
    for _ in 0..2 {
        gpt.step();
    }
    let mut gpt_mean = Mean::default();
    let mut gpt_counts = DeviceStats::default();
    g.bench_function("gpt2_124m_8x1024", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                gpt_counts = gpt.step();
            }
            gpt_mean.add(t.elapsed(), iters)
        })
    });
    let gpt_groups = gpt.m.groups();
    drop(gpt);

    let scale = std::env::var("TIDEMEM_BENCH_HOST_DLRM_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.1);
    let mut dlrm = DlrmRun::new(scale, 16_384);
    for _ in 0..2 {
        dlrm.step();
    }
    let mut dlrm_mean = Mean::default();
    let mut dlrm_counts = DeviceStats::default();
    g.bench_function("dlrm_kaggle_16384", |b| {
        b.iter_custom(|iters| {
            let mut t = Duration::ZERO;
            for _ in 0..iters {
                let (d, c) = dlrm.step();
                t += d;
                dlrm_counts = c;
            }
            dlrm_mean.add(t, iters)
        })
    });
    g.finish();
    // where the training thread's time goes, over a few more steps
    let dev = dlrm.store.device().clone();
    dev.start_profile();
    for _ in 0..4 {
        dlrm.step();
    }
    let dlrm_profile = dev.stop_profile().expect("profile").per_step(4);

    let ms = |m: &Mean| m.per_iter() * 1e3;
    println!(
        "\nhost path on a timing-only simulated device (no arithmetic; the losses are meaningless):"
    );
    println!(
        "  GPT-2 124M, bf16, 8 × 1024 tokens, resident, {gpt_groups} chunk groups: {:.2} ms a step, \
         target ≤ {GPT_TARGET_MS} ms: {:.2}× the target",
        ms(&gpt_mean),
        ms(&gpt_mean) / GPT_TARGET_MS
    );
    println!(
        "  DLRM d = 128, Kaggle tables × {scale} ({} rows), batch 16,384, a cache of {} rows \
         ({:.2}%): the training thread {:.2} ms a step, target ≤ {DLRM_TARGET_MS} ms: {:.2}× the \
         target ({} of {} batches waited for)",
        dlrm.rows,
        dlrm.capacity,
        100.0 * dlrm.capacity as f64 / dlrm.rows as f64,
        ms(&dlrm_mean),
        ms(&dlrm_mean) / DLRM_TARGET_MS,
        dlrm.batches.stats().waited,
        dlrm.batches.stats().delivered,
    );
    for (what, c) in [("GPT-2 124M", gpt_counts), ("DLRM", dlrm_counts)] {
        println!(
            "  {what} a step: {} launches, {} library calls, {} fills, {} device allocations, {} \
             blocking waits ({} stream syncs, {} event syncs, {} copies waited for)",
            c.launches,
            c.library_calls,
            c.fills,
            c.device_allocs,
            c.blocking_waits(),
            c.stream_syncs,
            c.event_syncs,
            c.pending_waits
        );
    }
    println!("  DLRM, where the training thread's step goes (timing-only device):\n{dlrm_profile}");
}

criterion_group!(benches, bench);
criterion_main!(benches);
