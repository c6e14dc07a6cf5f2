//! The collectives of the 2D and 2.5D layers, derived in the tests from each algorithm (not
//! from the crate's own `collectives()`), in f32.

use tidemem::comm::Tally;
use tidemem::parallel::{Cost, TensorMode};

/// `calls` collectives moving `bytes` in all.
pub fn tally(calls: u64, bytes: usize) -> Tally {
    Tally {
        calls,
        bytes: bytes as u64,
    }
}

/// The grid's `q` and depth.
pub fn q_depth(mode: TensorMode) -> (usize, usize) {
    match mode {
        TensorMode::TwoD { q } => (q, 1),
        TensorMode::TwoHalfD { q, depth } => (q, depth),
        m => panic!("{m}"),
    }
}

/// A SUMMA linear's collectives (`inp → out`, with a bias or not, `dX` wanted) over `rows`
/// rows of f32,
/// derived here: with `rl` local rows, `X` block `x = rl·inp/q`, weight block
/// `w = inp/q · out/q`, each of the `q` SUMMA steps broadcasts an `X` block on ROW and a `W`
/// block on COL forward; backward broadcasts `X` blocks (for `dW`) and reduces `dW` blocks
/// on COL, broadcasts `W` blocks on COL and reduces `dX` blocks on ROW; the bias is
/// all-gathered on COL forward and its gradient reduce-scattered there backward (f32); with
/// depth, DEP all-reduces `dW` and the bias gradient's block (`out/q²`, f32).
pub fn linear_formula(mode: TensorMode, rows: usize, inp: usize, out: usize, bias: bool) -> Cost {
    let (q, d) = q_depth(mode);
    let (rl, e) = (rows / (q * d), 4);
    let (x, w, b) = (rl * inp / q, inp / q * (out / q), out / q);
    let qq = q as u64;
    let mut c = Cost::default();
    c.forward.row.broadcast = tally(qq, q * x * e);
    c.forward.col.broadcast = tally(qq, q * w * e);
    if bias {
        c.forward.col.all_gather = tally(1, b * e);
    }
    c.backward.row.broadcast = tally(qq, q * x * e);
    c.backward.col.reduce = tally(qq, q * w * e);
    c.backward.col.broadcast = tally(qq, q * w * e);
    c.backward.row.reduce = tally(qq, q * x * e);
    if bias {
        c.backward.col.reduce_scatter = tally(1, b * 4);
    }
    if d > 1 {
        c.backward.dep.all_reduce = match bias {
            true => tally(2, w * e + b / q * 4),
            false => tally(1, w * e),
        };
    }
    c
}
