//! A model's run of transformer blocks on its layout, written once over any block
//! ([`BlockOn`]; a [`Checkpointed`](crate::nn::Checkpointed) one keeps only its input): the
//! forward, keeping each block's saved state, and the backward.

use crate::error::{Error, Result};
use crate::nn::{Act, BlockOn, HeadsCore, Layout};
use crate::store::{BackwardPass, ForwardPass};

/// A run's shape: `[batch, seq]` of the micro-batch and the attention's core.
#[derive(Clone, Copy)]
pub(super) struct Shape<'a> {
    pub(super) batch_seq: [usize; 2],
    pub(super) core: Option<&'a dyn HeadsCore>,
}

/// The blocks from `x`, keeping each block's saved state when `keep` (not in an evaluation
/// forward).
pub(super) fn forward<L: Layout, B: BlockOn<L>>(
    blocks: &[B],
    fwd: &ForwardPass<'_>,
    mut x: Act,
    shape: Shape<'_>,
    keep: bool,
) -> Result<(Act, Vec<B::Saved>)> {
    let mut kept = Vec::with_capacity(if keep { blocks.len() } else { 0 });
    for block in blocks {
        let (out, saved) = block.forward(fwd, &x, shape.batch_seq, shape.core)?;
        if keep {
            kept.push(saved);
        }
        x = out;
    }
    Ok((x, kept))
}

/// The backward of [`forward`] from `dx`, the last block first.
pub(super) fn backward<L: Layout, B: BlockOn<L>>(
    blocks: &[B],
    bwd: &mut BackwardPass<'_>,
    mut kept: Vec<B::Saved>,
    mut dx: Act,
    shape: Shape<'_>,
) -> Result<Act> {
    for block in blocks.iter().rev() {
        let saved = kept.pop().ok_or_else(|| Error::SavedMismatch {
            layer: "a transformer block (its saved state is gone)".into(),
        })?;
        dx = block.backward(bwd, &saved, &dx, shape.core)?;
    }
    Ok(dx)
}
