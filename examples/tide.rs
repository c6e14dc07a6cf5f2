//! The main example: trains a small MLP through the chunk manager on the simulated device, with a
//! device smaller than the model's data, under every placement policy.
//!
//! ```sh
//! cargo run --release --example tide
//! cargo run --release --example tide -- --layers 24 --width 96 --steps 8 --policies tide,patrickstar
//! ```
//!
//! Prints a progress bar and, per iteration and policy, the moves and bytes; checks that every
//! policy ends with bitwise identical parameters; writes `tide.svg` (device memory over the moments
//! of the last iteration: non-model data, chunks, budget) and `tide-<policy>.json` (a Chrome trace
//! of moments, fetches, loads, write-backs and evictions; open it in Perfetto) to `--out`.

use std::path::PathBuf;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use tidemem::chunk::{ChunkManager, ManagerConfig, Usage};
use tidemem::demo::ToyMlp;
use tidemem::device::{Device, LinkModel, SimConfig};
use tidemem::profile::write_tide_svg;
use tidemem::tensor::TensorId;
use tidemem::tide::{MoveStats, Policy};
use tidemem::units::{fmt_bytes, parse_bytes};

#[derive(Parser, Debug)]
#[command(
    about = "Train a small MLP through the chunk manager on a device smaller than its model data"
)]
struct Args {
    /// Blocks of the MLP.
    #[arg(long, default_value_t = 16)]
    layers: usize,
    /// Width of every block.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Training iterations per policy, at least 1 (the first is warm-up).
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Policies, comma-separated (tide, patrickstar, lru, static:F).
    #[arg(long, default_value = "tide,patrickstar,lru,static")]
    policies: String,
    /// Device memory (default: peak activations plus a third of the parameter chunks).
    #[arg(long)]
    device_mem: Option<String>,
    /// Give the simulated device a PCIe 4.0-like link.
    #[arg(long)]
    pcie: bool,
    /// Where to write tide.svg and the traces.
    #[arg(long, default_value = "target/tide")]
    out: PathBuf,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("tide: {e}");
        std::process::exit(1);
    }
}

struct Run {
    policy: Policy,
    iters: Vec<MoveStats>,
    loss: f32,
    params: Vec<u32>,
    usage: Usage,
    peak_device: u64,
    /// The device's counts of the last step.
    counts: tidemem::device::DeviceStats,
}

fn run() -> tidemem::Result<()> {
    let a = Args::parse();
    let toy = ToyMlp {
        layers: a.layers,
        width: a.width,
        batch: a.batch,
        tied: true,
        lr: 3e-3,
    };
    // flags that make no sense are refused before any work
    toy.validate()?;
    if a.steps == 0 {
        return Err(tidemem::Error::TooFew {
            what: "training steps (--steps 0 trains nothing)".into(),
            got: 0,
            need: 1,
        });
    }
    let policies: Vec<Policy> = a
        .policies
        .split(',')
        .map(Policy::parse)
        .collect::<tidemem::Result<_>>()?;
    let param_bytes = (toy.layers * toy.chunk_elems() * 2) as u64;
    let model_bytes = param_bytes * 7; // fp16 params + fp32 masters, momentum, variance
    let peak_act = toy.non_model_peak(tidemem::DType::F16) as u64;
    let capacity = match &a.device_mem {
        Some(s) => match parse_bytes(s)? {
            0 => {
                return Err(tidemem::Error::TooFew {
                    what: format!("bytes of device memory (--device-mem {s})"),
                    got: 0,
                    need: 1,
                })
            }
            b => b as u64,
        },
        None => ((peak_act + param_bytes / 3) as f64 / 0.9) as u64,
    };
    std::fs::create_dir_all(&a.out).map_err(|e| tidemem::Error::Io {
        during: "creating the output directory",
        source: e,
    })?;
    println!(
        "toy MLP: {} blocks of width {} (tied first/last weight), model data {} (parameters {}), \
         peak activations {}, device {}",
        toy.layers,
        toy.width,
        fmt_bytes(model_bytes),
        fmt_bytes(param_bytes),
        fmt_bytes(peak_act),
        fmt_bytes(capacity)
    );
    let mut runs = Vec::new();
    let mut svg_done = false;
    for &policy in &policies {
        let mut sim = SimConfig::with_capacity(capacity as usize);
        if a.pcie {
            sim = sim.link(LinkModel::pcie4());
        }
        let dev = Device::sim(sim)?;
        let mut cfg = ManagerConfig::new(toy.chunk_elems(), policy);
        cfg.scheduler.warmup_chunk_fraction = 0.3;
        // activations come from the manager's own non-model pool, which the tide watches
        let mut m = ChunkManager::new(dev, cfg)?;
        m.enable_log();
        let ids = toy.register(&mut m)?;
        let bar = ProgressBar::new(a.steps);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(policy.name());
        let mut iters = Vec::new();
        let mut loss = 0.0;
        // what the device was asked to do in the last step
        let mut counts = tidemem::device::DeviceStats::default();
        for s in 0..a.steps {
            let before = m.device().stats();
            loss = toy.step(&mut m, &ids, s)?;
            counts = m.device().stats().since(&before);
            let it = m.last_iteration();
            iters.push(it);
            bar.set_message(format!(
                "loss {loss:.5}  h2d {}  d2h {}  clean drops {}",
                fmt_bytes(it.h2d_bytes),
                fmt_bytes(it.d2h_bytes),
                it.clean_drops
            ));
            bar.inc(1);
        }
        bar.finish();
        println!("{}:", policy.name());
        for (i, it) in iters.iter().enumerate() {
            println!(
                "  iter {i}{}: loads {:>4} ({:>10}) write-backs {:>4} ({:>10}) clean drops {:>4} prefetches {:>4}",
                if i == 0 { " (warm-up)" } else { "          " },
                it.loads,
                fmt_bytes(it.h2d_bytes),
                it.write_backs,
                fmt_bytes(it.d2h_bytes),
                it.clean_drops,
                it.prefetches
            );
        }
        m.synchronize()?;
        m.chrome_trace()
            .write(a.out.join(format!("tide-{}.json", policy.name())))?;
        if !svg_done && policy == Policy::Tide {
            let points = m.tide_points();
            write_tide_svg(
                a.out.join("tide.svg"),
                &format!(
                    "tide: {} blocks × {} on a {} device",
                    toy.layers,
                    toy.width,
                    fmt_bytes(capacity)
                ),
                &points,
                capacity,
            )?;
            svg_done = true;
        }
        let mut params = Vec::new();
        for t in 0..m.num_tensors() as u32 {
            params.extend(m.master(TensorId(t))?.iter().map(|x| x.to_bits()));
        }
        runs.push(Run {
            policy,
            iters,
            loss,
            params,
            usage: m.usage(),
            peak_device: m.scheduler().map_or(0, |s| s.device_peak()),
            counts,
        });
    }
    println!("\nsteady iteration (last), per policy:");
    println!(
        "{:<14} {:>11} {:>11} {:>11} {:>12} {:>11} {:>10} {:>9} {:>7} {:>7}",
        "policy",
        "h2d",
        "d2h",
        "total",
        "clean drops",
        "peak chunks",
        "loss",
        "launches",
        "allocs",
        "waits"
    );
    for r in &runs {
        let it = r.iters.last().copied().unwrap_or_default();
        println!(
            "{:<14} {:>11} {:>11} {:>11} {:>12} {:>11} {:>10.5} {:>9} {:>7} {:>7}",
            r.policy.name(),
            fmt_bytes(it.h2d_bytes),
            fmt_bytes(it.d2h_bytes),
            fmt_bytes(it.h2d_bytes + it.d2h_bytes),
            it.clean_drops,
            fmt_bytes(r.peak_device),
            r.loss,
            r.counts.launches + r.counts.library_calls,
            r.counts.device_allocs,
            r.counts.blocking_waits()
        );
    }
    println!("(launches, device allocations and blocking waits of the last step: Device::stats)");
    if let Some(first) = runs.first() {
        let same = runs.iter().all(|r| r.params == first.params);
        println!(
            "final parameters bitwise identical across policies: {}",
            if same { "yes" } else { "NO" }
        );
        println!(
            "chunk bytes on the host at the end ({}): {}",
            first.policy.name(),
            fmt_bytes(Usage::total(&first.usage.host))
        );
        if !same {
            return Err(tidemem::Error::Internal {
                what: "the policies disagree on the parameters".into(),
            });
        }
    }
    if svg_done {
        println!("wrote {}", a.out.join("tide.svg").display());
    }
    println!(
        "wrote Chrome traces tide-<policy>.json to {} (open in ui.perfetto.dev)",
        a.out.display()
    );
    Ok(())
}
