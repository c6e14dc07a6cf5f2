//! ReLU on activations: [`relu`] and [`relu_backward`], and the [`Relu`] and [`Gelu`] layers a
//! [`Sequential`](super::Sequential) runs.

use super::act::Act;
use super::gelu::GeluSaved;
use super::sequential::Layer;
use crate::error::Result;
use crate::store::{BackwardPass, ForwardPass};

/// What [`relu`] keeps for [`relu_backward`]: its input. A type of its own, so that another
/// layer's saved state cannot be handed to ReLU's backward: this does not compile.
///
/// ```compile_fail
/// use tidemem::nn::{relu_backward, Act, Gelu, Layer};
/// # fn f(fwd: &tidemem::store::ForwardPass<'_>, bwd: &tidemem::store::BackwardPass<'_>, z: &Act, dy: &Act) -> tidemem::Result<()> {
/// let (_, saved) = Gelu.forward(fwd, z)?; // a GeluSaved
/// relu_backward(bwd, &saved, dy)?; // expected `&ReluSaved`
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct ReluSaved(Act);

/// `max(x, 0)` into a new activation from the pass's pool, on its stream
/// ([`ops::relu_forward`](crate::ops::relu_forward)), and what its backward needs.
pub fn relu(pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, ReluSaved)> {
    let y = Act::alloc(pass.pool(), x.rows(), x.cols(), x.dtype())?;
    crate::ops::relu_forward(pass.device(), pass.stream(), x.input(), y.view(), x.dtype())?;
    Ok((y, ReluSaved(x.clone())))
}

/// `dx = dy · [x > 0]` for the output's gradient `dy` (of the forward's shape and type, else
/// [`Error::ActivationShape`](crate::Error::ActivationShape)).
pub fn relu_backward(pass: &BackwardPass<'_>, saved: &ReluSaved, dy: &Act) -> Result<Act> {
    let x = &saved.0;
    dy.expect("dy", Some(x.rows()), x.cols(), x.dtype())?;
    let dx = Act::alloc(pass.pool(), x.rows(), x.cols(), x.dtype())?;
    let (dev, s) = (pass.device(), pass.stream());
    crate::ops::relu_backward(dev, s, x.input(), dy.input(), dx.view(), x.dtype())?;
    Ok(dx)
}

/// The ReLU as a layer of a [`Sequential`](super::Sequential).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Relu;

impl Layer for Relu {
    type Saved = ReluSaved;

    fn forward(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, ReluSaved)> {
        relu(pass, x)
    }

    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: ReluSaved,
        dy: &Act,
        _need_dx: bool,
    ) -> Result<Option<Act>> {
        relu_backward(pass, &saved, dy).map(Some)
    }
}

/// GELU (tanh approximation, [`gelu`](super::gelu)) as a layer of a
/// [`Sequential`](super::Sequential).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gelu;

impl Layer for Gelu {
    type Saved = GeluSaved;

    fn forward(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, GeluSaved)> {
        super::gelu(pass, x)
    }

    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: GeluSaved,
        dy: &Act,
        _need_dx: bool,
    ) -> Result<Option<Act>> {
        super::gelu_backward(pass, &saved, dy).map(Some)
    }
}
