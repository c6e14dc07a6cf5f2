//! The CPU twins of the LayerNorm kernels: the same additions in the same order as
//! `kernels/layernorm.cu` (each row's 32 lane sums, the warp's butterfly; dγ/dβ over fixed row
//! chunks), fused into as few passes over a row as the order allows; the forward takes four
//! rows at a time so their chains of dependent additions run side by side.

use std::array;

use super::{LayerNormBackwardParams, LayerNormParams};
use crate::device::TwinArgs;
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::float::{simd, with_float, Float};
use crate::ops::lanes::{lane_sums, warp_sum};
use crate::ops::rows::{add_columns, prefetch, Operands};

/// Rows the forward twin handles at once (their chains of additions interleave; the backward,
/// with more independent work per element, runs fastest a row at a time).
const GROUP: usize = 4;

/// The forward of `R` consecutive rows of `src` (`h` widened to f32) into `y`.
#[inline(always)]
fn forward_group<T: Float, const R: usize>(
    src: &[f32],
    y: &mut [T],
    (gv, bv): (&[f32], &[f32]),
    eps: f32,
    (mean, rstd): (&mut [f32], &mut [f32]),
) {
    let c = gv.len();
    let cf = c as f32;
    let rows: [&[f32]; R] = array::from_fn(|i| &src[i * c..(i + 1) * c]);
    let sums = lane_sums(rows, |_, v| v);
    let m: [f32; R] = array::from_fn(|i| warp_sum(&sums[i]) / cf);
    let sq = lane_sums(rows, |i, v| {
        let d = v - m[i];
        d * d
    });
    let rs: [f32; R] = array::from_fn(|i| 1.0 / (warp_sum(&sq[i]) / cf + eps).sqrt());
    for (i, (row, y)) in rows.iter().zip(y.chunks_exact_mut(c)).enumerate() {
        for (((y, &v), &g), &b) in y.iter_mut().zip(*row).zip(gv).zip(bv) {
            *y = T::put(((v - m[i]) * rs[i]) * g + b);
        }
    }
    mean[..R].copy_from_slice(&m);
    rstd[..R].copy_from_slice(&rs);
}

fn forward_typed<T: Float>(mut o: Operands<'_>, p: &LayerNormParams) -> Result<()> {
    let (n, c) = (p.rows as usize, p.cols as usize);
    let (x, r) = (o.read::<T>(0)?, o.read_opt::<T>(1)?);
    let (mut h, y) = (o.write_opt::<T>(4)?, o.write::<T>(5)?);
    let (mean, rstd) = (o.write::<f32>(6)?, o.write::<f32>(7)?);
    let gv = T::widen(o.read::<T>(2)?, &mut vec![0.0; c]).to_vec();
    let bv = T::widen(o.read::<T>(3)?, &mut vec![0.0; c]).to_vec();
    let mut buf = vec![0.0f32; GROUP * c];
    let mut row = 0;
    while row < n {
        let k = if n - row >= GROUP { GROUP } else { 1 };
        let span = row * c..(row + k) * c;
        let ahead = (row + 2 * k).min(n) * c..(row + 3 * k).min(n) * c;
        prefetch(&x[ahead.clone()]);
        let rh = match (r, h.as_deref_mut()) {
            (Some(r), Some(h)) => {
                prefetch(&r[ahead]);
                Some((&r[span.clone()], &mut h[span.clone()]))
            }
            _ => None,
        };
        let rows = (&x[span.clone()], rh, &mut y[span]);
        let stats = (&mut mean[row..row + k], &mut rstd[row..row + k]);
        let buf = &mut buf[..k * c];
        if k == GROUP {
            forward_step::<T, GROUP>(rows, (&gv, &bv), p.eps, buf, stats);
        } else {
            forward_step::<T, 1>(rows, (&gv, &bv), p.eps, buf, stats);
        }
        row += k;
    }
    Ok(())
}

/// The rows of one forward group: `x`, the residual with `h` where there is one, and `y`.
type FwdRows<'a, T> = (&'a [T], Option<(&'a [T], &'a mut [T])>, &'a mut [T]);

/// One group of the forward, in its own vectorised function (one per `T` and `R`): `h = x + r`
/// (rounded) where there is a residual, the rows widened into `buf`, then [`forward_group`].
#[inline(always)]
fn forward_step<T: Float, const R: usize>(
    (x, rh, y): FwdRows<'_, T>,
    gb: (&[f32], &[f32]),
    eps: f32,
    buf: &mut [f32],
    stats: (&mut [f32], &mut [f32]),
) {
    simd(
        #[inline(always)]
        || {
            let src: &[f32] = match rh {
                Some((r, h)) => {
                    for (((h, &a), &b), f) in h.iter_mut().zip(x).zip(r).zip(buf.iter_mut()) {
                        let v = T::put(a.get() + b.get());
                        *h = v;
                        *f = v.get();
                    }
                    buf
                }
                None => T::widen(x, buf),
            };
            forward_group::<T, R>(src, y, gb, eps, stats)
        },
    )
}

pub(super) fn forward_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: LayerNormParams = a.params()?;
    let o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    with_float!(o.dtype(0).unwrap_or(DType::F32), T => forward_typed::<T>(o, &p))
}

/// The row inputs of one group of the backward, `h` and `dy` widened to f32.
struct Group<'g> {
    h: &'g [f32],
    dy: &'g [f32],
    mean: &'g [f32],
    rstd: &'g [f32],
}

/// The backward of `R` consecutive rows: `dx =` (`dx +=` when `ACC`), and each column's `n·dy`
/// and `dy` added to `sg` and `sb` in row order.
#[inline(always)]
fn backward_group<T: Float, const R: usize, const ACC: bool>(
    g: Group<'_>,
    gv: &[f32],
    dx: &mut [T],
    (sg, sb): (&mut [f32], &mut [f32]),
) {
    let c = gv.len();
    let cf = c as f32;
    let h: [&[f32]; R] = array::from_fn(|i| &g.h[i * c..(i + 1) * c]);
    let dy: [&[f32]; R] = array::from_fn(|i| &g.dy[i * c..(i + 1) * c]);
    let (m, rs) = (&g.mean[..R], &g.rstd[..R]);
    // Pass 1: the lane sums of w = γ·dy and of w·n, n = (h − mean)·rstd.
    let (mut p1, mut p2) = ([[0.0f32; 32]; R], [[0.0f32; 32]; R]);
    let hs = h.map(|r| r.as_chunks::<32>());
    let ds = dy.map(|r| r.as_chunks::<32>());
    let (gs, gt) = gv.as_chunks::<32>();
    for (k, gk) in gs.iter().enumerate() {
        for i in 0..R {
            let (hk, dk) = (&hs[i].0[k], &ds[i].0[k]);
            let (mut q1, mut q2) = (p1[i], p2[i]);
            for j in 0..32 {
                let nv = (hk[j] - m[i]) * rs[i];
                let w = gk[j] * dk[j];
                q1[j] += w;
                q2[j] += w * nv;
            }
            (p1[i], p2[i]) = (q1, q2);
        }
    }
    for i in 0..R {
        for (j, ((&hv, &dv), &gj)) in hs[i].1.iter().zip(ds[i].1).zip(gt).enumerate() {
            let nv = (hv - m[i]) * rs[i];
            let w = gj * dv;
            p1[i][j] += w;
            p2[i][j] += w * nv;
        }
    }
    let a1: [f32; R] = array::from_fn(|i| warp_sum(&p1[i]) / cf);
    let a2: [f32; R] = array::from_fn(|i| warp_sum(&p2[i]) / cf);
    // Pass 2: dx, and the column sums (row after row, so rows in order within each column).
    for (i, dx) in dx.chunks_exact_mut(c).enumerate().take(R) {
        let cols = dx.iter_mut().zip(h[i]).zip(dy[i]).zip(gv);
        for ((((x, &hv), &dv), &gj), (sg, sb)) in cols.zip(sg.iter_mut().zip(sb.iter_mut())) {
            let nv = (hv - m[i]) * rs[i];
            let w = gj * dv;
            let d = ((w - a1[i]) - nv * a2[i]) * rs[i];
            *x = T::put(if ACC { x.get() + d } else { d });
            *sg += nv * dv;
            *sb += dv;
        }
    }
}

/// One group of the backward, in its own vectorised function (one per `T`, `R`, `ACC`: each
/// keeps its accumulators in registers), after widening its rows.
#[inline(always)]
fn backward_step<T: Float, const R: usize, const ACC: bool>(
    (h, dy): (&[T], &[T]),
    (mean, rstd): (&[f32], &[f32]),
    gv: &[f32],
    dx: &mut [T],
    (hbuf, dybuf): (&mut [f32], &mut [f32]),
    sums: (&mut [f32], &mut [f32]),
) {
    simd(
        #[inline(always)]
        || {
            let g = Group {
                h: T::widen(h, hbuf),
                dy: T::widen(dy, dybuf),
                mean,
                rstd,
            };
            backward_group::<T, R, ACC>(g, gv, dx, sums)
        },
    )
}

/// dx of every row, and each chunk's column sums into `scratch`.
fn backward_rows<T: Float>(
    o: &mut Operands<'_>,
    p: &LayerNormBackwardParams,
    scratch: &mut [f32],
) -> Result<()> {
    let (n, c) = (p.rows as usize, p.cols as usize);
    let (dy, h) = (o.read::<T>(0)?, o.read::<T>(1)?);
    let (mean, rstd) = (o.read::<f32>(2)?, o.read::<f32>(3)?);
    let gv = T::widen(o.read::<T>(4)?, &mut vec![0.0; c]).to_vec();
    let dx = o.write::<T>(5)?;
    let (acc, per) = (p.accumulate != 0, p.chunk_rows.max(1) as usize);
    let (mut hbuf, mut dybuf) = (vec![0.0f32; c], vec![0.0f32; c]);
    for (k, sums) in scratch.chunks_exact_mut(2 * c).enumerate() {
        let (sg, sb) = sums.split_at_mut(c);
        sg.fill(0.0);
        sb.fill(0.0);
        let end = ((k + 1) * per).min(n);
        for row in k * per..end {
            let span = row * c..(row + 1) * c;
            let ahead = (row + 2).min(n) * c..(row + 3).min(n) * c;
            prefetch(&h[ahead.clone()]);
            prefetch(&dy[ahead.clone()]);
            if acc {
                prefetch(&dx[ahead]);
            }
            let rows = (&h[span.clone()], &dy[span.clone()]);
            let stats = (&mean[row..row + 1], &rstd[row..row + 1]);
            let dx = &mut dx[span];
            let bufs = (&mut hbuf[..], &mut dybuf[..]);
            let sums = (&mut *sg, &mut *sb);
            if acc {
                backward_step::<T, 1, true>(rows, stats, &gv, dx, bufs, sums);
            } else {
                backward_step::<T, 1, false>(rows, stats, &gv, dx, bufs, sums);
            }
        }
    }
    Ok(())
}

/// `dγ += Σ_chunks`, `dβ += Σ_chunks`, the chunks in order, one rounding each.
fn backward_reduce<G: Float>(o: &mut Operands<'_>, scratch: &[f32], c: usize) -> Result<()> {
    let (dg, db) = (o.write::<G>(6)?, o.write::<G>(7)?);
    let mut sums = vec![0.0f32; 2 * c];
    simd(
        #[inline(always)]
        || {
            for part in scratch.chunks_exact(2 * c) {
                add_columns(&mut sums, part);
            }
            let (sg, sb) = sums.split_at(c);
            for (dst, sum) in [(dg, sg), (db, sb)] {
                for (d, &s) in dst.iter_mut().zip(sum) {
                    *d = G::put(d.get() + s);
                }
            }
        },
    );
    Ok(())
}

pub(super) fn backward_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: LayerNormBackwardParams = a.params()?;
    let mut o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    if p.rows == 0 {
        // CUDA launches nothing: dγ and dβ keep their bits.
        return Ok(());
    }
    let scratch = o.write::<f32>(8)?;
    with_float!(o.dtype(0).unwrap_or(DType::F32), T => backward_rows::<T>(&mut o, &p, scratch))?;
    let c = p.cols as usize;
    with_float!(o.dtype(6).unwrap_or(DType::F32), G => backward_reduce::<G>(&mut o, scratch, c))
}
