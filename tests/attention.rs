//! Causal multi-head attention (`ops::attention`) on every device: forward and backward against
//! an f64 reference, the reference's (analytic) backward against central finite differences of its
//! forward, f32/f16/bf16.

mod common;
mod ops_util;

use ops_util::*;
use tidemem::device::{Device, DeviceBuffer};
use tidemem::ops::attention::{Attention, AttentionBackward, AttentionForward};
use tidemem::ops::heads::Heads;
use tidemem::DType;

/// `out [B,T,C]` of attention over `qkv [B,T,3C]`, in f64.
fn reference(qkv: &[f64], (b, t, h, d): (usize, usize, usize, usize)) -> Vec<f64> {
    let c = h * d;
    let at = |bi: usize, ti: usize, part: usize, hi: usize, di: usize| {
        qkv[((bi * t + ti) * 3 + part) * c + hi * d + di]
    };
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; b * t * c];
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..t {
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d)
                            .map(|x| at(bi, i, 0, hi, x) * at(bi, j, 1, hi, x))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for x in 0..d {
                    out[(bi * t + i) * c + hi * d + x] =
                        (0..=i).map(|j| e[j] / z * at(bi, j, 2, hi, x)).sum();
                }
            }
        }
    }
    out
}

/// d(Σ dout·out)/d qkv by central differences of the f64 reference.
fn finite_differences(qkv: &[f64], dout: &[f64], shape: (usize, usize, usize, usize)) -> Vec<f64> {
    let eps = 1e-6;
    let f = |x: &[f64]| -> f64 {
        reference(x, shape)
            .iter()
            .zip(dout)
            .map(|(o, g)| o * g)
            .sum()
    };
    (0..qkv.len())
        .map(|i| central_diff(qkv, i, eps, f))
        .collect()
}

/// d(Σ dout·out)/d qkv analytically, in f64.
fn reference_backward(
    qkv: &[f64],
    dout: &[f64],
    (b, t, h, d): (usize, usize, usize, usize),
) -> Vec<f64> {
    let c = h * d;
    let idx = |bi: usize, ti: usize, part: usize, hi: usize, di: usize| {
        ((bi * t + ti) * 3 + part) * c + hi * d + di
    };
    let scale = 1.0 / (d as f64).sqrt();
    let mut g = vec![0.0; qkv.len()];
    for bi in 0..b {
        for hi in 0..h {
            // probabilities P [t, t] (causal)
            let mut p = vec![0.0; t * t];
            for i in 0..t {
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d)
                            .map(|x| qkv[idx(bi, i, 0, hi, x)] * qkv[idx(bi, j, 1, hi, x)])
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for j in 0..=i {
                    p[i * t + j] = (s[j] - m).exp() / z;
                }
            }
            let dy = |i: usize, x: usize| dout[(bi * t + i) * c + hi * d + x];
            for i in 0..t {
                // dP[i, j] = dY[i]·V[j]; dS = P ⊙ (dP − Σ_j dP·P)
                let dp: Vec<f64> = (0..=i)
                    .map(|j| (0..d).map(|x| dy(i, x) * qkv[idx(bi, j, 2, hi, x)]).sum())
                    .collect();
                let dot: f64 = (0..=i).map(|j| dp[j] * p[i * t + j]).sum();
                for j in 0..=i {
                    let ds = p[i * t + j] * (dp[j] - dot) * scale;
                    for x in 0..d {
                        g[idx(bi, i, 0, hi, x)] += ds * qkv[idx(bi, j, 1, hi, x)];
                        g[idx(bi, j, 1, hi, x)] += ds * qkv[idx(bi, i, 0, hi, x)];
                        g[idx(bi, j, 2, hi, x)] += p[i * t + j] * dy(i, x);
                    }
                }
            }
        }
    }
    g
}

#[test]
fn the_reference_backward_matches_finite_differences() {
    let mut r = SplitMix64::new(3);
    for shape in [(1, 1, 1, 1), (1, 4, 2, 3), (2, 5, 1, 2)] {
        let (b, t, h, d) = shape;
        let n = b * t * h * d;
        let (qkv, dout) = (r.uniform(3 * n, 1.0), r.uniform(n, 1.0));
        let fd = finite_differences(&qkv, &dout, shape);
        let an = reference_backward(&qkv, &dout, shape);
        for (i, (a, f)) in an.iter().zip(&fd).enumerate() {
            assert!(
                (a - f).abs() <= 1e-7 * (1.0 + f.abs()),
                "{shape:?} [{i}]: {a} vs {f}"
            );
        }
    }
}

/// Runs forward and backward on `dev`; returns `(out, dqkv)`.
fn view(buf: &DeviceBuffer, n: usize) -> tidemem::device::DeviceView<'_> {
    buf.view(0, n).unwrap()
}

fn run(
    dev: &Device,
    qkv: &[f64],
    dout: &[f64],
    shape: (usize, usize, usize, usize),
    dt: DType,
) -> (Vec<f64>, Vec<f64>) {
    let (b, t, h, d) = shape;
    let s = dev.new_stream().unwrap();
    let a = Attention::new(Heads::new(b, t, h, d));
    let alloc = |n: usize| dev.alloc(n.max(1)).unwrap();
    let x = upv(dev, &s, qkv, dt);
    let g = upv(dev, &s, dout, dt);
    let hb = a.head_bytes(dt);
    let sb = a.scores_bytes(dt);
    let [q, k, v, y, dy, dq, dk, dv] = [(); 8].map(|_| alloc(hb));
    let [scores, att, datt, dscores] = [(); 4].map(|_| alloc(sb));
    let out = alloc(a.out_bytes(dt));
    let dqkv = alloc(3 * a.out_bytes(dt));
    a.forward(
        dev,
        &s,
        AttentionForward {
            qkv: (&x).into(),
            q: view(&q, hb),
            k: view(&k, hb),
            v: view(&v, hb),
            scores: view(&scores, sb),
            att: view(&att, sb),
            y: view(&y, hb),
            out: view(&out, a.out_bytes(dt)),
        },
        dt,
    )
    .unwrap();
    a.backward(
        dev,
        &s,
        AttentionBackward {
            dout: (&g).into(),
            q: view(&q, hb).into(),
            k: view(&k, hb).into(),
            v: view(&v, hb).into(),
            att: view(&att, sb).into(),
            dy: view(&dy, hb),
            datt: view(&datt, sb),
            dscores: view(&dscores, sb),
            dq: view(&dq, hb),
            dk: view(&dk, hb),
            dv: view(&dv, hb),
            dqkv: view(&dqkv, 3 * a.out_bytes(dt)),
        },
        dt,
    )
    .unwrap();
    let out = downv(dev, &s, &out, dt);
    let dqkv = downv(dev, &s, &dqkv, dt);
    (
        out[..b * t * h * d].to_vec(),
        dqkv[..3 * b * t * h * d].to_vec(),
    )
}

#[test]
fn forward_and_backward_match_an_f64_reference_and_finite_differences() {
    let mut r = SplitMix64::new(7);
    for dev in common::devices("attention") {
        for shape in [(1, 1, 1, 1), (2, 5, 2, 3), (1, 17, 3, 8), (2, 33, 2, 16)] {
            let (b, t, h, d) = shape;
            let n = b * t * h * d;
            let qkv = r.uniform(3 * n, 1.0);
            let dout = r.uniform(n, 1.0);
            let want_out = reference(&qkv, shape);
            let want_grad = reference_backward(&qkv, &dout, shape);
            for dt in [DType::F32, DType::F16, DType::BF16] {
                // Inputs are rounded to the storage type first: compare against the reference of
                // the rounded inputs, within what the type's rounding of intermediates allows
                // (f32: GEMMs over at most T terms; 16-bit types: a few units of their epsilon
                // carried through scores, probabilities and the products).
                let (qr, gr) = (round(&qkv, dt), round(&dout, dt));
                let (want_out, want_grad) = if dt == DType::F32 {
                    (want_out.clone(), want_grad.clone())
                } else {
                    (reference(&qr, shape), reference_backward(&qr, &gr, shape))
                };
                let tol = match dt {
                    DType::F32 => 2e-5,
                    DType::F16 => 1e-2,
                    _ => 6e-2,
                };
                let (out, dqkv) = run(&dev, &qr, &gr, shape, dt);
                for (i, (g, w)) in out.iter().zip(&want_out).enumerate() {
                    assert!(
                        (g - w).abs() <= tol * (1.0 + w.abs()),
                        "{dev:?} {dt} {shape:?} out[{i}]: {g} vs {w}"
                    );
                }
                for (i, (g, w)) in dqkv.iter().zip(&want_grad).enumerate() {
                    assert!(
                        (g - w).abs() <= 2.0 * tol * (1.0 + w.abs()),
                        "{dev:?} {dt} {shape:?} dqkv[{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn an_overflowing_shape_is_a_typed_error() {
    let dev = common::sim(1 << 20);
    let s = dev.new_stream().unwrap();
    let a = Attention::new(Heads::new(usize::MAX, 2, 2, 2));
    let buf = dev.alloc(64).unwrap();
    let v = buf.view(0, 64).unwrap();
    let e = a
        .forward(
            &dev,
            &s,
            AttentionForward {
                qkv: v.into(),
                q: v,
                k: v,
                v,
                scores: v,
                att: v,
                y: v,
                out: v,
            },
            DType::F32,
        )
        .unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
}
