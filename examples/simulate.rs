//! Replays a GPT-like model's training trace through every placement policy, without allocating
//! its memory, and prints bytes moved per iteration against the offline lower bound.
//!
//! ```sh
//! cargo run --release --example simulate -- --model gpt2-1.5b --device-mem 8GiB --host-mem 64GiB --json
//! cargo run --release --example simulate -- --layers 24 --hidden 2048 --heads 16 --device-mem 4GiB
//! ```
//!
//! JSON output (keys are stable):
//! - `model`: `name`, `layers`, `hidden`, `heads`, `vocab`, `seq`, `batch`, `params`
//! - `device_mem`, `host_mem`: bytes
//! - `chunk_elems`, `groups`, `model_data_bytes`, `param_chunk_bytes`, `file_bytes`,
//!   `peak_non_model`, `min_budget`, `moments`, `device_adam_groups` (chunk groups Adam steps
//!   on the device after warm-up; 0 without `--device-adam`)
//! - `bound`: `{ h2d_bytes, d2h_bytes }`, the offline lower bound per steady iteration
//! - `policies`: list of `{ policy, h2d_bytes, d2h_bytes, total_bytes, ratio_to_bound,
//!   warmup_h2d_bytes, warmup_d2h_bytes, loads, write_backs, clean_drops, prefetches }` for the
//!   last steady iteration (or `{ policy, error }` when a policy cannot run)
//! - `largest`: `{ layers, params, model_data_bytes }` of the largest model of the same width that
//!   fits the device and host under `tide` (`null` if none or not searched)
//! - `largest_searched`: false with `--no-largest`, or when every policy failed
//!
//! When every policy failed, the output is printed and the example exits with status 1,
//! naming each policy's reason.

use clap::Parser;
use serde_json::{json, Value};
use tidemem::chunk::MomentStorage;
use tidemem::models::gpt::GptConfig;
use tidemem::optim::{DevicePlacement, ShadowBudget};
use tidemem::simulate::{
    plan, simulate, timeline, Rates, SimOptions, SimOverlap, StepSchedule, ADAM_BYTES_PER_ELEMENT,
};
use tidemem::tide::Policy;
use tidemem::units::fmt_bytes;
use tidemem::units::parse_bytes;

#[derive(Parser, Debug)]
#[command(about = "Simulate chunk placement policies on a GPT-like model")]
struct Args {
    /// Preset model (gpt2-small, gpt2-medium, gpt2-large, gpt2-1.5b, gpt3-2.7b, gpt3-6.7b, gpt3-13b).
    #[arg(long, default_value = "gpt2-1.5b")]
    model: String,
    /// Override: transformer layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Override: hidden size.
    #[arg(long)]
    hidden: Option<usize>,
    /// Override: attention heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Override: vocabulary size.
    #[arg(long)]
    vocab: Option<usize>,
    /// Override: sequence length.
    #[arg(long)]
    seq: Option<usize>,
    /// Override: micro-batch size.
    #[arg(long)]
    batch: Option<usize>,
    /// Device memory (e.g. 8GiB).
    #[arg(long, default_value = "8GiB")]
    device_mem: String,
    /// Host memory for model data (e.g. 64GiB); beyond it chunks spill to the file tier.
    #[arg(long, default_value = "64GiB")]
    host_mem: String,
    /// Size the device so that the smallest chunk budget of the iteration is this fraction of the
    /// parameter chunk bytes (overrides --device-mem).
    #[arg(long)]
    budget_fraction: Option<f64>,
    /// File tier size used when searching the largest model.
    #[arg(long, default_value = "0")]
    file_mem: String,
    /// Chunk size in elements (default: least-waste search).
    #[arg(long)]
    chunk_elems: Option<usize>,
    /// Policies, comma-separated (tide, patrickstar, lru, static:F).
    #[arg(long, default_value = "tide,patrickstar,lru,static")]
    policies: String,
    /// Share of device memory the scheduler plans with.
    #[arg(long, default_value_t = 0.9)]
    overall_fraction: f64,
    /// Most chunks loaded ahead of use (tide).
    #[arg(long, default_value_t = 2)]
    max_prefetch: usize,
    /// Step Adam on the device for the chunk groups that fit this fraction of the device margin
    /// after warm-up (PatrickStar's rule: 0.8); host only when absent.
    #[arg(long)]
    device_adam: Option<f64>,
    /// Skip the largest-model search.
    #[arg(long)]
    no_largest: bool,
    /// The overlapped step: shadowed (a loss scaler or a clip: copies of the host groups'
    /// optimizer state within --overlap-budget), in-place (nothing can invalidate a step),
    /// clipped (a clip that binds every step: the host groups step after backward, beside the
    /// next forward), redone (a step whose early steps are thrown away: shadowed's, every host
    /// group stepped again after backward), or serial.
    #[arg(long, default_value = "shadowed", value_parser = ["shadowed", "in-place", "clipped", "redone", "serial"])]
    overlap: String,
    /// Host groups that step after backward, beside the next forward, rather than during it
    /// (the first in order): a count, or `best`: the counts of these and of device groups (up
    /// to what --device-adam places) whose overlapped step is the shortest
    /// (`tidemem::simulate::plan`).
    #[arg(long, default_value = "0")]
    overlap_tail: String,
    /// Host bytes for the shadows: auto (half of what the host holds beside the model data)
    /// or a size.
    #[arg(long, default_value = "auto")]
    overlap_budget: String,
    /// Rates of the step-time prediction: a named profile (h100-pcie5).
    #[arg(long, default_value = "h100-pcie5")]
    rates: String,
    /// Override: device TFLOP/s the ops achieve.
    #[arg(long)]
    compute_tflops: Option<f64>,
    /// Override: link GB/s each way.
    #[arg(long)]
    link_gbs: Option<f64>,
    /// Override: the host optimizer's GB/s (28 bytes an element).
    #[arg(long)]
    host_adam_gbs: Option<f64>,
    /// Override: the file tier's GB/s.
    #[arg(long)]
    file_gbs: Option<f64>,
    /// Adam's moments: fp32 (4 bytes an element each) or 8bit (block-wise, 1.016 bytes an
    /// element each, as `ManagerConfig::moments` holds them).
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "8bit"])]
    moments: String,
    /// Data-parallel ZeRO ranks, one device of --device-mem each, sharing one host of
    /// --host-mem: the figures are one rank's.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Override: the collectives' bus GB/s between ranks.
    #[arg(long)]
    bus_gbs: Option<f64>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("simulate: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let mut c = GptConfig::preset(&a.model).ok_or_else(|| {
        tidemem::Error::InvalidArgument(format!(
            "unknown model '{}' (known: {})",
            a.model,
            GptConfig::PRESETS.join(", ")
        ))
    })?;
    c.layers = a.layers.unwrap_or(c.layers);
    c.channels = a.hidden.unwrap_or(c.channels);
    c.heads = a.heads.unwrap_or(c.heads);
    c.vocab = a.vocab.unwrap_or(c.vocab);
    // a step of `batch` sequences of `seq` tokens, every block checkpointed (as PatrickStar runs)
    let (seq, batch) = (a.seq.unwrap_or(1024), a.batch.unwrap_or(8));
    let mut device_mem = parse_bytes(&a.device_mem)? as u64;
    let host_mem = parse_bytes(&a.host_mem)? as u64;
    let file_mem = parse_bytes(&a.file_mem)? as u64;
    check(&a, device_mem)?;
    let policies: Vec<Policy> = a
        .policies
        .split(',')
        .map(Policy::parse)
        .collect::<tidemem::Result<_>>()?;
    let spec = c.spec(batch, seq, true)?;
    if let Some(f) = a.budget_fraction {
        device_mem = device_for_budget(&spec, f, a.overall_fraction, a.chunk_elems)?;
    }
    let mut opts = SimOptions::new(device_mem, host_mem);
    opts.chunk_elems = a.chunk_elems;
    opts.scheduler.overall_fraction = a.overall_fraction;
    opts.scheduler.max_prefetch = a.max_prefetch;
    opts.ranks = a.ranks;
    opts.moments = match a.moments.as_str() {
        "8bit" => MomentStorage::Int8,
        _ => MomentStorage::F32,
    };
    opts.overlap = match a.overlap.as_str() {
        "serial" => SimOverlap::Serial,
        "in-place" => SimOverlap::InPlace,
        "clipped" => SimOverlap::Clipped,
        o => {
            let budget = match a.overlap_budget.as_str() {
                "auto" => ShadowBudget::Auto,
                b => ShadowBudget::Bytes(parse_bytes(b)? as u64),
            };
            match o {
                "redone" => SimOverlap::Redone(budget),
                _ => SimOverlap::Shadowed(budget),
            }
        }
    };
    if let Some(fraction) = a.device_adam {
        opts.optimizer = DevicePlacement::Auto { fraction };
    }

    let rates = rates(&a)?;
    opts.overlap_tail = match a.overlap_tail.as_str() {
        // a policy that cannot run is reported with the others below
        "best" => match plan(&spec, policies[0], &opts, &rates, StepSchedule::Overlapped) {
            Ok(p) => {
                opts.optimizer = DevicePlacement::Groups(p.device_groups);
                p.overlap_tail
            }
            Err(_) => 0,
        },
        n => n.parse().map_err(|_| {
            tidemem::Error::InvalidArgument(format!(
                "--overlap-tail {n}: a count of host groups, or best"
            ))
        })?,
    };
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    let mut common: Option<Value> = None;
    // the step's time on the first policy that runs, serial and overlapped
    let mut step_time = Value::Null;
    for p in &policies {
        match simulate(&spec, *p, &opts) {
            Ok(r) => {
                if common.is_none() {
                    common = Some(json!({
                        "chunk_elems": r.chunk_elems,
                        "groups": r.groups,
                        "model_data_bytes": r.model_data_bytes,
                        "param_chunk_bytes": r.param_chunk_bytes,
                        "file_bytes": r.file_bytes,
                        "peak_non_model": r.peak_non_model,
                        "min_budget": r.min_budget,
                        "moments": r.moments,
                        "device_adam_groups": r.device_adam_groups,
                        "overlap": a.overlap,
                        "overlap_tail": opts.overlap_tail,
                        "overlap_host_bytes": r.overlap_host_bytes,
                        "bound": { "h2d_bytes": r.bound.h2d_bytes, "d2h_bytes": r.bound.d2h_bytes },
                    }));
                }
                if step_time.is_null() {
                    let mut times = Vec::new();
                    for s in [StepSchedule::Serial, StepSchedule::Overlapped] {
                        let t = timeline(&spec, *p, &opts, &rates, s)?;
                        let (slowest, _) = t.slowest();
                        times.push(json!({
                            "schedule": format!("{s:?}").to_lowercase(), "step_s": t.step,
                            "compute_s": t.compute, "h2d_s": t.h2d, "d2h_s": t.d2h,
                            "host_adam_s": t.host_adam, "file_s": t.file,
                            "collective_s": t.collective,
                            "slowest": slowest, "step_over_slowest": t.over_slowest(),
                        }));
                    }
                    step_time = json!({ "policy": p.name(), "rates": rates, "schedules": times });
                }
                let total = r.steady.h2d_bytes + r.steady.d2h_bytes;
                rows.push(json!({
                    "policy": r.policy,
                    "h2d_bytes": r.steady.h2d_bytes,
                    "d2h_bytes": r.steady.d2h_bytes,
                    "total_bytes": total,
                    "ratio_to_bound": total as f64 / r.bound.total().max(1) as f64,
                    "warmup_h2d_bytes": r.warmup.h2d_bytes,
                    "warmup_d2h_bytes": r.warmup.d2h_bytes,
                    "loads": r.steady.loads,
                    "write_backs": r.steady.write_backs,
                    "clean_drops": r.steady.clean_drops,
                    "prefetches": r.steady.prefetches,
                }));
            }
            Err(e) => {
                failures.push(format!("{}: {e}", p.name()));
                rows.push(json!({ "policy": p.name(), "error": e.to_string() }));
            }
        }
    }
    let all_failed = failures.len() == policies.len();
    // the search runs the policies again: not when none could run
    let searched = !a.no_largest && !all_failed;
    let largest = if !searched {
        Value::Null
    } else {
        match c.largest_fitting([batch, seq], true, Policy::Tide, &opts, file_mem)? {
            Some((lc, r)) => json!({
                "layers": lc.layers,
                "params": lc.spec(batch, seq, true)?.params(),
                "model_data_bytes": r.model_data_bytes,
                "overlap_host_bytes": r.overlap_host_bytes,
            }),
            None => Value::Null,
        }
    };
    let mut out = json!({
        "model": {
            "name": a.model, "layers": c.layers, "hidden": c.channels, "heads": c.heads,
            "vocab": c.vocab, "seq": seq, "batch": batch, "params": spec.params(),
        },
        "device_mem": device_mem,
        "host_mem": host_mem,
        "ranks": a.ranks,
        "moments": a.moments,
        "policies": rows,
        "largest": largest,
        "largest_searched": searched,
        "step_time": step_time,
    });
    if let (Some(Value::Object(m)), Value::Object(o)) = (common, &mut out) {
        o.extend(m);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    } else {
        print_table(&out);
    }
    if all_failed {
        return Err(format!("every policy failed: {}", failures.join("; ")).into());
    }
    Ok(())
}

/// The rates of `--rates` with the overrides.
fn rates(a: &Args) -> tidemem::Result<Rates> {
    let mut r = Rates::profile(&a.rates).ok_or_else(|| {
        tidemem::Error::InvalidArgument(format!(
            "--rates {}: a profile ({})",
            a.rates,
            Rates::PROFILES.join(", ")
        ))
    })?;
    if let Some(t) = a.compute_tflops {
        r.compute = t * 1e12;
    }
    if let Some(g) = a.link_gbs {
        (r.h2d, r.d2h) = (g * 1e9, g * 1e9);
    }
    if let Some(g) = a.host_adam_gbs {
        r.host_adam = g * 1e9 / ADAM_BYTES_PER_ELEMENT;
    }
    if let Some(g) = a.file_gbs {
        r.file = g * 1e9;
    }
    if let Some(g) = a.bus_gbs {
        r.bus = g * 1e9;
    }
    if a.compute_tflops.is_some()
        || a.link_gbs.is_some()
        || a.host_adam_gbs.is_some()
        || a.file_gbs.is_some()
        || a.bus_gbs.is_some()
    {
        r.name = format!("{} with overrides", r.name);
    }
    r.validate()?;
    Ok(r)
}

/// Refuses flags that make no sense before any work starts (the model's shape is checked by
/// [`gpt`]).
fn check(a: &Args, device_mem: u64) -> tidemem::Result<()> {
    let bad = |what: String| Err(tidemem::Error::InvalidArgument(what));
    if device_mem == 0 && a.budget_fraction.is_none() {
        return bad(format!("--device-mem {} is no memory", a.device_mem));
    }
    if let Some(f) = a.budget_fraction {
        if !(f.is_finite() && f > 0.0) {
            return bad(format!(
                "--budget-fraction takes a finite fraction above 0, got {f}"
            ));
        }
    }
    if !(a.overall_fraction > 0.0 && a.overall_fraction <= 1.0) {
        return bad(format!(
            "--overall-fraction takes a fraction in (0, 1], got {}",
            a.overall_fraction
        ));
    }
    if let Some(f) = a.device_adam {
        if !(f > 0.0 && f <= 1.0) {
            return bad(format!("--device-adam takes a fraction in (0, 1], got {f}"));
        }
    }
    if a.chunk_elems == Some(0) {
        return bad("--chunk-elems 0 holds nothing".into());
    }
    if let Some(n) = a.chunk_elems {
        // a chunk whose bytes cannot be addressed (every size from it would wrap)
        if let Err(e) = tidemem::chunk::ChunkLayout::new(n) {
            return bad(format!("--chunk-elems {n}: {e}"));
        }
    }
    if a.ranks == 0 {
        return bad("--ranks 0: at least one rank".into());
    }
    Ok(())
}

/// Device bytes whose smallest chunk budget is `f` × the parameter chunk bytes.
fn device_for_budget(
    spec: &tidemem::simulate::ModelSpec,
    f: f64,
    overall: f64,
    chunk_elems: Option<usize>,
) -> tidemem::Result<u64> {
    let mut probe = SimOptions::new(1 << 50, 1 << 50);
    probe.chunk_elems = chunk_elems;
    probe.iterations = 1;
    let r = simulate(spec, Policy::Tide, &probe)?;
    Ok(((r.peak_non_model as f64 + f * r.param_chunk_bytes as f64) / overall).ceil() as u64)
}

fn print_table(v: &Value) {
    let b = |k: &str| fmt_bytes(v[k].as_u64().unwrap_or(0));
    println!(
        "{} ({:.2}B params), device {}, host {}{}",
        v["model"]["name"].as_str().unwrap_or("?"),
        v["model"]["params"].as_u64().unwrap_or(0) as f64 / 1e9,
        b("device_mem"),
        b("host_mem"),
        match v["ranks"].as_u64() {
            Some(n) if n > 1 => format!(", {n} ZeRO ranks (one rank's figures)"),
            _ => String::new(),
        }
    );
    println!(
        "chunks: {} groups of {} elements; model data {} (param list {}), peak non-model {}, smallest chunk budget {}",
        v["groups"],
        v["chunk_elems"],
        b("model_data_bytes"),
        b("param_chunk_bytes"),
        b("peak_non_model"),
        b("min_budget")
    );
    println!(
        "the {} step holds {} of host memory beside the model data",
        v["overlap"].as_str().unwrap_or("?"),
        b("overlap_host_bytes")
    );
    if let Some(k) = v["device_adam_groups"].as_u64().filter(|&k| k > 0) {
        println!("Adam steps {k} chunk groups on the device after warm-up");
    }
    println!(
        "{:<14} {:>12} {:>12} {:>12} {:>9}",
        "policy", "h2d/iter", "d2h/iter", "total", "÷bound"
    );
    let bh = v["bound"]["h2d_bytes"].as_u64().unwrap_or(0);
    let bd = v["bound"]["d2h_bytes"].as_u64().unwrap_or(0);
    println!(
        "{:<14} {:>12} {:>12} {:>12} {:>9}",
        "lower bound",
        fmt_bytes(bh),
        fmt_bytes(bd),
        fmt_bytes(bh + bd),
        "1.00"
    );
    for r in v["policies"].as_array().into_iter().flatten() {
        if let Some(e) = r["error"].as_str() {
            println!("{:<14} error: {e}", r["policy"].as_str().unwrap_or("?"));
            continue;
        }
        println!(
            "{:<14} {:>12} {:>12} {:>12} {:>9.2}",
            r["policy"].as_str().unwrap_or("?"),
            fmt_bytes(r["h2d_bytes"].as_u64().unwrap_or(0)),
            fmt_bytes(r["d2h_bytes"].as_u64().unwrap_or(0)),
            fmt_bytes(r["total_bytes"].as_u64().unwrap_or(0)),
            r["ratio_to_bound"].as_f64().unwrap_or(0.0)
        );
    }
    let st = &v["step_time"];
    if let Some(times) = st["schedules"].as_array() {
        println!(
            "a steady step under {} at {} rates:",
            st["policy"].as_str().unwrap_or("?"),
            st["rates"]["name"].as_str().unwrap_or("?")
        );
        println!(
            "{:<11} {:>10} {:>10} {:>8} {:>8} {:>10} {:>8} {:>11} {:>10}",
            "schedule",
            "step ms",
            "compute",
            "h2d",
            "d2h",
            "host Adam",
            "file",
            "collectives",
            "÷slowest"
        );
        let ms = |t: &Value, k: &str| t[k].as_f64().unwrap_or(0.0) * 1e3;
        for t in times {
            println!(
                "{:<11} {:>10.1} {:>10.1} {:>8.1} {:>8.1} {:>10.1} {:>8.1} {:>11.1} {:>10.2}",
                t["schedule"].as_str().unwrap_or("?"),
                ms(t, "step_s"),
                ms(t, "compute_s"),
                ms(t, "h2d_s"),
                ms(t, "d2h_s"),
                ms(t, "host_adam_s"),
                ms(t, "file_s"),
                ms(t, "collective_s"),
                t["step_over_slowest"].as_f64().unwrap_or(0.0)
            );
        }
    }
    match &v["largest"] {
        Value::Null if v["largest_searched"].as_bool() == Some(false) => {}
        Value::Null => println!("largest model: none fits"),
        l => println!(
            "largest model of this width under tide: {} layers, {:.2}B params, model data {} \
             and {} for the overlapped step",
            l["layers"],
            l["params"].as_u64().unwrap_or(0) as f64 / 1e9,
            fmt_bytes(l["model_data_bytes"].as_u64().unwrap_or(0)),
            fmt_bytes(l["overlap_host_bytes"].as_u64().unwrap_or(0))
        ),
    }
}
