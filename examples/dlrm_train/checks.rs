//! The flags checked before any work: names, ranges, and the host memory the run would hold.
//! A refused flag is an [`Error::InvalidArgument`] naming the flag and its value (the binary
//! exits with status 2 on one, 1 on an error while running).

use tidemem::data::criteo::{Dataset, Synthetic, SyntheticConfig, DENSE_FEATURES};
use tidemem::models::dlrm::DlrmConfig;
use tidemem::prelude::*;

use crate::data::HELD_OUT;
use crate::{bad, Args};

/// Extra host bytes per held-out sample beyond the batch itself: the model's and the hidden
/// model's probabilities, the labels and the AUC's ranks.
const HELD_OUT_EXTRA: u128 = 20;
/// Host bytes per rank beyond one (a thread's stack and its channels).
const PER_RANK: u128 = 2 << 20;

/// The preset's configuration, once every flag is checked; nothing is allocated by size before.
pub fn check(a: &Args) -> Result<DlrmConfig> {
    let cfg = DlrmConfig::preset(&a.preset).ok_or_else(|| {
        bad(format!(
            "--preset {}: one of {:?}",
            a.preset,
            DlrmConfig::PRESETS
        ))
    })?;
    let synthetic = match a.dataset.as_slice() {
        [k] if k == "synthetic" => true,
        [k, _] if k == "criteo-tsv" => false,
        other => {
            return Err(bad(format!(
                "--dataset {}: synthetic, or criteo-tsv PATH",
                other.join(" ")
            )))
        }
    };
    if !matches!(a.ids.as_str(), "hash" | "vocab") {
        return Err(bad(format!("--ids {}: hash or vocab", a.ids)));
    }
    if synthetic && a.eval_tsv.is_some() {
        return Err(bad(
            "--eval-tsv is for --dataset criteo-tsv PATH; synthetic data has its own held-out \
             batches"
                .into(),
        ));
    }
    a.emb_optimizer()?;
    a.policy()?;
    if !matches!(a.sharding.as_str(), "table" | "column") {
        return Err(bad(format!("--sharding {}: table or column", a.sharding)));
    }
    if !matches!(a.backend.as_str(), "sim" | "timing" | "cuda") {
        return Err(bad(format!("--backend {}: sim, timing or cuda", a.backend)));
    }

    share("--scale", a.scale, false)?;
    if !a.zipf.is_finite() || a.zipf < 0.0 {
        return Err(bad(format!(
            "--zipf {}: the exponent must be a finite number, 0 or above",
            a.zipf
        )));
    }
    share("--cache-ratio", a.cache_ratio, false)?;
    share("--warmup", a.warmup, true)?;
    rate("--emb-lr", a.emb_lr)?;
    rate("--lr", a.lr)?;
    for (flag, v) in [
        ("--steps", a.steps),
        ("--eval-batches", a.eval_batches),
        ("--count-batches", a.count_batches),
    ] {
        if v == 0 {
            return Err(bad(format!("{flag} 0: must be at least 1")));
        }
    }
    if a.batch == 0 {
        return Err(bad("--batch 0: must be at least 1".into()));
    }
    if synthetic && a.steps > HELD_OUT {
        return Err(bad(format!(
            "--steps {}: at most {HELD_OUT} on synthetic data (the held-out batches start at \
             that batch index)",
            a.steps
        )));
    }
    if a.ranks == 0 {
        return Err(bad("--ranks 0: must be at least 1".into()));
    }
    if a.ranks > a.batch {
        return Err(bad(format!(
            "--ranks {} over --batch {}: every rank needs a sample of the batch",
            a.ranks, a.batch
        )));
    }
    if a.profile && a.ranks > 1 {
        return Err(bad(format!(
            "--profile measures one rank's step: leave out --ranks {}",
            a.ranks
        )));
    }
    if a.ranks > 1 && a.sharding == "column" && a.ranks > cfg.dim {
        return Err(bad(format!(
            "--ranks {} with --sharding column: the {} preset's rows have {} columns, at most \
             one rank each",
            a.ranks, a.preset, cfg.dim
        )));
    }

    // the tables the run builds: the generator holds no per-row state
    let gen = Synthetic::new(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(a.scale))?;
    let rows: u128 = gen
        .cardinalities()
        .iter()
        .map(|&n| u128::from(if a.ids == "vocab" { n.max(2) } else { n }))
        .sum();
    let need = host_bytes(a, &cfg, rows)?;
    let (have, from) = host_bytes_available();
    if need > have {
        return Err(bad(format!(
            "--batch {} with --eval-batches {} and --count-batches {}, --scale {} ({rows} rows), \
             --ranks {}: the run would hold at least {need} bytes of host memory, more than the \
             {have} bytes available ({from})",
            a.batch, a.eval_batches, a.count_batches, a.scale, a.ranks
        )));
    }
    Ok(cfg)
}

/// A share: finite, in (0, 1], or [0, 1] when `zero` is allowed.
fn share(flag: &str, v: f64, zero: bool) -> Result<()> {
    let low_ok = if zero { v >= 0.0 } else { v > 0.0 };
    if v.is_finite() && low_ok && v <= 1.0 {
        Ok(())
    } else {
        let range = if zero { "[0, 1]" } else { "(0, 1]" };
        Err(bad(format!("{flag} {v}: must be a number in {range}")))
    }
}

/// A learning rate: finite and above 0.
fn rate(flag: &str, v: f32) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(bad(format!("{flag} {v}: must be a finite number above 0")))
    }
}

/// The host bytes the run holds at least (the simulated device's memory is host memory too):
/// the tables with their row optimizer's state, the held-out and counted batches, one training
/// step's batch and activations, the ranks' copies of the MLPs. A floor: copies made along the
/// way come on top.
pub fn host_bytes(a: &Args, cfg: &DlrmConfig, rows: u128) -> Result<u128> {
    let f = 4u128; // bytes of an f32 or a u32
    let tables = cfg.tables as u128;
    let sample = f * (DENSE_FEATURES as u128 + tables + 1);
    let batch = a.batch as u128;
    let held_out = u128::from(a.eval_batches) * batch * (sample + HELD_OUT_EXTRA);
    let counted = u128::from(a.count_batches) * batch * (sample + f * tables);
    let widths: usize = DENSE_FEATURES
        + cfg.bottom.iter().sum::<usize>()
        + cfg.vectors() * cfg.dim
        + cfg.top_inputs()
        + cfg.top.iter().sum::<usize>();
    // the step's ids (concatenated, distinct, inverse) and activations with their gradients
    // and the device's copies
    let step = batch * (sample + 3 * f * tables + 3 * f * widths as u128);
    let row = cfg.dim + a.emb_optimizer()?.state_len(cfg.dim);
    let table = rows * f * row as u128;
    let ranks = a.ranks as u128;
    let mlps = ranks * 4 * f * cfg.mlp_params() as u128 + (ranks - 1) * PER_RANK;
    Ok(held_out + counted + step + table + mlps)
}

/// Host bytes available to the run and where the figure comes from: `MemAvailable` (else
/// `MemTotal`) of `/proc/meminfo`, or the process's limit (its cgroup's, `ulimit -v`) where
/// that is smaller, or else the most one allocation may hold.
pub fn host_bytes_available() -> (u128, &'static str) {
    let (have, from) = meminfo_available();
    let limit = u128::from(tidemem::limits::host_limit());
    if limit < have {
        return (
            limit,
            "the process's memory limit: ulimit -v, its cgroup or the machine",
        );
    }
    (have, from)
}

fn meminfo_available() -> (u128, &'static str) {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    for key in ["MemAvailable:", "MemTotal:"] {
        let kib = info
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u128>().ok());
        if let Some(kib) = kib {
            let from = if key == "MemAvailable:" {
                "MemAvailable in /proc/meminfo"
            } else {
                "MemTotal in /proc/meminfo"
            };
            return (kib * 1024, from);
        }
    }
    (isize::MAX as u128, "the most one allocation may hold")
}
