//! Checkpoints of every layout that saves one file a rank (`--pp`, PipeDream-2BW, `--tp`
//! 1d/2d/2.5d/3d, `--sp`, tensor parallelism with ZeRO beside it) survive a kill at any point
//! of the save, and files of different saves or runs never load together.
//!
//! Real processes: the `gpt_train` example that `cargo test` builds
//! (`target/<profile>/examples/gpt_train`), ended by the crate's failpoints inside the save
//! protocol, or by SIGKILL at random moments. What a set loads is told by the loss of one
//! step after it: a resumed run trains, bit for bit, as the uninterrupted run did (the batch
//! of a step is indexed by the optimizer's step count), so the loss names the step loaded.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The exit code of a process ended by a failpoint.
const FAILPOINT_EXIT: i32 = 86;

/// A small GPT every layout below splits (heads, batch and vocabulary divide by the grids).
const MODEL: &[&str] = &[
    "--layers",
    "2",
    "--channels",
    "32",
    "--heads",
    "2",
    "--seq",
    "16",
    "--batch",
    "4",
    "--sample",
    "0",
    "--json",
];

/// Every layout that saves a directory of one file a rank: its flags, its world size and the
/// store its ranks save (`ranks`: a manager a rank; `zero`: ZeRO shards, over data × sequence).
const LAYOUTS: &[(&str, &[&str], usize, &str)] = &[
    ("pp", &["--ranks", "2", "--pp", "2"], 2, "ranks"),
    (
        "2bw",
        &[
            "--ranks",
            "2",
            "--pp",
            "2",
            "--schedule",
            "2bw",
            "--micro-batches",
            "2",
        ],
        2,
        "ranks",
    ),
    ("tp-1d", &["--ranks", "2", "--tp", "1d:2"], 2, "ranks"),
    ("tp-2d", &["--ranks", "4", "--tp", "2d:2"], 4, "ranks"),
    ("tp-2.5d", &["--ranks", "8", "--tp", "2.5d:2x2"], 8, "ranks"),
    ("tp-3d", &["--ranks", "8", "--tp", "3d:2"], 8, "ranks"),
    ("sp", &["--ranks", "2", "--sp", "2"], 2, "zero"),
    ("tp-1d-zero", &["--ranks", "4", "--tp", "1d:2"], 4, "zero"),
];

fn binary() -> PathBuf {
    common::example_binary("gpt_train")
}

/// `gpt_train` with `layout`, the small model and `args`, ended at `failpoint` if given.
fn gpt_train(layout: &[&str], args: &[&str], failpoint: Option<&str>) -> Command {
    let mut cmd = Command::new(binary());
    cmd.args(MODEL)
        .args(layout)
        .args(args)
        .env("TIDEMEM_BACKEND", "sim")
        .env_remove("TIDEMEM_FAILPOINT")
        .env_remove("TIDEMEM_LEGACY_LOAD")
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(p) = failpoint {
        cmd.env("TIDEMEM_FAILPOINT", p);
    }
    cmd
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs and succeeds: the losses of its steps, as their bits.
fn losses(layout: &[&str], args: &[&str]) -> Vec<u32> {
    let out = gpt_train(layout, args, None).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", text(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l.as_f64().unwrap() as f32).to_bits())
        .collect()
}

/// Runs and is refused (exit 1): what it said.
fn refused(layout: &[&str], args: &[&str]) -> String {
    let out = gpt_train(layout, args, None).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
    text(&out)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Copies the files of checkpoint directory `from` into a new directory.
fn copy_set(from: &Path) -> tempfile::TempDir {
    let to = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.path().join(e.file_name())).unwrap();
    }
    to
}

/// The step the set in `dir` holds: one step resumed from it gives the loss of that step + 1
/// of the uninterrupted run, bit for bit (`reference[k]` is the loss of step k + 1).
fn step_held(layout: &[&str], dir: &Path, reference: &[u32], what: &str) -> usize {
    let scratch = tempfile::tempdir().unwrap();
    let got = losses(
        layout,
        &[
            "--steps",
            "1",
            "--resume",
            s(dir),
            "--save",
            s(scratch.path()),
        ],
    );
    reference
        .iter()
        .position(|&l| l == got[0])
        .unwrap_or_else(|| panic!("{what}: the loss after resuming is no step's: {got:?}"))
}

/// A process killed at any point of the save (after its file is written, after it kept the
/// earlier save, after its rename, after every rank renamed, after the clean-up: every point on
/// the pipeline, one of each outcome on the other layouts) leaves a set that loads the earlier
/// save or the new one, never a mix: the earlier one until a rank renamed its new file in, the
/// new one once the ranks agreed that all did.
#[test]
fn a_save_of_every_layout_killed_at_any_point_leaves_a_loadable_set() {
    std::thread::scope(|scope| {
        for &(name, layout, world, holds) in LAYOUTS {
            scope.spawn(move || killed_at_every_point(name, layout, world, holds));
        }
    });
}

fn killed_at_every_point(name: &str, layout: &[&str], world: usize, holds: &str) {
    let scratch = tempfile::tempdir().unwrap();
    // with --save, as below: PipeDream-2BW saves a step at a time
    let reference = losses(layout, &["--steps", "3", "--save", s(scratch.path())]);
    let base = tempfile::tempdir().unwrap();
    losses(layout, &["--steps", "1", "--save", s(base.path())]);
    assert_eq!(
        step_held(layout, base.path(), &reference, name),
        1,
        "{name}"
    );
    let last = world - 1;
    // every point on the first layout; on the others one point of each outcome (the earlier
    // save, either, the new one): the protocol is one, its every point on ZeRO in
    // `checkpoint_safety`
    let points: &[(&str, usize)] = if name == LAYOUTS[0].0 {
        &[
            ("written", 0),
            ("kept", 0),
            ("renamed", 0),
            ("renamed", 1),
            ("agreed", 0),
            ("agreed", 1),
            ("cleaned", 0),
        ]
    } else {
        &[("written", last), ("renamed", 0), ("agreed", last)]
    };
    for &(stage, rank) in points {
        let point = format!("{holds}.save.{stage}.rank{rank}");
        let dir = copy_set(base.path());
        let d = s(dir.path());
        let out = gpt_train(
            layout,
            &["--steps", "1", "--resume", d, "--save", d],
            Some(&point),
        )
        .output()
        .unwrap();
        assert_eq!(
            out.status.code(),
            Some(FAILPOINT_EXIT),
            "{name} {point}: the process did not stop there: {}",
            text(&out)
        );
        let step = step_held(layout, dir.path(), &reference, &format!("{name} {point}"));
        match stage {
            "written" | "kept" => assert_eq!(step, 1, "{name} {point}"),
            "renamed" => assert!(step == 1 || step == 2, "{name} {point}: step {step}"),
            _ => assert_eq!(step, 2, "{name} {point}"),
        }
    }
}

/// Files of two saves of one run, or of two runs at one step, put together in one directory
/// are refused on every layout, naming the save a rank lacks; a rank's file in another
/// rank's place too.
#[test]
fn files_of_different_saves_or_runs_never_load_together() {
    std::thread::scope(|scope| {
        for &(name, layout, world, _) in LAYOUTS {
            scope.spawn(move || mixes_are_refused(name, layout, world));
        }
    });
}

fn mixes_are_refused(name: &str, layout: &[&str], world: usize) {
    let (one, two, other) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    losses(layout, &["--steps", "1", "--save", s(one.path())]);
    losses(
        layout,
        &[
            "--steps",
            "1",
            "--resume",
            s(one.path()),
            "--save",
            s(two.path()),
        ],
    );
    losses(
        layout,
        &["--steps", "1", "--seed", "2", "--save", s(other.path())],
    );
    let file = |d: &Path, r: usize| d.join(format!("rank{r}.safetensors"));
    // rank 0 at step 2, the others at step 1; rank 1 of another run
    for (from, what) in [(&two, "another save"), (&other, "another run")] {
        let mixed = copy_set(one.path());
        std::fs::copy(file(from.path(), world - 1), file(mixed.path(), world - 1)).unwrap();
        let said = refused(layout, &["--steps", "1", "--resume", s(mixed.path())]);
        assert!(
            said.contains("different saves or runs"),
            "{name}, {what}: {said}"
        );
    }
    let swapped = copy_set(one.path());
    std::fs::copy(file(one.path(), 0), file(swapped.path(), 1)).unwrap();
    std::fs::copy(file(one.path(), 1), file(swapped.path(), 0)).unwrap();
    let said = refused(layout, &["--steps", "1", "--resume", s(swapped.path())]);
    assert!(said.contains("saved by rank"), "{name}, swapped: {said}");
}

/// SIGKILL at random moments of processes that resume, train and save in a loop, each
/// resuming what the kill before left: every set left loads a step of the uninterrupted run,
/// and the steps never go back. Moments are drawn over the time an uninterrupted process
/// takes; the test asserts that kills landed.
#[test]
fn pipeline_and_tensor_saves_killed_at_random_moments_load() {
    for &(name, layout, _, _) in [&LAYOUTS[0], &LAYOUTS[2]] {
        let scratch = tempfile::tempdir().unwrap();
        let rounds = 6;
        let reference = losses(layout, &["--steps", "16", "--save", s(scratch.path())]);
        let dir = tempfile::tempdir().unwrap();
        let d = s(dir.path());
        losses(layout, &["--steps", "1", "--save", d]);
        let t = Instant::now();
        losses(layout, &["--steps", "2", "--resume", d, "--save", d]);
        let span = t.elapsed().max(Duration::from_millis(20));
        let mut now = step_held(layout, dir.path(), &reference, name);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut killed = 0;
        for round in 0..rounds {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let at = span.mul_f64((seed >> 11) as f64 / (1u64 << 53) as f64);
            let mut child = gpt_train(layout, &["--steps", "2", "--resume", d, "--save", d], None)
                .spawn()
                .unwrap();
            std::thread::sleep(at);
            if child.try_wait().unwrap().is_none() {
                child.kill().unwrap();
                killed += 1;
            }
            child.wait().unwrap();
            let step = step_held(
                layout,
                dir.path(),
                &reference,
                &format!("{name} round {round}"),
            );
            assert!(step >= now, "{name} round {round}: step {now} then {step}");
            now = step;
        }
        assert!(
            killed > 0,
            "{name}: no process was killed in {rounds} rounds"
        );
    }
}
