//! A model's run of transformer blocks on whichever layout it was registered, written once:
//! registration, the forward (keeping each block's saved state, or only its input when
//! checkpointing) and the backward (recomputing a checkpointed block first).

use std::ops::Range;

use super::GptConfig;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::nn::{Act, Block, BlockSaved, HeadsCore, Layout, Serial};
use std::sync::Arc;

use crate::parallel::{Cube, Layout3D, OneD, ProcessGrid, Summa, TensorMode};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// How a model's blocks are split over its tensor group.
#[derive(Clone, Copy, Debug)]
pub(super) enum TensorSplit<'a> {
    /// Not split.
    None,
    /// Megatron's 1D split over this group.
    OneD(&'a Arc<Communicator>),
    /// The grid's scheme (1D, 2D, 2.5D or 3D).
    Grid(&'a ProcessGrid),
}

/// The blocks of a model (or of a pipeline stage), on one layout.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Blocks {
    Serial(Vec<Block<Serial>>),
    OneD(Vec<Block<OneD>>),
    Summa(Vec<Block<Summa>>),
    Cube(Vec<Block<Cube>>),
}

/// What a run of blocks keeps for its backward, per block: its saved state, or only its input
/// when checkpointing.
pub(super) enum Kept {
    Serial(Vec<BlockKept<Serial>>),
    OneD(Vec<BlockKept<OneD>>),
    Summa(Vec<BlockKept<Summa>>),
    Cube(Vec<BlockKept<Cube>>),
}

pub(super) enum BlockKept<L: Layout> {
    Saved(Box<BlockSaved<L>>),
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

/// Applies `$body` to the blocks of whichever layout.
macro_rules! each {
    ($blocks:expr, |$v:ident| $body:expr) => {
        match $blocks {
            Blocks::Serial($v) => $body,
            Blocks::OneD($v) => $body,
            Blocks::Summa($v) => $body,
            Blocks::Cube($v) => $body,
        }
    };
}

impl Blocks {
    /// Registers blocks `layers` of `cfg` split as `split` says, each parameter with the value
    /// of its master `init(name)`.
    pub(super) fn register<S: ParamStore>(
        store: &mut S,
        cfg: &GptConfig,
        layers: Range<usize>,
        split: TensorSplit<'_>,
        init: &dyn Fn(&str) -> Init,
    ) -> Result<Blocks> {
        fn all<S: ParamStore, L: Layout>(
            store: &mut S,
            cfg: &GptConfig,
            layers: Range<usize>,
            layout: L,
            init: &dyn Fn(&str) -> Init,
        ) -> Result<Vec<Block<L>>> {
            let shape = [cfg.channels, cfg.heads];
            layers
                .map(|i| {
                    Block::register(
                        store,
                        layout.clone(),
                        &format!("h.{i}"),
                        shape,
                        cfg.eps,
                        init,
                    )
                })
                .collect()
        }
        Ok(match split {
            TensorSplit::None => Blocks::Serial(all(store, cfg, layers, Serial, init)?),
            TensorSplit::OneD(group) => {
                Blocks::OneD(all(store, cfg, layers, OneD::of(group), init)?)
            }
            TensorSplit::Grid(grid) => match grid.spec().tensor {
                TensorMode::None => Blocks::Serial(all(store, cfg, layers, Serial, init)?),
                TensorMode::OneD { .. } => {
                    let l = OneD::of(grid.tensor());
                    Blocks::OneD(all(store, cfg, layers, l, init)?)
                }
                TensorMode::TwoD { .. } | TensorMode::TwoHalfD { .. } => {
                    Blocks::Summa(all(store, cfg, layers, Summa::of(grid)?, init)?)
                }
                TensorMode::ThreeD { .. } => {
                    let l = Cube::of(grid, Layout3D::RowsJColsK)?;
                    Blocks::Cube(all(store, cfg, layers, l, init)?)
                }
            },
        })
    }

    /// The same blocks with their linears writing gradient shares (a pipeline stage runs each
    /// once per micro-batch).
    pub(super) fn shared(self) -> Blocks {
        fn s<L: Layout>(v: Vec<Block<L>>) -> Vec<Block<L>> {
            v.into_iter().map(Block::shared).collect()
        }
        match self {
            Blocks::Serial(v) => Blocks::Serial(s(v)),
            Blocks::OneD(v) => Blocks::OneD(s(v)),
            Blocks::Summa(v) => Blocks::Summa(s(v)),
            Blocks::Cube(v) => Blocks::Cube(s(v)),
        }
    }

    /// Checks that the blocks were registered for `split` (their layout and this rank's place
    /// in it), before anything runs.
    pub(super) fn check(&self, split: TensorSplit<'_>) -> Result<()> {
        let ok = match (self, split) {
            (Blocks::Serial(_), TensorSplit::None) => Ok(()),
            (Blocks::OneD(v), TensorSplit::OneD(group)) => match v.first() {
                Some(b) if b.layout != OneD::of(group) => Err(()),
                _ => Ok(()),
            },
            (Blocks::Summa(v), TensorSplit::Grid(g)) => match v.first() {
                Some(b) if b.layout != Summa::of(g)? => Err(()),
                _ => Ok(()),
            },
            (Blocks::Cube(v), TensorSplit::Grid(g)) => match v.first() {
                Some(b) if b.layout != Cube::of(g, Layout3D::RowsJColsK)? => Err(()),
                _ => Ok(()),
            },
            _ => Err(()),
        };
        ok.map_err(|()| Error::WrongPlace {
            what: "a GPT's blocks",
            registered: self.describe(),
            run: match split {
                TensorSplit::None => "whole".to_string(),
                TensorSplit::OneD(c) => {
                    format!("as rank {} of a 1D group of {}", c.rank(), c.world())
                }
                TensorSplit::Grid(g) => format!("on a grid of tensor mode {}", g.spec().tensor),
            },
        })
    }

    /// The layout the blocks were registered on, in words.
    fn describe(&self) -> String {
        match self {
            Blocks::Serial(_) => "whole".into(),
            Blocks::OneD(v) => v.first().map_or("1D".into(), |b| {
                let s = b.layout.shard;
                format!("as rank {} of a 1D group of {}", s.rank, s.size)
            }),
            Blocks::Summa(_) => "on a 2D or 2.5D grid".into(),
            Blocks::Cube(_) => "on a 3D cube".into(),
        }
    }

    /// Every block's parameters, in registration order.
    pub(super) fn params(&self) -> Vec<TensorId> {
        fn p<L: Layout>(v: &[Block<L>]) -> Vec<TensorId> {
            v.iter().flat_map(Block::params).collect()
        }
        match self {
            Blocks::Serial(v) => p(v),
            Blocks::OneD(v) => p(v),
            Blocks::Summa(v) => p(v),
            Blocks::Cube(v) => p(v),
        }
    }

    /// Every block's parameters with their names, the first block being `h.{first}`.
    pub(super) fn named_params(&self, first: usize) -> Vec<(String, TensorId)> {
        fn n<L: Layout>(v: &[Block<L>], first: usize) -> Vec<(String, TensorId)> {
            let named = v.iter().enumerate();
            named
                .flat_map(|(i, b)| b.named_params(&format!("h.{}", first + i)))
                .collect()
        }
        match self {
            Blocks::Serial(v) => n(v, first),
            Blocks::OneD(v) => n(v, first),
            Blocks::Summa(v) => n(v, first),
            Blocks::Cube(v) => n(v, first),
        }
    }

    /// Heads a rank's attention computes (`heads` without blocks).
    pub(super) fn local_heads(&self, heads: usize) -> usize {
        fn h<L: Layout>(v: &[Block<L>], heads: usize) -> usize {
            v.first().map_or(heads, Block::local_heads)
        }
        match self {
            Blocks::Serial(v) => h(v, heads),
            Blocks::OneD(v) => h(v, heads),
            Blocks::Summa(v) => h(v, heads),
            Blocks::Cube(v) => h(v, heads),
        }
    }

    /// The blocks from `x`, keeping what `keep` says.
    pub(super) fn forward(
        &self,
        fwd: &ForwardPass<'_>,
        x: Act,
        shape: Shape<'_>,
        keep: Keep,
    ) -> Result<(Act, Kept)> {
        Ok(each!(self, |v| {
            let (y, k) = forward(v, fwd, x, shape, keep)?;
            (y, Kept::from(k))
        }))
    }

    /// The backward of [`Blocks::forward`] from `dx`, recomputing checkpointed blocks.
    pub(super) fn backward(
        &self,
        bwd: &mut BackwardPass<'_>,
        kept: Kept,
        dx: Act,
        shape: Shape<'_>,
    ) -> Result<Act> {
        each!(self, |v| backward(v, bwd, kept.into_vec()?, dx, shape))
    }

    /// [`Blocks::backward`] of a forward that kept every block's saved state.
    pub(super) fn backward_saved(
        &self,
        bwd: &BackwardPass<'_>,
        kept: Kept,
        dx: Act,
        shape: Shape<'_>,
    ) -> Result<Act> {
        each!(self, |v| backward_saved(
            v,
            bwd,
            kept.into_vec()?,
            dx,
            shape
        ))
    }
}

/// The layouts' kept states in and out of [`Kept`].
trait KeptOf: Layout {
    fn wrap(v: Vec<BlockKept<Self>>) -> Kept;
    fn unwrap(k: Kept) -> Option<Vec<BlockKept<Self>>>;
}

macro_rules! kept_of {
    ($($l:ident),*) => {$(
        impl KeptOf for $l {
            fn wrap(v: Vec<BlockKept<$l>>) -> Kept {
                Kept::$l(v)
            }
            fn unwrap(k: Kept) -> Option<Vec<BlockKept<$l>>> {
                match k {
                    Kept::$l(v) => Some(v),
                    _ => None,
                }
            }
        }
    )*};
}
kept_of!(Serial, OneD, Summa, Cube);

impl<L: KeptOf> From<Vec<BlockKept<L>>> for Kept {
    fn from(v: Vec<BlockKept<L>>) -> Kept {
        L::wrap(v)
    }
}

impl Kept {
    fn into_vec<L: KeptOf>(self) -> Result<Vec<BlockKept<L>>> {
        // the blocks' saved state is of another layout
        L::unwrap(self).ok_or_else(|| Error::SavedMismatch {
            layer: "the GPT blocks".into(),
        })
    }
}

fn forward<L: Layout>(
    blocks: &[Block<L>],
    fwd: &ForwardPass<'_>,
    mut x: Act,
    shape: Shape<'_>,
    keep: Keep,
) -> Result<(Act, Vec<BlockKept<L>>)> {
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

fn backward<L: Layout>(
    blocks: &[Block<L>],
    bwd: &mut BackwardPass<'_>,
    mut kept: Vec<BlockKept<L>>,
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

fn backward_saved<L: Layout>(
    blocks: &[Block<L>],
    bwd: &BackwardPass<'_>,
    mut kept: Vec<BlockKept<L>>,
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
