//! The GEMM against an f64 reference: the CPU twin on host slices and through the simulated
//! device, and CUDA (cuBLAS) when present; bad shapes are typed errors that write nothing.
//!
//! Tolerance, per element of `C` (from the reference's magnitudes, so it holds for any data):
//! with `S = |alpha|·Σ_p |a_ip|·|b_pj| + |beta|·|c_ij|` and `u = 2⁻²⁴`,
//! * the f32 result: `|got − ref| ≤ (k + 4)·u·S` — a dot product of `k` terms summed in any
//!   order, with or without fused multiply-adds, errs by at most `γ_k·Σ|a||b|` (`γ_k ≈ k·u`),
//!   and scaling by `alpha`, `beta` and the final add add three more roundings. Inputs of f16
//!   or bf16 are exact in f32, and their products are too.
//! * f16 / bf16 storage of `C`: that, plus the one final rounding, half an ulp: `2⁻¹¹·|ref|`
//!   (f16) or `2⁻⁸·|ref|` (bf16), plus `2⁻²⁵` for f16's subnormals.
//! * TF32: each input is first rounded to 11 significant bits (relative error ≤ 2⁻¹¹), so a
//!   product errs by ≤ 2⁻¹⁰ relative: add `2⁻¹⁰·|alpha|·Σ|a||b|`.
//! * CUDA: twice the f32 term (tensor cores may accumulate with truncation rather than
//!   rounding).
//!
//! Elements of `C` outside its `m × n` matrices (the gaps of a larger leading dimension or
//! between batches) must be left as they were, bit for bit.

mod common;
mod ops_util;

use half::{bf16, f16};
use ops_util::{dec, encf, round_f32, stored, Rng, SplitMix64, U};
use tidemem::device::{Device, Operand};
use tidemem::ops::{self, Gemm};
use tidemem::ops::{abi::GemmParams, abi::GEMM, GemmElem};
use tidemem::{DType, Error};

/// One test case: the description and the operands' elements as f32 (before encoding).
struct Case {
    g: Gemm,
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

fn extent(rows: u64, cols: u64, ld: u64, stride: u64, batch: u64) -> usize {
    if rows == 0 || cols == 0 || batch == 0 {
        return 0;
    }
    ((batch - 1) * stride + (rows - 1) * ld + cols) as usize
}

/// `[rows, cols, ld, stride]` of A, B and C as stored.
fn layouts(p: &GemmParams) -> [[u64; 4]; 3] {
    let ta = p.flags & GemmParams::TRANS_A != 0;
    let tb = p.flags & GemmParams::TRANS_B != 0;
    let (ar, ac) = if ta { (p.k, p.m) } else { (p.m, p.k) };
    let (br, bc) = if tb { (p.n, p.k) } else { (p.k, p.n) };
    [
        [ar, ac, p.lda, p.stride_a],
        [br, bc, p.ldb, p.stride_b],
        [p.m, p.n, p.ldc, p.stride_c],
    ]
}

impl Case {
    /// Random operands for `g`, in [-1, 1]; `C` holds NaN everywhere when `beta == 0` (it must
    /// not be read), and one element more than it needs (never touched).
    fn new(g: Gemm, r: &mut SplitMix64) -> Case {
        let p = g.params();
        let l = layouts(&p);
        let mut fill = |[rows, cols, ld, stride]: [u64; 4], nan: bool| -> Vec<f32> {
            let n = extent(rows, cols, ld, stride, p.batch) + 1;
            (0..n)
                .map(|_| {
                    if nan {
                        f32::NAN
                    } else {
                        r.uniform_f32(-1.0, 1.0)
                    }
                })
                .collect()
        };
        Case {
            g,
            a: fill(l[0], false),
            b: fill(l[1], false),
            c: fill(l[2], p.beta == 0.0),
        }
    }

    /// For each element of `C`: `Some((reference, S))` where it is written, `None` where it
    /// must stay. Inputs are taken as stored in `dtype` (rounded from the f32 values).
    fn reference(&self, dtype: DType) -> Vec<Option<(f64, f64)>> {
        let (a, b, c) = (
            stored(&self.a, dtype),
            stored(&self.b, dtype),
            stored(&self.c, dtype),
        );
        let p = self.g.params();
        let ta = p.flags & GemmParams::TRANS_A != 0;
        let tb = p.flags & GemmParams::TRANS_B != 0;
        let mut out = vec![None; c.len()];
        let (alpha, beta) = (p.alpha as f64, p.beta as f64);
        for bi in 0..p.batch {
            for i in 0..p.m {
                for j in 0..p.n {
                    let (mut dot, mut mag) = (0.0, 0.0);
                    if alpha != 0.0 {
                        for k in 0..p.k {
                            let ai =
                                bi * p.stride_a + if ta { k * p.lda + i } else { i * p.lda + k };
                            let bj =
                                bi * p.stride_b + if tb { j * p.ldb + k } else { k * p.ldb + j };
                            let prod = a[ai as usize] * b[bj as usize];
                            dot += prod;
                            mag += prod.abs();
                        }
                    }
                    let ci = (bi * p.stride_c + i * p.ldc + j) as usize;
                    let old = if beta == 0.0 { 0.0 } else { beta * c[ci] };
                    out[ci] = Some((alpha * dot + old, alpha.abs() * mag + old.abs()));
                }
            }
        }
        out
    }

    /// Asserts `got` (C after the GEMM, as f64) against the reference within the tolerance of
    /// the module docs (`f32_factor` times the f32 term).
    fn verify(&self, dtype: DType, got: &[f64], f32_factor: f64, what: &str) {
        let p = self.g.params();
        let before = round_f32(&self.c, dtype);
        let tf32 = if p.flags & GemmParams::TF32 != 0 {
            2f64.powi(-10)
        } else {
            0.0
        };
        let (out_rel, out_abs) = match dtype {
            DType::F16 => (2f64.powi(-11), 2f64.powi(-25)),
            DType::BF16 => (2f64.powi(-8), 1e-38),
            _ => (0.0, 0.0),
        };
        assert_eq!(got.len(), self.c.len(), "{what}");
        for (i, (r, &x)) in self.reference(dtype).iter().zip(got).enumerate() {
            match r {
                None => assert!(
                    x.to_bits() == (before[i] as f64).to_bits(),
                    "{what}: element {i} outside C changed: {} -> {x}",
                    before[i]
                ),
                Some((want, s)) => {
                    let tol = f32_factor * (p.k as f64 + 4.0) * U * s
                        + tf32 * s
                        + out_rel * want.abs() * (1.0 + 1e-6)
                        + out_abs;
                    assert!(
                        (x - want).abs() <= tol,
                        "{what}: element {i}: got {x}, want {want} (tolerance {tol:e})"
                    );
                }
            }
        }
    }
}

/// The shapes every test runs: sizes 1, odd, prime and past any tile, a product large enough
/// to take the threaded path, every transpose pair, padded leading dimensions, batches with
/// packed, padded and broadcast (0) strides, and several (alpha, beta), beta = 0 included.
fn shapes() -> Vec<Gemm> {
    let mut v = vec![];
    let sizes = [
        (1, 1, 1),
        (1, 7, 3),
        (5, 1, 9),
        (3, 4, 1),
        (17, 33, 65),
        (31, 47, 129),
        (64, 64, 64),
        (2, 100, 257),
        (70, 90, 110),
    ];
    let scalars = [(1.0, 0.0), (-0.5, 1.0), (2.0, 0.25), (0.0, -1.5)];
    let mut i = 0;
    for &(m, n, k) in &sizes {
        for ta in [false, true] {
            for tb in [false, true] {
                let (alpha, beta) = scalars[i % scalars.len()];
                let mut g = Gemm::new(m, n, k)
                    .trans_a(ta)
                    .trans_b(tb)
                    .alpha(alpha)
                    .beta(beta);
                if i % 3 == 1 {
                    // leading dimensions past the row length
                    let [lda, ldb, ldc] = [
                        (if ta { m } else { k }) + 3,
                        (if tb { k } else { n }) + 1,
                        n + 2,
                    ];
                    g = g.ld(lda, ldb, ldc);
                }
                v.push(g);
                i += 1;
            }
        }
    }
    // Batches: packed, padded, and a weight shared by every batch (stride 0).
    let (m, n, k) = (9, 13, 21);
    v.push(Gemm::new(m, n, k).batched(4, m * k, k * n, m * n).beta(0.5));
    v.push(
        Gemm::new(m, n, k)
            .trans_b(true)
            .batched(3, m * k + 5, 0, m * n + 7)
            .alpha(1.5),
    );
    v.push(
        Gemm::new(m, n, k)
            .trans_a(true)
            .ld(m + 1, n, n + 3)
            .batched(2, 0, k * n + 1, m * (n + 3))
            .beta(-1.0),
    );
    // Batches side by side in the rows of C (as attention heads are): stride n, ldc = 3n.
    v.push(
        Gemm::new(m, n, k)
            .ld(k, n, 3 * n)
            .batched(3, m * k, k * n, n),
    );
    // Empty: every case of m, n, k or batch = 0 (k = 0: C = beta·C).
    v.push(Gemm::new(0, 5, 3));
    v.push(Gemm::new(4, 0, 3));
    v.push(Gemm::new(4, 5, 0).beta(0.5));
    v.push(Gemm::new(4, 5, 0));
    v.push(Gemm::new(4, 5, 6).batched(0, 30, 30, 20));
    v
}

fn host_run<T: GemmElem>(case: &Case, enc: fn(f32) -> T, dec: fn(T) -> f32) -> Vec<f64> {
    let a: Vec<T> = case.a.iter().map(|&x| enc(x)).collect();
    let b: Vec<T> = case.b.iter().map(|&x| enc(x)).collect();
    let mut c: Vec<T> = case.c.iter().map(|&x| enc(x)).collect();
    ops::gemm_host(&case.g, &a, &b, &mut c).unwrap();
    c.into_iter().map(|x| dec(x) as f64).collect()
}

#[test]
fn the_twin_matches_an_f64_reference() {
    let mut r = SplitMix64::new(1);
    let mut n = 0;
    for g in shapes() {
        let case = Case::new(g, &mut r);
        let what = |d| format!("{d} {g:?}");
        let got = host_run::<f32>(&case, |x| x, |x| x);
        case.verify(DType::F32, &got, 1.0, &what("f32"));
        let got = host_run::<f16>(&case, f16::from_f32, f16::to_f32);
        case.verify(DType::F16, &got, 1.0, &what("f16"));
        let got = host_run::<bf16>(&case, bf16::from_f32, bf16::to_f32);
        case.verify(DType::BF16, &got, 1.0, &what("bf16"));
        n += 1;
    }
    eprintln!("{n} shapes × 3 types agree with the reference");
}

#[test]
fn tf32_is_used_only_when_asked_and_rounds_the_inputs() {
    // 1 + 2⁻²⁰ is not a TF32 value: it rounds to 1, so the product changes only under TF32.
    let x = 1.0 + 2f32.powi(-20);
    let (a, b) = ([x], [1.0f32]);
    let mut c = [0.0f32];
    ops::gemm_host(&Gemm::new(1, 1, 1), &a, &b, &mut c).unwrap();
    assert_eq!(c[0], x);
    ops::gemm_host(&Gemm::new(1, 1, 1).tf32(true), &a, &b, &mut c).unwrap();
    assert_eq!(c[0], 1.0);
    // And within the TF32 tolerance on the shapes.
    let mut r = SplitMix64::new(2);
    for g in shapes().into_iter().step_by(3) {
        let case = Case::new(g.tf32(true), &mut r);
        let got = host_run::<f32>(&case, |x| x, |x| x);
        case.verify(DType::F32, &got, 1.0, &format!("tf32 {g:?}"));
    }
}

/// Runs `case` on `dev` as `dtype` through [`ops::gemm`]; returns C.
fn device_run(dev: &Device, case: &Case, dtype: DType) -> tidemem::Result<Vec<f64>> {
    let s = dev.new_stream()?;
    let up = |v: &[f32]| dev.upload(&s, &encf(v, dtype));
    let (a, b, c) = (up(&case.a)?, up(&case.b)?, up(&case.c)?);
    ops::gemm(dev, &s, &case.g, &a, &b, &c, dtype)?;
    let out = dev.download(&s, &c)?;
    dev.sync_stream(&s)?;
    Ok(dec(&out, dtype))
}

#[test]
fn the_simulated_device_runs_the_twin() {
    let dev = common::sim(64 << 20);
    let mut r = SplitMix64::new(3);
    for g in shapes().into_iter().step_by(2) {
        let case = Case::new(g, &mut r);
        for d in DType::FLOATS {
            let got = device_run(&dev, &case, d).unwrap();
            case.verify(d, &got, 1.0, &format!("sim {d} {g:?}"));
        }
    }
}

#[test]
fn cuda_runs_cublas_or_says_it_is_missing() {
    let Some(dev) = common::cuda("gemm") else {
        return;
    };
    let mut r = SplitMix64::new(4);
    let case = Case::new(Gemm::new(3, 4, 5).beta(1.0), &mut r);
    if !ops::cublas_available() {
        // A typed error, and C untouched.
        let s = dev.new_stream().unwrap();
        let enc = |v: &[f32]| encf(v, DType::F32);
        let a = dev.upload(&s, &enc(&case.a)).unwrap();
        let b = dev.upload(&s, &enc(&case.b)).unwrap();
        let c = dev.upload(&s, &enc(&case.c)).unwrap();
        let err = ops::gemm(&dev, &s, &case.g, &a, &b, &c, DType::F32).unwrap_err();
        assert!(
            matches!(&err, Error::BackendUnavailable { reason, .. } if reason.contains("cuBLAS")),
            "{err}"
        );
        assert_eq!(dev.download(&s, &c).unwrap(), enc(&case.c));
        eprintln!("gemm: CUDA without cuBLAS answers: {err}");
        common::cuda_half_missing("gemm", "cuBLAS cannot be loaded");
        return;
    }
    let mut n = 0;
    for g in shapes() {
        for g in [g, g.tf32(true)] {
            let case = Case::new(g, &mut r);
            for d in DType::FLOATS {
                if g.params().flags & GemmParams::TF32 != 0 && d != DType::F32 {
                    continue;
                }
                let got = device_run(&dev, &case, d).unwrap();
                case.verify(d, &got, 2.0, &format!("cuda {d} {g:?}"));
                n += 1;
            }
        }
    }
    eprintln!("gemm: {n} cuBLAS cases agree with the reference");
}

/// Runs a launch expected to fail on the simulated device (and on CUDA when present), then
/// checks that `C` still holds its bytes.
fn refused(g: &Gemm, lens: [usize; 3], dtype: DType, check: impl Fn(&Error) -> bool, what: &str) {
    for dev in common::devices("gemm bad input") {
        let s = dev.new_stream().unwrap();
        let pattern = |n: usize, seed| common::pattern(n * dtype.size(), seed);
        let a = dev.upload(&s, &pattern(lens[0], 1)).unwrap();
        let b = dev.upload(&s, &pattern(lens[1], 2)).unwrap();
        let c0 = pattern(lens[2], 3);
        let c = dev.upload(&s, &c0).unwrap();
        let err = ops::gemm(&dev, &s, g, &a, &b, &c, dtype).unwrap_err();
        assert!(check(&err), "{what}: {err}");
        assert_eq!(dev.download(&s, &c).unwrap(), c0, "{what}: C was written");
        dev.sync_stream(&s).unwrap();
    }
}

fn invalid(needles: &'static [&'static str]) -> impl Fn(&Error) -> bool {
    move |e| matches!(e, Error::Operands { op: "gemm", reason } if needles.iter().all(|n| reason.contains(n)))
}

#[test]
fn bad_shapes_are_typed_errors_and_write_nothing() {
    let g = Gemm::new(4, 5, 6);
    // Views too small: each operand named with its shape, what it needs and what it holds.
    refused(
        &g,
        [23, 30, 20],
        DType::F32,
        invalid(&["`a`", "[4, 6]", "needs 24", "holds 23"]),
        "a",
    );
    refused(
        &g,
        [24, 29, 20],
        DType::F32,
        invalid(&["`b`", "[6, 5]", "needs 30", "holds 29"]),
        "b",
    );
    refused(
        &g,
        [24, 30, 19],
        DType::F16,
        invalid(&["`c`", "[4, 5]", "needs 20", "holds 19"]),
        "c",
    );
    let t = g.trans_a(true).trans_b(true);
    refused(
        &t,
        [23, 30, 20],
        DType::BF16,
        invalid(&["`a`", "[6, 4]"]),
        "aᵀ",
    );
    // Leading dimension below the row length, for each operand.
    refused(
        &g.ld(5, 5, 5),
        [100; 3],
        DType::F32,
        invalid(&["`a`", "ld 5", "leading"]),
        "lda",
    );
    refused(
        &g.ld(6, 4, 5),
        [100; 3],
        DType::F32,
        invalid(&["`b`", "ld 4"]),
        "ldb",
    );
    refused(
        &g.ld(6, 5, 4),
        [100; 3],
        DType::F32,
        invalid(&["`c`", "ld 4"]),
        "ldc",
    );
    // Strided batches: the last batch must fit too; C's batches may not overlap.
    let bg = g.batched(3, 24, 0, 20);
    refused(
        &bg,
        [72, 30, 59],
        DType::F32,
        invalid(&["`c`", "stride 20", "needs 60"]),
        "batch",
    );
    refused(
        &bg,
        [71, 30, 60],
        DType::F32,
        invalid(&["`a`", "needs 72"]),
        "batch a",
    );
    let overlap = g.batched(2, 24, 30, 10);
    refused(
        &overlap,
        [48, 60, 40],
        DType::F32,
        invalid(&["overlap"]),
        "C batches",
    );
    let shared_c = g.batched(2, 24, 30, 0);
    refused(
        &shared_c,
        [48, 60, 40],
        DType::F32,
        invalid(&["overlap"]),
        "C stride 0",
    );
    // Sizes past cuBLAS's int.
    let huge = Gemm::new(1 << 31, 1, 1);
    refused(&huge, [4; 3], DType::F32, invalid(&["m = 2147483648"]), "m");
    // TF32 is for f32 only; element types the GEMM does not take.
    refused(
        &g.tf32(true),
        [24, 30, 20],
        DType::F16,
        invalid(&["TF32"]),
        "tf32",
    );
    refused(
        &g,
        [24, 30, 20],
        DType::U32,
        |e| matches!(e, Error::Launch { kernel: "gemm", .. }),
        "u32",
    );
}

#[test]
fn mixed_types_and_overlaps_are_refused() {
    let dev = common::sim(1 << 20);
    let s = dev.new_stream().unwrap();
    let g = Gemm::new(2, 2, 2).params();
    let buf = dev.upload(&s, &[0u8; 64]).unwrap();
    let other = dev.upload(&s, &[7u8; 16]).unwrap();
    let v = |o, l| buf.view(o, l).unwrap();
    let p = bytemuck::bytes_of(&g);
    // A and B of different types.
    let ops = [
        Some(Operand::input(v(0, 16), DType::F32)),
        Some(Operand::input(v(16, 8), DType::F16)),
        Some(Operand::new(&other, DType::F32)),
    ];
    let err = dev.launch(&s, &GEMM, &ops, p).unwrap_err();
    assert!(
        matches!(&err, Error::Operands { reason, .. } if reason.contains("one element type")),
        "{err}"
    );
    // C overlapping A, or B; A and B may share memory.
    for (a, b, c) in [(0, 32, 8), (0, 32, 40)] {
        let err = ops::gemm(
            &dev,
            &s,
            &Gemm::new(2, 2, 2),
            v(a, 16),
            v(b, 16),
            v(c, 16),
            DType::F32,
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::Operands { reason, .. } if reason.contains("overlaps")),
            "{err}"
        );
    }
    ops::gemm(
        &dev,
        &s,
        &Gemm::new(2, 2, 2),
        v(0, 16),
        v(0, 16),
        &other,
        DType::F32,
    )
    .unwrap();
    assert_eq!(dev.download(&s, &buf).unwrap(), vec![0u8; 64]);
    assert_eq!(dev.download(&s, &other).unwrap(), vec![0u8; 16]);
}

#[test]
fn the_host_entry_checks_like_the_device() {
    let a = [1.0f32; 5];
    let b = [1.0f32; 6];
    let mut c = [9.0f32; 4];
    let err = ops::gemm_host(&Gemm::new(2, 2, 3), &a, &b, &mut c).unwrap_err();
    assert!(
        matches!(&err, Error::Operands { reason, .. } if reason.contains("`a`") && reason.contains("needs 6")),
        "{err}"
    );
    assert_eq!(c, [9.0; 4]);
    let err = ops::gemm_host(
        &Gemm::new(2, 2, 3).tf32(true),
        &[f16::ONE; 6],
        &[f16::ONE; 6],
        &mut [f16::ZERO; 4],
    )
    .unwrap_err();
    assert!(matches!(err, Error::Operands { op: "gemm", .. }), "{err}");
}

/// The emulator stands in for cuBLAS with the twin's arithmetic: on it, every shape's `C` is
/// the twin's, bit for bit (a GPU's cuBLAS rounds its own way and is checked against the
/// reference above instead).
#[test]
fn the_emulator_computes_the_twins_bits() {
    let Some(dev) = common::cuda("the_emulator_computes_the_twins_bits") else {
        return;
    };
    if !common::is_emulated(&dev) {
        return;
    }
    let mut r = SplitMix64::new(5);
    let mut shapes = shapes();
    // the toy models' products: weight gradients over a batch, and wide blocks
    for (m, n, k) in [
        (32, 32, 8),
        (32, 32, 2),
        (8, 32, 32),
        (2, 32, 32),
        (64, 48, 40),
    ] {
        shapes.push(Gemm::new(m, n, k));
        shapes.push(Gemm::new(m, n, k).trans_a(true).beta(1.0));
        shapes.push(Gemm::new(m, n, k).trans_b(true));
    }
    let mut differ = Vec::new();
    for g in shapes {
        let case = Case::new(g, &mut r);
        let bits = |v: &[f64]| v.iter().map(|&x| (x as f32).to_bits()).collect::<Vec<_>>();
        let twins = [
            host_run::<f32>(&case, |x| x, |x| x),
            host_run::<f16>(&case, f16::from_f32, f16::to_f32),
            host_run::<bf16>(&case, bf16::from_f32, bf16::to_f32),
        ];
        for (d, twin) in [DType::F32, DType::F16, DType::BF16].into_iter().zip(twins) {
            let got = device_run(&dev, &case, d).unwrap();
            if bits(&twin) != bits(&got) {
                differ.push((d, g));
            }
        }
    }
    assert!(
        differ.is_empty(),
        "the emulator's bits differ from the twin's for {differ:?}"
    );
}
