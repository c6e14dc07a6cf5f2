mod cost;
mod layernorm;

pub use layernorm::{LayerNorm2D, LayerNorm2DSaved, Place2D};

use super::two_d::split;
use super::{Linear2D, Linear2p5D, ProcessGrid, TensorMode};
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

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
