//! GPT-2 on the 2D, 2.5D and 3D tensor-parallel blocks.

use super::model::{default_init, GptBatch, RunOptions, IGNORE_INDEX};
use super::train::{micro_steps, TrainStep};
use super::GptConfig;
use crate::error::{Error, Result};
use crate::nn::{Act, Embedding, LayerNorm, LmHead};
use crate::parallel::{
    gather_3d, gather_batch_2d, split_3d, split_batch_2d_act, Block2D, Block2DSaved, Block3D,
    Block3DSaved, Layout3D, ProcessGrid, TensorMode,
};
use crate::store::{BackwardPass, ForwardPass, ParamStore, Pass, PassKind};
use crate::tensor::TensorId;

/// The blocks of a [`GptGrid`]: one scheme's.
#[derive(Clone, Debug, PartialEq)]
pub enum GridBlocks {
    /// [`Block2D`]s on a 2D or 2.5D grid.
    Summa(Vec<Block2D>),
    /// [`Block3D`]s on a 3D cube, all in one layout.
    Cube(Vec<Block3D>),
}

/// GPT-2 whose blocks are split over a 2D, 2.5D or 3D tensor-parallel grid
/// ([`Block2D`], [`Block3D`]): every rank holds its shards of each block, and the embedding,
/// the final LayerNorm and the tied head whole. The embedding's output is split into the
/// rank's tile of the grid's layout (`split_batch_2d_act`, `split_3d`), the blocks run on tiles,
/// and the last block's tiles are gathered (`gather_batch_2d`, `gather_3d`) for `ln_f` and the
/// head; backward mirrors it. The replicated parameters count `1/T` of their squared gradient
/// norm on each of the `T` ranks.
///
/// Each rank's tile must hold whole sequences: the batch must divide by the grid's row blocks
/// (`q` for 2D, `d·q` for 2.5D, `q²` for 3D).
#[derive(Clone, Debug, PartialEq)]
pub struct GptGrid {
    /// The shape.
    pub config: GptConfig,
    /// `wte` and `wpe`, whole.
    pub embedding: Embedding,
    /// The blocks' shards.
    pub blocks: GridBlocks,
    /// `ln_f`, whole.
    pub ln_f: LayerNorm,
    /// The head over `wte`, whole.
    pub head: LmHead,
}

/// What a block keeps for its backward: its saved tensors, or only its input tile when
/// checkpointing.
enum BlockKept {
    Summa(Box<Block2DSaved>),
    Cube(Box<Block3DSaved>),
    Input(Act),
}

impl GptGrid {
    /// Registers this rank's part of the model on `grid` (a 2D, 2.5D or 3D tensor mode) with
    /// [`Gpt::register`](super::Gpt::register)'s masters for `seed`, so that the split model
    /// computes what the serial one does. Fails on another mode or on shapes the blocks cannot
    /// split.
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        cfg: &GptConfig,
        seed: u64,
    ) -> Result<GptGrid> {
        cfg.validate()?;
        let mode = grid.spec().tensor;
        let init = |name: &str| default_init(cfg, name, seed);
        let c = cfg.channels;
        let wte = store.register("wte.weight", &[cfg.vocab, c], init("wte.weight"))?;
        let wpe = store.register("wpe.weight", &[cfg.max_seq, c], init("wpe.weight"))?;
        let name = |i: usize| format!("h.{i}");
        let blocks = match mode {
            TensorMode::TwoD { .. } | TensorMode::TwoHalfD { .. } => GridBlocks::Summa(
                (0..cfg.layers)
                    .map(|i| Block2D::register(store, grid, &name(i), c, cfg.heads, cfg.eps, &init))
                    .collect::<Result<_>>()?,
            ),
            TensorMode::ThreeD { .. } => GridBlocks::Cube(
                (0..cfg.layers)
                    .map(|i| {
                        let l = Layout3D::RowsJColsK;
                        Block3D::register(store, grid, &name(i), c, cfg.heads, cfg.eps, l, &init)
                    })
                    .collect::<Result<_>>()?,
            ),
            m => {
                return Err(Error::InvalidArgument(format!(
                    "GptGrid runs on a 2D, 2.5D or 3D grid; this one is {m}"
                )))
            }
        };
        let ln_f = LayerNorm {
            gamma: store.register("ln_f.weight", &[c], init("ln_f.weight"))?,
            beta: store.register("ln_f.bias", &[c], init("ln_f.bias"))?,
            cols: c,
            eps: cfg.eps,
        };
        // a 2.5D grid holds every block's shards once in each of its `d` depth slices
        if let (TensorMode::TwoHalfD { depth, .. }, GridBlocks::Summa(v)) = (mode, &blocks) {
            if depth > 1 {
                for id in v.iter().flat_map(Block2D::params) {
                    store.set_norm_share(id, 1.0 / depth as f64)?;
                }
            }
        }
        let share = 1.0 / mode.size() as f64;
        let replicated: [TensorId; 4] = [wte, wpe, ln_f.gamma, ln_f.beta];
        for id in replicated {
            store.set_norm_share(id, share)?;
        }
        let embedding = Embedding {
            wte,
            wpe,
            vocab: cfg.vocab,
            max_seq: cfg.max_seq,
            channels: c,
        };
        Ok(GptGrid {
            config: cfg.clone(),
            embedding,
            blocks,
            ln_f,
            head: LmHead::tied(&*store, wte, IGNORE_INDEX)?,
        })
    }

    /// One iteration's forward and backward on `b` (the same batch on every rank of the
    /// grid's tensor group): the gradients of this rank's shards and of the whole parameters
    /// written, the loss returned. `opts.loss_scale` scales the loss gradient; with
    /// `opts.checkpoint` each block keeps only its input tile and is recomputed in the backward
    /// pass ([`BackwardPass::recompute`]), the same bits with fewer activations held. Run
    /// [`ParamStore::step_reducing`] (or [`train_step_grid`]) next.
    pub fn forward_backward<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        grid: &ProcessGrid,
        b: &GptBatch<'_>,
        opts: RunOptions,
    ) -> Result<f32> {
        b.check(&self.config)?;
        let fwd = store.forward()?;
        let (x, emb) = self.embedding.forward(&fwd, b.tokens, b.batch, b.seq)?;
        let mut tile = self.split(&fwd, grid, &x)?;
        drop(x);
        let mut kept = Vec::new();
        for k in 0..self.layers() {
            let (out, s) = self.block_forward(&fwd, grid, k, &tile, b)?;
            if opts.checkpoint {
                drop(s);
                kept.push(BlockKept::Input(tile));
            } else {
                kept.push(s);
            }
            tile = out;
        }
        let full = self.gather(&fwd, grid, &tile)?;
        drop(tile);
        let (h, ln) = self.ln_f.forward(&fwd, &full, None)?;
        drop(full);
        let (loss, head) = self
            .head
            .forward_scaled(&fwd, &h, b.targets, opts.loss_scale)?;
        drop(h);
        fwd.finish()?;
        let mut bwd = store.backward()?;
        let dh = self.head.backward(&bwd, &head)?;
        drop(head);
        let dfull = self.ln_f.backward(&bwd, &ln, &dh, None)?;
        drop((dh, ln));
        let mut dtile = self.split(&bwd, grid, &dfull)?;
        drop(dfull);
        for k in (0..self.layers()).rev() {
            let s = kept
                .pop()
                .ok_or_else(|| Error::InvalidArgument("a block's saved state is gone".into()))?;
            let s = match s {
                BlockKept::Input(x) => {
                    let re = bwd.recompute()?;
                    let (out, s) = self.block_forward(&re, grid, k, &x, b)?;
                    drop((out, x));
                    re.finish()?;
                    s
                }
                saved => saved,
            };
            dtile = self.block_backward(&bwd, grid, k, &s, &dtile)?;
        }
        let dx = self.gather(&bwd, grid, &dtile)?;
        drop(dtile);
        self.embedding.backward(&bwd, &emb, &dx)?;
        drop((dx, emb));
        bwd.finish()?;
        Ok(loss)
    }

    fn layers(&self) -> usize {
        match &self.blocks {
            GridBlocks::Summa(v) => v.len(),
            GridBlocks::Cube(v) => v.len(),
        }
    }

    /// This rank's tile of a whole `[N, C]` activation (no collective).
    fn split<K: PassKind>(
        &self,
        pass: &Pass<'_, K>,
        grid: &ProcessGrid,
        full: &Act,
    ) -> Result<Act> {
        match &self.blocks {
            GridBlocks::Summa(_) => split_batch_2d_act(pass.pool(), pass.stream(), grid, full),
            GridBlocks::Cube(_) => split_3d(pass, grid, Layout3D::RowsJColsK, full),
        }
    }

    /// The whole `[N, C]` activation from every rank's tile.
    fn gather<K: PassKind>(
        &self,
        pass: &Pass<'_, K>,
        grid: &ProcessGrid,
        tile: &Act,
    ) -> Result<Act> {
        match &self.blocks {
            GridBlocks::Summa(_) => gather_batch_2d(pass.pool(), pass.stream(), grid, tile),
            GridBlocks::Cube(_) => gather_3d(pass, grid, Layout3D::RowsJColsK, tile),
        }
    }

    fn block_forward(
        &self,
        fwd: &ForwardPass<'_>,
        grid: &ProcessGrid,
        k: usize,
        x: &Act,
        b: &GptBatch<'_>,
    ) -> Result<(Act, BlockKept)> {
        match &self.blocks {
            GridBlocks::Summa(v) => {
                let (y, s) = v[k].forward(fwd, grid, x, b.seq)?;
                Ok((y, BlockKept::Summa(Box::new(s))))
            }
            GridBlocks::Cube(v) => {
                let (y, s) = v[k].forward(fwd, grid, x, b.batch, b.seq)?;
                Ok((y, BlockKept::Cube(Box::new(s))))
            }
        }
    }

    fn block_backward(
        &self,
        bwd: &BackwardPass<'_>,
        grid: &ProcessGrid,
        k: usize,
        saved: &BlockKept,
        dy: &Act,
    ) -> Result<Act> {
        match (&self.blocks, saved) {
            (GridBlocks::Summa(v), BlockKept::Summa(s)) => v[k].backward(bwd, grid, s, dy),
            (GridBlocks::Cube(v), BlockKept::Cube(s)) => v[k].backward(bwd, grid, s, dy),
            _ => Err(Error::InvalidArgument(
                "a block's saved state of the other kind".into(),
            )),
        }
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
            gpt.forward_backward(store, grid, b, opts)
        },
    )
}
