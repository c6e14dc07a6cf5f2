//! A model of your own, trained through the memory layer on a device smaller than its model
//! data: a 784 → 1024 → 1024 → 10 GELU classifier in fp16 with HybridAdam, on synthetic
//! clusters. The template to start from: the model is a `Sequential` of `nn` layers, the loss
//! a `CrossEntropyLoss` that takes the optimizer's loss scale, the device sized by
//! `ChunkManager::probe`.
//!
//! ```sh
//! cargo run --release --example own_model
//! cargo run --release --example own_model -- --steps 300 --share 0.2 --json
//! ```
//!
//! Prints what the model needs of a device, a progress bar with the loss and the bytes moved a
//! step, and with `--json` one line of figures.

use std::process::ExitCode;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use tidemem::chunk::{search_layer_chunk_size, SizeSearch};
use tidemem::nn::{CrossEntropyLoss, Gelu, Linear, Loss, Sequential};
use tidemem::optim::ScalerConfig;
use tidemem::prelude::*;
use tidemem::rng::{Rng, SplitMix64};
use tidemem::units::fmt_bytes;

const INPUTS: usize = 784;
const CLASSES: usize = 10;

// ---- the model ----------------------------------------------------------------------------

/// Registers the classifier's parameters in `m` and returns it.
fn register(m: &mut ChunkManager, hidden: usize) -> Result<Sequential> {
    Ok(Sequential::new()
        .push(Linear::register(m, "fc1", INPUTS, hidden, true, None)?)
        .push(Gelu)
        .push(Linear::register(m, "fc2", hidden, hidden, true, None)?)
        .push(Gelu)
        .push(Linear::register(m, "fc3", hidden, CLASSES, true, None)?))
}

/// One training step on samples `x` (`[N, 784]`) with labels `y`: forward, loss, backward and
/// the optimizer's step. The loss comes back without the host waiting for it.
fn step(
    m: &mut ChunkManager,
    model: &Sequential,
    adam: &mut HybridAdam,
    (x, y): (&[f32], &[i32]),
) -> Result<Loss> {
    let fwd = m.forward()?;
    let xa = Act::upload(
        fwd.pool(),
        fwd.stream(),
        y.len(),
        INPUTS,
        fwd.param_dtype(),
        x,
    )?;
    let (logits, saved) = model.forward(&fwd, &xa)?;
    let (loss, dlogits) = CrossEntropyLoss::new(CLASSES)?.forward(&fwd, adam, logits, y)?;
    fwd.finish()?;
    let bwd = m.backward()?;
    model.backward(&bwd, saved, &dlogits, false)?;
    bwd.finish()?;
    m.step(adam)?;
    Ok(loss)
}

/// fp16 parameters with f32 masters, in chunks that keep each layer's weight and bias together.
fn config(hidden: usize) -> Result<ManagerConfig> {
    let dims = [(INPUTS, hidden), (hidden, hidden), (hidden, CLASSES)];
    let layers: Vec<Vec<usize>> = dims.iter().map(|&(i, o)| vec![i * o, o]).collect();
    let largest = hidden * hidden.max(INPUTS);
    let s = SizeSearch {
        start: largest,
        range: largest / 4,
        interval: hidden,
        multiple_of: 1,
    };
    let mut cfg = ManagerConfig::new(
        search_layer_chunk_size(&layers, s)?.chunk_elems,
        Policy::Tide,
    );
    cfg.param_dtype = DType::F16;
    Ok(cfg)
}

fn optimizer(lr: f32) -> Result<HybridAdam> {
    let mut cfg = HybridConfig::new(AdamConfig::adam(lr));
    cfg.loss_scale = Some(ScalerConfig::default()); // fp16: dynamic loss scaling
    HybridAdam::new(cfg)
}

// ---- the data and the run -----------------------------------------------------------------

/// Batch `k`: `n` samples of 10 clusters (a ±1 centre per class, plus noise), and their labels.
fn batch(k: usize, n: usize) -> (Vec<f32>, Vec<i32>) {
    let centre = |c: usize, i: usize| {
        if (c * 7919 + i * 104_729).is_multiple_of(3) {
            1.0
        } else {
            -1.0
        }
    };
    let mut r = SplitMix64::new(k as u64 + 1);
    let y: Vec<i32> = (0..n)
        .map(|_| (r.next_u32() % CLASSES as u32) as i32)
        .collect();
    let x = y
        .iter()
        .flat_map(|&c| (0..INPUTS).map(move |i| centre(c as usize, i)))
        .map(|v: f32| v + r.uniform_f32(-1.5, 1.5))
        .collect();
    (x, y)
}

#[derive(Parser, Debug)]
#[command(about = "Train a classifier of your own on a device smaller than its model data")]
struct Args {
    /// Training steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Samples a step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Width of the two hidden layers.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// The share of the parameter chunks the device holds besides the activations (the
    /// device is never smaller than the smallest that trains).
    #[arg(long, default_value_t = 0.25)]
    share: f64,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f32,
    /// Print one line of JSON with the figures at the end.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("own_model: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(a: &Args) -> Result<()> {
    if a.steps == 0 || a.batch == 0 || a.hidden == 0 {
        return Err(Error::TooFew {
            what: "steps, batch and hidden width".into(),
            got: 0,
            need: 1,
        });
    }
    // a batch's inputs and the activations of its widest layer (f32), before any work
    tidemem::limits::host_bytes(
        || {
            format!(
                "--batch {} --hidden {}: a batch's activations",
                a.batch, a.hidden
            )
        },
        &[a.batch, INPUTS.max(a.hidden), 4 * 4],
    )?;
    // what the model needs of a device: one step on a roomy one
    let roomy = Device::sim(SimConfig::with_capacity(1 << 40))?;
    let (x0, y0) = batch(0, a.batch);
    let sizing = ChunkManager::probe(
        roomy,
        config(a.hidden)?,
        |m| register(m, a.hidden),
        |m, model| step(m, model, &mut optimizer(a.lr)?, (&x0, &y0)).map(drop),
    )?;
    let smallest = sizing.smallest_device(Policy::Tide, |c| sizing.config_for(c))?;
    let capacity = sizing.device_for(Policy::Tide, a.share)?;
    if !a.json {
        println!(
            "model data {}, non-model peak {}, largest moment {}: smallest device {}, using {}",
            fmt_bytes(sizing.model_data_bytes()),
            fmt_bytes(sizing.non_model_peak()),
            fmt_bytes(sizing.largest_moment()),
            fmt_bytes(smallest),
            fmt_bytes(capacity)
        );
    }

    let dev = Device::sim(SimConfig::with_capacity(capacity as usize))?;
    let mut cfg = config(a.hidden)?;
    cfg.scheduler = sizing.config_for(capacity);
    let mut m = ChunkManager::new(dev, cfg)?;
    let model = register(&mut m, a.hidden)?;
    let mut adam = optimizer(a.lr)?;
    let bar = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(a.steps as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("[{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let (mut losses, mut moved) = (Vec::new(), Vec::new());
    for k in 0..a.steps {
        let (x, y) = batch(k, a.batch);
        let loss = step(&mut m, &model, &mut adam, (&x, &y))?.read()?;
        let it = m.last_iteration();
        losses.push(loss);
        moved.push((it.h2d_bytes, it.d2h_bytes));
        bar.set_message(format!(
            "loss {loss:.4}  up {}  down {} a step",
            fmt_bytes(it.h2d_bytes),
            fmt_bytes(it.d2h_bytes)
        ));
        bar.inc(1);
    }
    bar.finish();
    let (up, down) = moved.last().copied().unwrap_or_default();
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    // chunks the device gave up: written back (not early, for the host's Adam) or dropped
    let s = m.stats();
    let evictions = s.write_backs - s.early_write_backs + s.clean_drops;
    if a.json {
        let j = serde_json::json!({
            "steps": a.steps,
            "model_data_bytes": sizing.model_data_bytes(),
            // what the model needs resident: the activations' peak and every chunk
            "resident_bytes": sizing.non_model_peak() + sizing.device_chunk_bytes(),
            "smallest_device_bytes": smallest,
            "device_bytes": capacity,
            "evictions": evictions,
            "losses": losses,
            "first_loss": first,
            "last_loss": last,
            "h2d_bytes_per_step": up,
            "d2h_bytes_per_step": down,
        });
        println!("{j}");
    } else {
        println!(
            "loss {first:.4} → {last:.4}; {} up and {} down a step",
            fmt_bytes(up),
            fmt_bytes(down)
        );
    }
    Ok(())
}
