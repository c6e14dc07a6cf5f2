//! The loss layers and the `Sequential` container against f64 references: each loss's value
//! and its gradient (the mean's, times the optimizer's loss scale, over its micro-batches),
//! and a `Sequential` against the same layers composed by hand, bit for bit.

use tidemem::nn::{
    relu, relu_backward, Act, BceWithLogitsLoss, CrossEntropyLoss, Gelu, Layer, Linear, MseLoss,
    Relu, Sequential,
};
use tidemem::optim::{AdamConfig, HybridAdam, HybridConfig, ScalerConfig};
use tidemem::prelude::*;

const SCALE: f32 = 8.0;
const MICRO: u32 = 2;

fn manager() -> ChunkManager {
    let dev = Device::sim(SimConfig::with_capacity(1 << 22)).unwrap();
    let mut cfg = ManagerConfig::new(1 << 10, Policy::Tide);
    cfg.param_dtype = DType::F32;
    let mut m = ChunkManager::new(dev, cfg).unwrap();
    // a pass needs a model: one parameter the loss tests do not use
    m.register("unused", &[1], Init::Zeros).unwrap();
    m
}

/// An optimizer with a loss scale of [`SCALE`] that accumulates [`MICRO`] micro-batches.
fn adam() -> HybridAdam {
    let mut cfg = HybridConfig::new(AdamConfig::adam(1e-3));
    cfg.loss_scale = Some(ScalerConfig {
        init_scale: SCALE,
        ..ScalerConfig::default()
    });
    cfg.accumulation_steps = MICRO;
    HybridAdam::new(cfg).unwrap()
}

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 29 + seed * 13) % 41) as f32 / 10.0 - 2.0)
        .collect()
}

#[track_caller]
fn close(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = 1e-5 * w.abs().max(1e-2);
        assert!((f64::from(g) - w).abs() <= tol, "{what}[{i}]: {g} vs {w}");
    }
}

/// The factor of every gradient: the loss scale over the terms and the micro-batches.
fn factor(terms: usize) -> f64 {
    f64::from(SCALE) / (terms as f64 * f64::from(MICRO))
}

#[test]
fn cross_entropy_matches_its_f64_reference() {
    let (rows, classes) = (3, 5);
    let x = values(rows * classes, 1);
    let targets = [1, -100, 4];
    let mut m = manager();
    let opt = adam();
    let fwd = m.forward().unwrap();
    let logits = Act::upload(fwd.pool(), fwd.stream(), rows, classes, DType::F32, &x).unwrap();
    let ce = CrossEntropyLoss::new(classes).unwrap();
    let (loss, grad) = ce.forward(&fwd, &opt, logits, &targets).unwrap();
    let grad = grad.to_f32(fwd.stream()).unwrap();
    fwd.finish().unwrap();

    let (mut want_loss, mut want_grad) = (0.0, vec![0.0; rows * classes]);
    for (r, &t) in targets.iter().enumerate() {
        if t < 0 {
            continue;
        }
        let row: Vec<f64> = x[r * classes..(r + 1) * classes]
            .iter()
            .map(|&v| v.into())
            .collect();
        let mx = row.iter().cloned().fold(f64::MIN, f64::max);
        let sum: f64 = row.iter().map(|v| (v - mx).exp()).sum();
        want_loss += sum.ln() + mx - row[t as usize];
        for c in 0..classes {
            let p = (row[c] - mx).exp() / sum;
            let onehot = if c == t as usize { 1.0 } else { 0.0 };
            want_grad[r * classes + c] = (p - onehot) * factor(2);
        }
    }
    close("loss", &[loss.read().unwrap()], &[want_loss / 2.0]);
    close("gradient", &grad, &want_grad);
    assert!(matches!(
        CrossEntropyLoss::new(0),
        Err(Error::TooFew { got: 0, .. })
    ));
}

#[test]
fn a_target_past_the_classes_is_refused() {
    let mut m = manager();
    let opt = adam();
    let fwd = m.forward().unwrap();
    let logits = Act::upload(fwd.pool(), fwd.stream(), 2, 3, DType::F32, &[0.0; 6]).unwrap();
    let r = CrossEntropyLoss::new(3)
        .unwrap()
        .forward(&fwd, &opt, logits, &[0, 3]);
    assert!(
        matches!(
            r,
            Err(Error::TokenOutOfRange {
                token: 3,
                position: 1,
                vocab: 3
            })
        ),
        "{r:?}"
    );
    fwd.finish().unwrap();
}

#[test]
fn mean_squared_error_matches_its_f64_reference() {
    let (rows, cols) = (4, 3);
    let (y, t) = (values(rows * cols, 2), values(rows * cols, 5));
    let mut m = manager();
    let opt = adam();
    let fwd = m.forward().unwrap();
    let ya = Act::upload(fwd.pool(), fwd.stream(), rows, cols, DType::F32, &y).unwrap();
    let (loss, grad) = MseLoss.forward(&fwd, &opt, &ya, &t).unwrap();
    let grad = grad.to_f32(fwd.stream()).unwrap();
    assert!(matches!(
        MseLoss.forward(&fwd, &opt, &ya, &t[1..]),
        Err(Error::Length {
            got: 11,
            expected: 12,
            ..
        })
    ));
    fwd.finish().unwrap();
    let n = rows * cols;
    let d: Vec<f64> = y
        .iter()
        .zip(&t)
        .map(|(&a, &b)| f64::from(a) - f64::from(b))
        .collect();
    let want_loss = d.iter().map(|v| v * v).sum::<f64>() / n as f64;
    let want_grad: Vec<f64> = d.iter().map(|v| 2.0 * v * factor(n)).collect();
    close("loss", &[loss.read().unwrap()], &[want_loss]);
    close("gradient", &grad, &want_grad);
}

#[test]
fn binary_cross_entropy_matches_its_f64_reference() {
    let (rows, cols) = (3, 2);
    let x = values(rows * cols, 3);
    let labels = [1.0, 0.0, 0.25, 1.0, 0.0, 0.75];
    let mut m = manager();
    let opt = adam();
    let fwd = m.forward().unwrap();
    let xa = Act::upload(fwd.pool(), fwd.stream(), rows, cols, DType::F32, &x).unwrap();
    let (loss, grad) = BceWithLogitsLoss.forward(&fwd, &opt, &xa, &labels).unwrap();
    let grad = grad.to_f32(fwd.stream()).unwrap();
    let bad = BceWithLogitsLoss.forward(&fwd, &opt, &xa, &[2.0; 6]);
    assert!(matches!(bad, Err(Error::BadValue { .. })), "{bad:?}");
    fwd.finish().unwrap();
    let n = rows * cols;
    let (mut want_loss, mut want_grad) = (0.0, Vec::new());
    for (&xi, &yi) in x.iter().zip(&labels) {
        let (xi, yi) = (f64::from(xi), f64::from(yi));
        want_loss += xi.max(0.0) - xi * yi + (1.0 + (-xi.abs()).exp()).ln();
        want_grad.push((1.0 / (1.0 + (-xi).exp()) - yi) * factor(n));
    }
    close("loss", &[loss.read().unwrap()], &[want_loss / n as f64]);
    close("gradient", &grad, &want_grad);
}

/// A `Sequential` of Linear → ReLU → Linear → GELU → Linear gives the gradients of the same
/// layers composed by hand, bit for bit, and refuses another container's saved state.
#[test]
fn a_sequential_is_the_layers_composed_by_hand() {
    let (rows, dims) = (4, [6, 8, 5, 3]);
    let x = values(rows * dims[0], 7);
    let targets = [0, 2, 1, 2];
    let run = |by_hand: bool| -> Vec<Vec<f32>> {
        let mut m = manager();
        let opt = adam();
        let fc: Vec<Linear> = (0..3)
            .map(|i| {
                Linear::register(&mut m, &format!("fc{i}"), dims[i], dims[i + 1], true, None)
                    .unwrap()
            })
            .collect();
        let fwd = m.forward().unwrap();
        let xa = Act::upload(fwd.pool(), fwd.stream(), rows, dims[0], DType::F32, &x).unwrap();
        let ce = CrossEntropyLoss::new(dims[3]).unwrap();
        if by_hand {
            let z0 = fc[0].forward(&fwd, &xa).unwrap();
            let (a0, r) = relu(&fwd, &z0).unwrap();
            let z1 = fc[1].forward(&fwd, &a0).unwrap();
            let (a1, g) = Layer::forward(&Gelu, &fwd, &z1).unwrap();
            let y = fc[2].forward(&fwd, &a1).unwrap();
            let (_, dy) = ce.forward(&fwd, &opt, y, &targets).unwrap();
            fwd.finish().unwrap();
            let bwd = m.backward().unwrap();
            let da1 = fc[2].backward(&bwd, &a1, &dy, true).unwrap().unwrap();
            let dz1 = Layer::backward(&Gelu, &bwd, g, &da1, true)
                .unwrap()
                .unwrap();
            let da0 = fc[1].backward(&bwd, &a0, &dz1, true).unwrap().unwrap();
            let dz0 = relu_backward(&bwd, &r, &da0).unwrap();
            assert!(fc[0].backward(&bwd, &xa, &dz0, false).unwrap().is_none());
            bwd.finish().unwrap();
        } else {
            let model = Sequential::new()
                .push(fc[0])
                .push(Relu)
                .push(fc[1])
                .push(Gelu)
                .push(fc[2]);
            assert_eq!(model.params().len(), 6);
            let (y, saved) = model.forward(&fwd, &xa).unwrap();
            let (_, dy) = ce.forward(&fwd, &opt, y, &targets).unwrap();
            // a saved state of another container is refused before anything runs
            let other = Sequential::new().push(Relu);
            let (_, wrong) = other.forward(&fwd, &xa).unwrap();
            fwd.finish().unwrap();
            let bwd = m.backward().unwrap();
            let r = model.backward(&bwd, wrong, &dy, false);
            assert!(matches!(r, Err(Error::SavedMismatch { .. })), "{r:?}");
            assert!(model.backward(&bwd, saved, &dy, false).unwrap().is_none());
            bwd.finish().unwrap();
        }
        fc.iter()
            .flat_map(|l| l.params())
            .map(|id| m.read(id).unwrap())
            .collect()
    };
    let (hand, seq) = (run(true), run(false));
    for (k, (a, b)) in hand.iter().zip(&seq).enumerate() {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b), "gradient {k}");
        assert!(a.iter().any(|&v| v != 0.0), "gradient {k} is all zeros");
    }
}

/// A `Sequential` of Linear → ReLU → Linear under a mean squared error: every parameter's
/// gradient against an f64 forward and backward from the same initial weights.
#[test]
fn a_sequential_matches_its_f64_reference() {
    let (rows, [i, h, o]) = (4, [3, 5, 2]);
    let (x, t) = (values(rows * i, 11), values(rows * o, 12));
    let mut m = manager();
    let opt = adam();
    let fc1 = Linear::register(&mut m, "fc1", i, h, true, None).unwrap();
    let fc2 = Linear::register(&mut m, "fc2", h, o, true, None).unwrap();
    let read = |m: &mut ChunkManager, id| -> Vec<f64> {
        m.read(id).unwrap().into_iter().map(f64::from).collect()
    };
    let (w1, b1) = (read(&mut m, fc1.weight), read(&mut m, fc1.bias.unwrap()));
    let (w2, b2) = (read(&mut m, fc2.weight), read(&mut m, fc2.bias.unwrap()));
    let model = Sequential::new().push(fc1).push(Relu).push(fc2);
    let fwd = m.forward().unwrap();
    let xa = Act::upload(fwd.pool(), fwd.stream(), rows, i, DType::F32, &x).unwrap();
    let (y, saved) = model.forward(&fwd, &xa).unwrap();
    let (loss, dy) = MseLoss.forward(&fwd, &opt, &y, &t).unwrap();
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    model.backward(&bwd, saved, &dy, false).unwrap();
    bwd.finish().unwrap();

    // the f64 reference: z = x·W1ᵀ + b1, a = relu(z), y = a·W2ᵀ + b2, L = mean((y − t)²)
    let lin = |inp: &[f64], w: &[f64], b: &[f64], k: usize, n: usize| -> Vec<f64> {
        (0..rows * n)
            .map(|rc| {
                let (r, c) = (rc / n, rc % n);
                b[c] + (0..k).map(|j| inp[r * k + j] * w[c * k + j]).sum::<f64>()
            })
            .collect()
    };
    let xf: Vec<f64> = x.iter().map(|&v| v.into()).collect();
    let z = lin(&xf, &w1, &b1, i, h);
    let a: Vec<f64> = z.iter().map(|&v| v.max(0.0)).collect();
    let yf = lin(&a, &w2, &b2, h, o);
    let n = rows * o;
    let dyf: Vec<f64> = yf
        .iter()
        .zip(&t)
        .map(|(&y, &t)| 2.0 * (y - f64::from(t)) * factor(n))
        .collect();
    let want_loss = yf
        .iter()
        .zip(&t)
        .map(|(&y, &t)| (y - f64::from(t)).powi(2))
        .sum::<f64>()
        / n as f64;
    // dW = dyᵀ·inp, db = Σ_rows dy, d(inp) = dy·W
    let grads = |d: &[f64], inp: &[f64], w: &[f64], k: usize, n: usize| {
        let dw: Vec<f64> = (0..n * k)
            .map(|ck| {
                (0..rows)
                    .map(|r| d[r * n + ck / k] * inp[r * k + ck % k])
                    .sum()
            })
            .collect();
        let db: Vec<f64> = (0..n)
            .map(|c| (0..rows).map(|r| d[r * n + c]).sum())
            .collect();
        let dinp: Vec<f64> = (0..rows * k)
            .map(|rj| (0..n).map(|c| d[rj / k * n + c] * w[c * k + rj % k]).sum())
            .collect();
        (dw, db, dinp)
    };
    let (dw2, db2, da) = grads(&dyf, &a, &w2, h, o);
    let dz: Vec<f64> = da
        .iter()
        .zip(&z)
        .map(|(&d, &z)| if z > 0.0 { d } else { 0.0 })
        .collect();
    let (dw1, db1, _) = grads(&dz, &xf, &w1, i, h);
    close("loss", &[loss.read().unwrap()], &[want_loss]);
    let got = |m: &mut ChunkManager, id| m.read(id).unwrap();
    close("fc1.weight", &got(&mut m, fc1.weight), &dw1);
    close("fc1.bias", &got(&mut m, fc1.bias.unwrap()), &db1);
    close("fc2.weight", &got(&mut m, fc2.weight), &dw2);
    close("fc2.bias", &got(&mut m, fc2.bias.unwrap()), &db2);
}
