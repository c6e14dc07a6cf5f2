//! Devices the shared suites run on (always a simulated device, plus CUDA device 0 when
//! present), and the toy model the manager and optimizer suites train.
#![allow(dead_code)]

pub mod summa;

use tidemem::device::{Device, LinkModel, SimConfig};
use tidemem::rng::{Rng, SplitMix64};

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    SplitMix64::new(seed).bytes(len)
}

pub fn sim(capacity: usize) -> Device {
    Device::sim(SimConfig::with_capacity(capacity)).expect("sim device")
}

/// A simulated device whose copies are slow enough that a missing wait would read stale data.
pub fn slow_sim(capacity: usize) -> Device {
    let link = LinkModel {
        h2d_gbps: 0.5,
        d2h_gbps: 0.5,
        d2d_gbps: 0.5,
        latency: std::time::Duration::from_millis(2),
    };
    Device::sim(SimConfig::with_capacity(capacity).link(link)).expect("sim device")
}

/// CUDA device 0, or `None` after printing why the GPU half of a test is skipped.
/// `TIDEMEM_REQUIRE_CUDA=1` makes a missing device a failure instead (the emulated-GPU run).
pub fn cuda(test: &str) -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            assert!(
                std::env::var("TIDEMEM_REQUIRE_CUDA").as_deref() != Ok("1"),
                "{test}: TIDEMEM_REQUIRE_CUDA=1 but there is no CUDA device: {e}"
            );
            eprintln!("{test}: skipping the CUDA backend: {e}");
            None
        }
    }
}

/// Notes that the CUDA half of `test` cannot run because `why` (say, cuBLAS does not load):
/// printed as a skip, or a failure under `TIDEMEM_REQUIRE_CUDA=1`, like a missing device.
pub fn cuda_half_missing(test: &str, why: &str) {
    assert!(
        std::env::var("TIDEMEM_REQUIRE_CUDA").as_deref() != Ok("1"),
        "{test}: TIDEMEM_REQUIRE_CUDA=1 but {why}"
    );
    eprintln!("{test}: skipping the CUDA backend: {why}");
}

/// Whether `dev` is the CPU stand-in for the CUDA driver (`cuda-emu`), which runs tidemem's
/// kernels, and NCCL only as its own stand-in.
pub fn is_emulated(dev: &Device) -> bool {
    dev.name().contains("CUDA emulator")
}

/// Whether the NCCL library loaded is the emulator's stand-in (`cuda-emu`'s `libcuda.so` under
/// NCCL's name, `.ci/run`): the one library that answers both `ncclGetVersion` and `cuInit`.
pub fn nccl_is_stand_in() -> bool {
    let Ok(path) = tidemem::comm::nccl_library() else {
        return false;
    };
    // SAFETY: the library is loaded already (opening it again runs no initializer); only the
    // presence of a symbol is read.
    unsafe { libloading::Library::new(path) }
        .is_ok_and(|l| unsafe { l.get::<unsafe extern "C" fn()>(b"cuInit\0") }.is_ok())
}

/// CUDA device 0 for a test of NCCL, or `None` after printing why it is skipped: on the CPU
/// emulator NCCL runs only as the emulator's stand-in, and with `TIDEMEM_REQUIRE_NCCL=1` a
/// real NCCL there (which needs a GPU) is a failure, as is a library that does not load.
pub fn nccl_device(test: &str) -> Option<Device> {
    let dev = cuda(test)?;
    let reachable = match tidemem::comm::nccl_library() {
        Err(e) => Err(e.to_string()),
        Ok(_) if is_emulated(&dev) && !nccl_is_stand_in() => Err(
            "the CUDA device is the CPU emulator and the NCCL library is not its stand-in \
             (TIDEMEM_NCCL_LIB=<emulator dir>/libnccl.so.2)"
                .to_string(),
        ),
        Ok(_) => Ok(()),
    };
    if let Err(why) = reachable {
        assert!(
            !required("TIDEMEM_REQUIRE_NCCL"),
            "{test}: TIDEMEM_REQUIRE_NCCL=1 but {why}"
        );
        eprintln!("{test}: skipping NCCL: {why}");
        return None;
    }
    Some(dev)
}

/// Whether NCCL can run `world` launched ranks here, one CUDA device each (see
/// [`nccl_device`]): fewer GPUs than ranks is a skip, said, whatever is required; on the
/// emulator (whose device count is `TIDEMEM_EMU_DEVICES`) it fails under
/// `TIDEMEM_REQUIRE_NCCL=1`.
pub fn nccl_ranks(test: &str, world: usize) -> bool {
    let Some(dev) = nccl_device(test) else {
        return false;
    };
    let n = tidemem::device::cuda_device_count();
    if n < world {
        assert!(
            !(is_emulated(&dev) && required("TIDEMEM_REQUIRE_NCCL")),
            "{test}: TIDEMEM_REQUIRE_NCCL=1 but the emulator shows {n} device(s) for {world} \
             ranks (TIDEMEM_EMU_DEVICES)"
        );
        eprintln!("{test}: skipping {world} launched ranks: {n} CUDA device(s)");
        return false;
    }
    true
}

/// Runs this test binary's `test` as `world` processes, one rank each with the variables a
/// launcher sets (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` of a free
/// port), and fails unless every one passes within `limit`; `env` is added to each.
pub fn launch_self(test: &str, world: usize, limit: std::time::Duration) {
    let exe = std::env::current_exe().expect("the test binary");
    launch_ranks(test, world, limit, |_| {
        let mut c = std::process::Command::new(&exe);
        c.args(["--exact", test, "--nocapture", "--test-threads", "1"]);
        c
    });
}

/// Runs `command(rank)` as `world` processes with a launcher's variables (see [`launch_self`])
/// and returns each one's standard output; fails unless every one exits 0 within `limit`.
pub fn launch_ranks(
    what: &str,
    world: usize,
    limit: std::time::Duration,
    command: impl Fn(usize) -> std::process::Command,
) -> Vec<String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    // output to files: a pipe nobody reads while waiting would stop a talkative rank
    let dir = std::env::temp_dir().join(format!("tidemem-ranks-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory for the ranks' output");
    let file = |r: usize, k: &str| dir.join(format!("rank{r}.{k}"));
    let mut children: Vec<Option<std::process::Child>> = (0..world)
        .map(|r| {
            let out = std::fs::File::create(file(r, "out")).expect("an output file");
            let err = std::fs::File::create(file(r, "err")).expect("an output file");
            Some(
                command(r)
                    .env("WORLD_SIZE", world.to_string())
                    .env("RANK", r.to_string())
                    .env("LOCAL_RANK", r.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .stdout(out)
                    .stderr(err)
                    .spawn()
                    .expect("a rank's process starts"),
            )
        })
        .collect();
    let start = std::time::Instant::now();
    let mut status = vec![None; world];
    while status.iter().any(Option::is_none) {
        for (r, slot) in children.iter_mut().enumerate() {
            if let Some(st) = slot.as_mut().and_then(|c| c.try_wait().expect("a status")) {
                status[r] = Some(st);
                *slot = None;
            }
        }
        if start.elapsed() > limit {
            for c in children.iter_mut().flatten() {
                let _ = c.kill();
            }
            let left = status.iter().filter(|s| s.is_none()).count();
            panic!("{what}: {left} of {world} ranks still ran after {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let read = |r: usize, k: &str| std::fs::read_to_string(file(r, k)).unwrap_or_default();
    let outs = (0..world).map(|r| read(r, "out")).collect();
    for (r, st) in status.into_iter().enumerate() {
        let st = st.expect("every rank finished");
        assert!(
            st.success(),
            "{what}: rank {r} of {world} failed ({st}):\n{}",
            read(r, "err")
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    outs
}

/// A fresh NCCL unique id for a test of NCCL, or `None` after printing why it is skipped: only
/// when no NCCL loads ([`Error::BackendUnavailable`](tidemem::Error::BackendUnavailable)), and
/// then only without `TIDEMEM_REQUIRE_NCCL=1` (the GPU bundle sets it, so an NCCL test cannot
/// pass there without running). Any other error is a failure.
pub fn nccl_id(test: &str) -> Option<[u8; 128]> {
    match tidemem::comm::nccl_unique_id() {
        Ok(id) => Some(id),
        Err(e @ tidemem::Error::BackendUnavailable { .. }) => {
            assert!(
                std::env::var("TIDEMEM_REQUIRE_NCCL").as_deref() != Ok("1"),
                "{test}: TIDEMEM_REQUIRE_NCCL=1 but NCCL does not load: {e}"
            );
            eprintln!("{test}: skipping NCCL: {e}");
            None
        }
        Err(e) => panic!("{test}: NCCL loads but makes no unique id: {e}"),
    }
}

/// Every backend available here, with a capacity-limited Sim first.
pub fn devices(test: &str) -> Vec<Device> {
    let mut v = vec![sim(256 << 20)];
    v.extend(cuda(test));
    v
}

/// The toy MLP the manager and optimizer suites train.
pub const TOY: tidemem::demo::ToyMlp = tidemem::demo::ToyMlp {
    layers: 6,
    width: 16,
    batch: 8,
    tied: true,
    lr: 1e-2,
};

/// A toy MLP whose chunks outweigh what it keeps between forward and backward: 16 blocks of
/// 32 × 32 (one 2,112-byte fp16 chunk each) on a batch of 2, its first weight tied to its last.
/// [`TOY`]'s activations outweigh its chunks, so no device both trains it and evicts; this one
/// evicts on any device below its non-model peak plus its chunks ([`DEEP_DEVICE`] for one
/// process).
pub const DEEP: tidemem::demo::ToyMlp = tidemem::demo::ToyMlp {
    layers: 16,
    width: 32,
    batch: 2,
    tied: true,
    lr: 1e-2,
};

/// [`DEEP`] without the tied weight (one chunk a block, each used once a stage).
pub const DEEP_UNTIED: tidemem::demo::ToyMlp = tidemem::demo::ToyMlp {
    tied: false,
    ..DEEP
};

/// A device for [`DEEP`] in one process: its non-model peak in fp16 (11,776 B) and room for
/// about five of its 16 parameter chunks, so every policy evicts and reloads chunks each step.
pub const DEEP_DEVICE: usize = 24_000;

/// Chunk evictions (write-backs and clean drops) in `s`; a write-back ahead of an eviction
/// (a host group stepped during backward) is not one: the eviction is its later clean drop.
pub fn evictions(s: &tidemem::tide::MoveStats) -> u64 {
    s.write_backs - s.early_write_backs + s.clean_drops
}

/// Asserts that a run on a small device (`small`, its move statistics) evicted more chunks and
/// moved more bytes up than the same run on a device that holds everything (`roomy`): the small
/// device is small enough to exercise eviction and reload. The message says how many.
pub fn assert_evicts(
    small: &tidemem::tide::MoveStats,
    roomy: &tidemem::tide::MoveStats,
    what: &str,
) {
    let (e, r) = (evictions(small), evictions(roomy));
    assert!(
        e > r && small.h2d_bytes > roomy.h2d_bytes,
        "{what}: the small device must evict: {e} chunk evictions and {} B up, against {r} and {} B on a roomy device",
        small.h2d_bytes,
        roomy.h2d_bytes
    );
    eprintln!(
        "{what}: {e} chunk evictions and {} B up, against {r} and {} B on a roomy device",
        small.h2d_bytes, roomy.h2d_bytes
    );
}

/// A manager for [`TOY`], its non-model pool and its tensors.
pub type ToySetup = (
    tidemem::chunk::ChunkManager,
    tidemem::device::CachingAllocator,
    tidemem::demo::ToyIds,
);

/// A manager for [`TOY`] on a Sim device of `capacity` bytes, with its non-model pool.
pub fn toy_setup(
    policy: tidemem::tide::Policy,
    capacity: usize,
    host_budget: Option<u64>,
) -> ToySetup {
    toy_setup_on(sim(capacity), policy, capacity, host_budget)
}

/// A manager for [`TOY`] on `dev`, planning for `capacity` bytes of it, with its non-model pool.
pub fn toy_setup_on(
    dev: Device,
    policy: tidemem::tide::Policy,
    capacity: usize,
    host_budget: Option<u64>,
) -> ToySetup {
    use tidemem::chunk::{ChunkManager, ManagerConfig};
    use tidemem::device::CachingAllocator;
    let mut cfg = ManagerConfig::new(TOY.chunk_elems(), policy);
    cfg.scheduler.capacity = capacity as u64;
    cfg.scheduler.overall_fraction = 1.0;
    cfg.scheduler.warmup_chunk_fraction = 0.3;
    cfg.host_budget = host_budget;
    let mut m = ChunkManager::new(dev.clone(), cfg).unwrap();
    let pool = CachingAllocator::new(dev);
    m.set_non_model_allocator(pool.clone());
    let ids = TOY.register(&mut m).unwrap();
    (m, pool, ids)
}

/// AdamW (lr 1e-2, decay 0.01) with clipping at 0.3 and, when `scaled`, a loss scale that starts
/// at 1024 and grows every 2 clean steps: the optimizer the ZeRO and checkpoint suites train
/// with, stepping `placement`'s chunk groups on the device.
pub fn hybrid_adam(
    scaled: bool,
    placement: tidemem::optim::DevicePlacement,
) -> tidemem::optim::HybridAdam {
    use tidemem::optim::{AdamConfig, HybridAdam, HybridConfig, ScalerConfig};
    HybridAdam::new(HybridConfig {
        loss_scale: scaled.then(|| ScalerConfig {
            init_scale: 1024.0,
            growth_interval: 2,
            ..ScalerConfig::default()
        }),
        max_grad_norm: Some(0.3),
        placement,
        ..HybridConfig::new(AdamConfig::adamw(1e-2, 0.01))
    })
    .unwrap()
}

/// Checks that `got` (f32 bit patterns from a run on `dev`) holds what `want` (the same run on
/// the Sim device) does. The emulator runs the Sim device's arithmetic, so there every bit must
/// match; a GPU's cuBLAS and math library round differently, so there the norm-wise relative
/// error must stay within `tol`. The error is printed, so a GPU run reports it.
pub fn assert_same_arithmetic(dev: &Device, got: &[u32], want: &[u32], tol: f64, what: &str) {
    if is_emulated(dev) {
        assert!(
            got == want,
            "{what}: the emulator's bits differ from the Sim device's"
        );
        return;
    }
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let (g, w) = (f32::from_bits(g) as f64, f32::from_bits(w) as f64);
        assert!(g.is_finite(), "{what}: {g} on {}", dev.name());
        diff += (g - w) * (g - w);
        norm += w * w;
    }
    let err = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
    eprintln!(
        "{what}: {} against the Sim device, norm-wise relative error {err:.2e}",
        dev.name()
    );
    assert!(
        err <= tol,
        "{what}: relative error {err:.2e} over {tol:.0e} on {}",
        dev.name()
    );
}

/// Where the example `name` is built beside this test binary:
/// `target/<profile>/deps/<test>-HASH` → `target/<profile>/examples/<name>`.
fn example_path(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let file = format!("{name}{}", std::env::consts::EXE_SUFFIX);
    exe.parent()
        .and_then(std::path::Path::parent)
        .expect("target/<profile>")
        .join("examples")
        .join(file)
}

/// The example `name` that `cargo test` builds beside this test binary; the test fails,
/// saying so, when it is not built (a filtered `cargo test --test X` builds no examples:
/// `cargo build --example <name>` first).
pub fn example_binary(name: &str) -> std::path::PathBuf {
    let p = example_path(name);
    assert!(
        p.is_file(),
        "{} is not built: this test runs it (`cargo test` builds it; a filtered run needs \
         `cargo build --example {name}` first)",
        p.display()
    );
    p
}

/// Whether the environment variable `var` is `1`: a prerequisite a test would skip without is
/// required (CI sets them, so that a skipped test cannot pass for a run).
fn required(var: &str) -> bool {
    std::env::var(var).as_deref() == Ok("1")
}

/// The example `name` built beside this test binary (`target/<profile>/examples/<name>`), or
/// `None` after printing that `test` is skipped; `TIDEMEM_REQUIRE_EXAMPLES=1` makes a missing
/// example a failure (a filtered `cargo test --test X` builds no examples:
/// `cargo build --example <name>` first).
pub fn example_or_skip(test: &str, name: &str) -> Option<std::path::PathBuf> {
    let p = example_path(name);
    if p.is_file() {
        return Some(p);
    }
    assert!(
        !required("TIDEMEM_REQUIRE_EXAMPLES"),
        "{test}: TIDEMEM_REQUIRE_EXAMPLES=1 but {} is not built (`cargo build --example {name}`, \
         with --release for a release run)",
        p.display()
    );
    eprintln!(
        "{test}: skipped: {} is not built (run `cargo test`)",
        p.display()
    );
    None
}

/// The first of `compilers` that runs (`--version`), or `None` after printing that `test` is
/// skipped; `TIDEMEM_REQUIRE_CXX=1` makes a missing host C++ compiler a failure.
pub fn cxx_or_skip(test: &str, compilers: &[&'static str]) -> Option<&'static str> {
    let found = compilers.iter().copied().find(|c| {
        std::process::Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if found.is_none() {
        assert!(
            !required("TIDEMEM_REQUIRE_CXX"),
            "{test}: TIDEMEM_REQUIRE_CXX=1 but none of {compilers:?} runs"
        );
        eprintln!("{test}: skipped: no host C++ compiler ({compilers:?})");
    }
    found
}
