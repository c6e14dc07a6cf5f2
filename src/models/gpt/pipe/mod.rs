//! GPT-2 split into pipeline stages ([`crate::parallel::pipeline`]): a stage holds a run of
//! blocks, the first stage also the embedding and the last `ln_f` and the head. `wte` is used
//! at both ends, so the first and the last stage each hold a copy: their shares of its
//! gradient are summed in f32 through the step's micro-batches, apart from its slot, swapped
//! between the two stages at the end of the backward pass and added in one order on both, so
//! the two copies stay bit for bit the same. Within a stage the blocks may be split over a 1D
//! tensor group or a 2D, 2.5D or 3D grid, and the positions over a sequence ring; the ends are
//! then split over the tensor group too ([`EndsLayout::Split`](super::EndsLayout): the vocab-parallel `wte`, tied
//! on the last stage to the vocab-parallel head, each tensor rank swapping its shard's
//! gradient with the same tensor rank of the other end) or whole on every rank
//! (`EndsLayout::Whole`).

mod step;
mod stream;
mod train;

pub use self::stream::train_two_bw_stream;
pub(super) use self::train::pipeline_step;
use super::{Gpt, ModelEnds, Variant};
use crate::nn::Layout;
use crate::tensor::TensorId;

impl<P: Layout, V: Variant> Gpt<P, V> {
    /// This stage's copy of a weight both ends use (GPT-2's `wte`), in a pipeline.
    fn tie(&self) -> Option<TensorId> {
        (self.stages > 1).then(|| self.ends.tied()).flatten()
    }
}
