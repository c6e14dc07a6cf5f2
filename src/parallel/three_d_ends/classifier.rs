//! [`Classifier3D`] (see [`Embedding3D`](crate::parallel::Embedding3D)).

use super::{here, VocabEmbedding3D};
use crate::comm::Tally;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{Act, WeightUse};
use crate::ops::{check_targets, VocabShard};
use crate::parallel::grid::ProcessGrid;
use crate::parallel::three_d::{groups, split, Layout3D, Linear3D, Linear3DSaved, Place3D};
use crate::parallel::Cost;
use crate::parallel::GridClassifier;
use crate::parallel::{BatchRows, ShardedCrossEntropy};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// A classifier on the cube: [`Linear3D`] logits and the softmax cross-entropy over classes
/// split along the layout's row axis, the mean over the whole batch (see [`Embedding3D`](crate::parallel::Embedding3D)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Classifier3D {
    /// The projection `inputs → classes`, its input in the classifier's layout.
    pub linear: Linear3D,
    /// Targets equal to it count for nothing.
    pub ignore_index: i32,
    /// How backward writes the weight's gradient: [`WeightUse::Shared`] when tied to a
    /// [`VocabEmbedding3D`].
    pub uses: WeightUse,
}

/// What [`Classifier3D::forward`] keeps for the backward.
#[derive(Debug)]
pub struct Classifier3DSaved {
    linear: Linear3DSaved,
    dlogits: Act,
}

impl Classifier3D {
    /// Registers an untied classifier of `inputs` features into `classes` classes whose input
    /// tile is in `layout`: [`Linear3D::register`]'s `{name}.weight` (from the master
    /// `[classes, inputs]`) and, with `bias`, `{name}.bias`. Fails before registering anything
    /// if the grid is not 3D, the inputs do not split by `q²` or the classes by `q`.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        inputs: usize,
        classes: usize,
        layout: Layout3D,
        weight: &Init,
        bias: Option<&Init>,
        ignore_index: i32,
    ) -> Result<Classifier3D> {
        let place = Place3D::of(grid)?;
        let q = place.q;
        split(name, "inputs", inputs, q * q, "q²")?;
        let cq = split(name, "classes", classes, q, "q")?;
        let (a, _) = place.axes(layout);
        VocabShard::new(classes, a * cq, cq)?;
        let linear = Linear3D::register(store, grid, name, inputs, classes, layout, weight, bias)?;
        Ok(Classifier3D {
            linear,
            ignore_index,
            uses: WeightUse::Once,
        })
    }

    /// The LM head tied to `emb`: logits `h·wteᵀ` over its vocabulary, no bias, its input in
    /// `emb`'s layout, its weight's gradient a share added to the embedding's. `store` must
    /// hold `emb`'s weight.
    pub fn tied(
        store: &impl ParamStore,
        emb: &VocabEmbedding3D,
        ignore_index: i32,
    ) -> Result<Classifier3D> {
        let linear = emb.linear();
        let q = emb.place.q;
        let want = [emb.channels / (q * q), emb.vocab / q];
        let shape = store.tensor_shape(emb.weight)?;
        if shape != want {
            return Err(Error::ParamShape {
                tensor: emb.weight.0,
                shape: shape.to_vec(),
                dtype: store.param_dtype(),
                expected: want.to_vec(),
                expected_dtype: store.param_dtype(),
            });
        }
        Ok(Classifier3D {
            linear,
            ignore_index,
            uses: WeightUse::Shared,
        })
    }

    /// The classes `C` of the whole classifier.
    pub(crate) fn classes(&self) -> usize {
        self.linear.outputs
    }

    /// The layout of the input tile.
    pub fn layout(&self) -> Layout3D {
        self.linear.layout
    }

    /// The collectives of one forward and backward on input tiles of `rows` rows
    /// (`n = R/q²`) in `dtype`: [`Linear3D::collectives`] (with the input gradient), plus in
    /// forward the cross-entropy's two all-reduces on the layout's row group (`n` f32 and
    /// `2n` f32) and the loss's all-reduce of one f64 on the tensor group.
    pub fn collectives(&self, rows: usize, dtype: DType) -> Cost {
        let lin = self.linear.collectives(rows, dtype, true);
        let mut forward = lin.forward;
        let ce = match self.layout() {
            Layout3D::RowsJColsK => &mut forward.input,
            Layout3D::RowsKColsJ => &mut forward.output,
        };
        ce.all_reduce = Tally {
            calls: 2,
            bytes: (3 * rows * DType::F32.size()) as u64,
        };
        forward.tensor.all_reduce = Tally {
            calls: 1,
            bytes: DType::F64.size() as u64,
        };
        Cost {
            forward,
            backward: lin.backward,
        }
    }
}

impl GridClassifier for Classifier3D {
    type Saved = Classifier3DSaved;

    fn params(&self) -> Vec<TensorId> {
        self.linear.params()
    }

    /// The mean cross-entropy over the rows of the whole batch whose target is not the ignore
    /// index, of this rank's input tile `h` `[R/q², inputs/q]` (in [`Classifier3D::layout`])
    /// against `targets` (the whole batch's `R` class ids, row by row, the same on every
    /// rank): the same loss on every rank of the cube. The logits' gradient, kept for the
    /// backward, is scaled by `loss_scale` over the rows counted. Targets, shapes, the scale
    /// and the grid are checked on the host before any collective.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        h: &Act,
        targets: &[i32],
        loss_scale: f32,
    ) -> Result<(f32, Classifier3DSaved)> {
        let place = here(grid, self.linear.place)?;
        let classes = self.classes();
        let tile = place.tile(self.layout().swapped(), targets.len(), classes)?;
        let iq = self.linear.inputs / place.q;
        h.expect("h", Some(tile.rows), iq, pass.param_dtype())?;
        check_targets(targets, classes, self.ignore_index)?;
        if !(loss_scale > 0.0 && loss_scale.is_finite()) {
            return Err(Error::BadValue {
                what: "the loss scale of a 3D classifier".into(),
                value: f64::from(loss_scale),
                want: "finite and above 0",
            });
        }
        let (ga, _, _) = groups(grid, self.layout())?;
        let ce = ShardedCrossEntropy {
            classes: VocabShard::new(classes, tile.col0, tile.cols)?,
            ignore_index: self.ignore_index,
        };
        let (logits, saved) = self.linear.forward(pass, grid, h)?;
        // the logits' rows (i·q + c)·n .., their other classes on the ranks along a
        let (a, _) = place.axes(self.layout());
        let rows = BatchRows {
            targets,
            first: tile.row0,
            owners: Some((grid.tensor(), a == 0)),
        };
        let loss = ce.batch_mean(pass, ga, &logits, rows, loss_scale)?;
        let saved = Classifier3DSaved {
            linear: saved,
            dlogits: logits,
        };
        Ok((loss, saved))
    }

    /// The backward of [`Classifier3D::forward`]: this rank's input-gradient tile
    /// `[R/q², inputs/q]` (in [`Classifier3D::layout`]); writes the weight's (and bias's)
    /// gradient shard, or adds it as a share when tied.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Classifier3DSaved,
    ) -> Result<Act> {
        let l = &self.linear;
        l.backward_with(pass, grid, &saved.linear, &saved.dlogits, true, self.uses)?
            .ok_or_else(|| Error::Internal {
                what: "the 3D classifier's linear asked for dh gave none".into(),
            })
    }
}
