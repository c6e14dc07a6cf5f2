//! Tensor parallelism on the memory layer: a process grid over a [`Communicator`]
//! ([`ProcessGrid`]: data × pipeline × tensor groups, the tensor mode 1D, 2D, 2.5D or 3D) and
//! layers whose weight shards are tensors of the rank's store, fetched, placed and stepped like
//! any other: [`one_d`] (Megatron's column- and row-parallel linears, the embedding split along
//! the channels and the GPT-2 block; [`vocab`]: the vocabulary split, for the embedding and the
//! tied head with the cross-entropy), [`two_d`] (the SUMMA linear on a q×q grid and its 2.5D
//! form with the batch split over depth; [`two_d_block`]: their LayerNorm and the GPT-2 block;
//! [`two_d_ends`]: their embeddings, the vocab-parallel one tied to the head, and the
//! classifier with the cross-entropy), [`three_d`] (the linear on a q³ cube),
//! [`three_d_block`] (its LayerNorm and the GPT-2 block on the cube) and [`three_d_ends`]
//! (the embeddings, the vocab-parallel tied LM head and the classifiers on the cube).
//!
//! [`Communicator`]: crate::comm::Communicator

mod cost;
mod cross_entropy;
mod grid;
pub mod one_d;
pub mod sequence;
pub mod three_d;
pub mod three_d_block;
pub mod three_d_ends;
pub mod two_d;
pub mod two_d_block;
pub mod two_d_ends;
pub mod vocab;

pub use cost::{Cost, PassCost};
pub use cross_entropy::{BatchRows, ShardedCrossEntropy};
pub use grid::{GridSpec, ProcessGrid, TensorMode};
pub use one_d::{ColumnLinear, Emb1DSaved, Embedding1D, Linear1D, OneD, RowLinear, Shard};
pub use sequence::{RingAttention, RingCore, RingSaved};
pub use three_d::{gather_3d, split_3d, Layout3D, Linear3D, Place3D, Saved3D, Tile};
pub use three_d_block::{Cube, LayerNorm3D, Ln3DSaved};
pub use three_d_ends::{
    Classifier3D, Classifier3DSaved, Emb3DSaved, Embedding3D, VocabEmb3DSaved, VocabEmbedding3D,
};
pub use two_d::{
    gather_batch_2d, split_batch_2d, split_batch_2d_act, BatchBlock, Linear2D, Linear2p5D,
};
pub use two_d_block::{LayerNorm2D, Ln2DSaved, Place2D, Summa, SummaLinear};
pub use two_d_ends::{
    Classifier2D, Cls2DSaved, Emb2DSaved, Embedding2D, VocabEmb2DSaved, VocabEmbedding2D,
};
pub use vocab::{
    Classifier1D, Cls1DSaved, VocabEmbSaved, VocabEmbedding1D, VocabHead1D, VocabHeadSaved,
};
pub mod pipeline;
pub use pipeline::{PipeOp, PipelineStage, Schedule, StageModel};
