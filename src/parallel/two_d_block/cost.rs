//! The collectives of [`LayerNorm2D`] and of the block on the [`Summa`] layout, from the
//! formulas.

use super::{split, LayerNorm2D, SummaLinear};
use crate::comm::Tally;
use crate::dtype::DType;
use crate::error::Result;
use crate::parallel::{Cost, PassCost};

/// `calls` calls of `bytes` bytes each.
fn tally(calls: usize, bytes: usize) -> Tally {
    Tally {
        calls: calls as u64,
        bytes: (calls * bytes) as u64,
    }
}

impl LayerNorm2D {
    /// The collectives of one forward and one backward over a full batch of `rows` rows of
    /// `dtype` (the store's parameter dtype), per group, as
    /// [`Communicator::stats`](crate::comm::Communicator::stats) counts them (the figures of
    /// [`LayerNorm2D`]'s documentation). Fails when `rows` does not split into the row
    /// blocks (`q`, or `d·q` in 2.5D).
    pub fn collectives(&self, rows: usize, dtype: DType) -> Result<Cost> {
        let p = self.place;
        let r = split("batch", "rows", rows, p.q * p.depth, "row blocks")?;
        let (c, e, q) = (self.cols, dtype.size(), p.q);
        let mut f = PassCost::default();
        f.row.all_gather = tally(1, r * c * e) + tally(2, c * e);
        f.col.all_gather = tally(2, c / q * e);
        let mut b = PassCost::default();
        b.row.all_gather = tally(2, r * c * e) + tally(1, c * e);
        b.col.all_gather = tally(1, c / q * e);
        b.col.reduce_scatter = tally(2, c / q * 4);
        if p.depth > 1 {
            b.dep.all_reduce = tally(2, c / (q * q) * 4);
        }
        Ok(Cost {
            forward: f,
            backward: b,
        })
    }
}

impl SummaLinear {
    /// [`Linear2D::collectives`](crate::parallel::Linear2D::collectives) or
    /// [`Linear2p5D::collectives`](crate::parallel::Linear2p5D::collectives), with `dX`.
    pub fn collectives(&self, rows: usize, dtype: DType) -> Result<Cost> {
        match self {
            SummaLinear::TwoD(l) => l.collectives(rows, dtype, true),
            SummaLinear::TwoHalfD(l) => l.collectives(rows, dtype, true),
        }
    }
}
