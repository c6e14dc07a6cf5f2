//! The CPU twins of the dot interaction: per sample, the rows widened to f32 in scratch, then
//! blocks of [`ROWS`] rows by [`LANES`] lanes accumulated in registers, each lane one fma chain
//! in the order the kernels run it.

use super::{check_operands, InteractionParams, InteractionShape};
use crate::device::TwinArgs;
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::float::{simd, with_float, Float};

/// Lanes of the twins' accumulator blocks (one AVX-512 vector of f32).
const LANES: usize = 16;
/// Rows of `Z` (forward) or of `dT` (backward) the twins accumulate at once.
const ROWS: usize = 8;

/// `N` values of `s` from `at`, as an array.
#[inline(always)]
fn arr<const N: usize>(s: &[f32], at: usize) -> &[f32; N] {
    s[at..at + N].try_into().expect("a slice of N values")
}

/// [`LANES`] values the twins treat as one vector: straight-line code on its lanes, which the
/// compiler turns into vector instructions, with the accumulators kept in registers.
#[derive(Clone, Copy)]
struct V([f32; LANES]);

impl V {
    const ZERO: V = V([0.0; LANES]);

    /// `self + a·b` lane by lane, one rounding each (`a` broadcast).
    #[inline(always)]
    fn fma(self, a: f32, b: &[f32; LANES]) -> V {
        let mut o = self;
        for (o, &b) in o.0.iter_mut().zip(b) {
            *o = a.mul_add(b, *o);
        }
        o
    }
}

/// `acc[r] += a[r]·b` for every row, written out row by row: a loop over the rows would be
/// vectorised across them (with gathers), not across the lanes.
#[inline(always)]
fn fma_rows(acc: &mut [V; ROWS], a: &[f32; ROWS], b: &[f32; LANES]) {
    let [a0, a1, a2, a3, a4, a5, a6, a7] = *a;
    acc[0] = acc[0].fma(a0, b);
    acc[1] = acc[1].fma(a1, b);
    acc[2] = acc[2].fma(a2, b);
    acc[3] = acc[3].fma(a3, b);
    acc[4] = acc[4].fma(a4, b);
    acc[5] = acc[5].fma(a5, b);
    acc[6] = acc[6].fma(a6, b);
    acc[7] = acc[7].fma(a7, b);
}

/// `acc[r][l] = Σ_c tt[c][i0 + r] · tt[c][j0 + l]` as fma chains over `c = 0, 1, …, dim − 1`,
/// `tt` holding `T` transposed with `np` values per column.
#[inline(always)]
fn dot_block(tt: &[f32], np: usize, dim: usize, i0: usize, j0: usize) -> [V; ROWS] {
    let mut acc = [V::ZERO; ROWS];
    for col in tt.chunks_exact(np).take(dim) {
        fma_rows(&mut acc, arr(col, i0), arr(col, j0));
    }
    acc
}

/// `dst = src` widened to f32, element by element.
#[inline(always)]
fn widen<T: Float>(dst: &mut [f32], src: &[T]) {
    for (d, v) in dst.iter_mut().zip(src) {
        *d = v.get();
    }
}

/// The first `dst.len()` lanes of `v` rounded into `dst` (a whole vector at once when it fits).
#[inline(always)]
fn narrow<T: Float>(dst: &mut [T], v: &V) {
    if let Ok(dst) = <&mut [T; LANES]>::try_from(&mut *dst) {
        for (d, &a) in dst.iter_mut().zip(&v.0) {
            *d = T::put(a);
        }
    } else {
        for (d, &a) in dst.iter_mut().zip(&v.0) {
            *d = T::put(a);
        }
    }
}

/// One sample of the forward pass; `tt` is scratch for `T` transposed (`dim` columns of `np`
/// values; what lies beyond row `n − 1` stays zero).
#[inline(always)]
fn forward_sample<T: Float>(x: &[T], e: &[T], out: &mut [T], tt: &mut [f32], n: usize, np: usize) {
    let dim = x.len();
    out[..dim].copy_from_slice(x);
    for (c, v) in x.iter().enumerate() {
        tt[c * np] = v.get();
    }
    for (r, row) in e.chunks_exact(dim.max(1)).enumerate() {
        for (c, v) in row.iter().enumerate() {
            tt[c * np + r + 1] = v.get();
        }
    }
    let z = &mut out[dim..];
    for i0 in (1..n).step_by(ROWS) {
        let last = (i0 + ROWS).min(n) - 1; // the block's last row: columns j < last
        for j0 in (0..last).step_by(LANES) {
            let acc = dot_block(tt, np, dim, i0, j0);
            for (r, acc) in acc.iter().enumerate().take(last + 1 - i0) {
                let i = i0 + r;
                let m = i.saturating_sub(j0).min(LANES);
                narrow(&mut z[i * (i - 1) / 2 + j0..][..m], acc);
            }
        }
    }
}

/// One sample of the backward pass. `rows` is scratch for `T` and then `dT` (`n` rows of `dp`
/// values, zero beyond `dim` in `T`), `g` for `G` (`n` rows of `gp` values, zero beyond `n`; `G`
/// is symmetric, so row `m` holds `G[k][m]` for every `k`). `dT` is written to the outputs row
/// by row at the end, so memory sees them written in order.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn backward_sample<T: Float>(
    x: &[T],
    e: &[T],
    dy: &[T],
    dx: &mut [T],
    de: &mut [T],
    rows: &mut [f32],
    dt: &mut [f32],
    g: &mut [f32],
    (n, dp, gp): (usize, usize, usize),
) {
    let dim = x.len();
    widen(&mut rows[..dim], x);
    for (r, row) in e.chunks_exact(dim.max(1)).enumerate() {
        widen(&mut rows[(r + 1) * dp..][..dim], row);
    }
    // Row i of dZ is G[i][j] for j < i (contiguous), and G[j][i] for each such j (strided);
    // the diagonal stays zero.
    let dz = &dy[dim..];
    for i in 1..n {
        let zi = &dz[i * (i - 1) / 2..][..i];
        widen(&mut g[i * gp..][..i], zi);
        for (j, v) in zi.iter().enumerate() {
            g[j * gp + i] = v.get();
        }
    }
    for k0 in (0..n).step_by(ROWS) {
        for c0 in (0..dim).step_by(LANES) {
            let mut acc = [V::ZERO; ROWS];
            if k0 == 0 {
                widen(&mut acc[0].0, &dy[c0..dim.min(c0 + LANES)]);
            }
            for m in 0..n {
                fma_rows(&mut acc, arr(g, m * gp + k0), arr(rows, m * dp + c0));
            }
            for (r, acc) in acc.iter().enumerate().take(n.min(k0 + ROWS) - k0) {
                dt[(k0 + r) * dp + c0..][..LANES].copy_from_slice(&acc.0);
            }
        }
    }
    T::narrow(&dt[..dim], dx);
    for (k, dst) in de.chunks_exact_mut(dim).enumerate() {
        T::narrow(&dt[(k + 1) * dp..][..dim], dst);
    }
}

/// The shape of a twin run, checked like a launch (the twin may be run directly): `lens` are
/// the operands' lengths in elements.
fn twin_shape(a: &TwinArgs<'_>, lens: &[usize]) -> Result<InteractionShape> {
    let p: InteractionParams = a.params()?;
    check_operands(a.desc(), &p, |i| (a.dtype(i), lens[i]))
}

fn forward_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let (dense, emb) = (a.read_as::<T>(0)?, a.read_as::<T>(1)?);
    let out = a.take_as::<T>(2)?;
    let s = twin_shape(a, &[dense.len(), emb.len(), out.len()])?;
    let (n, d, w) = (s.rows(), s.dim, s.out_width());
    if s.batch == 0 || w == 0 {
        return Ok(());
    }
    let np = (n - 1 + ROWS).next_multiple_of(LANES);
    let mut tt = vec![0f32; d * np];
    let fe = s.features * d;
    simd(
        #[inline(always)]
        || {
            for b in 0..s.batch {
                let (x, e) = (&dense[b * d..][..d], &emb[b * fe..][..fe]);
                forward_sample(x, e, &mut out[b * w..][..w], &mut tt, n, np);
            }
        },
    );
    Ok(())
}

fn backward_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let (dense, emb, dout) = (a.read_as::<T>(0)?, a.read_as::<T>(1)?, a.read_as::<T>(2)?);
    let d_dense = a.take_as::<T>(3)?;
    let d_emb = a.take_as::<T>(4)?;
    let lens = [
        dense.len(),
        emb.len(),
        dout.len(),
        d_dense.len(),
        d_emb.len(),
    ];
    let s = twin_shape(a, &lens)?;
    let (n, d, w) = (s.rows(), s.dim, s.out_width());
    if s.batch == 0 || d == 0 {
        return Ok(());
    }
    let dp = d.next_multiple_of(LANES);
    let gp = n.next_multiple_of(ROWS);
    let mut rows = vec![0f32; n * dp];
    let mut dt = vec![0f32; n.next_multiple_of(ROWS) * dp];
    let mut g = vec![0f32; n * gp];
    let fe = s.features * d;
    simd(
        #[inline(always)]
        || {
            for b in 0..s.batch {
                backward_sample(
                    &dense[b * d..][..d],
                    &emb[b * fe..][..fe],
                    &dout[b * w..][..w],
                    &mut d_dense[b * d..][..d],
                    &mut d_emb[b * fe..][..fe],
                    &mut rows,
                    &mut dt,
                    &mut g,
                    (n, dp, gp),
                );
            }
        },
    );
    Ok(())
}

pub(super) fn forward_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    with_float!(a.dtype(0).unwrap_or(DType::F32), T => forward_typed::<T>(a))
}

pub(super) fn backward_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    with_float!(a.dtype(0).unwrap_or(DType::F32), T => backward_typed::<T>(a))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{HostOperand, KernelDesc};
    use crate::ops::interaction::{INTERACTION_BACKWARD, INTERACTION_FORWARD};

    /// A pseudo-random value in [-1, 1).
    fn val(i: usize, seed: usize) -> f32 {
        let h = (i as u32 ^ (seed as u32).wrapping_mul(0x9E37_79B9)).wrapping_mul(2_654_435_761);
        (h >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }

    fn run(desc: &'static KernelDesc, s: InteractionShape, ins: &[&[f32]], outs: &mut [Vec<f32>]) {
        let p = s.params();
        let mut ops: Vec<HostOperand<'_>> = ins
            .iter()
            .map(|v| HostOperand::Read(bytemuck::cast_slice(v), DType::F32))
            .collect();
        ops.extend(
            outs.iter_mut()
                .map(|v| HostOperand::Write(bytemuck::cast_slice_mut(v), DType::F32)),
        );
        let mut args = TwinArgs::new(desc, ops, bytemuck::bytes_of(&p)).unwrap();
        (desc.twin)(&mut args).unwrap();
    }

    /// Row r of sample b.
    fn row<'v>(x: &'v [f32], e: &'v [f32], s: InteractionShape, b: usize, r: usize) -> &'v [f32] {
        let d = s.dim;
        if r == 0 {
            &x[b * d..][..d]
        } else {
            &e[(b * s.features + r - 1) * d..][..d]
        }
    }

    /// The module's definition, element by element, in f32.
    fn forward_naive(x: &[f32], e: &[f32], s: InteractionShape) -> Vec<f32> {
        let mut out = Vec::new();
        for b in 0..s.batch {
            out.extend_from_slice(row(x, e, s, b, 0));
            for i in 1..s.rows() {
                for j in 0..i {
                    let (a, c) = (row(x, e, s, b, i), row(x, e, s, b, j));
                    out.push(
                        a.iter()
                            .zip(c)
                            .fold(0.0f32, |acc, (p, q)| p.mul_add(*q, acc)),
                    );
                }
            }
        }
        out
    }

    #[allow(clippy::needless_range_loop)]
    fn backward_naive(x: &[f32], e: &[f32], dy: &[f32], s: InteractionShape) -> Vec<f32> {
        let (n, d, w) = (s.rows(), s.dim, s.out_width());
        let mut dt = vec![]; // [b][k][c]
        for b in 0..s.batch {
            let dy = &dy[b * w..][..w];
            let g = |k: usize, m: usize| match k.cmp(&m) {
                std::cmp::Ordering::Equal => 0.0,
                std::cmp::Ordering::Greater => dy[d + k * (k - 1) / 2 + m],
                std::cmp::Ordering::Less => dy[d + m * (m - 1) / 2 + k],
            };
            for k in 0..n {
                for c in 0..d {
                    let mut acc = if k == 0 { dy[c] } else { 0.0 };
                    for m in 0..n {
                        acc = g(k, m).mul_add(row(x, e, s, b, m)[c], acc);
                    }
                    dt.push(acc);
                }
            }
        }
        dt
    }

    #[test]
    fn twins_run_the_chains_of_the_definition_bit_for_bit() {
        for (batch, features, dim) in [(1, 0, 3), (2, 1, 1), (3, 5, 7), (2, 26, 64), (1, 17, 33)] {
            let s = InteractionShape {
                batch,
                features,
                dim,
            };
            let x: Vec<f32> = (0..batch * dim).map(|i| val(i, 1)).collect();
            let e: Vec<f32> = (0..batch * features * dim).map(|i| val(i, 2)).collect();
            let mut out = vec![vec![f32::NAN; batch * s.out_width()]];
            run(&INTERACTION_FORWARD, s, &[&x, &e], &mut out);
            let want = forward_naive(&x, &e, s);
            assert_eq!(bits(&out[0]), bits(&want), "forward {s:?}");

            let dy: Vec<f32> = (0..batch * s.out_width()).map(|i| val(i, 3)).collect();
            let mut grads = vec![vec![f32::NAN; x.len()], vec![f32::NAN; e.len()]];
            run(&INTERACTION_BACKWARD, s, &[&x, &e, &dy], &mut grads);
            let dt = backward_naive(&x, &e, &dy, s);
            let (n, d) = (s.rows(), dim);
            for b in 0..batch {
                let got_x = &grads[0][b * d..][..d];
                let got_e = &grads[1][b * features * d..][..features * d];
                let want = &dt[b * n * d..][..n * d];
                assert_eq!(bits(got_x), bits(&want[..d]), "d_dense {s:?}");
                assert_eq!(bits(got_e), bits(&want[d..]), "d_emb {s:?}");
            }
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn the_order_is_dlrms() {
        // T = [[1], [2], [3], [4]]: Z[1][0], Z[2][0], Z[2][1], Z[3][0], Z[3][1], Z[3][2].
        let s = InteractionShape {
            batch: 1,
            features: 3,
            dim: 1,
        };
        let mut out = vec![vec![0.0; s.out_width()]];
        run(
            &INTERACTION_FORWARD,
            s,
            &[&[1.0], &[2.0, 3.0, 4.0]],
            &mut out,
        );
        assert_eq!(out[0], [1.0, 2.0, 3.0, 6.0, 4.0, 8.0, 12.0]);
        assert_eq!(s.pairs(), 6);
        let criteo = InteractionShape {
            batch: 1,
            features: 26,
            dim: 16,
        };
        assert_eq!(criteo.out_width(), 367);
    }

    #[test]
    fn a_twin_run_directly_checks_its_shapes() {
        let s = InteractionShape {
            batch: 2,
            features: 2,
            dim: 3,
        };
        let (x, e) = (vec![1.0f32; 6], vec![1.0f32; 12]);
        let mut out = vec![7.0f32; 2 * s.out_width() - 1];
        let p = s.params();
        let ops = vec![
            HostOperand::Read(bytemuck::cast_slice(&x), DType::F32),
            HostOperand::Read(bytemuck::cast_slice(&e), DType::F32),
            HostOperand::Write(bytemuck::cast_slice_mut(&mut out), DType::F32),
        ];
        let mut args = TwinArgs::new(&INTERACTION_FORWARD, ops, bytemuck::bytes_of(&p)).unwrap();
        let err = (INTERACTION_FORWARD.twin)(&mut args).unwrap_err();
        assert!(err.to_string().contains("`out`"), "{err}");
        assert!(out.iter().all(|&v| v == 7.0));
    }
}
