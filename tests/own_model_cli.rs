//! The `own_model` template as a user runs it: the loss falls on a device smaller than what
//! the model needs resident, which evicts and gives a roomy device's losses bit for bit,
//! `--json` reports the bytes moved, and a bad flag prints the error's message
//! (not its `Debug` form) with exit code 1. Runs the example binary that `cargo test` builds
//! (`target/<profile>/examples/own_model`); skips with a note when it is absent.

mod common;

use std::process::{Command, Output};

fn run(args: &[&str]) -> Option<Output> {
    let bin = common::example_or_skip("own_model_cli", "own_model")?;
    Some(
        Command::new(bin)
            .args(args)
            .output()
            .expect("own_model starts"),
    )
}

/// One run's JSON, with `--share share` (the device's share of the chunks). The default
/// width: narrower models sit in so few chunks that their largest moment is all of them (the
/// smallest device that trains holds everything).
fn run_json(share: &str) -> Option<serde_json::Value> {
    let args = [
        "--hidden", "1024", "--steps", "12", "--batch", "32", "--share", share, "--json",
    ];
    let out = run(&args)?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    Some(serde_json::from_slice(&out.stdout).expect("one line of JSON"))
}

#[test]
fn the_template_trains_on_a_device_smaller_than_it_needs_resident() {
    let Some(j) = run_json("0.25") else { return };
    let Some(roomy) = run_json("1.0") else { return };
    let num =
        |j: &serde_json::Value, k: &str| j[k].as_f64().unwrap_or_else(|| panic!("{k} in {j}"));
    assert!(num(&j, "device_bytes") < num(&j, "resident_bytes"), "{j}");
    assert!(
        num(&roomy, "device_bytes") >= num(&roomy, "resident_bytes"),
        "{roomy}"
    );
    assert!(
        num(&j, "evictions") > num(&roomy, "evictions"),
        "the small device evicts: {j} against {roomy}"
    );
    assert_eq!(
        j["losses"], roomy["losses"],
        "a roomy device's losses, bit for bit"
    );
    assert!(num(&j, "last_loss") < 0.8 * num(&j, "first_loss"), "{j}");
    assert!(num(&j, "h2d_bytes_per_step") > 0.0, "{j}");
}

#[test]
fn a_refused_flag_prints_the_message() {
    let Some(out) = run(&["--steps", "0"]) else {
        return;
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("own_model: "), "{err}");
    assert!(
        err.contains("at least 1") && !err.contains("TooFew"),
        "{err}"
    );
}
