//! GPT-2's transformer block on a chunk manager: causal self-attention alone, the MLP alone,
//! then the whole pre-LayerNorm block, each one forward and backward against an f64 reference
//! written here (the output, the input's gradient and every parameter gradient, read from its
//! slot). On the simulated device and on CUDA when present (the emulator in CI, with
//! `TIDEMEM_REQUIRE_CUDA=1`).

mod common;

use tidemem::dtype::{decode_f32, encode_f32};
use tidemem::nn::{Act, Block, CausalSelfAttention, LayerNorm, Linear, Mlp};
use tidemem::prelude::*;
use tidemem::rng::{Rng, SplitMix64};
use tidemem::store::{BackwardPass, ForwardPass};

/// Batch, sequence, channels, heads (head size `C/H`).
const B: usize = 2;
const T: usize = 5;
const C: usize = 8;
const NH: usize = 2;
const N: usize = B * T;
const EPS: f32 = 1e-5;

// Tolerances, as `close` measures them (relative to the element plus the tensor's largest
// magnitude). f32: storage and math in f32 against f64, 1e-5 (measured 2.3e-7 for the block on
// the simulated device). f16 (2⁻¹¹ per rounding): every activation, the attention's q, k, v,
// probabilities and their gradients are rounded at each stage, 5e-3 (measured 6.3e-4). bf16
// (2⁻⁸ per rounding): 3e-2 (measured 5.9e-3).
const TOL_F32: f64 = 1e-5;
const TOL_F16: f64 = 5e-3;
const TOL_BF16: f64 = 3e-2;

const CASES: [(DType, f64); 3] = [
    (DType::F32, TOL_F32),
    (DType::F16, TOL_F16),
    (DType::BF16, TOL_BF16),
];

/// Values of `dtype` (uniform in ±`scale`), as f32.
fn data(len: usize, seed: u64, scale: f32, dtype: DType) -> Vec<f32> {
    let mut r = SplitMix64::new(seed);
    let v: Vec<f32> = (0..len).map(|_| r.uniform_f32(-scale, scale)).collect();
    decode_f32(&encode_f32(&v, dtype), dtype)
}

fn manager(dev: Device, dtype: DType) -> ChunkManager {
    let mut cfg = ManagerConfig::new(4 * C * C, Policy::Tide);
    cfg.param_dtype = dtype;
    ChunkManager::new(dev, cfg).unwrap()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a + b).collect()
}

/// `|got − want| ≤ tol·(max|want| + |want|)` elementwise; returns the worst ratio.
fn close(what: &str, got: &[f32], want: &[f64], tol: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let mut worst = 0.0f64;
    for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() / (scale + w.abs()).max(f64::MIN_POSITIVE);
        assert!(
            err <= tol,
            "{what}[{k}]: {g} vs {w} ({err:.2e} > {tol:.0e})"
        );
        worst = worst.max(err);
    }
    worst
}

// ---- the f64 reference ----

fn gelu_f64(z: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * z * (1.0 + (k * (z + 0.044715 * z * z * z)).tanh())
}

fn gelu_grad_f64(z: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let t = (k * (z + 0.044715 * z * z * z)).tanh();
    0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * z * z)
}

/// `y = x·wᵀ + b`.
fn linear(x: &[f64], w: &[f64], b: &[f64], inp: usize, out: usize) -> Vec<f64> {
    let rows = x.len() / inp;
    let mut y = vec![0.0; rows * out];
    for n in 0..rows {
        for o in 0..out {
            y[n * out + o] = b[o]
                + (0..inp)
                    .map(|i| x[n * inp + i] * w[o * inp + i])
                    .sum::<f64>();
        }
    }
    y
}

/// `(dx, dw, db)` of [`linear`].
fn linear_bwd(x: &[f64], w: &[f64], dy: &[f64], inp: usize, out: usize) -> [Vec<f64>; 3] {
    let rows = x.len() / inp;
    let (mut dx, mut dw, mut db) = (vec![0.0; rows * inp], vec![0.0; out * inp], vec![0.0; out]);
    for n in 0..rows {
        for o in 0..out {
            let g = dy[n * out + o];
            db[o] += g;
            for i in 0..inp {
                dx[n * inp + i] += g * w[o * inp + i];
                dw[o * inp + i] += g * x[n * inp + i];
            }
        }
    }
    [dx, dw, db]
}

/// LayerNorm over rows of `C`: `(y, normalised, rstd)`.
fn ln(x: &[f64], g: &[f64], b: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len() / C;
    let (mut y, mut nrm, mut rstd) = (vec![0.0; x.len()], vec![0.0; x.len()], vec![0.0; rows]);
    for n in 0..rows {
        let row = &x[n * C..(n + 1) * C];
        let mean = row.iter().sum::<f64>() / C as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / C as f64;
        rstd[n] = 1.0 / (var + EPS as f64).sqrt();
        for k in 0..C {
            nrm[n * C + k] = (row[k] - mean) * rstd[n];
            y[n * C + k] = nrm[n * C + k] * g[k] + b[k];
        }
    }
    (y, nrm, rstd)
}

/// `(dx, dγ, dβ)` of [`ln`].
fn ln_bwd(dy: &[f64], nrm: &[f64], rstd: &[f64], g: &[f64]) -> [Vec<f64>; 3] {
    let (mut dx, mut dg, mut db) = (vec![0.0; dy.len()], vec![0.0; C], vec![0.0; C]);
    for n in 0..rstd.len() {
        let wv: Vec<f64> = (0..C).map(|k| g[k] * dy[n * C + k]).collect();
        let mw = wv.iter().sum::<f64>() / C as f64;
        let mwn = (0..C).map(|k| wv[k] * nrm[n * C + k]).sum::<f64>() / C as f64;
        for k in 0..C {
            dg[k] += nrm[n * C + k] * dy[n * C + k];
            db[k] += dy[n * C + k];
            dx[n * C + k] = (wv[k] - mw - nrm[n * C + k] * mwn) * rstd[n];
        }
    }
    [dx, dg, db]
}

const D: usize = C / NH;

/// Element `j` of head `h`, part `p` (0 q, 1 k, 2 v) of token `(b, t)` in `qkv` `[N, 3C]`.
fn at(b: usize, t: usize, p: usize, h: usize, j: usize) -> usize {
    (b * T + t) * 3 * C + p * C + h * D + j
}

/// Causal attention on `qkv` `[N, 3C]`: `(out [N, C], att [B, H, T, T])`.
fn attention(qkv: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let scale = 1.0 / (D as f64).sqrt();
    let (mut out, mut att) = (vec![0.0; N * C], vec![0.0; B * NH * T * T]);
    for b in 0..B {
        for h in 0..NH {
            for t in 0..T {
                let a = &mut att[((b * NH + h) * T + t) * T..][..T];
                for s in 0..=t {
                    a[s] = scale
                        * (0..D)
                            .map(|j| qkv[at(b, t, 0, h, j)] * qkv[at(b, s, 1, h, j)])
                            .sum::<f64>();
                }
                let max = a[..=t].iter().cloned().fold(f64::MIN, f64::max);
                let sum: f64 = a[..=t].iter().map(|v| (v - max).exp()).sum();
                for v in &mut a[..=t] {
                    *v = (*v - max).exp() / sum;
                }
                for j in 0..D {
                    out[(b * T + t) * C + h * D + j] =
                        (0..=t).map(|s| a[s] * qkv[at(b, s, 2, h, j)]).sum();
                }
            }
        }
    }
    (out, att)
}

/// `dqkv` of [`attention`] from `dout`.
fn attention_bwd(qkv: &[f64], att: &[f64], dout: &[f64]) -> Vec<f64> {
    let scale = 1.0 / (D as f64).sqrt();
    let mut dqkv = vec![0.0; N * 3 * C];
    for b in 0..B {
        for h in 0..NH {
            for t in 0..T {
                let a = &att[((b * NH + h) * T + t) * T..][..T];
                let dy = |j: usize| dout[(b * T + t) * C + h * D + j];
                let datt: Vec<f64> = (0..=t)
                    .map(|s| (0..D).map(|j| dy(j) * qkv[at(b, s, 2, h, j)]).sum())
                    .collect();
                let dot: f64 = (0..=t).map(|s| a[s] * datt[s]).sum();
                for s in 0..=t {
                    let ds = a[s] * (datt[s] - dot) * scale;
                    for j in 0..D {
                        dqkv[at(b, s, 2, h, j)] += a[s] * dy(j);
                        dqkv[at(b, t, 0, h, j)] += ds * qkv[at(b, s, 1, h, j)];
                        dqkv[at(b, s, 1, h, j)] += ds * qkv[at(b, t, 0, h, j)];
                    }
                }
            }
        }
    }
    dqkv
}

/// Attention layer parameters `[wa, ba, wp, bp]`: `(y, dx, grads)` for `x` and `dy`.
fn attn_ref(p: &[Vec<f64>], x: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>) {
    let qkv = linear(x, &p[0], &p[1], C, 3 * C);
    let (o, att) = attention(&qkv);
    let y = linear(&o, &p[2], &p[3], C, C);
    let [do_, dwp, dbp] = linear_bwd(&o, &p[2], dy, C, C);
    let dqkv = attention_bwd(&qkv, &att, &do_);
    let [dx, dwa, dba] = linear_bwd(x, &p[0], &dqkv, C, 3 * C);
    (y, dx, vec![dwa, dba, dwp, dbp])
}

/// MLP parameters `[wf, bf, wp, bp]`: `(y, dx, grads)`.
fn mlp_ref(p: &[Vec<f64>], x: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>) {
    let z = linear(x, &p[0], &p[1], C, 4 * C);
    let a: Vec<f64> = z.iter().map(|&v| gelu_f64(v)).collect();
    let y = linear(&a, &p[2], &p[3], 4 * C, C);
    let [da, dwp, dbp] = linear_bwd(&a, &p[2], dy, 4 * C, C);
    let dz: Vec<f64> = da
        .iter()
        .zip(&z)
        .map(|(d, &v)| d * gelu_grad_f64(v))
        .collect();
    let [dx, dwf, dbf] = linear_bwd(x, &p[0], &dz, C, 4 * C);
    (y, dx, vec![dwf, dbf, dwp, dbp])
}

/// The block's 12 parameters in [`Block::params`] order: `(out, dx, grads)`.
fn block_ref(p: &[Vec<f64>], x: &[f64], dout: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>) {
    let (y1, n1, r1) = ln(x, &p[0], &p[1]);
    let (a, _, _) = attn_ref(&p[2..6], &y1, &vec![0.0; N * C]);
    let h1 = add(x, &a);
    let (y2, n2, r2) = ln(&h1, &p[6], &p[7]);
    let (m, dy2, gm) = mlp_ref(&p[8..12], &y2, dout);
    let out = add(&h1, &m);
    let [dh1_ln, dg2, db2] = ln_bwd(&dy2, &n2, &r2, &p[6]);
    let dh1 = add(dout, &dh1_ln);
    let (_, dy1, ga) = attn_ref(&p[2..6], &y1, &dh1);
    let [dx_ln, dg1, db1] = ln_bwd(&dy1, &n1, &r1, &p[0]);
    let dx = add(&dh1, &dx_ln);
    let mut grads = vec![dg1, db1];
    grads.extend(ga);
    grads.extend([dg2, db2]);
    grads.extend(gm);
    (out, dx, grads)
}

// ---- the runs ----

/// The parameters in registration order, as f64.
fn read_all(m: &mut ChunkManager, ids: &[TensorId]) -> Vec<Vec<f64>> {
    ids.iter().map(|&id| f64s(&m.read(id).unwrap())).collect()
}

/// A Linear with the default weight init and a random bias (so every path carries a signal).
fn lin(m: &mut ChunkManager, name: &str, inp: usize, out: usize, seed: u64) -> Linear {
    let bias = Init::Uniform {
        seed,
        lo: -0.2,
        hi: 0.2,
    };
    let w = Linear::default_init(name, inp);
    Linear::register_with(m, name, inp, out, w, Some(bias)).unwrap()
}

/// A LayerNorm with γ in [0.5, 1.5] and β in ±0.3.
fn lnorm(m: &mut ChunkManager, name: &str, seed: u64) -> LayerNorm {
    let u = |seed, lo, hi| Init::Uniform { seed, lo, hi };
    LayerNorm::register_with(m, name, C, EPS, u(seed, 0.5, 1.5), u(seed + 1, -0.3, 0.3)).unwrap()
}

fn attn_layer(m: &mut ChunkManager, name: &str) -> CausalSelfAttention {
    CausalSelfAttention {
        c_attn: lin(m, &format!("{name}.c_attn"), C, 3 * C, 1),
        c_proj: lin(m, &format!("{name}.c_proj"), C, C, 2),
        heads: NH,
    }
}

fn mlp_layer(m: &mut ChunkManager, name: &str) -> Mlp {
    Mlp {
        c_fc: lin(m, &format!("{name}.c_fc"), C, 4 * C, 3),
        c_proj: lin(m, &format!("{name}.c_proj"), 4 * C, C, 4),
    }
}

/// Reference output, input gradient and parameter gradients.
type Expect = (Vec<f64>, Vec<f64>, Vec<Vec<f64>>);

/// One forward and backward of a layer on `x` and `dy`: `(y, dx)` as f32.
type Layer<'a> = &'a dyn Fn(&ForwardPass<'_>, &Act) -> Result<(Act, Box<dyn std::any::Any>)>;
type LayerBack<'a> = &'a dyn Fn(&BackwardPass<'_>, &dyn std::any::Any, &Act) -> Result<Act>;

fn run(
    m: &mut ChunkManager,
    fwd_fn: Layer,
    bwd_fn: LayerBack,
    x: &[f32],
    dy: &[f32],
) -> Result<[Vec<f32>; 2]> {
    let d = m.param_dtype();
    let fwd = m.forward()?;
    let xa = Act::upload(fwd.pool(), fwd.stream(), N, C, d, x)?;
    let (y, saved) = fwd_fn(&fwd, &xa)?;
    let y = y.to_f32(fwd.stream())?;
    fwd.finish()?;
    let bwd = m.backward()?;
    let dya = Act::upload(bwd.pool(), bwd.stream(), N, C, d, dy)?;
    let dx = bwd_fn(&bwd, saved.as_ref(), &dya)?;
    assert!(!dx.same_memory(&dya), "dy is left as it was");
    let dx = dx.to_f32(bwd.stream())?;
    assert_eq!(dya.to_f32(bwd.stream())?, dy, "dy is left as it was");
    bwd.finish()?;
    Ok([y, dx])
}

/// Checks `(y, dx)` and the gradients of `ids` against `want` at `tol`.
fn compare(
    name: &str,
    m: &mut ChunkManager,
    ids: &[TensorId],
    got: [Vec<f32>; 2],
    want: Expect,
    tol: f64,
) {
    let (want_y, want_dx, want_g) = want;
    let mut worst = close(&format!("{name}: y"), &got[0], &want_y, tol);
    worst = worst.max(close(&format!("{name}: dx"), &got[1], &want_dx, tol));
    for (k, (id, w)) in ids.iter().zip(&want_g).enumerate() {
        let g = m.read(*id).unwrap();
        worst = worst.max(close(
            &format!("{name}: grad {k} (tensor {id})"),
            &g,
            w,
            tol,
        ));
    }
    eprintln!("{name}: worst error {worst:.2e} (bound {tol:.0e})");
}

fn inputs(d: DType) -> (Vec<f32>, Vec<f32>) {
    (data(N * C, 10, 1.5, d), data(N * C, 11, 1.0, d))
}

#[test]
fn attention_matches_an_f64_reference() {
    for dev in common::devices("nn_block::attention") {
        for (d, tol) in CASES {
            let mut m = manager(dev.clone(), d);
            let a = attn_layer(&mut m, "attn");
            let ids = a.params();
            let p = read_all(&mut m, &ids);
            let (x, dy) = inputs(d);
            let want = attn_ref(&p, &f64s(&x), &f64s(&dy));
            let got = run(
                &mut m,
                &|f, x| a.forward(f, x, B, T).map(|(y, s)| (y, Box::new(s) as _)),
                &|b, s, dy| a.backward(b, s.downcast_ref().unwrap(), dy),
                &x,
                &dy,
            )
            .unwrap();
            compare(
                &format!("attention {} {d}", dev.name()),
                &mut m,
                &ids,
                got,
                want,
                tol,
            );
        }
    }
}

#[test]
fn mlp_matches_an_f64_reference() {
    for dev in common::devices("nn_block::mlp") {
        for (d, tol) in CASES {
            let mut m = manager(dev.clone(), d);
            let l = mlp_layer(&mut m, "mlp");
            let ids = l.params();
            let p = read_all(&mut m, &ids);
            let (x, dy) = inputs(d);
            let want = mlp_ref(&p, &f64s(&x), &f64s(&dy));
            let got = run(
                &mut m,
                &|f, x| l.forward(f, x).map(|(y, s)| (y, Box::new(s) as _)),
                &|b, s, dy| l.backward(b, s.downcast_ref().unwrap(), dy),
                &x,
                &dy,
            )
            .unwrap();
            compare(
                &format!("mlp {} {d}", dev.name()),
                &mut m,
                &ids,
                got,
                want,
                tol,
            );
        }
    }
}

#[test]
fn block_matches_an_f64_reference() {
    for dev in common::devices("nn_block::block") {
        for (d, tol) in CASES {
            let mut m = manager(dev.clone(), d);
            let blk = Block {
                ln_1: lnorm(&mut m, "h.0.ln_1", 20),
                attn: attn_layer(&mut m, "h.0.attn"),
                ln_2: lnorm(&mut m, "h.0.ln_2", 22),
                mlp: mlp_layer(&mut m, "h.0.mlp"),
            };
            let ids = blk.params();
            assert_eq!(ids.len(), 12);
            let p = read_all(&mut m, &ids);
            let (x, dy) = inputs(d);
            let want = block_ref(&p, &f64s(&x), &f64s(&dy));
            let got = run(
                &mut m,
                &|f, x| blk.forward(f, x, B, T).map(|(y, s)| (y, Box::new(s) as _)),
                &|b, s, dy| blk.backward(b, s.downcast_ref().unwrap(), dy),
                &x,
                &dy,
            )
            .unwrap();
            compare(
                &format!("block {} {d}", dev.name()),
                &mut m,
                &ids,
                got,
                want,
                tol,
            );
        }
    }
}

/// `Block::register` gives GPT-2's parameter names and shapes; bad shapes are typed errors.
#[test]
fn block_registers_gpt2_names() {
    let mut m = manager(common::sim(1 << 20), DType::F32);
    let blk = Block::register(&mut m, "h.3", C, NH, EPS, None).unwrap();
    let names = [
        ("h.3.ln_1.weight", vec![C]),
        ("h.3.ln_1.bias", vec![C]),
        ("h.3.attn.c_attn.weight", vec![3 * C, C]),
        ("h.3.attn.c_attn.bias", vec![3 * C]),
        ("h.3.attn.c_proj.weight", vec![C, C]),
        ("h.3.attn.c_proj.bias", vec![C]),
        ("h.3.ln_2.weight", vec![C]),
        ("h.3.ln_2.bias", vec![C]),
        ("h.3.mlp.c_fc.weight", vec![4 * C, C]),
        ("h.3.mlp.c_fc.bias", vec![4 * C]),
        ("h.3.mlp.c_proj.weight", vec![C, 4 * C]),
        ("h.3.mlp.c_proj.bias", vec![C]),
    ];
    for (id, (_name, shape)) in blk.params().into_iter().zip(names) {
        assert_eq!(m.tensor_shape(id).unwrap(), shape.as_slice());
    }
    assert!(CausalSelfAttention::register(&mut m, "bad", C, 3, None).is_err());
    assert!(CausalSelfAttention::register(&mut m, "bad0", C, 0, None).is_err());

    // a row count that is not batch × sequence is refused before anything runs
    let fwd = m.forward().unwrap();
    let x = Act::upload(
        fwd.pool(),
        fwd.stream(),
        N,
        C,
        DType::F32,
        &data(N * C, 5, 1.0, DType::F32),
    )
    .unwrap();
    assert!(matches!(
        blk.attn.forward(&fwd, &x, B, T + 1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        blk.forward(&fwd, &x, 3, T),
        Err(Error::InvalidArgument(_))
    ));
    let (_, saved) = blk.forward(&fwd, &x, B, T).unwrap();
    assert_eq!(saved.h1().shape(), [N, C]);
    fwd.finish().unwrap();

    // a gradient of the wrong shape or type is refused; the pass goes on
    let bwd = m.backward().unwrap();
    let up = |rows, cols, d| {
        let v = data(rows * cols, 6, 1.0, d);
        Act::upload(bwd.pool(), bwd.stream(), rows, cols, d, &v).unwrap()
    };
    for bad in [
        up(N - 1, C, DType::F32),
        up(N, C + 1, DType::F32),
        up(N, C, DType::F16),
    ] {
        let err = blk.backward(&bwd, &saved, &bad).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
    let dx = blk.backward(&bwd, &saved, &up(N, C, DType::F32)).unwrap();
    assert_eq!(dx.shape(), [N, C]);
    bwd.finish().unwrap();
}
