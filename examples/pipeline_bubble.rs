//! The pipeline bubble measured on in-process stages: a GPT-2-shaped model (8 blocks,
//! C 256) in P stages, one thread and simulated device each, trained a few steps under each
//! schedule with M micro-batches (PipeDream-2BW as one stream of those steps with no flush,
//! M ≥ P); each stage's seconds waiting in messages over its step's
//! seconds, summed over the stages, beside the schedule's (P−1)/(M+P−1) and the simulator's
//! figure for the same shape.
//!
//! ```sh
//! cargo run --release --example pipeline_bubble
//! cargo run --release --example pipeline_bubble -- --stages 2 --json
//! ```
//!
//! A path check: the stages are threads sharing the machine's cores (two on the CI machine
//! kind) and every message goes through host memory, so only P no larger than the cores
//! measures the schedule itself; the waits also hold the transfers.

use clap::Parser;
use serde_json::json;
use tidemem::comm::Communicator;
use tidemem::models::gpt::{
    default_init, train_step, train_two_bw_stream, Gpt, GptBatch, GptConfig, Plan,
};
use tidemem::parallel::pipeline::{simulate_schedule, Schedule};
use tidemem::parallel::{GridSpec, ProcessGrid, TensorMode};
use tidemem::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Pipeline bubble per schedule, measured on in-process stages")]
struct Args {
    /// Stages.
    #[arg(long, default_value_t = 2)]
    stages: usize,
    /// Steps to time (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn config() -> GptConfig {
    GptConfig {
        layers: 8,
        channels: 256,
        heads: 4,
        vocab: 512,
        max_seq: 64,
        eps: 1e-5,
    }
}

/// The measured bubble of `schedule` with `m` micro-batches on `p` stages: the stages' waits
/// over their step times, both summed over the stages and the timed steps.
fn measure(a: &Args, schedule: Schedule, m: usize) -> tidemem::Result<f64> {
    let p = a.stages;
    let devices = (0..p)
        .map(|_| Device::sim(SimConfig::with_capacity(1 << 30)))
        .collect::<tidemem::Result<Vec<_>>>()?;
    let comms = Communicator::local(devices)?;
    let spec = GridSpec {
        data: 1,
        pipeline: p,
        sequence: 1,
        tensor: TensorMode::None,
    };
    let cfg = config();
    let per_rank = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                let cfg = &cfg;
                s.spawn(move || -> tidemem::Result<(f64, f64)> {
                    let grid = ProcessGrid::new(c, spec)?;
                    let mut mc = ManagerConfig::new(1 << 20, Policy::Tide);
                    mc.param_dtype = DType::F32;
                    let mut store = ChunkManager::new(c.device().clone(), mc)?;
                    store.set_non_model_allocator(CachingAllocator::new(c.device().clone()));
                    let plan = Plan {
                        schedule,
                        ..Plan::on(&grid)
                    };
                    let gpt: Gpt = Gpt::register_on(&mut store, &plan, cfg, |n, _| {
                        Ok(default_init(cfg, n, 1))
                    })?;
                    // PipeDream-2BW streams its steps on a second registration of the stage
                    let second = match schedule {
                        Schedule::TwoBW { .. } => {
                            Some(Gpt::register_on(&mut store, &plan, cfg, |n, _| {
                                Ok(default_init(cfg, n, 1))
                            })?)
                        }
                        _ => None,
                    };
                    let mut adam = HybridAdam::new(HybridConfig {
                        placement: tidemem::optim::DevicePlacement::HostOnly,
                        ..HybridConfig::new(AdamConfig::adamw(1e-3, 0.0))
                    })?;
                    let (b, t) = (4, cfg.max_seq);
                    let tokens: Vec<i32> = (0..b * t).map(|i| (i * 7 % 500) as i32).collect();
                    let micro: Vec<GptBatch> = (0..m)
                        .map(|_| GptBatch {
                            tokens: &tokens,
                            targets: &tokens,
                            batch: b,
                            seq: t,
                        })
                        .collect();
                    let (mut wait, mut total) = (0.0, 0.0);
                    if let Some(second) = &second {
                        // one stream of every step (the first, a warm-up, not counted)
                        let batches = vec![micro.clone(); a.steps + 1];
                        let out = train_two_bw_stream(
                            [&gpt, second],
                            &mut store,
                            &plan,
                            &mut adam,
                            &batches,
                        )?;
                        for rep in out.iter().skip(1).filter_map(|s| s.stage.as_ref()) {
                            wait += rep.wait_seconds;
                            total += rep.total_seconds;
                        }
                        return Ok((wait, total));
                    }
                    for k in 0..=a.steps {
                        let step = train_step(&gpt, &mut store, &plan, &mut adam, &micro)?;
                        if let (true, Some(rep)) = (k > 0, step.stage) {
                            wait += rep.wait_seconds;
                            total += rep.total_seconds;
                        }
                    }
                    Ok((wait, total))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a stage panicked"))
            .collect::<tidemem::Result<Vec<_>>>()
    })?;
    let (wait, total) = per_rank
        .iter()
        .fold((0.0, 0.0), |(w, t), (a, b)| (w + a, t + b));
    Ok(wait / total.max(f64::MIN_POSITIVE))
}

fn main() -> tidemem::Result<()> {
    let a = Args::parse();
    let p = a.stages;
    let mut rows = Vec::new();
    for schedule in [
        Schedule::OneFOneB,
        Schedule::GPipe,
        Schedule::TwoBW { every: 0 },
    ] {
        for m in [2, 4, 8] {
            let schedule = match schedule {
                Schedule::TwoBW { .. } if m < p => continue,
                Schedule::TwoBW { .. } => Schedule::TwoBW { every: m },
                s => s,
            };
            let measured = measure(&a, schedule, m)?;
            let formula = (p - 1) as f64 / (m + p - 1) as f64;
            // 2BW: the stream of the measured steps, one fill and one drain
            let steps = match schedule {
                Schedule::TwoBW { .. } => a.steps + 1,
                _ => 1,
            };
            let sim = simulate_schedule(schedule, p, m * steps, 1.0, 2.0)?.bubble_fraction;
            rows.push(
                json!({"schedule": schedule.name(), "stages": p, "micro_batches": m,
                             "measured": measured, "formula": formula, "simulated": sim}),
            );
        }
    }
    if a.json {
        println!("{}", json!({ "rows": rows }));
        return Ok(());
    }
    println!("{p} in-process stages, GPT-2 shape (8 blocks, C 256), 4 × 64 tokens a micro-batch");
    println!(
        "{:<8} {:>4} {:>10} {:>10} {:>10}",
        "schedule", "M", "measured", "(P-1)/(M+P-1)", "simulated"
    );
    for r in &rows {
        println!(
            "{:<8} {:>4} {:>10.3} {:>10.3} {:>10.3}",
            r["schedule"].as_str().unwrap_or(""),
            r["micro_batches"],
            r["measured"].as_f64().unwrap_or(0.0),
            r["formula"].as_f64().unwrap_or(0.0),
            r["simulated"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(())
}
