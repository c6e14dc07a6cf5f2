//! The classifier (or the LM head tied to the vocab-parallel embedding) with the softmax
//! cross-entropy, on the 2D / 2.5D layout.

use super::cost::tally;
use super::{groups, split, VocabEmbedding2D};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::ops::{check_targets, VocabShard};
use crate::parallel::Cost;
use crate::parallel::GridClassifier;
use crate::parallel::{
    BatchRows, Linear2D, Linear2p5D, Place2D, ProcessGrid, ShardedCrossEntropy, SummaLinear,
    TensorMode,
};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// A linear `C → classes` on the 2D / 2.5D layout fused with the mean softmax cross-entropy
/// over the whole batch (see [`Embedding2D`](crate::parallel::Embedding2D)); untied ([`Classifier2D::register`]) or the
/// LM head tied to a [`VocabEmbedding2D`] ([`Classifier2D::tied`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Classifier2D {
    /// The projection: logits tile `[rows_l, classes/q]`, class block `col`.
    pub linear: SummaLinear,
    /// The classes (the outputs of the linear).
    pub classes: usize,
    /// Targets equal to it count for nothing.
    pub ignore_index: i32,
    /// Whether the weight is tied to an embedding (its gradient then added as a share).
    pub tied: bool,
}

/// What [`Classifier2D::forward`] keeps for the backward.
#[derive(Debug)]
pub struct Classifier2DSaved {
    h: Act,
    dlogits: Act,
}

impl Classifier2D {
    /// Registers the untied classifier `name` (`{name}.weight`, and `{name}.bias` with
    /// `bias`, as [`SummaLinear::register`] lays them out: the masters `[classes, inputs]` and
    /// `[classes]`). Fails on a grid that is neither 2D nor 2.5D and when `inputs` or
    /// `classes` do not split by `q` (with a bias, `classes` by `q²`), naming the dimension.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        inputs: usize,
        classes: usize,
        weight: &Init,
        bias: Option<&Init>,
        ignore_index: i32,
    ) -> Result<Classifier2D> {
        let mode = grid.spec().tensor;
        if !matches!(mode, TensorMode::TwoD { .. } | TensorMode::TwoHalfD { .. }) {
            return Err(Error::Conflict {
                what: format!("Classifier2D '{name}'"),
                with: format!("a grid of tensor mode {mode} (it runs on a 2D or 2.5D grid)"),
            });
        }
        let q = grid.q()?;
        split(name, "classes", classes, q, "q")?;
        if bias.is_some() {
            split(name, "classes (with a bias)", classes, q * q, "q²")?;
        }
        let linear = SummaLinear::register(store, grid, name, [inputs, classes], weight, bias)?;
        Ok(Classifier2D {
            linear,
            classes,
            ignore_index,
            tied: false,
        })
    }

    /// The LM head over `emb`'s `wte` (the same tensor: logits `h·wteᵀ`, class block `col` =
    /// vocabulary block `col`; no bias). `store` is checked to hold the block.
    pub fn tied(
        store: &impl ParamStore,
        emb: &VocabEmbedding2D,
        ignore_index: i32,
    ) -> Result<Classifier2D> {
        let p = emb.place;
        let want = [emb.vocab / p.q, emb.channels / p.q];
        let have = store.tensor_shape(emb.weight)?;
        if have != want {
            return Err(Error::ParamShape {
                tensor: emb.weight.0,
                shape: have.to_vec(),
                dtype: store.param_dtype(),
                expected: want.to_vec(),
                expected_dtype: store.param_dtype(),
            });
        }
        let slice = Linear2D {
            weight: emb.weight,
            bias: None,
            inputs: emb.channels,
            outputs: emb.vocab,
            q: p.q,
            row: p.row,
            col: p.col,
        };
        let linear = match emb.mode {
            TensorMode::TwoHalfD { depth, .. } => SummaLinear::TwoHalfD(Linear2p5D {
                slice,
                depth,
                dep: p.dep,
            }),
            _ => SummaLinear::TwoD(slice),
        };
        Ok(Classifier2D {
            linear,
            classes: emb.vocab,
            ignore_index,
            tied: true,
        })
    }

    /// The grid mode and place the layer belongs to.
    fn at(&self) -> (TensorMode, Place2D) {
        let l = self.linear.slice();
        let (mode, depth, dep) = match self.linear {
            SummaLinear::TwoD(_) => (TensorMode::TwoD { q: l.q }, 1, 0),
            SummaLinear::TwoHalfD(h) => (
                TensorMode::TwoHalfD {
                    q: l.q,
                    depth: h.depth,
                },
                h.depth,
                h.dep,
            ),
        };
        let place = Place2D {
            q: l.q,
            depth,
            row: l.row,
            col: l.col,
            dep,
        };
        (mode, place)
    }

    /// The classes this rank's logits hold: class block `col`.
    pub fn shard(&self) -> Result<VocabShard> {
        let l = self.linear.slice();
        let cl = self.classes / l.q;
        VocabShard::new(self.classes, l.col * cl, cl)
    }

    /// The collectives of one forward and one backward over a batch of `n` rows, elements of
    /// `dtype` (the store's parameter dtype), with `r = n/(d·q)` the tile's rows: the
    /// linear's ([`SummaLinear::collectives`], with `dX`), plus forward ROW two all-reduces of
    /// `r·4` and `2r·4` bytes (the cross-entropy's row max, then its sums and target logits)
    /// and the tensor group one all-reduce of 8 bytes (the loss, f64). Fails when `n` does not
    /// split into the row blocks.
    pub fn collectives(&self, n: usize, dtype: DType) -> Result<Cost> {
        let (_, p) = self.at();
        let r = split("batch", "rows", n, p.q * p.depth, "row blocks")?;
        let mut c = self.linear.collectives(n, dtype)?;
        c.forward.row.all_reduce = c.forward.row.all_reduce + tally(1, r * 4) + tally(1, 2 * r * 4);
        c.forward.tensor.all_reduce = tally(1, 8);
        Ok(c)
    }
}

impl GridClassifier for Classifier2D {
    type Saved = Classifier2DSaved;

    fn params(&self) -> Vec<TensorId> {
        self.linear.params()
    }

    /// The mean cross-entropy over the whole batch's rows whose target is not the ignore
    /// index, from this rank's tile `h` `[N/(d·q), C/q]` and `targets` (the whole batch's `N`
    /// class ids, the same on every rank); every rank gets the same loss. The logits'
    /// gradient, kept for the backward, is scaled by `loss_scale` over the counted rows.
    /// Targets, shapes, the scale and the grid are checked before any collective.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        h: &Act,
        targets: &[i32],
        loss_scale: f32,
    ) -> Result<(f32, Classifier2DSaved)> {
        let (mode, p) = self.at();
        let gr = groups("Classifier2D", mode, p, grid)?;
        let l = self.linear.slice();
        h.expect("h", None, l.inputs / l.q, pass.param_dtype())?;
        check_targets(targets, self.classes, self.ignore_index)?;
        let blocks = p.q * p.depth;
        let rows = h.rows();
        let want = rows.checked_mul(blocks);
        if want != Some(targets.len()) {
            return Err(match want {
                None => Error::Overflow {
                    what: format!("Classifier2D: the rows of {blocks} row blocks of {rows}"),
                },
                Some(expected) => Error::Length {
                    what: format!(
                        "targets for Classifier2D's tile of {rows} rows over {blocks} row blocks"
                    ),
                    got: targets.len(),
                    expected,
                },
            });
        }
        if !(loss_scale > 0.0 && loss_scale.is_finite()) {
            return Err(Error::BadValue {
                what: "the loss scale of Classifier2D".into(),
                value: f64::from(loss_scale),
                want: "finite and above 0",
            });
        }
        let ce = ShardedCrossEntropy {
            classes: self.shard()?,
            ignore_index: self.ignore_index,
        };
        let rb = p.row + p.q * p.dep;
        let logits = self.linear.forward(pass, grid, h)?;
        let batch = BatchRows {
            targets,
            first: rb * rows,
            owners: Some((gr.tensor, p.col == 0)),
        };
        let loss = ce.batch_mean(pass, gr.row, &logits, batch, loss_scale)?;
        let saved = Classifier2DSaved {
            h: h.clone(),
            dlogits: logits,
        };
        Ok((loss, saved))
    }

    /// `dh`, this rank's tile `[N/(d·q), C/q]`; writes the weight's (and bias's) gradient, or
    /// adds the weight's share when tied: the linear's backward.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Classifier2DSaved,
    ) -> Result<Act> {
        let (x, dy) = (&saved.h, &saved.dlogits);
        if self.tied {
            self.linear.backward_shared(pass, grid, x, dy)
        } else {
            self.linear.backward(pass, grid, x, dy)
        }
    }
}
