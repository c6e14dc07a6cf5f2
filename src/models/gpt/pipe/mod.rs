//! GPT-2 split into pipeline stages ([`crate::parallel::pipeline`]): a stage holds a run of
//! blocks, the first stage also the embedding and the last `ln_f` and the head. `wte` is used
//! at both ends, so the first and the last stage each hold a copy: their shares of its
//! gradient are summed in f32 through the step's micro-batches, apart from its slot, swapped
//! between the two stages at the end of the backward pass and added in one order on both, so
//! the two copies stay bit for bit the same. Within a stage the blocks may be split over a 1D
//! tensor group or a 2D, 2.5D or 3D grid, and the positions over a sequence ring; the ends are
//! then split over the tensor group too ([`EndsLayout::Split`]: the vocab-parallel `wte`, tied
//! on the last stage to the vocab-parallel head, each tensor rank swapping its shard's
//! gradient with the same tensor rank of the other end) or whole on every rank
//! ([`EndsLayout::Whole`]).

mod step;
mod stream;
mod train;

use std::ops::Range;

pub use self::stream::train_two_bw_stream;
pub use self::train::train_step_pipe;
use super::blocks::{Blocks, StageSplit};
use super::grid_ends::EndsLayout;
use super::model::{default_init, GptBatch, IGNORE_INDEX};
use super::split_ends::{check_splits, wte_norm_share, Place, SplitEmbedding, SplitHead};
use super::GptConfig;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::nn::{Embedding, LayerNorm, LmHead, WeightUse};
use crate::parallel::pipeline::partition;
use crate::parallel::{BatchBlock, Layout3D, Place3D, ProcessGrid, Shard};
use crate::store::ParamStore;
use crate::tensor::TensorId;

/// One pipeline stage of a GPT-2: a run of blocks, the embedding on the first stage, `ln_f`
/// and the head on the last, each end with its copy of `wte` (see [`train_step_pipe`]).
#[derive(Clone, Debug, PartialEq)]
pub struct GptStage {
    /// The whole model's shape.
    pub config: GptConfig,
    /// This stage.
    pub stage: usize,
    /// Stages in the pipeline.
    pub stages: usize,
    /// The blocks this stage holds (their indices in the model).
    pub layers: Range<usize>,
    /// Those blocks (their linears write gradient shares: a stage runs each once per
    /// micro-batch).
    pub(super) blocks: Blocks,
    /// `wte` and `wpe`, on the first stage.
    pub embedding: Option<StageEmbedding>,
    /// `ln_f` and the head over the last stage's copy of `wte`, on the last stage.
    pub head: Option<StageHead>,
    /// The 1D tensor-parallel place of the blocks, if split that way.
    pub tensor: Option<Shard>,
}

/// The first stage's end: `wte` and `wpe`.
#[derive(Clone, Debug, PartialEq)]
pub enum StageEmbedding {
    /// Whole on every rank (on a grid, its output cut into the rank's tile).
    Whole(Embedding),
    /// Split over the stage's tensor group ([`EndsLayout::Split`]).
    Split(SplitEmbedding),
}

/// The last stage's end: `ln_f` and the head over the stage's copy of `wte`.
#[derive(Clone, Debug, PartialEq)]
pub enum StageHead {
    /// Whole on every rank (on a grid, the last tiles gathered for them).
    Whole {
        /// `ln_f`.
        ln_f: LayerNorm,
        /// The head over the stage's copy of `wte`.
        head: LmHead,
    },
    /// Split over the stage's tensor group ([`EndsLayout::Split`]).
    Split(SplitHead),
}

/// The groups one stage's step runs over.
#[derive(Clone, Copy, Debug)]
pub struct StageGroups<'a> {
    /// The stages, ranked by stage.
    pub pipeline: &'a Communicator,
    /// The tensor-parallel group of the blocks (as registered), if any.
    pub tensor: Option<&'a Communicator>,
    /// The sequence ring, if the positions are split.
    pub sequence: Option<&'a Communicator>,
    /// The grid, for blocks on a 2D, 2.5D or 3D scheme.
    pub grid: Option<&'a ProcessGrid>,
}

/// Parameters of each block and of the two ends, for a balanced partition.
fn block_params(cfg: &GptConfig) -> (u64, u64, u64) {
    let c = cfg.channels as u64;
    let block = 12 * c * c + 13 * c;
    let first = (cfg.vocab as u64 + cfg.max_seq as u64) * c;
    let last = cfg.vocab as u64 * c + 2 * c;
    (block, first, last)
}

impl GptStage {
    /// The blocks of each of `stages` stages, balanced by parameters (the embedding counted on
    /// the first, `ln_f` and the head on the last). Fails when there are fewer blocks than
    /// stages.
    pub fn balanced(cfg: &GptConfig, stages: usize) -> Result<Vec<Range<usize>>> {
        let (block, first, last) = block_params(cfg);
        let p = partition(&vec![block; cfg.layers], first, last, stages)?;
        Ok(p.stages)
    }

    /// Registers stage `stage` of `stages`, holding blocks `layers`, with
    /// [`Gpt::register`](super::Gpt::register)'s masters for `seed` (the blocks split as
    /// `split` says): the first stage also registers `wte` and `wpe`, the last `ln_f` and its
    /// own copy of `wte`. The ends are split over the tensor group ([`EndsLayout::Split`], see
    /// [`GptStage::register_with`]; whole without one). Replicated parameters count their share
    /// of the squared gradient norm (`1/T` over the tensor group, `1/2` for `wte`'s two copies,
    /// `1/d` for a 2.5D grid's depth replicas).
    pub fn register(
        store: &mut impl ParamStore,
        cfg: &GptConfig,
        seed: u64,
        (stage, stages): (usize, usize),
        layers: Range<usize>,
        split: StageSplit<'_>,
    ) -> Result<GptStage> {
        let ends = EndsLayout::Split;
        GptStage::register_with(store, cfg, seed, (stage, stages), layers, split, ends)
    }

    /// [`GptStage::register`] with the ends as `ends` says: [`EndsLayout::Split`] over the
    /// tensor group (on a 1D group, `wte`'s rows split and `wpe`, `ln_f` whole; on a grid,
    /// `wte` by vocabulary and channels, `wpe` and `ln_f` in the blocks' layout), or
    /// [`EndsLayout::Whole`] on every rank. Without a tensor group (`StageSplit::None`) the
    /// ends are whole either way. Split ends on a grid need the vocabulary and the positions to
    /// split by `q` and the channels by `q²` (pad the vocabulary, as GPT-2's 50257 to 50304):
    /// every stage fails otherwise, before registering anything.
    pub fn register_with(
        store: &mut impl ParamStore,
        cfg: &GptConfig,
        seed: u64,
        (stage, stages): (usize, usize),
        layers: Range<usize>,
        split: StageSplit<'_>,
        ends: EndsLayout,
    ) -> Result<GptStage> {
        let tensor = match split {
            StageSplit::OneD(s) => Some(s),
            _ => None,
        };
        cfg.validate()?;
        if stage >= stages || layers.end > cfg.layers || layers.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "stage {stage} of {stages} with blocks {layers:?} of {}",
                cfg.layers
            )));
        }
        let place = match (ends, split) {
            (EndsLayout::Whole, _) | (_, StageSplit::None) => None,
            (EndsLayout::Split, StageSplit::OneD(s)) => Some(Place::OneD(s)),
            (EndsLayout::Split, StageSplit::Grid(g)) => Some(Place::Grid(g)),
        };
        if let Some(p) = place {
            check_splits(cfg, p)?;
        }
        let init = |name: &str| default_init(cfg, name, seed);
        let (first, last) = (stage == 0, stage + 1 == stages);
        let t = match split {
            StageSplit::None => 1,
            StageSplit::OneD(s) => s.size,
            StageSplit::Grid(g) => g.spec().tensor.size(),
        };
        let replicated = 1.0 / t as f64;
        let copies = if stages > 1 { 2.0 } else { 1.0 };
        let (embedding, blocks, head) = match place {
            None => {
                let ends = (first, last);
                let wte_share = replicated / copies;
                let r = (layers.clone(), split, replicated);
                register_whole(store, cfg, &init, ends, r, wte_share)?
            }
            Some(p) => {
                let e = first
                    .then(|| SplitEmbedding::register(store, cfg, seed, p, WeightUse::Shared))
                    .transpose()?;
                let b = Blocks::register(store, cfg, layers.clone(), split, &init)?.shared();
                let h = last
                    .then(|| SplitHead::register(store, cfg, seed, p, e.as_ref()))
                    .transpose()?;
                // each copy of wte's shard counts its half
                let wte = e.as_ref().map(SplitEmbedding::wte);
                for id in wte.into_iter().chain(h.as_ref().map(SplitHead::wte)) {
                    store.set_norm_share(id, wte_norm_share(p) / copies)?;
                }
                (e.map(StageEmbedding::Split), b, h.map(StageHead::Split))
            }
        };
        Ok(GptStage {
            config: cfg.clone(),
            stage,
            stages,
            layers,
            blocks,
            embedding,
            head,
            tensor,
        })
    }

    /// Sequences and heads a rank's attention runs over, for micro-batch `b` (its tile's
    /// sequences on a grid).
    fn attention_shape(&self, grid: Option<&ProcessGrid>, b: &GptBatch<'_>) -> Result<[usize; 2]> {
        let cfg = &self.config;
        Ok(match (self.blocks.tiled(), grid) {
            (false, _) => [b.batch, self.blocks.local_heads(cfg.heads)],
            (true, Some(g)) => {
                let [rows, _] = self.tile_shape(g, b)?;
                [rows / b.seq.max(1), cfg.heads / g.q()?]
            }
            (true, None) => {
                return Err(Error::InvalidArgument(
                    "a stage of grid blocks run without its grid".into(),
                ))
            }
        })
    }

    /// The shape of micro-batch `b`'s activation between the stages on this rank: the whole
    /// `[batch·seq, C]`, or the rank's tile on a grid.
    fn tile_shape(&self, grid: &ProcessGrid, b: &GptBatch<'_>) -> Result<[usize; 2]> {
        let (rows, c) = (b.batch * b.seq, self.config.channels);
        Ok(match &self.blocks {
            Blocks::Serial(_) | Blocks::OneD(_) => [rows, c],
            Blocks::Summa(_) => BatchBlock::of(grid)?.shape(rows, c)?,
            Blocks::Cube(_) => {
                let t = Place3D::of(grid)?.tile(Layout3D::RowsJColsK, rows, c)?;
                [t.rows, t.cols]
            }
        })
    }

    /// This stage's copy of `wte` (its shard, with split ends), on the first and the last
    /// stage.
    pub fn wte(&self) -> Option<TensorId> {
        let first = self.embedding.as_ref().map(|e| match e {
            StageEmbedding::Whole(e) => e.wte,
            StageEmbedding::Split(e) => e.wte(),
        });
        first.or_else(|| {
            self.head.as_ref().map(|h| match h {
                StageHead::Whole { head, .. } => head.proj.weight,
                StageHead::Split(h) => h.wte(),
            })
        })
    }

    /// Whether the ends are split over the tensor group.
    fn split_ends(&self) -> bool {
        matches!(self.embedding, Some(StageEmbedding::Split(_)))
            || matches!(self.head, Some(StageHead::Split(_)))
    }

    /// Whether this stage holds one of `wte`'s two copies.
    fn ties(&self) -> bool {
        self.stages > 1 && (self.embedding.is_some() || self.head.is_some())
    }
}

/// The stage's blocks and whole ends, in the order [`GptStage::register`] registers them:
/// `wte` on an end stage (its norm share `wte_share`), `wpe` on the first, the blocks, `ln_f`
/// on the last (replicated, like the blocks' LayerNorms).
type WholeParts = (Option<StageEmbedding>, Blocks, Option<StageHead>);

fn register_whole(
    store: &mut impl ParamStore,
    cfg: &GptConfig,
    init: &dyn Fn(&str) -> crate::tensor::Init,
    (first, last): (bool, bool),
    (layers, split, replicated): (Range<usize>, StageSplit<'_>, f64),
    wte_share: f64,
) -> Result<WholeParts> {
    let c = cfg.channels;
    // `wte` on the first stage and on the last (one tensor when they are the same)
    let wte = if first || last {
        let id = store.register("wte.weight", &[cfg.vocab, c], init("wte.weight"))?;
        store.set_norm_share(id, wte_share)?;
        Some(id)
    } else {
        None
    };
    let held = |w: Option<TensorId>| {
        w.ok_or_else(|| Error::InvalidArgument("an end stage without wte".into()))
    };
    let embedding = if first {
        let wte = held(wte)?;
        let wpe = store.register("wpe.weight", &[cfg.max_seq, c], init("wpe.weight"))?;
        store.set_norm_share(wpe, replicated)?;
        Some(StageEmbedding::Whole(Embedding {
            wte,
            wpe,
            vocab: cfg.vocab,
            max_seq: cfg.max_seq,
            channels: c,
        }))
    } else {
        None
    };
    let blocks = Blocks::register(store, cfg, layers, split, init)?.shared();
    let head = if last {
        let ln_f = LayerNorm {
            gamma: store.register("ln_f.weight", &[c], init("ln_f.weight"))?,
            beta: store.register("ln_f.bias", &[c], init("ln_f.bias"))?,
            cols: c,
            eps: cfg.eps,
        };
        store.set_norm_share(ln_f.gamma, replicated)?;
        store.set_norm_share(ln_f.beta, replicated)?;
        let head = LmHead::tied(&*store, held(wte)?, IGNORE_INDEX)?;
        Some(StageHead::Whole { ln_f, head })
    } else {
        None
    };
    Ok((embedding, blocks, head))
}
