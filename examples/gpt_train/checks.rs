//! Every flag, input and output path checked before the first step, so that no run trains for
//! nothing and then fails at its end.

use std::path::{Path, PathBuf};

use tidemem::comm::MAX_LOCAL_RANKS;
use tidemem::data::text::{Split, TokenData, Tokenizer};
use tidemem::limits;
use tidemem::models::gpt::GptConfig;
use tidemem::prelude::*;

use super::{bad, Args};

/// The flags that need no data: numbers in range, layouts that need ranks, sizes the machine
/// can hold.
pub fn flags(a: &Args, launched: bool) -> Result<()> {
    if !a.clip.is_finite() || a.clip < 0.0 {
        return Err(bad(format!(
            "--clip {}: a finite global norm ≥ 0 (0: no clipping)",
            a.clip
        )));
    }
    if !a.lr.is_finite() || a.lr <= 0.0 {
        return Err(bad(format!("--lr {}: a finite rate > 0", a.lr)));
    }
    if !a.weight_decay.is_finite() || a.weight_decay < 0.0 {
        return Err(bad(format!(
            "--weight-decay {}: finite and ≥ 0",
            a.weight_decay
        )));
    }
    if !launched && a.ranks > MAX_LOCAL_RANKS {
        return Err(bad(format!(
            "--ranks {}: at most {MAX_LOCAL_RANKS} in-process ranks (one thread and device each)",
            a.ranks
        )));
    }
    let split = a.pp > 1 || a.sp > 1 || a.tp != "none";
    if split && a.ranks == 1 && !launched {
        return Err(bad(format!(
            "--pp {} --sp {} --tp {} split the model over ranks: give --ranks (a multiple of \
             their product)",
            a.pp, a.sp, a.tp
        )));
    }
    if a.profile && (a.ranks > 1 || launched || a.tp != "none") {
        return Err(bad(
            "--profile measures one process's step: leave out --ranks, --tp and the launcher"
                .into(),
        ));
    }
    if a.tokenizer.is_some() && a.data.is_none() {
        return Err(bad(
            "--tokenizer needs --data: the generated corpus is bytes, not the tokenizer's ids"
                .into(),
        ));
    }
    Ok(())
}

/// The batch sizes against the model and the machine: a micro-batch's logits and a step's
/// token ids must fit in host memory (the simulated device's memory is host memory too).
pub fn sizes(a: &Args, cfg: &GptConfig) -> Result<()> {
    if a.seq > cfg.max_seq || a.batch == 0 || a.seq == 0 || a.accumulate == 0 || a.ranks == 0 {
        return Err(bad(format!(
            "--batch {} --seq {} --accumulate {} --ranks {}: each at least 1, and --seq at most \
             the model's {} positions",
            a.batch, a.seq, a.accumulate, a.ranks, cfg.max_seq
        )));
    }
    let flags = || {
        format!(
            "--batch {} --seq {} --accumulate {} --ranks {}",
            a.batch, a.seq, a.accumulate, a.ranks
        )
    };
    // fp32 logits and their gradient, a micro-batch
    limits::host_bytes(
        || format!("{}: a micro-batch's logits", flags()),
        &[a.batch, a.seq, cfg.vocab, 8],
    )?;
    // a step's token ids and targets (4 bytes each), on every in-process rank
    let micro = (a.accumulate as usize).max(a.micro_batches);
    limits::host_bytes(
        || format!("{}: a step's tokens", flags()),
        &[a.batch, a.seq, micro, a.ranks, 8],
    )?;
    Ok(())
}

/// The corpus against the run: a training and a held-out batch exist, and a sample decodes.
pub fn data(a: &Args, cfg: &GptConfig, data: &TokenData, tok: &Tokenizer) -> Result<()> {
    if data.vocab() > cfg.vocab {
        return Err(bad(format!(
            "the tokenizer has {} tokens; the model only {}",
            data.vocab(),
            cfg.vocab
        )));
    }
    for split in [Split::Train, Split::Val] {
        let have = data.split(split).len();
        if have < a.seq + 1 {
            return Err(bad(format!(
                "the {} part of the corpus has {have} tokens; a --seq {} batch needs {}",
                if split == Split::Train {
                    "training"
                } else {
                    "held-out"
                },
                a.seq,
                a.seq + 1
            )));
        }
    }
    if a.sample > 0 && cfg.vocab > tok.vocab_size() {
        return Err(bad(format!(
            "--sample {}: the model draws from {} ids but the tokenizer decodes {}; pass \
             --sample 0 or a tokenizer of the model's vocabulary",
            a.sample,
            cfg.vocab,
            tok.vocab_size()
        )));
    }
    Ok(())
}

/// A path as the file system will resolve it: its directory made absolute (when it exists)
/// with the file name kept.
fn resolved(p: &Path) -> PathBuf {
    match (parent(p).canonicalize(), p.file_name()) {
        (Ok(d), Some(n)) => d.join(n),
        _ => p.to_path_buf(),
    }
}

/// `dir` exists (or is made) and takes a new file.
fn writable_dir(flag: &str, dir: &Path, create: bool) -> Result<()> {
    if create {
        std::fs::create_dir_all(dir)
            .map_err(|e| bad(format!("{flag} {}: cannot create it: {e}", dir.display())))?;
    }
    if !dir.is_dir() {
        return Err(bad(format!("{flag}: {} is not a directory", dir.display())));
    }
    tempfile::NamedTempFile::new_in(dir)
        .map(drop)
        .map_err(|e| bad(format!("{flag}: cannot write in {}: {e}", dir.display())))
}

/// The directory a file path is written in.
fn parent(p: &Path) -> &Path {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Every input and output path: inputs exist and are of the right kind, outputs can be
/// written and do not clash.
pub fn paths(a: &Args, sharded: bool) -> Result<()> {
    if let Some(r) = &a.resume {
        let meta =
            std::fs::metadata(r).map_err(|e| bad(format!("--resume {}: {e}", r.display())))?;
        if sharded && !meta.is_dir() {
            return Err(bad(format!(
                "--resume {}: with several ranks a checkpoint is a directory of one file a rank",
                r.display()
            )));
        }
        if !sharded && meta.is_dir() {
            let ranks = std::fs::read_dir(r)
                .map(|d| {
                    d.filter_map(|e| e.ok())
                        .filter(|e| e.file_name().to_string_lossy().starts_with("rank"))
                        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
                        .count()
                })
                .unwrap_or(0);
            return Err(bad(format!(
                "--resume {}: a directory, the checkpoint of {ranks} ranks: resume it with \
                 --ranks {ranks} (one rank resumes from a file)",
                r.display()
            )));
        }
    }
    if let Some(p) = &a.load_hf {
        if !p.is_file() {
            return Err(bad(format!("--load-hf {}: not a file", p.display())));
        }
    }
    if let Some(s) = &a.save {
        if sharded {
            writable_dir("--save", s, true)?;
        } else {
            if s.is_dir() {
                return Err(bad(format!(
                    "--save {}: a directory; one rank saves one file",
                    s.display()
                )));
            }
            writable_dir("--save", parent(s), false)?;
        }
    }
    if let Some(s) = &a.save_hf {
        if s.is_dir() {
            return Err(bad(format!("--save-hf {}: a directory", s.display())));
        }
        writable_dir("--save-hf", parent(s), false)?;
    }
    if let Some(t) = &a.trace {
        writable_dir("--trace", t, true)?;
    }
    // no output may overwrite another, nor the trace's files
    let mut outs: Vec<(&str, PathBuf)> = Vec::new();
    if let Some(s) = &a.save {
        outs.push(("--save", resolved(s)));
    }
    if let Some(s) = &a.save_hf {
        outs.push(("--save-hf", resolved(s)));
    }
    if let Some(t) = &a.trace {
        let t = resolved(t);
        outs.push(("--trace", t.join("gpt_train.json")));
        outs.push(("--trace", t.join("tide.svg")));
    }
    if let (Some(h), Some(d)) = (&a.load_hf, &a.save) {
        if resolved(h) == resolved(d) {
            return Err(bad(format!(
                "--save {} is the --load-hf file: a checkpoint of this crate would replace it",
                d.display()
            )));
        }
    }
    for (i, (f, p)) in outs.iter().enumerate() {
        for (g, q) in &outs[i + 1..] {
            if p == q {
                return Err(bad(format!(
                    "{f} and {g} both write {}: one would overwrite the other",
                    p.display()
                )));
            }
        }
    }
    Ok(())
}

/// The heads of an imported checkpoint: `--heads`, or `n_head` of the `config.json` beside
/// it; guessing from the shapes alone can be wrong (a 4-head model reads as 2).
pub fn hf_heads(a: &Args, file: &Path) -> Result<usize> {
    if let Some(h) = a.heads {
        return Ok(h);
    }
    let config = parent(file).join("config.json");
    let text = std::fs::read_to_string(&config).map_err(|_| {
        bad(format!(
            "--load-hf {}: no config.json beside it to read the heads from; give --heads",
            file.display()
        ))
    })?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", config.display())))?;
    json.get("n_head")
        .or_else(|| json.get("num_attention_heads"))
        .and_then(serde_json::Value::as_u64)
        .filter(|&h| h > 0)
        .map(|h| h as usize)
        .ok_or_else(|| bad(format!("{}: no n_head; give --heads", config.display())))
}
