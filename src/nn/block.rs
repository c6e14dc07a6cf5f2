//! GPT-2's pre-LayerNorm transformer block.

use super::act::Act;
use super::attention::{AttnSaved, CausalSelfAttention, HeadsCore};
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
///
/// # Example
///
/// One block of 8 channels and 2 heads over 2 sequences of 3 tokens:
///
/// ```
/// use tidemem::nn::{Act, Block};
/// use tidemem::prelude::*;
///
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 22))?;
/// let mut cfg = ManagerConfig::new(256, Policy::Tide);
/// cfg.param_dtype = DType::F32;
/// let mut m = ChunkManager::new(dev, cfg)?;
/// let block = Block::register(&mut m, "h.0", 8, 2, 1e-5, None)?;
/// assert_eq!(block.params().len(), 12);
///
/// let fwd = m.forward()?;
/// let x = Act::upload(fwd.pool(), fwd.stream(), 6, 8, DType::F32, &[0.5; 48])?;
/// let (out, saved) = block.forward(&fwd, &x, 2, 3)?;
/// assert_eq!(out.shape(), [6, 8]);
/// fwd.finish()?;
///
/// let bwd = m.backward()?;
/// let dout = Act::upload(bwd.pool(), bwd.stream(), 6, 8, DType::F32, &[1.0; 48])?;
/// let dx = block.backward(&bwd, &saved, &dout)?;
/// assert_eq!(dx.shape(), [6, 8]);
/// bwd.finish()?;
/// // the output bias's gradient: Σ_rows dout
/// assert_eq!(m.read(block.mlp.c_proj.bias.unwrap())?, vec![6.0; 8]);
/// # Ok(()) }
/// ```
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

/// What a split block adds to [`Block::forward_ext`] and [`Block::backward_ext`].
#[derive(Clone, Copy)]
pub struct BlockHooks<'a> {
    /// Applied in place to the attention's and the MLP's outputs before the residual adds,
    /// and to the gradients they give their inputs (a tensor-parallel all-reduce).
    pub sum: &'a dyn Fn(&Act) -> Result<()>,
    /// The attention between the projections (`None`: over the rows' own positions).
    pub core: Option<&'a dyn HeadsCore>,
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
    /// backward needs. The input's shape and type and `rows = batch × seq` are checked before
    /// anything runs ([`Error::InvalidArgument`](crate::Error::InvalidArgument)).
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        batch: usize,
        seq: usize,
    ) -> Result<(Act, BlockSaved)> {
        self.forward_with(pass, x, batch, seq, &|_| Ok(()))
    }

    /// [`Block::forward`] with `sum` applied in place to the attention's and the MLP's
    /// outputs before the residual adds: the all-reduce of a tensor-parallel block whose
    /// layers hold one rank's shards (each output is then a partial sum).
    pub fn forward_with(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        batch: usize,
        seq: usize,
        sum: &dyn Fn(&Act) -> Result<()>,
    ) -> Result<(Act, BlockSaved)> {
        self.forward_ext(pass, x, batch, seq, BlockHooks { sum, core: None })
    }

    /// [`Block::forward`] with `hooks`: the sum of a tensor-parallel block's partial outputs
    /// and the attention's core ([`HeadsCore`]; for a sequence split over ranks).
    pub fn forward_ext(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        batch: usize,
        seq: usize,
        hooks: BlockHooks<'_>,
    ) -> Result<(Act, BlockSaved)> {
        let sum = hooks.sum;
        x.expect("x", None, self.ln_1.cols, pass.param_dtype())?;
        self.attn.op(x.rows(), batch, seq)?;
        let (y1, ln_1) = self.ln_1.forward(pass, x, None)?;
        let (a, attn) = self.attn.forward_core(pass, &y1, batch, seq, hooks.core)?;
        sum(&a)?;
        // h1 = x + a, and its normalisation, in one op
        let (y2, ln_2) = self.ln_2.forward(pass, &a, Some(x))?;
        drop(a);
        let (m, mlp) = self.mlp.forward(pass, &y2)?;
        sum(&m)?;
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
        self.backward_with(pass, saved, dout, &|_| Ok(()))
    }

    /// [`Block::backward`] with `sum` applied in place to the gradients the MLP and the
    /// attention give their inputs, before the LayerNorms' backward (the all-reduce of a
    /// tensor-parallel block; see [`Block::forward_with`]).
    pub fn backward_with(
        &self,
        pass: &BackwardPass<'_>,
        saved: &BlockSaved,
        dout: &Act,
        sum: &dyn Fn(&Act) -> Result<()>,
    ) -> Result<Act> {
        self.backward_ext(pass, saved, dout, BlockHooks { sum, core: None })
    }

    /// [`Block::backward`] with the `hooks` its forward ran with.
    pub fn backward_ext(
        &self,
        pass: &BackwardPass<'_>,
        saved: &BlockSaved,
        dout: &Act,
        hooks: BlockHooks<'_>,
    ) -> Result<Act> {
        let sum = hooks.sum;
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
        sum(&dm)?;
        self.ln_2.backward(pass, &saved.ln_2, &dm, Some(&dres))?;
        drop(dm);
        let dy1 = self
            .attn
            .backward_core(pass, &saved.attn, &dres, hooks.core)?;
        sum(&dy1)?;
        self.ln_1.backward(pass, &saved.ln_1, &dy1, Some(&dres))?;
        Ok(dres)
    }
}
