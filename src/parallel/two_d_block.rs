//! The 2D / 2.5D layout's pieces: a rank's place ([`Place2D`]) and the linear of whichever scheme the
//! grid runs ([`SummaLinear`]); the layout itself is [`Summa`](crate::parallel::Summa).

use super::{Cost, Linear2D, Linear2p5D, ProcessGrid, TensorMode};
use crate::comm::Communicator;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// A rank's place on a 2D grid (`depth = 1`, `dep = 0`) or a 2.5D grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place2D {
    /// Side `q` of the grid (of each depth layer).
    pub q: usize,
    /// Depth layers `d` (1 on a 2D grid).
    pub depth: usize,
    /// The rank's row `i`.
    pub row: usize,
    /// The rank's column `j`.
    pub col: usize,
    /// The rank's depth layer (0 on a 2D grid).
    pub dep: usize,
}

impl Place2D {
    /// This rank's place; [`Error::Conflict`] on a grid that is neither 2D nor 2.5D.
    pub fn of(grid: &ProcessGrid) -> Result<Place2D> {
        let (q, depth, dep) = match grid.spec().tensor {
            TensorMode::TwoD { q } => (q, 1, 0),
            TensorMode::TwoHalfD { q, depth } => (q, depth, grid.dep_index()?),
            other => {
                return Err(Error::Conflict {
                    what: "a 2D / 2.5D layer".into(),
                    with: format!("a grid of tensor mode {other}"),
                })
            }
        };
        Ok(Place2D {
            q,
            depth,
            row: grid.row_index()?,
            col: grid.col_index()?,
            dep,
        })
    }

    /// The ROW, COL and (for `d > 1`) DEP groups of `grid`, after checking that this rank is
    /// at this place.
    pub(in crate::parallel) fn groups<'g>(&self, grid: &'g ProcessGrid) -> Result<Groups<'g>> {
        let here = Place2D::of(grid)?;
        if here != *self {
            return Err(Error::WrongPlace {
                what: "a 2D layer",
                registered: format!("for {self:?}"),
                run: format!("at {here:?}"),
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

/// The communicators of one call.
pub(in crate::parallel) struct Groups<'g> {
    pub(in crate::parallel) row: &'g Communicator,
    pub(in crate::parallel) col: &'g Communicator,
    pub(in crate::parallel) dep: Option<&'g Communicator>,
}

/// A linear of the 2D or the 2.5D scheme, whichever the grid runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SummaLinear {
    /// On a 2D grid.
    TwoD(Linear2D),
    /// On a 2.5D grid.
    TwoHalfD(Linear2p5D),
}

impl SummaLinear {
    /// Registers layer `name` as [`Linear2D::register`] or [`Linear2p5D::register`], by the
    /// grid's mode.
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        [inputs, outputs]: [usize; 2],
        weight: &Init,
        bias: Option<&Init>,
    ) -> Result<SummaLinear> {
        Ok(match grid.spec().tensor {
            TensorMode::TwoHalfD { .. } => SummaLinear::TwoHalfD(Linear2p5D::register(
                store, grid, name, inputs, outputs, weight, bias,
            )?),
            _ => SummaLinear::TwoD(Linear2D::register(
                store, grid, name, inputs, outputs, weight, bias,
            )?),
        })
    }

    /// The layer of this rank's depth layer.
    pub fn slice(&self) -> &Linear2D {
        match self {
            SummaLinear::TwoD(l) => l,
            SummaLinear::TwoHalfD(l) => &l.slice,
        }
    }

    /// The parameters, in fetch order.
    pub fn params(&self) -> Vec<TensorId> {
        self.slice().params()
    }

    /// The layer's forward (see [`Linear2D::forward`]).
    pub fn forward(&self, pass: &ForwardPass<'_>, grid: &ProcessGrid, x: &Act) -> Result<Act> {
        match self {
            SummaLinear::TwoD(l) => l.forward(pass, grid, x),
            SummaLinear::TwoHalfD(l) => l.forward(pass, grid, x),
        }
    }

    /// The layer's backward, returning `dX` (see [`Linear2D::backward`]).
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        dy: &Act,
    ) -> Result<Act> {
        let dx = match self {
            SummaLinear::TwoD(l) => l.backward(pass, grid, x, dy, true),
            SummaLinear::TwoHalfD(l) => l.backward(pass, grid, x, dy, true),
        }?;
        dx.ok_or_else(no_dx)
    }

    /// The backward of a linear whose weight is used more than once per iteration (a tied
    /// head), returning `dX`: [`Linear2D::backward_shared`] or
    /// [`Linear2p5D::backward_shared`].
    pub fn backward_shared(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        dy: &Act,
    ) -> Result<Act> {
        let dx = match self {
            SummaLinear::TwoD(l) => l.backward_shared(pass, grid, x, dy, true),
            SummaLinear::TwoHalfD(l) => l.backward_shared(pass, grid, x, dy, true),
        }?;
        dx.ok_or_else(no_dx)
    }
}

/// A linear's backward asked for `dx` that gave none: a bug.
fn no_dx() -> Error {
    Error::Internal {
        what: "a 2D linear's backward asked for dx gave none".into(),
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
