//! The `own_model` template as a user runs it: the loss falls on a device smaller than the
//! model's data, `--json` reports the bytes moved, and a bad flag prints the error's message
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

#[test]
fn the_template_trains_on_a_device_smaller_than_its_model_data() {
    let args = ["--hidden", "96", "--steps", "30", "--batch", "32", "--json"];
    let Some(out) = run(&args) else { return };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one line of JSON");
    let num = |k: &str| j[k].as_f64().unwrap_or_else(|| panic!("{k} in {j}"));
    assert!(num("device_bytes") < num("model_data_bytes"), "{j}");
    assert!(num("last_loss") < 0.8 * num("first_loss"), "{j}");
    assert!(num("h2d_bytes_per_step") > 0.0, "{j}");
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
