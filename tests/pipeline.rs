//! Pipeline parallelism on the memory layer: a toy model of 4 linear layers (GELU between,
//! sum-of-squares loss) split over 2 and 4 in-process ranks and trained with 1F1B (and GPipe)
//! in one store iteration per step gives, after 1 and 3 Adam steps, the parameters of the
//! single-rank model trained with gradient accumulation over the same micro-batches.

mod common;

use std::time::Duration;

use tidemem::comm::Communicator;
use tidemem::nn::{gelu, gelu_backward, GeluSaved, Linear};
use tidemem::optim::DevicePlacement;
use tidemem::parallel::pipeline::{PipelineStage, Schedule, StageModel, StageReport};
use tidemem::parallel::{GridSpec, ProcessGrid, TensorMode};
use tidemem::prelude::*;
use tidemem::zero::ZeroManager;

/// Layer `i` maps `DIMS[i]` features to `DIMS[i + 1]`.
const DIMS: [usize; 5] = [6, 8, 8, 8, 4];
const LAYERS: usize = 4;
const ROWS: usize = 4;

fn manager(dev: Device) -> ChunkManager {
    let mut cfg = ManagerConfig::new(256, Policy::Tide);
    cfg.param_dtype = DType::F32;
    ChunkManager::new(dev, cfg).unwrap()
}

fn adam(accumulation_steps: u32) -> HybridAdam {
    HybridAdam::new(HybridConfig {
        placement: DevicePlacement::HostOnly,
        accumulation_steps,
        ..HybridConfig::new(AdamConfig::adam(1e-2))
    })
    .unwrap()
}

/// Micro-batch `m` of step `step`: `[ROWS, DIMS[0]]`.
fn data(step: usize, m: usize) -> Vec<f32> {
    (0..ROWS * DIMS[0])
        .map(|i| {
            let h = tidemem::rng::splitmix64((step * 1000 + m * 97 + i) as u64);
            ((h % 2001) as f32 - 1000.0) / 1000.0
        })
        .collect()
}

/// Layers `range` of the toy model: `x → [GELU unless the model's first layer] → Linear`,
/// the loss `scale · Σ y²` after the model's last layer.
struct Toy {
    layers: Vec<(usize, Linear)>,
    scale: f32,
    step: usize,
    /// A forward of this micro-batch fails.
    fail_at: Option<usize>,
    /// Whether `params` lists the parameters (the driver declares the late forwards' uses).
    declare: bool,
    /// A stream of batches of this many micro-batches (PipeDream-2BW without a flush):
    /// micro-batch `j` is micro-batch `j % every` of step `j / every`.
    every: Option<usize>,
    /// Added to the micro-batch index of the data (a data-parallel replica's own batches).
    salt: usize,
}

struct Saved {
    /// Each layer's GELU (all but the first) and what went into its linear (after the GELU).
    xs: Vec<(Option<GeluSaved>, Act)>,
    /// The last layer's output on the host (the last stage).
    y: Option<Vec<f32>>,
}

impl Toy {
    fn register(store: &mut ChunkManager, range: std::ops::Range<usize>, scale: f32) -> Toy {
        Toy::register_named(store, "", range, scale)
    }

    /// [`Toy::register`] with `prefix` before each layer's name.
    fn register_named(
        store: &mut impl ParamStore,
        prefix: &str,
        range: std::ops::Range<usize>,
        scale: f32,
    ) -> Toy {
        let layers = range
            .map(|i| {
                let name = format!("{prefix}l{i}");
                let l = Linear::register(store, &name, DIMS[i], DIMS[i + 1], true, None).unwrap();
                (i, l.shared())
            })
            .collect();
        Toy {
            layers,
            scale,
            step: 0,
            fail_at: None,
            declare: true,
            every: None,
            salt: 0,
        }
    }

    fn first(&self) -> bool {
        self.layers[0].0 == 0
    }

    fn last(&self) -> bool {
        self.layers.last().unwrap().0 == LAYERS - 1
    }
}

impl StageModel for Toy {
    type Saved = Saved;

    fn params(&self) -> Vec<TensorId> {
        if !self.declare {
            return Vec::new();
        }
        self.layers.iter().flat_map(|(_, l)| l.params()).collect()
    }

    fn input_shape(&self, _micro: usize) -> Result<[usize; 2]> {
        Ok([ROWS, DIMS[self.layers[0].0]])
    }

    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        micro: usize,
        input: Option<&Act>,
    ) -> Result<(Act, Saved)> {
        if self.fail_at == Some(micro) {
            return Err(Error::InvalidArgument(format!("forward {micro} fails")));
        }
        let mut x = match input {
            Some(a) => a.clone(),
            None => Act::upload(
                pass.pool(),
                pass.stream(),
                ROWS,
                DIMS[0],
                DType::F32,
                &match self.every {
                    Some(every) => data(micro / every, micro % every + self.salt),
                    None => data(self.step, micro + self.salt),
                },
            )?,
        };
        let mut xs = Vec::new();
        for &(i, l) in &self.layers {
            let (h, g) = match i {
                0 => (x.clone(), None),
                _ => gelu(pass, &x).map(|(h, g)| (h, Some(g)))?,
            };
            let y = l.forward(pass, &h)?;
            xs.push((g, h));
            x = y;
        }
        if !self.last() {
            return Ok((x, Saved { xs, y: None }));
        }
        let y = x.to_f32(pass.stream())?;
        let loss = self.scale * y.iter().map(|v| v * v).sum::<f32>();
        let holder = Act::upload(pass.pool(), pass.stream(), 1, 1, DType::F32, &[loss])?;
        Ok((holder, Saved { xs, y: Some(y) }))
    }

    fn backward(
        &self,
        pass: &mut BackwardPass<'_>,
        _micro: usize,
        saved: Saved,
        dout: Option<&Act>,
    ) -> Result<Option<Act>> {
        let mut dy = match (&saved.y, dout) {
            (Some(y), _) => {
                let g: Vec<f32> = y.iter().map(|v| 2.0 * v * self.scale).collect();
                Act::upload(
                    pass.pool(),
                    pass.stream(),
                    ROWS,
                    DIMS[LAYERS],
                    DType::F32,
                    &g,
                )?
            }
            (None, Some(d)) => d.clone(),
            (None, None) => return Err(Error::InvalidArgument("no output gradient".into())),
        };
        let first = self.first();
        for (&(i, l), (x, h)) in self.layers.iter().zip(&saved.xs).rev() {
            let dh = l.backward(pass, h, &dy, i > 0 || !first)?;
            match (i, dh) {
                (0, _) => return Ok(None),
                (_, Some(dh)) => {
                    let g = x.as_ref().expect("a GELU before every layer but the first");
                    dy = gelu_backward(pass, g, &dh)?
                }
                (_, None) => unreachable!("asked for dx"),
            }
        }
        Ok(Some(dy))
    }
}

/// Parameters by name.
type Params = Vec<(String, Vec<f32>)>;

fn read_all(store: &mut ChunkManager, toy: &Toy) -> Params {
    let mut out = Vec::new();
    for &(i, l) in &toy.layers {
        out.push((format!("l{i}.weight"), store.read(l.weight).unwrap()));
        out.push((format!("l{i}.bias"), store.read(l.bias.unwrap()).unwrap()));
    }
    out
}

/// The single-rank model trained with gradient accumulation over `micro` micro-batches:
/// the parameters after each of `steps` steps.
fn reference(micro: usize, steps: usize) -> Vec<Params> {
    let mut store = manager(common::sim(64 << 20));
    let mut toy = Toy::register(&mut store, 0..LAYERS, 1.0);
    let mut opt = adam(micro as u32);
    let mut after = Vec::new();
    for step in 0..steps {
        toy.step = step;
        for m in 0..micro {
            let fwd = store.forward().unwrap();
            let (_, saved) = toy.forward(&fwd, m, None).unwrap();
            fwd.finish().unwrap();
            let mut bwd = store.backward().unwrap();
            toy.backward(&mut bwd, m, saved, None).unwrap();
            bwd.finish().unwrap();
            store.step(&mut opt).unwrap();
        }
        after.push(read_all(&mut store, &toy));
    }
    after
}

struct RankOut {
    stage: usize,
    params: Vec<Params>,
    reports: Vec<StageReport>,
}

/// One rank of `p` stages (`LAYERS / p` layers each): `steps` steps of `micro` micro-batches.
fn pipeline_rank(
    c: Communicator,
    p: usize,
    micro: usize,
    schedule: Schedule,
    steps: usize,
) -> Result<RankOut> {
    let grid = ProcessGrid::new(
        &c,
        GridSpec {
            data: 1,
            pipeline: p,
            sequence: 1,
            tensor: TensorMode::None,
        },
    )?;
    let s = grid.pipeline_rank();
    let per = LAYERS / p;
    let mut store = manager(c.device().clone());
    let mut toy = Toy::register(&mut store, s * per..(s + 1) * per, 1.0 / micro as f32);
    let mut opt = adam(1);
    let stage = PipelineStage::new(grid.pipeline(), schedule, micro)?;
    let (mut params, mut reports) = (Vec::new(), Vec::new());
    for step in 0..steps {
        toy.step = step;
        reports.push(stage.run(&mut store, &toy)?);
        store.step(&mut opt)?;
        params.push(read_all(&mut store, &toy));
    }
    Ok(RankOut {
        stage: s,
        params,
        reports,
    })
}

fn on_ranks<R: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(Communicator) -> R + Sync,
) -> Vec<R> {
    let devs = (0..world).map(|_| common::sim(64 << 20)).collect();
    let comms = Communicator::local_with_timeout(devs, timeout).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The largest `|a − b| / max(|b|, 1e-3)` over every parameter of every step.
fn worst(outs: &[RankOut], want: &[Params]) -> f64 {
    let mut w = 0.0f64;
    for o in outs {
        for (step, ps) in o.params.iter().enumerate() {
            for (name, got) in ps {
                let (_, r) = want[step].iter().find(|(n, _)| n == name).unwrap();
                for (a, b) in got.iter().zip(r) {
                    let d = f64::from((a - b).abs()) / f64::from(b.abs()).max(1e-3);
                    w = w.max(d);
                }
            }
        }
    }
    w
}

/// 1F1B and GPipe on 2 and 4 stages give gradient-accumulated training: bitwise when `M` is a
/// power of two (scaling the loss by `1/M` is then exact, and the shares add in the same
/// order as the accumulators), within 1e-5 relative otherwise (`1/M` rounds).
#[test]
fn one_f_one_b_is_gradient_accumulation() {
    const STEPS: usize = 3;
    for micro in [1, 3, 4, 8] {
        let want = reference(micro, STEPS);
        for p in [2, 4] {
            for schedule in [Schedule::OneFOneB, Schedule::GPipe] {
                let outs: Vec<RankOut> = on_ranks(p, Duration::from_secs(60), |c| {
                    pipeline_rank(c, p, micro, schedule, STEPS).unwrap()
                });
                let w = worst(&outs, &want);
                println!("{schedule:?} P {p} M {micro}: worst relative difference {w:e}");
                let tol = if micro.is_power_of_two() { 0.0 } else { 1e-5 };
                assert!(w <= tol, "{schedule:?} P {p} M {micro}: {w:e} > {tol:e}");
                for o in &outs {
                    let s = o.stage;
                    for r in &o.reports {
                        let bound = match schedule {
                            Schedule::GPipe => micro,
                            _ => (p - s).min(micro),
                        };
                        assert_eq!(r.in_flight_bound, bound);
                        assert!(r.peak_in_flight <= bound);
                        assert_eq!(r.peak_in_flight, bound, "the schedule fills the bound");
                        assert_eq!(r.losses.len(), if s + 1 == p { micro } else { 0 });
                    }
                }
            }
        }
    }
}

/// The pool holds at most `min(P − s, M)` micro-batches' activations at an op boundary under
/// 1F1B (GPipe: `M`), measured from its allocated bytes. Every buffer here is under the pool's
/// 512-byte rounding, so the bytes count blocks: a micro-batch saves its layer's input and the
/// GELU's output (the first stage: the input, which is the linear's too), and besides the saved
/// blocks at most four are alive at an op boundary (the layer's two f32 gradient sums, the
/// output held back to pair with the next receive, and the loss holder or a received buffer).
#[test]
fn in_flight_bytes_follow_the_schedule() {
    const BLOCK: usize = 512;
    let (p, micro) = (4, 8);
    for schedule in [Schedule::OneFOneB, Schedule::GPipe] {
        let outs: Vec<RankOut> = on_ranks(p, Duration::from_secs(60), |c| {
            pipeline_rank(c, p, micro, schedule, 2).unwrap()
        });
        for o in &outs {
            let s = o.stage;
            let saved = if s == 0 { 1 } else { 2 };
            let r = &o.reports[1];
            let peak = *r.pool_bytes.iter().max().unwrap();
            let one_f_one_b = ((p - s).min(micro) * saved + 4) * BLOCK;
            println!("{schedule:?} stage {s}: peak {peak} B, 1F1B's bound {one_f_one_b} B");
            match schedule {
                Schedule::GPipe => assert!(peak > one_f_one_b, "GPipe holds more than 1F1B"),
                _ => assert!(peak <= one_f_one_b, "stage {s}: {peak}"),
            }
            assert!(peak <= (r.in_flight_bound * saved + 4) * BLOCK);
        }
    }
}

/// A stage whose forward fails makes every stage return an error, none hangs.
#[test]
fn a_failing_stage_fails_every_stage() {
    let p = 4;
    let outs = on_ranks(p, Duration::from_millis(500), |c| {
        let grid = ProcessGrid::new(
            &c,
            GridSpec {
                data: 1,
                pipeline: p,
                sequence: 1,
                tensor: TensorMode::None,
            },
        )?;
        let s = grid.pipeline_rank();
        let mut store = manager(c.device().clone());
        let mut toy = Toy::register(&mut store, s..s + 1, 0.25);
        if s == 2 {
            toy.fail_at = Some(1);
        }
        PipelineStage::new(grid.pipeline(), Schedule::OneFOneB, 4)?.run(&mut store, &toy)
    });
    for (s, r) in outs.iter().enumerate() {
        assert!(r.is_err(), "stage {s}: {r:?}");
    }
}

/// Without the late forwards' uses declared in the forward pass, the store counts the last
/// backward use of each parameter too early: a recompute forward counts one use on each side,
/// so after the forward pass's `w` forwards the `w`-th backward is the "last", and the next
/// fetch of the parameter fails. The driver's declaration is what makes one iteration work.
#[test]
fn undeclared_late_forwards_fail() {
    let p = 2;
    let outs = on_ranks(p, Duration::from_millis(500), |c| {
        let grid = ProcessGrid::new(
            &c,
            GridSpec {
                data: 1,
                pipeline: p,
                sequence: 1,
                tensor: TensorMode::None,
            },
        )?;
        let s = grid.pipeline_rank();
        let mut store = manager(c.device().clone());
        let mut toy = Toy::register(&mut store, 2 * s..2 * s + 2, 0.25);
        toy.declare = false;
        PipelineStage::new(grid.pipeline(), Schedule::OneFOneB, 4)?.run(&mut store, &toy)
    });
    for (s, r) in outs.iter().enumerate() {
        println!("stage {s}: {r:?}");
        assert!(r.is_err(), "stage {s}");
    }
}

/// The bubble fractions of the schedules (equal stages, a backward twice a forward), for the
/// record: `cargo test --release --test pipeline bubble -- --nocapture`. GPipe and 1F1B flush
/// after every step of `M` micro-batches; 2BW does not, so its row is one step's share of 16
/// steps run as one stream (`16·M` micro-batches, a version every `M`).
#[test]
fn bubble_table() {
    use tidemem::parallel::pipeline::simulate_schedule;
    const STEPS: usize = 16;
    println!("| schedule | P | M | makespan a step | bubble |");
    println!("|---|---:|---:|---:|---:|");
    for name in ["GPipe", "1F1B", "2BW"] {
        for p in [2, 4, 8] {
            for m in [4, 8, 16] {
                let (sched, micro, steps) = match name {
                    "GPipe" => (Schedule::GPipe, m, 1),
                    "1F1B" => (Schedule::OneFOneB, m, 1),
                    _ => (Schedule::TwoBW { every: m.max(p) }, STEPS * m, STEPS),
                };
                let r = simulate_schedule(sched, p, micro, 1.0, 2.0).unwrap();
                println!(
                    "| {name} | {p} | {m} | {} | {:.4} |",
                    r.makespan / steps as f64,
                    r.bubble_fraction
                );
                let want = (p - 1) as f64 / (micro + p - 1) as f64;
                assert!((r.bubble_fraction - want).abs() < 1e-12);
            }
        }
    }
}

/// What a rank of a 2BW run ends with: the last stage's losses of every micro-batch, the
/// masters of the newest weights, and each batch's report.
struct TwoBwOut {
    losses: Vec<u32>,
    masters: Vec<Vec<u32>>,
    reports: Vec<StageReport>,
}

fn masters_of(store: &mut ChunkManager, toy: &Toy) -> Vec<Vec<u32>> {
    toy.params()
        .into_iter()
        .map(|id| {
            store
                .master(id)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

fn pipeline_grid(c: &Communicator, p: usize) -> Result<ProcessGrid> {
    ProcessGrid::new(
        c,
        GridSpec {
            data: 1,
            pipeline: p,
            sequence: 1,
            tensor: TensorMode::None,
        },
    )
}

/// PipeDream-2BW as the trainer ran it before it streamed: a version a step through the
/// optimizer's delayed parameters, each step's micro-batches in 1F1B order and flushed.
fn two_bw_per_step(c: Communicator, p: usize, micro: usize, batches: usize) -> Result<TwoBwOut> {
    let grid = pipeline_grid(&c, p)?;
    let (s, per) = (grid.pipeline_rank(), LAYERS / p);
    let mut store = manager(c.device().clone());
    let mut toy = Toy::register(&mut store, s * per..(s + 1) * per, 1.0 / micro as f32);
    let mut opt = HybridAdam::new(HybridConfig {
        placement: DevicePlacement::HostOnly,
        delayed_params: true,
        ..HybridConfig::new(AdamConfig::adam(1e-2))
    })?;
    let stage = PipelineStage::new(grid.pipeline(), Schedule::OneFOneB, micro)?;
    let (mut losses, mut reports) = (Vec::new(), Vec::new());
    for step in 0..batches {
        toy.step = step;
        let r = stage.run(&mut store, &toy)?;
        store.step(&mut opt)?;
        losses.extend(r.losses.iter().map(|l| l.to_bits()));
        reports.push(r);
    }
    let masters = masters_of(&mut store, &toy);
    Ok(TwoBwOut {
        losses,
        masters,
        reports,
    })
}

/// PipeDream-2BW as one stream of `batches` batches with no flush, on two registrations of the
/// stage's layers.
fn two_bw_stream(c: Communicator, p: usize, micro: usize, batches: usize) -> Result<TwoBwOut> {
    let grid = pipeline_grid(&c, p)?;
    let (s, per) = (grid.pipeline_rank(), LAYERS / p);
    let mut store = manager(c.device().clone());
    let layers = s * per..(s + 1) * per;
    let scale = 1.0 / micro as f32;
    let mut a = Toy::register(&mut store, layers.clone(), scale);
    let mut b = Toy::register_named(&mut store, "v1.", layers, scale);
    a.every = Some(micro);
    b.every = Some(micro);
    let mut opt = adam(1);
    let stage = PipelineStage::new(grid.pipeline(), Schedule::TwoBW { every: micro }, micro)?;
    let mut traced = Vec::new();
    let reports = stage.run_two_bw(&mut store, [&a, &b], batches, |store, _| {
        // the tide's trace as the step before this one left it (the first iteration's is
        // dropped after its step: the pipeline's fill is unlike the steady iterations)
        traced.push(store.trace().map(|t| t.len()));
        store.step(&mut opt).map(drop)
    })?;
    assert_eq!(traced[0], None, "the first iteration is the warm-up");
    if batches > 2 {
        assert_eq!(traced[1], None, "the second iteration is the warm-up again");
        assert!(
            traced[2].is_some(),
            "the second iteration's trace is installed"
        );
    }
    let losses = reports
        .iter()
        .flat_map(|r| r.losses.iter().map(|l| l.to_bits()))
        .collect();
    let newest = [&a, &b][(batches - 1) % 2];
    let masters = masters_of(&mut store, newest);
    Ok(TwoBwOut {
        losses,
        masters,
        reports,
    })
}

/// PipeDream-2BW with no flush (batch `b + 1`'s first forwards between batch `b`'s last
/// backwards, on the other weight version) computes what the per-step 2BW does, bit for bit:
/// every micro-batch's loss and the newest masters, on 2 and 4 stages. The stream's stages
/// run the next batch's forwards ahead (all but the last stage), and hold no more micro-batches
/// than 1F1B's bound.
#[test]
fn two_bw_without_a_flush_equals_the_per_step_two_bw() {
    const BATCHES: usize = 4;
    for p in [2, 4] {
        for micro in [p, p + 1] {
            let want = on_ranks(p, Duration::from_secs(60), |c| {
                two_bw_per_step(c, p, micro, BATCHES).unwrap()
            });
            let got = on_ranks(p, Duration::from_secs(60), |c| {
                two_bw_stream(c, p, micro, BATCHES).unwrap()
            });
            for (s, (g, w)) in got.iter().zip(&want).enumerate() {
                let what = format!("P {p} M {micro} stage {s}");
                assert_eq!(g.losses, w.losses, "{what}: losses");
                assert_eq!(g.masters, w.masters, "{what}: masters");
                assert_eq!(g.reports.len(), BATCHES);
                let late: usize = g.reports.iter().map(|r| r.late_forwards).sum();
                let flushed: usize = w.reports.iter().map(|r| r.late_forwards).sum();
                // the stream's early forwards of the next batch run ahead, not in recompute
                // passes: fewer of batch b's own forwards run late
                assert!(
                    late <= flushed,
                    "{what}: {late} late forwards, {flushed} flushed"
                );
                for (b, r) in g.reports.iter().enumerate() {
                    assert!(r.peak_in_flight <= r.in_flight_bound, "{what}: {r:?}");
                    // P − s − 1 of the next batch's forwards, but after the last batch
                    let ahead = if b + 1 < BATCHES { p - s - 1 } else { 0 };
                    assert_eq!(r.ahead_forwards, ahead, "{what}, batch {b}");
                }
            }
            assert_eq!(got[p - 1].losses.len(), BATCHES * micro);
            no_message_crosses_a_step(&got, &format!("P {p} M {micro}"));
        }
    }
}

/// 2BW's typed errors: `run` refuses it (its micro-batches cross the steps), `run_two_bw`
/// refuses the flush schedules and versions that are not two registrations of the same
/// parameters.
#[test]
fn two_bw_misuse_is_an_error() {
    let outs = on_ranks(1, Duration::from_secs(10), |c| {
        let grid = pipeline_grid(&c, 1).unwrap();
        let mut store = manager(c.device().clone());
        let a = Toy::register(&mut store, 0..LAYERS, 1.0);
        let b = Toy::register_named(&mut store, "v1.", 0..LAYERS - 1, 1.0);
        let two = PipelineStage::new(grid.pipeline(), Schedule::TwoBW { every: 2 }, 2).unwrap();
        let by_run = two.run(&mut store, &a).map(drop);
        let mismatched = two
            .run_two_bw(&mut store, [&a, &b], 2, |_, _| Ok(()))
            .map(drop);
        let same = two
            .run_two_bw(&mut store, [&a, &a], 2, |_, _| Ok(()))
            .map(drop);
        let flush = PipelineStage::new(grid.pipeline(), Schedule::OneFOneB, 2)
            .unwrap()
            .run_two_bw(&mut store, [&a, &a], 2, |_, _| Ok(()))
            .map(drop);
        let every = PipelineStage::new(grid.pipeline(), Schedule::TwoBW { every: 3 }, 2).map(drop);
        [by_run, mismatched, same, flush, every]
    });
    let [by_run, mismatched, same, flush, every] = &outs[0];
    assert!(
        matches!(by_run, Err(Error::Conflict { what, .. }) if what == "PipelineStage::run"),
        "{by_run:?}"
    );
    assert!(
        matches!(mismatched, Err(Error::Length { got, expected, .. }) if got < expected),
        "{mismatched:?}"
    );
    assert!(matches!(same, Err(Error::Conflict { .. })), "{same:?}");
    assert!(
        matches!(flush, Err(Error::Conflict { what, with }) if what == "run_two_bw" && with.contains("1F1B")),
        "{flush:?}"
    );
    assert!(
        matches!(
            every,
            Err(Error::Length {
                got: 3,
                expected: 2,
                ..
            })
        ),
        "{every:?}"
    );
}

/// Each parameter's master bits on the ZeRO rank that owns it, `None` on the others.
type OwnedMasters = Vec<Option<Vec<u32>>>;

/// What a ZeRO rank of a 2BW run ends with.
struct ZeroOut {
    stage: usize,
    losses: Vec<u32>,
    masters: OwnedMasters,
    reduce_scatters: u64,
    /// Broadcasts on the data-parallel group (the state copies between owners).
    broadcasts: u64,
}

/// Owned masters of `toy`'s parameters on a ZeRO rank: `None` where another rank owns one.
fn owned_masters(z: &mut ZeroManager, toy: &Toy) -> OwnedMasters {
    toy.params()
        .into_iter()
        .map(|id| {
            z.owns(id)
                .then(|| z.master(id).unwrap().iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

/// Whether the second version's registration starts on a chunk group rank 0 owns.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Aligned {
    Yes,
    No,
}

/// One rank of data 2 × pipeline `p` on ZeRO: PipeDream-2BW a step at a time (delayed
/// parameters) or as one stream on two registrations; the last stage's losses and the owned
/// masters of the newest weights.
fn two_bw_zero(
    c: Communicator,
    p: usize,
    micro: usize,
    batches: usize,
    stream: Option<Aligned>,
) -> Result<ZeroOut> {
    let grid = ProcessGrid::new(
        &c,
        GridSpec {
            data: 2,
            pipeline: p,
            sequence: 1,
            tensor: TensorMode::None,
        },
    )?;
    let (s, per) = (grid.pipeline_rank(), LAYERS / p);
    // chunks of 16 elements: even a stage of one layer packs into more groups than ranks
    let mut cfg = ManagerConfig::new(16, Policy::Tide);
    cfg.param_dtype = DType::F32;
    let mut z = ZeroManager::new(grid.split_replicas(&c)?, cfg)?;
    let layers = s * per..(s + 1) * per;
    // the mean over the replicas of each one's mean over its micro-batches
    let scale = 1.0 / micro as f32;
    let mut a = Toy::register_named(&mut z, "", layers.clone(), scale);
    a.salt = 100 * grid.data_rank();
    let mut opt = HybridAdam::new(HybridConfig {
        placement: DevicePlacement::HostOnly,
        delayed_params: stream.is_none(),
        ..HybridConfig::new(AdamConfig::adam(1e-2))
    })?;
    let mut losses = Vec::new();
    let Some(aligned) = stream else {
        let stage = PipelineStage::new(grid.pipeline(), Schedule::OneFOneB, micro)?;
        for step in 0..batches {
            a.step = step;
            let r = stage.run(&mut z, &a)?;
            z.step(&mut opt)?;
            losses.extend(r.losses.iter().map(|l| l.to_bits()));
        }
        let masters = owned_masters(&mut z, &a);
        let reduce_scatters = z.stats().reduce_scatters;
        return Ok(ZeroOut {
            stage: s,
            losses,
            masters,
            reduce_scatters,
            broadcasts: z.comm().stats().broadcast.calls,
        });
    };
    if aligned == Aligned::Yes {
        ParamStore::align_to_ranks(&mut z)?;
    }
    let mut b = Toy::register_named(&mut z, "v1.", layers, scale);
    b.salt = a.salt;
    a.every = Some(micro);
    b.every = Some(micro);
    let stage = PipelineStage::new(grid.pipeline(), Schedule::TwoBW { every: micro }, micro)?;
    let reports = stage.run_two_bw(&mut z, [&a, &b], batches, |z, _| z.step(&mut opt).map(drop))?;
    for r in &reports {
        losses.extend(r.losses.iter().map(|l| l.to_bits()));
    }
    // the newest weights end in the first version
    let masters = owned_masters(&mut z, &a);
    let reduce_scatters = z.stats().reduce_scatters;
    Ok(ZeroOut {
        stage: s,
        losses,
        masters,
        reduce_scatters,
        broadcasts: z.comm().stats().broadcast.calls,
    })
}

/// PipeDream-2BW with no flush on ZeRO: data 2 × pipeline 2 and × pipeline 4 (8 ranks), the
/// stages' parameters sharded over the data replicas, the two versions' state copied between
/// owners (a broadcast where they differ) and the next step's forwards gathered ahead with
/// nothing reduced for them. Every replica's losses and the newest masters (each from the
/// replica that owns it) equal the per-step 2BW's, bit for bit.
#[test]
fn two_bw_without_a_flush_on_zero_equals_the_per_step_two_bw() {
    const BATCHES: usize = 3;
    // state copies between owners happen unaligned (on some stage of some case)
    let mut crossed = 0;
    for (p, aligned) in [
        (2, Aligned::No),
        (4, Aligned::No),
        (2, Aligned::Yes),
        (4, Aligned::Yes),
    ] {
        let micro = p;
        let want = on_ranks(2 * p, Duration::from_secs(20), |c| {
            two_bw_zero(c, p, micro, BATCHES, None).unwrap()
        });
        let got = on_ranks(2 * p, Duration::from_secs(20), |c| {
            two_bw_zero(c, p, micro, BATCHES, Some(aligned)).unwrap()
        });
        // aligned, each tensor's two versions lie on one rank: no state crosses the ranks
        let broadcasts: u64 = got.iter().map(|g| g.broadcasts).sum();
        match aligned {
            Aligned::Yes => assert_eq!(broadcasts, 0, "P {p}: state copied across ranks"),
            Aligned::No => crossed += broadcasts,
        }
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.losses, w.losses, "P {p}, rank {r}: losses");
            // only batch b's groups are reduce-scattered in its iteration, not those gathered
            // for the next batch's forwards alone (one group may hold both versions' tensors)
            assert!(
                g.reduce_scatters <= w.reduce_scatters + BATCHES as u64,
                "P {p}, rank {r}: {} reduce-scatters against {} a step at a time",
                g.reduce_scatters,
                w.reduce_scatters
            );
        }
        // the ranks own other tensors in the two runs (the stream's second registration packs
        // after the first): each master the per-step run's owner holds is held, with the same
        // bits, by a rank of the same stage in the stream
        for (r, w) in want.iter().enumerate() {
            for (k, m) in w.masters.iter().enumerate() {
                let Some(m) = m else { continue };
                let held = got
                    .iter()
                    .filter(|g| g.stage == w.stage)
                    .any(|g| g.masters.get(k) == Some(&Some(m.clone())));
                assert!(held, "P {p}, rank {r}: tensor {k}'s newest master");
            }
        }
        assert!(got.iter().any(|g| g.losses.len() == BATCHES * micro));
    }
    assert!(crossed > 0, "no case copied state between owners");
}

/// Each stage's messages to a neighbour in an iteration are that neighbour's receives in the
/// same iteration: none waits in a send across an optimizer step (on NCCL such a send blocks
/// the stream that the step's collectives follow).
fn no_message_crosses_a_step(outs: &[TwoBwOut], what: &str) {
    for s in 0..outs.len().saturating_sub(1) {
        for (b, (a, n)) in outs[s].reports.iter().zip(&outs[s + 1].reports).enumerate() {
            let (a, n) = (a.messages, n.messages);
            assert_eq!(
                a.to_next,
                n.from_prev,
                "{what}: stages {s}, {} in batch {b}",
                s + 1
            );
            assert_eq!(
                n.to_prev,
                a.from_next,
                "{what}: stages {}, {s} in batch {b}",
                s + 1
            );
        }
    }
}
