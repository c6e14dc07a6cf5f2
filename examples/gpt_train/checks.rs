//! Every flag, input and output path checked before the first step, so that no run trains for
//! nothing and then fails at its end.

use std::path::{Path, PathBuf};

use tidemem::comm::MAX_LOCAL_RANKS;
use tidemem::data::text::{Split, TokenData, Tokenizer};
use tidemem::limits;
use tidemem::models::gpt::GptConfig;
use tidemem::prelude::*;
use tidemem::units::fmt_bytes;

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
    if a.overlap_budget != "auto" {
        tidemem::units::parse_bytes(&a.overlap_budget).map_err(|e| {
            bad(format!(
                "--overlap-budget {}: auto or a size such as 8GiB ({e})",
                a.overlap_budget
            ))
        })?;
    }
    if a.rates != "memory" && tidemem::simulate::Rates::profile(&a.rates).is_none() {
        return Err(bad(format!(
            "--rates {}: memory or one of {}",
            a.rates,
            tidemem::simulate::Rates::PROFILES.join(", ")
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
    if a.load_hf.is_some() && a.resume.is_some() {
        return Err(bad(
            "--load-hf with --resume: the checkpoint restores every weight the import would \
             give; pass one"
                .into(),
        ));
    }
    limits::host_bytes(
        || format!("--sample {}: the tokens drawn", a.sample),
        &[a.sample, 8],
    )?;
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

/// The host memory the run needs at least, against what this process may use
/// ([`limits::host_limit`]: the machine, its cgroup, `ulimit -v`): the model data held on the
/// host (parameters, fp32 masters and moments: `dtype` + 12 bytes an element, at most
/// `--host-mem`; the rest spills to the file tier), the overlapped step's copy of the host
/// groups' optimizer state (12 bytes an element), and the simulated devices' memory
/// (`device` bytes each, host memory too). A run past it is refused before any work, naming
/// every part, where it would otherwise end in an allocation failure midway.
pub fn host(
    a: &Args,
    cfg: &GptConfig,
    dtype: DType,
    host_mem: Option<u64>,
    device: u64,
) -> Result<()> {
    let elems: u64 = cfg
        .param_shapes()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() as u64)
        .sum();
    // the master and the moments (8-bit: a byte an element and a scale a 256), and the
    // overlap's shadow of them
    let state = if a.moments == "8bit" {
        4.0 + 2.0 * 1.016
    } else {
        12.0
    };
    let per = dtype.size() as f64 + state;
    let model = (elems as f64 * per) as u64;
    let held = model.min(host_mem.unwrap_or(u64::MAX));
    let shadow = if a.no_overlap {
        0
    } else {
        (held as f64 / per * state) as u64
    };
    let sim = a.backend != "cuda" && !launched()?;
    let devices = if sim {
        device.saturating_mul(a.ranks as u64)
    } else {
        0
    };
    let need = held.saturating_add(shadow).saturating_add(devices);
    let limit = limits::host_limit();
    if need > limit {
        return Err(Error::TooLarge {
            what: format!(
                "host memory of a {} run: model data {} on the host{}, the overlapped step's \
                 copy of its optimizer state {} (--no-overlap: none), simulated devices {} \
                 (pass --host-mem to spill model data to the file tier)",
                a.model,
                fmt_bytes(held),
                if held < model { " (--host-mem)" } else { "" },
                fmt_bytes(shadow),
                fmt_bytes(devices)
            ),
            requested: need.into(),
            limit,
        });
    }
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

/// The file a path names once every symbolic link is followed: its final path (which need
/// not exist: an output's) and, when it exists, its type and identity (device, inode), so
/// that two names of one file (links, hard links) are known as one.
struct Resolved {
    path: PathBuf,
    file: Option<(std::fs::FileType, (u64, u64))>,
}

/// Follows `p`'s links as the kernel would (40 at most: more is a loop) to what it names; an
/// error names `flag` and the path when a link loops or a directory on the way is missing.
fn resolve(flag: &str, p: &Path) -> Result<Resolved> {
    use std::os::unix::fs::MetadataExt;
    let mut at = p.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&at) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let dir = parent(&at).canonicalize().map_err(|e| {
                    bad(format!(
                        "{flag} {}: its directory {}: {e}",
                        p.display(),
                        parent(&at).display()
                    ))
                })?;
                let name = at
                    .file_name()
                    .ok_or_else(|| bad(format!("{flag} {}: names no file", p.display())))?;
                return Ok(Resolved {
                    path: dir.join(name),
                    file: None,
                });
            }
            Err(e) => return Err(bad(format!("{flag} {}: {e}", p.display()))),
            Ok(m) if m.file_type().is_symlink() => {
                let link = std::fs::read_link(&at)
                    .map_err(|e| bad(format!("{flag} {}: {e}", p.display())))?;
                at = parent(&at).join(link);
            }
            Ok(m) => {
                let path = at
                    .canonicalize()
                    .map_err(|e| bad(format!("{flag} {}: {e}", p.display())))?;
                return Ok(Resolved {
                    path,
                    file: Some((m.file_type(), (m.dev(), m.ino()))),
                });
            }
        }
    }
    Err(bad(format!(
        "{flag} {}: a loop of symbolic links",
        p.display()
    )))
}

/// What a file type is, in words, for one that is not a regular file.
fn kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    match () {
        _ if t.is_dir() => "a directory",
        _ if t.is_fifo() => "a fifo (reading it would wait for a writer)",
        _ if t.is_char_device() || t.is_block_device() => "a device",
        _ if t.is_socket() => "a socket",
        _ => "not a regular file",
    }
}

/// An input: a regular file that exists (a fifo or a device is refused: reading one may never
/// end).
fn input(flag: &str, p: &Path) -> Result<Resolved> {
    let r = resolve(flag, p)?;
    match r.file {
        None => Err(bad(format!("{flag} {}: no such file", p.display()))),
        Some((t, _)) if !t.is_file() => Err(bad(format!("{flag} {}: {}", p.display(), kind(t)))),
        Some(_) => Ok(r),
    }
}

/// An output file: new, or a regular file to be replaced, in a directory that takes a new
/// file (a save writes beside its target and renames).
fn output(flag: &str, p: &Path) -> Result<Resolved> {
    let r = resolve(flag, p)?;
    if let Some((t, _)) = r.file {
        if !t.is_file() {
            return Err(bad(format!(
                "{flag} {}: {}; an output must be a regular file or a new name",
                p.display(),
                kind(t)
            )));
        }
    }
    writable_dir(flag, parent(&r.path), false)?;
    Ok(r)
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

/// The file of rank `r` in a checkpoint directory of several ranks.
pub fn rank_file(dir: &Path, r: usize) -> PathBuf {
    dir.join(format!("rank{r}.safetensors"))
}

/// The files `--resume r` reads: `r`, or with `sharded` each rank's file of the directory `r`
/// (its previous generation where a killed save left only that).
fn resume_files(r: &Path, sharded: bool, ranks: usize) -> Result<Vec<Resolved>> {
    let mut out = Vec::new();
    let meta = std::fs::metadata(r).map_err(|e| bad(format!("--resume {}: {e}", r.display())))?;
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
        if ranks == 0 {
            return Err(bad(format!(
                "--resume {}: a directory holding no rank<r>.safetensors: not a checkpoint \
                 (one rank resumes from a file)",
                r.display()
            )));
        }
        return Err(bad(format!(
            "--resume {}: a directory, the checkpoint of {ranks} ranks: resume it with \
             --ranks {ranks} and the layout that saved it (one rank resumes from a file)",
            r.display()
        )));
    }
    if sharded {
        for k in 0..ranks {
            // a rank's current file, or only its previous generation after a killed save
            let f = rank_file(r, k);
            let prev = PathBuf::from(format!("{}.prev", f.display()));
            match input("--resume", &f) {
                Ok(f) => out.push(f),
                Err(_) if prev.exists() => out.push(input("--resume", &prev)?),
                Err(e) => return Err(e),
            }
        }
    } else {
        out.push(input("--resume", r)?);
    }
    Ok(out)
}

/// Every input and output path, before any work: inputs are regular files that exist (a fifo
/// would hang the run), outputs are regular files or new names in directories that take a
/// file, and no output is another input or output under another name (a symbolic or hard link
/// included), so that nothing a user gives is overwritten. `--save` may be `--resume`: a
/// checkpoint saved over the one it resumed, atomically. `ranks` is the world size: with
/// `sharded`, a checkpoint is a directory of one file a rank.
pub fn paths(a: &Args, sharded: bool, ranks: usize) -> Result<()> {
    // (flag, file, whether the run writes it)
    let mut files: Vec<(&str, Resolved, bool)> = Vec::new();
    if let Some(r) = &a.resume {
        for f in resume_files(r, sharded, ranks)? {
            files.push(("--resume", f, false));
        }
    }
    if let Some(p) = &a.load_hf {
        files.push(("--load-hf", input("--load-hf", p)?, false));
        let config = parent(p).join("config.json");
        if config.exists() || config.is_symlink() {
            files.push((
                "--load-hf's config.json",
                input("--load-hf", &config)?,
                false,
            ));
        }
    }
    if let Some(p) = &a.data {
        files.push(("--data", input("--data", p)?, false));
    }
    if let Some(p) = &a.tokenizer {
        files.push(("--tokenizer", input("--tokenizer", p)?, false));
    }
    if let Some(s) = &a.save {
        if sharded {
            writable_dir("--save", s, true)?;
            for k in 0..ranks {
                files.push(("--save", output("--save", &rank_file(s, k))?, true));
            }
        } else {
            if s.is_dir() {
                return Err(bad(format!(
                    "--save {}: a directory; one rank saves one file",
                    s.display()
                )));
            }
            files.push(("--save", output("--save", s)?, true));
        }
    }
    if let Some(s) = &a.save_hf {
        files.push(("--save-hf", output("--save-hf", s)?, true));
    }
    if let Some(t) = &a.trace {
        writable_dir("--trace", t, true)?;
        for name in ["gpt_train.json", "tide.svg"] {
            files.push(("--trace", output("--trace", &t.join(name))?, true));
        }
    }
    for (i, (f, p, w)) in files.iter().enumerate() {
        for (g, q, v) in &files[i + 1..] {
            let same = p.path == q.path
                || matches!((p.file, q.file), (Some((_, x)), Some((_, y))) if x == y);
            // a checkpoint saved over the one it resumed is replaced atomically, by design
            let resave = (*f, *g) == ("--resume", "--save");
            if same && (*w || *v) && !resave {
                return Err(bad(match (*w, *v) {
                    (true, true) => format!(
                        "{f} and {g} both write {}: one would overwrite the other",
                        p.path.display()
                    ),
                    _ => format!(
                        "{f} and {g} are one file, {}: the run would overwrite its input",
                        p.path.display()
                    ),
                }));
            }
        }
    }
    Ok(())
}

/// The `config.json` beside an imported checkpoint, if there is one (checked a regular file
/// by [`paths`]).
fn hf_config(file: &Path) -> Result<Option<(PathBuf, serde_json::Value)>> {
    let config = parent(file).join("config.json");
    if !config.exists() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(&config).map_err(|e| bad(format!("{}: {e}", config.display())))?;
    let json =
        serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", config.display())))?;
    Ok(Some((config, json)))
}

/// A positive count of a `config.json` field, or why it is not one.
fn count(config: &Path, json: &serde_json::Value, keys: &[&str]) -> Result<Option<usize>> {
    let Some((key, v)) = keys.iter().find_map(|k| json.get(*k).map(|v| (*k, v))) else {
        return Ok(None);
    };
    match v.as_u64() {
        Some(n) if n > 0 => Ok(Some(n as usize)),
        _ => Err(bad(format!(
            "{}: {key} is {v}, not a positive whole number",
            config.display()
        ))),
    }
}

/// The heads of an imported checkpoint: `--heads`, or `n_head` of the `config.json` beside
/// it; guessing from the shapes alone can be wrong (a 4-head model reads as 2).
pub fn hf_heads(a: &Args, file: &Path) -> Result<usize> {
    if let Some(h) = a.heads {
        return Ok(h);
    }
    let Some((config, json)) = hf_config(file)? else {
        return Err(bad(format!(
            "--load-hf {}: no config.json beside it to read the heads from; give --heads",
            file.display()
        )));
    };
    count(&config, &json, &["n_head", "num_attention_heads"])?
        .ok_or_else(|| bad(format!("{}: no n_head; give --heads", config.display())))
}

/// An imported model's shape against what the command line and its `config.json` say: a
/// shape flag or a `config.json` field that contradicts the file is refused, naming both
/// values (the file's tensors decide the shape; nothing is silently ignored).
pub fn hf_agrees(a: &Args, file: &Path, cfg: &GptConfig) -> Result<()> {
    let flags = [
        ("--layers", a.layers, cfg.layers),
        ("--channels", a.channels, cfg.channels),
        ("--heads", a.heads, cfg.heads),
        ("--vocab", a.vocab, cfg.vocab),
        ("--max-seq", a.max_seq, cfg.max_seq),
    ];
    for (flag, given, has) in flags {
        if let Some(g) = given.filter(|&g| g != has) {
            return Err(bad(format!(
                "{flag} {g}: the --load-hf model {} has {has}",
                file.display()
            )));
        }
    }
    if let Some((config, json)) = hf_config(file)? {
        let fields: [(&[&str], usize); 5] = [
            (&["n_layer", "num_hidden_layers"], cfg.layers),
            (&["n_embd", "hidden_size"], cfg.channels),
            (&["n_head", "num_attention_heads"], cfg.heads),
            (&["vocab_size"], cfg.vocab),
            (&["n_positions", "max_position_embeddings"], cfg.max_seq),
        ];
        for (keys, has) in fields {
            if let Some(n) = count(&config, &json, keys)?.filter(|&n| n != has) {
                return Err(bad(format!(
                    "{}: {} is {n}, but the tensors of {} give {has}",
                    config.display(),
                    keys[0],
                    file.display()
                )));
            }
        }
    }
    Ok(())
}

/// Whether a launcher started this process as one rank of a job (`torchrun`'s variables, or
/// an `srun` task's).
pub fn launched() -> Result<bool> {
    Ok(tidemem::comm::LaunchEnv::from_env()?.is_some())
}
