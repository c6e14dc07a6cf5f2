//! The ends of a model on the 3D cube (arXiv 2105.14450) of [`three_d`](super::three_d): the
//! embeddings that make the first activation tile and the classifiers that end in the loss,
//! each taking a [`Layout3D`](super::Layout3D) at registration, the layout of its activation tile (rows
//! `(i·q + a)·R/q² ..`, `R/q²` of them, and columns `c·C/q ..`, with `(a, c)` the rank's
//! coordinates on the layout's axes: `(j, k)` for [`Layout3D::RowsJColsK`](super::Layout3D::RowsJColsK), `(k, j)` for
//! [`Layout3D::RowsKColsJ`](super::Layout3D::RowsKColsJ)). `A` is the group along `a` (ranked by `a`), `Wg` the weight group
//! ([`ProcessGrid::weight`], ranked by `i`), `n = R/q²`.
//!
//! # Embedding3D
//!
//! A table `[rows, C]` (positions, or a vocabulary that is not split by vocabulary): rank
//! `(i, j, k)` registers `{name}.weight` `[rows/q, C/q]`, the table's row piece `i` and
//! column block `c`, the same on the `q` ranks along `a` (norm share `1/q`). Forward
//! all-gathers it over `Wg` (`[rows, C/q]`, column block `c`) and looks up the ids of the
//! tile's rows: the tile `[n, C/q]` in the layout. Backward: the table's gradient
//! `[rows, C/q]` from the tile's rows, a reduce-scatter over `Wg` (`[rows/q, C/q]`) and an
//! all-reduce over `A` (the other row blocks), into the slot.
//!
//! # VocabEmbedding3D
//!
//! The token embedding with the vocabulary split, tied to the LM head: its weight is exactly
//! the [`Linear3D`](super::Linear3D) shard of the master `wte` `[V, C]` (outputs `V`, inputs `C`) for input
//! layout `L`: `{name}.weight` `[C/q², V/q]`, element `(r, s)` = `wte[a·V/q + s, c·C/q +
//! i·C/q² + r]`, so [`Classifier3D::tied`] is [`Linear3D`](super::Linear3D)'s algorithm on the same tensor.
//! `V` must split by `q` and `C` by `q²`: pad the vocabulary (GPT-2's 50257 tokens to 50304,
//! the padding rows never looked up and, as classes, never a target).
//!
//! - forward: `W̃ = all-gather_Wg(W)` `[C/q, V/q]` (`wte[vocab block a, C block c]ᵀ`),
//!   transposed to `[V/q, C/q]`; a masked lookup
//!   ([`vocab_embedding_forward`](crate::ops::vocab_embedding_forward), the tokens
//!   `a·V/q ..` of the vocabulary) of the `q·n` rows of row block `i`, a partial sum over the
//!   vocabulary blocks; `reduce-scatter_A` completes the sum and keeps the rows of sub-block
//!   `i·q + a`: the tile in `L`.
//! - backward: `all-gather_A(dtile)` `[q·n, C/q]`; the lookup's backward into `[V/q, C/q]`,
//!   transposed to `[C/q, V/q]`; `reduce-scatter_Wg` (the other row blocks) gives the shard
//!   `[C/q², V/q]`, added through
//!   [`Guard::accumulate_grad`](crate::store::Guard::accumulate_grad) (the head adds the other
//!   share).
//!
//! # Classifier3D
//!
//! `logits = h·Mᵀ (+ b)` by [`Linear3D`](super::Linear3D) on an input tile in `L`, so the logits are in
//! `L.swapped()`: rows `(i·q + c)·n ..`, classes block `a`. The ranks holding the other classes
//! of those rows are `A`: [`ShardedCrossEntropy`](super::ShardedCrossEntropy) over `A` (the classes `a·classes/q ..`) gives
//! each rank the sum of its tile rows' losses and the logits' gradient; the ranks with `a = 0`
//! add theirs over [`ProcessGrid::tensor`] (one f64 all-reduce) and every rank divides by the
//! rows counted in the whole batch (targets not the ignore index): the mean loss, the same on
//! every rank of the cube. The gradient is scaled by `loss_scale / count`. Backward is
//! [`Linear3D`](super::Linear3D)'s, giving `dh` in `L`; a classifier tied to a [`VocabEmbedding3D`]
//! ([`Classifier3D::tied`]) adds its weight share with
//! [`Linear3D::backward_with`](super::Linear3D::backward_with) and [`WeightUse::Shared`](crate::nn::WeightUse::Shared).
//!
//! Every layer checks on the host, on every rank and before any collective, that the grid is
//! 3D and that the dimensions split (a typed [`Error::NotSplit`] naming the dimension), and
//! gives its collectives by group ([`Cost`](super::Cost)).
//!
//! ```
//! use tidemem::chunk::{ChunkManager, ManagerConfig};
//! use tidemem::comm::Communicator;
//! use tidemem::device::{Device, SimConfig};
//! use tidemem::parallel::{Classifier3D, GridSpec, Layout3D, ProcessGrid, TensorMode};
//! use tidemem::parallel::VocabEmbedding3D;
//! use tidemem::store::ParamStore;
//! use tidemem::tensor::Init;
//! use tidemem::tide::Policy;
//! use tidemem::DType;
//! # fn main() -> tidemem::Result<()> {
//! // a cube of one rank: the layers are the serial ones
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let comm = Communicator::local(vec![dev.clone()])?.remove(0);
//! let spec = GridSpec { data: 1, pipeline: 1, sequence: 1, tensor: TensorMode::ThreeD { q: 1 } };
//! let grid = ProcessGrid::new(&comm, spec)?;
//! let mut cfg = ManagerConfig::new(1024, Policy::Tide);
//! cfg.param_dtype = DType::F32;
//! let mut m = ChunkManager::new(dev, cfg)?;
//! // wte [3 tokens, 2 channels] = [[1, 0], [0, 1], [1, 1]]
//! let wte = Init::Fn(std::sync::Arc::new(|e| [1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0][e]));
//! let lay = Layout3D::RowsJColsK;
//! let emb = VocabEmbedding3D::register(&mut m, &grid, "wte", 3, 2, lay, &wte)?;
//! let head = Classifier3D::tied(&m, &emb, -100)?;
//! let fwd = m.forward()?;
//! let (h, emb_saved) = emb.forward(&fwd, &grid, &[2, 0])?;
//! assert_eq!(h.to_f32(fwd.stream())?, [1.0, 1.0, 1.0, 0.0]);
//! // logits [[1, 1, 2], [1, 0, 1]]; the second row is ignored
//! let (loss, head_saved) = head.forward(&fwd, &grid, &h, &[2, -100], 1.0)?;
//! let want = (2.0f32.exp() + 2.0 * 1.0f32.exp()).ln() - 2.0;
//! assert!((loss - want).abs() < 1e-6);
//! fwd.finish()?;
//! let bwd = m.backward()?;
//! let dh = head.backward(&bwd, &grid, &head_saved)?;
//! assert_eq!(dh.shape(), [2, 2]);
//! emb.backward(&bwd, &grid, &emb_saved, &dh)?;
//! bwd.finish()?;
//! assert_eq!(m.read(emb.weight)?.len(), 6);
//! # Ok(()) }
//! ```

mod classifier;
mod embedding;

pub use classifier::{Classifier3D, Classifier3DSaved};
pub use embedding::{Embedding3D, Embedding3DSaved, VocabEmbedding3D, VocabEmbedding3DSaved};

use super::grid::ProcessGrid;
use super::three_d::Place3D;
use crate::error::{Error, Result};

/// This rank's place on `grid`, which must be `registered` (where the layer was registered).
fn here(grid: &ProcessGrid, registered: Place3D) -> Result<Place3D> {
    let place = Place3D::of(grid)?;
    if place != registered {
        return Err(Error::WrongPlace {
            what: "a 3D layer",
            registered: format!("at {registered:?}"),
            run: format!("at {place:?}"),
        });
    }
    Ok(place)
}

/// The first id of `ids` outside `0..n`, as [`Error::TokenOutOfRange`].
fn check_ids(ids: &[i32], n: usize) -> Result<()> {
    match ids.iter().position(|&t| t < 0 || t as usize >= n) {
        None => Ok(()),
        Some(p) => Err(Error::TokenOutOfRange {
            token: ids[p].into(),
            position: p,
            vocab: n,
        }),
    }
}
