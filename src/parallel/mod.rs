//! Tensor parallelism on the memory layer: a process grid over a [`Communicator`]
//! ([`ProcessGrid`]: data × pipeline × tensor groups, the tensor mode 1D, 2D, 2.5D or 3D) and
//! layers whose weight shards are tensors of the rank's store, fetched, placed and stepped like
//! any other: [`one_d`](crate::parallel::OneD) (Megatron's column- and row-parallel linears, the embedding split along
//! the channels and the GPT-2 block; [`vocab`](crate::parallel::VocabEmbedding1D): the vocabulary split, for the embedding and the
//! tied head with the cross-entropy), [`two_d`](crate::parallel::Linear2D) (the SUMMA linear on a q×q grid and its 2.5D
//! form with the batch split over depth; [`Summa`]: the GPT-2 block on it, with the grid
//! LayerNorm that 2D and 3D share, [`LayerNorm2D`] and [`LayerNorm3D`];
//! [`two_d_ends`](crate::parallel::Embedding2D): their embeddings, the vocab-parallel one tied to the head, and the
//! classifier with the cross-entropy), [`three_d`](crate::parallel::Linear3D) (the linear on a q³ cube),
//! [`Cube`] (the GPT-2 block on the cube), [`three_d_ends`](crate::parallel::Embedding3D)
//! (the embeddings, the vocab-parallel tied LM head and the classifiers on the cube).
//!
//! [`Communicator`]: crate::comm::Communicator

mod cost;
mod cross_entropy;
pub(crate) mod ends;
mod grid;
mod grid_norm;
pub(crate) mod one_d;
mod placement;
pub(crate) mod sequence;
pub(crate) mod three_d;
pub(crate) mod three_d_ends;
pub(crate) mod two_d;
pub(crate) mod two_d_block;
pub(crate) mod two_d_ends;
pub(crate) mod vocab;

pub use cost::{Cost, PassCost};
pub use cross_entropy::{BatchRows, ShardedCrossEntropy};
pub use ends::{GridClassifier, GridLookup, GridNorm, NormHead, TokenPosition};
pub use grid::{GridSpec, ProcessGrid, TensorMode};
pub use grid_norm::{GridNormSaved, LayerNorm2D, LayerNorm3D};
pub use one_d::{ColumnLinear, Embedding1D, Embedding1DSaved, RowLinear, Shard};
pub use placement::{Cube, Linear1D, OneD, Placement, Summa};
pub use sequence::{RingAttention, RingAttentionSaved, RingCore};
pub use three_d::{gather_3d, split_3d, Layout3D, Linear3D, Linear3DSaved, Place3D, Tile};
pub use three_d_ends::{
    Classifier3D, Classifier3DSaved, Embedding3D, Embedding3DSaved, VocabEmbedding3D,
    VocabEmbedding3DSaved,
};
pub use two_d::{
    gather_batch_2d, split_batch_2d, split_batch_2d_act, BatchBlock, Linear2D, Linear2p5D,
};
pub use two_d_block::{Place2D, SummaLinear};
pub use two_d_ends::{
    Classifier2D, Classifier2DSaved, Embedding2D, Embedding2DSaved, VocabEmbedding2D,
    VocabEmbedding2DSaved,
};
pub use vocab::{
    Classifier1D, Classifier1DSaved, VocabEmbedding1D, VocabEmbedding1DSaved, VocabHead1D,
    VocabHead1DSaved,
};
pub mod pipeline;

/// `n / parts`, or [`Error::NotSplit`](crate::Error::NotSplit) naming `layer`'s dimension
/// `what` (`n`) and the parts it must split into (`parts`, counted `by`).
pub(crate) fn split(
    layer: &str,
    what: &'static str,
    n: usize,
    parts: usize,
    by: &'static str,
) -> crate::Result<usize> {
    if n == 0 || parts == 0 || !n.is_multiple_of(parts) {
        return Err(crate::Error::NotSplit {
            layer: layer.to_string(),
            what,
            value: n,
            parts,
            by,
        });
    }
    Ok(n / parts)
}
