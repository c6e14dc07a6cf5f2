//! Nothing a user gives `gpt_train` is lost or silently misread: no output overwrites an input
//! or another output under any name (a symbolic or a hard link), outputs that cannot be
//! written and inputs that would hang are refused before the first step, a checkpoint's
//! every header byte is checked, a checkpoint of another model is refused naming both
//! values, and an import's shape is never contradicted silently.
//!
//! Runs the `gpt_train` example that `cargo test` builds (`target/<profile>/examples/`); a
//! filtered run must build it first (`cargo build --example gpt_train`).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// A small model: a run of two steps takes well under a second (each flag unless a test
/// gives its own).
const SMALL: &[(&str, &str)] = &[
    ("--layers", "2"),
    ("--channels", "32"),
    ("--heads", "2"),
    ("--seq", "16"),
    ("--batch", "2"),
    ("--steps", "2"),
    ("--sample", "0"),
];

fn binary() -> PathBuf {
    common::example_binary("gpt_train")
}

/// `gpt_train` in `dir` with the small model, `args` and the environment `env`.
fn run_with(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(binary());
    for (flag, value) in SMALL {
        if !args.contains(flag) {
            cmd.args([flag, value]);
        }
    }
    cmd.args(args)
        .current_dir(dir)
        .env("TIDEMEM_BACKEND", "sim")
        .env_remove("TIDEMEM_LEGACY_LOAD")
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("gpt_train starts")
}

fn run(dir: &Path, args: &[&str]) -> Output {
    run_with(dir, args, &[])
}

fn ok(dir: &Path, args: &[&str]) {
    let out = run(dir, args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Refused with exit 1 and a message holding `want`, with every file of `dir` as it was.
#[track_caller]
fn refused(dir: &Path, args: &[&str], want: &str) {
    let before = contents(dir);
    let out = run(dir, args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert!(err.contains(want), "{args:?}: {err:?} lacks {want:?}");
    assert_eq!(contents(dir), before, "{args:?}: a file changed");
}

/// Every regular file under `dir` (links followed) and its bytes.
fn contents(dir: &Path) -> Vec<(PathBuf, Option<Vec<u8>>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_dir() {
                stack.push(p);
            } else if meta.is_file() {
                out.push((p.clone(), std::fs::read(&p).ok()));
            } else {
                out.push((p, None));
            }
        }
    }
    out.sort();
    out
}

/// A directory holding a checkpoint `c.st`, an exported model `m.st` and a corpus.
fn workspace() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    ok(dir.path(), &["--save", "c.st", "--save-hf", "m.st"]);
    std::fs::write(dir.path().join("corpus.txt"), "a small corpus ".repeat(200)).unwrap();
    dir
}

/// Every input (`--data`, `--load-hf`, `--resume`) and output (`--save`, `--save-hf`,
/// `--trace`) is a distinct file once links and hard links are followed; `--save` may be
/// `--resume` (a newer checkpoint replaces the one resumed, atomically).
#[test]
fn no_output_overwrites_an_input_or_another_output() {
    let dir = workspace();
    let d = dir.path();
    std::os::unix::fs::symlink("m.st", d.join("link-to-m.st")).unwrap();
    std::os::unix::fs::symlink("c.st", d.join("link-to-c.st")).unwrap();
    std::fs::hard_link(d.join("c.st"), d.join("hard-c.st")).unwrap();
    let cases: &[&[&str]] = &[
        &["--load-hf", "m.st", "--save", "link-to-m.st"],
        &["--resume", "c.st", "--save-hf", "c.st"],
        &["--resume", "hard-c.st", "--save-hf", "c.st"],
        &["--data", "corpus.txt", "--save", "corpus.txt"],
        &["--data", "corpus.txt", "--save-hf", "./corpus.txt"],
        &["--trace", ".", "--data", "tide.svg"],
    ];
    std::fs::write(d.join("tide.svg"), "<svg/>").unwrap();
    for args in cases {
        refused(d, args, "one file");
    }
    let outputs: &[&[&str]] = &[
        &["--save", "c.st", "--save-hf", "link-to-c.st"],
        &["--save", "a.st", "--save-hf", "a.st"],
        &["--save", "x.st", "--save-hf", "./x.st"],
        &["--trace", ".", "--save", "gpt_train.json"],
    ];
    for args in outputs {
        refused(d, args, "both write");
    }
    // a checkpoint saved over the one it resumed is the one case allowed
    ok(d, &["--resume", "c.st", "--save", "c.st"]);
    ok(d, &["--resume", "hard-c.st", "--save", "c.st"]);
}

/// Outputs that cannot be written (a device, a fifo, a directory, a link loop, a dangling link
/// into no directory, a rank's file that is a directory) and inputs that would hang (fifos)
/// are refused before any work.
#[test]
fn outputs_that_cannot_be_written_and_inputs_that_hang_are_refused_first() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let fifo = d.join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    std::os::unix::fs::symlink("/dev/null", d.join("null-link")).unwrap();
    std::os::unix::fs::symlink("loop-b", d.join("loop-a")).unwrap();
    std::os::unix::fs::symlink("loop-a", d.join("loop-b")).unwrap();
    std::os::unix::fs::symlink("no-dir/x.st", d.join("dangling")).unwrap();
    std::fs::create_dir_all(d.join("ck/rank1.safetensors")).unwrap();
    refused(d, &["--save", "/dev/null"], "a device");
    refused(d, &["--save-hf", "/dev/null"], "a device");
    refused(d, &["--save", "null-link"], "a device");
    refused(d, &["--save", "fifo"], "a fifo");
    refused(d, &["--save", "loop-a"], "a loop of symbolic links");
    refused(d, &["--save", "dangling"], "no-dir");
    refused(d, &["--ranks", "2", "--save", "ck"], "a directory");
    refused(d, &["--data", "fifo"], "a fifo");
    refused(d, &["--tokenizer", "fifo", "--data", "fifo"], "a fifo");
    std::fs::write(d.join("m.st"), b"x").unwrap();
    std::fs::remove_file(&fifo).unwrap();
    assert!(Command::new("mkfifo")
        .arg(d.join("config.json"))
        .status()
        .unwrap()
        .success());
    refused(d, &["--load-hf", "m.st"], "a fifo");
}

/// A checkpoint's header is checked whole (a step count edited, its checksums deleted); one
/// without checksums loads only when the user asks for a legacy load.
#[test]
fn a_checkpoint_without_checksums_loads_only_when_asked() {
    let dir = workspace();
    let d = dir.path();
    let bytes = std::fs::read(d.join("c.st")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    // the step count one higher, the header's length kept
    let edited = header.replace("\"adam.steps\":\"2\"", "\"adam.steps\":\"3\"");
    assert_ne!(edited, header);
    let with = |h: &str| [&bytes[..8], h.as_bytes(), &bytes[8 + n..]].concat();
    std::fs::write(d.join("edited.st"), with(&edited)).unwrap();
    refused(d, &["--resume", "edited.st"], "does not match its checksum");
    // every checksum key renamed away (the same length)
    let unsummed = header.replace("\"crc32/", "\"xxxxx/");
    std::fs::write(d.join("unsummed.st"), with(&unsummed)).unwrap();
    refused(d, &["--resume", "unsummed.st"], "TIDEMEM_LEGACY_LOAD=1");
    let out = run_with(
        d,
        &["--resume", "unsummed.st"],
        &[("TIDEMEM_LEGACY_LOAD", "1")],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Settings a checkpoint's tensors do not show are in it and checked: a checkpoint of 2 heads
/// resumed with 4 (same shapes) is refused, naming both; an import's shape is never
/// contradicted silently (a flag or its `config.json`), and `--load-hf` with `--resume` is
/// refused.
#[test]
fn another_model_with_the_same_tensors_is_refused() {
    let dir = workspace();
    let d = dir.path();
    // the small model with 4 heads in place of 2
    refused(
        d,
        &["--resume", "c.st", "--heads", "4"],
        "model.gpt.heads is 2, this run's is 4",
    );
    refused(d, &["--load-hf", "m.st", "--layers", "3"], "--layers 3");
    refused(
        d,
        &["--load-hf", "m.st", "--resume", "c.st"],
        "--load-hf with --resume",
    );
    for (config, want) in [
        (r#"{"n_head": 2, "n_layer": 5}"#, "n_layer is 5"),
        (r#"{"n_head": 2, "n_embd": 64}"#, "n_embd is 64"),
        (
            r#"{"n_head": "4"}"#,
            "n_head is \"4\", not a positive whole number",
        ),
        (r#"{"n_head": -4}"#, "n_head is -4"),
        (r#"{"n_head": 0}"#, "n_head is 0"),
    ] {
        std::fs::write(d.join("config.json"), config).unwrap();
        let out = run(d, &["--load-hf", "m.st"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{config}: {err}");
        assert!(err.contains(want), "{config}: {err}");
    }
}

/// The checkpoint is written before validation and sampling, so that nothing after the
/// training can lose it; a sample count no host holds is refused before any step.
#[test]
fn the_save_comes_before_anything_that_can_fail_after_training() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    refused(
        d,
        &["--sample", "18446744073709551615", "--save", "s.st"],
        "--sample",
    );
    assert!(!d.join("s.st").exists());
}

/// A run whose loss becomes NaN ends with an error naming the step, on one rank and on many.
#[test]
fn a_diverging_run_fails_at_its_step() {
    let dir = tempfile::tempdir().unwrap();
    for ranks in [&[][..], &["--ranks", "2", "--tp", "1d:2"]] {
        let args = [&["--lr", "1e30", "--steps", "5"][..], ranks].concat();
        refused(dir.path(), &args, "the loss of step 2 of this run = NaN");
    }
}

/// `gpt_train args` in `dir` under `ulimit <limit>` (a shell sets it, then becomes the
/// trainer): its exit code and what it said.
fn under_ulimit(dir: &Path, limit: &str, args: &str) -> (Option<i32>, String) {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit {limit} && exec '{}' {args}",
            binary().display()
        ))
        .current_dir(dir)
        .env("TIDEMEM_BACKEND", "sim")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code(), err)
}

/// A save past the file-size limit (`ulimit -f`) is an error naming the file, not SIGXFSZ,
/// and leaves no temporary file.
#[test]
fn a_save_past_the_file_size_limit_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = under_ulimit(
        dir.path(),
        "-f 100",
        "--layers 2 --channels 32 --heads 2 --seq 16 --steps 1 --sample 0 --save big.st",
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("big.st") && err.contains("File too large"),
        "{err}"
    );
    assert_eq!(contents(dir.path()), [], "nothing left behind");
}

/// Several ranks: a ZeRO checkpoint resumed with another model is refused as one rank's is,
/// and a tensor-parallel checkpoint resumed as ZeRO says what it is.
#[test]
fn ranks_refuse_another_model_and_another_layout() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    ok(d, &["--ranks", "2", "--save", "zero"]);
    refused(
        d,
        &["--ranks", "2", "--resume", "zero", "--heads", "4"],
        "model.gpt.heads is 2, this run's is 4",
    );
    ok(d, &["--ranks", "2", "--tp", "1d:2", "--save", "tp"]);
    refused(
        d,
        &["--ranks", "2", "--resume", "tp"],
        "a model-parallel rank's file",
    );
}

/// Under an address-space limit (`ulimit -v`), a model past it is refused before any work,
/// naming what it needs, instead of aborting on an allocation failure midway.
#[test]
fn a_model_past_the_address_space_limit_is_refused_before_work() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = under_ulimit(
        dir.path(),
        "-v 2000000",
        "--model gpt2-xl --steps 1 --sample 0",
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("host memory of a gpt2-xl run") && err.contains("limit of 2048000000"),
        "{err}"
    );
}
