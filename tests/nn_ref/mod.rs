//! What the `nn` suites share: a small manager, f64 references of the layers (linear,
//! LayerNorm, GELU, causal attention, the MLP, the block) written apart from the crate's code,
//! the comparison, and the layers registered with fixed seeds. The shapes (`B`, `T`, `C`, `NH`,
//! `N`, `EPS`) are the including suite's.
#![allow(dead_code)]

use super::{B, C, EPS, N, NH, T};
use tidemem::nn::{Block, CausalSelfAttention, LayerNorm, Linear, Mlp, Serial, WeightUse};
use tidemem::prelude::*;

pub fn manager(dev: Device, dtype: DType) -> ChunkManager {
    let mut cfg = ManagerConfig::new(4 * C * C, Policy::Tide);
    cfg.param_dtype = dtype;
    ChunkManager::new(dev, cfg).unwrap()
}

pub fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

pub fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a + b).collect()
}

/// `|got − want| ≤ tol·(max|want| + |want|)` elementwise; returns the worst ratio.
pub fn close(what: &str, got: &[f32], want: &[f64], tol: f64) -> f64 {
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

pub fn gelu_f64(z: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * z * (1.0 + (k * (z + 0.044715 * z * z * z)).tanh())
}

pub fn gelu_grad_f64(z: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let t = (k * (z + 0.044715 * z * z * z)).tanh();
    0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * z * z)
}

/// `y = x·wᵀ + b`.
pub fn linear(x: &[f64], w: &[f64], b: &[f64], inp: usize, out: usize) -> Vec<f64> {
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
pub fn linear_bwd(x: &[f64], w: &[f64], dy: &[f64], inp: usize, out: usize) -> [Vec<f64>; 3] {
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
pub fn ln(x: &[f64], g: &[f64], b: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
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
pub fn ln_bwd(dy: &[f64], nrm: &[f64], rstd: &[f64], g: &[f64]) -> [Vec<f64>; 3] {
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

pub const D: usize = C / NH;

/// Element `j` of head `h`, part `p` (0 q, 1 k, 2 v) of token `(b, t)` in `qkv` `[N, 3C]`.
pub fn at(b: usize, t: usize, p: usize, h: usize, j: usize) -> usize {
    (b * T + t) * 3 * C + p * C + h * D + j
}

/// Causal attention on `qkv` `[N, 3C]`: `(out [N, C], att [B, H, T, T])`.
pub fn attention(qkv: &[f64]) -> (Vec<f64>, Vec<f64>) {
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
pub fn attention_bwd(qkv: &[f64], att: &[f64], dout: &[f64]) -> Vec<f64> {
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
pub fn attn_ref(p: &[Vec<f64>], x: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>) {
    let qkv = linear(x, &p[0], &p[1], C, 3 * C);
    let (o, att) = attention(&qkv);
    let y = linear(&o, &p[2], &p[3], C, C);
    let [do_, dwp, dbp] = linear_bwd(&o, &p[2], dy, C, C);
    let dqkv = attention_bwd(&qkv, &att, &do_);
    let [dx, dwa, dba] = linear_bwd(x, &p[0], &dqkv, C, 3 * C);
    (y, dx, vec![dwa, dba, dwp, dbp])
}

/// MLP parameters `[wf, bf, wp, bp]`: `(y, dx, grads)`.
pub fn mlp_ref(p: &[Vec<f64>], x: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>) {
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
pub fn block_ref(p: &[Vec<f64>], x: &[f64], dout: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>) {
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
pub fn read_all(m: &mut ChunkManager, ids: &[TensorId]) -> Vec<Vec<f64>> {
    ids.iter().map(|&id| f64s(&m.read(id).unwrap())).collect()
}

/// A Linear with the default weight init and a random bias (so every path carries a signal).
pub fn lin(m: &mut ChunkManager, name: &str, inp: usize, out: usize, seed: u64) -> Linear {
    let bias = Init::Uniform {
        seed,
        lo: -0.2,
        hi: 0.2,
    };
    let w = Linear::default_init(name, inp);
    Linear::register_with(m, name, inp, out, w, Some(bias)).unwrap()
}

/// A LayerNorm with γ in [0.5, 1.5] and β in ±0.3.
pub fn lnorm(m: &mut ChunkManager, name: &str, seed: u64) -> LayerNorm {
    let u = |seed, lo, hi| Init::Uniform { seed, lo, hi };
    LayerNorm::register_with(m, name, C, EPS, u(seed, 0.5, 1.5), u(seed + 1, -0.3, 0.3)).unwrap()
}

pub fn attn_layer(m: &mut ChunkManager, name: &str) -> CausalSelfAttention {
    CausalSelfAttention {
        c_attn: lin(m, &format!("{name}.c_attn"), C, 3 * C, 1),
        c_proj: lin(m, &format!("{name}.c_proj"), C, C, 2),
        heads: NH,
    }
}

pub fn mlp_layer(m: &mut ChunkManager, name: &str) -> Mlp {
    Mlp {
        c_fc: lin(m, &format!("{name}.c_fc"), C, 4 * C, 3),
        c_proj: lin(m, &format!("{name}.c_proj"), 4 * C, C, 4),
    }
}

/// A block `name` of [`lnorm`]s (seeds 20 and 22), [`attn_layer`] and [`mlp_layer`], registered in
/// that order.
pub fn block_layer(m: &mut ChunkManager, name: &str) -> Block {
    let ln_1 = lnorm(m, &format!("{name}.ln_1"), 20);
    let attn = attn_layer(m, &format!("{name}.attn"));
    let ln_2 = lnorm(m, &format!("{name}.ln_2"), 22);
    let mlp = mlp_layer(m, &format!("{name}.mlp"));
    Block {
        layout: Serial,
        ln_1,
        c_attn: attn.c_attn,
        attn_proj: attn.c_proj,
        ln_2,
        c_fc: mlp.c_fc,
        mlp_proj: mlp.c_proj,
        heads: NH,
        channels: C,
        uses: WeightUse::Once,
    }
}

/// The token + position embedding `x[n] = wte[tokens[n]] + wpe[n % T]`.
pub fn embed_ref(wte: &[f64], wpe: &[f64], tokens: &[i32]) -> Vec<f64> {
    let mut x = vec![0.0; N * C];
    for n in 0..N {
        for c in 0..C {
            x[n * C + c] = wte[tokens[n] as usize * C + c] + wpe[(n % T) * C + c];
        }
    }
    x
}

/// The embedding's backward: `dx` scattered into `dwte` (added) and a new `dwpe` of
/// `positions` rows.
pub fn embed_bwd(dx: &[f64], tokens: &[i32], dwte: &mut [f64], positions: usize) -> Vec<f64> {
    let mut dwpe = vec![0.0; positions * C];
    for n in 0..N {
        for c in 0..C {
            dwte[tokens[n] as usize * C + c] += dx[n * C + c];
            dwpe[(n % T) * C + c] += dx[n * C + c];
        }
    }
    dwpe
}

/// What [`lm_head_ref`] gives.
pub struct LmRef {
    /// The mean cross-entropy over the counted rows.
    pub loss: f64,
    /// `[N, V]`.
    pub logits: Vec<f64>,
    /// The gradient of `h`.
    pub dh: Vec<f64>,
    /// The head's share of `wte`'s gradient.
    pub dwte: Vec<f64>,
}

/// The tied head `logits = h·wteᵀ` over `v` tokens and the mean cross-entropy over the rows
/// whose target is not negative (the ignore index).
pub fn lm_head_ref(h: &[f64], wte: &[f64], targets: &[i32], v: usize) -> LmRef {
    let logits: Vec<f64> = (0..N * v)
        .map(|i| (0..C).map(|c| h[i / v * C + c] * wte[i % v * C + c]).sum())
        .collect();
    let counted = targets.iter().filter(|&&t| t >= 0).count() as f64;
    let (mut loss, mut dlog) = (0.0, vec![0.0; N * v]);
    for n in 0..N {
        if targets[n] < 0 {
            continue;
        }
        let lg = &logits[n * v..(n + 1) * v];
        let m = lg.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let z: f64 = lg.iter().map(|l| (l - m).exp()).sum();
        let t = targets[n] as usize;
        loss += z.ln() - (lg[t] - m);
        for k in 0..v {
            let hot = if k == t { 1.0 } else { 0.0 };
            dlog[n * v + k] = ((lg[k] - m).exp() / z - hot) / counted;
        }
    }
    let (mut dh, mut dwte) = (vec![0.0; N * C], vec![0.0; v * C]);
    for n in 0..N {
        for k in 0..v {
            let d = dlog[n * v + k];
            for c in 0..C {
                dh[n * C + c] += d * wte[k * C + c];
                dwte[k * C + c] += d * h[n * C + c];
            }
        }
    }
    LmRef {
        loss: loss / counted,
        logits,
        dh,
        dwte,
    }
}
