//! A model's run of transformer blocks on its layout, written once: the forward (keeping
//! each block's saved state, or only its input when checkpointing) and the backward
//! (recomputing a checkpointed block first).

use crate::error::{Error, Result};
use crate::nn::{Act, BlockOn, HeadsCore, Layout};
use crate::store::{BackwardPass, ForwardPass};

/// What a forward keeps of a block for its backward: its saved state, or only its input when
/// checkpointing.
pub(super) enum BlockKept<S> {
    Saved(Box<S>),
    Input(Act),
}

/// How a forward keeps what the backward needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Keep {
    /// Nothing (an evaluation forward).
    Nothing,
    /// Every block's saved state.
    Saved,
    /// Only every block's input: the backward recomputes the block.
    Inputs,
}

/// A run's shape: `[batch, seq]` of the micro-batch and the attention's core.
#[derive(Clone, Copy)]
pub(super) struct Shape<'a> {
    pub(super) batch_seq: [usize; 2],
    pub(super) core: Option<&'a dyn HeadsCore>,
}

/// The blocks from `x`, keeping what `keep` says.
pub(super) fn forward<L: Layout, B: BlockOn<L>>(
    blocks: &[B],
    fwd: &ForwardPass<'_>,
    mut x: Act,
    shape: Shape<'_>,
    keep: Keep,
) -> Result<(Act, Vec<BlockKept<B::Saved>>)> {
    let mut kept = Vec::with_capacity(blocks.len());
    for block in blocks {
        let (out, saved) = block.forward(fwd, &x, shape.batch_seq, shape.core)?;
        match keep {
            Keep::Saved => kept.push(BlockKept::Saved(Box::new(saved))),
            Keep::Inputs => {
                drop(saved);
                kept.push(BlockKept::Input(x));
            }
            Keep::Nothing => {}
        }
        x = out;
    }
    Ok((x, kept))
}

/// Fewer saved states than blocks: the state of other blocks.
fn gone() -> Error {
    Error::SavedMismatch {
        layer: "a GPT block (its saved state is gone)".into(),
    }
}

/// The backward of [`forward`] from `dx`, recomputing checkpointed blocks.
pub(super) fn backward<L: Layout, B: BlockOn<L>>(
    blocks: &[B],
    bwd: &mut BackwardPass<'_>,
    mut kept: Vec<BlockKept<B::Saved>>,
    mut dx: Act,
    shape: Shape<'_>,
) -> Result<Act> {
    for block in blocks.iter().rev() {
        let saved = match kept.pop().ok_or_else(gone)? {
            BlockKept::Saved(s) => *s,
            BlockKept::Input(x) => {
                let re = bwd.recompute()?;
                let (out, s) = block.forward(&re, &x, shape.batch_seq, shape.core)?;
                drop(out);
                re.finish()?;
                s
            }
        };
        dx = block.backward(bwd, &saved, &dx, shape.core)?;
    }
    Ok(dx)
}

/// [`backward`] of a forward that kept every block's saved state.
pub(super) fn backward_saved<L: Layout, B: BlockOn<L>>(
    blocks: &[B],
    bwd: &BackwardPass<'_>,
    mut kept: Vec<BlockKept<B::Saved>>,
    mut dx: Act,
    shape: Shape<'_>,
) -> Result<Act> {
    for block in blocks.iter().rev() {
        let BlockKept::Saved(saved) = kept.pop().ok_or_else(gone)? else {
            return Err(Error::Internal {
                what: "a checkpointed block's backward without its recompute".into(),
            });
        };
        dx = block.backward(bwd, &saved, &dx, shape.core)?;
    }
    Ok(dx)
}
