//! The simulator on GPT-2 1.5B: the tide policy against the offline lower bound and the baselines.

use tidemem::models::gpt::GptConfig;
use tidemem::optim::ShadowBudget;
use tidemem::simulate::{simulate, SimOptions, SimOverlap};
use tidemem::tide::Policy;

/// Options whose device leaves, at the tightest moment of the iteration, a chunk budget of
/// `fraction` × the parameter chunk bytes.
fn options_for(fraction: f64) -> (tidemem::simulate::ModelSpec, SimOptions) {
    let spec = GptConfig::preset("gpt2-1.5b")
        .unwrap()
        .spec(8, 1024, true)
        .unwrap();
    let mut probe = SimOptions::new(1 << 50, 1 << 50);
    probe.iterations = 1;
    let r = simulate(&spec, Policy::Tide, &probe).unwrap();
    let device =
        ((r.peak_non_model as f64 + fraction * r.param_chunk_bytes as f64) / 0.9).ceil() as u64;
    (spec, SimOptions::new(device, 64 << 30))
}

#[test]
fn gpt2_1_5b_at_a_quarter_of_the_parameter_chunks() {
    let (spec, opts) = options_for(0.25);
    let run = |p| simulate(&spec, p, &opts).unwrap();
    let tide = run(Policy::Tide);
    let ps = run(Policy::PatrickStar);
    let lru = run(Policy::Lru);
    let all_host = run(Policy::Static {
        device_fraction: 0.0,
    });
    let q = tide.param_chunk_bytes / 4;
    assert!(
        tide.min_budget.abs_diff(q) < q / 100,
        "budget {} vs {}",
        tide.min_budget,
        q
    );
    let total = |r: &tidemem::simulate::SimReport| r.steady.h2d_bytes + r.steady.d2h_bytes;
    let bound = tide.bound.total();
    assert!(
        total(&tide) as f64 <= 1.1 * bound as f64,
        "tide {} bound {}",
        total(&tide),
        bound
    );
    // PatrickStar moves 2L for L bytes of loads; any schedule moves at least L + P (gradients come
    // back) and L <= 2P here, so no policy can beat 0.75 × PatrickStar on this trace (docs/memory.md).
    let ratio = total(&tide) as f64 / total(&ps) as f64;
    assert!(ratio <= 0.8, "tide / patrickstar = {ratio}");
    assert_eq!(
        tide.steady.d2h_bytes, tide.param_chunk_bytes,
        "tide writes back gradients only"
    );
    assert_eq!(
        tide.steady.h2d_bytes, ps.steady.h2d_bytes,
        "same victims, same loads"
    );
    assert!(total(&tide) < total(&lru));
    assert!(total(&all_host) > 4 * total(&tide));
    // every policy respects the same budget
    for r in [&tide, &ps, &lru, &all_host] {
        assert!(r.device_peak <= opts.device_mem, "{}", r.policy);
    }
}

/// The largest model counts the overlapped step's host memory: none serially or in place, and
/// shadows of the optimizer state (16 bytes an element with the parameter-sized buffers)
/// within their budget.
#[test]
fn the_largest_model_counts_the_overlaps_host_memory() {
    let base = GptConfig::preset("gpt2-1.5b").unwrap();
    let host = 64u64 << 30;
    let at = |overlap: SimOverlap| {
        let mut o = SimOptions::new(8 << 30, host);
        o.overlap = overlap;
        base.largest_fitting([8, 1024], true, Policy::Tide, &o, 0)
            .unwrap()
            .unwrap()
    };
    let (serial, rs) = at(SimOverlap::Serial);
    let (in_place, ri) = at(SimOverlap::InPlace);
    let (shadowed, rw) = at(SimOverlap::Shadowed(ShadowBudget::Bytes(u64::MAX)));
    let (auto, ra) = at(SimOverlap::Shadowed(ShadowBudget::Auto));
    assert_eq!(rs.overlap_host_bytes, 0);
    for r in [&rs, &ri, &rw, &ra] {
        assert!(r.model_data_bytes + r.overlap_host_bytes <= host, "{r:?}");
    }
    // 14 bytes an element of model data; 16 more with every shadow
    assert!(serial.layers >= in_place.layers && in_place.layers > shadowed.layers);
    assert!(
        shadowed.layers * 19 < serial.layers * 10,
        "{} layers with every shadow, {} serial",
        shadowed.layers,
        serial.layers
    );
    // the automatic budget is half of what the model data leaves
    assert!(
        ra.overlap_host_bytes <= (host - ra.model_data_bytes) / 2,
        "{ra:?}"
    );
    assert!(
        auto.layers > shadowed.layers,
        "{} ≤ {}",
        auto.layers,
        shadowed.layers
    );
}

/// 8-bit moments (`MomentStorage::Int8`): 8.03 bytes of model data a parameter against 14,
/// and a largest model at least 1.5 times the fp32 moments' on the same host.
#[test]
fn eight_bit_moments_grow_the_largest_model() {
    use tidemem::chunk::MomentStorage;
    let base = GptConfig::preset("gpt2-1.5b").unwrap();
    let at = |moments: MomentStorage| {
        // a device roomy enough that the host binds
        let mut o = SimOptions::new(80 << 30, 64 << 30);
        o.moments = moments;
        base.largest_fitting([8, 1024], true, Policy::Tide, &o, 0)
            .unwrap()
            .unwrap()
    };
    let ((f32c, f32r), (q8c, q8r)) = (at(MomentStorage::F32), at(MomentStorage::Int8));
    let per = |r: &tidemem::simulate::SimReport, c: &GptConfig| {
        r.model_data_bytes as f64 / c.params() as f64
    };
    // 14 and 8.03 bytes a parameter, the chunks' padding on both
    let (f, q) = (per(&f32r, &f32c), per(&q8r, &q8c));
    assert!(
        (14.0..14.5).contains(&f) && (0.56..0.58).contains(&(q / f)),
        "{f} {q}"
    );
    assert!(
        q8c.params() as f64 >= 1.5 * f32c.params() as f64,
        "{} against {}",
        q8c.params(),
        f32c.params()
    );
    assert_eq!(MomentStorage::Int8.bytes(1000), 1000 + 4 * 4);
    assert_eq!(MomentStorage::F32.bytes(1000), 4000);
}

#[test]
fn largest_model_grows_with_host_memory() {
    let base = GptConfig::preset("gpt2-1.5b").unwrap();
    let opts = |host: u64| SimOptions::new(8 << 30, host << 30);
    let (small, r16) = base
        .largest_fitting([8, 1024], true, Policy::Tide, &opts(16), 0)
        .unwrap()
        .unwrap();
    let (large, r64) = base
        .largest_fitting([8, 1024], true, Policy::Tide, &opts(64), 0)
        .unwrap()
        .unwrap();
    assert!(
        large.layers > 3 * small.layers,
        "{} vs {}",
        large.layers,
        small.layers
    );
    assert!(r16.model_data_bytes <= 16 << 30);
    assert!(r64.model_data_bytes <= 64 << 30);
    // one more layer would not fit
    let more = GptConfig {
        layers: large.layers + 1,
        ..base.clone()
    }
    .spec(8, 1024, true)
    .unwrap();
    let r = simulate(&more, Policy::Tide, &opts(64));
    assert!(r.map_or(true, |r| r.model_data_bytes > 64 << 30));
}

/// The step-time prediction on GPT-2 1.5B at a quarter of its parameter chunks, Adam on the
/// host: the device computes exactly the model's FLOPs, the host steps every parameter once, the
/// link carries the simulator's bytes, and overlapping the host's step with backward shortens
/// the step without changing any resource's work.
#[test]
fn the_timeline_charges_the_models_work() {
    use tidemem::simulate::{timeline, Rates, StepSchedule};
    let (spec, opts) = options_for(0.25);
    let rates = Rates::profile("h100-pcie5").unwrap();
    let sim = simulate(&spec, Policy::Tide, &opts).unwrap();
    let serial = timeline(&spec, Policy::Tide, &opts, &rates, StepSchedule::Serial).unwrap();
    let over = timeline(&spec, Policy::Tide, &opts, &rates, StepSchedule::Overlapped).unwrap();
    let flops: u64 = spec.ops.iter().map(|o| o.flops + o.bwd_flops).sum();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.max(1e-12);
    assert!(
        close(serial.compute, flops as f64 / rates.compute),
        "{serial:?}"
    );
    // every parameter once (chunk padding included, so at least the parameters), and the
    // gradient statistics' pass over each gradient before its step
    let per_elem = 1.0 / rates.host_adam + 1.0 / rates.host_stats;
    let elems = serial.host_adam / per_elem;
    assert!(
        elems >= spec.params() as f64 && elems < 1.01 * spec.params() as f64,
        "{elems}"
    );
    assert!(
        close(serial.h2d, sim.steady.h2d_bytes as f64 / rates.h2d),
        "{serial:?} {sim:?}"
    );
    assert!(
        close(serial.d2h, sim.steady.d2h_bytes as f64 / rates.d2h),
        "{serial:?}"
    );
    for (a, b) in [
        (over.compute, serial.compute),
        (over.h2d, serial.h2d),
        (over.d2h, serial.d2h),
        (over.host_adam, serial.host_adam),
    ] {
        assert!(close(a, b));
    }
    assert!(over.step < serial.step, "{over:?} vs {serial:?}");
    assert!(
        over.over_slowest() >= 1.0 - 1e-9 && serial.over_slowest() > over.over_slowest(),
        "{over:?} vs {serial:?}"
    );
    eprintln!(
        "GPT-2 1.5B at h100-pcie5 rates: serial {:.1} ms ({:.2} of its slowest resource), \
         overlapped {:.1} ms ({:.2})",
        serial.step * 1e3,
        serial.over_slowest(),
        over.step * 1e3,
        over.over_slowest()
    );
}

/// The step-time model on a small GPT (`simulate::timeline`).
mod timeline {
    use tidemem::models::gpt::GptConfig;
    use tidemem::simulate::{timeline, ModelSpec, Rates, SimOptions, StepSchedule, StepTime};
    use tidemem::tide::Policy;

    fn small() -> ModelSpec {
        let c = GptConfig {
            layers: 4,
            channels: 256,
            heads: 4,
            vocab: 4096,
            max_seq: 128,
            eps: 1e-5,
        };
        c.spec(2, 128, false).unwrap()
    }

    fn rates() -> Rates {
        Rates {
            name: "test".into(),
            compute: 1e12,
            h2d: 10e9,
            d2h: 10e9,
            host_adam: 1e9,
            host_stats: 1e10,
            device_adam: 1e11,
            host_adam8: 0.5e9,
            device_adam8: 1.5e11,
            file: 1e9,
            bus: 100e9,
        }
    }

    fn run(opts: &SimOptions, r: &Rates, s: StepSchedule) -> StepTime {
        timeline(&small(), Policy::Tide, opts, r, s).unwrap()
    }

    /// 8-bit moments step at their own rates: the host's optimizer time is its elements at
    /// `host_adam8` (plus the statistics), not at `host_adam`.
    #[test]
    fn eight_bit_moments_step_at_their_own_rates() {
        use tidemem::chunk::MomentStorage;
        let mut opts = SimOptions::new(1 << 40, 1 << 40);
        opts.optimizer = tidemem::optim::DevicePlacement::HostOnly;
        let r = Rates {
            host_stats: 1e15,
            ..rates()
        };
        let f32s = run(&opts, &r, StepSchedule::Serial);
        opts.moments = MomentStorage::Int8;
        let int8 = run(&opts, &r, StepSchedule::Serial);
        let ratio = int8.host_adam / f32s.host_adam;
        assert!(
            (ratio - r.host_adam / r.host_adam8).abs() < 1e-3,
            "{ratio}: {} against {}",
            int8.host_adam,
            f32s.host_adam
        );
        assert!(
            int8.step > f32s.step,
            "the host's optimizer is the slowest here"
        );
    }

    /// Every configuration: the step is at least its busiest resource, and at most the sum of
    /// every resource's time (nothing runs twice); overlap never lengthens it.
    #[test]
    fn a_step_lies_between_its_slowest_resource_and_the_sum() {
        let spec = small();
        let model = {
            let r = tidemem::simulate::simulate(
                &spec,
                Policy::Tide,
                &SimOptions::new(1 << 40, 1 << 40),
            )
            .unwrap();
            r.model_data_bytes
        };
        for (device, host) in [
            (1u64 << 40, 1u64 << 40),
            (model / 3 + (8 << 20), 1 << 40),
            (model / 3 + (8 << 20), model / 2),
        ] {
            let opts = SimOptions::new(device, host);
            for host_adam in [1e8, 1e9, 1e11] {
                let r = Rates {
                    host_adam,
                    host_stats: 10.0 * host_adam,
                    ..rates()
                };
                let serial = run(&opts, &r, StepSchedule::Serial);
                let over = run(&opts, &r, StepSchedule::Overlapped);
                for t in [&serial, &over] {
                    let sum = t.compute + t.h2d + t.d2h + t.host_adam + t.file;
                    assert!(t.over_slowest() >= 1.0 - 1e-9, "{t:?}");
                    assert!(t.step <= sum * (1.0 + 1e-9), "{t:?}");
                }
                assert!(
                    over.step <= serial.step * (1.0 + 1e-9),
                    "{over:?} {serial:?}"
                );
                // the same work on both schedules
                assert_eq!(
                    (over.compute, over.h2d, over.host_adam),
                    (serial.compute, serial.h2d, serial.host_adam)
                );
            }
        }
    }

    /// Resident with Adam on the host: the serial step is backward then the host's Adam (the
    /// forward's loads wait for it); overlapped, the host's Adam of all but the last groups hides
    /// under backward.
    #[test]
    fn overlap_hides_the_host_step_under_backward() {
        let opts = SimOptions::new(1 << 40, 1 << 40);
        // a host optimizer about as slow as backward
        let probe = run(&opts, &rates(), StepSchedule::Serial);
        let scale = probe.host_adam / (0.6 * probe.compute);
        let r = Rates {
            host_adam: rates().host_adam * scale,
            host_stats: rates().host_stats * scale,
            ..rates()
        };
        let serial = run(&opts, &r, StepSchedule::Serial);
        let over = run(&opts, &r, StepSchedule::Overlapped);
        assert!(
            serial.step >= serial.compute + 0.9 * serial.host_adam,
            "{serial:?}"
        );
        // all but the embedding's group (the first forward use, the last backward one)
        assert!(
            over.step < serial.step - 0.2 * serial.host_adam,
            "{over:?} vs {serial:?}"
        );
        assert!(over.over_slowest() < serial.over_slowest());
    }

    /// A redone step (its early steps thrown away) is charged the host's work of the early
    /// groups twice: the clipped step's schedule after backward plus the thrown-away steps
    /// during it, in the shadowed step's memory.
    #[test]
    fn a_redone_step_charges_the_early_groups_twice() {
        use tidemem::optim::ShadowBudget;
        use tidemem::simulate::{simulate, SimOverlap};
        let at = |overlap: SimOverlap| {
            let mut o = SimOptions::new(1 << 40, 1 << 40);
            o.overlap = overlap;
            o
        };
        let budget = ShadowBudget::Bytes(u64::MAX);
        let (kept, redone) = (
            at(SimOverlap::Shadowed(budget)),
            at(SimOverlap::Redone(budget)),
        );
        let clipped = at(SimOverlap::Clipped);
        // a host twice as slow as the compute
        let slow = Rates {
            host_adam: 5e8,
            host_stats: 5e9,
            ..rates()
        };
        let over = |o: &SimOptions| run(o, &slow, StepSchedule::Overlapped);
        let (k, r, c) = (over(&kept), over(&redone), over(&clipped));
        // every host group steps early with every shadow: the host's work twice
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b;
        assert!(close(r.host_adam, 2.0 * k.host_adam), "{r:?} {k:?}");
        assert!(close(c.host_adam, k.host_adam));
        // host-bound: the step takes the host's doubled work, longer than the clipped step
        let more = r.step >= r.host_adam * (1.0 - 1e-9) && r.step > c.step;
        assert!(more && c.step >= k.step, "{r:?} {c:?} {k:?}");
        let bytes = |o: &SimOptions| simulate(&small(), Policy::Tide, o).unwrap();
        let bytes = |o| bytes(o).overlap_host_bytes;
        assert!(bytes(&redone) > 0 && bytes(&redone) == bytes(&kept));
    }

    /// Model data beyond host memory goes through the file tier, which the timeline charges.
    #[test]
    fn the_file_tier_is_charged() {
        let all = run(
            &SimOptions::new(1 << 40, 1 << 40),
            &rates(),
            StepSchedule::Serial,
        );
        assert_eq!(all.file, 0.0);
        let spec = small();
        let model =
            tidemem::simulate::simulate(&spec, Policy::Tide, &SimOptions::new(1 << 40, 1 << 40))
                .unwrap()
                .model_data_bytes;
        let spill = run(
            &SimOptions::new(1 << 40, model / 2),
            &rates(),
            StepSchedule::Serial,
        );
        assert!(spill.file > 0.0 && spill.step > all.step, "{spill:?}");
    }

    #[test]
    fn bad_rates_are_refused() {
        let opts = SimOptions::new(1 << 40, 1 << 40);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let r = Rates {
                h2d: bad,
                ..rates()
            };
            assert!(timeline(&small(), Policy::Tide, &opts, &r, StepSchedule::Serial).is_err());
        }
        assert!(Rates::profile("h100-pcie5").unwrap().validate().is_ok());
        assert!(Rates::profile("nope").is_none());
    }
}

/// ZeRO ranks in the simulator (`simulate::shard`).
mod zero {
    use tidemem::models::gpt::GptConfig;
    use tidemem::simulate::{shard, simulate, SimOptions};
    use tidemem::tide::Policy;

    #[test]
    fn a_rank_holds_its_share_and_gathers_each_op() {
        let spec = GptConfig::preset("gpt2")
            .unwrap()
            .spec(8, 1024, true)
            .unwrap();
        let one = shard(&spec, 1, 2).unwrap();
        assert_eq!(one.params(), spec.params());
        let s = shard(&spec, 8, 2).unwrap();
        assert!(s.params() * 8 >= spec.params() && s.params() * 8 < spec.params() + 8 * 1000);
        for (a, b) in s.ops.iter().zip(&spec.ops) {
            let full: u64 = b
                .tensors
                .iter()
                .map(|&t| spec.tensors[t].1 as u64 * 2)
                .sum();
            assert_eq!(a.fwd_non_model, b.fwd_non_model + full);
            assert_eq!(a.flops, b.flops, "each rank computes its whole micro-batch");
        }
        assert!(shard(&spec, 0, 2).is_err());
        // one rank's model data is an eighth of the whole, the host's memory shared by eight
        let whole = simulate(&spec, Policy::Tide, &SimOptions::new(1 << 40, 1 << 40)).unwrap();
        let mut opts = SimOptions::new(1 << 40, 1 << 40);
        opts.ranks = 8;
        let rank = simulate(&spec, Policy::Tide, &opts).unwrap();
        let ratio = whole.model_data_bytes as f64 / rank.model_data_bytes as f64;
        assert!((7.0..=8.5).contains(&ratio), "{ratio}");
        assert!(rank.peak_non_model > whole.peak_non_model);
    }

    /// Over ranks the timeline charges a gather a stage and a reduce-scatter for each
    /// parameter chunk, on the bus; the step still lies between its slowest resource and the
    /// sum, and one rank has no collective.
    #[test]
    fn the_timeline_charges_the_collectives() {
        use tidemem::simulate::{timeline, Rates, StepSchedule};
        let spec = GptConfig::preset("gpt2")
            .unwrap()
            .spec(8, 1024, true)
            .unwrap();
        let rates = Rates::profile("h100-pcie5").unwrap();
        let mut opts = SimOptions::new(80 << 30, 1 << 40);
        let one = timeline(&spec, Policy::Tide, &opts, &rates, StepSchedule::Overlapped).unwrap();
        assert_eq!(one.collective, 0.0);
        opts.ranks = 4;
        let four = timeline(&spec, Policy::Tide, &opts, &rates, StepSchedule::Overlapped).unwrap();
        // each rank's shard of every parameter chunk, 3 shards each way, three times a step
        let report = simulate(&spec, Policy::Tide, &opts).unwrap();
        let want = 3.0 * 3.0 * report.param_chunk_bytes as f64 / rates.bus;
        assert!(
            (four.collective - want).abs() <= 1e-9 * want,
            "{} vs {want}",
            four.collective
        );
        let sum = four.compute + four.h2d + four.d2h + four.host_adam + four.file + four.collective;
        assert!(four.over_slowest() >= 1.0 - 1e-9 && four.step <= sum * (1.0 + 1e-9));
        // the host's optimizer shared by four ranks, each stepping a quarter of the elements
        // (and its chunks' padding: a quarter of the embedding pads more)
        let r = four.host_adam / one.host_adam;
        assert!((0.9..1.5).contains(&r), "{r}");
    }
}

/// Where the host's Adam is the slowest resource, the first host groups stepped after backward
/// (in the next forward's order) rather than last in backward's shorten the overlapped step.
#[test]
fn a_tail_of_host_groups_after_backward_shortens_a_host_bound_step() {
    use tidemem::simulate::{timeline, Rates, StepSchedule};
    let spec = GptConfig::preset("gpt2-1.5b")
        .unwrap()
        .spec(8, 1024, true)
        .unwrap();
    let rates = Rates::profile("h100-pcie5").unwrap();
    let opts = SimOptions {
        overlap: SimOverlap::InPlace,
        ..SimOptions::new(8 << 30, 64 << 30)
    };
    let step = |tail: usize| {
        let o = SimOptions {
            overlap_tail: tail,
            ..opts.clone()
        };
        timeline(&spec, Policy::Tide, &o, &rates, StepSchedule::Overlapped)
            .unwrap()
            .step
    };
    let none = step(0);
    let best = (1..8).map(|i| step(i * 8)).fold(f64::INFINITY, f64::min);
    assert!(best < 0.98 * none, "best tail {best} s, none {none} s");
}

/// The time model's placement (`simulate::plan`).
mod plan {
    use tidemem::models::gpt::GptConfig;
    use tidemem::optim::{DevicePlacement, ShadowBudget};
    use tidemem::simulate::{
        plan, timeline, ModelSpec, Rates, SimOptions, SimOverlap, StepSchedule,
    };
    use tidemem::tide::Policy;

    fn gpt() -> ModelSpec {
        let mut c = GptConfig::preset("gpt2").unwrap();
        c.layers = 6;
        c.spec(4, 512, true).unwrap()
    }

    fn opts(device: u64) -> SimOptions {
        let mut o = SimOptions::new(device, 64 << 30);
        o.chunk_elems = Some(4 << 20);
        o.optimizer = DevicePlacement::Auto { fraction: 0.8 };
        o.overlap = SimOverlap::Shadowed(ShadowBudget::Auto);
        o
    }

    #[test]
    fn a_slow_host_keeps_every_group_the_memory_rule_places_on_the_device() {
        let rates = Rates {
            host_adam: 1e6,
            host_stats: 1e7,
            ..Rates::profile("h100-pcie5").unwrap()
        };
        let (spec, o) = (gpt(), opts(8 << 30));
        let p = plan(&spec, Policy::Tide, &o, &rates, StepSchedule::Overlapped).unwrap();
        assert!(p.memory_groups > 0);
        assert_eq!(p.device_groups, p.memory_groups);
    }

    #[test]
    fn a_fast_host_steps_groups_the_memory_rule_places_on_the_device_beside_backward() {
        // on a server's host the overlapped host step hides under backward, while a device
        // group's step runs on the device after it
        let rates = Rates::profile("h100-server").unwrap();
        let mut c = GptConfig::preset("gpt2-1.5b").unwrap();
        c.layers = 12;
        let spec = c.spec(8, 1024, true).unwrap();
        let mut o = SimOptions::new(16 << 30, 256 << 30);
        o.optimizer = DevicePlacement::Auto { fraction: 0.8 };
        let p = plan(&spec, Policy::Tide, &o, &rates, StepSchedule::Overlapped).unwrap();
        assert!(p.device_groups < p.memory_groups, "{p:?}");
        assert!(p.step.step < p.memory_step, "{p:?}");
    }

    #[test]
    fn a_host_bound_overlapped_step_moves_groups_after_backward_only_where_shorter() {
        let rates = Rates::profile("h100-pcie5").unwrap();
        let mut o = opts(8 << 30);
        o.optimizer = DevicePlacement::HostOnly;
        let spec = gpt();
        let p = plan(&spec, Policy::Tide, &o, &rates, StepSchedule::Overlapped).unwrap();
        assert_eq!((p.memory_groups, p.device_groups), (0, 0));
        let o = SimOptions {
            overlap_tail: p.overlap_tail,
            ..o
        };
        let t = timeline(&spec, Policy::Tide, &o, &rates, StepSchedule::Overlapped).unwrap();
        assert_eq!(t.step, p.step.step);
        assert!(p.overlap_tail == 0 || p.step.step < p.memory_step);
    }
}
