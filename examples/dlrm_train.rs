//! Trains a DLRM ([`tidemem::models::dlrm`]) on synthetic Criteo-like data, its embedding
//! tables in one cached collection (a `--cache-ratio` share of the rows on the device) or all
//! rows on the device (`--full-table`), on one rank.
//!
//! ```sh
//! cargo run --release --example dlrm_train -- --preset kaggle --scale 0.01 --batch 2048 \
//!     --steps 300 --cache-ratio 0.015 --eval-every 50
//! cargo run --release --example dlrm_train -- --preset tiny --steps 200 --full-table --json
//! ```
//!
//! The MLPs train with Adam in the memory layer (`--lr`); the embedding rows with the cache's
//! row optimizer (`--emb-opt sgd|adagrad|adam`, `--emb-lr`). Ids are counted over the first
//! `--count-batches` batches, the tables reordered by frequency and the hottest
//! `--warmup × capacity` rows preloaded. The capacity is raised to twice the largest batch's
//! distinct rows when the ratio gives fewer (reported as `capacity`). Held-out batches (a
//! disjoint range of batch indices) give the AUC and log loss every `--eval-every` steps and at
//! the end, beside the hidden model's own AUC on them (the ceiling on that data).
//!
//! `--json` prints one object at the end (keys are stable): `preset`, `scale`, `batch`,
//! `steps`, `rows`, `dim`, `capacity`, `full_table`, `auc`, `logloss`, `hidden_model_auc`,
//! `hidden_model_logloss`, `it_per_s`, `samples_per_s`, `cache_hit_rate`,
//! `device_bytes_embeddings`, `full_table_bytes`, `h2d_bytes`, `d2h_bytes`, `history` (a list
//! of `{ step, loss, auc, logloss }`).

use std::time::Instant;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tidemem::data::criteo::{Batch, Dataset, Synthetic, SyntheticConfig};
use tidemem::embedding::{bincount, CachedEmbeddingCollection, EmbeddingOptimizer, Policy};
use tidemem::metrics::{auc, log_loss};
use tidemem::models::dlrm::{self, Dlrm, DlrmConfig};
use tidemem::ops::embedding::BagMode;
use tidemem::prelude::*;
use tidemem::rng::{Rng, SplitMix64};

#[derive(Parser, Debug)]
#[command(about = "Train a DLRM on synthetic Criteo-like data with a cached embedding")]
struct Args {
    /// kaggle, torchrec or tiny.
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Factor on every Criteo Kaggle table's cardinality, in (0, 1].
    #[arg(long, default_value_t = 0.01)]
    scale: f64,
    /// Zipf exponent of id popularity.
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Seed of the data and the model.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Samples per batch.
    #[arg(long, default_value_t = 1024)]
    batch: usize,
    /// Training steps.
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Share of all embedding rows cached on the device.
    #[arg(long, default_value_t = 0.015)]
    cache_ratio: f64,
    /// Every row on the device (the comparison mode).
    #[arg(long)]
    full_table: bool,
    /// Eviction policy: frequency, lfu or lru.
    #[arg(long, default_value = "frequency")]
    policy: String,
    /// Batches the id frequencies are counted over.
    #[arg(long, default_value_t = 20)]
    count_batches: u64,
    /// Share of the cache preloaded with the hottest rows.
    #[arg(long, default_value_t = 0.7)]
    warmup: f64,
    /// The embedding rows' optimizer: sgd, adagrad (row-wise) or adam.
    #[arg(long, default_value = "sgd")]
    emb_opt: String,
    /// The embedding rows' learning rate.
    #[arg(long, default_value_t = 0.5)]
    emb_lr: f32,
    /// The MLPs' Adam learning rate.
    #[arg(long, default_value_t = 1e-2)]
    lr: f32,
    /// Steps between evaluations (0: only at the end).
    #[arg(long, default_value_t = 0)]
    eval_every: u64,
    /// Held-out batches per evaluation.
    #[arg(long, default_value_t = 8)]
    eval_batches: u64,
    /// sim or cuda.
    #[arg(long, default_value = "sim")]
    backend: String,
    /// Print one JSON object at the end instead of the progress bar and summary.
    #[arg(long)]
    json: bool,
}

/// Held-out batches start at this index: disjoint from the training batches.
const HELD_OUT: u64 = 1 << 40;

fn bad(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

fn main() {
    let a = Args::parse();
    if let Err(e) = run(&a) {
        eprintln!("dlrm_train: {e}");
        std::process::exit(1);
    }
}

fn device(a: &Args) -> Result<Device> {
    match a.backend.as_str() {
        "sim" => Device::sim(SimConfig::with_capacity(4 << 30)),
        "cuda" => Device::cuda(0),
        b => Err(bad(format!("--backend {b}: sim or cuda"))),
    }
}

fn emb_optimizer(a: &Args) -> Result<EmbeddingOptimizer> {
    Ok(match a.emb_opt.as_str() {
        "sgd" => EmbeddingOptimizer::Sgd { lr: a.emb_lr },
        "adagrad" => EmbeddingOptimizer::RowwiseAdagrad {
            lr: a.emb_lr,
            eps: 1e-8,
        },
        "adam" => EmbeddingOptimizer::Adam {
            lr: a.emb_lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        o => return Err(bad(format!("--emb-opt {o}: sgd, adagrad or adam"))),
    })
}

fn policy(a: &Args) -> Result<Policy> {
    Ok(match a.policy.as_str() {
        "frequency" => Policy::Frequency,
        "lfu" => Policy::Lfu,
        "lru" => Policy::Lru,
        p => return Err(bad(format!("--policy {p}: frequency, lfu or lru"))),
    })
}

/// The collection: capacity from the ratio (or every row), tables reordered by the counted
/// frequencies and warmed up.
fn collection(
    a: &Args,
    dev: Device,
    gen: &Synthetic,
    dim: usize,
) -> Result<(CachedEmbeddingCollection, usize)> {
    let rows: Vec<usize> = gen.cardinalities().iter().map(|&n| n as usize).collect();
    let total: usize = rows.iter().sum();
    let mut counted = Vec::new();
    let mut largest = 0;
    for i in 0..a.count_batches.max(1) {
        let mut ids = gen.concat_ids(&gen.batch(i, a.batch))?;
        counted.extend_from_slice(&ids);
        ids.sort_unstable();
        ids.dedup();
        largest = largest.max(ids.len());
    }
    let capacity = if a.full_table {
        total
    } else {
        ((a.cache_ratio * total as f64).ceil() as usize)
            .max(2 * largest)
            .min(total)
    };
    let max_rows = rows.iter().copied().max().unwrap_or(1);
    let bound = (1.0 / max_rows as f64).sqrt();
    let pol = policy(a)?;
    let mut emb = CachedEmbeddingCollection::new(
        dev,
        &rows,
        dim,
        capacity,
        BagMode::Sum,
        emb_optimizer(a)?,
        |c| c.policy(pol),
        |t, id, row| {
            let mut r = SplitMix64::new(a.seed ^ ((t as u64) << 32 | u64::from(id)));
            for v in row {
                *v = ((2.0 * r.next_f64() - 1.0) * bound) as f32;
            }
        },
    )?;
    let counts = bincount(total, [counted.as_slice()])?;
    let cache = emb.bag_mut().cache_mut();
    cache.reorder(&counts)?;
    cache.warm_up(a.warmup)?;
    Ok((emb, capacity))
}

/// AUC and log loss on the held-out batches.
fn evaluate(
    model: &Dlrm,
    store: &mut ChunkManager,
    emb: &mut CachedEmbeddingCollection,
    held_out: &[Batch],
) -> Result<(f64, f64)> {
    let (mut p, mut y) = (Vec::new(), Vec::new());
    for b in held_out {
        p.extend(dlrm::predict(model, store, emb, b)?);
        y.extend_from_slice(&b.labels);
    }
    Ok((auc(&p, &y)?.unwrap_or(0.5), log_loss(&p, &y)?))
}

fn run(a: &Args) -> Result<()> {
    let cfg = DlrmConfig::preset(&a.preset).ok_or_else(|| {
        bad(format!(
            "--preset {}: one of {:?}",
            a.preset,
            DlrmConfig::PRESETS
        ))
    })?;
    let gen = Synthetic::new(
        SyntheticConfig::new(Dataset::CriteoKaggle)
            .with_scale(a.scale)
            .with_zipf(a.zipf)
            .with_seed(a.seed),
    )?;
    let dev = device(a)?;
    let mut mc = ManagerConfig::new(1 << 20, tidemem::tide::Policy::Tide);
    mc.param_dtype = DType::F32;
    let mut store = ChunkManager::new(dev.clone(), mc)?;
    let model = Dlrm::register(&mut store, &cfg, a.seed)?;
    let (mut emb, capacity) = collection(a, dev, &gen, cfg.dim)?;
    let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(a.lr)))?;
    let held_out: Vec<Batch> = (0..a.eval_batches.max(1))
        .map(|i| gen.batch(HELD_OUT + i, a.batch))
        .collect();
    let (mut t, mut y) = (Vec::new(), Vec::new());
    for b in &held_out {
        t.extend((0..b.size).map(|s| 1.0 / (1.0 + (-gen.true_logit(b, s)).exp()) as f32));
        y.extend_from_slice(&b.labels);
    }
    let (hidden_auc, hidden_ll) = (auc(&t, &y)?.unwrap_or(0.5), log_loss(&t, &y)?);
    let bar = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(a.steps)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps {elapsed} | {msg}")
            .expect("a valid template"),
    );
    let mut history = Vec::new();
    let (mut trained, mut last_auc) = (0.0f64, f64::NAN);
    let mut loss_avg = f32::NAN;
    for step in 0..a.steps {
        let b = gen.batch(step, a.batch);
        let t0 = Instant::now();
        let s = dlrm::train_step(&model, &mut store, &mut adam, &mut emb, &b)?;
        trained += t0.elapsed().as_secs_f64();
        loss_avg = if loss_avg.is_nan() {
            s.loss
        } else {
            0.95 * loss_avg + 0.05 * s.loss
        };
        let done = step + 1;
        let mut entry = json!({ "step": done, "loss": s.loss });
        if (a.eval_every > 0 && done % a.eval_every == 0) || done == a.steps {
            let (au, ll) = evaluate(&model, &mut store, &mut emb, &held_out)?;
            last_auc = au;
            entry["auc"] = json!(au);
            entry["logloss"] = json!(ll);
            history.push(entry);
        } else if a.json {
            history.push(entry);
        }
        let moved = emb.bag().cache().moved();
        bar.set_message(format!(
            "loss {loss_avg:.4} auc {last_auc:.4} {:.1} it/s moved {} MB",
            done as f64 / trained,
            (moved.h2d_bytes + moved.d2h_bytes) >> 20
        ));
        bar.inc(1);
    }
    bar.finish();
    let (final_auc, final_ll) = evaluate(&model, &mut store, &mut emb, &held_out)?;
    let cache = emb.bag().cache();
    let (rows, dim) = (cache.rows(), cache.dim());
    let full_table_bytes = rows * cache.stride() * 4;
    let report = json!({
        "preset": a.preset, "scale": a.scale, "batch": a.batch, "steps": a.steps,
        "rows": rows, "dim": dim, "capacity": capacity, "full_table": a.full_table,
        "auc": final_auc, "logloss": final_ll,
        "hidden_model_auc": hidden_auc, "hidden_model_logloss": hidden_ll,
        "it_per_s": a.steps as f64 / trained,
        "samples_per_s": (a.steps as f64 * a.batch as f64) / trained,
        "cache_hit_rate": cache.stats().hit_rate(),
        "device_bytes_embeddings": emb.bag().device_bytes(),
        "full_table_bytes": full_table_bytes,
        "h2d_bytes": cache.moved().h2d_bytes, "d2h_bytes": cache.moved().d2h_bytes,
        "history": history,
    });
    if a.json {
        println!("{report}");
    } else {
        println!(
            "{} steps of {} samples: AUC {final_auc:.4} (hidden model {hidden_auc:.4}), log loss \
             {final_ll:.4} ({hidden_ll:.4}), {:.1} it/s, hit rate {:.3}, embeddings {} MB on the \
             device of {} MB",
            a.steps,
            a.batch,
            a.steps as f64 / trained,
            cache.stats().hit_rate(),
            emb.bag().device_bytes() >> 20,
            full_table_bytes >> 20
        );
    }
    Ok(())
}
