//! `gpt_train` as a user meets it: bad flags, sizes, data and paths are refused before the
//! first step (exit 1, a message naming the flag), and what used to fail at the end of a run
//! fails at its start. Runs the example binary that `cargo test` builds
//! (`target/<profile>/examples/gpt_train`); skips with a note when it is absent (a filtered
//! `cargo test --test gpt_train_cli` builds no examples).

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn binary() -> Option<PathBuf> {
    common::example_or_skip("gpt_train_cli", "gpt_train")
}

fn run(args: &[&str], dir: &std::path::Path) -> Option<Output> {
    let bin = binary()?;
    Some(
        Command::new(bin)
            .args(args)
            .current_dir(dir)
            .env("TIDEMEM_BACKEND", "sim")
            .output()
            .expect("gpt_train starts"),
    )
}

/// `args` fail fast (well before a step of training could end) with a message holding `want`.
fn refused(args: &[&str], want: &str) {
    let dir = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let Some(out) = run(args, dir.path()) else {
        return;
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert!(err.contains(want), "{args:?}: {err:?} lacks {want:?}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "{args:?} took {:?} to be refused",
        t.elapsed()
    );
}

#[test]
fn numbers_that_make_no_sense_are_refused() {
    refused(&["--clip", "nan"], "--clip NaN");
    refused(&["--clip=-1"], "--clip -1");
    refused(&["--lr", "inf"], "--lr inf");
    refused(&["--weight-decay", "nan"], "--weight-decay");
    refused(&["--pp", "2"], "give --ranks");
    refused(&["--sp", "2"], "give --ranks");
    refused(&["--batch", "0"], "each at least 1");
    refused(&["--overlap-budget", "lots"], "--overlap-budget lots");
    refused(
        &["--rates", "fast"],
        "--rates fast: memory or one of h100-pcie5",
    );
}

#[test]
fn sizes_beyond_the_machine_are_refused_before_allocating() {
    refused(&["--batch", "100000000"], "a micro-batch's logits");
    refused(&["--batch", "4294967297", "--seq", "1"], "logits");
    refused(&["--accumulate", "4294967295"], "a step's tokens");
    refused(&["--ranks", "100000"], "in-process ranks");
    refused(&["--ranks", "10000000"], "in-process ranks");
}

#[test]
fn data_that_would_fail_at_the_end_fails_at_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny.txt");
    std::fs::write(&tiny, "a corpus far too short for its held-out part").unwrap();
    let tiny = tiny.to_str().unwrap();
    refused(
        &["--data", tiny, "--seq", "16"],
        "held-out part of the corpus has",
    );
    refused(&["--vocab", "1024", "--sample", "200"], "--sample 200");
    refused(
        &["--tokenizer", "tokenizer.json"],
        "--tokenizer needs --data",
    );
}

#[test]
fn outputs_are_checked_before_the_first_step() {
    refused(&["--save", "/nonexistent-dir/c.st"], "--save");
    refused(&["--save-hf", "/nonexistent-dir/m.st"], "--save-hf");
    refused(&["--trace", "/proc/no-such-dir"], "--trace");
    refused(&["--save", "a.st", "--save-hf", "a.st"], "both write");
    refused(&["--save", "a.st", "--save-hf", "./a.st"], "both write");
}

#[test]
fn a_sharded_checkpoint_resumed_on_one_rank_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    std::fs::create_dir(&ck).unwrap();
    for r in 0..2 {
        std::fs::write(ck.join(format!("rank{r}.safetensors")), b"x").unwrap();
    }
    refused(
        &["--resume", ck.to_str().unwrap()],
        "resume it with --ranks 2",
    );
}

#[test]
fn an_import_without_heads_reads_config_json_or_asks() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("model.safetensors");
    std::fs::write(&f, b"x").unwrap();
    refused(&["--load-hf", f.to_str().unwrap()], "give --heads");
}

#[test]
fn a_run_of_no_steps_on_ranks_saves_and_ends_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let Some(out) = run(
        &[
            "--ranks", "2", "--steps", "0", "--sample", "0", "--layers", "1", "--save", "ck",
        ],
        dir.path(),
    ) else {
        return;
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    for r in 0..2 {
        assert!(dir.path().join(format!("ck/rank{r}.safetensors")).is_file());
    }
}

/// `--adam auto` places by the time model: with a server's host (its overlapped step hides
/// under backward) one group fewer on the device than PatrickStar's rule and one host group
/// stepped after backward, as the plan in the report says, with the rule's losses.
#[test]
fn adam_auto_places_the_groups_by_the_time_model() {
    let dir = tempfile::tempdir().unwrap();
    let report = |rates: &str| -> Option<serde_json::Value> {
        let args = [
            "--layers",
            "3",
            "--channels",
            "64",
            "--heads",
            "2",
            "--seq",
            "32",
            "--steps",
            "2",
            "--device-mem",
            "8MiB",
            "--json",
            "--rates",
            rates,
        ];
        let out = run(&args, dir.path())?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {err}");
        Some(serde_json::from_slice(&out.stdout).expect("one JSON report"))
    };
    let Some(timed) = report("h100-server") else {
        return;
    };
    let rule = report("memory").unwrap();
    let plan = &timed["adam_plan"];
    let n = |v: &serde_json::Value| v.as_u64().unwrap();
    assert!(rule["adam_plan"].is_null(), "{}", rule["adam_plan"]);
    assert_eq!(plan["memory_groups"], rule["adam_device_groups"], "{plan}");
    assert_eq!(
        n(&plan["device_groups"]) + 1,
        n(&plan["memory_groups"]),
        "{plan}"
    );
    assert_eq!(plan["device_groups"], timed["adam_device_groups"]);
    assert_eq!(plan["overlap_tail"], 1, "{plan}");
    assert!(plan["predicted_step_s"].as_f64() < plan["memory_rule_step_s"].as_f64());
    assert_eq!(timed["losses"], rule["losses"], "the same bits");
}

/// `--adam` steps the chunk groups where it says and changes no bit: the same losses on the
/// host, on the device, and by PatrickStar's rule, which puts every group on a roomy device and
/// none on the default device (sized below the model data).
#[test]
fn adam_placement_changes_no_bit() {
    let dir = tempfile::tempdir().unwrap();
    let report = |extra: &[&str]| -> Option<serde_json::Value> {
        // a small model: four runs in debug in a few seconds
        let small = [
            "--layers",
            "2",
            "--channels",
            "32",
            "--heads",
            "2",
            "--seq",
            "16",
        ];
        let mut args = vec!["--steps", "3", "--json"];
        args.extend_from_slice(&small);
        args.extend_from_slice(extra);
        let out = run(&args, dir.path())?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {err}");
        Some(serde_json::from_slice(&out.stdout).expect("one JSON report"))
    };
    let roomy = ["--device-mem", "64MiB"];
    let Some(host) = report(&[&roomy[..], &["--adam", "host"]].concat()) else {
        return;
    };
    let groups = |r: &serde_json::Value| {
        (
            r["adam_device_groups"].as_u64().unwrap(),
            r["adam_host_groups"].as_u64().unwrap(),
        )
    };
    let (_, n) = groups(&host);
    assert!(n > 0 && groups(&host) == (0, n), "{host}");
    let device = report(&[&roomy[..], &["--adam", "device"]].concat()).unwrap();
    let rule = ["--rates", "memory"];
    let auto = report(&[&roomy[..], &rule].concat()).unwrap();
    let sized = report(&rule).unwrap();
    assert_eq!(groups(&device), (n, 0));
    assert_eq!(groups(&auto), (n, 0), "the margin holds every group");
    assert_eq!(groups(&sized), (0, n), "no margin on the sized device");
    for r in [&device, &auto, &sized] {
        assert_eq!(r["losses"], host["losses"], "the same losses");
    }
    // the overlap's host memory: with a loss scaler (f16) a copy of the host groups'
    // optimizer state; in bf16 without a clip nothing can invalidate a step, so none; a clip
    // that binds (the default's, on this model) is not speculated after its first step
    let bytes = |r: &serde_json::Value| r["overlap"]["host_bytes"].as_u64().unwrap();
    let no_clip = [&roomy[..], &["--adam", "host", "--clip", "0"]].concat();
    let scaled = report(&no_clip).unwrap();
    let in_place = report(&[&no_clip[..], &["--dtype", "bf16"]].concat()).unwrap();
    let budget0 = report(&[&no_clip[..], &["--overlap-budget", "0"]].concat()).unwrap();
    assert!(
        bytes(&in_place) == 0 && bytes(&scaled) > 0,
        "in place {} against {} with shadows",
        bytes(&in_place),
        bytes(&scaled)
    );
    for o in [&scaled["overlap"], &in_place["overlap"]] {
        assert!(
            o["started"].as_u64() > Some(0) && o["started"] == o["kept"],
            "{o}"
        );
    }
    assert_eq!(host["overlap"]["redone"], 0, "{}", host["overlap"]);
    assert_eq!(
        budget0["overlap"]["started"], 0,
        "no room for a shadow: no early step"
    );
}

/// An imported checkpoint trains on every plan: a small model exported with `--save-hf`, then
/// loaded with `--load-hf` whole, split over a 1D group of 2 and over a 2×2 grid, gives the
/// same losses (within 1e-4 relative: the shards' sums run in another order).
#[test]
fn an_import_trains_split_over_tensor_parallel_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let small = [
        "--layers",
        "2",
        "--channels",
        "32",
        "--heads",
        "2",
        "--seq",
        "16",
        "--vocab",
        "256",
    ];
    let export = [
        &small[..],
        &[
            "--steps",
            "1",
            "--sample",
            "0",
            "--save-hf",
            "m.safetensors",
        ],
    ];
    let Some(out) = run(&export.concat(), dir.path()) else {
        return;
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let losses = |extra: &[&str]| -> Vec<f64> {
        let mut args = vec![
            "--load-hf",
            "m.safetensors",
            "--heads",
            "2",
            "--seq",
            "16",
            "--vocab",
            "256",
            "--steps",
            "2",
            "--sample",
            "0",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = run(&args, dir.path()).expect("built");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {err}");
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON report");
        let l = r["losses"].as_array().expect("losses").iter();
        l.map(|v| v.as_f64().unwrap()).collect()
    };
    let whole = losses(&[]);
    assert_eq!(whole.len(), 2);
    for split in [
        &["--ranks", "2", "--tp", "1d:2"][..],
        &["--ranks", "4", "--tp", "2d:2"],
    ] {
        let got = losses(split);
        for (a, b) in whole.iter().zip(&got) {
            assert!(
                (a - b).abs() <= 1e-4 * a.abs(),
                "{split:?}: {got:?} vs {whole:?}"
            );
        }
    }
}
