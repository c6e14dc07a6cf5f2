//! The CPU GEMM: the twin the simulated device runs (and [`gemm_host`](super::gemm_host)).
//!
//! [`sgemm`] is the crate's one call into the `gemm` crate: f32, BLAS-order scalars
//! (`C = alpha·A·B + beta·C`; the crate's own `dst := alpha·dst + beta·lhs·rhs` has them the
//! other way round), each matrix given by row and column strides (a transpose is a swap of
//! the two), `beta == 0` leaving `C` unread. It runs on the available threads above a size
//! threshold, serially below it, with AVX-512 where the CPU has it (the `x86-v4` feature,
//! chosen at run time).
//!
//! f16 and bf16 operands are widened to f32 scratch first (exact), `C` is computed in f32 and
//! rounded once to its type, element by element of the `m × n` matrices only (elements between
//! rows or batches are left alone). The `gemm` crate's own f16 path is not used: it rounds the
//! destination to f16 after every block of `k`, which is not f32 accumulation. With TF32 asked
//! for, f32 inputs are rounded to TF32 (10 explicit mantissa bits, to nearest, ties away from
//! zero, as CUDA's `cvt.rna.tf32.f32`) before an f32 product, as a tensor core multiplies them.

use std::borrow::Cow;
use std::sync::OnceLock;

use gemm::Parallelism;
use half::{bf16, f16, slice::HalfFloatSliceExt};

use super::{check_shapes, GemmParams, Layout};
use crate::device::TwinArgs;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Below this many multiply-adds a product runs on the calling thread (64³: the threads'
/// start-up would cost more than they save).
const SERIAL_BELOW: u128 = 1 << 18;

/// A matrix that a product reads: element `(i, j)` at `data[i·rs + j·cs]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub(crate) cs: usize,
}

/// The matrix a product writes, laid out as [`MatRef`].
#[derive(Debug)]
pub(crate) struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub(crate) cs: usize,
}

/// One past the largest index of a `rows × cols` matrix with strides `rs`, `cs` (0 when
/// empty), if it lies within `len` and every stride fits an `isize`.
fn fits(rows: usize, cols: usize, rs: usize, cs: usize, len: usize) -> bool {
    if rows == 0 || cols == 0 {
        return true;
    }
    let last = (rows - 1)
        .checked_mul(rs)
        .and_then(|r| (cols - 1).checked_mul(cs).and_then(|c| r.checked_add(c)));
    last.is_some_and(|l| l < len) && rs <= isize::MAX as usize && cs <= isize::MAX as usize
}

/// The threads for an `m × n × k` product: every available one (or `TIDEMEM_SIM_THREADS`, read
/// once, where set: the simulated device's share of the cores), or none below
/// [`SERIAL_BELOW`].
fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    static THREADS: OnceLock<usize> = OnceLock::new();
    let threads = *THREADS.get_or_init(|| {
        // (a bad value is refused when a simulated device is made)
        crate::device::sim_threads()
            .ok()
            .flatten()
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    });
    if threads <= 1 || (m as u128) * (n as u128) * (k as u128) < SERIAL_BELOW {
        Parallelism::None
    } else {
        Parallelism::Rayon(threads)
    }
}

/// `C = alpha·A·B + beta·C` in f32 (BLAS order): `A` is `m × k`, `B` `k × n`, `C` `m × n`.
/// `beta == 0`: `C` is not read. `alpha == 0` or `k == 0`: `A` and `B` are not read and
/// `C = beta·C`. Shapes that disagree or matrices outside their slices are an error, and
/// nothing is written.
pub(crate) fn sgemm(
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    c: MatMut<'_>,
) -> Result<()> {
    let (m, n, k) = (c.rows, c.cols, a.cols);
    if a.rows != m || b.rows != k || b.cols != n {
        return Err(Error::Internal {
            what: format!(
                "sgemm: A is {}×{}, B {}×{}, C {}×{}",
                a.rows, a.cols, b.rows, b.cols, c.rows, c.cols
            ),
        });
    }
    let reads = k > 0 && alpha != 0.0;
    let inputs_fit =
        !reads || (fits(m, k, a.rs, a.cs, a.data.len()) && fits(k, n, b.rs, b.cs, b.data.len()));
    if !inputs_fit || !fits(m, n, c.rs, c.cs, c.data.len()) {
        return Err(Error::Internal {
            what: "sgemm: a matrix lies outside its slice".into(),
        });
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if !reads {
        for i in 0..m {
            for j in 0..n {
                let x = &mut c.data[i * c.rs + j * c.cs];
                *x = if beta == 0.0 { 0.0 } else { beta * *x };
            }
        }
        return Ok(());
    }
    // SAFETY: every element the call reads or writes lies in its slice (`fits` above: the
    // last index of each matrix is within it, so every other index is too, and every stride
    // fits an `isize`); `c` is borrowed mutably, so it aliases neither input. With
    // `read_dst == false` the call writes `C` without reading it.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.data.as_mut_ptr(),
            c.cs as isize,
            c.rs as isize,
            beta != 0.0,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            // the crate's `dst := alpha·dst + beta·lhs·rhs`
            beta,
            alpha,
            false,
            false,
            false,
            parallelism(m, n, k),
        );
    }
    Ok(())
}

/// Rounds an f32 to TF32: 10 explicit mantissa bits, to nearest with ties away from zero (as
/// `cvt.rna.tf32.f32`); NaN and infinities are kept, and a value that rounds past the largest
/// finite one becomes infinite.
pub(crate) fn to_tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    f32::from_bits((x.to_bits() + 0x1000) & !0x1fff)
}

/// Element types of the twin, widened to f32 and rounded back to nearest even.
trait Elem: bytemuck::Pod {
    /// The elements as f32 (TF32-rounded when asked).
    fn widen(src: &[Self], tf32: bool) -> Cow<'_, [f32]>;
    /// Rounds `src` into `dst` (same length).
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// `Some` when the type is f32 itself (`C` is then computed in place).
    fn as_f32(c: &mut [Self]) -> Option<&mut [f32]>;
}

impl Elem for f32 {
    fn widen(src: &[f32], tf32: bool) -> Cow<'_, [f32]> {
        if tf32 {
            Cow::Owned(src.iter().map(|&x| to_tf32(x)).collect())
        } else {
            Cow::Borrowed(src)
        }
    }
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn as_f32(c: &mut [f32]) -> Option<&mut [f32]> {
        Some(c)
    }
}

macro_rules! half_elem {
    ($t:ty) => {
        impl Elem for $t {
            fn widen(src: &[$t], _: bool) -> Cow<'_, [f32]> {
                let mut v = vec![0.0; src.len()];
                src.convert_to_f32_slice(&mut v);
                Cow::Owned(v)
            }
            fn narrow(src: &[f32], dst: &mut [$t]) {
                dst.convert_from_f32_slice(src);
            }
            fn as_f32(_: &mut [$t]) -> Option<&mut [f32]> {
                None
            }
        }
    };
}
half_elem!(f16);
half_elem!(bf16);

/// Every batch of `p` on f32 operands (checked shapes).
fn batches(p: &GemmParams, a: &[f32], b: &[f32], c: &mut [f32]) -> Result<()> {
    let [la, lb, lc] = Layout::of(p);
    let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
    // (row stride, column stride) of op(X): a transpose swaps them.
    let strides = |l: &Layout, trans: bool| {
        let ld = l.ld as usize;
        if trans {
            (1, ld)
        } else {
            (ld, 1)
        }
    };
    let (a_rs, a_cs) = strides(&la, p.has(GemmParams::TRANS_A));
    let (b_rs, b_cs) = strides(&lb, p.has(GemmParams::TRANS_B));
    let at = |x: &Layout, bi: usize| bi.saturating_mul(x.stride as usize);
    for bi in 0..p.batch as usize {
        let mat = |data, rows, cols, (rs, cs)| MatRef {
            data,
            rows,
            cols,
            rs,
            cs,
        };
        let a = mat(a.get(at(&la, bi)..).unwrap_or(&[]), m, k, (a_rs, a_cs));
        let b = mat(b.get(at(&lb, bi)..).unwrap_or(&[]), k, n, (b_rs, b_cs));
        let c = MatMut {
            data: c.get_mut(at(&lc, bi)..).unwrap_or(&mut []),
            rows: m,
            cols: n,
            rs: lc.ld as usize,
            cs: 1,
        };
        sgemm(p.alpha, a, b, p.beta, c)?;
    }
    Ok(())
}

fn run<T: Elem>(p: &GemmParams, a: &[T], b: &[T], c: &mut [T]) -> Result<()> {
    if p.m == 0 || p.n == 0 || p.batch == 0 {
        return Ok(());
    }
    let [ea, eb, ec] = Layout::of(p).map(|l| l.extent(p.batch).unwrap_or(0) as usize);
    let tf32 = p.has(GemmParams::TF32);
    let (a32, b32) = (T::widen(&a[..ea], tf32), T::widen(&b[..eb], tf32));
    let c = &mut c[..ec];
    if let Some(c) = T::as_f32(c) {
        return batches(p, &a32, &b32, c);
    }
    let mut c32 = if p.beta != 0.0 {
        T::widen(c, false).into_owned()
    } else {
        vec![0.0; ec]
    };
    batches(p, &a32, &b32, &mut c32)?;
    // Round back the m × n elements of each batch only.
    let (n, ldc, sc) = (p.n as usize, p.ldc as usize, p.stride_c as usize);
    for bi in 0..p.batch as usize {
        for i in 0..p.m as usize {
            let at = bi * sc + i * ldc;
            T::narrow(&c32[at..at + n], &mut c[at..at + n]);
        }
    }
    Ok(())
}

/// `bytes` as elements of `T` (alignment and whole elements checked by the launch).
fn elems<T: bytemuck::Pod>(bytes: &[u8]) -> Result<&[T]> {
    if bytes.is_empty() {
        return Ok(&[]);
    }
    bytemuck::try_cast_slice(bytes)
        .map_err(|e| super::GEMM.signature_error(format!("operand bytes as elements: {e}")))
}

fn elems_mut<T: bytemuck::Pod>(bytes: &mut [u8]) -> Result<&mut [T]> {
    if bytes.is_empty() {
        return Ok(&mut []);
    }
    bytemuck::try_cast_slice_mut(bytes)
        .map_err(|e| super::GEMM.signature_error(format!("operand bytes as elements: {e}")))
}

/// The twin of [`GEMM`](super::GEMM): checks the shapes again (a twin may be run directly on
/// host slices), then computes as the module says.
pub(super) fn twin(args: &mut TwinArgs<'_>) -> Result<()> {
    let p: GemmParams = args.params()?;
    let dtypes = [args.dtype(0), args.dtype(1), args.dtype(2)];
    let (a, b, c) = (args.read(0)?, args.read(1)?, args.take(2)?);
    let es = dtypes[0].map_or(1, |d| d.size());
    check_shapes(&p, dtypes, [a.len() / es, b.len() / es, c.len() / es])?;
    match dtypes[0] {
        Some(DType::F16) => run::<f16>(&p, elems(a)?, elems(b)?, elems_mut(c)?),
        Some(DType::BF16) => run::<bf16>(&p, elems(a)?, elems(b)?, elems_mut(c)?),
        _ => run::<f32>(&p, elems(a)?, elems(b)?, elems_mut(c)?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(
        alpha: f32,
        a: &MatRef<'_>,
        b: &MatRef<'_>,
        beta: f32,
        c: &[f32],
        c_rs: usize,
    ) -> Vec<f64> {
        let mut out = vec![];
        for i in 0..a.rows {
            for j in 0..b.cols {
                let dot: f64 = (0..a.cols)
                    .map(|p| {
                        a.data[i * a.rs + p * a.cs] as f64 * b.data[p * b.rs + j * b.cs] as f64
                    })
                    .sum();
                let old = if beta == 0.0 {
                    0.0
                } else {
                    beta as f64 * c[i * c_rs + j] as f64
                };
                out.push(alpha as f64 * dot + old);
            }
        }
        out
    }

    #[test]
    fn sgemm_takes_blas_order_scalars_and_strides() {
        // A 3×2 stored transposed (2×3, ld 4), B 2×4 (ld 5), C 3×4 (ld 6).
        let a: Vec<f32> = (0..8).map(|i| i as f32 * 0.5 - 1.0).collect();
        let b: Vec<f32> = (0..10).map(|i| (i as f32).sin()).collect();
        let c0: Vec<f32> = (0..18).map(|i| i as f32).collect();
        let ar = MatRef {
            data: &a,
            rows: 3,
            cols: 2,
            rs: 1,
            cs: 4,
        };
        let br = MatRef {
            data: &b,
            rows: 2,
            cols: 4,
            rs: 5,
            cs: 1,
        };
        for (alpha, beta) in [(1.0, 0.0), (2.0, 0.5), (-1.5, 1.0), (0.0, 3.0)] {
            let mut c = c0.clone();
            let want = naive(alpha, &ar, &br, beta, &c, 6);
            sgemm(
                alpha,
                ar,
                br,
                beta,
                MatMut {
                    data: &mut c,
                    rows: 3,
                    cols: 4,
                    rs: 6,
                    cs: 1,
                },
            )
            .unwrap();
            for i in 0..3 {
                for j in 0..4 {
                    let got = c[i * 6 + j] as f64;
                    assert!(
                        (got - want[i * 4 + j]).abs() < 1e-5,
                        "{alpha} {beta} ({i},{j})"
                    );
                }
                // the two elements past each row are left alone
                assert_eq!(&c[i * 6 + 4..i * 6 + 6], &c0[i * 6 + 4..i * 6 + 6]);
            }
        }
    }

    #[test]
    fn beta_zero_does_not_read_c_and_alpha_zero_does_not_read_a_or_b() {
        let a = [f32::NAN; 4];
        let b = [1.0f32; 4];
        let mut c = [f32::NAN; 4];
        let m = |d| MatRef {
            data: d,
            rows: 2,
            cols: 2,
            rs: 2,
            cs: 1,
        };
        sgemm(
            1.0,
            m(&b),
            m(&b),
            0.0,
            MatMut {
                data: &mut c,
                rows: 2,
                cols: 2,
                rs: 2,
                cs: 1,
            },
        )
        .unwrap();
        assert_eq!(c, [2.0; 4]);
        sgemm(
            0.0,
            m(&a),
            m(&b),
            0.5,
            MatMut {
                data: &mut c,
                rows: 2,
                cols: 2,
                rs: 2,
                cs: 1,
            },
        )
        .unwrap();
        assert_eq!(c, [1.0; 4]);
    }

    #[test]
    fn sgemm_refuses_matrices_outside_their_slices() {
        let x = [1.0f32; 4];
        let mut c = [0.0f32; 4];
        let a = MatRef {
            data: &x,
            rows: 2,
            cols: 3,
            rs: 3,
            cs: 1,
        };
        let b = MatRef {
            data: &x,
            rows: 3,
            cols: 2,
            rs: 2,
            cs: 1,
        };
        let r = sgemm(
            1.0,
            a,
            b,
            0.0,
            MatMut {
                data: &mut c,
                rows: 2,
                cols: 2,
                rs: 2,
                cs: 1,
            },
        );
        assert!(matches!(r, Err(Error::Internal { .. })));
        assert_eq!(c, [0.0; 4]);
        let b = MatRef {
            data: &x,
            rows: 2,
            cols: 2,
            rs: 2,
            cs: 1,
        };
        let r = sgemm(
            1.0,
            b,
            b,
            0.0,
            MatMut {
                data: &mut c,
                rows: 2,
                cols: 3,
                rs: 3,
                cs: 1,
            },
        );
        assert!(r.is_err());
    }

    #[test]
    fn tf32_rounds_to_nearest_ties_away() {
        let one = 1.0f32.to_bits();
        assert_eq!(to_tf32(f32::from_bits(one + 0xfff)), 1.0);
        assert_eq!(
            to_tf32(f32::from_bits(one + 0x1000)).to_bits(),
            one + 0x2000
        );
        assert_eq!(
            to_tf32(-f32::from_bits(one + 0x1000)).to_bits(),
            (one + 0x2000) | 1 << 31
        );
        assert_eq!(to_tf32(f32::MAX), f32::INFINITY);
        assert!(to_tf32(f32::NAN).is_nan());
        assert_eq!(to_tf32(f32::NEG_INFINITY), f32::NEG_INFINITY);
    }
}
