//! The trainers launched as one process a rank, the ranks meeting through NCCL (a GPU, or the
//! CUDA emulator with its NCCL stand-in in CI), against the same job's in-process ranks: at 2
//! processes the losses and every saved tensor are bitwise the in-process run's.
//!
//! A launched rank runs on the CUDA device of its `LOCAL_RANK`; the in-process reference runs
//! on simulated devices, whose arithmetic the CUDA kernels match bit for bit. Needs the example
//! binaries (built first in CI) and NCCL that can run (skipped otherwise, a failure under
//! `TIDEMEM_REQUIRE_EXAMPLES=1` or `TIDEMEM_REQUIRE_NCCL=1`).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

/// Longest a launched job may run.
const LIMIT: Duration = Duration::from_secs(300);

/// The example and that NCCL can run, or `None` (skipped, having said why).
fn ready(test: &str, example: &str) -> Option<std::path::PathBuf> {
    let bin = common::example_or_skip(test, example)?;
    common::nccl_ranks(test, 2).then_some(bin)
}

/// The in-process run of `bin` with `args`: its standard output.
fn in_process(bin: &Path, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The tensor bytes of a safetensors file (everything after its header, which holds the
/// save's own id and checksums of it).
fn tensor_bytes(p: &Path) -> Vec<u8> {
    let b = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    b[8 + n..].to_vec()
}

#[test]
fn zero_train_on_two_processes_is_bitwise_its_in_process_run() {
    const TEST: &str = "zero_train_on_two_processes_is_bitwise_its_in_process_run";
    let Some(bin) = ready(TEST, "zero_train") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (inproc, launched) = (dir.path().join("in"), dir.path().join("launched"));
    let args = ["--steps", "2", "--layers", "6", "--json"];
    let reference: Vec<Value> = serde_json::from_str(&in_process(
        &bin,
        &[
            &args[..],
            &["--ranks", "2", "--save", inproc.to_str().unwrap()],
        ]
        .concat(),
    ))
    .unwrap();
    let outs = common::launch_ranks(TEST, 2, LIMIT, |_| {
        let mut c = Command::new(&bin);
        c.args(args).args(["--save", launched.to_str().unwrap()]);
        c
    });
    for (r, out) in outs.iter().enumerate() {
        // each process prints its own rank
        let mine: Vec<Value> = serde_json::from_str(out).unwrap();
        assert_eq!(mine.len(), 1);
        let (got, want) = (&mine[0], &reference[r]);
        assert_eq!(
            (&got["rank"], &got["backend"]),
            (&want["rank"], &"nccl".into())
        );
        assert_eq!(got["losses"], want["losses"], "rank {r}");
        for k in ["all_gather_bytes_per_step", "reduce_scatter_bytes_per_step"] {
            assert_eq!(got[k], want[k], "rank {r}: {k}");
        }
        let file = format!("rank{r}.safetensors");
        assert!(
            tensor_bytes(&launched.join(&file)) == tensor_bytes(&inproc.join(&file)),
            "rank {r}'s saved shard differs from the in-process run's"
        );
    }
}

#[test]
fn gpt_train_on_two_processes_is_bitwise_its_in_process_run() {
    const TEST: &str = "gpt_train_on_two_processes_is_bitwise_its_in_process_run";
    let Some(bin) = ready(TEST, "gpt_train") else {
        return;
    };
    let args = [
        "--model",
        "gpt2-tiny",
        "--sample",
        "0",
        "--seq",
        "16",
        "--batch",
        "2",
        "--steps",
        "2",
        "--json",
    ];
    let reference: Value =
        serde_json::from_str(&in_process(&bin, &[&args[..], &["--ranks", "2"]].concat())).unwrap();
    let outs = common::launch_ranks(TEST, 2, LIMIT, |_| {
        let mut c = Command::new(&bin);
        c.args(args);
        c
    });
    // rank 0 reports for the job, the other rank prints nothing
    assert_eq!(outs[1].trim(), "");
    let got: Value = serde_json::from_str(&outs[0]).unwrap();
    assert_eq!(got["ranks"], 2);
    let losses = got["losses"].as_array().unwrap();
    assert_eq!(losses.len(), 2);
    assert_eq!(got["losses"], reference["losses"]);
    assert_eq!(
        got["device_capacity_bytes"],
        reference["device_capacity_bytes"]
    );
}
