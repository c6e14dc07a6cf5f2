//! The reduction orders of the row kernels (`kernels/lanes.cuh`), for the CPU twins to mirror
//! bit for bit.
//!
//! A row kernel gives each thread (lane) the elements `l, l + L, l + 2L, …` of a row of `L`
//! threads, summed in that order from `+0.0` (the twins keep `L` running sums, one per lane,
//! over chunks of `L` elements; [`lane_sums`] does so for kernels that give one warp to a row,
//! several rows at a time); a warp then combines its 32 partial sums with the xor butterfly
//! `v = v + shfl_xor(v, o)` for `o = 16, 8, 4, 2, 1` ([`warp_sum`]: every lane ends with the
//! same value, as addition is commutative); a block of several warps adds the warps' totals in
//! warp order, starting from warp 0's ([`block_sum`]). Maxima are exact in any order
//! ([`max_lanes`]). Everything is plain f32 arithmetic, which Rust never contracts, so the
//! twins' results are the kernels' bits.

/// The 32 lane sums of `R` warps that own a row each: lane `l` of row `i` adds `f(i, x)` for
/// the row's elements `l`, `l + 32`, … in order, starting from `+0.0`. The rows' additions
/// interleave, so `R` chains of dependent additions run side by side, each in its row's order.
/// The rows have the same length.
#[inline(always)]
pub(crate) fn lane_sums<E: Copy, const R: usize>(
    rows: [&[E]; R],
    f: impl Fn(usize, E) -> f32,
) -> [[f32; 32]; R] {
    let mut p = [[0.0f32; 32]; R];
    let split: [(&[[E; 32]], &[E]); R] = rows.map(|r| r.as_chunks::<32>());
    let chunks = split.iter().map(|s| s.0.len()).min().unwrap_or(0);
    for k in 0..chunks {
        // Indexed, with a copy of each row's lanes: the form LLVM keeps in vector registers.
        #[allow(clippy::needless_range_loop)]
        for i in 0..R {
            let ch = &split[i].0[k];
            let mut a = p[i];
            for j in 0..32 {
                a[j] += f(i, ch[j]);
            }
            p[i] = a;
        }
    }
    for (i, (p, (_, rest))) in p.iter_mut().zip(&split).enumerate() {
        for (j, &x) in rest.iter().enumerate() {
            p[j] += f(i, x);
        }
    }
    p
}

/// The value every lane of a warp holds after the xor butterfly over its 32 partials `p`.
#[inline(always)]
pub(crate) fn warp_sum(p: &[f32]) -> f32 {
    let mut v = [0f32; 32];
    v.copy_from_slice(&p[..32]);
    // Lane l < o ends round o with v[l] + v[l ^ o] = v[l] + v[l + o]; lane 0's chain is every
    // lane's final value.
    let mut o = 16;
    while o > 0 {
        for l in 0..o {
            v[l] += v[l + o];
        }
        o /= 2;
    }
    v[0]
}

/// The sum of a block of `L` threads (`L / 32` warps): each warp's butterfly, then the warps'
/// totals added in warp order (`block_sum` in `kernels/lanes.cuh`).
#[inline(always)]
pub(crate) fn block_sum<const L: usize>(p: &[f32; L]) -> f32 {
    let mut total = warp_sum(&p[..32]);
    for w in p.chunks_exact(32).skip(1) {
        total += warp_sum(w);
    }
    total
}

/// The largest of 32 lanes, by halving (exact in any order).
#[inline(always)]
pub(crate) fn max_lanes(mut m: [f32; 32]) -> f32 {
    let mut o = 16;
    while o > 0 {
        for l in 0..o {
            m[l] = m[l].max(m[l + o]);
        }
        o /= 2;
    }
    m[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The butterfly as 32 lanes run it, every lane kept.
    fn butterfly(p: &[f32]) -> [f32; 32] {
        let mut v: [f32; 32] = p.try_into().unwrap();
        for o in [16, 8, 4, 2, 1] {
            let u = v;
            for l in 0..32 {
                v[l] = u[l] + u[l ^ o];
            }
        }
        v
    }

    #[test]
    fn warp_sum_is_every_lanes_butterfly_result() {
        let p: Vec<f32> = (0..32).map(|i| 1.0 / (i as f32 + 0.37) * 1e3).collect();
        let all = butterfly(&p);
        assert!(all.iter().all(|&v| v.to_bits() == all[0].to_bits()));
        assert_eq!(warp_sum(&p).to_bits(), all[0].to_bits());
    }

    #[test]
    fn lane_sums_stride_by_lane() {
        let x: Vec<f32> = (0..70).map(|i| i as f32).collect();
        let [p] = lane_sums([&x[..]], |_, v| v);
        assert_eq!(p[0], 0.0 + 32.0 + 64.0);
        assert_eq!(p[5], 5.0 + 37.0 + 69.0);
        assert_eq!(p[6], 6.0 + 38.0);
        let mut b = [0f32; 64];
        for (i, &v) in x.iter().enumerate() {
            b[i % 64] += v;
        }
        assert_eq!(block_sum(&b), (0..70).sum::<i32>() as f32);
    }

    #[test]
    fn rows_keep_their_own_lanes() {
        let xs: Vec<f32> = (0..77).map(|i| (i as f32).sin() * 1e3).collect();
        let ys: Vec<f32> = (0..77).map(|i| (i as f32).cos()).collect();
        let [p, q] = lane_sums([&xs[..], &ys[..]], |i, v| if i == 0 { v } else { v * v });
        let (mut want_p, mut want_q) = ([0.0f32; 32], [0.0f32; 32]);
        for (i, &x) in xs.iter().enumerate() {
            want_p[i % 32] += x;
        }
        for (i, &y) in ys.iter().enumerate() {
            want_q[i % 32] += y * y;
        }
        assert_eq!(p, want_p);
        assert_eq!(q, want_q);
        assert_eq!(warp_sum(&p).to_bits(), butterfly(&p)[0].to_bits());
    }

    #[test]
    fn max_ignores_nan() {
        let mut m = [f32::NEG_INFINITY; 32];
        m[7] = f32::NAN;
        m[20] = 3.5;
        m[3] = -1.0;
        assert_eq!(max_lanes(m), 3.5);
        assert_eq!(max_lanes([f32::NEG_INFINITY; 32]), f32::NEG_INFINITY);
    }
}
