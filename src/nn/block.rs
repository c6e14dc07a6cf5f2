//! GPT-2's pre-LayerNorm transformer block.

use super::act::Act;
use super::attention::{AttnSaved, CausalSelfAttention};
use super::layernorm::{LayerNorm, LnSaved};
use super::mlp::{Mlp, MlpSaved};
use crate::error::Result;
use crate::ops::{add, Axpby};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// A pre-LayerNorm transformer block as GPT-2's:
/// `h1 = x + attn(ln_1(x))`, `out = h1 + mlp(ln_2(h1))`.
///
/// `ln_2` runs fused with the first residual add (it takes `attn`'s output and the residual
/// `x`, and yields `h1` with its normalisation); backward carries the residual stream's
/// gradient in one buffer that `ln_2` and then `ln_1` add their input gradients into.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Block {
    /// LayerNorm before the attention.
    pub ln_1: LayerNorm,
    /// Causal self-attention.
    pub attn: CausalSelfAttention,
    /// LayerNorm before the MLP.
    pub ln_2: LayerNorm,
    /// The feed-forward block.
    pub mlp: Mlp,
}

/// What [`Block::forward`] keeps for the backward.
#[derive(Debug)]
pub struct BlockSaved {
    ln_1: LnSaved,
    attn: AttnSaved,
    ln_2: LnSaved,
    mlp: MlpSaved,
}

impl BlockSaved {
    /// `h1 = x + attn(ln_1(x))`, the residual stream between the two halves.
    pub fn h1(&self) -> &Act {
        self.ln_2.h()
    }
}

impl Block {
    /// Registers `{name}.ln_1.*`, `{name}.attn.{c_attn,c_proj}.*`, `{name}.ln_2.*` and
    /// `{name}.mlp.{c_fc,c_proj}.*` (GPT-2's names): LayerNorms of `eps` (γ ones, β zeros),
    /// linear weights with `init` (or [`Linear::default_init`](super::Linear::default_init)),
    /// biases zero.
    pub fn register(
        store: &mut impl ParamStore,
        name: &str,
        channels: usize,
        heads: usize,
        eps: f32,
        init: Option<Init>,
    ) -> Result<Block> {
        let ln_1 = LayerNorm::register(store, &format!("{name}.ln_1"), channels, eps)?;
        let attn = CausalSelfAttention::register(
            store,
            &format!("{name}.attn"),
            channels,
            heads,
            init.clone(),
        )?;
        let ln_2 = LayerNorm::register(store, &format!("{name}.ln_2"), channels, eps)?;
        let mlp = Mlp::register(store, &format!("{name}.mlp"), channels, init)?;
        Ok(Block {
            ln_1,
            attn,
            ln_2,
            mlp,
        })
    }

    /// The parameters in registration order: `ln_1` (γ, β), `attn`, `ln_2`, `mlp`.
    pub fn params(&self) -> Vec<TensorId> {
        let mut v = vec![self.ln_1.gamma, self.ln_1.beta];
        v.extend(self.attn.params());
        v.extend([self.ln_2.gamma, self.ln_2.beta]);
        v.extend(self.mlp.params());
        v
    }

    /// The block on `x` `[B·T, C]` (batch-major rows): returns `out` `[B·T, C]` and what the
    /// backward needs. Shapes and types are checked by the layers before they run.
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        batch: usize,
        seq: usize,
    ) -> Result<(Act, BlockSaved)> {
        let (y1, ln_1) = self.ln_1.forward(pass, x, None)?;
        let (a, attn) = self.attn.forward(pass, &y1, batch, seq)?;
        // h1 = x + a, and its normalisation, in one op
        let (y2, ln_2) = self.ln_2.forward(pass, &a, Some(x))?;
        drop(a);
        let (m, mlp) = self.mlp.forward(pass, &y2)?;
        let out = Act::alloc(pass.pool(), x.rows(), x.cols(), x.dtype())?;
        let one = Axpby {
            alpha: 1.0,
            beta: 1.0,
        };
        add(
            pass.device(),
            pass.stream(),
            one,
            ln_2.h().input(),
            m.input(),
            out.view(),
            x.dtype(),
        )?;
        let saved = BlockSaved {
            ln_1,
            attn,
            ln_2,
            mlp,
        };
        Ok((out, saved))
    }

    /// The backward of [`Block::forward`] from the output's gradient `dout`: writes every
    /// parameter's gradient and returns `dx` (a new activation; `dout` is not changed).
    pub fn backward(&self, pass: &BackwardPass<'_>, saved: &BlockSaved, dout: &Act) -> Result<Act> {
        let (rows, c, d) = (dout.rows(), dout.cols(), dout.dtype());
        dout.expect(
            "dout",
            Some(saved.h1().rows()),
            saved.h1().cols(),
            pass.param_dtype(),
        )?;
        // the residual stream's gradient: dout, then + ln_2's dx (= dh1), then + ln_1's dx
        let dres = Act::alloc(pass.pool(), rows, c, d)?;
        pass.device()
            .copy_d2d(pass.stream(), dout.input(), dres.view())?;
        let dm = self.mlp.backward(pass, &saved.mlp, dout)?;
        self.ln_2.backward(pass, &saved.ln_2, &dm, Some(&dres))?;
        drop(dm);
        let dy1 = self.attn.backward(pass, &saved.attn, &dres)?;
        self.ln_1.backward(pass, &saved.ln_1, &dy1, Some(&dres))?;
        Ok(dres)
    }
}
