//! LayerNorm (fused with the residual add), forward and backward, on every backend here: against
//! an f64 reference on shapes of one row and column, odd widths, widths past a warp's 32 lanes,
//! more rows than a block's 8 warps and than the 256 chunks of the parameter-gradient sums; the
//! f64 backward against central finite differences of the f64 forward, and the f32 op against
//! them too; bad operands refused with nothing written.
//!
//! Tolerances, with u the unit roundoff of the storage type (2⁻²⁴ f32, 2⁻¹¹ f16, 2⁻⁸ bf16) and
//! inputs already rounded to it:
//! - `y`: |Δ| ≤ 8u·(1 + |y|) + 1e-5·(1 + |y|) (f32 math, then one rounding to storage);
//! - `mean`: |Δ| ≤ 2e-6·max|h| of the row; `rstd`: relative 1e-5 (both f32);
//! - `dx`: |Δ| ≤ 8u·|dx| + 2e-5·S + 4u·S where S = rstd·max|γ·dy| of the row (with the forward's
//!   f32 mean and rstd);
//! - `dγ`, `dβ`: |Δ| ≤ 1e-5·Σ|terms| + 4u_g·|value| (u_g of their own type);
//! - f64 backward vs central differences (step 1e-6): 1e-6 of the gradient's scale; the f32 op
//!   vs central differences: 2e-4 of the scale.

mod common;
mod ops_util;

use ops_util::*;
use tidemem::device::{Device, DeviceBuffer, Stream};
use tidemem::ops::{
    layernorm_backward, layernorm_backward_scratch_bytes, layernorm_forward, LayerNormBackward,
    LayerNormForward, Residual,
};
use tidemem::DType;

const EPS: f64 = 1e-5;

/// The f64 forward of rows of `h`: (y, mean, rstd).
fn fwd64(h: &[f64], g: &[f64], b: &[f64], c: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut y, mut mean, mut rstd) = (vec![], vec![], vec![]);
    for row in h.chunks(c) {
        let m = row.iter().sum::<f64>() / c as f64;
        let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / c as f64;
        let rs = 1.0 / (var + EPS).sqrt();
        y.extend(
            row.iter()
                .zip(g)
                .zip(b)
                .map(|((v, g), b)| (v - m) * rs * g + b),
        );
        mean.push(m);
        rstd.push(rs);
    }
    (y, mean, rstd)
}

/// The f64 backward: (dh, dγ, dβ).
fn bwd64(dy: &[f64], h: &[f64], g: &[f64], c: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (_, mean, rstd) = fwd64(h, g, &vec![0.0; c], c);
    let (mut dx, mut dg, mut db) = (vec![], vec![0.0; c], vec![0.0; c]);
    for (r, (hr, dyr)) in h.chunks(c).zip(dy.chunks(c)).enumerate() {
        let n: Vec<f64> = hr.iter().map(|v| (v - mean[r]) * rstd[r]).collect();
        let w: Vec<f64> = dyr.iter().zip(g).map(|(d, g)| d * g).collect();
        let a = w.iter().sum::<f64>() / c as f64;
        let b = w.iter().zip(&n).map(|(w, n)| w * n).sum::<f64>() / c as f64;
        dx.extend(w.iter().zip(&n).map(|(w, n)| (w - a - n * b) * rstd[r]));
        for j in 0..c {
            dg[j] += n[j] * dyr[j];
            db[j] += dyr[j];
        }
    }
    (dx, dg, db)
}

struct FwdOut {
    h: Option<Vec<f64>>,
    y: Vec<f64>,
    mean: Vec<f32>,
    rstd: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn run_fwd(
    dev: &Device,
    s: &Stream,
    d: DType,
    x: &[f64],
    r: Option<&[f64]>,
    g: &[f64],
    b: &[f64],
    (n, c): (usize, usize),
) -> FwdOut {
    let (xb, gb, bb) = (upv(dev, s, x, d), upv(dev, s, g, d), upv(dev, s, b, d));
    let rb = r.map(|r| upv(dev, s, r, d));
    let hb = dev.alloc(n * c * d.size()).unwrap();
    let yb = dev.alloc(n * c * d.size()).unwrap();
    let (mb, sb) = (dev.alloc(n * 4).unwrap(), dev.alloc(n * 4).unwrap());
    let ops = LayerNormForward {
        x: (&xb).into(),
        residual: rb.as_ref().map(|rb| Residual {
            r: rb.into(),
            h: (&hb).into(),
        }),
        gamma: (&gb).into(),
        beta: (&bb).into(),
        y: (&yb).into(),
        mean: (&mb).into(),
        rstd: (&sb).into(),
    };
    layernorm_forward(dev, s, ops, n, c, EPS as f32, d).unwrap();
    FwdOut {
        h: r.map(|_| downv(dev, s, &hb, d)),
        y: downv(dev, s, &yb, d),
        mean: bytemuck::pod_collect_to_vec(&down(dev, s, &mb)),
        rstd: bytemuck::pod_collect_to_vec(&down(dev, s, &sb)),
    }
}

struct BwdIn<'a> {
    dy: &'a [f64],
    h: &'a [f64],
    mean: &'a [f32],
    rstd: &'a [f32],
    g: &'a [f64],
    dx0: Option<&'a [f64]>,
    dg0: &'a [f64],
    db0: &'a [f64],
}

/// (dx, dγ, dβ) from a device backward; dγ, dβ of type `gd`.
fn run_bwd(
    dev: &Device,
    s: &Stream,
    d: DType,
    gd: DType,
    i: &BwdIn<'_>,
    (n, c): (usize, usize),
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let f32s = |v: &[f32]| up(dev, s, bytemuck::cast_slice(v));
    let (dyb, hb, gb) = (
        upv(dev, s, i.dy, d),
        upv(dev, s, i.h, d),
        upv(dev, s, i.g, d),
    );
    let (mb, sb) = (f32s(i.mean), f32s(i.rstd));
    let dxb = match i.dx0 {
        Some(v) => upv(dev, s, v, d),
        None => up(dev, s, &vec![0x5a; n * c * d.size()]),
    };
    let (dgb, dbb) = (upv(dev, s, i.dg0, gd), upv(dev, s, i.db0, gd));
    let scratch = dev
        .alloc(layernorm_backward_scratch_bytes(n, c) + 12)
        .unwrap();
    let ops = LayerNormBackward {
        dy: (&dyb).into(),
        h: (&hb).into(),
        mean: (&mb).into(),
        rstd: (&sb).into(),
        gamma: (&gb).into(),
        dx: (&dxb).into(),
        accumulate: i.dx0.is_some(),
        dgamma: (&dgb).into(),
        dbeta: (&dbb).into(),
        param_grad_dtype: gd,
        scratch: (&scratch).into(),
    };
    layernorm_backward(dev, s, ops, n, c, d).unwrap();
    (
        downv(dev, s, &dxb, d),
        downv(dev, s, &dgb, gd),
        downv(dev, s, &dbb, gd),
    )
}

const SHAPES: [(usize, usize); 8] = [
    (1, 1),
    (3, 7),
    (5, 32),
    (9, 33),
    (17, 100),
    (300, 5),
    (2, 1000),
    (600, 41),
];

#[test]
fn forward_matches_the_f64_reference() {
    let mut rng = SplitMix64::new(1);
    for dev in common::devices("layernorm forward") {
        let s = dev.new_stream().unwrap();
        for d in FLOATS {
            let u = unit(d);
            for (n, c) in SHAPES {
                for residual in [false, true] {
                    let x = rng.vals(n * c, 2.0, 0.5, d);
                    let r = rng.vals(n * c, 1.0, 0.0, d);
                    let g = rng.vals(c, 1.0, 1.0, d);
                    let b = rng.vals(c, 0.5, 0.0, d);
                    let out = run_fwd(&dev, &s, d, &x, residual.then_some(&r), &g, &b, (n, c));
                    let what = format!("{d} [{n}, {c}] residual {residual}");
                    let h = if residual {
                        let sum: Vec<f64> = x.iter().zip(&r).map(|(a, b)| a + b).collect();
                        // h is the sum rounded once to storage (the f32 sum of two stored values
                        // rounds to the same).
                        let h = round(&sum, d);
                        assert_eq!(out.h.as_ref().unwrap(), &h, "{what}: h");
                        h
                    } else {
                        x.clone()
                    };
                    let (y, mean, rstd) = fwd64(&h, &g, &b, c);
                    for (i, row) in h.chunks(c).enumerate() {
                        let big = row.iter().fold(0.0f64, |a, v| a.max(v.abs()));
                        let m = out.mean[i] as f64;
                        assert!((m - mean[i]).abs() <= 2e-6 * big, "{what}: mean {i}");
                        let rs = out.rstd[i] as f64;
                        assert!((rs - rstd[i]).abs() <= 1e-5 * rstd[i], "{what}: rstd {i}");
                    }
                    let tol = 8.0 * u + 1e-5;
                    close(&format!("{what}: y"), &out.y, &y, tol, tol);
                }
            }
        }
    }
}

#[test]
fn backward_matches_the_f64_reference() {
    let mut rng = SplitMix64::new(2);
    for dev in common::devices("layernorm backward") {
        let s = dev.new_stream().unwrap();
        for d in FLOATS {
            let u = unit(d);
            for gd in [DType::F32, d] {
                let ug = unit(gd);
                for (n, c) in SHAPES {
                    for accumulate in [false, true] {
                        let h = rng.vals(n * c, 2.0, -0.3, d);
                        let dy = rng.vals(n * c, 1.0, 0.0, d);
                        let g = rng.vals(c, 1.0, 1.0, d);
                        let dx0 = rng.vals(n * c, 1.0, 0.0, d);
                        let (dg0, db0) = (rng.vals(c, 1.0, 0.0, gd), rng.vals(c, 1.0, 0.0, gd));
                        // The forward's f32 statistics, as the backward gets them.
                        let f = run_fwd(&dev, &s, d, &h, None, &g, &vec![0.0; c], (n, c));
                        let inp = BwdIn {
                            dy: &dy,
                            h: &h,
                            mean: &f.mean,
                            rstd: &f.rstd,
                            g: &g,
                            dx0: accumulate.then_some(&dx0),
                            dg0: &dg0,
                            db0: &db0,
                        };
                        let (dx, dg, db) = run_bwd(&dev, &s, d, gd, &inp, (n, c));
                        let what = format!("{d} grads {gd} [{n}, {c}] acc {accumulate}");
                        let (rdx, rdg, rdb) = bwd64(&dy, &h, &g, c);
                        for (r, ((got, want), old)) in dx
                            .chunks(c)
                            .zip(rdx.chunks(c))
                            .zip(dx0.chunks(c))
                            .enumerate()
                        {
                            let scale = f.rstd[r] as f64
                                * dy[r * c..][..c]
                                    .iter()
                                    .zip(&g)
                                    .fold(0.0f64, |a, (d, g)| a.max((d * g).abs()));
                            let want: Vec<f64> = if accumulate {
                                want.iter().zip(old).map(|(w, o)| w + o).collect()
                            } else {
                                want.to_vec()
                            };
                            let atol = (2e-5 + 4.0 * u) * scale + 4.0 * u;
                            close(&format!("{what}: dx row {r}"), got, &want, atol, 8.0 * u);
                        }
                        let (mut sg, mut sb) = (vec![0.0; c], vec![0.0; c]);
                        let (_, mean, rstd) = fwd64(&h, &g, &vec![0.0; c], c);
                        for r in 0..n {
                            for j in 0..c {
                                let nv = (h[r * c + j] - mean[r]) * rstd[r];
                                sg[j] += (nv * dy[r * c + j]).abs();
                                sb[j] += dy[r * c + j].abs();
                            }
                        }
                        for j in 0..c {
                            let (wg, wb) = (rdg[j] + dg0[j], rdb[j] + db0[j]);
                            let tg = 1e-5 * sg[j] + 4.0 * ug * wg.abs() + 1e-6;
                            let tb = 1e-5 * sb[j] + 4.0 * ug * wb.abs() + 1e-6;
                            assert!(
                                (dg[j] - wg).abs() <= tg,
                                "{what}: dgamma {j}: {} vs {wg}",
                                dg[j]
                            );
                            assert!(
                                (db[j] - wb).abs() <= tb,
                                "{what}: dbeta {j}: {} vs {wb}",
                                db[j]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Σ y·w of the f64 forward with a residual: the loss whose gradient the backward gives.
fn loss(x: &[f64], r: &[f64], g: &[f64], b: &[f64], w: &[f64], c: usize) -> f64 {
    let h: Vec<f64> = x.iter().zip(r).map(|(a, b)| a + b).collect();
    let (y, _, _) = fwd64(&h, g, b, c);
    y.iter().zip(w).map(|(y, w)| y * w).sum()
}

#[test]
fn backward_matches_finite_differences() {
    let mut rng = SplitMix64::new(3);
    let dev = common::sim(64 << 20);
    let s = dev.new_stream().unwrap();
    for (n, c) in [(1, 1), (2, 3), (3, 37), (5, 64)] {
        let x = rng.vals(n * c, 1.0, 0.2, DType::F32);
        let r = rng.vals(n * c, 1.0, 0.0, DType::F32);
        let g = rng.vals(c, 0.5, 1.0, DType::F32);
        let b = rng.vals(c, 0.5, 0.0, DType::F32);
        let w = rng.vals(n * c, 1.0, 0.0, DType::F32);
        let h: Vec<f64> = x.iter().zip(&r).map(|(a, b)| a + b).collect();
        let (dh, dg, db) = bwd64(&w, &h, &g, c);
        let step = 1e-6;
        let fd = |f: &dyn Fn(f64) -> f64| (f(step) - f(-step)) / (2.0 * step);
        let mut num_dx = vec![];
        for i in 0..n * c {
            num_dx.push(fd(&|e| {
                let mut x = x.clone();
                x[i] += e;
                loss(&x, &r, &g, &b, &w, c)
            }));
            let dr = fd(&|e| {
                let mut r = r.clone();
                r[i] += e;
                loss(&x, &r, &g, &b, &w, c)
            });
            assert!((dr - num_dx[i]).abs() <= 1e-6 * (1.0 + dr.abs()));
        }
        let num_dg: Vec<f64> = (0..c)
            .map(|j| {
                fd(&|e| {
                    let mut g = g.clone();
                    g[j] += e;
                    loss(&x, &r, &g, &b, &w, c)
                })
            })
            .collect();
        let num_db: Vec<f64> = (0..c)
            .map(|j| {
                fd(&|e| {
                    let mut b = b.clone();
                    b[j] += e;
                    loss(&x, &r, &g, &b, &w, c)
                })
            })
            .collect();
        let scale = |v: &[f64]| v.iter().fold(1.0f64, |a, x| a.max(x.abs()));
        let what = format!("[{n}, {c}]");
        let sx = scale(&num_dx);
        close(&format!("{what}: f64 dx"), &dh, &num_dx, 1e-6 * sx, 0.0);
        close(
            &format!("{what}: f64 dgamma"),
            &dg,
            &num_dg,
            1e-6 * scale(&num_dg),
            0.0,
        );
        close(
            &format!("{what}: f64 dbeta"),
            &db,
            &num_db,
            1e-6 * scale(&num_db),
            0.0,
        );
        // The f32 op: forward with the residual, then the backward on its h, mean and rstd.
        let f = run_fwd(&dev, &s, DType::F32, &x, Some(&r), &g, &b, (n, c));
        let hd = f.h.clone().unwrap();
        let zeros = vec![0.0; c];
        let inp = BwdIn {
            dy: &w,
            h: &hd,
            mean: &f.mean,
            rstd: &f.rstd,
            g: &g,
            dx0: None,
            dg0: &zeros,
            db0: &zeros,
        };
        let (dx, dg32, db32) = run_bwd(&dev, &s, DType::F32, DType::F32, &inp, (n, c));
        close(&format!("{what}: f32 dx"), &dx, &num_dx, 2e-4 * sx, 0.0);
        close(
            &format!("{what}: f32 dgamma"),
            &dg32,
            &num_dg,
            2e-4 * scale(&num_dg),
            0.0,
        );
        close(
            &format!("{what}: f32 dbeta"),
            &db32,
            &num_db,
            2e-4 * scale(&num_db),
            0.0,
        );
    }
}

/// Buffers of a forward over [2, 4] in f32, with a residual.
struct Bufs {
    x: DeviceBuffer,
    r: DeviceBuffer,
    g: DeviceBuffer,
    b: DeviceBuffer,
    h: DeviceBuffer,
    y: DeviceBuffer,
    m: DeviceBuffer,
    s: DeviceBuffer,
}

#[test]
fn bad_forward_operands_are_refused_and_nothing_is_written() {
    for dev in common::devices("layernorm forward refusals") {
        let s = dev.new_stream().unwrap();
        let f = |n: usize, b: u8| up(&dev, &s, &vec![b; n * 4]);
        let k = Bufs {
            x: up(&dev, &s, &enc(&[1.0; 8], DType::F32)),
            r: up(&dev, &s, &enc(&[1.0; 8], DType::F32)),
            g: up(&dev, &s, &enc(&[1.0; 4], DType::F32)),
            b: up(&dev, &s, &enc(&[0.0; 4], DType::F32)),
            h: f(8, 0x11),
            y: f(8, 0x22),
            m: f(2, 0x33),
            s: f(2, 0x44),
        };
        let short = f(7, 0x55);
        let wide = f(16, 0x66);
        let half = up(&dev, &s, &[0x77; 16]);
        let before: Vec<(Vec<u8>, &DeviceBuffer)> = [&k.h, &k.y, &k.m, &k.s, &short, &wide, &half]
            .into_iter()
            .map(|b| (down(&dev, &s, b), b))
            .collect();
        let check = |what: &str, ops: LayerNormForward<'_>, n: usize, c: usize, eps: f32, d| {
            let r = layernorm_forward(&dev, &s, ops, n, c, eps, d);
            let bufs: Vec<(&DeviceBuffer, &[u8])> =
                before.iter().map(|(v, b)| (*b, &v[..])).collect();
            refused(what, r, &dev, &s, &bufs);
        };
        let good = || LayerNormForward {
            x: (&k.x).into(),
            residual: Some(Residual {
                r: (&k.r).into(),
                h: (&k.h).into(),
            }),
            gamma: (&k.g).into(),
            beta: (&k.b).into(),
            y: (&k.y).into(),
            mean: (&k.m).into(),
            rstd: (&k.s).into(),
        };
        // The good launch works (on copies of the outputs, so `before` stays true).
        {
            let (h2, y2, m2, s2) = (f(8, 0), f(8, 0), f(2, 0), f(2, 0));
            let ops = LayerNormForward {
                residual: Some(Residual {
                    r: (&k.r).into(),
                    h: (&h2).into(),
                }),
                y: (&y2).into(),
                mean: (&m2).into(),
                rstd: (&s2).into(),
                ..good()
            };
            layernorm_forward(&dev, &s, ops, 2, 4, 1e-5, DType::F32).unwrap();
        }
        check(
            "y too short",
            LayerNormForward {
                y: (&short).into(),
                ..good()
            },
            2,
            4,
            1e-5,
            DType::F32,
        );
        check(
            "y too long",
            LayerNormForward {
                y: (&wide).into(),
                ..good()
            },
            2,
            4,
            1e-5,
            DType::F32,
        );
        check("rows do not match", good(), 3, 4, 1e-5, DType::F32);
        check(
            "gamma of the wrong width",
            LayerNormForward {
                gamma: (&k.x).into(),
                ..good()
            },
            2,
            4,
            1e-5,
            DType::F32,
        );
        check(
            "mean of the wrong length",
            LayerNormForward {
                mean: (&short).into(),
                ..good()
            },
            2,
            4,
            1e-5,
            DType::F32,
        );
        check("no columns", good(), 2, 0, 1e-5, DType::F32);
        check("NaN eps", good(), 2, 4, f32::NAN, DType::F32);
        check("negative eps", good(), 2, 4, -1.0, DType::F32);
        check("f32 buffers read as f16", good(), 4, 4, 1e-5, DType::F16);
        check(
            "y is h",
            LayerNormForward {
                y: k.h.view(0, 32).unwrap(),
                residual: Some(Residual {
                    r: (&k.r).into(),
                    h: k.h.view(0, 32).unwrap(),
                }),
                ..good()
            },
            2,
            4,
            1e-5,
            DType::F32,
        );
        check(
            "mean inside y",
            LayerNormForward {
                mean: k.y.view(0, 8).unwrap(),
                ..good()
            },
            2,
            4,
            1e-5,
            DType::F32,
        );
        check(
            "misaligned y",
            LayerNormForward {
                y: wide.view(2, 32).unwrap(),
                ..good()
            },
            2,
            4,
            1e-5,
            DType::F32,
        );
        // An f16 y among f32 operands: a wrong type is refused before anything runs.
        let r = dev.launch(
            &s,
            &tidemem::ops::abi::LAYERNORM_FORWARD,
            &[
                Some(tidemem::device::Operand::new(&k.x, DType::F32)),
                None,
                Some(tidemem::device::Operand::new(&k.g, DType::F32)),
                Some(tidemem::device::Operand::new(&k.b, DType::F32)),
                None,
                Some(tidemem::device::Operand::new(&half, DType::F16)),
                Some(tidemem::device::Operand::new(&k.m, DType::F32)),
                Some(tidemem::device::Operand::new(&k.s, DType::F32)),
            ],
            bytemuck::bytes_of(&tidemem::ops::abi::LayerNormParams {
                rows: 2,
                cols: 4,
                eps: 1e-5,
                pad: 0,
            }),
        );
        let bufs: Vec<(&DeviceBuffer, &[u8])> = before.iter().map(|(v, b)| (*b, &v[..])).collect();
        refused("f16 y", r, &dev, &s, &bufs);
        // A residual without its sum.
        let r = dev.launch(
            &s,
            &tidemem::ops::abi::LAYERNORM_FORWARD,
            &[
                Some(tidemem::device::Operand::new(&k.x, DType::F32)),
                Some(tidemem::device::Operand::new(&k.r, DType::F32)),
                Some(tidemem::device::Operand::new(&k.g, DType::F32)),
                Some(tidemem::device::Operand::new(&k.b, DType::F32)),
                None,
                Some(tidemem::device::Operand::new(&k.y, DType::F32)),
                Some(tidemem::device::Operand::new(&k.m, DType::F32)),
                Some(tidemem::device::Operand::new(&k.s, DType::F32)),
            ],
            bytemuck::bytes_of(&tidemem::ops::abi::LayerNormParams {
                rows: 2,
                cols: 4,
                eps: 1e-5,
                pad: 0,
            }),
        );
        refused("r without h", r, &dev, &s, &bufs);
    }
}

#[test]
fn bad_backward_operands_are_refused_and_nothing_is_written() {
    for dev in common::devices("layernorm backward refusals") {
        let s = dev.new_stream().unwrap();
        let (n, c) = (3usize, 5usize);
        let f = |len: usize, b: u8| up(&dev, &s, &vec![b; len * 4]);
        let (dy, h, g) = (f(n * c, 0), f(n * c, 0), f(c, 0));
        let (m, r) = (f(n, 0), f(n, 0));
        let (dx, dg, db) = (f(n * c, 0x11), f(c, 0x22), f(c, 0x33));
        let need = layernorm_backward_scratch_bytes(n, c);
        let scratch = up(&dev, &s, &vec![0x44; need]);
        let small = up(&dev, &s, &vec![0x55; need - 4]);
        let half_g = up(&dev, &s, &vec![0x66; c * 2]);
        let outs = [&dx, &dg, &db, &scratch, &small, &half_g];
        let before: Vec<Vec<u8>> = outs.iter().map(|b| down(&dev, &s, b)).collect();
        let bufs: Vec<(&DeviceBuffer, &[u8])> = outs
            .iter()
            .zip(&before)
            .map(|(b, v)| (*b, &v[..]))
            .collect();
        let good = || LayerNormBackward {
            dy: (&dy).into(),
            h: (&h).into(),
            mean: (&m).into(),
            rstd: (&r).into(),
            gamma: (&g).into(),
            dx: (&dx).into(),
            accumulate: true,
            dgamma: (&dg).into(),
            dbeta: (&db).into(),
            param_grad_dtype: DType::F32,
            scratch: (&scratch).into(),
        };
        let run = |ops, n, c| layernorm_backward(&dev, &s, ops, n, c, DType::F32);
        refused(
            "scratch too small",
            run(
                LayerNormBackward {
                    scratch: (&small).into(),
                    ..good()
                },
                n,
                c,
            ),
            &dev,
            &s,
            &bufs,
        );
        refused("rows do not match", run(good(), n + 1, c), &dev, &s, &bufs);
        refused(
            "dgamma too short",
            run(
                LayerNormBackward {
                    dgamma: m.view(0, 12).unwrap(),
                    ..good()
                },
                n,
                c,
            ),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "dgamma f16 but dbeta f32",
            run(
                LayerNormBackward {
                    dgamma: (&half_g).into(),
                    param_grad_dtype: DType::F16,
                    ..good()
                },
                n,
                c,
            ),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "dx overlaps dgamma",
            run(
                LayerNormBackward {
                    dgamma: dx.view(0, 20).unwrap(),
                    ..good()
                },
                n,
                c,
            ),
            &dev,
            &s,
            &bufs,
        );
        refused("no columns", run(good(), n, 0), &dev, &s, &bufs);
        // The good launch on the same buffers works.
        run(good(), n, c).unwrap();
    }
}
