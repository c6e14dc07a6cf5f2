//! GPT-2's feed-forward block: `c_proj(GELU(c_fc(x)))`, `C → 4C → C`.

use super::act::Act;
use super::asked_dx;
use super::gelu::{gelu, gelu_backward, GeluSaved};
use super::linear::Linear;
use crate::error::{Error, Result};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// The transformer's MLP (GPT-2's `mlp`): `y = c_proj(GELU(c_fc(x)))` with `c_fc` `C → 4C`,
/// the tanh-approximated GELU, and `c_proj` `4C → C`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mlp {
    /// `C → 4C`.
    pub c_fc: Linear,
    /// `4C → C`.
    pub c_proj: Linear,
}

/// What [`Mlp::forward`] keeps for the backward: its input, the pre-activation `c_fc(x)` and
/// the GELU's output.
#[derive(Debug)]
pub struct MlpSaved {
    x: Act,
    pre: GeluSaved,
    act: Act,
}

impl MlpSaved {
    /// The layer's input `x` (shared with the caller's).
    pub fn x(&self) -> &Act {
        &self.x
    }
}

impl Mlp {
    /// Registers `{name}.c_fc.{weight,bias}` (`[4C, C]`, `[4C]`) and
    /// `{name}.c_proj.{weight,bias}` (`[C, 4C]`, `[C]`): weights with `init` (or
    /// [`Linear::default_init`]), biases zero.
    pub fn register(
        store: &mut impl ParamStore,
        name: &str,
        channels: usize,
        init: Option<Init>,
    ) -> Result<Mlp> {
        let hidden = channels.checked_mul(4).ok_or_else(|| Error::Overflow {
            what: format!("the hidden width (4 × {channels} channels) of mlp '{name}'"),
        })?;
        let c_fc = Linear::register(
            store,
            &format!("{name}.c_fc"),
            channels,
            hidden,
            true,
            init.clone(),
        )?;
        let c_proj = Linear::register(
            store,
            &format!("{name}.c_proj"),
            hidden,
            channels,
            true,
            init,
        )?;
        Ok(Mlp { c_fc, c_proj })
    }

    /// The parameters: `c_fc`'s, then `c_proj`'s.
    pub fn params(&self) -> Vec<TensorId> {
        let mut v = self.c_fc.params();
        v.extend(self.c_proj.params());
        v
    }

    /// `y = c_proj(GELU(c_fc(x)))` for `x` `[N, C]`; returns `y` and what the backward needs.
    /// Shapes and types are checked before anything runs ([`Error::Length`],
    /// [`Error::ActivationShape`]).
    pub fn forward(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, MlpSaved)> {
        if self.c_proj.inputs != self.c_fc.outputs {
            return Err(Error::Length {
                what: "mlp: the inputs c_proj takes for the features c_fc gives".into(),
                got: self.c_proj.inputs,
                expected: self.c_fc.outputs,
            });
        }
        let pre = self.c_fc.forward(pass, x)?;
        let (act, pre) = gelu(pass, &pre)?;
        let y = self.c_proj.forward(pass, &act)?;
        let saved = MlpSaved {
            x: x.clone(),
            pre,
            act,
        };
        Ok((y, saved))
    }

    /// The backward of [`Mlp::forward`] from the output's gradient `dy`: writes the four
    /// parameters' gradients and returns `dx`.
    pub fn backward(&self, pass: &BackwardPass<'_>, saved: &MlpSaved, dy: &Act) -> Result<Act> {
        let dact = self
            .c_proj
            .backward(pass, &saved.act, dy, true)
            .and_then(asked_dx)?;
        let dpre = gelu_backward(pass, &saved.pre, &dact)?;
        drop(dact);
        self.c_fc
            .backward(pass, &saved.x, &dpre, true)
            .and_then(asked_dx)
    }
}
