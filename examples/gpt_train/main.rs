//! The main example: trains a GPT-2 through the memory layer, on a device smaller than its
//! model data by default.
//!
//! ```sh
//! cargo run --release --example gpt_train                    # gpt2-tiny on a generated corpus
//! cargo run --release --example gpt_train -- --json --steps 20
//! cargo run --release --example gpt_train -- --data input.txt --model gpt2-tiny --policy lru
//! cargo run --release --example gpt_train -- --load-hf model.safetensors --tokenizer tokenizer.json \
//!     --data input.txt --seq 128 --save-hf tuned.safetensors
//! cargo run --release --example gpt_train -- --ranks 4      # ZeRO over 4 in-process ranks
//! # one NCCL rank per process and GPU:
//! WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
//!     cargo run --release --example gpt_train -- --backend cuda &
//! WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
//!     cargo run --release --example gpt_train -- --backend cuda
//! ```
//!
//! Without `--device-mem`, one probe iteration measures the non-model peak and the device gets
//! that plus a third of the parameter chunks, so chunks stream under the tide scheduler. The
//! progress bar shows the loss, tokens/s, MFU (against the CPU's FMA peak measured at the start,
//! or not shown on CUDA) and the bytes moved per step; `--json` prints one object at the end.

mod checks;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tidemem::chunk::MomentStorage;
use tidemem::comm::{launch, Communicator, ReduceOp};
use tidemem::data::text::{Split, TokenData, Tokenizer};
use tidemem::data::Ahead;
use tidemem::device::{DeviceStats, HostPhase};
use tidemem::models::gpt::{
    default_init, read_hf, train_step, train_two_bw_stream, EndsLayout, Gpt, GptBatch, GptConfig,
    Plan, TrainStep,
};
use tidemem::optim::{DevicePlacement, ScalerConfig, ShadowBudget};
use tidemem::parallel::pipeline::Schedule;
use tidemem::parallel::{GridSpec, Placement, ProcessGrid, TensorMode};
use tidemem::prelude::*;
use tidemem::profile::{fma_isa, fma_peak, write_tide_svg};
use tidemem::simulate::{plan, Rates, SimOptions, SimOverlap, StepPlan, StepSchedule};
use tidemem::tide::Sizing;
use tidemem::units::{fmt_bytes, parse_bytes};

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Train a GPT-2 through the chunk manager on a device smaller than its model data"
)]
struct Args {
    /// Preset: gpt2-tiny, gpt2 (124M), gpt2-medium (350M), gpt2-large (774M), gpt2-xl (1.5B).
    #[arg(long, default_value = "gpt2-tiny")]
    model: String,
    /// Override the preset's blocks.
    #[arg(long)]
    layers: Option<usize>,
    /// Override the preset's channels.
    #[arg(long)]
    channels: Option<usize>,
    /// Override the preset's heads (also the heads of an imported checkpoint).
    #[arg(long)]
    heads: Option<usize>,
    /// Override the preset's vocabulary.
    #[arg(long)]
    vocab: Option<usize>,
    /// Override the preset's positions.
    #[arg(long)]
    max_seq: Option<usize>,
    /// Device memory, e.g. 8MiB (default: the non-model peak plus a third of the parameter chunks).
    #[arg(long)]
    device_mem: Option<String>,
    /// Host memory for chunks; the rest spills to the file tier (default: unlimited).
    #[arg(long)]
    host_mem: Option<String>,
    /// Placement policy: tide, patrickstar, lru, static:F.
    #[arg(long, default_value = "tide")]
    policy: String,
    /// Parameter type: f32, f16 (with dynamic loss scaling) or bf16; masters are fp32.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// Sequences per micro-batch (per rank).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 400)]
    steps: u64,
    /// Micro-batches per step (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    accumulate: u32,
    /// Learning rate (AdamW, β 0.9/0.999).
    #[arg(long, default_value_t = 2e-3)]
    lr: f32,
    /// Decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f32,
    /// Clip gradients to this global norm (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    clip: f32,
    /// Where Adam steps the chunk groups: auto (at most the groups whose fp32 state fits 0.8 of
    /// the room the model and activations leave, PatrickStar's rule, on the device, as many as
    /// the time model at --rates finds the shortest step with; the rest on the host), host, or
    /// device (every group). The same bits either way.
    #[arg(long, default_value = "auto", value_parser = ["auto", "host", "device"])]
    adam: String,
    /// Step the host's chunk groups on the training thread after backward, instead of during
    /// backward or beside the next forward on a thread of their own (the same bits; with a loss
    /// scaler or a clip the overlapped step holds a second copy of the optimizer state of the
    /// groups it steps during backward, within --overlap-budget).
    #[arg(long)]
    no_overlap: bool,
    /// How Adam's moments are held: f32, or 8bit (block-wise, a byte an element and a scale a
    /// 256: model data of 8.04 bytes a parameter with fp16 parameters instead of 14).
    #[arg(long, default_value = "f32", value_parser = ["f32", "8bit"])]
    moments: String,
    /// Host bytes for the overlapped step's copies of the optimizer state (with a loss scaler
    /// or a clip): `auto` (half of what the host holds beside the model data) or a size such
    /// as 8GiB; the host groups beyond it step after backward.
    #[arg(long, default_value = "auto")]
    overlap_budget: String,
    /// Host groups that step after backward, beside the next forward, rather than during it
    /// (the first in order; with --adam auto, the time model's count when absent, else 0).
    #[arg(long)]
    overlap_tail: Option<usize>,
    /// Rates the time model of --adam auto decides with: a profile of
    /// `tidemem::simulate::Rates` (h100-pcie5, h100-server), or `memory` (PatrickStar's rule
    /// alone, no tail). The time model replays the activations of a probe step (one more step
    /// where --device-mem is given).
    #[arg(long, default_value = "h100-pcie5")]
    rates: String,
    /// Activation checkpointing per block: on, off, auto (on from 12 blocks).
    #[arg(long, default_value = "auto")]
    checkpoint: String,
    /// ZeRO data parallelism over this many in-process ranks (each its own device); under a
    /// launcher (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) one NCCL rank per
    /// process on CUDA device LOCAL_RANK instead.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Tensor parallelism over groups of the `--ranks` ranks: none, 1d:N, 2d:Q, 2.5d:QxD or
    /// 3d:Q (ZeRO data parallelism over the remaining factor).
    #[arg(long, default_value = "none")]
    tp: String,
    /// Sequence parallelism: each sequence's positions split over rings of this many of the
    /// `--ranks` ranks (attention by ring self-attention), with ZeRO over the data × sequence
    /// ranks that hold the same parameters.
    #[arg(long, default_value_t = 1)]
    sp: usize,
    /// Pipeline parallelism: the blocks in this many stages (balanced by parameters), each
    /// step's micro-batches scheduled by --schedule.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Micro-batches a step with --pp (each of --batch sequences).
    #[arg(long, default_value_t = 4)]
    micro_batches: usize,
    /// The pipeline schedule: 1f1b (PipeDream-Flush), gpipe, or 2bw (PipeDream-2BW: a new
    /// weight version every step of --micro-batches ≥ --pp, the gradient taken at the one
    /// before). Without --save/--resume, 2bw runs the steps as one stream with no flush on two
    /// registrations of each stage; with them a step at a time, the optimizer keeping the
    /// parameters one version behind (a checkpoint names each tensor once).
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// With --tp 2d/2.5d/3d, or any --tp with --pp: the embeddings, ln_f and the tied head
    /// split over the tensor group like the blocks (split: on a grid the vocabulary must divide
    /// by q; pad it otherwise) or whole on every rank (whole). With --pp the first and the last
    /// stage each hold their copy of wte (its shard, split).
    #[arg(long, default_value = "split")]
    tp_ends: String,
    /// Train on this UTF-8 text file (default: a generated corpus).
    #[arg(long)]
    data: Option<PathBuf>,
    /// A Hugging Face tokenizer.json (default: bytes).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Resume from a checkpoint of this crate (parameters, optimizer state, step, scaler; with
    /// ZeRO ranks a directory of one shard a rank).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Save a checkpoint of this crate at the end (with ZeRO ranks, a directory).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Start from a Hugging Face GPT-2 model.safetensors (its shape replaces --model).
    #[arg(long)]
    load_hf: Option<PathBuf>,
    /// Write the trained weights as a Hugging Face GPT-2 model.safetensors.
    #[arg(long)]
    save_hf: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto) and the tide plot of the last step here.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Print one JSON object at the end instead of the progress bar and summary.
    #[arg(long)]
    json: bool,
    /// Measure where a steady step's time goes (device phases by events on the compute
    /// stream, host spans by wall clock) and print it as a table (`profile` in `--json`;
    /// one process only).
    #[arg(long)]
    profile: bool,
    /// Tokens to sample after training from a held-out prompt (temperature 0.8; 0: none).
    #[arg(long, default_value_t = 120)]
    sample: usize,
    /// Seed of the initial weights and the generated corpus.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Backend: sim (the simulated device), cuda, or timing (the simulated device running
    /// nothing: the host's own time a step; the losses are meaningless).
    #[arg(long, default_value = "sim")]
    backend: String,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("gpt_train: {e}");
        std::process::exit(1);
    }
}

/// A loss that is not finite ends the run with an error naming the step of this run (1 the
/// first), instead of training on NaN to the end.
fn diverged(loss: f32, step: u64) -> Result<()> {
    if loss.is_finite() {
        return Ok(());
    }
    Err(Error::BadValue {
        what: format!("the loss of step {step} of this run"),
        value: loss.into(),
        want: "finite (the run diverged: a lower --lr?)",
    })
}

fn bad(what: String) -> Error {
    Error::InvalidArgument(what)
}

fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        _ => Err(bad(format!("--dtype {s}: f32, f16 or bf16"))),
    }
}

fn parse_policy(s: &str) -> Result<Policy> {
    Ok(match s {
        "tide" => Policy::Tide,
        "patrickstar" => Policy::PatrickStar,
        "lru" => Policy::Lru,
        _ => match s.strip_prefix("static:").map(str::parse::<f64>) {
            Some(Ok(f)) if (0.0..=1.0).contains(&f) => Policy::Static { device_fraction: f },
            _ => {
                return Err(bad(format!(
                    "--policy {s}: tide, patrickstar, lru or static:F"
                )))
            }
        },
    })
}

/// The model's shape: an imported checkpoint's, or the preset's with the overrides.
fn model_config(a: &Args) -> Result<(GptConfig, Option<tidemem::models::gpt::HfWeights>)> {
    if let Some(p) = &a.load_hf {
        let w = read_hf(p, Some(checks::hf_heads(a, p)?), None)?;
        checks::hf_agrees(a, p, w.config())?;
        return Ok((w.config().clone(), Some(w)));
    }
    let mut c = GptConfig::preset(&a.model).ok_or_else(|| {
        bad(format!(
            "--model {}: one of {:?}",
            a.model,
            GptConfig::PRESETS
        ))
    })?;
    c.layers = a.layers.unwrap_or(c.layers);
    c.channels = a.channels.unwrap_or(c.channels);
    c.heads = a.heads.unwrap_or(c.heads);
    c.vocab = a.vocab.unwrap_or(c.vocab);
    c.max_seq = a.max_seq.unwrap_or(c.max_seq);
    c.validate()?;
    Ok((c, None))
}

/// What every rank's run needs.
struct Setup {
    cfg: GptConfig,
    hf: Option<tidemem::models::gpt::HfWeights>,
    /// Shared with the threads that build batches ahead of the step.
    data: std::sync::Arc<TokenData>,
    dtype: DType,
    moments: MomentStorage,
    policy: Policy,
    checkpoint: bool,
    chunk_elems: usize,
    capacity: u64,
    host: Option<u64>,
    /// The probed non-model peak: warm-up keeps chunks within what it leaves.
    warmup: Option<u64>,
    /// Where `--adam auto` steps the groups, by the time model (one rank).
    step_plan: Option<StepPlan>,
    /// The probed non-model bytes of each forward and backward moment.
    tide: Option<Vec<u64>>,
}

/// The device groups and the tail of `--adam auto` by the time model at `--rates`, for one
/// rank (`None`: another placement, the rule alone, or a model the simulator cannot replay).
fn step_plan(a: &Args, p: &Setup, gpt: &Gpt) -> Result<Option<StepPlan>> {
    if a.adam != "auto" || a.rates == "memory" {
        return Ok(None);
    }
    // checked with the flags
    let Some(rates) = Rates::profile(&a.rates) else {
        return Ok(None);
    };
    // the model moment by moment as it fetches, its activations as a probe measures them
    let mut spec = gpt.spec(a.batch, a.seq, p.checkpoint);
    match &p.tide {
        Some(tide) => spec.set_tide(tide)?,
        None => spec.set_tide(&tide(&probe(a, p)?))?,
    }
    let mut opts = SimOptions::new(p.capacity, p.host.unwrap_or(u64::MAX / 4));
    opts.chunk_elems = Some(p.chunk_elems);
    opts.param_bytes = p.dtype.size() as u64;
    opts.scheduler = manager_config(p).scheduler;
    opts.optimizer = DevicePlacement::Auto { fraction: 0.8 };
    opts.moments = p.moments;
    let scaled = p.dtype == DType::F16;
    opts.overlap = match (a.no_overlap, scaled || a.clip > 0.0) {
        (true, _) => SimOverlap::Serial,
        (false, false) => SimOverlap::InPlace,
        (false, true) => SimOverlap::Shadowed(match a.overlap_budget.as_str() {
            "auto" => ShadowBudget::Auto,
            s => ShadowBudget::Bytes(parse_bytes(s)? as u64),
        }),
    };
    opts.overlap_tail = a.overlap_tail.unwrap_or(0);
    let schedule = match a.no_overlap {
        true => StepSchedule::Serial,
        false => StepSchedule::Overlapped,
    };
    // the trainer runs on what the simulator cannot replay: the memory rule decides there
    Ok(plan(&spec, p.policy, &opts, &rates, schedule).ok())
}

/// The storage `--moments` names (checked by clap).
fn moments(a: &Args) -> MomentStorage {
    match a.moments.as_str() {
        "8bit" => MomentStorage::Int8,
        _ => MomentStorage::F32,
    }
}

fn manager_config(p: &Setup) -> ManagerConfig {
    let mut cfg = ManagerConfig::new(p.chunk_elems, p.policy);
    cfg.param_dtype = p.dtype;
    cfg.scheduler.capacity = p.capacity;
    cfg.scheduler.overall_fraction = 1.0;
    cfg.host_budget = p.host;
    cfg.moments = p.moments;
    if let Some(peak) = p.warmup {
        cfg.scheduler.warmup_chunk_fraction =
            p.capacity.saturating_sub(peak) as f64 / p.capacity as f64;
    }
    cfg
}

fn device(a: &Args, capacity: u64) -> Result<Device> {
    match a.backend.as_str() {
        "sim" => Device::sim(SimConfig::with_capacity(capacity as usize)),
        // the host's own time: nothing runs, the losses are meaningless
        "timing" => Device::sim(SimConfig::with_capacity(capacity as usize).timing_only()),
        "cuda" => Device::cuda(0),
        b => Err(bad(format!("--backend {b}: sim, timing or cuda"))),
    }
}

/// Registers this rank's part of the model as `plan` places it: the imported weights, or
/// GPT-2's initialisation from `seed`.
fn register<P: Placement>(
    store: &mut impl ParamStore,
    plan: &Plan<'_>,
    p: &Setup,
    seed: u64,
) -> Result<Gpt<P>> {
    match &p.hf {
        Some(w) => Gpt::register_hf(store, plan, w),
        None => Gpt::register_on(store, plan, &p.cfg, |n, _| {
            Ok(default_init(&p.cfg, n, seed))
        }),
    }
}

/// The optimizer; `delayed` keeps the parameters one version behind the masters (PipeDream-2BW
/// a step at a time).
fn adam(a: &Args, p: &Setup, delayed: bool) -> Result<HybridAdam> {
    let dtype = p.dtype;
    HybridAdam::new(HybridConfig {
        // a small model's f16 gradients overflow at the usual 2^16: start lower
        loss_scale: (dtype == DType::F16).then(|| ScalerConfig {
            init_scale: 1024.0,
            growth_interval: 200,
            ..ScalerConfig::default()
        }),
        max_grad_norm: (a.clip > 0.0).then_some(a.clip),
        accumulation_steps: a.accumulate,
        placement: match a.adam.as_str() {
            "host" => DevicePlacement::HostOnly,
            "device" => DevicePlacement::Groups(usize::MAX),
            _ => match &p.step_plan {
                Some(s) => DevicePlacement::Groups(s.device_groups),
                None => DevicePlacement::Auto { fraction: 0.8 },
            },
        },
        delayed_params: delayed,
        overlap: !a.no_overlap,
        overlap_budget: match a.overlap_budget.as_str() {
            "auto" => ShadowBudget::Auto,
            s => ShadowBudget::Bytes(parse_bytes(s)? as u64),
        },
        overlap_tail: (a.overlap_tail)
            .or(p.step_plan.as_ref().map(|s| s.overlap_tail))
            .unwrap_or(0),
        ..HybridConfig::new(AdamConfig::adamw(a.lr, a.weight_decay))
    })
}

/// The non-model bytes of each forward and backward moment of a probed iteration.
fn tide(sizing: &Sizing) -> Vec<u64> {
    let moments = sizing.trace().moments.iter();
    let passes = moments.filter(|x| x.stage != Stage::Optimizer);
    passes.map(|x| x.non_model).collect()
}

/// What the model needs of a device ([`Sizing`]: the non-model peak, the largest single moment,
/// the smallest device under a policy), from one iteration on a device with room for everything.
fn probe(a: &Args, p: &Setup) -> Result<Sizing> {
    let mut cfg = manager_config(p);
    cfg.scheduler.capacity = 1 << 40;
    cfg.scheduler.warmup_chunk_fraction = 1.0;
    let dev = device(a, 1 << 40)?;
    let mut m = ChunkManager::new(dev.clone(), cfg)?;
    m.set_non_model_allocator(CachingAllocator::new(dev));
    let gpt: Gpt = register(&mut m, &Plan::default(), p, a.seed)?;
    let (t, g) = p.data.batch(Split::Train, 0, a.batch, a.seq)?;
    let b = GptBatch {
        tokens: &t,
        targets: &g,
        batch: a.batch,
        seq: a.seq,
    };
    // one whole step (the trace holds the optimizer's visits too), on one micro-batch
    let one = Args {
        accumulate: 1,
        ..a.clone()
    };
    let run = Plan {
        checkpoint: p.checkpoint,
        ..Plan::default()
    };
    train_step(&gpt, &mut m, &run, &mut adam(&one, p, false)?, &[b])?;
    m.sizing()
}

fn run() -> Result<()> {
    let a = Args::parse();
    let env = tidemem::comm::LaunchEnv::from_env()?;
    let launched = env.is_some();
    let sharded = a.ranks > 1 || launched || a.tp != "none";
    // everything that can be checked before any work is
    checks::flags(&a, launched)?;
    let world = env.map_or(a.ranks, |e| e.world_size);
    checks::paths(&a, sharded, world)?;
    if a.backend == "timing" {
        eprintln!(
            "gpt_train: --backend timing: nothing runs on the device; the losses are \
             meaningless, the times are the host's own"
        );
    }
    let (cfg, hf) = model_config(&a)?;
    checks::sizes(&a, &cfg)?;
    let tok = match &a.tokenizer {
        Some(p) => Tokenizer::from_file(p)?,
        None => Tokenizer::bytes(),
    };
    let data = match &a.data {
        Some(p) => TokenData::from_file(p, &tok, 0.05)?,
        None => TokenData::generated(400_000, a.seed, 0.05)?,
    };
    checks::data(&a, &cfg, &data, &tok)?;
    let checkpoint = match a.checkpoint.as_str() {
        "on" => true,
        "off" => false,
        "auto" => cfg.layers >= 12,
        c => return Err(bad(format!("--checkpoint {c}: on, off or auto"))),
    };
    let largest = cfg
        .param_shapes()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .max();
    let mut plan = Setup {
        dtype: parse_dtype(&a.dtype)?,
        moments: moments(&a),
        policy: parse_policy(&a.policy)?,
        checkpoint,
        chunk_elems: largest.unwrap_or(1).div_ceil(1024) * 1024,
        capacity: 0,
        warmup: None,
        step_plan: None,
        tide: None,
        host: a
            .host_mem
            .as_deref()
            .map(parse_bytes)
            .transpose()?
            .map(|b| b as u64),
        cfg,
        hf,
        data: std::sync::Arc::new(data),
    };
    checks::host(&a, &plan.cfg, plan.dtype, plan.host, 0)?;
    plan.capacity = match &a.device_mem {
        Some(s) => parse_bytes(s)? as u64,
        None => {
            let sizing = probe(&a, &plan)?;
            let peak = sizing.non_model_peak();
            plan.warmup = Some(peak);
            plan.tide = Some(tide(&sizing));
            let chunks = sizing.device_chunk_bytes();
            if world > 1 {
                // a ZeRO rank also holds gather buffers of whole communication groups, and a
                // pipeline stage the activations of the micro-batches in flight (all of a
                // GPipe step's, at most one a stage under 1F1B and 2BW)
                let in_flight = match a.schedule.as_str() {
                    "gpipe" => a.micro_batches.max(1),
                    _ => a.micro_batches.clamp(1, a.pp.max(1)),
                };
                let in_flight = if a.pp > 1 { in_flight as u64 } else { 1 };
                peak * in_flight + 2 * chunks.max(sizing.largest_moment())
            } else {
                // a third of the chunks besides the activations, and never less than the
                // largest single moment (an oversized tensor's chunk with its neighbours)
                sizing.device_for(plan.policy, 1.0 / 3.0)?
            }
        }
    };
    checks::host(&a, &plan.cfg, plan.dtype, plan.host, plan.capacity)?;
    if sharded {
        if a.save_hf.is_some() || a.trace.is_some() {
            return Err(bad(
                "--save-hf and --trace need one rank (each ZeRO rank holds a shard)".into(),
            ));
        }
        return train_zero(&a, &plan);
    }
    let dev = device(&a, plan.capacity)?;
    let mut m = ChunkManager::new(dev.clone(), manager_config(&plan))?;
    m.set_non_model_allocator(CachingAllocator::new(dev.clone()));
    let gpt = register(&mut m, &Plan::default(), &plan, a.seed)?;
    let run = Plan {
        checkpoint: plan.checkpoint,
        ..Plan::default()
    };
    plan.step_plan = step_plan(&a, &plan, &gpt)?;
    let mut opt = adam(&a, &plan, false)?;
    if let Some(p) = &a.resume {
        opt.load_checkpoint(&mut m, p)?;
    }
    if a.trace.is_some() {
        m.enable_log();
    }
    let peak = match (a.backend.as_str(), fma_isa()) {
        ("sim", Some((_, lanes))) => {
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            Some(fma_peak(lanes, threads, 1.0) * 1e9)
        }
        _ => None,
    };
    // parameters and, per element, the fp32 master, momentum and variance
    let model_data: u64 = m
        .layout()
        .group_elems
        .iter()
        .map(|&e| (e * (plan.dtype.size() + 4)) as u64 + 2 * plan.moments.bytes(e))
        .sum();
    let bar = progress(&a);
    let (mut losses, mut tps, mut h2d, mut d2h) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let start = opt.steps();
    // chunk groups Adam stepped on the device and on the host at the last step, and what the
    // device was asked to do in it
    let mut adam_groups = (0, 0);
    let mut device_step = tidemem::device::DeviceStats::default();
    // each step's micro-batches, built on a worker thread ahead of the step: step `s` trains
    // on batches `s·accumulate ..`, `s` the optimizer's steps (a skipped step trains its
    // batches again: `at` builds a repeated index here)
    let mut ahead = {
        let (data, acc, (b, t)) = (plan.data.clone(), u64::from(a.accumulate), (a.batch, a.seq));
        Ahead::indexed(start..u64::MAX, 2, 1, move |s| {
            data.batches(Split::Train, (0..acc).map(|k| s * acc + k), b, t)
        })?
    };
    // the profile covers the steady steps (all of them, in a run of two or fewer)
    let profile_from = if a.steps > 2 { 2 } else { 0 };
    train_loop(
        (&gpt, &run),
        &mut m,
        &mut opt,
        &mut ahead,
        (a.steps, a.batch, a.seq),
        |m, i| {
            if a.profile && i == profile_from {
                dev.start_profile();
            }
            (m.stats(), m.device().stats())
        },
        |m, (before, dev_before), r, secs| {
            device_step = m.device().stats().since(&dev_before);
            adam_groups = (r.report.device_groups, m.groups() - r.report.device_groups);
            let moved = m.stats().since(&before);
            let rate = r.tokens as f64 / secs;
            losses.push(r.loss);
            tps.push(rate);
            h2d.push(moved.h2d_bytes);
            d2h.push(moved.d2h_bytes);
            let mfu = peak.map(|p| rate * plan.cfg.flops_per_token(a.seq) / p);
            bar.set_message(format!(
                "loss {:.4} | {:.0} tok/s | MFU {} | h2d {} d2h {}",
                r.loss,
                rate,
                mfu_text(mfu, 2),
                fmt_bytes(moved.h2d_bytes),
                fmt_bytes(moved.d2h_bytes)
            ));
            bar.inc(1);
            Ok(())
        },
    )?;
    bar.finish_and_clear();
    // the saves first: what follows (validation, sampling, the trace) cannot lose the run
    if let Some(p) = &a.save {
        opt.save_checkpoint(&mut m, p)?;
    }
    if let Some(p) = &a.save_hf {
        gpt.save_hf(&mut m, p)?;
    }
    let profile = match a.profile {
        true => Some(
            dev.stop_profile()?
                .per_step((a.steps - profile_from) as usize),
        ),
        false => None,
    };
    let val_loss = validation(&gpt, &mut m, &plan, &a)?;
    let sample = match a.sample {
        0 => None,
        n => {
            let prompt: Vec<i32> = plan.data.val()[..a.seq.min(32).min(plan.data.val().len())]
                .iter()
                .map(|&t| t as i32)
                .collect();
            let out = gpt.generate(&mut m, &prompt, n, 0.8, a.seed)?;
            let ids = |v: &[i32]| v.iter().map(|&t| t as u32).collect::<Vec<_>>();
            Some((tok.decode(&ids(&prompt))?, tok.decode(&ids(&out))?))
        }
    };
    if let Some(dir) = &a.trace {
        std::fs::create_dir_all(dir).map_err(|e| bad(format!("{}: {e}", dir.display())))?;
        m.synchronize()?;
        m.chrome_trace().write(dir.join("gpt_train.json"))?;
        let title = format!("tide: {} on a {} device", a.model, fmt_bytes(plan.capacity));
        write_tide_svg(
            dir.join("tide.svg"),
            &title,
            &m.tide_points(),
            plan.capacity,
        )?;
    }
    // steady steps: the first two warm up (all of them, in a run of two or fewer)
    let steady = |v: &[f64]| {
        let s = if v.len() > 2 { &v[2..] } else { v };
        if s.is_empty() {
            f64::NAN
        } else {
            s.iter().sum::<f64>() / s.len() as f64
        }
    };
    let as_f = |v: &[u64]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let tokens_per_s = steady(&tps);
    let mfu = peak.map(|p| tokens_per_s * plan.cfg.flops_per_token(a.seq) / p);
    let report = json!({
        "model": a.model,
        "config": plan.cfg,
        "params": plan.cfg.params(),
        "dtype": a.dtype,
        "moments": a.moments,
        "policy": plan.policy.name(),
        "checkpoint": plan.checkpoint,
        "first_step": start,
        "losses": losses,
        "val_loss": val_loss,
        "sample": sample.as_ref().map(|s| format!("{}{}", s.0, s.1)),
        "tokens_per_s": tokens_per_s,
        // a fraction above 1 says the peak read low, not that the model beat the hardware
        "mfu": mfu.filter(|&f| f <= 1.0),
        "mfu_above_measured_peak": mfu.filter(|&f| f > 1.0),
        "fma_peak_flops": peak,
        "model_data_bytes": model_data,
        "param_chunk_bytes": m.param_footprint(),
        "device_capacity_bytes": plan.capacity,
        "h2d_bytes": steady(&as_f(&h2d)),
        "d2h_bytes": steady(&as_f(&d2h)),
        "adam": a.adam,
        "results_meaningless": a.backend == "timing",
        "device_stats": device_json(&device_step),
        "adam_device_groups": adam_groups.0,
        "adam_host_groups": adam_groups.1,
        "adam_plan": plan.step_plan.as_ref().map(|s| json!({
            "rates": a.rates,
            "device_groups": s.device_groups,
            "overlap_tail": s.overlap_tail,
            "memory_groups": s.memory_groups,
            "predicted_step_s": s.step.step,
            "memory_rule_step_s": s.memory_step,
        })),
        "overlap": m.overlap_stats(),
        "profile": profile,
    });
    if a.json {
        println!("{report}");
    } else {
        if let Some(p) = &profile {
            println!("where a steady step's time goes:\n{p}");
        }
        summary(
            &a,
            &plan,
            &losses,
            val_loss,
            tokens_per_s,
            mfu,
            model_data,
            &h2d,
            &d2h,
            m.overlap_stats(),
        );
        if let Some((prompt, text)) = sample {
            println!("sample (prompt in brackets):\n[{prompt}]{text}");
        }
    }
    Ok(())
}

/// A step's micro-batches, as owned (tokens, targets) pairs.
type Batches = Vec<(Vec<i32>, Vec<i32>)>;

/// The one training loop, of one rank and of every rank of many: `steps` optimizer steps of
/// `gpt` on `store`, each step's micro-batches (`[batch, seq]` each) built ahead on a worker
/// thread (`at` the optimizer's steps, so a skipped step trains its batches again). `before`
/// runs first in each step (given its index) and its value goes to `after` with the step's
/// report and seconds; a loss that is not finite stops the run.
fn train_loop<P: Placement, S: ParamStore, M>(
    (gpt, plan): (&Gpt<P>, &Plan<'_>),
    store: &mut S,
    opt: &mut HybridAdam,
    ahead: &mut Ahead<Batches>,
    (steps, batch, seq): (u64, usize, usize),
    mut before: impl FnMut(&mut S, u64) -> M,
    mut after: impl FnMut(&mut S, M, &TrainStep, f64) -> Result<()>,
) -> Result<()> {
    for i in 0..steps {
        let measured = before(store, i);
        let span = store.device().host_span(HostPhase::Data);
        let batches = ahead.at(opt.steps())?;
        drop(span);
        let micro: Vec<GptBatch<'_>> = batches
            .iter()
            .map(|(tokens, targets)| GptBatch {
                tokens,
                targets,
                batch,
                seq,
            })
            .collect();
        let t0 = Instant::now();
        let r = train_step(gpt, store, plan, opt, &micro)?;
        let secs = t0.elapsed().as_secs_f64();
        diverged(r.loss, i + 1)?;
        after(store, measured, &r, secs)?;
    }
    Ok(())
}

/// A step's device counts for `--json`, with the blocking waits summed.
fn device_json(s: &tidemem::device::DeviceStats) -> serde_json::Value {
    let mut v = serde_json::to_value(s).unwrap_or_default();
    v["blocking_waits"] = json!(s.blocking_waits());
    v
}

/// The model FLOPs utilisation as printed: never a fraction above 1 as a fact (the measured
/// peak read low then).
fn mfu_text(mfu: Option<f64>, digits: usize) -> String {
    match mfu {
        None => "-".into(),
        Some(f) if f > 1.0 => format!("n/a ({f:.2} of a peak that read low)"),
        Some(f) => format!("{f:.digits$}"),
    }
}

/// Micro-batches of `--batch` × `--seq` tokens over owned (tokens, targets) pairs.
/// A sequence-parallel rank's block of a batch: positions `r·L .. (r + 1)·L` of each of the
/// `--batch` sequences, `L = --seq / ring size`, `r` the rank in the ring.
fn positions_of(
    (tokens, targets): &(Vec<i32>, Vec<i32>),
    (batch, seq): (usize, usize),
    (rank, world): (usize, usize),
) -> (Vec<i32>, Vec<i32>) {
    let l = seq / world;
    let at = |i: usize| i * seq + rank * l;
    let block = |v: &[i32]| -> Vec<i32> {
        (0..batch)
            .flat_map(|i| v[at(i)..at(i) + l].to_vec())
            .collect()
    };
    (block(tokens), block(targets))
}

fn views<'a>(batches: &'a [(Vec<i32>, Vec<i32>)], a: &Args) -> Vec<GptBatch<'a>> {
    batches
        .iter()
        .map(|(t, g)| GptBatch {
            tokens: t,
            targets: g,
            batch: a.batch,
            seq: a.seq,
        })
        .collect()
}

fn progress(a: &Args) -> ProgressBar {
    let bar = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(a.steps)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps {elapsed} | {msg}")
            .expect("a valid template"),
    );
    bar
}

/// The mean loss over a few held-out batches.
fn validation(gpt: &Gpt, store: &mut impl ParamStore, p: &Setup, a: &Args) -> Result<f32> {
    let mut sum = 0.0;
    for k in 0..4 {
        let (t, g) = p.data.batch(Split::Val, k, a.batch, a.seq)?;
        let b = GptBatch {
            tokens: &t,
            targets: &g,
            batch: a.batch,
            seq: a.seq,
        };
        sum += gpt.loss(store, &Plan::default(), &b)?;
    }
    Ok(sum / 4.0)
}

#[allow(clippy::too_many_arguments)]
fn summary(
    a: &Args,
    p: &Setup,
    losses: &[f32],
    val: f32,
    tps: f64,
    mfu: Option<f64>,
    model_data: u64,
    h2d: &[u64],
    d2h: &[u64],
    overlap: tidemem::chunk::OverlapStats,
) {
    println!(
        "{} ({} parameters, {} blocks × {} channels, {}), {} steps of {} × {} tokens × {} micro-batches",
        a.model,
        p.cfg.params(),
        p.cfg.layers,
        p.cfg.channels,
        a.dtype,
        losses.len(),
        a.batch,
        a.seq,
        a.accumulate
    );
    println!(
        "model data {} on a {} device ({}), activation checkpointing {}",
        fmt_bytes(model_data),
        fmt_bytes(p.capacity),
        p.policy.name(),
        if p.checkpoint { "on" } else { "off" }
    );
    if p.capacity >= model_data {
        println!(
            "(the largest moment and the activations need more than the model data: the \
             device holds all of it, nothing is offloaded)"
        );
    }
    if overlap.started > 0 {
        println!(
            "host groups stepped during backward: {} of {} kept, holding {} of host memory",
            overlap.kept,
            overlap.started,
            fmt_bytes(overlap.host_bytes)
        );
    }
    if overlap.deferred > 0 {
        println!(
            "host groups stepped after backward, beside the next forward: {}",
            overlap.deferred
        );
    }
    if let (Some(f), Some(l)) = (losses.first(), losses.last()) {
        println!("loss {f:.4} → {l:.4}, validation loss {val:.4}");
    }
    println!(
        "{tps:.0} tokens/s, MFU {}, per steady step h2d {} d2h {}",
        mfu_text(mfu, 3),
        fmt_bytes(h2d.last().copied().unwrap_or(0)),
        fmt_bytes(d2h.last().copied().unwrap_or(0))
    );
}

/// ZeRO over `--ranks` in-process ranks (each a simulated device of the same capacity, or
/// CUDA device 0 with `--backend cuda`), or one NCCL rank per process when a launcher sets
/// `WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` (or `srun` its own:
/// [`LaunchEnv`](tidemem::comm::LaunchEnv)) (CUDA device `LOCAL_RANK`); each rank trains on
/// `--batch` rows of its own. Rank 0 reports.
fn train_zero(a: &Args, p: &Setup) -> Result<()> {
    let launched = checks::launched()?;
    let device_for = |r: usize| {
        if launched {
            Device::cuda(r).map_err(|e| {
                bad(format!(
                    "a launched rank runs on CUDA device LOCAL_RANK ({r}), \
                     which is not usable here ({e}); without a launcher, --ranks N runs \
                     in-process ranks on --backend {}",
                    a.backend
                ))
            })
        } else {
            device(a, p.capacity)
        }
    };
    let results = launch(a.ranks, device_for, Duration::from_secs(300), |c| {
        rank(a, p, c)
    })?;
    let Some(Some((losses, tokens_per_s, world, step))) = results.into_iter().next() else {
        return Ok(()); // not rank 0 of a launched job
    };
    if a.json {
        println!(
            "{}",
            json!({ "model": a.model, "ranks": world, "tp": a.tp, "sp": a.sp, "pp": a.pp,
                    "schedule": a.schedule, "micro_batches": a.micro_batches, "losses": losses,
                    "tokens_per_s": tokens_per_s, "device_capacity_bytes": p.capacity,
                    "device_stats": step.as_ref().map(device_json) })
        );
    } else {
        println!(
            "{world} ranks (tensor parallelism {}, sequence rings of {}, {} pipeline stage(s), \
             ZeRO over the rest): loss {:.4} → {:.4}, {tokens_per_s:.0} tokens/s in all",
            a.tp,
            a.sp,
            a.pp,
            losses.first().copied().unwrap_or(f32::NAN),
            losses.last().copied().unwrap_or(f32::NAN)
        );
    }
    Ok(())
}

/// One rank's run: on rank 0, the losses averaged over the ranks, tokens/s over all ranks, and
/// the world size. The ranks form a grid of `--tp` tensor-parallel groups and ZeRO over the
/// remaining factor (data parallel).
/// What rank 0 reports: the losses, tokens/s, the world size, and its device's counts over the
/// last step (none for PipeDream-2BW's stream, which runs every step at once).
type RankReport = (Vec<f32>, f64, usize, Option<DeviceStats>);

fn rank(a: &Args, p: &Setup, c: Communicator) -> Result<Option<RankReport>> {
    let tensor: TensorMode = a.tp.parse()?;
    let (world, t, sp, pp) = (c.world(), tensor.size(), a.sp, a.pp);
    if t == 0 || sp == 0 || pp == 0 || !world.is_multiple_of(t * sp * pp) {
        return Err(bad(format!(
            "--tp {tensor} × --sp {sp} × --pp {pp} does not divide {world} ranks"
        )));
    }
    if sp > 1 && !a.seq.is_multiple_of(sp) {
        return Err(bad(format!(
            "--sp {sp} runs with a --seq ({}) that divides by it",
            a.seq
        )));
    }
    let schedule = match a.schedule.as_str() {
        "1f1b" | "flush" => Schedule::OneFOneB,
        "gpipe" => Schedule::GPipe,
        "2bw" => Schedule::TwoBW {
            every: a.micro_batches,
        },
        other => return Err(bad(format!("--schedule {other}: 1f1b, gpipe or 2bw"))),
    };
    if pp > 1 && (a.accumulate != 1 || a.micro_batches == 0) {
        return Err(bad(format!(
            "--pp {pp} runs without --accumulate (the pipeline's micro-batches are \
             --micro-batches {})",
            a.micro_batches
        )));
    }
    let spec = GridSpec {
        data: world / (t * sp * pp),
        pipeline: pp,
        sequence: sp,
        tensor,
    };
    let grid = ProcessGrid::new(&c, spec)?;
    let (dp, dps) = (grid.data_rank() as u64, spec.data as u64);
    let r = c.rank();
    // a checkpoint of several ranks is a directory of one file a rank
    let file = |dir: &PathBuf| checks::rank_file(dir, r);
    let run = Run {
        a,
        p,
        grid: &grid,
        sp: (sp > 1).then(|| grid.sequence()),
        schedule,
        stream: pp > 1
            && matches!(schedule, Schedule::TwoBW { .. })
            && a.save.is_none()
            && a.resume.is_none(),
        dp,
        dps,
    };
    // the one place the tensor mode becomes the model's placement type
    let (losses, tokens, secs, step) = tidemem::with_placement!(tensor, |P| {
        if spec.data * sp > 1 {
            // ZeRO over the ranks that hold the same parameters: data × sequence
            let replicas = grid.split_replicas(&c)?;
            let mut z = ZeroManager::new(replicas, manager_config(p))?;
            run.go::<P, _>(&mut z, &c, &file)?
        } else {
            let mut m = ChunkManager::new(c.device().clone(), manager_config(p))?;
            m.set_non_model_allocator(CachingAllocator::new(c.device().clone()));
            run.go::<P, _>(&mut m, &c, &file)?
        }
    });
    // every rank of a tensor group has the same loss: the mean over all ranks is the mean
    // over the data-parallel batches
    let n = world as f64;
    let mut mean: Vec<f64> = losses.iter().map(|&l| f64::from(l) / n).collect();
    // (a run of no steps has no loss to average: --steps 0 only loads and saves)
    if !mean.is_empty() {
        c.all_reduce_host(&mut mean, ReduceOp::Sum)?;
    }
    // tokens: each tensor group trains on one batch (its sequence ranks on their positions),
    // and every pipeline stage sees the same tokens
    let mut rate = [tokens as f64 / (t * pp) as f64 / secs];
    c.all_reduce_host(&mut rate, ReduceOp::Sum)?;
    let losses = mean.into_iter().map(|l| l as f32).collect();
    Ok((r == 0).then_some((losses, rate[0], world, step)))
}

/// What a rank's training loop needs besides its store.
struct Run<'a> {
    a: &'a Args,
    p: &'a Setup,
    /// The rank's grid: tensor, sequence, pipeline and data groups.
    grid: &'a ProcessGrid,
    /// The sequence ring, with sequence parallelism.
    sp: Option<&'a Communicator>,
    /// The pipeline's schedule.
    schedule: Schedule,
    /// PipeDream-2BW as one stream of steps with no flush (two registrations of the stage).
    stream: bool,
    dp: u64,
    dps: u64,
}

impl Run<'_> {
    /// Step `step`'s `m` micro-batches (this rank's positions with sequence parallelism).
    fn micro_batches(&self, step: u64, m: u64) -> Result<Vec<(Vec<i32>, Vec<i32>)>> {
        (self.batches(m))(step)
    }

    /// What builds step `s`'s `m` micro-batches of this rank, on any thread.
    #[allow(clippy::type_complexity)]
    fn batches(
        &self,
        m: u64,
    ) -> impl Fn(u64) -> Result<Vec<(Vec<i32>, Vec<i32>)>> + Send + Sync + 'static {
        let (data, shape) = (self.p.data.clone(), (self.a.batch, self.a.seq));
        let (dp, dps) = (self.dp, self.dps);
        let ring = self.sp.map(|r| (r.rank(), r.world()));
        move |step| {
            let batches = (0..m)
                .map(|k| data.batch(Split::Train, (step * m + k) * dps + dp, shape.0, shape.1))
                .collect::<Result<Vec<_>>>()?;
            Ok(match ring {
                Some(r) => batches.iter().map(|b| positions_of(b, shape, r)).collect(),
                None => batches,
            })
        }
    }

    /// The micro-batches as the trainers take them.
    fn views<'b>(&self, batches: &'b [(Vec<i32>, Vec<i32>)]) -> Vec<GptBatch<'b>> {
        let mut micro = views(batches, self.a);
        let l = self.a.seq / self.sp.map_or(1, Communicator::world);
        micro.iter_mut().for_each(|b| b.seq = l);
        micro
    }

    /// Trains `--steps` steps on `store`: the losses, tokens and seconds. `--resume` and
    /// `--save` load and save the checkpoint every rank of `world` saves together, this rank's
    /// file at `file(dir)`.
    fn go<P: Placement, S: ParamStore>(
        &self,
        store: &mut S,
        world: &Communicator,
        file: &dyn Fn(&PathBuf) -> PathBuf,
    ) -> Result<(Vec<f32>, usize, f64, Option<DeviceStats>)> {
        let (a, p) = (self.a, self.p);
        let ends = match a.tp_ends.as_str() {
            "split" => EndsLayout::Split,
            "whole" => EndsLayout::Whole,
            e => return Err(bad(format!("--tp-ends {e}: split or whole"))),
        };
        let pipelined = self.grid.spec().pipeline > 1;
        let plan = Plan {
            grid: Some(self.grid),
            ends,
            stages: None,
            schedule: self.schedule,
            // a pipeline stage keeps its blocks' activations
            checkpoint: p.checkpoint && !pipelined,
        };
        // a stream's two weight versions: the stage registered twice, each time from a chunk
        // group rank 0 owns, so that a ZeRO rank holds both versions of a tensor
        if self.stream {
            store.align_to_ranks()?;
        }
        let gpt: Gpt<P> = register(store, &plan, p, a.seed)?;
        let second = match self.stream {
            true => {
                store.align_to_ranks()?;
                Some(register::<P>(store, &plan, p, a.seed)?)
            }
            false => None,
        };
        let delayed = pipelined && !self.stream && a.schedule == "2bw";
        let mut opt = adam(a, p, delayed)?;
        if let Some(dir) = &a.resume {
            store.load_rank(world, &mut opt, &file(dir))?;
        }
        let (mut losses, t0, mut tokens) = (Vec::new(), Instant::now(), 0);
        let m = match pipelined {
            true => a.micro_batches as u64,
            false => u64::from(a.accumulate),
        };
        if let Some(second) = &second {
            // PipeDream-2BW's stream: every step's micro-batches, then one run
            let all = (0..a.steps)
                .map(|k| self.micro_batches(opt.steps() + k, m))
                .collect::<Result<Vec<_>>>()?;
            let batches: Vec<Vec<GptBatch<'_>>> = all.iter().map(|b| self.views(b)).collect();
            let out = train_two_bw_stream([&gpt, second], store, &plan, &mut opt, &batches)?;
            for (k, s) in out.into_iter().enumerate() {
                diverged(s.loss, k as u64 + 1)?;
                losses.push(s.loss);
                tokens += s.tokens;
            }
            return Ok((losses, tokens, t0.elapsed().as_secs_f64(), None));
        }
        let mut step = None;
        // each step's micro-batches, built on a worker thread ahead of the step (`at` by the
        // optimizer's steps, so a skipped step trains its batches again)
        let mut ahead = Ahead::indexed(opt.steps()..u64::MAX, 2, 1, self.batches(m))?;
        let l = a.seq / self.sp.map_or(1, Communicator::world);
        train_loop(
            (&gpt, &plan),
            store,
            &mut opt,
            &mut ahead,
            (a.steps, a.batch, l),
            |store, _| store.device().stats(),
            |store, before, s, _| {
                step = Some(store.device().stats().since(&before));
                losses.push(s.loss);
                tokens += s.tokens;
                Ok(())
            },
        )?;
        if let Some(dir) = &a.save {
            std::fs::create_dir_all(dir).map_err(|e| bad(format!("{}: {e}", dir.display())))?;
            store.save_rank(world, &opt, &file(dir))?;
        }
        Ok((losses, tokens, t0.elapsed().as_secs_f64(), step))
    }
}
