//! GELU (tanh approximation) on activations: [`gelu`] and [`gelu_backward`].

use super::act::Act;
use crate::error::Result;
use crate::store::{BackwardPass, Pass, PassKind};

/// `GELU(x)` into a new activation from the pass's pool, on its stream
/// ([`ops::gelu_forward`](crate::ops::gelu_forward)); in a backward pass too (a recomputed
/// activation).
pub fn gelu<K: PassKind>(pass: &Pass<'_, K>, x: &Act) -> Result<Act> {
    let y = Act::alloc(pass.pool(), x.rows(), x.cols(), x.dtype())?;
    crate::ops::gelu_forward(pass.device(), pass.stream(), x.input(), y.view(), x.dtype())?;
    Ok(y)
}

/// `dx = dy · GELU'(x)` for the forward's input `x` and the output's gradient `dy` (same shape
/// and type, else [`Error::ActivationShape`](crate::Error::ActivationShape)).
pub fn gelu_backward(pass: &BackwardPass<'_>, x: &Act, dy: &Act) -> Result<Act> {
    dy.expect("dy", Some(x.rows()), x.cols(), x.dtype())?;
    let dx = Act::alloc(pass.pool(), x.rows(), x.cols(), x.dtype())?;
    let (dev, s) = (pass.device(), pass.stream());
    crate::ops::gelu_backward(dev, s, x.input(), dy.input(), dx.view(), x.dtype())?;
    Ok(dx)
}
