//! GPT-2 on the 2D, 2.5D and 3D tensor-parallel blocks.

use super::blocks::{Blocks, Keep, On, Shape, StageSplit};
use super::grid_ends::{EndsLayout, GridEnds};
use super::model::{default_init, GptBatch, RunOptions};
use super::train::{micro_steps, TrainStep};
use super::GptConfig;
use crate::error::{Error, Result};
use crate::nn::{Act, HeadsCore, Loss};
use crate::parallel::{ProcessGrid, RingAttention, RingCore, TensorMode};
use crate::store::ParamStore;

/// GPT-2 split over a 2D, 2.5D or 3D tensor-parallel grid: the blocks (on the
/// [`Summa`](crate::parallel::Summa) or [`Cube`](crate::parallel::Cube) layout) on tiles, and the ends ([`GridEnds`]) split too ([`EndsLayout::Split`]: the
/// vocab-parallel `wte` tied to the vocab-parallel head, `wpe` and `ln_f` in the blocks'
/// layout, so no rank ever holds a whole activation or table) or whole on every rank
/// ([`EndsLayout::Whole`]: the embedding's output cut into tiles, the last tiles gathered).
/// Every rank holds its shards as tensors of its store; replicated parameters count their
/// share of the squared gradient norm ([`ParamStore::set_norm_share`]).
///
/// Each rank's tile must hold whole sequences: the batch must divide by the grid's row blocks
/// (`q` for 2D, `d·q` for 2.5D, `q²` for 3D).
#[derive(Clone, Debug, PartialEq)]
pub struct GptGrid {
    /// The shape.
    pub config: GptConfig,
    /// The blocks' shards.
    pub(super) blocks: Blocks,
    /// The embeddings, `ln_f` and the tied head.
    pub ends: GridEnds,
}

impl GptGrid {
    /// Registers this rank's part of the model on `grid` (a 2D, 2.5D or 3D tensor mode) with
    /// [`Gpt::register`](super::Gpt::register)'s masters for `seed`, so that the split model
    /// computes what the serial one does, the ends split ([`EndsLayout::Split`]). Fails on
    /// another mode or on shapes the layers cannot split (naming the dimension).
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        cfg: &GptConfig,
        seed: u64,
    ) -> Result<GptGrid> {
        GptGrid::register_with(store, grid, cfg, seed, EndsLayout::Split)
    }

    /// [`GptGrid::register`] with the ends as `ends` says.
    pub fn register_with(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        cfg: &GptConfig,
        seed: u64,
        ends: EndsLayout,
    ) -> Result<GptGrid> {
        cfg.validate()?;
        let mode = grid.spec().tensor;
        let init = |name: &str| default_init(cfg, name, seed);
        if !matches!(
            mode,
            TensorMode::TwoD { .. } | TensorMode::TwoHalfD { .. } | TensorMode::ThreeD { .. }
        ) {
            return Err(Error::InvalidArgument(format!(
                "GptGrid runs on a 2D, 2.5D or 3D grid; this one is {mode}"
            )));
        }
        let ends = GridEnds::register(store, grid, cfg, seed, ends)?;
        let layers = 0..cfg.layers;
        let blocks = Blocks::register(store, cfg, layers, StageSplit::Grid(grid), &init)?;
        Ok(GptGrid {
            config: cfg.clone(),
            blocks,
            ends,
        })
    }

    /// One iteration's forward and backward on `b` (the same batch on every rank of the
    /// grid's tensor group): the gradients of this rank's shards and of the whole parameters
    /// written, the loss returned. `opts.loss_scale` scales the loss gradient; with
    /// `opts.checkpoint` each block keeps only its input tile and is recomputed in the backward
    /// pass ([`BackwardPass::recompute`](crate::store::BackwardPass::recompute)), the same bits with fewer activations held. Run
    /// [`ParamStore::step_reducing`] (or [`train_step_grid`]) next.
    pub fn forward_backward<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        grid: &ProcessGrid,
        b: &GptBatch<'_>,
        opts: RunOptions,
    ) -> Result<f32> {
        b.check(&self.config)?;
        opts.check()?;
        let fwd = store.forward()?;
        let first = grid.sequence_rank() * b.seq;
        let (tile, emb) = self
            .ends
            .embed(&fwd, grid, b.tokens, [b.batch, b.seq, first])?;
        let ring = self.ring(grid, &tile, b)?;
        let shape = Shape {
            batch_seq: [b.batch, b.seq],
            core: ring.as_ref().map(|r| r as &dyn HeadsCore),
        };
        let on = On {
            tensor: None,
            grid: Some(grid),
        };
        let keep = match opts.checkpoint {
            true => Keep::Inputs,
            false => Keep::Saved,
        };
        let (tile, kept) = self.blocks.forward(&fwd, on, tile, shape, keep)?;
        let (loss, head) = self
            .ends
            .head_forward(&fwd, grid, &tile, b.targets, opts.loss_scale)?;
        drop(tile);
        fwd.finish()?;
        let mut bwd = store.backward()?;
        let dtile = self.ends.head_backward(&bwd, grid, head)?;
        let dtile = self.blocks.backward(&mut bwd, on, kept, dtile, shape)?;
        self.ends.embed_backward(&bwd, grid, emb, &dtile)?;
        drop(dtile);
        bwd.finish()?;
        Ok(loss)
    }

    /// The sequence ring's attention over this rank's heads and sequences (`tile`'s rows),
    /// when the grid splits the positions.
    fn ring<'g>(
        &self,
        grid: &'g ProcessGrid,
        tile: &Act,
        b: &GptBatch<'_>,
    ) -> Result<Option<RingCore<'g>>> {
        let n = grid.spec().sequence;
        if n == 1 {
            return Ok(None);
        }
        let cfg = &self.config;
        let q = grid.q()?;
        let head_dim = cfg.channels / cfg.heads;
        let seqs = tile.rows() / b.seq.max(1);
        let attn = RingAttention::new(grid.sequence(), seqs, b.seq * n, cfg.heads / q, head_dim)?;
        Ok(Some(RingCore {
            attn,
            group: grid.sequence(),
        }))
    }
}

/// One optimizer step of a [`GptGrid`] over the micro-batches `micro` (as many as the
/// optimizer accumulates, the same on every rank of the tensor group): a forward and backward
/// each (checkpointed with `checkpoint`), then the store's step with the gradient statistics
/// all-reduced over the grid's tensor group (replicated parameters counted once), so every
/// rank clips by the global norm and skips an overflow together. See
/// [`train_step`](super::train_step).
pub fn train_step_grid<S: ParamStore + ?Sized>(
    gpt: &GptGrid,
    store: &mut S,
    grid: &ProcessGrid,
    adam: &mut crate::optim::HybridAdam,
    micro: &[GptBatch<'_>],
    checkpoint: bool,
) -> Result<TrainStep> {
    micro_steps(
        store,
        Some(grid.tensor()),
        adam,
        micro,
        |store, b, loss_scale| {
            let opts = RunOptions {
                checkpoint,
                loss_scale,
            };
            gpt.forward_backward(store, grid, b, opts).map(Loss::ready)
        },
    )
}
