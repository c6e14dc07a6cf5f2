//! Calls of the stand-in cuBLAS from their arguments (`Raw`), and products on random operands
//! checked element by element against a reference (`Case`, `check_case`).
use std::ffi::c_void;
use std::ptr::null_mut;

use half::{bf16, f16};
use tidemem_cuda_emu::*;

use crate::common::{download, ok, upload, Ctx};

pub const CUDA_R_32F: i32 = 0;
pub const CUDA_R_64F: i32 = 1;
pub const CUDA_R_16F: i32 = 2;
pub const CUDA_R_16BF: i32 = 14;
pub const COMPUTE_16F: i32 = 64;
pub const COMPUTE_32F: i32 = 68;
pub const COMPUTE_32F_PEDANTIC: i32 = 69;
pub const COMPUTE_64F: i32 = 70;
pub const COMPUTE_32F_FAST_16F: i32 = 74;
pub const COMPUTE_32F_FAST_16BF: i32 = 75;
pub const COMPUTE_32F_FAST_TF32: i32 = 77;
pub const TF32_TENSOR_OP_MATH: i32 = 3;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ty {
    F32,
    F16,
    Bf16,
}

impl Ty {
    pub fn cuda(self) -> i32 {
        match self {
            Ty::F32 => CUDA_R_32F,
            Ty::F16 => CUDA_R_16F,
            Ty::Bf16 => CUDA_R_16BF,
        }
    }
    fn size(self) -> usize {
        match self {
            Ty::F32 => 4,
            _ => 2,
        }
    }
    /// The unit roundoff of the storage type.
    fn unit(self) -> f64 {
        match self {
            Ty::F32 => 2f64.powi(-24),
            Ty::F16 => 2f64.powi(-11),
            Ty::Bf16 => 2f64.powi(-8),
        }
    }
    fn quantize(self, x: f32) -> f32 {
        match self {
            Ty::F32 => x,
            Ty::F16 => f16::from_f32(x).to_f32(),
            Ty::Bf16 => bf16::from_f32(x).to_f32(),
        }
    }
    fn bytes(self, v: &[f32]) -> Vec<u8> {
        v.iter()
            .flat_map(|&x| match self {
                Ty::F32 => x.to_le_bytes().to_vec(),
                Ty::F16 => f16::from_f32(x).to_le_bytes().to_vec(),
                Ty::Bf16 => bf16::from_f32(x).to_le_bytes().to_vec(),
            })
            .collect()
    }
    fn values(self, b: &[u8]) -> Vec<f32> {
        b.chunks(self.size())
            .map(|c| match self {
                Ty::F32 => f32::from_le_bytes(c.try_into().unwrap()),
                Ty::F16 => f16::from_le_bytes(c.try_into().unwrap()).to_f32(),
                Ty::Bf16 => bf16::from_le_bytes(c.try_into().unwrap()).to_f32(),
            })
            .collect()
    }
}

/// `x` rounded to TF32 (11 significant bits, ties to even), computed in f64 for normal `x`.
fn tf32(x: f32) -> f32 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let e = ((x.to_bits() >> 23) & 0xff) as i32 - 127;
    let q = 2f64.powi(e - 10);
    ((x as f64 / q).round_ties_even() * q) as f32
}

/// How a compute type rounds the inputs of an fp32 product.
fn input_rounding(compute: i32) -> fn(f32) -> f32 {
    match compute {
        COMPUTE_32F_FAST_TF32 => tf32,
        COMPUTE_32F_FAST_16F => |x| f16::from_f32(x).to_f32(),
        COMPUTE_32F_FAST_16BF => |x| bf16::from_f32(x).to_f32(),
        _ => |x| x,
    }
}

/// A small deterministic generator of values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn fill(&mut self, n: usize, ty: Ty) -> Vec<f32> {
        (0..n).map(|_| ty.quantize(self.next())).collect()
    }
}

/// A cuBLAS handle on `stream`.
pub fn handle(stream: *mut c_void) -> *mut c_void {
    let mut h = null_mut();
    unsafe {
        assert_eq!(cublasCreate_v2(&mut h), 0);
        assert_eq!(cublasSetStream_v2(h, stream), 0);
    }
    h
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Api {
    GemmEx,
    StridedEx,
    Sgemm,
    SgemmStrided,
}

/// One call's arguments as cuBLAS takes them.
#[derive(Clone, Copy, Debug)]
pub struct Raw {
    pub api: Api,
    pub trans: [i32; 2],
    pub mnk: [i32; 3],
    pub ld: [i32; 3],
    pub stride: [i64; 3],
    pub batch: i32,
    pub types: [i32; 3],
    pub compute: i32,
    /// `None`: a null `alpha`.
    pub alpha: Option<f32>,
    pub beta: f32,
}

impl Raw {
    /// `C = A B` in fp32, not transposed, leading dimensions the rows, one matrix.
    pub fn new(api: Api, [m, n, k]: [i32; 3]) -> Self {
        Raw {
            api,
            trans: [0, 0],
            mnk: [m, n, k],
            ld: [m, k, m],
            stride: [0; 3],
            batch: 1,
            types: [CUDA_R_32F; 3],
            compute: COMPUTE_32F,
            alpha: Some(1.0),
            beta: 0.0,
        }
    }
    pub fn scale(self, alpha: f32, beta: f32) -> Self {
        let alpha = Some(alpha);
        Raw {
            alpha,
            beta,
            ..self
        }
    }
    pub fn mnk(self, mnk: [i32; 3]) -> Self {
        Raw { mnk, ..self }
    }
    pub fn ld(self, ld: [i32; 3]) -> Self {
        Raw { ld, ..self }
    }
    pub fn trans(self, trans: [i32; 2]) -> Self {
        Raw { trans, ..self }
    }
    pub fn types(self, types: [i32; 3], compute: i32) -> Self {
        Raw {
            types,
            compute,
            ..self
        }
    }
    pub fn batch(self, batch: i32, stride: [i64; 3]) -> Self {
        Raw {
            batch,
            stride,
            ..self
        }
    }
}

/// Calls `r.api` on the device operands `d` (A, B, C).
pub unsafe fn call(h: *mut c_void, r: &Raw, d: [u64; 3]) -> i32 {
    let [m, n, k] = r.mnk;
    let [ta, tb] = r.trans;
    let [lda, ldb, ldc] = r.ld;
    let [sa, sb, sc] = r.stride;
    let [at, bt, ct] = r.types;
    let al = r
        .alpha
        .as_ref()
        .map_or(std::ptr::null(), |a| a as *const f32);
    let be = &r.beta as *const f32;
    let (a, b, c) = (d[0] as *mut f32, d[1] as *mut f32, d[2] as *mut f32);
    let (vl, vb) = (al as *const c_void, be as *const c_void);
    let (va, vb_, vc) = (a as *const c_void, b as *const c_void, c as *mut c_void);
    match r.api {
        Api::GemmEx => cublasGemmEx(
            h, ta, tb, m, n, k, vl, va, at, lda, vb_, bt, ldb, vb, vc, ct, ldc, r.compute, -1,
        ),
        Api::StridedEx => cublasGemmStridedBatchedEx(
            h, ta, tb, m, n, k, vl, va, at, lda, sa, vb_, bt, ldb, sb, vb, vc, ct, ldc, sc,
            r.batch, r.compute, -1,
        ),
        Api::Sgemm => cublasSgemm_v2(h, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc),
        Api::SgemmStrided => cublasSgemmStridedBatched(
            h, ta, tb, m, n, k, al, a, lda, sa, b, ldb, sb, be, c, ldc, sc, r.batch,
        ),
    }
}

/// A product on random operands.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub api: Api,
    pub ty: Ty,
    pub trans: [i32; 2],
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Leading dimension minus the stored rows, per operand.
    pub pad: [usize; 3],
    pub batch: usize,
    /// B's stride is 0: one B for every batch.
    pub shared_b: bool,
    pub alpha: f32,
    pub beta: f32,
    pub compute: i32,
    /// C starts as NaN.
    pub nan_c: bool,
}

impl Case {
    pub fn new(api: Api, ty: Ty) -> Self {
        Case {
            api,
            ty,
            trans: [0, 0],
            m: 13,
            n: 11,
            k: 17,
            pad: [3, 2, 5],
            batch: 1,
            shared_b: false,
            alpha: 1.5,
            beta: -0.75,
            compute: COMPUTE_32F,
            nan_c: false,
        }
    }

    /// Stored rows and columns of operand `i` (A, B, C).
    fn stored(&self, i: usize) -> (usize, usize) {
        let t = |i: usize| self.trans[i] != 0;
        match i {
            0 if t(0) => (self.k, self.m),
            0 => (self.m, self.k),
            1 if t(1) => (self.n, self.k),
            1 => (self.k, self.n),
            _ => (self.m, self.n),
        }
    }
    fn ld(&self, i: usize) -> usize {
        self.stored(i).0 + self.pad[i]
    }
    fn stride(&self, i: usize) -> usize {
        if i == 1 && self.shared_b {
            return 0;
        }
        let (rows, cols) = self.stored(i);
        (cols - 1) * self.ld(i) + rows + 7
    }
    /// The elements operand `i` spans, all its batches.
    pub fn len(&self, i: usize) -> usize {
        let (rows, cols) = self.stored(i);
        (self.batch - 1) * self.stride(i) + (cols - 1) * self.ld(i) + rows
    }
    /// Index of element (r, c) of operand `i`'s op-matrix in batch `b`.
    pub fn at(&self, i: usize, b: usize, r: usize, c: usize) -> usize {
        let t = i < 2 && self.trans[i] != 0;
        let (r, c) = if t { (c, r) } else { (r, c) };
        b * self.stride(i) + r + c * self.ld(i)
    }
    pub fn raw(&self) -> Raw {
        let [m, n, k] = [self.m, self.n, self.k].map(|v| v as i32);
        let t = self.ty.cuda();
        Raw::new(self.api, [m, n, k])
            .trans(self.trans)
            .ld([0, 1, 2].map(|i| self.ld(i) as i32))
            .batch(self.batch as i32, [0, 1, 2].map(|i| self.stride(i) as i64))
            .types([t; 3], self.compute)
            .scale(self.alpha, self.beta)
    }
}

/// Runs `c` on random operands and checks every element of C against the reference (see the
/// tolerance at the top of `main.rs`), and that nothing between its matrices or beyond its
/// rows changed. Returns C.
pub fn check_case(ctx: &Ctx, h: *mut c_void, c: &Case, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    let a = rng.fill(c.len(0), c.ty);
    let b = rng.fill(c.len(1), c.ty);
    let c0 = if c.nan_c {
        vec![f32::NAN; c.len(2)]
    } else {
        rng.fill(c.len(2), c.ty)
    };
    let s = ctx.stream;
    let d = [&a, &b, &c0].map(|v| upload(&c.ty.bytes(v), s));
    assert_eq!(unsafe { call(h, &c.raw(), d) }, 0, "{c:?}");
    let got =
        c.ty.values(&download::<u8>(d[2], c.len(2) * c.ty.size(), s));
    let round = input_rounding(c.compute);
    let mut inside = vec![false; c.len(2)];
    for bt in 0..c.batch {
        for j in 0..c.n {
            for i in 0..c.m {
                let (mut s64, mut mag) = (0f64, 0f64);
                for p in 0..c.k {
                    let x = round(a[c.at(0, bt, i, p)]);
                    let y = round(b[c.at(1, bt, p, j)]);
                    s64 += x as f64 * y as f64;
                    mag += (x as f64 * y as f64).abs();
                }
                let idx = c.at(2, bt, i, j);
                inside[idx] = true;
                let old = c0[idx];
                // The emulator computes as tidemem's simulated device does (the `gemm` crate's
                // blocked f32 products, bit for bit: tidemem's `tests/gemm.rs` checks that);
                // here, each element within f32 accumulation's bound of the exact value.
                let (exact, bound) = if c.beta == 0.0 {
                    (c.alpha as f64 * s64, 0.0)
                } else {
                    let bc = c.beta as f64 * old as f64;
                    (c.alpha as f64 * s64 + bc, bc.abs())
                };
                let g = got[idx];
                let accumulated = c.alpha.abs() as f64 * mag + bound;
                let tol = (c.k as f64 + 3.0) * 2f64.powi(-24) * accumulated
                    + c.ty.unit() * exact.abs()
                    + 2f64.powi(-25);
                assert!(
                    (g as f64 - exact).abs() <= tol,
                    "{c:?}: C[{bt}]({i},{j}) = {g}, exact {exact}, tolerance {tol}"
                );
            }
        }
    }
    for (idx, (&g, &o)) in got.iter().zip(&c0).enumerate() {
        if !inside[idx] {
            assert_eq!(g.to_bits(), o.to_bits(), "{c:?}: element {idx} outside C");
        }
    }
    for p in d {
        ok(cuMemFreeAsync(p, s));
    }
    got
}
