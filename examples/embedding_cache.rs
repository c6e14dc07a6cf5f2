//! Evaluates the embedding cache's policies on a synthetic Criteo-like trace: per cache ratio
//! and policy, the hit rate (per id occurrence), rows and bytes moved host→device and
//! device→host per batch, and the id-preparation throughput, beside the offline optimum.
//!
//! ```sh
//! cargo run --release --example embedding_cache -- --dataset criteo-kaggle --zipf 1.0 \
//!     --batch 16384 --batches 200 --ratios 0.005,0.01,0.015,0.05 --json
//! cargo run --release --example embedding_cache -- --scale 0.1 --batch 2048 --batches 100
//! cargo run --release --example embedding_cache -- --drift-days 20 --drift-shift 0.001 \
//!     --count-batches 20
//! ```
//!
//! All tables are concatenated into one id space and share one cache of `ratio × rows` rows;
//! ids are ordered by their frequency in the trace itself (dataset statistics; with
//! `--count-batches N`, in its first N batches only), and every
//! policy starts from the same warm-up (the hottest `warmup × capacity` rows). Training is
//! emulated: every row a batch uses becomes dirty, so evicting it costs a write-back.
//!
//! JSON output (keys are stable):
//! - `dataset`, `zipf`, `scale`, `seed`, `batch`, `batches`, `tables`, `rows`, `dim`,
//!   `row_bytes`, `warmup`, `count_batches` (batches the frequency order was counted over),
//!   `drift` (`null` or `{ batches_per_day, shift }`)
//! - `generate_seconds`: time to generate the trace; `unique_per_batch`: distinct rows per batch
//! - `results`: list of `{ ratio, capacity, policy, hit_rate, of_optimal, h2d_rows_per_batch,
//!   h2d_bytes_per_batch, d2h_bytes_per_batch, ids_per_second }`; `of_optimal` is the hit rate
//!   over the optimal policy's at the same ratio (`null` when the optimum was not run)
//!
//! Flags that make no sense (a batch of 0 samples or one past the machine's memory, a ratio
//! outside (0, 1], a non-finite rate, an unknown policy) are refused before any work; when no
//! run succeeds, the output is printed and the example exits with status 1.

use std::time::Instant;

use clap::Parser;
use serde_json::json;
use tidemem::data::criteo::{Batch, Dataset, Drift, Synthetic, SyntheticConfig};
use tidemem::embedding::{bincount, replay, CachePolicy, OptimalTrace, ReplayConfig};
use tidemem::limits;
use tidemem::units::fmt_bytes;

#[derive(Parser, Debug)]
#[command(about = "Hit rates and traffic of the embedding cache's policies on a Criteo-like trace")]
struct Args {
    /// criteo-kaggle, criteo-1tb or avazu.
    #[arg(long, default_value = "criteo-kaggle")]
    dataset: String,
    /// Zipf exponent of id popularity.
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Factor on every table's cardinality, in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Samples per batch (at least 1).
    #[arg(long, default_value_t = 16384)]
    batch: usize,
    /// Batches in the trace (at least 1).
    #[arg(long, default_value_t = 200)]
    batches: usize,
    /// Cache sizes as fractions of all rows, each in (0, 1].
    #[arg(long, value_delimiter = ',', default_value = "0.005,0.01,0.015,0.05")]
    ratios: Vec<f64>,
    /// Policies to run: frequency, lfu, lru, optimal.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "frequency,lfu,lru,optimal"
    )]
    policies: Vec<String>,
    /// Embedding width, for byte counts.
    #[arg(long, default_value_t = 128)]
    dim: usize,
    /// Floats of optimizer state per row (0 for SGD, 1 for row-wise Adagrad, 2·dim for Adam).
    #[arg(long, default_value_t = 0)]
    state: usize,
    /// Fraction of the cache preloaded with the hottest rows, in [0, 1].
    #[arg(long, default_value_t = 0.7)]
    warmup: f64,
    /// Seed of the synthetic data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Drifting variant: batches per "day" (popularity shifts every day).
    #[arg(long)]
    drift_days: Option<u64>,
    /// Drifting variant: fraction of each table's ranks the popularity rotates by per day.
    #[arg(long, default_value_t = 0.001)]
    drift_shift: f64,
    /// Frequency order from the counts of the first N batches only (default: the whole trace),
    /// as a trainer's order comes from data it has already seen.
    #[arg(long)]
    count_batches: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// A policy by name (the optimal one rebuilt from the trace by `replay`).
fn policy(name: &str) -> Result<CachePolicy, Box<dyn std::error::Error>> {
    Ok(match name {
        "frequency" => CachePolicy::Frequency,
        "lfu" => CachePolicy::Lfu,
        "lru" => CachePolicy::Lru,
        "optimal" => CachePolicy::Optimal(OptimalTrace::new::<_, &[u32]>([])?),
        other => return Err(format!("unknown policy '{other}'").into()),
    })
}

/// Refuses flags that make no sense before any work starts (the generator checks `--zipf`,
/// `--scale` and the drift); returns the bytes of one row.
fn check(args: &Args, tables: usize) -> Result<usize, Box<dyn std::error::Error>> {
    if args.batch == 0 || args.batches == 0 {
        return Err(format!(
            "--batch {} --batches {}: the trace needs at least one sample",
            args.batch, args.batches
        )
        .into());
    }
    // the trace's ids (a u32 per sample and table), and one generated batch at a time
    limits::host_bytes(
        || {
            format!(
                "bytes of a trace of {} batches of {} samples of {tables} tables",
                args.batches, args.batch
            )
        },
        &[args.batches, args.batch, tables, 4],
    )?;
    Batch::bytes_for(args.batch, tables)?;
    if args.ratios.is_empty() {
        return Err("--ratios names no cache size".into());
    }
    if let Some(r) = args.ratios.iter().find(|&&r| !(r > 0.0 && r <= 1.0)) {
        return Err(format!("--ratios takes fractions in (0, 1], got {r}").into());
    }
    if !(0.0..=1.0).contains(&args.warmup) {
        return Err(format!("--warmup takes a fraction in [0, 1], got {}", args.warmup).into());
    }
    if !(args.drift_shift.is_finite() && (0.0..=1.0).contains(&args.drift_shift)) {
        return Err(format!(
            "--drift-shift takes a fraction in [0, 1] of the ids a day moves, got {}",
            args.drift_shift
        )
        .into());
    }
    if args.count_batches == Some(0) {
        return Err("--count-batches 0 counts no ids to order by".into());
    }
    if args.dim == 0 {
        return Err("--dim 0: a row needs at least one float".into());
    }
    for name in &args.policies {
        policy(name)?;
    }
    let row_bytes = args
        .dim
        .checked_add(args.state)
        .and_then(|f| f.checked_mul(4))
        .ok_or_else(|| format!("--dim {} --state {} overflows a row", args.dim, args.state))?;
    Ok(row_bytes)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("embedding_cache: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let dataset: Dataset = args.dataset.parse()?;
    let row_bytes = check(&args, dataset.cardinalities().len())?;
    let mut config = SyntheticConfig::new(dataset)
        .with_zipf(args.zipf)
        .with_scale(args.scale)
        .with_seed(args.seed);
    let drift = args.drift_days.map(|d| Drift {
        batches_per_day: d,
        shift: args.drift_shift,
    });
    if let Some(d) = drift {
        config = config.with_drift(d);
    }
    let gen = Synthetic::new(config)?;
    let rows = *gen.table_offsets().last().expect("offsets") as usize;

    let t = Instant::now();
    let trace: Vec<Vec<u32>> = (0..args.batches as u64)
        .map(|i| gen.concat_ids(&gen.try_batch(i, args.batch)?))
        .collect::<tidemem::Result<_>>()?;
    let generate_seconds = t.elapsed().as_secs_f64();
    let count_batches = args.count_batches.unwrap_or(trace.len()).min(trace.len());
    let counts = bincount(rows, trace[..count_batches].iter().map(|b| b.as_slice()))?;

    let mut results = Vec::new();
    let mut unique_per_batch = 0.0;
    for &ratio in &args.ratios {
        let capacity = ((ratio * rows as f64).ceil() as usize).max(1);
        let rc = ReplayConfig {
            rows,
            capacity,
            row_bytes,
            warmup: args.warmup,
            train: true,
        };
        let mut at_ratio = Vec::new();
        for name in &args.policies {
            match replay(&trace, &counts, policy(name)?, &rc) {
                Ok(s) => {
                    unique_per_batch = s.unique_per_batch;
                    at_ratio.push((name.clone(), Some(s), None));
                }
                Err(e) => at_ratio.push((name.clone(), None, Some(e.to_string()))),
            }
        }
        let optimal = at_ratio
            .iter()
            .find(|(n, s, _)| n == "optimal" && s.is_some())
            .and_then(|(_, s, _)| s.map(|s| s.hit_rate));
        for (name, s, err) in at_ratio {
            results.push(match s {
                Some(s) => json!({
                    "ratio": ratio,
                    "capacity": capacity,
                    "policy": name,
                    "hit_rate": s.hit_rate,
                    "of_optimal": optimal.map(|o| s.hit_rate / o),
                    "h2d_rows_per_batch": s.h2d_rows_per_batch,
                    "h2d_bytes_per_batch": s.h2d_bytes_per_batch,
                    "d2h_bytes_per_batch": s.d2h_bytes_per_batch,
                    "ids_per_second": s.ids_per_second,
                }),
                None => json!({
                    "ratio": ratio, "capacity": capacity, "policy": name, "error": err,
                }),
            });
        }
    }

    if args.json {
        let out = json!({
            "dataset": dataset.name(),
            "zipf": args.zipf,
            "scale": args.scale,
            "seed": args.seed,
            "batch": args.batch,
            "batches": args.batches,
            "tables": gen.num_tables(),
            "rows": rows,
            "dim": args.dim,
            "row_bytes": row_bytes,
            "warmup": args.warmup,
            "count_batches": count_batches,
            "drift": drift.map(|d| json!({"batches_per_day": d.batches_per_day, "shift": d.shift})),
            "generate_seconds": generate_seconds,
            "unique_per_batch": unique_per_batch,
            "results": results,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return every_run_failed(&results);
    }
    println!(
        "{} (zipf {}, scale {}): {} tables, {} rows, batch {} × {} batches, {:.0} distinct rows \
         per batch, trace generated in {:.1} s",
        dataset.name(),
        args.zipf,
        args.scale,
        gen.num_tables(),
        rows,
        args.batch,
        args.batches,
        unique_per_batch,
        generate_seconds
    );
    println!(
        "{:>7} {:>10} {:>10} {:>9} {:>8} {:>12} {:>12} {:>12}",
        "ratio", "slots", "policy", "hit rate", "of opt", "h2d/batch", "d2h/batch", "Mids/s"
    );
    for r in &results {
        if let Some(e) = r.get("error") {
            println!(
                "{:>7} {:>10} {:>10} error: {e}",
                r["ratio"], r["capacity"], r["policy"]
            );
            continue;
        }
        println!(
            "{:>7} {:>10} {:>10} {:>9.4} {:>8} {:>12} {:>12} {:>12.1}",
            r["ratio"].as_f64().unwrap_or(0.0),
            r["capacity"].as_u64().unwrap_or(0),
            r["policy"].as_str().unwrap_or(""),
            r["hit_rate"].as_f64().unwrap_or(0.0),
            r["of_optimal"]
                .as_f64()
                .map_or("-".to_string(), |x| format!("{x:.4}")),
            fmt_bytes(r["h2d_bytes_per_batch"].as_f64().unwrap_or(0.0) as u64),
            fmt_bytes(r["d2h_bytes_per_batch"].as_f64().unwrap_or(0.0) as u64),
            r["ids_per_second"].as_f64().unwrap_or(0.0) / 1e6,
        );
    }
    every_run_failed(&results)
}

/// An error naming every reason when no (ratio, policy) run succeeded.
fn every_run_failed(results: &[serde_json::Value]) -> Result<(), Box<dyn std::error::Error>> {
    let errors: Vec<String> = results
        .iter()
        .filter_map(|r| {
            r.get("error").map(|e| {
                let (policy, e) = (r["policy"].as_str(), e.as_str());
                format!(
                    "{} at ratio {}: {}",
                    policy.unwrap_or("?"),
                    r["ratio"],
                    e.unwrap_or("?")
                )
            })
        })
        .collect();
    if !results.is_empty() && errors.len() == results.len() {
        return Err(format!("every run failed: {}", errors.join("; ")).into());
    }
    Ok(())
}
