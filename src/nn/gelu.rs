//! GELU (tanh approximation) on activations: [`gelu`] and [`gelu_backward`].

use super::act::Act;
use crate::error::Result;
use crate::store::{BackwardPass, Pass, PassKind};

/// What [`gelu`] keeps for [`gelu_backward`]: its input. A type of its own, so that another
/// activation (the GELU's output, a ReLU's saved state) cannot be handed to the backward in
/// its place.
#[derive(Clone, Debug)]
pub struct GeluSaved(Act);

impl GeluSaved {
    /// The GELU's input.
    pub fn input(&self) -> &Act {
        &self.0
    }
}

/// `GELU(x)` into a new activation from the pass's pool, on its stream
/// ([`ops::gelu_forward`](crate::ops::gelu_forward)), and what its backward needs; in a
/// backward pass too (a recomputed activation).
pub fn gelu<K: PassKind>(pass: &Pass<'_, K>, x: &Act) -> Result<(Act, GeluSaved)> {
    let y = Act::alloc(pass.pool(), x.rows(), x.cols(), x.dtype())?;
    crate::ops::gelu_forward(pass.device(), pass.stream(), x.input(), y.view(), x.dtype())?;
    Ok((y, GeluSaved(x.clone())))
}

/// `dx = dy · GELU'(x)` for the forward's saved input and the output's gradient `dy` (same
/// shape and type, else [`Error::ActivationShape`](crate::Error::ActivationShape)).
pub fn gelu_backward(pass: &BackwardPass<'_>, saved: &GeluSaved, dy: &Act) -> Result<Act> {
    let x = &saved.0;
    dy.expect("dy", Some(x.rows()), x.cols(), x.dtype())?;
    let dx = Act::alloc(pass.pool(), x.rows(), x.cols(), x.dtype())?;
    let (dev, s) = (pass.device(), pass.stream());
    crate::ops::gelu_backward(dev, s, x.input(), dy.input(), dx.view(), x.dtype())?;
    Ok(dx)
}
