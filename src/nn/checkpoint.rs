//! Activation checkpointing as a wrapper layer: [`Checkpointed`].

use super::act::Act;
use super::attention::HeadsCore;
use super::block::BlockOn;
use super::layout::Layout;
use crate::error::Result;
use crate::store::{BackwardPass, ForwardPass};
use crate::tensor::TensorId;

/// A block run with activation checkpointing: its forward keeps only its input, and its
/// backward first recomputes the forward in a [`recompute`](BackwardPass::recompute) pass
/// (which writes no gradient), then runs the block's backward. The same bits as the block
/// itself, with one block's activations held at a time in the backward instead of every
/// block's from the forward on.
///
/// ```
/// use tidemem::nn::{Act, Block, BlockOn, Checkpointed, Serial};
/// use tidemem::prelude::*;
///
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 22))?;
/// let mut cfg = ManagerConfig::new(256, Policy::Tide);
/// cfg.param_dtype = DType::F32;
/// let mut m = ChunkManager::new(dev, cfg)?;
/// let init = |name: &str| Block::default_init(name, 8);
/// let block = Block::register(&mut m, Serial, "h.0", [8, 2], 1e-5, &init)?;
/// let ck = Checkpointed(&block);
///
/// let fwd = m.forward()?;
/// let x = Act::upload(fwd.pool(), fwd.stream(), 6, 8, DType::F32, &[0.5; 48])?;
/// let (_, saved) = ck.forward(&fwd, &x, [2, 3], None)?; // keeps x only
/// fwd.finish()?;
///
/// let mut bwd = m.backward()?;
/// let dout = Act::upload(bwd.pool(), bwd.stream(), 6, 8, DType::F32, &[1.0; 48])?;
/// let dx = ck.backward(&mut bwd, &saved, &dout, None)?; // recomputes, then the backward
/// assert_eq!(dx.shape(), [6, 8]);
/// bwd.finish()?;
/// assert_eq!(m.read(block.mlp_proj.bias.unwrap())?, vec![6.0; 8]);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Checkpointed<'b, B>(pub &'b B);

/// What a [`Checkpointed`] block keeps: its input and the run's `[batch, seq]`.
#[derive(Debug)]
pub struct CheckpointSaved {
    x: Act,
    batch_seq: [usize; 2],
}

impl<L: Layout, B: BlockOn<L>> BlockOn<L> for Checkpointed<'_, B> {
    type Saved = CheckpointSaved;

    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        batch_seq: [usize; 2],
        core: Option<&dyn HeadsCore>,
    ) -> Result<(Act, CheckpointSaved)> {
        let (out, saved) = self.0.forward(pass, x, batch_seq, core)?;
        drop(saved);
        let x = x.clone();
        Ok((out, CheckpointSaved { x, batch_seq }))
    }

    fn backward(
        &self,
        pass: &mut BackwardPass<'_>,
        saved: &CheckpointSaved,
        dout: &Act,
        core: Option<&dyn HeadsCore>,
    ) -> Result<Act> {
        let re = pass.recompute()?;
        let (out, kept) = self.0.forward(&re, &saved.x, saved.batch_seq, core)?;
        drop(out);
        re.finish()?;
        self.0.backward(pass, &kept, dout, core)
    }

    fn params(&self) -> Vec<TensorId> {
        self.0.params()
    }
}
