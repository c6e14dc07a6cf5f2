//! Data-parallel training with ZeRO over chunks: one trainer, launched as N in-process ranks
//! (simulated devices, the default) or as one NCCL rank per process when a launcher sets
//! `WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` (or under Slurm's
//! `srun`, its own variables: see `tidemem::comm::LaunchEnv`) (CUDA device
//! `LOCAL_RANK`).
//!
//! ```sh
//! cargo run --release --example zero_train
//! cargo run --release --example zero_train -- --ranks 4 --layers 16 --width 64 --steps 6 --json
//! cargo run --release --example zero_train -- --prefetch 0   # gather on demand only
//! cargo run --release --example zero_train -- --steps 3 --save target/ckpt
//! cargo run --release --example zero_train -- --steps 3 --resume target/ckpt
//! # two processes on one node, one GPU each:
//! WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 cargo run --release --example zero_train &
//! WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 cargo run --release --example zero_train
//! ```
//!
//! Rank r trains on share r of every global batch of the toy MLP. Prints per step the global
//! loss, gradient norm and loss scale; at the end each rank's model-data bytes against the
//! unsharded total, and the collective bytes per step against the formula (parameters
//! all-gathered in forward and in backward, gradients reduce-scattered once). With `--json`,
//! one object per rank with the keys `rank`, `world`, `backend`, `losses`, `steps_done`,
//! `host_bytes`,
//! `model_bytes`, `all_gather_bytes_per_step`, `reduce_scatter_bytes_per_step`,
//! `formula_bytes_per_step`, `bus_bytes_per_step`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde_json::json;
use tidemem::chunk::ManagerConfig;
use tidemem::comm::{launch, CommStats, ReduceOp, MAX_LOCAL_RANKS};
use tidemem::demo::ToyMlp;
use tidemem::device::{Device, SimConfig};
use tidemem::optim::{AdamConfig, HybridAdam, HybridConfig, ScalerConfig};
use tidemem::tide::Policy;
use tidemem::units::{fmt_bytes, parse_bytes};
use tidemem::zero::ZeroManager;

#[derive(Parser, Debug)]
#[command(about = "Train the toy MLP with ZeRO over chunks on N data-parallel ranks")]
struct Args {
    /// In-process ranks, 1 to 1024 (ignored under a launcher).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Blocks of the MLP (one chunk each).
    #[arg(long, default_value_t = 16)]
    layers: usize,
    /// Width of every block.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Samples per global batch (a positive multiple of the world size).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Training steps (at least 1).
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Memory of each simulated device.
    #[arg(long, default_value = "64MiB")]
    device_mem: String,
    /// Communication groups gathered ahead of their use in forward and backward (0: on demand
    /// only).
    #[arg(long, default_value_t = 1)]
    prefetch: usize,
    /// Save every rank's shard to DIR/rank<r>.safetensors after the last step. A save killed
    /// midway leaves the earlier one loadable (as DIR/rank<r>.safetensors.prev until every
    /// rank holds the new one).
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    /// Load every rank's shard from DIR (written by --save on as many ranks, all of one save)
    /// before training; the batches go on from the step the checkpoint holds.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("zero_train: {e}");
        std::process::exit(1);
    }
}

/// Refuses flags that make no sense before any work starts.
fn check(args: &Args, toy: &ToyMlp, mem: usize, launched: bool) -> tidemem::Result<()> {
    let too_few = |what: String, got: usize| Err(tidemem::Error::TooFew { what, got, need: 1 });
    toy.validate()?;
    if args.steps == 0 {
        return too_few("training steps (--steps 0 trains nothing)".into(), 0);
    }
    if mem == 0 {
        let what = format!("bytes of device memory (--device-mem {})", args.device_mem);
        return too_few(what, mem);
    }
    if !launched {
        if args.ranks == 0 {
            return too_few("ranks (--ranks 0: a job needs at least one)".into(), 0);
        }
        if args.ranks > MAX_LOCAL_RANKS {
            return Err(tidemem::Error::TooLarge {
                what: "in-process ranks (--ranks)".into(),
                requested: args.ranks as u128,
                limit: MAX_LOCAL_RANKS as u64,
            });
        }
        // every in-process rank gathers communication groups of N chunk slots (the one in use
        // and those prefetched), so the ranks' gather buffers grow as N² in this one process
        let n = args.ranks;
        tidemem::limits::host_bytes(
            || {
                format!(
                    "--ranks {n} --width {} --prefetch {}: the gather buffers of {n} in-process \
                     ranks ({n} × {} groups of {n} chunks of {} fp32 elements)",
                    args.width,
                    args.prefetch,
                    args.prefetch + 2,
                    toy.chunk_elems()
                )
            },
            &[n, n, args.prefetch.saturating_add(2), toy.chunk_elems(), 4],
        )?;
        if !args.batch.is_multiple_of(args.ranks) {
            return Err(tidemem::Error::NotMultiple {
                what: "--batch",
                value: args.batch,
                of: "--ranks",
                divisor: args.ranks,
            });
        }
    }
    Ok(())
}

fn run() -> tidemem::Result<()> {
    let args = Args::parse();
    let mem = parse_bytes(&args.device_mem)?;
    let toy = ToyMlp {
        layers: args.layers,
        width: args.width,
        batch: args.batch,
        tied: false,
        lr: 1e-2,
    };
    let launched = tidemem::comm::LaunchEnv::from_env()?.is_some();
    check(&args, &toy, mem, launched)?;
    let device_for = |r: usize| {
        if launched {
            Device::cuda(r)
        } else {
            Device::sim(SimConfig::with_capacity(mem))
        }
    };
    let quiet = args.json;
    let steps = args.steps;
    let prefetch = args.prefetch;
    let (save, resume) = (args.save.clone(), args.resume.clone());
    if let Some(dir) = &save {
        std::fs::create_dir_all(dir).map_err(|e| tidemem::Error::Io {
            during: "creating the checkpoint directory",
            source: e,
        })?;
    }
    let results = launch(args.ranks, device_for, Duration::from_secs(120), |c| {
        let (rank, world) = (c.rank(), c.world());
        let mut z = ZeroManager::new(c, ManagerConfig::new(toy.chunk_elems(), Policy::Tide))?;
        z.set_prefetch(prefetch)?;
        let ids = toy.register(&mut z)?;
        let mut adam = HybridAdam::new(HybridConfig {
            loss_scale: Some(ScalerConfig::default()),
            max_grad_norm: Some(1.0),
            ..HybridConfig::new(AdamConfig::adamw(toy.lr, 0.01))
        })?;
        let shard = |dir: &PathBuf| dir.join(format!("rank{rank}.safetensors"));
        if let Some(dir) = &resume {
            z.load_checkpoint(&mut adam, shard(dir))?;
            if rank == 0 && !quiet {
                println!("resumed from {} at step {}", dir.display(), adam.steps());
            }
        }
        let first = adam.steps();
        let last_step = first
            .checked_add(steps)
            .ok_or_else(|| tidemem::Error::Overflow {
                what: format!("the step counter, at --steps {steps} from step {first}"),
            })?;
        let mut losses = Vec::new();
        let mut before = CommStats::default();
        for s in first..last_step {
            before = z.comm().stats();
            let loss = toy.forward_backward(&mut z, &ids, s, adam.loss_scale(), (rank, world))?;
            let rep = z.step(&mut adam)?;
            let mut total = [loss as f64];
            z.comm().all_reduce_host(&mut total, ReduceOp::Sum)?;
            losses.push(total[0]);
            if rank == 0 && !quiet {
                println!(
                    "step {s}: loss {:.5}  grad norm {:.4}  loss scale {}  {:?}",
                    total[0], rep.grad_norm, rep.loss_scale, rep.outcome
                );
            }
        }
        if let Some(dir) = &save {
            z.save_checkpoint(&adam, shard(dir))?;
            if rank == 0 && !quiet {
                println!("saved to {} at step {}", dir.display(), adam.steps());
            }
        }
        let last = z.comm().stats().since(&before);
        let (per, model) = z.shard_balance();
        let u = z.usage();
        let host: u64 = u.host.iter().chain(&u.file).sum();
        // the formula: every communication group's N chunk slots gathered twice, scattered once
        let es = z.param_dtype().size() as u64;
        let groups = z.layout().groups();
        let slots: u64 = (0..groups.div_ceil(world))
            .map(|j| {
                let end = ((j + 1) * world).min(groups);
                *z.layout().group_elems[j * world..end]
                    .iter()
                    .max()
                    .unwrap_or(&0) as u64
            })
            .sum();
        let formula = 3 * slots * world as u64 * es;
        Ok(json!({
            "rank": rank,
            "world": world,
            "backend": z.comm().backend_name(),
            "losses": losses,
            "steps_done": adam.steps(),
            "host_bytes": host,
            "shard_bytes": per[rank],
            "model_bytes": model,
            "all_gather_bytes_per_step": last.all_gather.bytes,
            "reduce_scatter_bytes_per_step": last.reduce_scatter.bytes,
            "formula_bytes_per_step": formula,
            "bus_bytes_per_step": last.bus_bytes(world),
        }))
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results).expect("json"));
        return Ok(());
    }
    for r in &results {
        println!(
            "rank {} of {} ({}): model data {} of {} unsharded; collectives per step {} (formula {}), bus {}",
            r["rank"],
            r["world"],
            r["backend"].as_str().unwrap_or("?"),
            fmt_bytes(r["host_bytes"].as_u64().unwrap_or(0)),
            fmt_bytes(r["model_bytes"].as_u64().unwrap_or(0)),
            fmt_bytes(
                r["all_gather_bytes_per_step"].as_u64().unwrap_or(0)
                    + r["reduce_scatter_bytes_per_step"].as_u64().unwrap_or(0)
            ),
            fmt_bytes(r["formula_bytes_per_step"].as_u64().unwrap_or(0)),
            fmt_bytes(r["bus_bytes_per_step"].as_f64().unwrap_or(0.0) as u64),
        );
    }
    Ok(())
}
