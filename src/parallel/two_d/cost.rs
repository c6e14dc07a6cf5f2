//! The collectives of the 2D and 2.5D layers, from the formulas.

use super::Linear2D;
use crate::comm::Tally;
use crate::dtype::DType;
use crate::parallel::{Cost, PassCost};

/// A tally of `calls` calls of `elems` elements of `size` bytes each.
fn tally(calls: usize, elems: usize, size: usize) -> Tally {
    Tally {
        calls: calls as u64,
        bytes: (calls * elems * size) as u64,
    }
}

impl Linear2D {
    /// The formulas: `rows_l` local rows, `depth` layers, elements of `dtype`.
    ///
    /// With `r` local rows (`rows/q`, or `rows/(d·q)` in 2.5D), `X` block `x = r·inputs/q`
    /// elements, weight block `w = outputs/q · inputs/q`, bias block `outputs/q`, `e` bytes an
    /// element (the parameter dtype), every rank does:
    ///
    /// - forward: ROW `q` broadcasts of `x·e` bytes; COL `q` broadcasts of `w·e`, and with a bias
    ///   one all-gather of `outputs/q · e`;
    /// - backward: ROW `q` broadcasts of `x·e` (for `dW`); COL `q` reduces of `w·e`; with `dX`,
    ///   COL `q` broadcasts of `w·e` and ROW `q` reduces of `x·e`; with a bias, COL one
    ///   reduce-scatter of `outputs/q · 4` (f32); in 2.5D with `d > 1`, DEP one all-reduce of
    ///   `w·e` and, with a bias, one of `outputs/q² · 4`.
    pub(super) fn costs(&self, rows_l: usize, depth: usize, dtype: DType, need_dx: bool) -> Cost {
        let (q, e) = (self.q, dtype.size());
        let (in_l, out_l) = self.local();
        let (x, w) = (rows_l * in_l, out_l * in_l);
        let bias = self.bias.is_some();
        let mut f = PassCost::default();
        f.row.broadcast = tally(q, x, e);
        f.col.broadcast = tally(q, w, e);
        if bias {
            f.col.all_gather = tally(1, out_l, e);
        }
        let mut b = PassCost::default();
        b.row.broadcast = tally(q, x, e);
        b.col.reduce = tally(q, w, e);
        if need_dx {
            b.col.broadcast = tally(q, w, e);
            b.row.reduce = tally(q, x, e);
        }
        if bias {
            b.col.reduce_scatter = tally(1, out_l, 4);
        }
        if depth > 1 {
            b.dep.all_reduce = tally(1, w, e);
            if bias {
                b.dep.all_reduce = b.dep.all_reduce + tally(1, out_l / q, 4);
            }
        }
        Cost {
            forward: f,
            backward: b,
        }
    }
}
