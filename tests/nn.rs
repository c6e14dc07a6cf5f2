//! The `nn` layers on a chunk manager: one forward and backward of
//! `LayerNorm(x + r) → Linear → GELU → Linear` against an f64 reference (every parameter
//! gradient, read from its slot; the outputs; the residual stream and its gradient), a tied
//! Linear applied twice, and bad input as typed errors. On the simulated device and on CUDA
//! when present (the emulator in CI, with `TIDEMEM_REQUIRE_CUDA=1`).

mod common;

use tidemem::nn::{gelu, gelu_backward, Act, LayerNorm, Linear, WeightUse};
use tidemem::prelude::*;
use tidemem::rng::{Rng, SplitMix64};
use tidemem::{decode_f32, encode_f32};

/// Rows (samples), features, hidden features.
const N: usize = 6;
const C: usize = 8;
const H: usize = 16;
const EPS: f32 = 1e-5;

/// Values of `dtype` (uniform in ±`scale`), as f32.
fn data(len: usize, seed: u64, scale: f32, dtype: DType) -> Vec<f32> {
    let mut r = SplitMix64::new(seed);
    let v: Vec<f32> = (0..len).map(|_| r.uniform_f32(-scale, scale)).collect();
    decode_f32(&encode_f32(&v, dtype), dtype)
}

fn manager(dev: Device, dtype: DType) -> ChunkManager {
    let mut cfg = ManagerConfig::new(C * H, Policy::Tide);
    cfg.param_dtype = dtype;
    ChunkManager::new(dev, cfg).unwrap()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn gelu_f64(z: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * z * (1.0 + (k * (z + 0.044715 * z * z * z)).tanh())
}

fn gelu_grad_f64(z: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let t = (k * (z + 0.044715 * z * z * z)).tanh();
    0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * z * z)
}

/// `y[n, o] = Σ_i x[n, i]·w[o, i] + b[o]`.
fn linear_f64(x: &[f64], w: &[f64], b: &[f64], inputs: usize, outputs: usize) -> Vec<f64> {
    let rows = x.len() / inputs;
    let mut y = vec![0.0; rows * outputs];
    for n in 0..rows {
        for o in 0..outputs {
            let dot: f64 = (0..inputs)
                .map(|i| x[n * inputs + i] * w[o * inputs + i])
                .sum();
            y[n * outputs + o] = dot + b[o];
        }
    }
    y
}

/// `(dx = dy·w, dw = dyᵀ·x, db = Σ_rows dy)`.
fn linear_grads_f64(
    x: &[f64],
    w: &[f64],
    dy: &[f64],
    inputs: usize,
    outputs: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len() / inputs;
    let (mut dx, mut dw, mut db) = (
        vec![0.0; rows * inputs],
        vec![0.0; outputs * inputs],
        vec![0.0; outputs],
    );
    for n in 0..rows {
        for o in 0..outputs {
            let g = dy[n * outputs + o];
            db[o] += g;
            for i in 0..inputs {
                dx[n * inputs + i] += g * w[o * inputs + i];
                dw[o * inputs + i] += g * x[n * inputs + i];
            }
        }
    }
    (dx, dw, db)
}

/// The stack's parameters (γ, β, W1, b1, W2, b2) and inputs (x, r, dy, the residual stream's
/// gradient so far), as f32 values of the store's type.
struct Case {
    params: [Vec<f32>; 6],
    x: Vec<f32>,
    r: Vec<f32>,
    dy: Vec<f32>,
    dres: Vec<f32>,
}

/// What the reference computes: the output, `h = x + r`, the residual gradient after the
/// LayerNorm's backward, and the six parameter gradients.
struct Expect {
    y: Vec<f64>,
    h: Vec<f64>,
    dres: Vec<f64>,
    grads: [Vec<f64>; 6],
}

fn reference(c: &Case) -> Expect {
    let [g, b, w1, b1, w2, b2] = c.params.each_ref().map(|v| f64s(v));
    let h: Vec<f64> =
        c.x.iter()
            .zip(&c.r)
            .map(|(&x, &r)| x as f64 + r as f64)
            .collect();
    let (mut norm, mut rstd, mut yln) = (vec![0.0; N * C], vec![0.0; N], vec![0.0; N * C]);
    for n in 0..N {
        let row = &h[n * C..(n + 1) * C];
        let mean = row.iter().sum::<f64>() / C as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / C as f64;
        rstd[n] = 1.0 / (var + EPS as f64).sqrt();
        for k in 0..C {
            norm[n * C + k] = (row[k] - mean) * rstd[n];
            yln[n * C + k] = norm[n * C + k] * g[k] + b[k];
        }
    }
    let z = linear_f64(&yln, &w1, &b1, C, H);
    let a: Vec<f64> = z.iter().map(|&v| gelu_f64(v)).collect();
    let y = linear_f64(&a, &w2, &b2, H, C);
    let (da, dw2, db2) = linear_grads_f64(&a, &w2, &f64s(&c.dy), H, C);
    let dz: Vec<f64> = da
        .iter()
        .zip(&z)
        .map(|(d, &v)| d * gelu_grad_f64(v))
        .collect();
    let (dyln, dw1, db1) = linear_grads_f64(&yln, &w1, &dz, C, H);
    let (mut dg, mut dbeta, mut dres) = (vec![0.0; C], vec![0.0; C], f64s(&c.dres));
    for n in 0..N {
        let wv: Vec<f64> = (0..C).map(|k| g[k] * dyln[n * C + k]).collect();
        let mean_w = wv.iter().sum::<f64>() / C as f64;
        let mean_wn = (0..C).map(|k| wv[k] * norm[n * C + k]).sum::<f64>() / C as f64;
        for k in 0..C {
            dg[k] += norm[n * C + k] * dyln[n * C + k];
            dbeta[k] += dyln[n * C + k];
            dres[n * C + k] += (wv[k] - mean_w - norm[n * C + k] * mean_wn) * rstd[n];
        }
    }
    Expect {
        y,
        h,
        dres,
        grads: [dg, dbeta, dw1, db1, dw2, db2],
    }
}

/// `|got − want| ≤ tol·(max|want| + |want|)` elementwise: relative to the element and to the
/// tensor's scale (a sum that cancels to near zero is judged against its terms' size).
fn close(what: &str, got: &[f32], want: &[f64], tol: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let mut worst = 0.0f64;
    for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() / (scale + w.abs()).max(f64::MIN_POSITIVE);
        assert!(
            err <= tol,
            "{what}[{k}]: {g} vs {w} (error {err:.2e} > {tol:.0e})"
        );
        worst = worst.max(err);
    }
    worst
}

/// The stack's layers.
struct Stack {
    ln: LayerNorm,
    fc: Linear,
    proj: Linear,
}

impl Stack {
    fn register(m: &mut ChunkManager) -> Result<Stack> {
        let uniform = |seed, lo, hi| Init::Uniform { seed, lo, hi };
        let ln =
            LayerNorm::register_with(m, "ln", C, EPS, uniform(1, 0.5, 1.5), uniform(2, -0.5, 0.5))?;
        let fc = Linear::register_with(
            m,
            "fc",
            C,
            H,
            Linear::default_init("fc", C),
            Some(uniform(3, -0.2, 0.2)),
        )?;
        let proj = Linear::register_with(
            m,
            "proj",
            H,
            C,
            Linear::default_init("proj", H),
            Some(uniform(4, -0.2, 0.2)),
        )?;
        Ok(Stack { ln, fc, proj })
    }

    fn ids(&self) -> [TensorId; 6] {
        let (fc, proj) = (self.fc, self.proj);
        [
            self.ln.gamma,
            self.ln.beta,
            fc.weight,
            fc.bias.unwrap(),
            proj.weight,
            proj.bias.unwrap(),
        ]
    }
}

/// One forward and backward of the stack; returns `(y, h, dres after backward)` as f32.
fn run_stack(m: &mut ChunkManager, s: &Stack, c: &Case) -> Result<[Vec<f32>; 3]> {
    let d = m.param_dtype();
    let fwd = m.forward()?;
    let up = |v: &[f32], cols| Act::upload(fwd.pool(), fwd.stream(), N, cols, d, v);
    let (x, r) = (up(&c.x, C)?, up(&c.r, C)?);
    let (yln, saved) = s.ln.forward(&fwd, &x, Some(&r))?;
    let z = s.fc.forward(&fwd, &yln)?;
    let (a, z_saved) = gelu(&fwd, &z)?;
    let y = s.proj.forward(&fwd, &a)?;
    let (y_host, h_host) = (y.to_f32(fwd.stream())?, saved.h().to_f32(fwd.stream())?);
    fwd.finish()?;
    let bwd = m.backward()?;
    let up = |v: &[f32], cols| Act::upload(bwd.pool(), bwd.stream(), N, cols, d, v);
    let (dy, dres) = (up(&c.dy, C)?, up(&c.dres, C)?);
    let da = s.proj.backward(&bwd, &a, &dy, true)?.expect("dx asked for");
    let dz = gelu_backward(&bwd, &z_saved, &da)?;
    let dyln = s.fc.backward(&bwd, &yln, &dz, true)?.expect("dx asked for");
    let dx = s.ln.backward(&bwd, &saved, &dyln, Some(&dres))?;
    assert!(
        dx.same_memory(&dres),
        "the residual gradient is added in place"
    );
    let dres_host = dx.to_f32(bwd.stream())?;
    bwd.finish()?;
    Ok([y_host, h_host, dres_host])
}

/// The stack on `dev` with parameters of `dtype`, against the f64 reference at `tol`.
fn stack_matches_reference(dev: Device, dtype: DType, tol: f64) {
    let name = format!("{} {dtype}", dev.name());
    let mut m = manager(dev, dtype);
    let s = Stack::register(&mut m).unwrap();
    let params = s.ids().map(|id| m.read(id).unwrap());
    let c = Case {
        params,
        x: data(N * C, 10, 2.0, dtype),
        r: data(N * C, 11, 1.0, dtype),
        dy: data(N * C, 12, 1.0, dtype),
        dres: data(N * C, 13, 0.5, dtype),
    };
    let want = reference(&c);
    let [y, h, dres] = run_stack(&mut m, &s, &c).unwrap();
    let mut worst = close(&format!("{name}: y"), &y, &want.y, tol);
    worst = worst.max(close(&format!("{name}: h"), &h, &want.h, tol));
    worst = worst.max(close(&format!("{name}: dres"), &dres, &want.dres, tol));
    let names = ["dγ", "dβ", "dW1", "db1", "dW2", "db2"];
    for ((id, want), n) in s.ids().iter().zip(&want.grads).zip(names) {
        let got = m.read(*id).unwrap();
        worst = worst.max(close(&format!("{name}: {n}"), &got, want, tol));
    }
    eprintln!("{name}: worst error {worst:.2e} (bound {tol:.0e})");
}

// Tolerances, as `close` measures them (relative to the element plus the tensor's largest
// magnitude). f32: storage and math in f32 against f64, 1e-5 (sums of at most 16 products,
// GELU's few-ulp tanh, LayerNorm's rstd; measured 1.3e-7 on the simulated device). f16: every
// activation and gradient is rounded to f16 (2⁻¹¹ relative) at each stage, 5e-3 (measured
// 5.1e-4: the last rounding dominates). bf16 (2⁻⁸ per rounding): 3e-2 (measured 3.4e-3).
const TOL_F32: f64 = 1e-5;
const TOL_F16: f64 = 5e-3;
const TOL_BF16: f64 = 3e-2;

#[test]
fn stack_gradients_match_an_f64_reference() {
    for dev in common::devices("nn::stack") {
        stack_matches_reference(dev.clone(), DType::F32, TOL_F32);
        stack_matches_reference(dev.clone(), DType::F16, TOL_F16);
        stack_matches_reference(dev, DType::BF16, TOL_BF16);
    }
}

/// `y = L(L(x))` with one square Linear applied twice: its gradients are the sums of the
/// two uses' shares.
#[test]
fn a_shared_linear_gets_the_sum_of_its_uses() {
    for dev in common::devices("nn::shared") {
        let d = DType::F32;
        let mut m = manager(dev.clone(), d);
        let l = Linear::register_with(
            &mut m,
            "tied",
            C,
            C,
            Linear::default_init("tied", C),
            Some(Init::Constant(0.1)),
        )
        .unwrap()
        .shared();
        assert_eq!(l.uses, WeightUse::Shared);
        let (w, b) = (m.read(l.weight).unwrap(), m.read(l.bias.unwrap()).unwrap());
        let (x, dy) = (data(N * C, 20, 1.0, d), data(N * C, 21, 1.0, d));
        let fwd = m.forward().unwrap();
        let xa = Act::upload(fwd.pool(), fwd.stream(), N, C, d, &x).unwrap();
        let y1 = l.forward(&fwd, &xa).unwrap();
        let y2 = l.forward(&fwd, &y1).unwrap();
        let y2_host = y2.to_f32(fwd.stream()).unwrap();
        fwd.finish().unwrap();
        let bwd = m.backward().unwrap();
        let dya = Act::upload(bwd.pool(), bwd.stream(), N, C, d, &dy).unwrap();
        let dy1 = l.backward(&bwd, &y1, &dya, true).unwrap().unwrap();
        assert!(l.backward(&bwd, &xa, &dy1, false).unwrap().is_none());
        bwd.finish().unwrap();

        let (w64, b64) = (f64s(&w), f64s(&b));
        let y1r = linear_f64(&f64s(&x), &w64, &b64, C, C);
        let y2r = linear_f64(&y1r, &w64, &b64, C, C);
        let (dy1r, dw2, db2) = linear_grads_f64(&y1r, &w64, &f64s(&dy), C, C);
        let (_, dw1, db1) = linear_grads_f64(&f64s(&x), &w64, &dy1r, C, C);
        let sum = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(a, b)| a + b).collect::<Vec<_>>();
        let name = dev.name();
        close(&format!("{name}: y2"), &y2_host, &y2r, TOL_F32);
        close(
            &format!("{name}: dW"),
            &m.read(l.weight).unwrap(),
            &sum(&dw1, &dw2),
            TOL_F32,
        );
        close(
            &format!("{name}: db"),
            &m.read(l.bias.unwrap()).unwrap(),
            &sum(&db1, &db2),
            TOL_F32,
        );
    }
}

/// Applied twice without `shared()`, the second backward's gradient write is refused.
#[test]
fn a_linear_used_twice_must_be_shared() {
    let d = DType::F32;
    let mut m = manager(common::sim(1 << 20), d);
    let l = Linear::register(&mut m, "once", C, C, true, None).unwrap();
    let fwd = m.forward().unwrap();
    let x = Act::upload(fwd.pool(), fwd.stream(), N, C, d, &data(N * C, 30, 1.0, d)).unwrap();
    let y1 = l.forward(&fwd, &x).unwrap();
    let _y2 = l.forward(&fwd, &y1).unwrap();
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    let dy = Act::upload(bwd.pool(), bwd.stream(), N, C, d, &data(N * C, 31, 1.0, d)).unwrap();
    let err = l.backward(&bwd, &y1, &dy, true).unwrap_err();
    assert!(
        matches!(&err, Error::Conflict { with, .. } if with.contains("write it at the last")),
        "{err}"
    );
}

/// Wrong shapes and types are typed errors before anything runs: the pass goes on, and a
/// correct call afterwards computes the right gradients.
#[test]
fn bad_input_is_a_typed_error() {
    let d = DType::F32;
    let mut m = manager(common::sim(1 << 20), d);
    let ln = LayerNorm::register(&mut m, "ln", C, EPS).unwrap();
    let l = Linear::register(&mut m, "fc", C, H, true, None).unwrap();
    assert!(Linear::from_ids(&m, l.weight, Some(ln.gamma), WeightUse::Once).is_err());
    assert_eq!(
        Linear::from_ids(&m, l.weight, l.bias, WeightUse::Once).unwrap(),
        l
    );
    assert!(Linear::from_ids(&m, ln.gamma, None, WeightUse::Once).is_err());
    assert!(Linear::register(&mut m, "empty", 0, 4, true, None).is_err());
    assert!(LayerNorm::register(&mut m, "bad", C, f32::NAN).is_err());

    let fwd = m.forward().unwrap();
    let up = |rows, cols, dt| {
        Act::upload(
            fwd.pool(),
            fwd.stream(),
            rows,
            cols,
            dt,
            &data(rows * cols, 40, 1.0, dt),
        )
    };
    let x = up(N, C, d).unwrap();
    let bad = |r: Result<Act>| {
        let typed = matches!(
            r,
            Err(Error::ActivationShape { .. } | Error::InvalidArgument(_))
        );
        assert!(typed, "{r:?}");
    };
    bad(l.forward(&fwd, &up(N, C + 1, d).unwrap()));
    bad(l.forward(&fwd, &up(N, C, DType::F16).unwrap()));
    bad(ln
        .forward(&fwd, &x, Some(&up(N + 1, C, d).unwrap()))
        .map(|(y, _)| y));
    bad(ln
        .forward(&fwd, &up(N, H, d).unwrap(), None)
        .map(|(y, _)| y));
    let (yln, saved) = ln.forward(&fwd, &x, None).unwrap();
    assert!(
        saved.h().same_memory(&x),
        "without a residual the saved input is x itself"
    );
    let y = l.forward(&fwd, &yln).unwrap();
    fwd.finish().unwrap();

    let bwd = m.backward().unwrap();
    let up = |rows, cols| {
        Act::upload(
            bwd.pool(),
            bwd.stream(),
            rows,
            cols,
            d,
            &data(rows * cols, 41, 1.0, d),
        )
    };
    let dy = up(N, H).unwrap();
    let bad = |r: Result<Option<Act>>| {
        let typed = matches!(
            r,
            Err(Error::ActivationShape { .. } | Error::InvalidArgument(_))
        );
        assert!(typed, "{r:?}");
    };
    bad(l.backward(&bwd, &yln, &up(N - 1, H).unwrap(), true));
    bad(l.backward(&bwd, &yln, &up(N, C).unwrap(), true));
    bad(l.backward(&bwd, &y, &dy, true));
    let dyln = l.backward(&bwd, &yln, &dy, true).unwrap().unwrap();
    let bad = |r: Result<Act>| {
        let typed = matches!(
            r,
            Err(Error::ActivationShape { .. } | Error::Operands { .. })
        );
        assert!(typed, "{r:?}");
    };
    bad(ln.backward(&bwd, &saved, &up(N, H).unwrap(), None));
    bad(ln.backward(&bwd, &saved, &dyln, Some(&dyln)));
    bad(ln.backward(&bwd, &saved, &dyln, Some(&up(N + 1, C).unwrap())));
    ln.backward(&bwd, &saved, &dyln, None).unwrap();
    bwd.finish().unwrap();
    // db = Σ_rows dy: the refused calls wrote nothing
    let dyv = f64s(&data(N * H, 41, 1.0, d));
    let db: Vec<f64> = (0..H)
        .map(|o| (0..N).map(|n| dyv[n * H + o]).sum())
        .collect();
    close(
        "db after refused calls",
        &m.read(l.bias.unwrap()).unwrap(),
        &db,
        TOL_F32,
    );
}

/// A Linear without a bias: `y = x·Wᵀ`, and only the weight's gradient (no input gradient
/// asked for).
#[test]
fn a_linear_without_bias() {
    let d = DType::F32;
    let mut m = manager(common::sim(1 << 20), d);
    let l = Linear::register(&mut m, "nobias", C, H, false, None).unwrap();
    assert_eq!((l.bias, l.params()), (None, vec![l.weight]));
    let w = f64s(&m.read(l.weight).unwrap());
    let bound = 1.0 / (C as f64).sqrt(); // the default init: uniform in ±1/√inputs
    assert!(w.iter().all(|v| v.abs() <= bound) && w.iter().any(|&v| v != w[0]));
    let (x, dy) = (data(N * C, 50, 1.0, d), data(N * H, 51, 1.0, d));
    let fwd = m.forward().unwrap();
    let xa = Act::upload(fwd.pool(), fwd.stream(), N, C, d, &x).unwrap();
    let y = l.forward(&fwd, &xa).unwrap().to_f32(fwd.stream()).unwrap();
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    let dya = Act::upload(bwd.pool(), bwd.stream(), N, H, d, &dy).unwrap();
    assert!(l.backward(&bwd, &xa, &dya, false).unwrap().is_none());
    bwd.finish().unwrap();
    close(
        "y",
        &y,
        &linear_f64(&f64s(&x), &w, &[0.0; H], C, H),
        TOL_F32,
    );
    let (_, dw, _) = linear_grads_f64(&f64s(&x), &w, &f64s(&dy), C, H);
    close("dW", &m.read(l.weight).unwrap(), &dw, TOL_F32);
}
