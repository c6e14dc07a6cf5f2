//! GPT-2's tied language-model head: `logits = h·wteᵀ`, then the fused softmax cross-entropy.

use super::act::Act;
use super::linear::{Linear, WeightUse};
use super::loss::Loss;
use super::losses::fused_cross_entropy;
use crate::error::{Error, Result};
use crate::ops::check_targets;
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::TensorId;

/// The tied projection to the vocabulary (`logits = h·wteᵀ`, a [`Linear`] over the token
/// embedding's weight, [`WeightUse::Shared`]) fused with the mean cross-entropy.
///
/// Forward and backward are separate passes, so the forward computes the logits and runs
/// [`cross_entropy_forward_backward`](crate::ops::cross_entropy_forward_backward): it writes the
/// losses and, over the logits, their gradient scaled by `1 / rows counted`, which the
/// [`LmHeadSaved`] keeps. Backward runs the shared linear's backward from it: `dh`, and `wte`'s
/// share through [`Guard::accumulate_grad`](crate::store::Guard::accumulate_grad).
///
/// # Example
///
/// The embedding and the tied head, one step over a batch of 1 × 3 tokens:
///
/// ```
/// use tidemem::nn::{Embedding, LmHead};
/// use tidemem::prelude::*;
///
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let mut cfg = ManagerConfig::new(64, Policy::Tide);
/// cfg.param_dtype = DType::F32;
/// let mut m = ChunkManager::new(dev, cfg)?;
/// let emb = Embedding::register(&mut m, 5, 4, 2, None)?;
/// let head = LmHead::tied(&m, emb.wte, -100)?;
///
/// let fwd = m.forward()?;
/// let (x, emb_saved) = emb.forward(&fwd, &[1, 4, 1], 1, 3)?;
/// let (loss, head_saved) = head.forward(&fwd, &x, &[4, 1, -100])?;
/// assert!((loss - 5f32.ln()).abs() < 0.01); // near-uniform logits from small weights
/// fwd.finish()?;
///
/// let bwd = m.backward()?;
/// let dx = head.backward(&bwd, &head_saved)?;
/// emb.backward(&bwd, &emb_saved, &dx)?; // wte: the head's share + the embedding's
/// bwd.finish()?;
/// assert_eq!(m.read(emb.wpe)?[6..], [0.0; 2]); // position 3 is unused: no gradient
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LmHead {
    /// The projection over `wte` `[V, C]`.
    pub proj: Linear,
    /// Targets equal to it count for nothing (PyTorch's default -100).
    pub ignore_index: i32,
}

/// What [`LmHead::forward`] keeps for the backward.
#[derive(Debug)]
pub struct LmHeadSaved {
    h: Act,
    dlogits: Act,
    counted: usize,
}

impl LmHeadSaved {
    /// The logits' gradient `[N, V]` (`(softmax − onehot)/counted`, 0 on ignored rows).
    pub fn dlogits(&self) -> &Act {
        &self.dlogits
    }

    /// Rows whose target was not the ignore index.
    pub fn counted(&self) -> usize {
        self.counted
    }
}

impl LmHead {
    /// The head over the token embedding `wte` (`[V, C]`, registered already).
    pub fn tied(store: &impl ParamStore, wte: TensorId, ignore_index: i32) -> Result<LmHead> {
        let proj = Linear::from_ids(store, wte, None, WeightUse::Shared)?;
        Ok(LmHead { proj, ignore_index })
    }

    /// `V`.
    pub fn vocab(&self) -> usize {
        self.proj.outputs
    }

    /// The mean loss over the rows whose target is not the ignore index (0 when none is), for
    /// `h` `[N, C]` and `targets` `[N]` (host i32). Targets are checked on the host
    /// ([`check_targets`]) and shapes before anything runs; the loss comes back in one download.
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        h: &Act,
        targets: &[i32],
    ) -> Result<(f32, LmHeadSaved)> {
        let (loss, saved) = self.forward_scaled(pass, h, targets, 1.0)?;
        Ok((loss.read()?, saved))
    }

    /// [`LmHead::forward`] with the gradient kept for the backward scaled by `scale` (a loss
    /// scale for f16 training, or `1 / micro-batches`), and the loss (not scaled) left on its
    /// way to the host ([`Loss`]): the host does not wait for it here. The scale must be
    /// positive and finite.
    pub fn forward_scaled(
        &self,
        pass: &ForwardPass<'_>,
        h: &Act,
        targets: &[i32],
        scale: f32,
    ) -> Result<(Loss, LmHeadSaved)> {
        super::check_scale("the loss scale", scale)?;
        let (d, v) = (pass.param_dtype(), self.vocab());
        h.expect("h", Some(targets.len()), self.proj.inputs, d)?;
        check_targets(targets, v, self.ignore_index)?;
        let counted = targets.iter().filter(|&&t| t != self.ignore_index).count();
        let logits = self.proj.forward(pass, h)?;
        let grad_scale = scale / counted.max(1) as f32;
        let loss = fused_cross_entropy(pass, &logits, targets, self.ignore_index, grad_scale)?;
        let saved = LmHeadSaved {
            h: h.clone(),
            dlogits: logits,
            counted,
        };
        Ok((loss, saved))
    }

    /// The backward of [`LmHead::forward`]: returns `dh` `[N, C]` and adds `wte`'s share.
    pub fn backward(&self, pass: &BackwardPass<'_>, saved: &LmHeadSaved) -> Result<Act> {
        let dh = self.proj.backward(pass, &saved.h, &saved.dlogits, true)?;
        dh.ok_or_else(|| Error::Internal {
            what: "the head's backward asked for dh gave none".into(),
        })
    }

    /// [`LmHead::backward`] with `wte`'s share returned (`[V, C]`, the parameter dtype)
    /// instead of added to the store ([`Linear::backward_returning`]).
    pub fn backward_returning(
        &self,
        pass: &BackwardPass<'_>,
        saved: &LmHeadSaved,
    ) -> Result<(Act, crate::device::PoolBlock)> {
        let (dh, share) = self
            .proj
            .backward_returning(pass, &saved.h, &saved.dlogits, true)?;
        let dh = dh.ok_or_else(|| Error::Internal {
            what: "the head's backward asked for dh gave none".into(),
        })?;
        Ok((dh, share))
    }
}
