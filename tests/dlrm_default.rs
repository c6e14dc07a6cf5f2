//! `examples/dlrm_train` as a user runs it: the built binary of this test's profile
//! (`target/<profile>/examples/dlrm_train`, built by `cargo test` or `cargo build --example
//! dlrm_train`; each test is skipped with a note when it is absent).
//!
//! With no flags the example runs its default, the showcase: one pass over synthetic data with
//! 1.5% of the rows cached on the device, ending within 0.01 of the hidden model's AUC. The test
//! of the default pins its settings (`examples/dlrm_train/main.rs`'s `defaults`) to the recipe
//! measured to converge, and is release only (about 20 s there; minutes in debug):
//! `cargo build --release --example dlrm_train && cargo test --release --test dlrm_default`.
//! The others take a second or two: a refused flag exits with status 2 and a message naming
//! it before any work, and `--steps` beyond a TSV file's batches is a warning.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// The example's binary beside this test's (`target/<profile>/deps/..` →
/// `target/<profile>/examples/dlrm_train`), if built.
fn example() -> Option<PathBuf> {
    common::example_or_skip("dlrm_default", "dlrm_train")
}

fn run(bin: &PathBuf, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .output()
        .expect("the example starts")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn number(j: &Value, key: &str) -> f64 {
    j[key]
        .as_f64()
        .unwrap_or_else(|| panic!("`{key}` is not a number in {j}"))
}

#[test]
#[cfg_attr(debug_assertions, ignore = "minutes in debug: release only")]
fn the_default_run_reaches_the_hidden_models_auc() {
    let Some(bin) = example() else { return };
    let out = run(&bin, &["--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let j: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    // the defaults are the recipe measured to converge (seeds 0, 1, 2: gaps 0.0031, 0.0029,
    // 0.0040)
    for (key, want) in [
        ("preset", "tiny"),
        ("dataset", "synthetic"),
        ("emb_opt", "adagrad"),
        ("sharding", "table"),
    ] {
        assert_eq!(j[key], want, "{key}");
    }
    for (key, want) in [
        ("scale", 0.1),
        ("zipf", 1.4),
        ("seed", 0.0),
        ("batch", 1024.0),
        ("steps", 4000.0),
        ("steps_requested", 4000.0),
        ("ranks", 1.0),
        ("cache_ratio", 0.015),
        ("count_batches", 20.0),
        ("warmup", 0.7),
        ("eval_batches", 64.0),
        ("held_out_samples", 65536.0),
        ("max_gap", 0.01),
    ] {
        assert_eq!(number(&j, key), want, "{key}");
    }
    // the learning rates are f32 flags
    assert_eq!(number(&j, "emb_lr") as f32, 0.05, "emb_lr");
    assert_eq!(number(&j, "lr") as f32, 5e-3, "lr");
    assert_eq!(j["full_table"], false);

    // the cached embedding: a device far smaller than the tables, most lookups hits
    let (rows, capacity) = (number(&j, "rows"), number(&j, "capacity"));
    assert_eq!(rows, 3_376_271.0);
    assert!(
        capacity < 0.02 * rows,
        "a cache of {capacity} of {rows} rows"
    );
    let (device, table) = (
        number(&j, "device_bytes_embeddings"),
        number(&j, "full_table_bytes"),
    );
    assert!(
        device < table / 10.0,
        "{device} bytes on the device for a table of {table}"
    );
    let hit = number(&j, "cache_hit_rate");
    assert!(hit > 0.9 && hit < 1.0, "hit rate {hit}");

    let (auc, hidden, gap) = (
        number(&j, "auc"),
        number(&j, "hidden_model_auc"),
        number(&j, "gap"),
    );
    println!(
        "AUC {auc:.4}, hidden model {hidden:.4}, gap {gap:.4}, hit rate {hit:.3}, {:.1} s",
        number(&j, "wall_s")
    );
    assert!((hidden - auc - gap).abs() < 1e-12);
    assert!(
        gap <= 0.01,
        "AUC {auc:.4} is {gap:.4} below the hidden model's {hidden:.4}"
    );
    assert_eq!(j["reached"], true);
    assert!(auc > 0.75, "AUC {auc:.4}");
    let aucs: Vec<f64> = j["history"]
        .as_array()
        .expect("a history")
        .iter()
        .filter_map(|h| h["auc"].as_f64())
        .collect();
    assert_eq!(aucs.len(), 4, "an evaluation every 1,000 steps: {aucs:?}");
    assert!(
        aucs.windows(2).all(|w| w[1] > w[0]),
        "the AUC does not rise: {aucs:?}"
    );
}

#[test]
fn a_short_run_prints_the_auc_the_hidden_models_and_the_gap() {
    let Some(bin) = example() else { return };
    let out = run(
        &bin,
        &[
            "--scale",
            "0.001",
            "--batch",
            "64",
            "--steps",
            "5",
            "--eval-batches",
            "2",
            "--count-batches",
            "2",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "5 steps of 64 samples on 1 rank(s) in ",
        "held-out AUC ",
        "on 128 samples",
        "hidden model's AUC ",
        "): gap ",
        "hit rate ",
    ] {
        assert!(text.contains(want), "no `{want}` in:\n{text}");
    }
    assert!(
        text.contains("reached the hidden model's AUC (gap ≤ 0.01)")
            || text.contains("did not reach the hidden model's AUC (gap > 0.01)"),
        "no verdict in:\n{text}"
    );
}

/// Runs the example with `args`, expects status 2 (a refused flag) and every one of `want` in
/// its message.
fn refused(bin: &PathBuf, args: &[&str], want: &[&str]) {
    let out = run(bin, args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for w in want {
        assert!(err.contains(w), "{args:?}: no `{w}` in: {err}");
    }
}

#[test]
fn a_batch_beyond_the_machines_memory_is_refused_with_the_numbers() {
    let Some(bin) = example() else { return };
    let max = u64::MAX.to_string();
    refused(
        &bin,
        &["--batch", &max],
        &[
            &format!("--batch {max}"),
            "bytes of host memory, more than the",
            "bytes available",
        ],
    );
    for flag in ["--eval-batches", "--count-batches"] {
        refused(
            &bin,
            &[flag, &max],
            &[&format!("{flag} {max}"), "bytes of host memory"],
        );
    }
    refused(
        &bin,
        &["--batch", "1000000000", "--eval-batches", "1"],
        &["--batch 1000000000", "bytes of host memory"],
    );
}

#[test]
fn nan_inf_zero_and_out_of_range_numbers_are_refused() {
    let Some(bin) = example() else { return };
    for (args, want) in [
        (&["--cache-ratio", "2"][..], "--cache-ratio 2: "),
        (&["--cache-ratio", "inf"], "--cache-ratio inf: "),
        (&["--cache-ratio", "nan"], "--cache-ratio NaN: "),
        (&["--cache-ratio", "0"], "--cache-ratio 0: "),
        (&["--cache-ratio=-0.5"], "--cache-ratio -0.5: "),
        (&["--emb-lr", "nan"], "--emb-lr NaN: "),
        (&["--emb-lr", "inf"], "--emb-lr inf: "),
        (&["--emb-lr", "0"], "--emb-lr 0: "),
        (&["--lr", "nan"], "--lr NaN: "),
        (&["--lr=-1"], "--lr -1: "),
        (&["--lr", "1e39"], "--lr inf: "),
        (&["--scale", "0"], "--scale 0: "),
        (&["--scale", "1.5"], "--scale 1.5: "),
        (&["--scale", "nan"], "--scale NaN: "),
        (&["--zipf", "nan"], "--zipf NaN: "),
        (&["--zipf=-1"], "--zipf -1: "),
        (&["--warmup", "1.5"], "--warmup 1.5: "),
        (&["--warmup", "nan"], "--warmup NaN: "),
        (&["--eval-batches", "0"], "--eval-batches 0: "),
        (&["--count-batches", "0"], "--count-batches 0: "),
        (&["--steps", "0"], "--steps 0: "),
        (&["--batch", "0"], "--batch 0: "),
        (&["--ranks", "0"], "--ranks 0: "),
        (&["--steps", "1099511627777"], "--steps 1099511627777: "),
        (
            &["--ranks", "8", "--batch", "4"],
            "--ranks 8 over --batch 4",
        ),
        (
            &["--ranks", "5", "--sharding", "column"],
            "--ranks 5 with --sharding column",
        ),
        (&["--preset", "huge"], "--preset huge"),
        (&["--emb-opt", "lamb"], "--emb-opt lamb"),
        (&["--policy", "fifo"], "--policy fifo"),
        (&["--sharding", "row"], "--sharding row"),
        (&["--backend", "tpu"], "--backend tpu"),
        (&["--ids", "both"], "--ids both"),
        (&["--eval-tsv", "held.tsv"], "--eval-tsv"),
    ] {
        refused(&bin, args, &[want]);
    }
}

#[test]
fn steps_beyond_a_tsv_files_batches_warn() {
    let Some(bin) = example() else { return };
    // 60 lines: 8 held out, then 6 batches of 8 and one of 4
    let mut text = String::new();
    let mut x = 1u64;
    for _ in 0..60 {
        let mut next = || {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            x >> 33
        };
        let mut cols = vec![(next() % 2).to_string()];
        cols.extend((0..13).map(|_| (next() % 50).to_string()));
        cols.extend((0..26).map(|_| format!("{:08x}", next())));
        text.push_str(&cols.join("\t"));
        text.push('\n');
    }
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dlrm_default_short.tsv");
    std::fs::write(&path, text).expect("the TSV file");
    let p = path.to_str().expect("a UTF-8 path");
    let args = [
        "--dataset",
        "criteo-tsv",
        p,
        "--scale",
        "0.001",
        "--batch",
        "8",
        "--eval-batches",
        "1",
        "--steps",
        "100",
        "--json",
    ];
    let out = run(&bin, &args);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: --steps 100 but")
            && err.contains("holds 7 training batches of at most 8 samples"),
        "{err}"
    );
    let j: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(number(&j, "steps"), 7.0);
    assert_eq!(number(&j, "steps_requested"), 100.0);
    assert!(j["gap"].is_null() && j["reached"].is_null());
    // no warning when the file holds the steps asked for
    let args: Vec<&str> = args
        .iter()
        .map(|&s| if s == "100" { "7" } else { s })
        .collect();
    let out = run(&bin, &args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));
}
