//! Passes over a store: the forward and backward stages of an iteration, and the recompute
//! and ahead passes inside the backward stage.

use std::cell::{RefCell, RefMut};
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use super::guard::Guard;
use super::host::{Backward, Forward, Handles, Host, PassKind, Sum};
use super::ParamStore;
use super::TOKEN;
use crate::device::{CachingAllocator, Device, PoolBlock, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Stage, TensorId};

/// A forward pass over a store (see [`ParamStore::forward`]).
pub type ForwardPass<'s> = Pass<'s, Forward>;

/// A backward pass over a store (see [`ParamStore::backward`]); its guards write gradients.
pub type BackwardPass<'s> = Pass<'s, Backward>;

struct State<'s> {
    store: RefCell<&'s mut dyn ParamStore>,
    handles: Handles,
    deferred: RefCell<Option<Error>>,
    sums: RefCell<Vec<Sum>>,
    /// The stage fetches and releases run in.
    stage: Stage,
    /// A forward pass recomputing inside the backward stage ([`BackwardPass::recompute`]).
    recompute: bool,
    /// A forward pass inside the backward stage for a later iteration's backward
    /// ([`BackwardPass::ahead`]; `recompute` is set too).
    ahead: bool,
}

impl<'s> State<'s> {
    fn new(store: &'s mut dyn ParamStore, handles: Handles, stage: Stage, recompute: bool) -> Self {
        State {
            store: RefCell::new(store),
            handles,
            deferred: RefCell::new(None),
            sums: RefCell::new(Vec::new()),
            stage,
            recompute,
            ahead: false,
        }
    }
}

impl Host for State<'_> {
    fn handles(&self) -> &Handles {
        &self.handles
    }
    fn store(&self) -> RefMut<'_, dyn ParamStore + '_> {
        RefMut::map(self.store.borrow_mut(), |s| &mut **s)
    }
    fn try_store(&self) -> Option<RefMut<'_, dyn ParamStore + '_>> {
        let s = self.store.try_borrow_mut().ok()?;
        Some(RefMut::map(s, |s| &mut **s))
    }
    fn defer(&self, e: Error) {
        self.deferred.borrow_mut().get_or_insert(e);
    }
    fn sums(&self) -> RefMut<'_, Vec<Sum>> {
        self.sums.borrow_mut()
    }
    fn release_stage(&self) -> Stage {
        self.stage
    }
}

/// One stage of an iteration over a store, from [`ParamStore::forward`] or
/// [`ParamStore::backward`]: ops [`fetch`](Pass::fetch) their parameters through it, take
/// device memory from its [`pool`](Pass::pool) and run on its [`stream`](Pass::stream).
/// [`finish`](Pass::finish) ends the stage; a pass dropped without it leaves the stage open
/// (the next `forward()` / `backward()` continues it).
///
/// Layers take `&ForwardPass<'_>` / `&BackwardPass<'_>`: fetching needs only a shared
/// reference, so several guards (nested layers) may be alive at once.
pub struct Pass<'s, K: PassKind> {
    state: State<'s>,
    _kind: PhantomData<fn() -> K>,
}

impl<K: PassKind> fmt::Debug for Pass<'_, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pass")
            .field("stage", &K::STAGE)
            .field("device", &self.state.handles.device.id())
            .finish()
    }
}

impl<'s, K: PassKind> Pass<'s, K> {
    pub(super) fn new(store: &'s mut dyn ParamStore) -> Result<Self> {
        let now = store.stage();
        let (ok, call) = match K::STAGE {
            Stage::Forward => (
                matches!(now, None | Some(Stage::Forward)),
                "store.forward() (the forward pass ended)",
            ),
            _ => (
                now == Some(Stage::Backward),
                "store.backward() (it opens once the forward pass finished)",
            ),
        };
        if !ok {
            return Err(Error::WrongStage {
                call: call.into(),
                stage: now.map_or("idle", Stage::name),
            });
        }
        let handles = Handles {
            device: store.device().clone(),
            stream: store.compute_arc(TOKEN),
            pool: store.pool().clone(),
            dtype: store.param_dtype(),
        };
        Ok(Pass {
            state: State::new(store, handles, K::STAGE, false),
            _kind: PhantomData,
        })
    }

    /// Fetches tensors for an op: their memory is on the device, ready on
    /// [`Pass::stream`], and does not move until the guard drops (or
    /// [`Guard::release`]). Fails with [`Error::UnknownTensor`] for an id the store never
    /// registered, and with an error a guard's drop could not return (a failed release).
    pub fn fetch(&self, ids: &[TensorId]) -> Result<Guard<'_, K>> {
        self.take_deferred()?;
        let mut store = self.state.store();
        let shapes = ids
            .iter()
            .map(|&id| store.tensor_shape(id).map(<[usize]>::to_vec))
            .collect::<Result<Vec<_>>>()?;
        let views = if self.state.ahead {
            store.fetch_ahead(ids, TOKEN)?
        } else if self.state.recompute {
            store.fetch_recompute(ids, TOKEN)?
        } else {
            store.fetch(ids, K::STAGE)?
        };
        drop(store);
        Ok(Guard {
            host: &self.state,
            ids: ids.to_vec(),
            views,
            shapes,
            overwritten: RefCell::new(vec![false; ids.len()]),
            open: true,
            _kind: PhantomData,
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.state.handles.device
    }

    /// The store's compute stream: enqueue every op on fetched memory here.
    pub fn stream(&self) -> &Stream {
        &self.state.handles.stream
    }

    /// The store's non-model pool, for activations and scratch buffers.
    pub fn pool(&self) -> &CachingAllocator {
        &self.state.handles.pool
    }

    /// A block of the pool holding `bytes` (token ids, targets, a host-built plan), copied on
    /// [`Pass::stream`] without the host waiting ([`Device::upload_to`]).
    pub fn upload(&self, bytes: &[u8]) -> Result<PoolBlock> {
        let h = &self.state.handles;
        let b = h.pool.alloc(bytes.len().max(4))?;
        h.device
            .upload_to(&h.stream, bytes, b.view(0, bytes.len())?)?;
        Ok(b)
    }

    /// The element type of parameters and gradients.
    pub fn param_dtype(&self) -> DType {
        self.state.handles.dtype
    }

    /// The stage this pass runs.
    pub fn stage(&self) -> Stage {
        K::STAGE
    }

    /// Ends the stage ([`ParamStore::end_forward`] or [`ParamStore::end_backward`]). Fails
    /// with an error a guard's drop could not return, and in backward if a parameter's
    /// gradient was accumulated over some of its uses but not written at its last.
    pub fn finish(self) -> Result<()> {
        self.take_deferred()?;
        if self.state.recompute {
            // the backward stage goes on
            return Ok(());
        }
        let mut store = self.state.store();
        match K::STAGE {
            Stage::Forward => store.end_forward(),
            _ => {
                if let Some(s) = self.state.sums.borrow().first() {
                    return Err(Error::Conflict {
                        what: "finishing the backward pass".into(),
                        with: format!(
                            "the gradient of tensor {}, accumulated over {} backward uses but not \
                             its last",
                            s.id, s.uses
                        ),
                    });
                }
                store.end_backward()
            }
        }
    }

    fn take_deferred(&self) -> Result<()> {
        match self.state.deferred.borrow_mut().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Pass<'_, Forward> {
    /// Counts `times` more forward uses of each of `ids` (an id listed twice counts twice)
    /// without fetching them: the uses of forward ops that will run later, in
    /// [`recompute`](Pass::recompute) passes of the backward pass (a pipeline stage's forwards
    /// after its first backward), so that each tensor's gradient is written at its last
    /// backward use. Unlike a fetch and release per use, it records no moment and moves no
    /// chunk (and gathers nothing on a ZeRO rank). Only for tensors this forward pass has
    /// fetched already ([`Error::Conflict`](crate::Error::Conflict) otherwise);
    /// not in a recompute pass ([`Error::WrongStage`](crate::Error::WrongStage)).
    pub fn declare_uses(&self, ids: &[TensorId], times: u32) -> Result<()> {
        self.take_deferred()?;
        if self.state.recompute {
            return Err(crate::Error::WrongStage {
                call: "declaring forward uses in a recompute or ahead pass".into(),
                stage: "backward",
            });
        }
        self.state.store().declare_forward_uses(ids, times, TOKEN)
    }
}

impl Pass<'_, Backward> {
    /// A forward pass inside this backward stage, to recompute the forward of a checkpointed
    /// segment (activation checkpointing): layers run their `forward` on it as on any
    /// [`ForwardPass`], and each of its fetches is a backward-stage moment that counts one more
    /// use of its tensors on both sides, so it never writes a gradient and the segment's
    /// backward that follows still finds each tensor's last use. Its
    /// [`finish`](Pass::finish) reports a release error its guards deferred and leaves the
    /// backward stage open.
    ///
    /// ```
    /// use tidemem::nn::{Act, Linear};
    /// use tidemem::prelude::*;
    ///
    /// # fn main() -> tidemem::Result<()> {
    /// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
    /// let mut cfg = ManagerConfig::new(64, Policy::Tide);
    /// cfg.param_dtype = DType::F32;
    /// let mut m = ChunkManager::new(dev, cfg)?;
    /// let fc = Linear::register(&mut m, "fc", 4, 4, true, None)?;
    /// let x_host = [1.0f32; 8];
    ///
    /// let fwd = m.forward()?;
    /// let x = Act::upload(fwd.pool(), fwd.stream(), 2, 4, DType::F32, &x_host)?;
    /// drop(fc.forward(&fwd, &x)?); // the output is not kept
    /// fwd.finish()?;
    ///
    /// let mut bwd = m.backward()?;
    /// let re = bwd.recompute()?;
    /// let _y = fc.forward(&re, &x)?; // recomputed where the backward needs it
    /// re.finish()?;
    /// let dy = Act::upload(bwd.pool(), bwd.stream(), 2, 4, DType::F32, &[1.0; 8])?;
    /// fc.backward(&bwd, &x, &dy, false)?;
    /// bwd.finish()?;
    /// assert_eq!(m.read(fc.bias.unwrap())?, vec![2.0; 4]);
    /// # Ok(()) }
    /// ```
    pub fn recompute(&mut self) -> Result<ForwardPass<'_>> {
        self.inner_forward(false)
    }

    /// A forward pass inside this backward stage whose own backward runs in a later iteration:
    /// a pipeline stage's forwards on the next weight version under PipeDream-2BW, between the
    /// backwards of the current batch. Its fetches are backward-stage moments that only read
    /// and count no use, so they touch no gradient and the tensors stay as they were for the
    /// step that ends this iteration (which leaves tensors with no gradient untouched). Only for
    /// tensors this iteration has not used otherwise
    /// ([`Error::Conflict`](crate::Error::Conflict)). On a ZeRO rank the fetch
    /// gathers the tensors' communication groups (every rank of the group makes the same
    /// fetches) and reduces nothing for them.
    ///
    /// ```
    /// use tidemem::nn::{Act, Linear};
    /// use tidemem::prelude::*;
    ///
    /// # fn main() -> tidemem::Result<()> {
    /// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
    /// let mut cfg = ManagerConfig::new(64, Policy::Tide);
    /// cfg.param_dtype = DType::F32;
    /// let mut m = ChunkManager::new(dev, cfg)?;
    /// let now = Linear::register(&mut m, "now", 4, 4, true, None)?;
    /// let next = Linear::register(&mut m, "next", 4, 4, true, None)?;
    /// let x_host = [1.0f32; 8];
    ///
    /// let fwd = m.forward()?;
    /// let x = Act::upload(fwd.pool(), fwd.stream(), 2, 4, DType::F32, &x_host)?;
    /// drop(now.forward(&fwd, &x)?);
    /// fwd.finish()?;
    /// let mut bwd = m.backward()?;
    /// let ahead = bwd.ahead()?;
    /// let _y_next = next.forward(&ahead, &x)?; // its backward comes after the step
    /// ahead.finish()?;
    /// let dy = Act::upload(bwd.pool(), bwd.stream(), 2, 4, DType::F32, &[1.0; 8])?;
    /// now.backward(&bwd, &x, &dy, false)?;
    /// bwd.finish()?;
    /// let (w_now, w_next) = (m.master(now.weight)?, m.master(next.weight)?);
    /// let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(0.1)))?;
    /// m.step(&mut adam)?;
    /// assert_ne!(m.master(now.weight)?, w_now);
    /// assert_eq!(m.master(next.weight)?, w_next); // no gradient: untouched
    /// # Ok(()) }
    /// ```
    pub fn ahead(&mut self) -> Result<ForwardPass<'_>> {
        self.inner_forward(true)
    }

    fn inner_forward(&mut self, ahead: bool) -> Result<ForwardPass<'_>> {
        self.take_deferred()?;
        let handles = Handles {
            device: self.state.handles.device.clone(),
            stream: Arc::clone(&self.state.handles.stream),
            pool: self.state.handles.pool.clone(),
            dtype: self.state.handles.dtype,
        };
        let store: &mut dyn ParamStore = &mut **self.state.store.get_mut();
        Ok(Pass {
            state: State {
                ahead,
                ..State::new(store, handles, Stage::Backward, true)
            },
            _kind: PhantomData,
        })
    }
}
