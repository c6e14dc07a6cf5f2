//! Bad input to the public API is a typed error (or an empty answer), never a panic, a hang or a
//! wrapped size.

mod common;

use std::time::Duration;

use tidemem::chunk::{search_chunk_size, ChunkManager, ChunkPlan, ManagerConfig, SizeSearch};

use tidemem::comm::{launch, Communicator, ReduceOp, MAX_LOCAL_RANKS};
use tidemem::device::{CachingAllocator, Device, FileStore, LinkModel, SimConfig};
use tidemem::embedding::{batch_slice, CacheConfig, EmbeddingCache, ShardedEmbedding, Sharding};
use tidemem::models::gpt::GptConfig;
use tidemem::ops::embedding::BagMode;
use tidemem::ops::embedding::EmbeddingOptimizer;
use tidemem::optim::{LossScaler, ScalerConfig};
use tidemem::tensor::ChunkKind;
use tidemem::tensor::Init;
use tidemem::tide::{MoveStats, Policy};
use tidemem::Error;

/// `r` is an error that `kind` accepts.
#[track_caller]
fn typed<T: std::fmt::Debug>(r: tidemem::Result<T>, kind: fn(&Error) -> bool) {
    assert!(matches!(&r, Err(e) if kind(e)), "{r:?}");
}

fn bad_value(e: &Error) -> bool {
    matches!(e, Error::BadValue { .. })
}

fn too_large(e: &Error) -> bool {
    matches!(e, Error::TooLarge { .. })
}

#[test]
fn a_simulated_link_without_bandwidth_is_refused() {
    for rate in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let link = LinkModel {
            h2d_gbps: rate,
            ..LinkModel::pcie4()
        };
        typed(
            Device::sim(SimConfig::with_capacity(1 << 20).link(link)),
            bad_value,
        );
    }
    let slow = LinkModel {
        latency: Duration::MAX,
        ..LinkModel::pcie4()
    };
    typed(
        Device::sim(SimConfig::with_capacity(1 << 20).link(slow)),
        bad_value,
    );
}

#[test]
fn an_endless_timeout_waits_like_any_other() {
    let devs = (0..2).map(|_| common::sim(1 << 20)).collect();
    let comms = Communicator::local_with_timeout(devs, Duration::MAX).unwrap();
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                if c.rank() == 1 {
                    // the other rank waits for this one with no end to its deadline
                    std::thread::sleep(Duration::from_millis(50));
                }
                let mut x = [1.0f32];
                c.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
                assert_eq!(x[0], 2.0);
            });
        }
    });
}

#[test]
fn sizes_that_overflow_are_refused() {
    let dev = common::sim(1 << 20);
    let pool = CachingAllocator::new(dev.clone());
    let (stats, free) = (pool.stats(), dev.mem_info().unwrap().free);
    typed(pool.alloc(usize::MAX), too_large);
    assert_eq!(
        pool.stats(),
        stats,
        "a refused allocation changes no counter"
    );
    assert_eq!(
        dev.mem_info().unwrap().free,
        free,
        "nor takes device memory"
    );
    let mut m =
        ChunkManager::new(common::sim(1 << 20), ManagerConfig::new(64, Policy::Tide)).unwrap();
    typed(m.register("huge", &[1 << 62], Init::Zeros), too_large);
    typed(
        m.register("huge", &[1 << 31, 1 << 31], Init::Zeros),
        too_large,
    );
    // nothing was registered: the next tensor is the first, at the start of the first chunk
    assert_eq!(m.num_tensors(), 0);
    let id = m.register("w", &[8], Init::Zeros).unwrap();
    let (name, shape, slot) = m.tensor_info(id).unwrap();
    assert_eq!(
        (id.0, name, shape, slot.group, slot.offset),
        (0, "w", &[8][..], 0, 0)
    );
    let huge = GptConfig {
        channels: 12 << 30,
        vocab: 1 << 30,
        ..GptConfig::preset("gpt2-small").unwrap()
    };
    // more than 2^40 parameters
    assert!(matches!(
        huge.spec(8, 1024, true),
        Err(Error::TooLarge { limit, .. }) if limit == (1 << 40) - 1
    ));
    let spec = GptConfig::preset("gpt2-small")
        .unwrap()
        .spec(8, 1024, true)
        .unwrap();
    typed(ChunkPlan::new(&spec.numels(), 1 << 20, 0), bad_value);
    typed(ChunkPlan::new(&spec.numels(), 1 << 20, u64::MAX), bad_value);
    typed(
        search_chunk_size(
            &[10, 20],
            SizeSearch {
                start: 1,
                range: usize::MAX,
                interval: 1,
                multiple_of: 1,
            },
        ),
        too_large,
    );
    typed(
        EmbeddingCache::new(
            common::sim(1 << 20),
            CacheConfig::new(10, 1 << 62, 4),
            |_, _| {},
        ),
        |e| matches!(e, Error::Overflow { .. }),
    );
}

#[test]
fn out_of_range_questions_get_empty_answers() {
    let mut m =
        ChunkManager::new(common::sim(1 << 20), ManagerConfig::new(64, Policy::Tide)).unwrap();
    m.register("w", &[8], Init::Zeros).unwrap();
    assert_eq!(m.chunk_state(1 << 30, ChunkKind::Param), None);
    assert_eq!(m.device_buffer_id(1 << 32, ChunkKind::Param), None);
    assert_eq!(batch_slice(10, 0, 0), (0, 0));
    assert_eq!(batch_slice(10, 3, 7), (10, 10));
    assert_eq!(batch_slice(usize::MAX, 2, 1), (usize::MAX / 2, usize::MAX));
    let later = MoveStats {
        loads: 5,
        ..MoveStats::default()
    };
    assert_eq!(MoveStats::default().since(&later), MoveStats::default());
    let c = Communicator::local(vec![common::sim(1 << 20)])
        .unwrap()
        .remove(0);
    let before = c.stats();
    c.all_reduce_host(&mut [1.0f32], ReduceOp::Sum).unwrap();
    assert_eq!(
        before.since(&c.stats()),
        tidemem::comm::CommStats::default()
    );
    assert_eq!(c.stats().since(&before).all_reduce.calls, 1);
}

#[test]
fn a_loss_scaler_cannot_be_restored_to_a_state_it_never_has() {
    let mut s = LossScaler::new(ScalerConfig {
        growth_interval: 4,
        hysteresis: 2,
        ..ScalerConfig::default()
    })
    .unwrap();
    let before = (s.scale(), s.clean_steps(), s.allowance());
    for (scale, clean, allowance) in [
        (f32::NAN, 0, 1),
        (1e30, 0, 1),
        // in range, but no power of two: a scaler of factors 2 and ½ never holds it
        (1124.0, 0, 1),
        (1.0, 4, 1),
        (1.0, 0, 0),
        (1.0, 0, 3),
    ] {
        let r = s.restore(scale, clean, allowance);
        if scale == 1.0 {
            // a count the scaler's settings cannot reach
            typed(r, |e| matches!(e, Error::Conflict { .. }));
        } else {
            typed(r, bad_value);
        }
    }
    assert_eq!((s.scale(), s.clean_steps(), s.allowance()), before);
    s.restore(512.0, 3, 2).unwrap();
    s.update(false);
    assert_eq!(s.scale(), 1024.0);
}

#[test]
fn sharded_tables_need_tables() {
    let comm = Communicator::local(vec![common::sim(1 << 20)])
        .unwrap()
        .remove(0);
    typed(
        ShardedEmbedding::new(
            comm,
            Sharding::TableWise,
            &[],
            4,
            8,
            BagMode::Sum,
            EmbeddingOptimizer::Sgd { lr: 0.1 },
            |_, _, _| {},
        ),
        |e| matches!(e, Error::Empty { .. }),
    );
}

/// A checkpoint of one tensor `w` of `n` f32 elements whose data is a hole (the file is
/// sparse: it takes no disk space), with the metadata of a real checkpoint of this crate.
fn sparse_checkpoint(
    path: &std::path::Path,
    n: usize,
    metadata: &std::collections::BTreeMap<String, String>,
) {
    use std::io::Write;
    let bytes = 4 * n as u64;
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!(metadata));
    for (i, list) in ["param", "master", "momentum", "variance"]
        .iter()
        .enumerate()
    {
        header.insert(
            format!("{list}/w"),
            serde_json::json!({
                "dtype": "F32",
                "shape": [n],
                "data_offsets": [i as u64 * bytes, (i as u64 + 1) * bytes],
            }),
        );
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&json).unwrap();
    f.set_len(8 + json.len() as u64 + 4 * bytes).unwrap();
}

#[test]
fn a_full_file_tier_is_a_typed_error_not_a_signal() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::new(dir.path()).unwrap();
    let Some(free) = store.available_bytes() else {
        println!("skipped: the temporary directory's filesystem reports no free space");
        return;
    };
    // More than the disk holds: a typed error naming the bytes and the directory, not a
    // sparse file that would fault (SIGBUS) when first touched.
    let too_many = usize::try_from(free.saturating_mul(2).saturating_add(1 << 20)).unwrap();
    match store.alloc(too_many) {
        Err(Error::FileTierFull {
            requested, dir: d, ..
        }) => {
            assert_eq!((requested, d.as_path()), (too_many, dir.path()))
        }
        other => panic!("{too_many} bytes with {free} free: {other:?}"),
    }
    assert!(matches!(
        store.alloc(1 << 50),
        Err(Error::FileTierFull { .. })
    ));

    // The resume path: a checkpoint loaded into a manager whose chunks live on the file tier.
    // Its parameter chunk needs twice the free space (plus a MiB).
    let n = usize::try_from(free / 2 + (1 << 18)).unwrap();
    if 16 * n as u64 > 4 << 40 {
        println!("skipped the resume part: {free} bytes free is too much to outgrow");
        return;
    }
    let cfg = |chunk_elems| {
        let mut c = ManagerConfig::new(chunk_elems, Policy::Tide);
        c.param_dtype = tidemem::DType::F32;
        c.host_budget = Some(0);
        c.file_dir = Some(dir.path().join("spill"));
        c
    };
    let mut small = ChunkManager::new(common::sim(1 << 20), cfg(4)).unwrap();
    small.register("w", &[4], Init::Zeros).unwrap();
    let ckpt = dir.path().join("small.safetensors");
    small.save_checkpoint(&ckpt, &Default::default()).unwrap();
    let bytes = std::fs::read(&ckpt).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    // without the small file's checksums (the big file's data is a hole: a load would read
    // all of it to check them before allocating anything)
    let meta = meta.metadata().clone().unwrap_or_default();
    let meta: std::collections::HashMap<String, String> = meta
        .into_iter()
        .filter(|(k, _)| !k.starts_with("crc32/"))
        .collect();
    let big = dir.path().join("big.safetensors");
    sparse_checkpoint(&big, n, &meta.into_iter().collect());

    let mut m = ChunkManager::new(common::sim(1 << 20), cfg(n)).unwrap();
    m.register("w", &[n], Init::Zeros).unwrap();
    // a file without checksums loads only when asked for (no other test of this binary loads
    // a checkpoint, and the examples its tests run load none)
    std::env::set_var("TIDEMEM_LEGACY_LOAD", "1");
    match m.load_checkpoint(&big) {
        Err(Error::FileTierFull {
            requested, dir: d, ..
        }) => assert_eq!((requested, d), (4 * n, dir.path().join("spill"))),
        other => panic!("a chunk of {} bytes with {free} free: {other:?}", 4 * n),
    }
}

#[test]
fn more_in_process_ranks_than_the_cap_are_refused_before_any_device() {
    if std::env::var_os("WORLD_SIZE").is_some() {
        return; // launched as an NCCL rank: launch does not start in-process ranks
    }
    let made = std::sync::atomic::AtomicUsize::new(0);
    for world in [MAX_LOCAL_RANKS + 1, 100_000, 10_000_000, usize::MAX] {
        let t0 = std::time::Instant::now();
        let r = launch(
            world,
            |_| {
                made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(common::sim(1 << 20))
            },
            Duration::from_secs(60),
            |c| Ok(c.rank()),
        );
        match r {
            Err(Error::TooLarge {
                requested, limit, ..
            }) => assert_eq!((requested, limit), (world as u128, MAX_LOCAL_RANKS as u64)),
            other => panic!("{world} ranks: {other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
    }
    assert_eq!(made.into_inner(), 0);
    let devices = (0..MAX_LOCAL_RANKS + 1)
        .map(|_| common::sim(1 << 10))
        .collect();
    assert!(matches!(
        Communicator::local(devices),
        Err(Error::TooLarge { .. })
    ));
}

#[test]
fn batch_builders_refuse_sizes_past_host_memory() {
    use tidemem::data::criteo::{Dataset, Synthetic, SyntheticConfig};
    use tidemem::data::text::{Split, TokenData};
    let limit = tidemem::limits::host_limit();
    fn too_large<T>(r: tidemem::Result<T>) {
        let limit = tidemem::limits::host_limit();
        match r {
            Err(Error::TooLarge {
                requested,
                limit: l,
                ..
            }) => assert!(l == limit && requested > u128::from(limit)),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("accepted"),
        }
    }
    let text = TokenData::generated(4096, 2, 0.1).unwrap();
    // `--batch 100000000`, `--batch 4294967297 --seq 1`, `--accumulate 4294967295`: past this
    // machine's memory whatever it is
    let rows = limit as usize / 4 + 1;
    too_large(text.batch(Split::Train, 0, rows, 1));
    too_large(text.batch(Split::Train, 0, usize::MAX, 1024));
    too_large(text.batches(Split::Train, 0..u64::from(u32::MAX), rows / 1024, 1));
    let gen =
        Synthetic::new(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(0.001)).unwrap();
    too_large(gen.try_batch(0, usize::MAX));
    too_large(gen.try_batch(0, rows));
}

#[test]
fn a_gpt_whose_heads_do_not_divide_its_width_is_refused() {
    let c = GptConfig {
        heads: 7,
        ..GptConfig::preset("gpt2-1.5b").unwrap()
    };
    assert!(matches!(
        c.spec(8, 1024, true),
        Err(Error::NotMultiple {
            value: 1600,
            divisor: 7,
            ..
        })
    ));
}

/// The status and stderr of example `name` run with `args`, or `None` (with a note) when the
/// example is not built beside this test (`cargo test` builds the examples; `cargo test --test
/// bad_input` alone does not). Fails the test when the example runs past `timeout`.
fn run_example(name: &str, args: &[&str], timeout: Duration) -> Option<(i32, String)> {
    use std::io::Read;
    let path = common::example_or_skip("bad_input", name)?;
    let mut child = std::process::Command::new(&path)
        .args(args)
        .env_remove("WORLD_SIZE")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if t0.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{name} {args:?} ran past {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    // a signal (SIGBUS, an abort) has no code: report it as such
    Some((status.code().unwrap_or(-1), err))
}

/// Example `name` refuses `args` with status 1 and a message holding every one of `needles`.
fn refused(name: &str, args: &[&str], needles: &[&str]) {
    let Some((code, err)) = run_example(name, args, Duration::from_secs(60)) else {
        return;
    };
    assert_eq!(code, 1, "{name} {args:?}: status {code}, stderr: {err}");
    assert!(!err.contains("panicked"), "{name} {args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{name} {args:?}: '{n}' not in: {err}");
    }
}

#[test]
fn the_toy_trainers_refuse_flags_that_train_nothing() {
    let out = tempfile::tempdir().unwrap();
    let out = out.path().to_str().unwrap();
    for ex in ["zero_train", "tide"] {
        // tide writes its traces to --out: a fresh directory, though a refusal writes nothing
        let with = |args: &[&'static str]| {
            let mut v: Vec<&str> = args.to_vec();
            if ex == "tide" {
                v.extend(["--out", out]);
            }
            v
        };
        refused(ex, &with(&["--batch", "0"]), &["batch"]);
        refused(ex, &with(&["--layers", "0"]), &["layers"]);
        refused(ex, &with(&["--width", "0"]), &["width"]);
        refused(ex, &with(&["--steps", "0"]), &["--steps 0"]);
        refused(ex, &with(&["--device-mem", "0"]), &["--device-mem"]);
        let huge = ["--batch", "18446744073709551615"];
        refused(ex, &with(&huge), &["18446744073709551615"]);
    }
    refused("zero_train", &["--ranks", "0"], &["--ranks 0"]);
    refused("zero_train", &["--ranks", "100000"], &["100000", "1024"]);
    refused("zero_train", &["--ranks", "10000000"], &["10000000"]);
    refused("zero_train", &["--ranks", "3"], &["32", "3"]);
}

#[test]
fn simulate_refuses_shapes_and_fails_when_every_policy_fails() {
    refused(
        "simulate",
        &["--hidden", "1600", "--heads", "7", "--no-largest"],
        &["1600", "7"],
    );
    refused(
        "simulate",
        &[
            "--device-mem",
            "1KiB",
            "--no-largest",
            "--policies",
            "tide,lru",
        ],
        &["every policy failed", "tide:", "lru:", "1024 bytes"],
    );
    refused("simulate", &["--overall-fraction", "nan"], &["NaN"]);
    refused("simulate", &["--budget-fraction=-1"], &["-1"]);
    refused("simulate", &["--device-adam", "inf"], &["inf"]);
    refused("simulate", &["--chunk-elems", "0"], &["--chunk-elems"]);
}

#[test]
fn embedding_cache_refuses_its_bad_flags() {
    let ex = "embedding_cache";
    refused(
        ex,
        &["--batch", "18446744073709551615"],
        &["18446744073709551615"],
    );
    refused(ex, &["--batch", "0"], &["--batch 0"]);
    refused(ex, &["--batches", "0"], &["--batches 0"]);
    for r in [
        "--ratios=0",
        "--ratios=1.5",
        "--ratios=nan",
        "--ratios=inf",
        "--ratios=-0.1",
    ] {
        refused(ex, &[r], &["--ratios"]);
    }
    refused(ex, &["--warmup", "nan"], &["--warmup"]);
    refused(ex, &["--zipf", "inf"], &["zipf"]);
    refused(ex, &["--scale", "0"], &["scale"]);
    refused(ex, &["--drift-shift", "nan"], &["--drift-shift"]);
    refused(ex, &["--count-batches", "0"], &["--count-batches"]);
    refused(ex, &["--dim", "0"], &["--dim"]);
    refused(ex, &["--policies", "lru,bogus"], &["bogus"]);
    // a cache too small for every batch under every policy: no run succeeds
    refused(
        ex,
        &[
            "--scale",
            "0.001",
            "--batch",
            "64",
            "--batches",
            "3",
            "--ratios",
            "0.01",
            "--policies",
            "lru,lfu",
        ],
        &["every run failed", "lru", "lfu"],
    );
}

#[test]
fn embedding_tables_past_host_memory_or_disk_are_refused() {
    use tidemem::embedding::{bincount, CacheIndex, CachePolicy, HostTier};
    let limit = tidemem::limits::host_limit();
    let too_large = |r: Result<(), Error>| {
        assert!(
            matches!(r, Err(Error::TooLarge { limit: l, .. }) if l == limit),
            "{r:?}"
        )
    };
    too_large(bincount(usize::MAX, []).map(|_| ()));
    let rows = (u32::MAX - 1) as usize;
    if rows as u64 * 8 > limit {
        too_large(CacheIndex::new(rows, 1, CachePolicy::Lru).map(|_| ()));
    }
    // a paged table of more than the machine holds
    let rows = 1 << 20;
    let dim = (limit / (4 << 20)) as usize + 1;
    let r = EmbeddingCache::new(
        common::sim(1 << 20),
        CacheConfig::new(rows, dim, 4),
        |_, _| {},
    );
    too_large(r.map(|_| ()));
    // a table on the file tier of more than the disk holds
    let dir = tempfile::tempdir().unwrap();
    let Some(free) = FileStore::new(dir.path()).unwrap().available_bytes() else {
        return;
    };
    let dim = (free / (4 << 20)) as usize + 2;
    let mut cfg = CacheConfig::new(rows, dim, 4);
    cfg.host = HostTier::Mapped(dir.path().to_path_buf());
    let r = EmbeddingCache::new(common::sim(1 << 20), cfg, |_, _| {});
    assert!(
        matches!(&r, Err(Error::FileTierFull { requested, .. }) if *requested == rows * dim * 4),
        "{r:?}"
    );
}

/// Inputs that would block or grow without bound, and flags past their range, are refused
/// with a message naming them: a fifo or `/dev/zero` as the Criteo TSV, a file whose every
/// line is bad (the first bad line and why), `--drift-shift` past 1, 0 threads or a size no
/// host holds for `adam_bench`, one chunk or an unknown flag for `device_tour`.
#[test]
fn inputs_that_block_or_grow_and_flags_out_of_range_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let bad = dir.path().join("bad.tsv");
    std::fs::write(&bad, "x\ty\n1\t2\n").unwrap();
    let tsv = |p: &std::path::Path| p.to_str().unwrap().to_string();
    for (path, want) in [
        (tsv(&fifo), vec!["fifo", "not a regular file"]),
        (
            "/dev/zero".to_string(),
            vec!["/dev/zero", "not a regular file"],
        ),
        (tsv(&bad), vec!["none of the 2 lines", "line 1: 2 columns"]),
    ] {
        let args = ["--dataset", "criteo-tsv", path.as_str(), "--steps", "1"];
        refused("dlrm_train", &args, &want);
    }
    refused(
        "embedding_cache",
        &["--drift-shift", "5"],
        &["--drift-shift"],
    );
    refused("adam_bench", &["--threads", "0"], &["at least 1"]);
    refused("adam_bench", &["--reps", "0"], &["at least 1"]);
    refused(
        "adam_bench",
        &["--sizes", "18446744073709551615"],
        &["--sizes 18446744073709551615"],
    );
    refused("device_tour", &["--chunks", "1"], &["--chunks"]);
    refused(
        "zero_train",
        &["--ranks", "1024", "--layers", "1024", "--batch", "1024"],
        &["the gather buffers of 1024 in-process ranks"],
    );
    refused(
        "simulate",
        &["--chunk-elems", "18446744073709551615"],
        &["--chunk-elems 18446744073709551615", "addressable"],
    );
    if let Some((code, err)) = run_example("device_tour", &["--bogus"], Duration::from_secs(60)) {
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("unexpected argument '--bogus'"), "{err}");
    }
}
