//! [`Linear2p5D`]: [`Linear2D`]'s algorithm in each depth layer of a `q × q × d` grid.

use super::{split_rows, wrong_mode, Groups, Linear2D};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::parallel::Cost;
use crate::parallel::{ProcessGrid, TensorMode};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// A linear layer over a `q × q × d` grid: [`Linear2D`]'s algorithm in each depth layer, the
/// batch cut `d·q` ways, weight and bias gradients all-reduced over depth (see
/// [`Linear2D`](crate::parallel::Linear2D)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear2p5D {
    /// The layer of this rank's depth layer: its blocks, `q`, row and column.
    pub slice: Linear2D,
    /// Number of depth layers `d`.
    pub depth: usize,
    /// This rank's depth layer.
    pub dep: usize,
}

impl Linear2p5D {
    /// Registers this rank's blocks of layer `name` on a 2.5D `grid`, as
    /// [`Linear2D::register`] does in each depth layer (the same blocks in every layer). Fails
    /// on a grid of another mode and on shapes that do not split, naming the dimension.
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        inputs: usize,
        outputs: usize,
        weight: &Init,
        bias: Option<&Init>,
    ) -> Result<Linear2p5D> {
        let TensorMode::TwoHalfD { q, depth } = grid.spec().tensor else {
            return Err(wrong_mode("Linear2p5D", name, "a 2.5D", grid));
        };
        let (row, col, dep) = (grid.row_index()?, grid.col_index()?, grid.dep_index()?);
        let slice =
            Linear2D::register_at(store, name, [inputs, outputs], [q, row, col], weight, bias)?;
        Ok(Linear2p5D { slice, depth, dep })
    }

    /// The parameters, in fetch order.
    pub fn params(&self) -> Vec<TensorId> {
        self.slice.params()
    }

    /// `Y` from this rank's `X` block `[rows/(d·q), inputs/q]` (row block `row + q·dep`):
    /// [`Linear2D::forward`] within the depth layer.
    pub fn forward(&self, pass: &ForwardPass<'_>, grid: &ProcessGrid, x: &Act) -> Result<Act> {
        self.slice.forward_in(pass, &self.groups(grid)?, x)
    }

    /// [`Linear2D::backward`] within the depth layer, then the weight and bias gradients
    /// all-reduced over DEP (for `d > 1`).
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        self.slice
            .backward_in(pass, &self.groups(grid)?, x, dy, need_dx, false)
    }

    /// [`Linear2D::backward_shared`] within the depth layer: the weight gradient is all-reduced
    /// over DEP (for `d > 1`) before it is added as this use's share.
    pub fn backward_shared(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        self.slice
            .backward_in(pass, &self.groups(grid)?, x, dy, need_dx, true)
    }

    /// The collectives of one forward and one backward over a full batch of `rows` rows (see
    /// [`Linear2D::collectives`]). Fails when `rows` does not split by `d·q`.
    pub fn collectives(&self, rows: usize, dtype: DType, need_dx: bool) -> Result<Cost> {
        let rows_l = split_rows(rows, self.depth * self.slice.q)?;
        Ok(self.slice.costs(rows_l, self.depth, dtype, need_dx))
    }

    fn groups<'g>(&self, grid: &'g ProcessGrid) -> Result<Groups<'g>> {
        let mode = TensorMode::TwoHalfD {
            q: self.slice.q,
            depth: self.depth,
        };
        if grid.spec().tensor != mode {
            return Err(wrong_mode("Linear2p5D", "", &format!("its {mode}"), grid));
        }
        self.slice.check_place(grid)?;
        if grid.dep_index()? != self.dep {
            return Err(Error::WrongPlace {
                what: "a 2.5D layer",
                registered: format!("for depth layer {}", self.dep),
                run: format!("in layer {}", grid.dep_index()?),
            });
        }
        Ok(Groups {
            row: grid.row()?,
            col: grid.col()?,
            dep: if self.depth > 1 {
                Some(grid.dep()?)
            } else {
                None
            },
        })
    }
}
