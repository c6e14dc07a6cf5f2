//! The simulator's step time ([`timeline`]) against measured steps on this machine, and the
//! host optimizer overlapped with backward against the serial step.
//!
//! A toy MLP (16 blocks of 512 × 512 in fp16) trains with `HybridAdam` on the host (one
//! thread; the simulated device's kernels get the other core, as a GPU and its host are two
//! machines) on a simulated device whose links run at 1 GB/s each way ([`LinkModel`]). The
//! rates come from measurements in the same run: the device's compute from a forward and
//! backward on a roomy device without a link model (the model's FLOPs over its time), the host
//! optimizer from the step alone on that device (elements over its time), the link from the
//! link model, and the file tier from writing and reading a file-backed buffer (mapped, as the
//! manager's). Three configurations:
//!
//! * roomy: every chunk fits (the host-stepped parameters still go up every step);
//! * small: the device holds the activations and a third of the parameter chunks;
//! * small + file: as small, with host memory for half the model data (the optimizer state
//!   spills to the file tier; overlapped, the groups whose state is there step during
//!   backward, the others after it).
//!
//! **Validation** (batch 1,024): each configuration's predicted step, serial, overlapped and
//! overlapped with a clip that binds every step, against the mean of measured steps (target:
//! within 15%).
//!
//! **Overlap** (batch 48, where backward, the link and the host optimizer take comparable
//! time): the measured overlapped step over the measured serial one (target ≤ 0.75) and over
//! its slowest resource's predicted busy time (target ≤ 1.15), in each configuration; with a
//! clip that binds every step (the host groups step after backward, beside the next forward),
//! overlapped over serial (target ≤ 0.85).
//!
//! Not a criterion bench: one measured run per configuration is the figure.
//!
//! ```sh
//! cargo bench --bench timeline
//! ```

use std::time::{Duration, Instant};

use tidemem::demo::{ToyIds, ToyMlp};
use tidemem::device::{Device, LinkModel, SimConfig};
use tidemem::prelude::*;
use tidemem::simulate::{simulate, timeline, Rates, SimOptions, SimOverlap, StepSchedule};

/// The validation's toy.
const TOY: ToyMlp = ToyMlp {
    layers: 16,
    width: 512,
    batch: 1024,
    tied: false,
    lr: 1e-3,
};
/// The overlap's toy: a batch small enough that the step is not all compute.
const SMALL_BATCH: ToyMlp = ToyMlp { batch: 48, ..TOY };
const STEPS: u64 = 6;
const LINK_GBPS: f64 = 1.0;

fn manager(
    toy: &ToyMlp,
    device: Device,
    host: Option<u64>,
    dir: &std::path::Path,
) -> (ChunkManager, ToyIds) {
    let mut cfg = ManagerConfig::new(toy.chunk_elems(), Policy::Tide);
    cfg.param_dtype = DType::F16;
    cfg.host_budget = host;
    cfg.file_dir = host.map(|_| dir.to_path_buf());
    let mut m = ChunkManager::new(device, cfg).expect("manager");
    let ids = toy.register(&mut m).expect("register");
    (m, ids)
}

/// Adam on the host, one thread, overlapped with the device's work or serial; with `clip`, a
/// clip that binds every step.
fn adam(overlap: bool, clip: bool) -> HybridAdam {
    HybridAdam::new(HybridConfig {
        placement: tidemem::optim::DevicePlacement::HostOnly,
        threads: 1,
        overlap,
        max_grad_norm: clip.then_some(1e-6),
        ..HybridConfig::new(AdamConfig::adam(TOY.lr))
    })
    .expect("adam")
}

/// Mean seconds of the steps after two warm ones: `step` runs one.
fn mean_step(mut step: impl FnMut(u64)) -> f64 {
    for s in 0..2 {
        step(s);
    }
    let t = Instant::now();
    for s in 2..2 + STEPS {
        step(s);
    }
    t.elapsed().as_secs_f64() / STEPS as f64
}

/// The rates of this machine's simulated device, measured.
fn measured_rates(toy: &ToyMlp, dir: &std::path::Path) -> Rates {
    let spec = toy.spec_for(DType::F16);
    let flops: u64 = spec.ops.iter().map(|o| o.flops + o.bwd_flops).sum();
    let dev = Device::sim(SimConfig::with_capacity(4 << 30)).expect("device");
    let (mut m, ids) = manager(toy, dev, None, dir);
    let mut opt = adam(false, false);
    // compute: forward and backward alone
    let compute = mean_step(|s| {
        toy.forward_backward(&mut m, &ids, s, 1.0, (0, 1))
            .expect("fwd/bwd");
        m.synchronize().expect("sync");
        m.skip_step().expect("skip");
    });
    // the host optimizer: the step alone (no link model: its copies are memcpys)
    let mut adam_time = Duration::ZERO;
    for s in 0..2 + STEPS {
        toy.forward_backward(&mut m, &ids, s, 1.0, (0, 1))
            .expect("fwd/bwd");
        m.synchronize().expect("sync");
        let t = Instant::now();
        opt.step(&mut m).expect("step");
        if s >= 2 {
            adam_time += t.elapsed();
        }
    }
    let elems = spec.params() as f64;
    // the gradient statistics' pass the step begins with, on every core as the optimizer runs
    // it: f16 gradients of every parameter, a share a thread
    let stats_time = {
        let grads = vec![half::f16::from_f32(0.01); spec.params() as usize];
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let share = grads.len().div_ceil(threads);
        let pass = || {
            std::thread::scope(|s| {
                for part in grads.chunks(share) {
                    s.spawn(move || {
                        let bytes: &[u8] = bytemuck::cast_slice(part);
                        tidemem::ops::grad_stats_of(bytes, DType::F16).expect("stats")
                    });
                }
            })
        };
        pass();
        let t = Instant::now();
        for _ in 0..STEPS {
            pass();
        }
        t.elapsed().as_secs_f64() / STEPS as f64
    };
    let step_time = adam_time.as_secs_f64() / STEPS as f64;
    // the file tier as the manager uses it: a chunk-sized file-backed buffer, mapped once,
    // written and read
    let file = {
        let store = tidemem::device::FileStore::new(dir).expect("file store");
        let bytes = toy.chunk_elems() * 4;
        let src = vec![7u8; bytes];
        let mut back = vec![0u8; bytes];
        let mut b = store.alloc(bytes).expect("file buffer");
        b.copy_from_slice(&src);
        let t = Instant::now();
        for _ in 0..8 {
            b.copy_from_slice(&src);
            back.copy_from_slice(&b);
        }
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(back[bytes - 1], 7);
        2.0 * 8.0 * bytes as f64 / secs
    };
    Rates {
        name: "this machine's simulated device, measured".into(),
        compute: flops as f64 / compute,
        h2d: LINK_GBPS * 1e9,
        d2h: LINK_GBPS * 1e9,
        // the step's own time, its statistics' pass apart
        host_adam: elems / (step_time - stats_time).max(step_time / 10.0),
        host_stats: elems / stats_time,
        device_adam: f64::MAX / 4.0,
        // (the bench runs fp32 moments)
        host_adam8: elems / (step_time - stats_time).max(step_time / 10.0),
        device_adam8: f64::MAX / 4.0,
        file,
        bus: f64::MAX / 4.0,
    }
}

/// A measured configuration: the device, host memory, and which schedule.
struct Measured {
    step: f64,
    predicted: tidemem::simulate::StepTime,
    overlap: tidemem::chunk::OverlapStats,
}

/// Trains `toy` on a device of `capacity` bytes and host memory `host` with the host groups
/// stepped as `schedule` says; the mean measured step and the simulator's prediction.
fn measure(
    toy: &ToyMlp,
    rates: &Rates,
    capacity: u64,
    host: Option<u64>,
    schedule: StepSchedule,
    clip: bool,
    dir: &std::path::Path,
) -> Measured {
    let link = LinkModel {
        h2d_gbps: LINK_GBPS,
        d2h_gbps: LINK_GBPS,
        d2d_gbps: 1000.0,
        latency: Duration::from_micros(10),
    };
    let dev = Device::sim(SimConfig::with_capacity(capacity as usize).link(link)).expect("dev");
    let (mut m, ids) = manager(toy, dev, host, dir);
    let mut opt = adam(schedule == StepSchedule::Overlapped, clip);
    let dev = m.device().clone();
    let step = mean_step(|s| {
        toy.forward_backward(&mut m, &ids, s, 1.0, (0, 1))
            .expect("fwd/bwd");
        // (host steps still running beside the next forward when a step returns are counted
        // at the window's start and left out at its end: the same work, steady state)
        opt.step(&mut m).expect("step");
    });
    // where the measured steps' time went, over one more step (outside the timing)
    dev.start_profile();
    toy.forward_backward(&mut m, &ids, 2 + STEPS, 1.0, (0, 1))
        .expect("fwd/bwd");
    opt.step(&mut m).expect("step");
    let profile = dev.stop_profile().expect("profile");
    if std::env::var_os("TIDEMEM_TIMELINE_PROFILE").is_some() {
        println!("{profile}");
    }
    let mut opts = SimOptions::new(capacity, host.unwrap_or(1 << 40));
    opts.chunk_elems = Some(toy.chunk_elems());
    opts.scheduler = *m.scheduler().expect("steady").config();
    opts.param_bytes = 2;
    // the measured optimizer has no loss scaler: without a clip its host groups step in place
    // during backward, with one that binds every step after it
    opts.overlap = match clip {
        false => SimOverlap::InPlace,
        true => SimOverlap::Clipped,
    };
    let spec = toy.spec_for(DType::F16);
    let predicted = timeline(&spec, Policy::Tide, &opts, rates, schedule).expect("timeline");
    Measured {
        step,
        predicted,
        overlap: m.overlap_stats(),
    }
}

/// The configurations for `toy`: roomy, small, small + file.
fn configs(toy: &ToyMlp) -> [(&'static str, u64, Option<u64>); 3] {
    let spec = toy.spec_for(DType::F16);
    let model = simulate(&spec, Policy::Tide, &SimOptions::new(1 << 40, 1 << 40))
        .expect("simulate")
        .model_data_bytes;
    let params = spec.params() * 2;
    let peak = toy.non_model_peak(DType::F16) as u64;
    // room for the activations (and the pool's rounding) and a third of the parameters
    let small = peak + peak / 4 + params / 3;
    [
        ("roomy", 4u64 << 30, None),
        ("small", small, None),
        ("small + file", small, Some(model / 2)),
    ]
}

fn print_rates(toy: &ToyMlp, rates: &Rates) {
    println!(
        "batch {}: rates measured here: compute {:.1} GFLOP/s, link {LINK_GBPS} GB/s each way, \
         host Adam {:.0} M elements/s, its gradient statistics {:.0} M elements/s, file {:.2} GB/s",
        toy.batch,
        rates.compute / 1e9,
        rates.host_adam / 1e6,
        rates.host_stats / 1e6,
        rates.file / 1e9
    );
}

fn main() {
    let dir = std::env::temp_dir().join(format!("tidemem-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch directory");
    if std::env::args().any(|a| a == "--overlap-part") {
        overlap(&dir);
        std::fs::remove_dir_all(&dir).ok();
        return;
    }
    validate(&dir);
    // the overlap in a process of its own, whose simulated device's kernels get one core and
    // the host optimizer the other, as a GPU and its host are two machines (the thread count
    // is read once per process)
    let me = std::env::current_exe().expect("this bench's path");
    let status = std::process::Command::new(me)
        .arg("--overlap-part")
        .env("TIDEMEM_SIM_THREADS", "1")
        .status()
        .expect("the overlap part");
    assert!(status.success(), "the overlap part failed");
    std::fs::remove_dir_all(&dir).ok();
}

/// Predicted against measured steps, serial and overlapped, at batch 1,024.
fn validate(dir: &std::path::Path) {
    let dir = dir.to_path_buf();
    let dir = &dir;

    let rates = measured_rates(&TOY, dir);
    print_rates(&TOY, &rates);
    println!(
        "{:<14} {:<10} {:>11} {:>11} {:>7}   predicted busy: compute / h2d / d2h / host Adam / file (ms)",
        "config", "schedule", "predicted", "measured", "ratio"
    );
    let ms = |x: f64| x * 1e3;
    let mut worst: f64 = 0.0;
    for (name, capacity, host) in configs(&TOY) {
        let runs = [
            (StepSchedule::Serial, false),
            (StepSchedule::Overlapped, false),
            (StepSchedule::Overlapped, true),
        ];
        for (schedule, clip) in runs {
            let r = measure(&TOY, &rates, capacity, host, schedule, clip, dir);
            let t = &r.predicted;
            let ratio = t.step / r.step;
            worst = worst.max((ratio - 1.0).abs());
            println!(
                "{name:<14} {:<10} {:>9.1}ms {:>9.1}ms {:>7.3}   {:.1} / {:.1} / {:.1} / {:.1} / {:.1}",
                match clip {
                    false => format!("{schedule:?}").to_lowercase(),
                    true => "clipped".into(),
                },
                ms(t.step),
                ms(r.step),
                ratio,
                ms(t.compute),
                ms(t.h2d),
                ms(t.d2h),
                ms(t.host_adam),
                ms(t.file)
            );
        }
    }
    println!(
        "worst prediction off by {:.1}% (target ≤ 15%)",
        100.0 * worst
    );
}

/// The overlapped step against the serial one, and against its slowest resource, at batch 48.
fn overlap(dir: &std::path::Path) {
    let ms = |x: f64| x * 1e3;
    let toy = SMALL_BATCH;
    let rates = measured_rates(&toy, dir);
    print_rates(&toy, &rates);
    for (name, capacity, host) in configs(&toy) {
        let both = |clip| {
            let run = |schedule| measure(&toy, &rates, capacity, host, schedule, clip, dir);
            (run(StepSchedule::Serial), run(StepSchedule::Overlapped))
        };
        let (serial, over) = both(false);
        let o = over.overlap;
        assert!(o.kept > 0 && o.redone == 0, "{name}: {o:?}");
        let (slowest, busy) = over.predicted.slowest();
        println!(
            "{name}: serial {:.1} ms, overlapped {:.1} ms: overlapped ÷ serial {:.3} (target ≤ \
             0.75); ÷ its slowest resource ({slowest}, {:.1} ms) {:.3} (target ≤ 1.15)",
            ms(serial.step),
            ms(over.step),
            over.step / serial.step,
            ms(busy),
            over.step / busy
        );
        // a clip that binds every step: the host groups step after backward, beside the next
        // forward
        let (serial, over) = both(true);
        let o = over.overlap;
        assert!(o.deferred > 0 && o.kept == 0, "{name}, clipped: {o:?}");
        println!(
            "{name}, a clip binding every step: serial {:.1} ms, overlapped {:.1} ms: overlapped \
             ÷ serial {:.3} (target ≤ 0.85); predicted {:.1} ms, predicted ÷ measured {:.3}",
            ms(serial.step),
            ms(over.step),
            over.step / serial.step,
            ms(over.predicted.step),
            over.predicted.step / over.step,
        );
    }
}
