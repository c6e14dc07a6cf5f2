//! A tiny GPT-2 on a chunk manager: the embedding (`wte`, `wpe`) → one transformer block →
//! the final LayerNorm → the LM head tied to `wte` with the mean cross-entropy. The loss and
//! every parameter gradient (`wte`'s the sum of the embedding's and the head's shares) against
//! an f64 reference written here, on the simulated device and on CUDA when present (the
//! emulator in CI, with `TIDEMEM_REQUIRE_CUDA=1`).

mod common;

use tidemem::nn::{Block, CausalSelfAttention, Embedding, LayerNorm, Linear, LmHead, Mlp};
use tidemem::prelude::*;

/// Batch, sequence, channels, heads (head size `C/H`), vocabulary, positions.
const B: usize = 2;
const T: usize = 4;
const C: usize = 8;
const NH: usize = 2;
const V: usize = 11;
const MAX_T: usize = 6;
const N: usize = B * T;
const EPS: f32 = 1e-5;
const IGNORE: i32 = -100;

// Tolerances, as `close` measures them (relative to the element plus the tensor's largest
// magnitude). f32: 1e-5 (measured 6.8e-7 on the simulated device). f16 (2⁻¹¹ per rounding):
// every activation, the logits and their gradient rounded at each stage, 5e-3 (measured
// 1.4e-3). bf16 (2⁻⁸ per rounding): 3e-2 (measured 8.4e-3).
const TOL_F32: f64 = 1e-5;
const TOL_F16: f64 = 5e-3;
const TOL_BF16: f64 = 3e-2;

const CASES: [(DType, f64); 3] = [
    (DType::F32, TOL_F32),
    (DType::F16, TOL_F16),
    (DType::BF16, TOL_BF16),
];

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

/// The model's f64 reference from its parameters (`[wte, wpe, block's 12…, γ_f, β_f]`):
/// `(loss, grads)` in the same order.
fn gpt_ref(p: &[Vec<f64>], tokens: &[i32], targets: &[i32]) -> (f64, Vec<Vec<f64>>) {
    let (wte, wpe, pb, gf, bf) = (&p[0], &p[1], &p[2..14], &p[14], &p[15]);
    let mut x = vec![0.0; N * C];
    for n in 0..N {
        for c in 0..C {
            x[n * C + c] = wte[tokens[n] as usize * C + c] + wpe[(n % T) * C + c];
        }
    }
    let (out, _, _) = block_ref(pb, &x, &vec![0.0; N * C]);
    let (hf, nf, rf) = ln(&out, gf, bf);
    let counted = targets.iter().filter(|&&t| t != IGNORE).count();
    let mut loss = 0.0;
    let mut dlog = vec![0.0; N * V];
    for n in 0..N {
        if targets[n] == IGNORE {
            continue;
        }
        let lg: Vec<f64> = (0..V)
            .map(|v| (0..C).map(|c| hf[n * C + c] * wte[v * C + c]).sum())
            .collect();
        let m = lg.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let z: f64 = lg.iter().map(|l| (l - m).exp()).sum();
        let t = targets[n] as usize;
        loss += z.ln() - (lg[t] - m);
        for v in 0..V {
            let onehot = if v == t { 1.0 } else { 0.0 };
            dlog[n * V + v] = (((lg[v] - m).exp() / z) - onehot) / counted as f64;
        }
    }
    loss /= counted as f64;
    let mut dhf = vec![0.0; N * C];
    let mut dwte = vec![0.0; V * C];
    for n in 0..N {
        for v in 0..V {
            for c in 0..C {
                dhf[n * C + c] += dlog[n * V + v] * wte[v * C + c];
                dwte[v * C + c] += dlog[n * V + v] * hf[n * C + c];
            }
        }
    }
    let [dout, dgf, dbf] = ln_bwd(&dhf, &nf, &rf, gf);
    let (_, dx, gb) = block_ref(pb, &x, &dout);
    let mut dwpe = vec![0.0; MAX_T * C];
    for n in 0..N {
        for c in 0..C {
            dwte[tokens[n] as usize * C + c] += dx[n * C + c];
            dwpe[(n % T) * C + c] += dx[n * C + c];
        }
    }
    let mut grads = vec![dwte, dwpe];
    grads.extend(gb);
    grads.extend([dgf, dbf]);
    (loss, grads)
}

struct Gpt {
    emb: Embedding,
    blk: Block,
    ln_f: LayerNorm,
    head: LmHead,
}

impl Gpt {
    fn new(m: &mut ChunkManager) -> Gpt {
        let emb = Embedding::register(m, V, MAX_T, C, None).unwrap();
        let blk = Block {
            ln_1: lnorm(m, "h.0.ln_1", 20),
            attn: attn_layer(m, "h.0.attn"),
            ln_2: lnorm(m, "h.0.ln_2", 22),
            mlp: mlp_layer(m, "h.0.mlp"),
        };
        let ln_f = lnorm(m, "ln_f", 24);
        let head = LmHead::tied(m, emb.wte, IGNORE).unwrap();
        Gpt {
            emb,
            blk,
            ln_f,
            head,
        }
    }

    fn params(&self) -> Vec<TensorId> {
        let mut v = self.emb.params();
        v.extend(self.blk.params());
        v.extend([self.ln_f.gamma, self.ln_f.beta]);
        v
    }

    /// One forward and backward: the loss.
    fn step(&self, m: &mut ChunkManager, tokens: &[i32], targets: &[i32]) -> Result<f32> {
        let fwd = m.forward()?;
        let (x, emb_saved) = self.emb.forward(&fwd, tokens, B, T)?;
        let (out, blk_saved) = self.blk.forward(&fwd, &x, B, T)?;
        let (hf, ln_saved) = self.ln_f.forward(&fwd, &out, None)?;
        let (loss, head_saved) = self.head.forward(&fwd, &hf, targets)?;
        fwd.finish()?;
        let bwd = m.backward()?;
        let dhf = self.head.backward(&bwd, &head_saved)?;
        let dout = self.ln_f.backward(&bwd, &ln_saved, &dhf, None)?;
        let dx = self.blk.backward(&bwd, &blk_saved, &dout)?;
        self.emb.backward(&bwd, &emb_saved, &dx)?;
        bwd.finish()?;
        Ok(loss)
    }
}

const TOKENS: [i32; N] = [3, 7, 3, 0, 10, 7, 7, 2];
const TARGETS: [i32; N] = [7, 3, 0, IGNORE, 7, 7, 2, 10];

#[test]
fn gpt_loss_and_gradients_match_an_f64_reference() {
    for dev in common::devices("nn_gpt::gpt") {
        for (d, tol) in CASES {
            let mut m = manager(dev.clone(), d);
            let gpt = Gpt::new(&mut m);
            let ids = gpt.params();
            assert_eq!(ids.len(), 16);
            let p = read_all(&mut m, &ids);
            let (want_loss, want) = gpt_ref(&p, &TOKENS, &TARGETS);
            let loss = gpt.step(&mut m, &TOKENS, &TARGETS).unwrap();
            let name = format!("gpt {} {d}", dev.name());
            let mut worst = close(&format!("{name}: loss"), &[loss], &[want_loss], tol);
            for (k, (id, w)) in ids.iter().zip(&want).enumerate() {
                let g = m.read(*id).unwrap();
                worst = worst.max(close(
                    &format!("{name}: grad {k} (tensor {id})"),
                    &g,
                    w,
                    tol,
                ));
            }
            eprintln!("{name}: loss {loss}, worst error {worst:.2e} (bound {tol:.0e})");
        }
    }
}

/// Bad tokens, sequences and targets are typed errors before anything runs.
#[test]
fn bad_input_is_refused() {
    let dev = Device::sim(SimConfig::with_capacity(1 << 22)).unwrap();
    let mut m = manager(dev, DType::F32);
    let gpt = Gpt::new(&mut m);
    let fwd = m.forward().unwrap();
    let bad_tok = [0, 1, 2, V as i32];
    assert!(matches!(
        gpt.emb.forward(&fwd, &bad_tok, 1, 4),
        Err(Error::InvalidArgument(_))
    ));
    assert!(gpt.emb.forward(&fwd, &[0, 1, 2, -1], 1, 4).is_err());
    assert!(
        gpt.emb.forward(&fwd, &[0; 7], 1, 7).is_err(),
        "seq > max_seq"
    );
    assert!(gpt.emb.forward(&fwd, &[0; 3], 1, 4).is_err(), "length");
    let (x, _) = gpt.emb.forward(&fwd, &[0, 1, 2, 3], 1, 4).unwrap();
    assert!(gpt.head.forward(&fwd, &x, &[0, 1, 2, V as i32]).is_err());
    assert!(gpt.head.forward(&fwd, &x, &[0, 1, 2]).is_err());
    let (loss, _) = gpt.head.forward(&fwd, &x, &[0, IGNORE, 2, 3]).unwrap();
    assert!(loss.is_finite());
    fwd.finish().unwrap();
}

#[test]
fn embedding_registers_gpt2_names() {
    let dev = Device::sim(SimConfig::with_capacity(1 << 22)).unwrap();
    let mut m = manager(dev, DType::F32);
    let emb = Embedding::register(&mut m, V, MAX_T, C, None).unwrap();
    assert_eq!(m.tensor_shape(emb.wte).unwrap(), [V, C]);
    assert_eq!(m.tensor_shape(emb.wpe).unwrap(), [MAX_T, C]);
    assert!(Embedding::register(&mut m, 0, MAX_T, C, None).is_err());
    let head = LmHead::tied(&m, emb.wte, IGNORE).unwrap();
    assert_eq!(head.vocab(), V);
}
