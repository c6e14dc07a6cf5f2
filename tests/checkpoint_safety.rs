//! Checkpoints that survive a kill, carry the identity of their save, are checksummed, hold
//! finite values only and refuse targets that are not files; their errors say what is wrong
//! with which file.
//!
//! The kill tests run real processes: this test binary again, in the child mode of
//! [`save_child`] (selected by an environment variable), which resumes a two-rank ZeRO set,
//! trains and saves, and is ended by the crate's failpoint at a chosen point of the save
//! protocol, or by SIGKILL at a random moment.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;
use std::time::Instant;

use tidemem::chunk::{ChunkManager, ManagerConfig};
use tidemem::comm::{launch, Communicator};
use tidemem::demo::{ToyIds, ToyMlp};
use tidemem::device::{Device, SimConfig};
use tidemem::models::gpt::{read_hf, write_hf, GptConfig};
use tidemem::optim::{DevicePlacement, HybridAdam};
use tidemem::rng::{Rng, SplitMix64};
use tidemem::tensor::{Init, TensorId};
use tidemem::tide::Policy;
use tidemem::zero::ZeroManager;
use tidemem::{DType, Error, Result};

const TOY: ToyMlp = ToyMlp {
    layers: 4,
    width: 16,
    batch: 8,
    tied: false,
    lr: 1e-2,
};

/// AdamW with clipping, without loss scaling: no step is skipped, so the step count is the
/// number of iterations, which the kill tests index their reference run by.
fn adam() -> HybridAdam {
    common::hybrid_adam(false, DevicePlacement::HostOnly)
}

/// Runs `f` on two in-process ranks: their values in rank order, or the error `launch`
/// reports (a rank's own error before another's report of it).
fn on_two<R: Send>(f: impl Fn(Communicator) -> Result<R> + Sync) -> Result<Vec<R>> {
    launch(
        2,
        |_| Device::sim(SimConfig::with_capacity(1 << 20)),
        Duration::from_secs(60),
        f,
    )
}

/// A ZeRO rank of `toy` with f16 parameters.
fn rank(c: Communicator, toy: &ToyMlp) -> Result<(ZeroManager, ToyIds, HybridAdam)> {
    let mut cfg = ManagerConfig::new(toy.chunk_elems(), Policy::Tide);
    cfg.param_dtype = DType::F16;
    cfg.scheduler.overall_fraction = 1.0;
    cfg.scheduler.warmup_chunk_fraction = 0.3;
    let mut z = ZeroManager::new(c, cfg)?;
    let ids = toy.register(&mut z)?;
    Ok((z, ids, adam()))
}

/// One step of `toy` on batch `adam.steps()`.
fn step(z: &mut ZeroManager, ids: &ToyIds, adam: &mut HybridAdam, toy: &ToyMlp) -> Result<()> {
    let part = (z.comm().rank(), z.comm().world());
    toy.forward_backward(z, ids, adam.steps(), adam.loss_scale(), part)?;
    z.step(adam)?;
    Ok(())
}

/// What a rank holds: the optimizer's step count and the bits of its owned masters.
type Held = (u64, Vec<Vec<u32>>);

fn held(z: &mut ZeroManager, adam: &HybridAdam) -> Result<Held> {
    let ids: Vec<TensorId> = (0..z.layout().slots.len() as u32)
        .map(TensorId)
        .filter(|&id| z.owns(id))
        .collect();
    let masters = ids
        .into_iter()
        .map(|id| Ok(z.master(id)?.iter().map(|x| x.to_bits()).collect()))
        .collect::<Result<_>>()?;
    Ok((adam.steps(), masters))
}

fn shard(dir: &Path, r: usize) -> PathBuf {
    dir.join(format!("rank{r}.safetensors"))
}

/// What a rank of `toy` holds before its first step: saved (which closes registration, so that
/// ownership is known) to a scratch directory, and returned with the rank.
fn fresh(c: Communicator, toy: &ToyMlp) -> Result<(ZeroManager, ToyIds, HybridAdam, Held)> {
    let r = c.rank();
    let (mut z, ids, adam) = rank(c, toy)?;
    let scratch = tempfile::tempdir().map_err(|source| Error::Io {
        during: "making a directory",
        source,
    })?;
    z.save_checkpoint(&adam, shard(scratch.path(), r))?;
    let h = held(&mut z, &adam)?;
    Ok((z, ids, adam, h))
}

/// What both ranks hold after every step `0..=steps` of one uninterrupted run.
fn reference(steps: u64) -> Vec<Vec<Held>> {
    let per_rank = on_two(|c| {
        let (mut z, ids, mut adam, initial) = fresh(c, &TOY)?;
        let mut out = vec![initial];
        for _ in 0..steps {
            step(&mut z, &ids, &mut adam, &TOY)?;
            out.push(held(&mut z, &adam)?);
        }
        Ok(out)
    })
    .unwrap();
    (0..=steps as usize)
        .map(|s| per_rank.iter().map(|r| r[s].clone()).collect())
        .collect()
}

/// Loads the set in `dir` on two fresh ranks and checks that what every rank holds is, bit
/// for bit, what it held at that step of the uninterrupted run. Returns the step.
fn load_and_check(dir: &Path, reference: &[Vec<Held>], what: &str) -> u64 {
    let got = on_two(|c| {
        let r = c.rank();
        let (mut z, _, mut adam) = rank(c, &TOY)?;
        z.load_checkpoint(&mut adam, shard(dir, r))?;
        held(&mut z, &adam)
    })
    .unwrap_or_else(|e| panic!("{what}: the set does not load: {e}"));
    let step = got[0].0;
    assert_eq!(got[1].0, step, "{what}: ranks at different steps");
    assert!(
        got == reference[step as usize],
        "{what}: the state loaded differs from step {step}'s"
    );
    step
}

/// A complete set at step 1 in a new directory.
fn base_set() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    on_two(|c| {
        let r = c.rank();
        let (mut z, ids, mut adam) = rank(c, &TOY)?;
        step(&mut z, &ids, &mut adam, &TOY)?;
        z.save_checkpoint(&adam, shard(dir.path(), r))
    })
    .unwrap();
    dir
}

fn copy_set(from: &Path) -> tempfile::TempDir {
    let to = tempfile::tempdir().unwrap();
    for r in 0..2 {
        std::fs::copy(shard(from, r), shard(to.path(), r)).unwrap();
    }
    to
}

const CHILD_DIR: &str = "TIDEMEM_TEST_SAVE_DIR";
/// What the child prints after each of its saves (with the save's index).
const SAVED: &str = "save_child: saved";
const CHILD_STEPS: &str = "TIDEMEM_TEST_SAVE_STEPS";
/// The exit status of a process the crate's failpoint ended.
const FAILPOINT_EXIT: i32 = 86;

/// The child process: resumes the two-rank set in `$TIDEMEM_TEST_SAVE_DIR`, then trains and
/// saves `$TIDEMEM_TEST_SAVE_STEPS` times. Without the variable (a normal test run), nothing.
#[test]
fn save_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR).map(PathBuf::from) else {
        return;
    };
    let steps: u64 = std::env::var(CHILD_STEPS).unwrap().parse().unwrap();
    on_two(|c| {
        let r = c.rank();
        let (mut z, ids, mut adam) = rank(c, &TOY)?;
        z.load_checkpoint(&mut adam, shard(&dir, r))?;
        for k in 0..steps {
            step(&mut z, &ids, &mut adam, &TOY)?;
            z.save_checkpoint(&adam, shard(&dir, r))?;
            if r == 0 {
                eprintln!("{SAVED} {k}");
            }
        }
        Ok(())
    })
    .unwrap();
}

/// This test binary in the mode of [`save_child`], ended at `failpoint` if given.
fn child(dir: &Path, steps: u64, failpoint: Option<&str>) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["save_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_DIR, dir)
        .env(CHILD_STEPS, steps.to_string())
        .env_remove("TIDEMEM_FAILPOINT")
        .env_remove("TIDEMEM_FAILPOINT_HOLD")
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(p) = failpoint {
        cmd.env("TIDEMEM_FAILPOINT", p);
    }
    cmd
}

/// Runs the child until its failpoint ends it.
fn killed_at(dir: &Path, point: &str) {
    let out = child(dir, 1, Some(point)).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(FAILPOINT_EXIT),
        "{point}: the child did not stop there: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs the child until its failpoint `point` ends it, one of its ranks held at `hold` (so
/// that the other gets there first); fails after a minute.
fn killed_at_holding(dir: &Path, point: &str, hold: &str) {
    let mut ch = child(dir, 1, Some(point))
        .env("TIDEMEM_FAILPOINT_HOLD", hold)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = ch.try_wait().unwrap() {
            break st;
        }
        if std::time::Instant::now() > deadline {
            let _ = ch.kill();
            panic!("{point} holding {hold}: the child did not stop within a minute");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(
        status.code(),
        Some(FAILPOINT_EXIT),
        "{point} holding {hold}"
    );
}

/// The points of the save protocol, on each rank: half way through writing its temporary
/// file, after its file is written, after it kept the earlier save as the previous
/// generation, after its rename, after the ranks agreed that every rename happened, after its
/// previous generation is removed.
fn points() -> Vec<(String, &'static str)> {
    let stages = ["written", "kept", "renamed", "agreed", "cleaned"];
    let mut v: Vec<(String, &'static str)> = (0..2)
        .flat_map(|r| stages.map(|s| (format!("zero.save.{s}.rank{r}"), s)))
        .collect();
    // in the middle of a rank's temporary file: half its tensors on disk
    v.insert(0, ("checkpoint.write.half".into(), "written"));
    v
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A process killed at any point of a two-rank save leaves a set that loads, bit for bit, the
/// earlier save or the new one: the earlier one until a rank renamed its new file in, the new
/// one once the ranks agreed that all did. Again when every save starts from what the kill
/// before it left; and a save that completes leaves no temporary file nor previous
/// generation, those of the killed processes included. And with SIGKILL at random moments.
#[test]
fn a_zero_save_killed_at_any_point_leaves_a_loadable_set() {
    let reference = reference(1 + (RANDOM_ROUNDS + 1) * RANDOM_STEPS);
    let base = base_set();
    assert_eq!(load_and_check(base.path(), &reference, "base"), 1);
    for (point, stage) in points() {
        let dir = copy_set(base.path());
        killed_at(dir.path(), &point);
        let step = load_and_check(dir.path(), &reference, &point);
        match stage {
            "written" | "kept" => assert_eq!(step, 1, "{point}"),
            "renamed" => assert!(step == 1 || step == 2, "{point}: step {step}"),
            _ => assert_eq!(step, 2, "{point}"),
        }
    }
    let dir = copy_set(base.path());
    let mut now = 1;
    for (point, _) in points() {
        killed_at(dir.path(), &point);
        let step = load_and_check(dir.path(), &reference, &format!("after {point}"));
        assert!(step == now || step == now + 1, "{point}: {now} then {step}");
        now = step;
    }
    let out = child(dir.path(), 1, None).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(load_and_check(dir.path(), &reference, "complete"), now + 1);
    assert_eq!(
        names_in(dir.path()),
        ["rank0.safetensors", "rank1.safetensors"]
    );
    killed_at_random_moments(base.path(), &reference);
}

/// The set two killed saves can leave: rank 0 holds saves 3 (current) and 1 (previous),
/// rank 1 saves 2 and 1 (the second save killed after rank 0's rename, the first after rank
/// 1's). The newest save every rank holds is 1, though 2 is the oldest of the ranks' newest;
/// a save from there, killed at any point, keeps it.
#[test]
fn a_set_left_by_two_killed_saves_loads_the_save_every_rank_holds() {
    let reference = reference(3);
    let saves: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    on_two(|c| {
        let r = c.rank();
        let (mut z, ids, mut adam) = rank(c, &TOY)?;
        for dir in &saves {
            step(&mut z, &ids, &mut adam, &TOY)?;
            z.save_checkpoint(&adam, shard(dir.path(), r))?;
        }
        Ok(())
    })
    .unwrap();
    let left = tempfile::tempdir().unwrap();
    let prev = |r: usize| left.path().join(format!("rank{r}.safetensors.prev"));
    let copy = |from: &tempfile::TempDir, r: usize, to: PathBuf| {
        std::fs::copy(shard(from.path(), r), to).unwrap();
    };
    copy(&saves[2], 0, shard(left.path(), 0));
    copy(&saves[0], 0, prev(0));
    copy(&saves[1], 1, shard(left.path(), 1));
    copy(&saves[0], 1, prev(1));
    assert_eq!(load_and_check(left.path(), &reference, "left"), 1);
    for (point, _) in points() {
        let dir = tempfile::tempdir().unwrap();
        for r in 0..2 {
            std::fs::copy(shard(left.path(), r), shard(dir.path(), r)).unwrap();
            std::fs::copy(
                prev(r),
                dir.path().join(format!("rank{r}.safetensors.prev")),
            )
            .unwrap();
        }
        killed_at(dir.path(), &point);
        let step = load_and_check(dir.path(), &reference, &format!("left, then {point}"));
        assert!(step == 1 || step == 2, "{point}: step {step}");
    }
}

/// The child, spawned, and when each of its saves ended (its output read on a thread, so that
/// it never blocks on a full pipe).
fn saves_of(mut ch: std::process::Child) -> (std::process::Child, mpsc::Receiver<Instant>) {
    use std::io::BufRead;
    let err = ch.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(|l| l.ok()) {
            if line.starts_with(SAVED) {
                let _ = tx.send(Instant::now());
            }
        }
    });
    (ch, rx)
}

/// SIGKILL at random moments of processes that train and save in a loop, each resuming what
/// the kill before left: each kill a random time (under the shortest step and save an
/// uninterrupted process took) after a random one of its saves with two or more to follow,
/// timed from the child's own saves (not its start-up), so that every kill interrupts.
fn killed_at_random_moments(base: &Path, reference: &[Vec<Held>]) {
    let dir = copy_set(base);
    let (ch, saves) = saves_of(child(dir.path(), RANDOM_STEPS, None).spawn().unwrap());
    let out = ch.wait_with_output().unwrap();
    assert!(out.status.success(), "the uninterrupted child failed");
    let times: Vec<Instant> = saves.iter().collect();
    assert_eq!(times.len() as u64, RANDOM_STEPS, "a line a save");
    let shortest = times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_micros() as u64)
        .min()
        .unwrap();
    let mut now = load_and_check(dir.path(), reference, "uninterrupted");
    assert_eq!(now, 1 + RANDOM_STEPS);
    let mut rng = SplitMix64::new(0x5eed);
    let mut interrupted = 0;
    for round in 0..RANDOM_ROUNDS {
        let (mut ch, saves) = saves_of(child(dir.path(), RANDOM_STEPS, None).spawn().unwrap());
        let after = rng.next_u64() % (RANDOM_STEPS - 2);
        for _ in 0..=after {
            saves.recv().expect("the child saves");
        }
        std::thread::sleep(Duration::from_micros(rng.next_u64() % shortest.max(1)));
        let _ = ch.kill();
        interrupted += u32::from(!ch.wait().unwrap().success());
        let step = load_and_check(dir.path(), reference, &format!("round {round}"));
        assert!(step >= now, "round {round}: back from {now} to {step}");
        now = step;
    }
    eprintln!("{interrupted} of {RANDOM_ROUNDS} processes killed at random, at step {now}");
    assert_eq!(
        u64::from(interrupted),
        RANDOM_ROUNDS,
        "every kill interrupts a save loop"
    );
}

/// A two-rank save killed with rank 0's new file renamed in and rank 1's not yet (rank 1
/// held before its rename, in a real process): the set loads the earlier save, the one every
/// rank holds, and the next save completes from it and leaves the two current files.
#[test]
fn the_rename_gap_between_two_ranks_loads_the_earlier_save() {
    let reference = reference(3);
    let base = base_set();
    for (first, second) in [(0, 1), (1, 0)] {
        let dir = copy_set(base.path());
        let point = format!("zero.save.renamed.rank{first}");
        let hold = format!("zero.save.kept.rank{second}");
        killed_at_holding(dir.path(), &point, &hold);
        let what = format!("rank {first} renamed, rank {second} not");
        // the renamed rank holds the new save and the earlier one as its previous generation
        let prev = dir.path().join(format!("rank{first}.safetensors.prev"));
        assert!(prev.exists(), "{what}: {:?}", names_in(dir.path()));
        assert_eq!(load_and_check(dir.path(), &reference, &what), 1);
        let out = child(dir.path(), 1, None).output().unwrap();
        assert!(out.status.success(), "{what}: the next save");
        assert_eq!(load_and_check(dir.path(), &reference, &what), 2);
        assert_eq!(
            names_in(dir.path()),
            ["rank0.safetensors", "rank1.safetensors"],
            "{what}"
        );
    }
}

/// Rounds of [`killed_at_random_moments`], and the steps each process trains and saves.
const RANDOM_ROUNDS: u64 = 8;
const RANDOM_STEPS: u64 = 12;

/// Rank 0's file of one run and rank 1's of another, both at step 3: no rank loads, rank 1
/// (whose file is not of the save rank 0's is) says why, and each run's set loads alone.
#[test]
fn shards_of_two_runs_never_load_together() {
    let runs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let toys = [TOY, ToyMlp { batch: 16, ..TOY }];
    for (dir, toy) in runs.iter().zip(&toys) {
        on_two(|c| {
            let r = c.rank();
            let (mut z, ids, mut adam) = rank(c, toy)?;
            for _ in 0..3 {
                step(&mut z, &ids, &mut adam, toy)?;
            }
            z.save_checkpoint(&adam, shard(dir.path(), r))
        })
        .unwrap();
    }
    let mixed = tempfile::tempdir().unwrap();
    std::fs::copy(shard(runs[0].path(), 0), shard(mixed.path(), 0)).unwrap();
    std::fs::copy(shard(runs[1].path(), 1), shard(mixed.path(), 1)).unwrap();
    let outcomes = on_two(|c| {
        let r = c.rank();
        let (mut z, _, mut adam, before) = fresh(c, &TOY)?;
        let e = z.load_checkpoint(&mut adam, shard(mixed.path(), r)).err();
        let unchanged = held(&mut z, &adam)? == before;
        Ok((e.map(|e| format!("{e:?}")), unchanged))
    })
    .unwrap();
    for (r, (e, unchanged)) in outcomes.iter().enumerate() {
        assert!(unchanged, "rank {r} loaded");
        let e = e
            .as_deref()
            .unwrap_or_else(|| panic!("rank {r} accepted the mix"));
        let want = if r == 1 { "SaveMismatch" } else { "RankFailed" };
        assert!(e.starts_with(want), "rank {r}: {e}");
    }
    let e = on_two(|c| {
        let r = c.rank();
        let (mut z, _, mut adam) = rank(c, &TOY)?;
        z.load_checkpoint(&mut adam, shard(mixed.path(), r))
    })
    .unwrap_err();
    match &e {
        Error::SaveMismatch {
            path, rank, found, ..
        } => {
            assert_eq!((path, *rank), (&shard(mixed.path(), 1), 1));
            assert_eq!(found.len(), 1);
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("different saves or runs"), "{e}");
    for dir in &runs {
        on_two(|c| {
            let r = c.rank();
            let (mut z, _, mut adam) = rank(c, &TOY)?;
            z.load_checkpoint(&mut adam, shard(dir.path(), r))
        })
        .unwrap();
    }
}

/// A chunk manager of the toy model trained two steps.
fn trained() -> (ChunkManager, HybridAdam) {
    let (mut m, _, ids) = common::toy_setup(Policy::Tide, 1 << 20, None);
    let mut opt = adam();
    for s in 0..2 {
        common::TOY
            .forward_backward(&mut m, &ids, s, opt.loss_scale(), (0, 1))
            .unwrap();
        opt.step(&mut m).unwrap();
    }
    (m, opt)
}

fn masters(m: &mut ChunkManager) -> Vec<Vec<u32>> {
    (0..m.num_tensors() as u32)
        .map(|t| {
            let v = m.master(TensorId(t)).unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        })
        .collect()
}

/// The byte range of tensor `name`'s data in the safetensors file `bytes`.
fn data_range(bytes: &[u8], name: &str) -> std::ops::Range<usize> {
    let (n, meta) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let (start, end) = meta.info(name).unwrap().data_offsets;
    8 + n + start..8 + n + end
}

/// `src` written again by the `safetensors` crate without the checksums (as a file of before
/// them, or of another program), with `edit` applied to each tensor's bytes.
fn rewritten(src: &Path, dst: &Path, edit: impl Fn(&str, &mut Vec<u8>)) {
    let bytes = std::fs::read(src).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta: Option<HashMap<String, String>> = meta.metadata().clone().map(|m| {
        m.into_iter()
            .filter(|(k, _)| !k.starts_with("crc32/"))
            .collect()
    });
    let tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            let mut data = v.data().to_vec();
            edit(&name, &mut data);
            (name, v.dtype(), v.shape().to_vec(), data)
        })
        .collect();
    let views = tensors.iter().map(|(n, d, s, b)| {
        (
            n.clone(),
            safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
        )
    });
    safetensors::serialize_to_file(views, &meta, dst).unwrap();
}

/// A flipped bit or a zeroed region of a tensor's data is refused, naming the file and the
/// tensor, before anything changes; so is a file without checksums.
#[test]
fn a_damaged_checkpoint_is_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.safetensors");
    let (mut m, opt) = trained();
    opt.save_checkpoint(&mut m, &good).unwrap();
    let saved = masters(&mut m);
    let bytes = std::fs::read(&good).unwrap();
    let name = m.tensor_info(TensorId(1)).unwrap().0.to_string();
    type Damage = Box<dyn Fn(&mut [u8])>;
    let damages: Vec<(&str, String, Damage)> = vec![
        ("bit", format!("param/{name}"), Box::new(|d| d[3] ^= 0x10)),
        ("zeros", format!("master/{name}"), Box::new(|d| d.fill(0))),
    ];
    for (what, tensor, damage) in damages {
        let mut b = bytes.clone();
        let range = data_range(&b, &tensor);
        damage(&mut b[range]);
        let p = dir.path().join(format!("{what}.safetensors"));
        std::fs::write(&p, &b).unwrap();
        let (mut fresh, _, _) = common::toy_setup(Policy::Tide, 1 << 20, None);
        let before = masters(&mut fresh);
        let e = adam().load_checkpoint(&mut fresh, &p).unwrap_err();
        match &e {
            Error::ChecksumMismatch { path, tensor: t } => {
                assert_eq!((path, t), (&p, &tensor), "{what}");
            }
            other => panic!("{what}: {other}"),
        }
        assert!(e.to_string().contains(&p.display().to_string()), "{e}");
        assert_eq!(masters(&mut fresh), before, "{what}: nothing changed");
    }
    // without its checksums (an older file, or one whose checksums were deleted): nothing in
    // it can be verified, so it is refused unless the user asks for a legacy load (the CLI
    // test `a_checkpoint_without_checksums_loads_only_when_asked` asks)
    let legacy = dir.path().join("legacy.safetensors");
    rewritten(&good, &legacy, |_, _| {});
    let (mut fresh, _, _) = common::toy_setup(Policy::Tide, 1 << 20, None);
    let before = masters(&mut fresh);
    let e = adam().load_checkpoint(&mut fresh, &legacy).unwrap_err();
    assert!(
        matches!(&e, Error::Unverified { path, .. } if path == &legacy),
        "{e}"
    );
    assert!(e.to_string().contains("TIDEMEM_LEGACY_LOAD=1"), "{e}");
    assert_eq!(masters(&mut fresh), before, "legacy: nothing changed");
    assert_ne!(before, saved);
}

/// One rank's damaged file of a ZeRO set: no rank loads.
#[test]
fn a_damaged_shard_stops_every_rank() {
    let base = base_set();
    let b = std::fs::read(shard(base.path(), 1)).unwrap();
    let (n, meta) = safetensors::SafeTensors::read_metadata(&b).unwrap();
    let (name, info) = meta.tensors().into_iter().next().unwrap();
    let mut b = b.clone();
    b[8 + n + info.data_offsets.0] ^= 1;
    std::fs::write(shard(base.path(), 1), &b).unwrap();
    let outcomes = on_two(|c| {
        let r = c.rank();
        let (mut z, _, mut adam, before) = fresh(c, &TOY)?;
        let e = z.load_checkpoint(&mut adam, shard(base.path(), r)).err();
        Ok((e.map(|e| format!("{e}")), held(&mut z, &adam)? == before))
    })
    .unwrap();
    for (r, (e, unchanged)) in outcomes.iter().enumerate() {
        assert!(unchanged, "rank {r} loaded");
        let e = e.as_deref().unwrap_or_else(|| panic!("rank {r} loaded"));
        let want = if r == 1 {
            name.as_str()
        } else {
            "another rank failed"
        };
        assert!(e.contains(want), "rank {r}: {e}");
    }
}

fn tiny_gpt() -> GptConfig {
    GptConfig {
        layers: 1,
        channels: 8,
        heads: 2,
        vocab: 10,
        max_seq: 4,
        eps: 1e-5,
    }
}

fn gpt_values(cfg: &GptConfig) -> HashMap<String, Vec<f32>> {
    cfg.param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            (name, (0..n).map(|i| (i % 7) as f32 / 8.0 - 0.3).collect())
        })
        .collect()
}

/// A Hugging Face file with a NaN or an infinity is refused, naming the tensor and the first
/// bad element; one from elsewhere (no checksums) is read when its values are finite.
#[test]
fn non_finite_weights_are_refused_on_import() {
    let cfg = tiny_gpt();
    let values = gpt_values(&cfg);
    let dir = tempfile::tempdir().unwrap();
    let ours = dir.path().join("ours.safetensors");
    write_hf(&ours, &cfg, |name| Ok(values[name].clone())).unwrap();
    let theirs = dir.path().join("theirs.safetensors");
    rewritten(&ours, &theirs, |_, _| {});
    read_hf(&theirs, Some(2), Some(&cfg)).unwrap();
    for (tensor, index, value) in [
        ("h.0.mlp.c_fc.weight", 5usize, f32::NAN),
        ("wte.weight", 0, f32::INFINITY),
        ("ln_f.bias", 7, f32::NEG_INFINITY),
    ] {
        let p = dir.path().join("bad.safetensors");
        rewritten(&ours, &p, |name, data| {
            if name == tensor {
                data[index * 4..index * 4 + 4].copy_from_slice(&value.to_le_bytes());
            }
        });
        match read_hf(&p, Some(2), Some(&cfg)) {
            Err(Error::NonFinite {
                path,
                tensor: t,
                index: i,
                saving: false,
            }) => assert_eq!((path, t.as_str(), i), (p, tensor, index as u64)),
            other => panic!("{tensor}: {other:?}"),
        }
    }
}

/// A save whose values hold a NaN or an infinity fails, naming the tensor and element, and
/// the earlier file stays as it was: in the chunk manager's checkpoints and in the Hugging Face
/// export.
#[test]
fn a_save_of_non_finite_state_keeps_the_earlier_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.safetensors");
    let manager = |v: Init| {
        let mut m =
            ChunkManager::new(common::sim(1 << 20), ManagerConfig::new(64, Policy::Tide)).unwrap();
        m.register("w", &[4], Init::Constant(1.0)).unwrap();
        m.register("v", &[8], v).unwrap();
        m
    };
    manager(Init::Constant(0.5))
        .save_checkpoint(&p, &BTreeMap::new())
        .unwrap();
    let before = std::fs::read(&p).unwrap();
    let nan_at_3 = Init::Fn(std::sync::Arc::new(|i| if i == 3 { f32::NAN } else { 0.5 }));
    let e = manager(nan_at_3)
        .save_checkpoint(&p, &BTreeMap::new())
        .unwrap_err();
    match &e {
        Error::NonFinite {
            path,
            tensor,
            index,
            saving: true,
        } => assert_eq!((path, tensor.as_str(), *index), (&p, "param/v", 3)),
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("earlier file stays"), "{e}");
    assert_eq!(std::fs::read(&p).unwrap(), before);
    assert_eq!(names_in(dir.path()), ["m.safetensors"]);

    let cfg = tiny_gpt();
    let values = gpt_values(&cfg);
    let hf = dir.path().join("hf.safetensors");
    write_hf(&hf, &cfg, |name| Ok(values[name].clone())).unwrap();
    let before = std::fs::read(&hf).unwrap();
    let e = write_hf(&hf, &cfg, |name| {
        let mut v = values[name].clone();
        if name == "ln_f.bias" {
            v[7] = f32::INFINITY;
        }
        Ok(v)
    })
    .unwrap_err();
    assert!(
        matches!(&e, Error::NonFinite { tensor, index: 7, .. } if tensor == "ln_f.bias"),
        "{e:?}"
    );
    assert_eq!(std::fs::read(&hf).unwrap(), before);
}

fn small_manager() -> ChunkManager {
    let mut m =
        ChunkManager::new(common::sim(1 << 20), ManagerConfig::new(64, Policy::Tide)).unwrap();
    m.register("w", &[4], Init::Constant(1.0)).unwrap();
    m
}

/// A directory or a fifo at the target is refused, naming it, and stays; a symbolic link is
/// written through to its final target, atomically, and stays a link.
#[cfg(unix)]
#[test]
fn save_targets_are_regular_files_or_links_to_them() {
    use std::os::unix::fs::{symlink, FileTypeExt};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut m = small_manager();
    let meta = BTreeMap::new();
    let sub = d.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let refused = |e: Error, path: &Path, kind: &str| match e {
        Error::NotAFile { path: p, kind: k } => assert_eq!((p.as_path(), k), (path, kind)),
        other => panic!("{}: {other:?}", path.display()),
    };
    refused(
        m.save_checkpoint(&sub, &meta).unwrap_err(),
        &sub,
        "directory",
    );
    assert!(sub.is_dir());
    let to_dir = d.join("to-dir");
    symlink("sub", &to_dir).unwrap();
    refused(
        m.save_checkpoint(&to_dir, &meta).unwrap_err(),
        &to_dir,
        "directory",
    );
    let fifo = d.join("fifo");
    if Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        refused(m.save_checkpoint(&fifo, &meta).unwrap_err(), &fifo, "fifo");
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
        std::fs::remove_file(&fifo).unwrap();
    }
    // a relative link into another directory, and a link to that link
    let real = d.join("real");
    std::fs::create_dir(&real).unwrap();
    let target = real.join("a.safetensors");
    std::fs::write(&target, b"an earlier file").unwrap();
    let link = d.join("link");
    symlink("real/a.safetensors", &link).unwrap();
    let link2 = d.join("link2");
    symlink("link", &link2).unwrap();
    for (i, l) in [&link, &link2].into_iter().enumerate() {
        let meta = BTreeMap::from([("i".to_string(), i.to_string())]);
        m.save_checkpoint(l, &meta).unwrap();
        assert!(std::fs::symlink_metadata(l).unwrap().is_symlink());
        let mut back = small_manager();
        assert_eq!(back.load_checkpoint(&target).unwrap()["i"], i.to_string());
    }
    assert_eq!(
        std::fs::read_link(&link).unwrap(),
        Path::new("real/a.safetensors")
    );
    assert_eq!(names_in(&real), ["a.safetensors"]);
    // a dangling link: its target is created
    let dangling = d.join("dangling");
    symlink("real/b.safetensors", &dangling).unwrap();
    m.save_checkpoint(&dangling, &meta).unwrap();
    assert!(std::fs::symlink_metadata(&dangling).unwrap().is_symlink());
    assert!(std::fs::symlink_metadata(real.join("b.safetensors"))
        .unwrap()
        .is_file());
    assert_eq!(
        names_in(d),
        ["dangling", "link", "link2", "real", "sub", "to-dir"]
    );
}

/// A file that is not a checkpoint is described in words, with its path; a directory is said
/// to be one; a save's error names the path asked for, not a temporary file.
#[test]
fn errors_say_what_is_wrong_with_which_file() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.safetensors");
    let mut m = small_manager();
    m.save_checkpoint(&good, &BTreeMap::new()).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let data = bytes.len() - 8 - header as usize;
    let cases: Vec<(&str, Vec<u8>, String)> = vec![
        ("short", bytes[..5].to_vec(), "truncated header".into()),
        (
            "cut-header",
            bytes[..40].to_vec(),
            format!("the header says {header} bytes but the file has 32"),
        ),
        (
            "cut-data",
            bytes[..bytes.len() - 4].to_vec(),
            format!(
                "the header describes {data} bytes of tensor data, the file holds {}",
                data - 4
            ),
        ),
        (
            "text",
            b"{\"a\": not a checkpoint at all, just text}".to_vec(),
            "not a safetensors file".into(),
        ),
    ];
    for (name, content, want) in cases {
        let p = dir.path().join(name);
        std::fs::write(&p, content).unwrap();
        let e = small_manager().load_checkpoint(&p).unwrap_err();
        assert!(
            matches!(&e, Error::Checkpoint { what, path } if what.contains(&want) && path == &p),
            "{name}: {e}"
        );
        assert!(e.to_string().contains(&p.display().to_string()), "{e}");
    }
    // a directory: the checkpoint of several ranks?
    let e = small_manager().load_checkpoint(dir.path()).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::NotAFile {
                kind: "directory",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("several ranks"), "{e}");
    let absent = dir.path().join("absent");
    match small_manager().load_checkpoint(&absent).unwrap_err() {
        Error::FileIo { path, source, .. } => {
            assert_eq!(path, absent);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("{other}"),
    }
    // a save under a regular file, as if it were a directory
    let under = good.join("x.safetensors");
    let e = m.save_checkpoint(&under, &BTreeMap::new()).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::FileIo { .. }), "{e:?}");
    assert!(text.contains(&under.display().to_string()), "{text}");
    assert!(!text.contains(".partial"), "{text}");
}

/// When one rank's save fails, the error of that rank is the one a two-rank launch reports,
/// not another rank's report that some rank failed.
#[test]
fn the_failing_ranks_own_error_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("missing").join("rank1.safetensors");
    let e = on_two(|c| {
        let r = c.rank();
        let (mut z, ids, mut adam) = rank(c, &TOY)?;
        step(&mut z, &ids, &mut adam, &TOY)?;
        let to = if r == 0 {
            shard(dir.path(), 0)
        } else {
            bad.clone()
        };
        z.save_checkpoint(&adam, to)
    })
    .unwrap_err();
    match e {
        Error::FileIo { path, .. } => assert_eq!(path, bad),
        other => panic!("{other:?}"),
    }
}

/// The temporary files of saves whose process is dead are removed by the next save to the
/// same path; those of live processes, of other targets and of other names stay.
#[test]
fn stale_partial_files_of_dead_writers_are_removed() {
    if !Path::new("/proc/self").exists() {
        eprintln!("no /proc: a dead writer cannot be told from a live one");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // pid 999999999 is above any pid_max; pid 1 is always alive
    let dead = "m.safetensors.999999999.0.partial";
    let stay = [
        "m.safetensors.1.0.partial",
        "n.safetensors.999999999.0.partial",
        "m.safetensors.x1y2z3.partial",
    ];
    for f in std::iter::once(dead).chain(stay) {
        std::fs::write(d.join(f), b"left by a killed save").unwrap();
    }
    small_manager()
        .save_checkpoint(d.join("m.safetensors"), &BTreeMap::new())
        .unwrap();
    let mut want: Vec<&str> = stay.to_vec();
    want.push("m.safetensors");
    want.sort();
    assert_eq!(names_in(d), want);
}

/// A checkpoint is created as any file is: mode 0666 less the umask.
#[cfg(unix)]
#[test]
fn checkpoints_are_created_like_any_other_file() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain");
    std::fs::File::create(&plain).unwrap();
    let p = dir.path().join("m.safetensors");
    small_manager()
        .save_checkpoint(&p, &BTreeMap::new())
        .unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode(&p),
        mode(&plain),
        "{:o} vs {:o}",
        mode(&p),
        mode(&plain)
    );
}
