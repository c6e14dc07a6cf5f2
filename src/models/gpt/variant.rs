//! What makes a transformer family: its block and its two ends on every layout
//! ([`Variant`]). The model ([`Gpt`](super::Gpt)), its plan, its training step and every
//! pipeline schedule are written once over it; GPT-2 ([`Gpt2`]) is one variant.

use std::fmt::Debug;

use super::GptConfig;
use crate::device::PoolBlock;
use crate::error::Result;
use crate::nn::{Act, BlockOn, Layout, Loss, WeightUse};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// What happens to a tied weight's gradient share at an end: added to the store as it comes
/// (`None`), or handed to the function (a pipeline's end stages sum their shares over the
/// step apart from the slot, and swap them at its end).
pub type Tie<'a> = Option<&'a dyn Fn(&BackwardPass<'_>, &PoolBlock) -> Result<()>>;

/// Where a rank's part of a model is registered and how its parameters count in the
/// gradient norm, as [`Gpt::register_variant`](super::Gpt::register_variant) hands it to the
/// variant.
pub struct RegisterAt<'a> {
    /// The whole model's shape.
    pub cfg: &'a GptConfig,
    /// Each parameter's whole master, by name.
    pub master: &'a dyn Fn(&str) -> Init,
    /// How often the weights are used an iteration ([`WeightUse::Shared`] in a pipeline: a
    /// stage runs its layers once per micro-batch).
    pub uses: WeightUse,
    /// The norm share of a parameter every rank of the tensor group holds (`1/T`).
    pub replicated: f64,
    /// Copies of a weight tied across the ends (2 in a pipeline, one an end stage).
    pub copies: f64,
    /// Whether this rank holds the first end (the embedding) and the last (the head).
    pub ends: [bool; 2],
    /// Whether the ends split over the tensor group as the layout splits them (else they
    /// are whole on every rank).
    pub split: bool,
}

/// A transformer family: its block and its ends, on every layout. Registration runs the
/// first end, the blocks, then the last end, each parameter named in the order
/// [`Variant::param_shapes`] lists them.
///
/// A variant needs no code per layout: it registers its layers through the layout
/// ([`Layout::register_linear`], [`Layout::register_norm`], …), and its ends either split as
/// the layout splits them or stay whole (cut into and gathered from the blocks' tiles by
/// [`Layout::to_tile`] and [`Layout::to_full`]).
pub trait Variant: Clone + Debug + PartialEq + Send + Sync + 'static {
    /// The block on layout `L`.
    type Block<L: Layout>: BlockOn<L>;
    /// The ends a rank holds on layout `L`.
    type Ends<L: Layout>: ModelEnds<L>;

    /// Every parameter of the whole model of shape `cfg`, `(name, shape)` in registration
    /// order (linear weights `[outputs, inputs]`).
    fn param_shapes(&self, cfg: &GptConfig) -> Vec<(String, Vec<usize>)>;

    /// Registers this rank's part of block `name` on `layout`, each parameter with the values
    /// of its whole master (`at.master(param name)`) and its linears writing their gradients
    /// as `at.uses` says, each named (`{name}.…`) in `params` in registration order. Fails
    /// before registering anything on a shape that does not split.
    fn register_block<L: Layout, S: ParamStore>(
        &self,
        store: &mut S,
        layout: L,
        name: &str,
        at: &RegisterAt<'_>,
        params: &mut Vec<(String, TensorId)>,
    ) -> Result<Self::Block<L>>;

    /// Registers what comes before the blocks: the first end where `at.ends[0]`, and any
    /// weight the last end ties to it; each parameter named in `params`.
    fn register_first<L: Layout, S: ParamStore>(
        &self,
        store: &mut S,
        at: &RegisterAt<'_>,
        layout: L,
        params: &mut Vec<(String, TensorId)>,
    ) -> Result<Self::Ends<L>>;

    /// Registers what comes after the blocks: the last end where `at.ends[1]`; each
    /// parameter named in `params`.
    fn register_last<L: Layout, S: ParamStore>(
        &self,
        ends: &mut Self::Ends<L>,
        store: &mut S,
        at: &RegisterAt<'_>,
        params: &mut Vec<(String, TensorId)>,
    ) -> Result<()>;
}

/// The two ends of a transformer, or the one a pipeline stage holds, on layout `L`: the
/// embedding of the tokens into the blocks' layout, and the head's loss (or logits) from the
/// last block's output.
pub trait ModelEnds<L: Layout>: Clone + Debug + PartialEq + Send + Sync {
    /// What the embedding keeps for its backward.
    type EmbedSaved: Send;
    /// What the head keeps for its backward.
    type HeadSaved: Send;

    /// The layout the blocks run on.
    fn layout(&self) -> &L;

    /// Whether this rank holds the embedding (the first end).
    fn has_embedding(&self) -> bool;

    /// Whether this rank holds the head (the last end).
    fn has_head(&self) -> bool;

    /// Whether the ends are split over the tensor group (a tied weight's shares then go to
    /// the store's sum as they come).
    fn split(&self) -> bool;

    /// The embedding's parameters and the head's, in the order the forward fetches them.
    fn params(&self) -> (Vec<TensorId>, Vec<TensorId>);

    /// This rank's copy of a weight both ends use (GPT-2's `wte`), if the family ties one:
    /// in a pipeline the two end stages hold a copy each and keep them equal.
    fn tied(&self) -> Option<TensorId>;

    /// The embedding of `tokens` at positions `first .. first + seq` of their sequences, in
    /// the blocks' layout.
    fn embed(
        &self,
        fwd: &ForwardPass<'_>,
        tokens: &[i32],
        batch_seq_first: [usize; 3],
    ) -> Result<(Act, Self::EmbedSaved)>;

    /// The embedding's gradients from the first block's input gradient `dx`; a tied
    /// weight's share as `tie` says.
    fn embed_backward(
        &self,
        bwd: &BackwardPass<'_>,
        saved: Self::EmbedSaved,
        dx: Act,
        tie: Tie<'_>,
    ) -> Result<()>;

    /// The head on the last block's output: the mean loss over the batch (targets equal to
    /// [`IGNORE_INDEX`](super::IGNORE_INDEX) count for nothing), the loss gradient kept
    /// scaled by `scale`.
    fn head_forward(
        &self,
        fwd: &ForwardPass<'_>,
        x: Act,
        targets: &[i32],
        scale: f32,
    ) -> Result<(Loss, Self::HeadSaved)>;

    /// The gradient of the last block's output, from what the head kept; a tied weight's
    /// share as `tie` says.
    fn head_backward(
        &self,
        bwd: &BackwardPass<'_>,
        saved: Self::HeadSaved,
        tie: Tie<'_>,
    ) -> Result<Act>;

    /// The logits `[rows, V]` of the last block's output, of a whole model (an error on a
    /// split one).
    fn logits(&self, fwd: &ForwardPass<'_>, x: Act) -> Result<Act>;
}
