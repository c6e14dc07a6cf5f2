//! Trains a DLRM ([`tidemem::models::dlrm`]) with a cached embedding: a `--cache-ratio` share of
//! the rows on the device (or every row, `--full-table`), on one rank or in hybrid parallel over
//! `--ranks N` in-process ranks (the tables placed table-wise or column-wise, the MLPs data
//! parallel), on synthetic Criteo-like data or a Criteo TSV file.
//!
//! ```sh
//! cargo run --release --example dlrm_train -- --preset kaggle --scale 0.01 --batch 2048 \
//!     --steps 300 --cache-ratio 0.015 --eval-every 50
//! cargo run --release --example dlrm_train -- --preset tiny --steps 200 --full-table --json
//! cargo run --release --example dlrm_train -- --ranks 4 --sharding column --steps 100
//! cargo run --release --example dlrm_train -- --dataset criteo-tsv train.txt --ids vocab \
//!     --preset kaggle --scale 1 --batch 4096
//! ```
//!
//! The MLPs train with Adam in the memory layer (`--lr`); the embedding rows with the cache's
//! row optimizer (`--emb-opt sgd|adagrad|adam`, `--emb-lr`). Ids are counted over the first
//! `--count-batches` batches, the tables reordered by frequency and the hottest
//! `--warmup × capacity` rows preloaded. The capacity is raised to twice the largest batch's
//! distinct rows when the ratio gives fewer (reported as `capacity`).
//!
//! Held-out batches give the AUC and log loss every `--eval-every` steps and at the end. On
//! synthetic data they are a disjoint range of batch indices, and the hidden model's own AUC on
//! them (the ceiling on that data) is reported beside. On a TSV file (`--dataset criteo-tsv
//! PATH`: label, 13 integer and 26 hex columns, tab-separated) they are the first
//! `--eval-batches` batches of `--eval-tsv PATH`, or else of the training file, which training
//! then skips; ids are hashed into the preset's (scaled) Kaggle cardinalities, or numbered by a
//! vocabulary built in a first pass (`--ids vocab`); malformed lines are skipped and reported
//! with their line numbers. Training stops after `--steps` or at the end of the file.
//!
//! `--trace DIR` writes `steps.csv` (every step's loss, seconds, bytes moved and hit rate) and,
//! on one rank, the MLP store's Chrome trace (`dlrm_train.json`) and tide plot (`tide.svg`).
//!
//! `--json` prints one object at the end (keys are stable): `preset`, `dataset`, `scale`,
//! `batch`, `steps`, `ranks`, `sharding`, `rows`, `dim`, `capacity`, `full_table`, `auc`,
//! `logloss`, `hidden_model_auc` and `hidden_model_logloss` (synthetic data; `null` otherwise),
//! `it_per_s`, `samples_per_s`, `cache_hit_rate`, `device_bytes_embeddings` (over all ranks),
//! `full_table_bytes`, `h2d_bytes`, `d2h_bytes`, `malformed_lines`, `history` (a list of
//! `{ step, loss, auc, logloss }`).

mod data;
mod ranks;
mod trainer;

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tidemem::data::criteo::{Batch, Dataset, Synthetic, SyntheticConfig};
use tidemem::embedding::{EmbeddingOptimizer, Policy};
use tidemem::metrics::{auc, log_loss};
use tidemem::models::dlrm::DlrmConfig;
use tidemem::prelude::*;

use data::Source;
use trainer::Trainer;

#[derive(Parser, Debug)]
#[command(about = "Train a DLRM with a cached embedding, on one rank or in hybrid parallel")]
pub struct Args {
    /// kaggle, torchrec or tiny.
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// `synthetic`, or `criteo-tsv PATH`.
    #[arg(long, num_args = 1..=2, value_names = ["KIND", "PATH"], default_value = "synthetic")]
    dataset: Vec<String>,
    /// Held-out TSV file (criteo-tsv; default: the first batches of the training file).
    #[arg(long)]
    eval_tsv: Option<PathBuf>,
    /// How TSV categorical values become ids: hash or vocab.
    #[arg(long, default_value = "hash")]
    ids: String,
    /// Factor on every Criteo Kaggle table's cardinality, in (0, 1].
    #[arg(long, default_value_t = 0.01)]
    scale: f64,
    /// Zipf exponent of id popularity (synthetic).
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Seed of the data and the model.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Samples per batch (the global batch over all ranks).
    #[arg(long, default_value_t = 1024)]
    batch: usize,
    /// Training steps.
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Share of all embedding rows cached on the device (of each rank's rows).
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
    /// In-process ranks: the tables over them, the MLPs data parallel.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// How the tables are placed over the ranks: table or column.
    #[arg(long, default_value = "table")]
    sharding: String,
    /// Steps between evaluations (0: only at the end).
    #[arg(long, default_value_t = 0)]
    eval_every: u64,
    /// Held-out batches per evaluation.
    #[arg(long, default_value_t = 8)]
    eval_batches: u64,
    /// sim or cuda.
    #[arg(long, default_value = "sim")]
    backend: String,
    /// Write steps.csv and the MLP store's trace and tide plot here.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Print one JSON object at the end instead of the progress bar and summary.
    #[arg(long)]
    json: bool,
}

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

impl Args {
    /// A device of this run's backend (`index` on CUDA).
    pub fn device(&self, index: usize) -> Result<Device> {
        match self.backend.as_str() {
            "sim" => Device::sim(SimConfig::with_capacity(4 << 30)),
            "cuda" => Device::cuda(index),
            b => Err(bad(format!("--backend {b}: sim or cuda"))),
        }
    }

    /// The embedding rows' optimizer.
    pub fn emb_optimizer(&self) -> Result<EmbeddingOptimizer> {
        Ok(match self.emb_opt.as_str() {
            "sgd" => EmbeddingOptimizer::Sgd { lr: self.emb_lr },
            "adagrad" => EmbeddingOptimizer::RowwiseAdagrad {
                lr: self.emb_lr,
                eps: 1e-8,
            },
            "adam" => EmbeddingOptimizer::Adam {
                lr: self.emb_lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
            o => return Err(bad(format!("--emb-opt {o}: sgd, adagrad or adam"))),
        })
    }

    /// The cache's eviction policy.
    pub fn policy(&self) -> Result<Policy> {
        Ok(match self.policy.as_str() {
            "frequency" => Policy::Frequency,
            "lfu" => Policy::Lfu,
            "lru" => Policy::Lru,
            p => return Err(bad(format!("--policy {p}: frequency, lfu or lru"))),
        })
    }

    /// The data source and its name.
    fn source(&self) -> Result<(Source, String)> {
        let gen = Synthetic::new(
            SyntheticConfig::new(Dataset::CriteoKaggle)
                .with_scale(self.scale)
                .with_zipf(self.zipf)
                .with_seed(self.seed),
        )?;
        match self.dataset.as_slice() {
            [k] if k == "synthetic" => Ok((
                Source::Synthetic {
                    gen: Box::new(gen),
                    next: 0,
                },
                k.clone(),
            )),
            [k, path] if k == "criteo-tsv" => {
                let vocab = match self.ids.as_str() {
                    "hash" => false,
                    "vocab" => true,
                    o => return Err(bad(format!("--ids {o}: hash or vocab"))),
                };
                let path = PathBuf::from(path);
                let cfg = data::tsv_config(&path, gen.cardinalities(), vocab)?;
                Ok((
                    Source::tsv(&path, cfg)?,
                    format!("criteo-tsv {}", path.display()),
                ))
            }
            other => Err(bad(format!(
                "--dataset {}: synthetic, or criteo-tsv PATH",
                other.join(" ")
            ))),
        }
    }
}

/// AUC (exact, ties handled) and log loss of `p` against the labels of `held_out`.
fn score(p: &[f32], held_out: &[Batch]) -> Result<(f64, f64)> {
    let y: Vec<f32> = held_out
        .iter()
        .flat_map(|b| b.labels.iter().copied())
        .collect();
    Ok((auc(p, &y)?.unwrap_or(0.5), log_loss(p, &y)?))
}

fn run(a: &Args) -> Result<()> {
    let cfg = DlrmConfig::preset(&a.preset).ok_or_else(|| {
        bad(format!(
            "--preset {}: one of {:?}",
            a.preset,
            DlrmConfig::PRESETS
        ))
    })?;
    if a.batch == 0 || a.steps == 0 {
        return Err(bad("--batch and --steps must be at least 1".into()));
    }
    let (mut source, dataset) = a.source()?;
    let held_out = source.held_out(
        a.eval_batches.max(1) as usize,
        a.batch,
        a.eval_tsv.as_deref(),
    )?;
    let hidden = match held_out
        .iter()
        .map(|b| source.hidden_probs(b))
        .collect::<Option<Vec<_>>>()
    {
        Some(p) => Some(score(&p.concat(), &held_out)?),
        None => None,
    };
    let counted = source.peek(a.count_batches.max(1) as usize, a.batch)?;
    let mut trainer = Trainer::new(a, &cfg, &source.cardinalities(), &counted)?;
    let bar = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(a.steps)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps {elapsed} | {msg}")
            .expect("a valid template"),
    );
    let mut csv = match &a.trace {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| bad(format!("{}: {e}", dir.display())))?;
            let path = dir.join("steps.csv");
            let mut f = std::fs::File::create(&path)
                .map_err(|e| bad(format!("{}: {e}", path.display())))?;
            writeln!(f, "step,loss,seconds,h2d_bytes,d2h_bytes,hit_rate")
                .map_err(|e| bad(format!("{}: {e}", path.display())))?;
            Some((f, path))
        }
        None => None,
    };
    let mut history = Vec::new();
    let (mut trained, mut steps, mut last_auc) = (0.0f64, 0u64, f64::NAN);
    let mut loss_avg = f32::NAN;
    while steps < a.steps {
        let Some(b) = source.next(a.batch)? else {
            break;
        };
        let t0 = Instant::now();
        let loss = trainer.step(&b)?;
        let seconds = t0.elapsed().as_secs_f64();
        trained += seconds;
        steps += 1;
        loss_avg = if loss_avg.is_nan() {
            loss
        } else {
            0.95 * loss_avg + 0.05 * loss
        };
        let mut entry = json!({ "step": steps, "loss": loss });
        if a.eval_every > 0 && steps % a.eval_every == 0 {
            let (au, ll) = score(&trainer.predict(&held_out)?, &held_out)?;
            last_auc = au;
            entry["auc"] = json!(au);
            entry["logloss"] = json!(ll);
            history.push(entry);
        } else if a.json {
            history.push(entry);
        }
        let s = trainer.stats()?;
        if let Some((f, path)) = csv.as_mut() {
            writeln!(
                f,
                "{steps},{loss},{seconds:.6},{},{},{:.6}",
                s.h2d_bytes, s.d2h_bytes, s.hit_rate
            )
            .map_err(|e| bad(format!("{}: {e}", path.display())))?;
        }
        bar.set_message(format!(
            "loss {loss_avg:.4} auc {last_auc:.4} {:.1} it/s moved {} MB",
            steps as f64 / trained,
            (s.h2d_bytes + s.d2h_bytes) >> 20
        ));
        bar.inc(1);
    }
    bar.finish();
    if steps == 0 {
        return Err(bad(
            "no training batch: the data ran out before the first step".into(),
        ));
    }
    let (final_auc, final_ll) = score(&trainer.predict(&held_out)?, &held_out)?;
    if history.last().and_then(|h| h.get("auc")).is_none() {
        history.push(json!({ "step": steps, "auc": final_auc, "logloss": final_ll }));
    }
    if let Some(dir) = &a.trace {
        trainer.write_trace(dir)?;
    }
    let s = trainer.stats()?;
    let malformed = source.report().map_or(0, |(_, r)| r.malformed);
    if let Some((path, r)) = source.report() {
        if r.malformed > 0 && !a.json {
            eprintln!(
                "{}: {} of {} lines malformed and skipped; the first at lines {:?}",
                path.display(),
                r.malformed,
                r.lines,
                r.malformed_lines
                    .iter()
                    .take(10)
                    .map(|m| m.line)
                    .collect::<Vec<_>>()
            );
        }
    }
    let report = json!({
        "preset": a.preset, "dataset": dataset, "scale": a.scale, "batch": a.batch,
        "steps": steps, "ranks": a.ranks, "sharding": a.sharding,
        "rows": s.rows, "dim": cfg.dim, "capacity": s.capacity, "full_table": a.full_table,
        "auc": final_auc, "logloss": final_ll,
        "hidden_model_auc": hidden.map(|h| h.0), "hidden_model_logloss": hidden.map(|h| h.1),
        "it_per_s": steps as f64 / trained,
        "samples_per_s": (steps as f64 * a.batch as f64) / trained,
        "cache_hit_rate": s.hit_rate,
        "device_bytes_embeddings": s.device_bytes,
        "full_table_bytes": s.full_table_bytes,
        "h2d_bytes": s.h2d_bytes, "d2h_bytes": s.d2h_bytes,
        "malformed_lines": malformed,
        "history": history,
    });
    if a.json {
        println!("{report}");
    } else {
        let ceiling = hidden.map_or(String::new(), |(h, hl)| {
            format!(" (hidden model {h:.4}, log loss {hl:.4})")
        });
        println!(
            "{steps} steps of {} samples on {} rank(s): AUC {final_auc:.4}, log loss \
             {final_ll:.4}{ceiling}, {:.1} it/s, hit rate {:.3}, embeddings {} MB on the \
             device of {} MB",
            a.batch,
            a.ranks,
            steps as f64 / trained,
            s.hit_rate,
            s.device_bytes >> 20,
            s.full_table_bytes >> 20
        );
    }
    Ok(())
}
