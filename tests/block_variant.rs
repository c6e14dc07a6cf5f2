//! A block variant written once, over any [`Layout`]: a pre-LayerNorm ReLU MLP block,
//! `out = x + proj(ReLU(fc(ln(x))))`, exists only in this test. The same code runs serially
//! and on a 2×2 SUMMA grid: the serial run and every rank's parameter-gradient shards match an
//! f64 reference (within 1e-5 of the tensor's scale), and the grid's output and input gradient,
//! gathered from the ranks' tiles, match the serial run's. Two of them as two pipeline stages
//! give the gradients of the two run in one store, bit for bit. Nothing in the crate knows of
//! the variant: the layout brings the splits, the shards and the collectives, the pipeline the
//! stages' order and the activations between them.

use tidemem::comm::Communicator;
use tidemem::models::gpt::{
    train_step, EndsLayout, Gpt, GptBatch, GptConfig, ModelEnds, Plan, RegisterAt, Tie, Variant,
    IGNORE_INDEX,
};
use tidemem::nn::{
    Act, BlockOn, Embedding, EmbeddingSaved, HeadsCore, Layout, Linear, LinearOn, LmHead,
    LmHeadSaved, Loss, NormOn, Pair, Serial, WeightUse,
};
use tidemem::parallel::pipeline::{PipelineStage, Schedule, StageModel};
use tidemem::parallel::{
    gather_batch_2d, split_batch_2d, GridSpec, Placement, ProcessGrid, Summa, TensorMode,
};
use tidemem::prelude::*;
use tidemem::store::{BackwardPass, ForwardPass, ParamStore};

const ROWS: usize = 12;
const C: usize = 8;
const HIDDEN: usize = 16;
const EPS: f32 = 1e-5;

/// The variant: a LayerNorm, then a column and a row linear around a ReLU, and the residual.
#[derive(Clone, Debug, PartialEq)]
struct ReluBlock<L: Layout> {
    layout: L,
    ln: L::Norm,
    fc: L::Linear,
    proj: L::Linear,
    uses: WeightUse,
}

struct Saved<L: Layout> {
    ln: <L::Norm as NormOn<L>>::Saved,
    fc: <L::Linear as LinearOn<L>>::Saved,
    pre: Act,
    proj: <L::Linear as LinearOn<L>>::Saved,
}

/// Each parameter's master, from its name.
fn master(name: &str) -> Init {
    let seed = name
        .bytes()
        .fold(7u64, |h, b| h.wrapping_mul(131) ^ u64::from(b));
    let (lo, hi) = match name {
        n if n.ends_with("ln.weight") => (0.5, 1.5),
        n if n.ends_with("bias") => (-0.2, 0.2),
        _ => (-0.4, 0.4),
    };
    Init::Uniform { seed, lo, hi }
}

impl<L: Layout> ReluBlock<L> {
    /// The block's parameters, named `{prefix}ln`, `{prefix}fc` and `{prefix}proj`, each
    /// with the values of its whole master `init(name)`.
    fn register<S: ParamStore>(
        m: &mut S,
        layout: L,
        prefix: &str,
        init: &dyn Fn(&str) -> Init,
    ) -> tidemem::Result<ReluBlock<L>> {
        let name = |p: &str| format!("{prefix}{p}");
        let two = |p: &str| {
            [
                init(&format!("{}.weight", name(p))),
                init(&format!("{}.bias", name(p))),
            ]
        };
        let [g, b] = two("ln");
        let ln = layout.register_norm(m, &name("ln"), C, EPS, [&g, &b])?;
        let [w, b] = two("fc");
        let column = Pair::Column { parts: 1 };
        let fc = layout.register_linear(m, &name("fc"), [C, HIDDEN], column, [&w, &b])?;
        let [w, b] = two("proj");
        let proj = layout.register_linear(m, &name("proj"), [HIDDEN, C], Pair::Row, [&w, &b])?;
        Ok(ReluBlock {
            layout,
            ln,
            fc,
            proj,
            uses: WeightUse::Once,
        })
    }

    /// The same block with its linears writing gradient shares.
    fn shared(self) -> ReluBlock<L> {
        ReluBlock {
            uses: WeightUse::Shared,
            ..self
        }
    }
}

impl<L: Layout> BlockOn<L> for ReluBlock<L> {
    type Saved = Saved<L>;

    fn params(&self) -> Vec<TensorId> {
        let mut v = self.ln.params();
        v.extend(self.fc.params());
        v.extend(self.proj.params());
        v
    }

    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        _batch_seq: [usize; 2],
        _core: Option<&dyn HeadsCore>,
    ) -> tidemem::Result<(Act, Saved<L>)> {
        let l = &self.layout;
        let (y, ln) = self.ln.forward_on(l, pass, x, None)?;
        let (pre, fc) = self.fc.forward_on(l, pass, &y)?;
        let act = Act::alloc(pass.pool(), pre.rows(), pre.cols(), pre.dtype())?;
        tidemem::ops::relu_forward(
            pass.device(),
            pass.stream(),
            pre.input(),
            act.view(),
            pre.dtype(),
        )?;
        let (m, proj) = self.proj.forward_on(l, pass, &act)?;
        let out = Act::alloc(pass.pool(), x.rows(), x.cols(), x.dtype())?;
        let one = tidemem::ops::Axpby {
            alpha: 1.0,
            beta: 1.0,
        };
        let (dev, s) = (pass.device(), pass.stream());
        tidemem::ops::add(dev, s, one, x.input(), m.input(), out.view(), x.dtype())?;
        Ok((out, Saved { ln, fc, pre, proj }))
    }

    fn backward(
        &self,
        pass: &mut BackwardPass<'_>,
        saved: &Saved<L>,
        dout: &Act,
        _core: Option<&dyn HeadsCore>,
    ) -> tidemem::Result<Act> {
        let (l, once) = (&self.layout, self.uses);
        let (dev, s) = (pass.device(), pass.stream());
        let dres = Act::alloc(pass.pool(), dout.rows(), dout.cols(), dout.dtype())?;
        dev.copy_d2d(s, dout.input(), dres.view())?;
        let dact = self.proj.backward_on(l, pass, &saved.proj, dout, once)?;
        let dpre = Act::alloc(pass.pool(), dact.rows(), dact.cols(), dact.dtype())?;
        let (pre, d) = (&saved.pre, dact.dtype());
        tidemem::ops::relu_backward(dev, s, pre.input(), dact.input(), dpre.view(), d)?;
        let dy = self.fc.backward_on(l, pass, &saved.fc, &dpre, once)?;
        self.ln.backward_on(l, pass, &saved.ln, &dy, &dres)?;
        Ok(dres)
    }
}

fn manager(dev: Device) -> ChunkManager {
    let mut cfg = ManagerConfig::new(1 << 12, Policy::Tide);
    cfg.param_dtype = DType::F32;
    ChunkManager::new(dev, cfg).unwrap()
}

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 + seed * 11) % 97) as f32 / 48.5 - 1.0)
        .collect()
}

/// One run: output, input gradient and every parameter's gradient (each rank's part).
type Out = (Vec<f32>, Vec<f32>, Vec<Vec<f32>>);

fn run<L: Layout>(
    m: &mut ChunkManager,
    blk: &ReluBlock<L>,
    [x, dout]: [&[f32]; 2],
    [rows, cols]: [usize; 2],
) -> tidemem::Result<Out> {
    let fwd = m.forward()?;
    let xa = Act::upload(fwd.pool(), fwd.stream(), rows, cols, DType::F32, x)?;
    let (y, saved) = blk.forward(&fwd, &xa, [rows, 1], None)?;
    let y = y.to_f32(fwd.stream())?;
    drop(xa);
    fwd.finish()?;
    let mut bwd = m.backward()?;
    let da = Act::upload(bwd.pool(), bwd.stream(), rows, cols, DType::F32, dout)?;
    let dx = blk
        .backward(&mut bwd, &saved, &da, None)?
        .to_f32(bwd.stream())?;
    drop((saved, da));
    bwd.finish()?;
    let grads = blk
        .params()
        .into_iter()
        .map(|id| m.read(id))
        .collect::<tidemem::Result<_>>()?;
    Ok((y, dx, grads))
}

/// Rank `(row, col)`'s shard of a 2D parameter of `[outputs, inputs]` (`inputs` 1: a bias or
/// a LayerNorm's γ, β), as the 2D layers lay them out on a 2×2 grid.
fn shard(full: &[f64], [outputs, inputs]: [usize; 2], [row, col]: [usize; 2]) -> Vec<f64> {
    let q = 2;
    let out_l = outputs / q;
    if inputs == 1 {
        let piece = outputs / (q * q);
        return (0..piece)
            .map(|k| full[col * out_l + row * piece + k])
            .collect();
    }
    let in_l = inputs / q;
    (0..out_l * in_l)
        .map(|k| full[(col * out_l + k / in_l) * inputs + row * in_l + k % in_l])
        .collect()
}

fn close(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1e-3f64, |a, v| a.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(*g) - w).abs() / scale;
        assert!(
            err <= 1e-5,
            "{what}[{i}]: {g} against {w} (error {err:.1e})"
        );
    }
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// The variant in f64: output, input gradient, and gradients of γ, β, fc's and proj's
/// weight and bias.
fn reference(x: &[f64], dout: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>) {
    let full = |n: &str, len: usize| -> Vec<f64> {
        (0..len).map(|i| f64::from(master(n).value(i))).collect()
    };
    let (gamma, beta) = (full("ln.weight", C), full("ln.bias", C));
    let (w1, b1) = (full("fc.weight", HIDDEN * C), full("fc.bias", HIDDEN));
    let (w2, b2) = (full("proj.weight", C * HIDDEN), full("proj.bias", C));
    let mut out = vec![0.0; ROWS * C];
    let mut dx = vec![0.0; ROWS * C];
    let mut grads = vec![
        vec![0.0; C],
        vec![0.0; C],
        vec![0.0; HIDDEN * C],
        vec![0.0; HIDDEN],
        vec![0.0; C * HIDDEN],
        vec![0.0; C],
    ];
    for r in 0..ROWS {
        let xr = &x[r * C..(r + 1) * C];
        let mean = xr.iter().sum::<f64>() / C as f64;
        let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / C as f64;
        let rstd = 1.0 / (var + f64::from(EPS)).sqrt();
        let xhat: Vec<f64> = xr.iter().map(|v| (v - mean) * rstd).collect();
        let y: Vec<f64> = (0..C).map(|c| xhat[c] * gamma[c] + beta[c]).collect();
        let pre: Vec<f64> = (0..HIDDEN)
            .map(|h| b1[h] + (0..C).map(|c| w1[h * C + c] * y[c]).sum::<f64>())
            .collect();
        let act: Vec<f64> = pre.iter().map(|&v| v.max(0.0)).collect();
        let d = &dout[r * C..(r + 1) * C];
        for c in 0..C {
            let m: f64 = b2[c]
                + (0..HIDDEN)
                    .map(|h| w2[c * HIDDEN + h] * act[h])
                    .sum::<f64>();
            out[r * C + c] = xr[c] + m;
            grads[5][c] += d[c];
            for h in 0..HIDDEN {
                grads[4][c * HIDDEN + h] += d[c] * act[h];
            }
        }
        let dpre: Vec<f64> = (0..HIDDEN)
            .map(|h| {
                let da: f64 = (0..C).map(|c| d[c] * w2[c * HIDDEN + h]).sum();
                if pre[h] > 0.0 {
                    da
                } else {
                    0.0
                }
            })
            .collect();
        let mut dy = [0.0; C];
        for h in 0..HIDDEN {
            grads[3][h] += dpre[h];
            for c in 0..C {
                grads[2][h * C + c] += dpre[h] * y[c];
                dy[c] += dpre[h] * w1[h * C + c];
            }
        }
        let dxhat: Vec<f64> = (0..C).map(|c| dy[c] * gamma[c]).collect();
        let m1 = dxhat.iter().sum::<f64>() / C as f64;
        let m2 = (0..C).map(|c| dxhat[c] * xhat[c]).sum::<f64>() / C as f64;
        for c in 0..C {
            grads[0][c] += dy[c] * xhat[c];
            grads[1][c] += dy[c];
            dx[r * C + c] = d[c] + rstd * (dxhat[c] - m1 - xhat[c] * m2);
        }
    }
    (out, dx, grads)
}

#[test]
fn a_variant_written_once_runs_serial_and_on_a_2d_grid() {
    let (x, dout) = (data(ROWS * C, 1), data(ROWS * C, 2));
    let mut m = manager(Device::sim(SimConfig::with_capacity(1 << 22)).unwrap());
    let serial = ReluBlock::register(&mut m, Serial, "", &master).unwrap();
    let (y, dx, grads) = run(&mut m, &serial, [&x, &dout], [ROWS, C]).unwrap();
    let (want_y, want_dx, want_g) = reference(&f64s(&x), &f64s(&dout));
    close("serial out", &y, &want_y);
    close("serial dx", &dx, &want_dx);
    for (k, (g, w)) in grads.iter().zip(&want_g).enumerate() {
        close(&format!("serial grad {k}"), g, w);
    }

    // the same block on a 2×2 grid: each rank's tiles are the serial run's
    let devices = (0..4)
        .map(|_| Device::sim(SimConfig::with_capacity(1 << 22)))
        .collect::<tidemem::Result<Vec<_>>>()
        .unwrap();
    let comms = Communicator::local(devices).unwrap();
    let spec = GridSpec {
        data: 1,
        pipeline: 1,
        sequence: 1,
        tensor: TensorMode::TwoD { q: 2 },
    };
    type Rank = ([Vec<f32>; 2], Vec<Vec<f32>>, [usize; 2]);
    let ranks: Vec<Rank> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                let (x, dout) = (&x, &dout);
                s.spawn(move || -> tidemem::Result<Rank> {
                    let grid = ProcessGrid::new(comm, spec)?;
                    let mut m = manager(comm.device().clone());
                    let blk = ReluBlock::register(&mut m, Summa::of(&grid)?, "", &master)?;
                    let xt = split_batch_2d(&grid, x, ROWS, C)?;
                    let dt = split_batch_2d(&grid, dout, ROWS, C)?;
                    let tile = [ROWS / 2, C / 2];
                    let (y, dx, grads) = run(&mut m, &blk, [&xt, &dt], tile)?;
                    // the whole output and input gradient, gathered from the tiles
                    m.skip_step()?;
                    let fwd = m.forward()?;
                    let (pool, st) = (fwd.pool(), fwd.stream());
                    let whole = |v: &[f32]| -> tidemem::Result<Vec<f32>> {
                        let t = Act::upload(pool, st, tile[0], tile[1], DType::F32, v)?;
                        gather_batch_2d(pool, st, &grid, &t)?.to_f32(st)
                    };
                    let out = [whole(&y)?, whole(&dx)?];
                    fwd.finish()?;
                    m.backward()?.finish()?;
                    m.skip_step()?;
                    Ok((out, grads, [grid.row_index()?, grid.col_index()?]))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank panicked").unwrap())
            .collect()
    });
    let shapes = [
        [C, 1],
        [C, 1],
        [HIDDEN, C],
        [HIDDEN, 1],
        [C, HIDDEN],
        [C, 1],
    ];
    for (t, ([gy, gdx], grads, place)) in ranks.iter().enumerate() {
        close(&format!("2D rank {t} out"), gy, &f64s(&y));
        close(&format!("2D rank {t} dx"), gdx, &f64s(&dx));
        for (k, (g, w)) in grads.iter().zip(&want_g).enumerate() {
            close(
                &format!("2D rank {t} grad {k}"),
                g,
                &shard(w, shapes[k], *place),
            );
        }
    }
}

/// One pipeline stage of two, each a [`ReluBlock`]: the first reads `x`, the last returns the
/// loss `½·Σ out²` (whose gradient is `out`).
struct Stage {
    blk: ReluBlock<Serial>,
    first: bool,
    last: bool,
    x: Vec<f32>,
}

impl StageModel for Stage {
    type Saved = (Saved<Serial>, Option<Vec<f32>>);

    fn params(&self) -> Vec<TensorId> {
        self.blk.params()
    }

    fn input_shape(&self, _micro: usize) -> tidemem::Result<[usize; 2]> {
        Ok([ROWS, C])
    }

    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        _micro: usize,
        input: Option<&Act>,
    ) -> tidemem::Result<(Act, Self::Saved)> {
        let x = match input {
            Some(a) => a.clone(),
            None => Act::upload(pass.pool(), pass.stream(), ROWS, C, DType::F32, &self.x)?,
        };
        let (y, saved) = self.blk.forward(pass, &x, [ROWS, 1], None)?;
        if !self.last {
            return Ok((y, (saved, None)));
        }
        let y = y.to_f32(pass.stream())?;
        let loss = 0.5 * y.iter().map(|v| v * v).sum::<f32>();
        let one = Act::upload(pass.pool(), pass.stream(), 1, 1, DType::F32, &[loss])?;
        Ok((one, (saved, Some(y))))
    }

    fn backward(
        &self,
        pass: &mut BackwardPass<'_>,
        _micro: usize,
        (saved, y): Self::Saved,
        dout: Option<&Act>,
    ) -> tidemem::Result<Option<Act>> {
        let dy = match (y, dout) {
            (Some(y), _) => Act::upload(pass.pool(), pass.stream(), ROWS, C, DType::F32, &y)?,
            (None, Some(d)) => d.clone(),
            (None, None) => unreachable!("a stage before the last is given its output's gradient"),
        };
        let dx = self.blk.backward(pass, &saved, &dy, None)?;
        Ok((!self.first).then_some(dx))
    }
}

/// Every parameter's gradient after `run`, by tensor.
fn grads_of(m: &mut ChunkManager, blk: &ReluBlock<Serial>) -> Vec<Vec<f32>> {
    blk.params()
        .into_iter()
        .map(|id| m.read(id).unwrap())
        .collect()
}

#[test]
fn the_variant_runs_as_two_pipeline_stages() {
    let x = data(ROWS * C, 3);
    let names = ["b0.", "b1."];
    // both blocks in one store
    let mut m = manager(Device::sim(SimConfig::with_capacity(1 << 22)).unwrap());
    let blocks = names.map(|p| ReluBlock::register(&mut m, Serial, p, &master).unwrap());
    let stages = [0, 1].map(|s| Stage {
        blk: blocks[s].clone(),
        first: s == 0,
        last: s == 1,
        x: x.clone(),
    });
    let fwd = m.forward().unwrap();
    let (h, s0) = stages[0].forward(&fwd, 0, None).unwrap();
    let (_, s1) = stages[1].forward(&fwd, 0, Some(&h)).unwrap();
    drop(h);
    fwd.finish().unwrap();
    let mut bwd = m.backward().unwrap();
    let dh = stages[1].backward(&mut bwd, 0, s1, None).unwrap().unwrap();
    stages[0].backward(&mut bwd, 0, s0, Some(&dh)).unwrap();
    drop(dh);
    bwd.finish().unwrap();
    let want = blocks.map(|b| grads_of(&mut m, &b));

    // each block a stage of its own on a rank of its own
    let devices = (0..2)
        .map(|_| Device::sim(SimConfig::with_capacity(1 << 22)))
        .collect::<tidemem::Result<Vec<_>>>()
        .unwrap();
    let comms = Communicator::local(devices).unwrap();
    let spec = GridSpec {
        data: 1,
        pipeline: 2,
        sequence: 1,
        tensor: TensorMode::None,
    };
    let got: Vec<(usize, Vec<Vec<f32>>)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                let x = &x;
                s.spawn(move || -> tidemem::Result<(usize, Vec<Vec<f32>>)> {
                    let grid = ProcessGrid::new(comm, spec)?;
                    let st = grid.pipeline_rank();
                    let mut m = manager(comm.device().clone());
                    let blk = ReluBlock::register(&mut m, Serial, names[st], &master)?;
                    let stage = Stage {
                        blk,
                        first: st == 0,
                        last: st == 1,
                        x: x.clone(),
                    };
                    PipelineStage::new(grid.pipeline(), Schedule::OneFOneB, 1)?
                        .run(&mut m, &stage)?;
                    Ok((st, grads_of(&mut m, &stage.blk)))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank panicked").unwrap())
            .collect()
    });
    for (st, grads) in got {
        for (k, (g, w)) in grads.iter().zip(&want[st]).enumerate() {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(g), bits(w), "stage {st}, gradient {k}");
        }
    }
}

/// A family of the variant's blocks: GPT-2's token and position embedding, then
/// [`ReluBlock`]s, then a head of its own (no final norm, a weight not tied to `wte`), the
/// ends whole on every rank. Nothing in the crate knows of it either.
#[derive(Clone, Debug, PartialEq)]
struct ReluNet;

/// [`ReluNet`]'s ends, or the one a pipeline stage holds.
#[derive(Clone, Debug, PartialEq)]
struct NetEnds<L: Layout> {
    layout: L,
    embedding: Option<Embedding>,
    head: Option<LmHead>,
}

/// The block's parameters under its name, in registration order.
const BLOCK_PARAMS: [&str; 6] = [
    "ln.weight",
    "ln.bias",
    "fc.weight",
    "fc.bias",
    "proj.weight",
    "proj.bias",
];

/// Registers `name` whole on every rank (its norm share `1/T`), named in `params`.
fn whole<S: ParamStore>(
    store: &mut S,
    at: &RegisterAt<'_>,
    params: &mut Vec<(String, TensorId)>,
    name: &str,
    shape: &[usize],
) -> tidemem::Result<TensorId> {
    let id = store.register(name, shape, (at.master)(name))?;
    store.set_norm_share(id, at.replicated)?;
    params.push((name.into(), id));
    Ok(id)
}

impl Variant for ReluNet {
    type Block<L: Layout> = ReluBlock<L>;
    type Ends<L: Layout> = NetEnds<L>;

    fn param_shapes(&self, cfg: &GptConfig) -> Vec<(String, Vec<usize>)> {
        let (c, v) = (cfg.channels, cfg.vocab);
        let mut p = vec![
            ("wte.weight".to_string(), vec![v, c]),
            ("wpe.weight".to_string(), vec![cfg.max_seq, c]),
        ];
        let shapes = [
            vec![c],
            vec![c],
            vec![HIDDEN, c],
            vec![HIDDEN],
            vec![c, HIDDEN],
            vec![c],
        ];
        for i in 0..cfg.layers {
            for (n, s) in BLOCK_PARAMS.iter().zip(&shapes) {
                p.push((format!("h.{i}.{n}"), s.clone()));
            }
        }
        p.push(("lm_head.weight".to_string(), vec![v, c]));
        p
    }

    fn register_block<L: Layout, S: ParamStore>(
        &self,
        store: &mut S,
        layout: L,
        name: &str,
        at: &RegisterAt<'_>,
        params: &mut Vec<(String, TensorId)>,
    ) -> tidemem::Result<ReluBlock<L>> {
        let b = ReluBlock::register(store, layout, &format!("{name}."), at.master)?;
        let names = BLOCK_PARAMS.iter().map(|n| format!("{name}.{n}"));
        params.extend(names.zip(b.params()));
        Ok(match at.uses {
            WeightUse::Once => b,
            WeightUse::Shared => b.shared(),
        })
    }

    fn register_first<L: Layout, S: ParamStore>(
        &self,
        store: &mut S,
        at: &RegisterAt<'_>,
        layout: L,
        params: &mut Vec<(String, TensorId)>,
    ) -> tidemem::Result<NetEnds<L>> {
        let cfg = at.cfg;
        let embedding = match at.ends[0] {
            true => Some(Embedding {
                wte: whole(store, at, params, "wte.weight", &[cfg.vocab, cfg.channels])?,
                wpe: whole(
                    store,
                    at,
                    params,
                    "wpe.weight",
                    &[cfg.max_seq, cfg.channels],
                )?,
                vocab: cfg.vocab,
                max_seq: cfg.max_seq,
                channels: cfg.channels,
            }),
            false => None,
        };
        Ok(NetEnds {
            layout,
            embedding,
            head: None,
        })
    }

    fn register_last<L: Layout, S: ParamStore>(
        &self,
        ends: &mut NetEnds<L>,
        store: &mut S,
        at: &RegisterAt<'_>,
        params: &mut Vec<(String, TensorId)>,
    ) -> tidemem::Result<()> {
        if at.ends[1] {
            let shape = [at.cfg.vocab, at.cfg.channels];
            let w = whole(store, at, params, "lm_head.weight", &shape)?;
            let proj = Linear::from_ids(&*store, w, None, at.uses)?;
            ends.head = Some(LmHead {
                proj,
                ignore_index: IGNORE_INDEX,
            });
        }
        Ok(())
    }
}

/// A stage without the end it is asked to run.
fn absent() -> tidemem::Error {
    tidemem::Error::Empty {
        what: "this stage's end".into(),
    }
}

impl<L: Layout> ModelEnds<L> for NetEnds<L> {
    type EmbedSaved = EmbeddingSaved;
    type HeadSaved = LmHeadSaved;

    fn layout(&self) -> &L {
        &self.layout
    }

    fn has_embedding(&self) -> bool {
        self.embedding.is_some()
    }

    fn has_head(&self) -> bool {
        self.head.is_some()
    }

    fn split(&self) -> bool {
        false
    }

    fn params(&self) -> (Vec<TensorId>, Vec<TensorId>) {
        let first = self.embedding.iter().flat_map(Embedding::params).collect();
        let last = self.head.iter().map(|h| h.proj.weight).collect();
        (first, last)
    }

    fn tied(&self) -> Option<TensorId> {
        None
    }

    fn embed(
        &self,
        fwd: &ForwardPass<'_>,
        tokens: &[i32],
        [batch, seq, first]: [usize; 3],
    ) -> tidemem::Result<(Act, EmbeddingSaved)> {
        let e = self.embedding.as_ref().ok_or_else(absent)?;
        let (x, saved) = e.forward_at(fwd, tokens, batch, seq, first)?;
        Ok((self.layout.to_tile(fwd, x)?, saved))
    }

    fn embed_backward(
        &self,
        bwd: &BackwardPass<'_>,
        saved: EmbeddingSaved,
        dx: Act,
        _tie: Tie<'_>,
    ) -> tidemem::Result<()> {
        let e = self.embedding.as_ref().ok_or_else(absent)?;
        e.backward(bwd, &saved, &self.layout.to_full(bwd, dx)?)
    }

    fn head_forward(
        &self,
        fwd: &ForwardPass<'_>,
        x: Act,
        targets: &[i32],
        scale: f32,
    ) -> tidemem::Result<(Loss, LmHeadSaved)> {
        let h = self.head.as_ref().ok_or_else(absent)?;
        h.forward_scaled(fwd, &self.layout.to_full(fwd, x)?, targets, scale)
    }

    fn head_backward(
        &self,
        bwd: &BackwardPass<'_>,
        saved: LmHeadSaved,
        _tie: Tie<'_>,
    ) -> tidemem::Result<Act> {
        let h = self.head.as_ref().ok_or_else(absent)?;
        let dh = h.backward(bwd, &saved)?;
        drop(saved);
        self.layout.to_tile(bwd, dh)
    }

    fn logits(&self, fwd: &ForwardPass<'_>, x: Act) -> tidemem::Result<Act> {
        let h = self.head.as_ref().ok_or_else(absent)?;
        h.proj.forward(fwd, &self.layout.to_full(fwd, x)?)
    }
}

const NET: GptConfig = GptConfig {
    layers: 2,
    channels: C,
    heads: 2,
    vocab: 16,
    max_seq: 4,
    eps: EPS,
};
/// Sequences a step.
const SEQS: usize = 4;
const STEPS: u64 = 3;

/// Step `k`'s tokens and targets, `SEQS` sequences of `NET.max_seq`.
fn tokens(k: u64) -> (Vec<i32>, Vec<i32>) {
    let (v, t) = (NET.vocab as u64, NET.max_seq);
    let tok = |r: usize, p: usize| ((k * 5 + r as u64 * 3 + p as u64 * 7) % v) as i32;
    let all = |shift: usize| {
        (0..SEQS)
            .flat_map(|r| (0..t).map(move |p| tok(r, p + shift)))
            .collect()
    };
    (all(0), all(1))
}

/// `STEPS` steps of the family on `plan`, `micro` micro-batches a step: the losses and the
/// gradient norms (clipped at every step, so the norm must be the global one).
fn train_net<P: Placement>(m: &mut ChunkManager, plan: &Plan<'_>, micro: usize) -> Vec<[f64; 2]> {
    let net: Gpt<P, ReluNet> =
        Gpt::register_variant(m, plan, ReluNet, &NET, |n, _| Ok(master(n))).unwrap();
    let mut adam = HybridAdam::new(HybridConfig {
        max_grad_norm: Some(0.05),
        placement: tidemem::optim::DevicePlacement::HostOnly,
        ..HybridConfig::new(AdamConfig::adamw(3e-3, 0.01))
    })
    .unwrap();
    let per = SEQS / micro * NET.max_seq;
    (0..STEPS)
        .map(|k| {
            let (t, g) = tokens(k);
            let batches: Vec<GptBatch> = (0..micro)
                .map(|j| GptBatch {
                    tokens: &t[j * per..(j + 1) * per],
                    targets: &g[j * per..(j + 1) * per],
                    batch: SEQS / micro,
                    seq: NET.max_seq,
                })
                .collect();
            let r = train_step(&net, m, plan, &mut adam, &batches).unwrap();
            assert!(r.report.clip_coef < 1.0, "step {k} clips");
            [f64::from(r.loss), r.report.grad_norm]
        })
        .collect()
}

/// Every rank of a grid of `spec` (one thread each) trained as [`train_net`].
fn train_on_grid<P: Placement>(spec: GridSpec, micro: usize) -> Vec<Vec<[f64; 2]>> {
    let devices = (0..spec.world())
        .map(|_| Device::sim(SimConfig::with_capacity(1 << 22)))
        .collect::<tidemem::Result<Vec<_>>>()
        .unwrap();
    let comms = Communicator::local(devices).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                s.spawn(move || {
                    let grid = ProcessGrid::new(comm, spec).unwrap();
                    let mut m = manager(comm.device().clone());
                    let plan = Plan {
                        ends: EndsLayout::Whole,
                        ..Plan::on(&grid)
                    };
                    train_net::<P>(&mut m, &plan, micro)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    })
}

/// The family swaps the block and the ends, and runs through the crate's one model and
/// training step: serially, on a 2×2 SUMMA grid, and as two pipeline stages (1F1B, two
/// micro-batches a step, no weight tied across the stages); the losses and gradient norms of
/// every rank within 1e-5 relative of the serial run's.
#[test]
fn a_family_of_the_variant_trains_serial_on_a_grid_and_in_a_pipeline() {
    let mut m = manager(Device::sim(SimConfig::with_capacity(1 << 22)).unwrap());
    let serial = train_net::<Serial>(&mut m, &Plan::default(), 1);
    assert!(serial[2][0] < serial[0][0], "the loss falls: {serial:?}");
    let grid = GridSpec {
        data: 1,
        pipeline: 1,
        sequence: 1,
        tensor: TensorMode::TwoD { q: 2 },
    };
    let pipe = GridSpec {
        pipeline: 2,
        tensor: TensorMode::None,
        ..grid
    };
    let runs = [
        ("2×2 grid", train_on_grid::<Summa>(grid, 1)),
        ("two stages", train_on_grid::<Serial>(pipe, 2)),
    ];
    for (what, ranks) in runs {
        for (r, steps) in ranks.iter().enumerate() {
            for (k, (got, want)) in steps.iter().zip(&serial).enumerate() {
                for (i, name) in ["loss", "gradient norm"].iter().enumerate() {
                    let e = (got[i] - want[i]).abs() / want[i];
                    assert!(
                        e < 1e-5,
                        "{what}, rank {r}, step {k}: {name} {} vs {}",
                        got[i],
                        want[i]
                    );
                }
            }
        }
    }
}
