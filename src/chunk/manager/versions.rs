//! Copies of tensor state between two registrations of the same parameters: PipeDream-2BW's
//! two weight versions are two sets of tensors in one manager, and the optimizer state is one
//! chain that the set stepped next takes over from the other.

use std::ops::Range;

use super::ChunkManager;
use crate::chunk::moments;
use crate::chunk::plan::ChunkPlan;
use crate::error::{Error, Result};
use crate::tensor::{ChunkKind, TensorId, TensorState};

impl ChunkManager {
    /// Copies lists `kinds` of each `(from, to)` pair's tensor `from` into tensor `to` (of the
    /// same shape): the parameter, the fp32 master, the momentum and the variance, through the
    /// chunks' host copies. `to` then holds a payload in each list copied.
    ///
    /// The optimizer lists copy between iterations and between the end of the backward pass and
    /// the step (the masters and moments a step is about to update); the parameter list only
    /// between iterations, and only while neither tensor's chunk may hold a gradient. Fails with
    /// [`Error::WrongStage`] at other times, and with [`Error::Conflict`] for a pair of
    /// different shapes, a tensor paired with itself, a tensor written twice or both read and
    /// written, or a parameter chunk that may hold a gradient; nothing is copied then. A host
    /// copy that fails midway leaves the manager unusable (as a failed checkpoint load does).
    ///
    /// ```
    /// use tidemem::prelude::*;
    /// use tidemem::tensor::ChunkKind;
    ///
    /// # fn main() -> tidemem::Result<()> {
    /// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
    /// let mut m = ChunkManager::new(dev, ManagerConfig::new(64, Policy::Tide))?;
    /// let a = m.register("a", &[8], Init::Uniform { seed: 1, lo: -1.0, hi: 1.0 })?;
    /// let b = m.register("b", &[8], Init::Zeros)?;
    /// m.copy_state(&[(a, b)], &ChunkKind::ALL)?;
    /// assert_eq!(m.read(b)?, m.read(a)?);
    /// assert_eq!(m.master(b)?, m.master(a)?);
    /// # Ok(()) }
    /// ```
    pub fn copy_state(
        &mut self,
        pairs: &[(TensorId, TensorId)],
        kinds: &[ChunkKind],
    ) -> Result<()> {
        self.usable()?;
        // registration closes here, as at a first fetch
        self.close()?;
        let params = kinds.contains(&ChunkKind::Param);
        self.check_copy(pairs, params)?;
        self.note_state_copies(kinds);
        for &kind in ChunkKind::ALL.iter().filter(|k| kinds.contains(k)) {
            for &(a, b) in pairs {
                let bytes = self.tensor_bytes(a, kind)?;
                self.set_tensor_bytes(b, kind, &bytes)?;
            }
        }
        Ok(())
    }

    /// Records the next iteration as the warm-up again, between iterations: the one recorded
    /// was unlike those to come (a pipeline stream's fill). Until the next trace is installed
    /// the scheduler works as in warm-up.
    pub(crate) fn rewarm(&mut self) -> Result<()> {
        self.usable()?;
        if self.stage.is_some() {
            return Err(Error::WrongStage {
                call: "rewarm (between iterations)".into(),
                stage: self.stage.map_or("idle", |s| s.name()),
            });
        }
        if let Some(s) = self.sched.as_mut() {
            s.forget_trace();
        }
        self.tracer.discard();
        self.warm = true;
        Ok(())
    }

    /// [`ChunkManager::copy_state`]'s checks: the moment, the pairs, and with `params` no
    /// parameter chunk that may hold gradients.
    pub(crate) fn check_copy(&self, pairs: &[(TensorId, TensorId)], params: bool) -> Result<()> {
        crate::chunk::check_copy(self.stage, params, &self.tensors, pairs, |t| {
            (&t.name, &t.shape)
        })?;
        if params {
            let ids: Vec<TensorId> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
            self.check_params_clean(&ids)?;
        }
        Ok(())
    }

    /// Refuses tensors whose parameter chunk may hold gradients (fetched in a backward pass and
    /// not rewritten by an optimizer pass since).
    pub(crate) fn check_params_clean(&self, ids: &[TensorId]) -> Result<()> {
        for &id in ids {
            let t = self.meta(id)?;
            if self.grads_in.get(t.slot.group as usize) == Some(&true) {
                return Err(Error::Conflict {
                    what: format!("copy_state of '{}'", t.name),
                    with: "its parameter chunk, which may hold gradients".into(),
                });
            }
        }
        Ok(())
    }

    /// Tensor `id`'s bytes in list `kind`, from its chunk's host copy (initial values if the
    /// chunk has no payload yet). 8-bit moments are the tensor's codes, then its blocks'
    /// scales.
    pub(crate) fn tensor_bytes(&mut self, id: TensorId, kind: ChunkKind) -> Result<Vec<u8>> {
        let spans = self.tensor_spans(id, kind)?;
        let slot = self.meta(id)?.slot;
        let mut bytes = Vec::new();
        self.read_chunk_host(ChunkPlan::chunk_no(slot.group, kind) as usize, |h| {
            for r in &spans {
                bytes.extend_from_slice(&h[r.clone()]);
            }
            Ok(())
        })?;
        Ok(bytes)
    }

    /// The byte ranges of tensor `id`'s chunk in list `kind` that hold its values.
    fn tensor_spans(&self, id: TensorId, kind: ChunkKind) -> Result<Vec<Range<usize>>> {
        let slot = self.meta(id)?.slot;
        if self.moment_map(kind).is_some() {
            let elems = self.layout.group_elems[slot.group as usize];
            let (codes, scales) = moments::tensor_bytes8(elems, slot.offset, slot.numel)?;
            return Ok(vec![codes, scales]);
        }
        let es = self.list_dtype(kind).size();
        let values = slot.offset * es..(slot.offset + slot.numel) * es;
        Ok(std::iter::once(values).collect())
    }

    /// Overwrites tensor `id`'s bytes in list `kind` (as [`ChunkManager::tensor_bytes`] reads
    /// them) through its chunk's host copy; the tensor holds a payload in that list from here.
    pub(crate) fn set_tensor_bytes(
        &mut self,
        id: TensorId,
        kind: ChunkKind,
        bytes: &[u8],
    ) -> Result<()> {
        let spans = self.tensor_spans(id, kind)?;
        let slot = self.meta(id)?.slot;
        let want: usize = spans.iter().map(|r| r.len()).sum();
        if bytes.len() != want {
            return Err(Error::SizeMismatch {
                src: bytes.len(),
                dst: want,
            });
        }
        self.write_chunk_host(ChunkPlan::chunk_no(slot.group, kind) as usize, |h| {
            let mut at = 0;
            for r in spans {
                h[r.clone()].copy_from_slice(&bytes[at..at + r.len()]);
                at += r.len();
            }
        })?;
        let s = &mut self.tensors[id.index()].state[kind.index()];
        if *s == TensorState::Free {
            *s = TensorState::Hold;
        }
        Ok(())
    }
}
