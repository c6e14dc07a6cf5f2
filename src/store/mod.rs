//! Where parameters live, and the passes a trainer runs over them.
//!
//! [`ParamStore`] is what a layer or a trainer sees of the memory layer, whichever store holds
//! the parameters: a [`ChunkManager`] (one process) or a [`ZeroManager`] (a data-parallel rank
//! of a model sharded over chunks). It gives the [device](ParamStore::device), the
//! [compute stream](ParamStore::compute_stream) every kernel runs on, the
//! [non-model pool](ParamStore::pool) activations come from (so the tide sees them), the
//! passes, and the optimizer step.
//!
//! # One iteration
//!
//! - [`store.forward()`](ParamStore::forward) opens a [`ForwardPass`]; each op
//!   [fetches](Pass::fetch) its parameters and gets a [`Guard`]. [`Guard::param`] is a
//!   [`ReadView`] of the parameter's memory in its chunk (or ZeRO gather buffer), with its
//!   shape and dtype, that a kernel reads in place. Dropping the guard releases the
//!   parameters, so an early return (`?`) cannot leave them fetched.
//!   [`finish`](Pass::finish) ends the forward pass.
//! - [`store.backward()`](ParamStore::backward) opens a [`BackwardPass`]. Its guards also give
//!   [`Guard::grad`], the [`GradView`] a kernel writes the gradient into (the parameter's own
//!   slot: the gradient overwrites the parameter, so read [`Guard::param`] first), and
//!   [`Guard::accumulate_grad`] for a parameter used more than once (tied weights): every use
//!   adds its share, and the last use writes the sum into the slot.
//! - [`store.step(&mut adam)`](ParamStore::step) runs the optimizer and ends the iteration.
//!
//! The stage is in the pass's type: a forward guard has no gradient to write, and no pass
//! exists for the optimizer stage. A view borrows its guard, so it cannot outlive the release.
//!
//! # Example
//!
//! A layer `y = GELU(w)` over a parameter `w`: forward launches the GELU kernel reading the
//! weight in place in its chunk; backward launches the GELU gradient kernel and writes `dw`
//! into the gradient slot on the device (through a pool buffer: the slot is the weight's own
//! memory, which the kernel reads). No host round trip; activations come from the pool.
//!
//! ```
//! use tidemem::prelude::*;
//!
//! struct GeluOfWeight {
//!     w: TensorId,
//! }
//!
//! impl GeluOfWeight {
//!     fn forward(&self, pass: &ForwardPass<'_>) -> Result<PoolBlock> {
//!         let g = pass.fetch(&[self.w])?;
//!         let w = g.param(0)?; // read-only, in the chunk's memory, with shape and dtype
//!         assert_eq!((w.shape(), w.dtype()), (&[4, 4][..], DType::F16));
//!         let y = pass.pool().alloc(w.len_bytes())?; // activations from the non-model pool
//!         let out = y.view(0, w.len_bytes())?;
//!         ops::gelu_forward(pass.device(), pass.stream(), &w, out, w.dtype())?;
//!         Ok(y)
//!     } // the guard drops: the weight is released
//!
//!     fn backward(&self, pass: &BackwardPass<'_>, dy: &PoolBlock) -> Result<()> {
//!         let g = pass.fetch(&[self.w])?;
//!         let w = g.param(0)?;
//!         let n = w.len_bytes();
//!         let dw = pass.pool().alloc(n)?;
//!         let (dev, s) = (pass.device(), pass.stream());
//!         ops::gelu_backward(dev, s, &w, dy.view(0, n)?, dw.view(0, n)?, w.dtype())?;
//!         // the gradient slot (the weight's memory; the kernel above read it first)
//!         dev.copy_d2d(s, dw.view(0, n)?, g.grad(0)?)?;
//!         Ok(())
//!     }
//! }
//!
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let mut m = ChunkManager::new(dev, ManagerConfig::new(64, Policy::Tide))?;
//! let layer = GeluOfWeight { w: m.register("w", &[4, 4], Init::Constant(1.0))? };
//! let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(0.1)))?;
//!
//! let fwd = m.forward()?;
//! let y = layer.forward(&fwd)?; // y = GELU(1) ≈ 0.8413
//! fwd.finish()?;
//! let bwd = m.backward()?;
//! layer.backward(&bwd, &y)?; // dw = y · GELU'(1) ≈ 0.8413 · 1.0830
//! bwd.finish()?;
//! let dw = m.read(layer.w)?; // the gradient, in the parameter's slot (f16)
//! assert!((dw[0] - 0.9111).abs() < 2e-3, "{}", dw[0]);
//! m.step(&mut adam)?;
//! assert_eq!(m.master(layer.w)?, vec![0.9; 16]); // Adam's first step: lr against the sign
//! # Ok(()) }
//! ```

mod guard;
mod host;
mod pass;
mod view;

/// The token the passes call a store's internal methods with.
const TOKEN: sealed::Token = sealed::Token(());

/// Refuses tensors of `store` whose parameter chunk may hold gradients (on a ZeRO rank, of
/// the tensors it owns): after a step that left gradients in the parameter slots (a
/// `skip_step`), before they are read as parameters again.
pub(crate) fn check_params_clean<S: ParamStore + ?Sized>(
    store: &S,
    ids: &[TensorId],
) -> Result<()> {
    store.check_params_clean(ids, TOKEN)
}

/// Makes `store` record its next iteration as the warm-up again (its tide trace; on a ZeRO rank
/// also the gathers' prefetch order), between iterations: the iteration recorded was unlike
/// the ones to come.
pub(crate) fn rewarm<S: ParamStore + ?Sized>(store: &mut S) -> Result<()> {
    store.rewarm(TOKEN)
}

pub use guard::Guard;
pub use host::{Backward, Forward, PassKind};
pub use pass::{BackwardPass, ForwardPass, Pass};
pub use view::{GradView, ReadView};

use std::path::Path;
use std::sync::Arc;

use crate::chunk::{ChunkManager, TensorView};
use crate::comm::Communicator;
use crate::device::{CachingAllocator, Device, Stream};
use crate::dtype::DType;
use crate::error::Result;
use crate::optim::{GradStats, HybridAdam, StepReport};
use crate::tensor::{ChunkKind, Init, Stage, TensorId};
use crate::zero::{Holds, RankFiles, ZeroManager};

/// What a layer or trainer needs from the store that holds the parameters, so that one trainer
/// runs on a [`ChunkManager`] or a data-parallel [`ZeroManager`] alike (generic over
/// `S: ParamStore`, or through `&mut dyn ParamStore`).
///
/// The trait is sealed: the stores are this crate's. Start passes with
/// [`ParamStore::forward`] and [`ParamStore::backward`]; the stage-explicit calls
/// ([`ParamStore::fetch`], [`ParamStore::release`], [`ParamStore::write_grad`], ...) remain for
/// trainers written against them.
pub trait ParamStore: Send + sealed::Core {
    /// Registers a parameter; registration closes at the first fetch.
    fn register(&mut self, name: &str, shape: &[usize], init: Init) -> Result<TensorId>;

    /// The shape a tensor was registered with.
    fn tensor_shape(&self, id: TensorId) -> Result<&[usize]>;

    /// The element type of parameters and gradients.
    fn param_dtype(&self) -> DType;

    /// The device the parameters are fetched to.
    fn device(&self) -> &Device;

    /// The stream every device operation on fetched tensors runs on: fetched tensors are ready
    /// on it, and later moves of their memory wait for it.
    fn compute_stream(&self) -> &Stream;

    /// The non-model pool: activations and other non-model buffers should come from it, so
    /// that the tide (and a ZeRO rank's gather buffers) share one accounting.
    fn pool(&self) -> &CachingAllocator;

    /// The stage of the iteration in progress (`None` between iterations).
    fn stage(&self) -> Option<Stage>;

    /// Opens (or continues) the forward pass of an iteration.
    ///
    /// Fails with [`Error::WrongStage`](crate::Error::WrongStage) after the forward pass
    /// ended.
    fn forward(&mut self) -> Result<ForwardPass<'_>>;

    /// Opens (or continues) the backward pass, after the forward pass
    /// [finished](Pass::finish).
    ///
    /// Fails with [`Error::WrongStage`](crate::Error::WrongStage) outside the backward
    /// stage.
    fn backward(&mut self) -> Result<BackwardPass<'_>>;

    /// Runs the optimizer for the iteration whose backward pass just finished, and ends the
    /// iteration (see [`HybridAdam::step`]; a [`ZeroManager`] all-reduces the gradient
    /// statistics first).
    fn step(&mut self, adam: &mut HybridAdam) -> Result<StepReport>;

    /// [`ParamStore::step`] with the gradient statistics passed through `reduce` before they
    /// decide anything (after a [`ZeroManager`]'s own reduction over its data-parallel group):
    /// e.g. an all-reduce over a tensor-parallel group, so that every rank clips by the global
    /// norm and skips an overflow together.
    fn step_reducing(
        &mut self,
        adam: &mut HybridAdam,
        reduce: &mut dyn FnMut(GradStats) -> Result<GradStats>,
    ) -> Result<StepReport>;

    /// Counts `share` (in (0, 1]) of tensor `id`'s squared gradient norm in the optimizer's
    /// statistics: `1/P` for a parameter every rank of a tensor-parallel group of `P` holds
    /// whole. Before the first fetch.
    fn set_norm_share(&mut self, id: TensorId, share: f64) -> Result<()>;

    /// Ends the iteration whose backward pass just ended without an optimizer step (an
    /// evaluation forward, or a step the trainer drops): the parameters stay as they were.
    /// Fails with [`Error::WrongStage`](crate::Error::WrongStage) before the backward pass
    /// ended.
    fn skip_step(&mut self) -> Result<()>;

    /// A tensor's parameter slot as f32 on the host (its gradient after its last backward
    /// use).
    fn read(&mut self, id: TensorId) -> Result<Vec<f32>>;

    /// Fetches tensors for an op of `stage` (stage-explicit form of [`Pass::fetch`]; the
    /// views must be dropped before [`ParamStore::release`]).
    fn fetch(&mut self, ids: &[TensorId], stage: Stage) -> Result<Vec<TensorView>>;

    /// Ends an op's use of tensors fetched with [`ParamStore::fetch`].
    fn release(&mut self, ids: &[TensorId], stage: Stage) -> Result<()>;

    /// Writes a tensor's gradient from the host at its last backward use.
    fn write_grad(&mut self, id: TensorId, grad: &[f32]) -> Result<()>;

    /// Ends the forward pass.
    fn end_forward(&mut self) -> Result<()>;

    /// Ends the backward pass.
    fn end_backward(&mut self) -> Result<()>;

    /// Copies lists `kinds` of each `(from, to)` pair's tensor `from` into tensor `to`, of the
    /// same shape (see [`ChunkManager::copy_state`]): PipeDream-2BW's two weight versions are
    /// two registrations of a stage's parameters. On a [`ZeroManager`] every rank calls it with
    /// the same pairs ([`ZeroManager::copy_state`]: a side another rank owns comes by
    /// broadcast).
    fn copy_state(&mut self, pairs: &[(TensorId, TensorId)], kinds: &[ChunkKind]) -> Result<()>;

    /// Closes the open chunk so that the next tensor starts a new chunk group, owned by rank 0
    /// of a [`ZeroManager`] ([`ZeroManager::align_to_ranks`]): call it before each registration
    /// of a PipeDream-2BW version, so each tensor's two versions lie on one rank and their
    /// state copies stay local. Before the first fetch.
    fn align_to_ranks(&mut self) -> Result<()>;

    /// Records what the model is beyond its tensors' names and shapes (`heads = 12`: two
    /// models can have the same tensors and differ): saved with every checkpoint as metadata
    /// `model.<key>`, and checked by every load, which refuses a checkpoint whose value
    /// differs, naming both, or that lacks the key (one saved before models were described
    /// loads with `TIDEMEM_LEGACY_LOAD=1`). Describing a key twice with another value is
    /// refused ([`Error::Conflict`](crate::Error::Conflict)).
    ///
    /// ```
    /// use std::collections::BTreeMap;
    /// use tidemem::prelude::*;
    /// # fn main() -> tidemem::Result<()> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let path = dir.path().join("model.safetensors");
    /// let new = |heads: &str| -> tidemem::Result<ChunkManager> {
    ///     let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
    ///     let mut m = ChunkManager::new(dev, ManagerConfig::new(1024, Policy::Tide))?;
    ///     m.register("w", &[4, 4], Init::Zeros)?;
    ///     m.describe_model("heads", heads)?;
    ///     Ok(m)
    /// };
    /// new("4")?.save_checkpoint(&path, &BTreeMap::new())?;
    /// assert!(new("4")?.load_checkpoint(&path).is_ok());
    /// let e = new("8")?.load_checkpoint(&path).unwrap_err();
    /// assert!(e.to_string().contains("model.heads"), "{e}");
    /// # Ok(()) }
    /// ```
    fn describe_model(&mut self, key: &str, value: &str) -> Result<()>;

    /// Saves this rank's file of a checkpoint that every rank of `world` saves at once, one
    /// file a rank at the path each names (`dir/rank<r>.safetensors`, say): a [`ZeroManager`]'s
    /// shard, or a [`ChunkManager`]'s whole model data (the part of the model a tensor-,
    /// sequence- or pipeline-parallel rank holds), with `adam`'s counters, the rank and size of
    /// `world` and the save's identity. `world` holds every rank whose file belongs to the
    /// save (a ZeRO rank's data-parallel group and the model-parallel groups beside it): the
    /// ranks agree at every step, so that a failure on one fails the save on all, and a
    /// process killed at any point leaves files [`ParamStore::load_rank`] loads, the earlier
    /// save or the new one, never a mix (see the [`zero` docs](crate::zero#checkpoints)).
    /// Every rank of `world` must call it, between iterations.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tidemem::comm::launch;
    /// use tidemem::prelude::*;
    /// # fn main() -> tidemem::Result<()> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let sim = |_| Device::sim(SimConfig::with_capacity(1 << 20));
    /// let saved = |c: tidemem::comm::Communicator| -> tidemem::Result<Vec<f32>> {
    ///     let mut m = ChunkManager::new(c.device().clone(), ManagerConfig::new(64, Policy::Tide))?;
    ///     let w = m.register("w", &[8], Init::Constant(c.rank() as f32))?;
    ///     let adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-3)))?;
    ///     let file = dir.path().join(format!("rank{}.safetensors", c.rank()));
    ///     m.save_rank(&c, &adam, &file)?;
    ///     // a fresh rank loads its own file of the save every rank holds
    ///     let mut n = ChunkManager::new(c.device().clone(), ManagerConfig::new(64, Policy::Tide))?;
    ///     let v = n.register("w", &[8], Init::Zeros)?;
    ///     let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-3)))?;
    ///     n.load_rank(&c, &mut adam, &file)?;
    ///     n.master(v)
    /// };
    /// let masters = launch(2, sim, Duration::from_secs(60), saved)?;
    /// assert_eq!(masters, [vec![0.0; 8], vec![1.0; 8]]);
    /// # Ok(()) }
    /// ```
    fn save_rank(&mut self, world: &Communicator, adam: &HybridAdam, path: &Path) -> Result<()>;

    /// Loads this rank's file of the newest save every rank of `world` holds, written by
    /// [`ParamStore::save_rank`] on the same rank of a world of the same size, layout and
    /// model. The ranks agree on the save, each checks its file (its rank and world, the
    /// optimizer's metadata, the tensors, the checksums), the ranks agree that every file fits
    /// and holds the same step, and only then does any rank load. Otherwise every rank fails
    /// and none changes: a rank whose files hold another save (files of two runs, or of two
    /// saves, put together) fails with [`Error::SaveMismatch`](crate::Error::SaveMismatch),
    /// the others with [`Error::RankFailed`](crate::Error::RankFailed). Every rank of `world`
    /// must call it, between iterations.
    fn load_rank(&mut self, world: &Communicator, adam: &mut HybridAdam, path: &Path)
        -> Result<()>;
}

/// What the passes need from a store beyond its public interface.
pub(crate) mod sealed {
    use std::sync::Arc;

    use crate::chunk::TensorView;
    use crate::device::Stream;
    use crate::error::Result;
    use crate::tensor::TensorId;

    /// Only this module makes one, so that the methods of [`Core`] (callable on a
    /// `dyn ParamStore`) are the crate's own.
    #[derive(Clone, Copy, Debug)]
    pub struct Token(pub(in crate::store) ());

    /// Not nameable outside the crate: only this crate's stores implement [`super::ParamStore`].
    pub trait Core {
        /// Checks that a gradient of `id` may be written now; whether this is its last
        /// backward use.
        fn grad_use(&self, id: TensorId, _: Token) -> Result<bool>;
        /// Marks the gradient of `id` written (at its last backward use).
        fn mark_grad(&mut self, id: TensorId, _: Token) -> Result<()>;
        /// Waits for the compute stream before the host reads what it wrote (through the
        /// communicator for a ZeRO rank, which gives up on a failed peer).
        fn wait_compute(&mut self, _: Token) -> Result<()>;
        /// The compute stream, shared.
        fn compute_arc(&self, _: Token) -> Arc<Stream>;
        /// Fetches tensors in the backward stage to recompute a forward op: one more use on
        /// each side, never the last backward use.
        fn fetch_recompute(&mut self, ids: &[TensorId], _: Token) -> Result<Vec<TensorView>>;
        /// Counts `times` more forward uses of each of `ids` without fetching them.
        fn declare_forward_uses(&mut self, ids: &[TensorId], times: u32, _: Token) -> Result<()>;
        /// Fetches tensors in the backward stage for a later iteration's forward: a read that
        /// counts no use.
        fn fetch_ahead(&mut self, ids: &[TensorId], _: Token) -> Result<Vec<TensorView>>;
        /// Refuses tensors whose parameter chunk may hold gradients (this rank's, on ZeRO).
        fn check_params_clean(&self, ids: &[TensorId], _: Token) -> Result<()>;
        /// Records the next iteration as the warm-up again.
        fn rewarm(&mut self, _: Token) -> Result<()>;
    }
}

impl ChunkManager {
    /// Runs `adam` for the iteration whose backward pass just ended and ends the iteration:
    /// the same as `adam.step(self)` ([`HybridAdam::step`]), named as for every store.
    pub fn step(&mut self, adam: &mut HybridAdam) -> Result<StepReport> {
        adam.step(self)
    }
}

impl ZeroManager {
    /// The device of this rank (the communicator's).
    pub fn device(&self) -> &Device {
        self.comm().device()
    }

    /// The stream every device operation of this rank runs on (the same as
    /// [`ZeroManager::stream`], named as for every store).
    pub fn compute_stream(&self) -> &Stream {
        self.stream()
    }
}

impl sealed::Core for ChunkManager {
    fn grad_use(&self, id: TensorId, _: sealed::Token) -> Result<bool> {
        ChunkManager::grad_use(self, id)
    }
    fn mark_grad(&mut self, id: TensorId, _: sealed::Token) -> Result<()> {
        ChunkManager::mark_grad(self, id)
    }
    fn wait_compute(&mut self, _: sealed::Token) -> Result<()> {
        Ok(())
    }
    fn compute_arc(&self, _: sealed::Token) -> Arc<Stream> {
        ChunkManager::compute_arc(self)
    }
    fn fetch_recompute(&mut self, ids: &[TensorId], _: sealed::Token) -> Result<Vec<TensorView>> {
        ChunkManager::fetch_recompute(self, ids)
    }
    fn declare_forward_uses(
        &mut self,
        ids: &[TensorId],
        times: u32,
        _: sealed::Token,
    ) -> Result<()> {
        ChunkManager::declare_forward_uses(self, ids, times)
    }
    fn fetch_ahead(&mut self, ids: &[TensorId], _: sealed::Token) -> Result<Vec<TensorView>> {
        ChunkManager::fetch_ahead(self, ids)
    }
    fn check_params_clean(&self, ids: &[TensorId], _: sealed::Token) -> Result<()> {
        ChunkManager::check_params_clean(self, ids)
    }
    fn rewarm(&mut self, _: sealed::Token) -> Result<()> {
        ChunkManager::rewarm(self)
    }
}

impl ParamStore for ChunkManager {
    fn register(&mut self, name: &str, shape: &[usize], init: Init) -> Result<TensorId> {
        ChunkManager::register(self, name, shape, init)
    }
    fn tensor_shape(&self, id: TensorId) -> Result<&[usize]> {
        self.tensor_info(id).map(|(_, shape, _)| shape)
    }
    fn param_dtype(&self) -> DType {
        ChunkManager::param_dtype(self)
    }
    fn device(&self) -> &Device {
        ChunkManager::device(self)
    }
    fn compute_stream(&self) -> &Stream {
        ChunkManager::compute_stream(self)
    }
    fn pool(&self) -> &CachingAllocator {
        ChunkManager::pool(self)
    }
    fn stage(&self) -> Option<Stage> {
        ChunkManager::stage(self)
    }
    fn forward(&mut self) -> Result<ForwardPass<'_>> {
        Pass::new(self)
    }
    fn backward(&mut self) -> Result<BackwardPass<'_>> {
        Pass::new(self)
    }
    fn step(&mut self, adam: &mut HybridAdam) -> Result<StepReport> {
        ChunkManager::step(self, adam)
    }
    fn step_reducing(
        &mut self,
        adam: &mut HybridAdam,
        reduce: &mut dyn FnMut(GradStats) -> Result<GradStats>,
    ) -> Result<StepReport> {
        adam.step_reducing(self, reduce)
    }
    fn set_norm_share(&mut self, id: TensorId, share: f64) -> Result<()> {
        ChunkManager::set_norm_share(self, id, share)
    }
    fn skip_step(&mut self) -> Result<()> {
        if self.stage() != Some(Stage::Optimizer) {
            return Err(crate::Error::WrongStage {
                call: "skip_step (it runs after end_backward)".into(),
                stage: self.stage().map_or("idle", Stage::name),
            });
        }
        ChunkManager::skip_step(self)
    }
    fn read(&mut self, id: TensorId) -> Result<Vec<f32>> {
        ChunkManager::read(self, id)
    }
    fn fetch(&mut self, ids: &[TensorId], stage: Stage) -> Result<Vec<TensorView>> {
        ChunkManager::fetch(self, ids, stage)
    }
    fn release(&mut self, ids: &[TensorId], stage: Stage) -> Result<()> {
        ChunkManager::release(self, ids, stage)
    }
    fn write_grad(&mut self, id: TensorId, grad: &[f32]) -> Result<()> {
        ChunkManager::write_grad(self, id, grad)
    }
    fn end_forward(&mut self) -> Result<()> {
        ChunkManager::end_forward(self)
    }
    fn end_backward(&mut self) -> Result<()> {
        ChunkManager::end_backward(self)
    }
    fn copy_state(&mut self, pairs: &[(TensorId, TensorId)], kinds: &[ChunkKind]) -> Result<()> {
        ChunkManager::copy_state(self, pairs, kinds)
    }
    fn align_to_ranks(&mut self) -> Result<()> {
        self.seal_chunk()
    }
    fn save_rank(&mut self, world: &Communicator, adam: &HybridAdam, path: &Path) -> Result<()> {
        RankFiles {
            comm: world,
            holds: Holds::Manager,
        }
        .save(path, Ok(()), self, adam)
    }
    fn load_rank(
        &mut self,
        world: &Communicator,
        adam: &mut HybridAdam,
        path: &Path,
    ) -> Result<()> {
        RankFiles {
            comm: world,
            holds: Holds::Manager,
        }
        .load(path, Ok(()), self, adam)?;
        // the next step is armed by the step after it
        self.arm_overlap(None);
        Ok(())
    }
    fn describe_model(&mut self, key: &str, value: &str) -> Result<()> {
        ChunkManager::describe_model(self, key, value)
    }
}

impl sealed::Core for ZeroManager {
    fn grad_use(&self, id: TensorId, _: sealed::Token) -> Result<bool> {
        ZeroManager::grad_use(self, id)
    }
    fn mark_grad(&mut self, id: TensorId, _: sealed::Token) -> Result<()> {
        ZeroManager::mark_grad(self, id)
    }
    fn wait_compute(&mut self, _: sealed::Token) -> Result<()> {
        // the stream may hold collectives: wait through the communicator, which gives up on a
        // peer that failed or never comes
        self.comm().wait(self.stream())
    }
    fn compute_arc(&self, _: sealed::Token) -> Arc<Stream> {
        // the rank's stream is its manager's compute stream
        self.local().compute_arc()
    }
    fn fetch_recompute(&mut self, ids: &[TensorId], _: sealed::Token) -> Result<Vec<TensorView>> {
        ZeroManager::fetch_recompute(self, ids)
    }
    fn declare_forward_uses(
        &mut self,
        ids: &[TensorId],
        times: u32,
        _: sealed::Token,
    ) -> Result<()> {
        ZeroManager::declare_forward_uses(self, ids, times)
    }
    fn fetch_ahead(&mut self, ids: &[TensorId], _: sealed::Token) -> Result<Vec<TensorView>> {
        ZeroManager::fetch_ahead(self, ids)
    }
    fn check_params_clean(&self, ids: &[TensorId], _: sealed::Token) -> Result<()> {
        ZeroManager::check_params_clean(self, ids)
    }
    fn rewarm(&mut self, _: sealed::Token) -> Result<()> {
        ZeroManager::rewarm(self)
    }
}

impl ParamStore for ZeroManager {
    fn register(&mut self, name: &str, shape: &[usize], init: Init) -> Result<TensorId> {
        ZeroManager::register(self, name, shape, init)
    }
    fn tensor_shape(&self, id: TensorId) -> Result<&[usize]> {
        self.tensor_info(id).map(|(_, shape, _)| shape)
    }
    fn param_dtype(&self) -> DType {
        ZeroManager::param_dtype(self)
    }
    fn device(&self) -> &Device {
        ZeroManager::device(self)
    }
    fn compute_stream(&self) -> &Stream {
        ZeroManager::compute_stream(self)
    }
    fn pool(&self) -> &CachingAllocator {
        ZeroManager::pool(self)
    }
    fn stage(&self) -> Option<Stage> {
        ZeroManager::stage(self)
    }
    fn forward(&mut self) -> Result<ForwardPass<'_>> {
        Pass::new(self)
    }
    fn backward(&mut self) -> Result<BackwardPass<'_>> {
        Pass::new(self)
    }
    fn step(&mut self, adam: &mut HybridAdam) -> Result<StepReport> {
        ZeroManager::step(self, adam)
    }
    fn step_reducing(
        &mut self,
        adam: &mut HybridAdam,
        reduce: &mut dyn FnMut(GradStats) -> Result<GradStats>,
    ) -> Result<StepReport> {
        ZeroManager::step_reducing(self, adam, reduce)
    }
    fn set_norm_share(&mut self, id: TensorId, share: f64) -> Result<()> {
        ZeroManager::set_norm_share(self, id, share)
    }
    fn skip_step(&mut self) -> Result<()> {
        ZeroManager::skip_step(self)
    }
    fn read(&mut self, id: TensorId) -> Result<Vec<f32>> {
        ZeroManager::read(self, id)
    }
    fn fetch(&mut self, ids: &[TensorId], stage: Stage) -> Result<Vec<TensorView>> {
        ZeroManager::fetch(self, ids, stage)
    }
    fn release(&mut self, ids: &[TensorId], stage: Stage) -> Result<()> {
        ZeroManager::release(self, ids, stage)
    }
    fn write_grad(&mut self, id: TensorId, grad: &[f32]) -> Result<()> {
        ZeroManager::write_grad(self, id, grad)
    }
    fn end_forward(&mut self) -> Result<()> {
        ZeroManager::end_forward(self)
    }
    fn end_backward(&mut self) -> Result<()> {
        ZeroManager::end_backward(self)
    }
    fn copy_state(&mut self, pairs: &[(TensorId, TensorId)], kinds: &[ChunkKind]) -> Result<()> {
        ZeroManager::copy_state(self, pairs, kinds)
    }
    fn align_to_ranks(&mut self) -> Result<()> {
        ZeroManager::align_to_ranks(self)
    }
    fn save_rank(&mut self, world: &Communicator, adam: &HybridAdam, path: &Path) -> Result<()> {
        self.save_over(Some(world), adam, path)
    }
    fn load_rank(
        &mut self,
        world: &Communicator,
        adam: &mut HybridAdam,
        path: &Path,
    ) -> Result<()> {
        self.load_over(Some(world), adam, path)
    }
    fn describe_model(&mut self, key: &str, value: &str) -> Result<()> {
        ZeroManager::describe_model(self, key, value)
    }
}

#[cfg(test)]
mod tests;
