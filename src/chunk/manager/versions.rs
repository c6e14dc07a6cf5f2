//! Copies of tensor state between two registrations of the same parameters: PipeDream-2BW's
//! two weight versions are two sets of tensors in one manager, and the optimizer state is one
//! chain that the set stepped next takes over from the other.

use super::ChunkManager;
use crate::chunk::plan::ChunkPlan;
use crate::error::{Error, Result};
use crate::tensor::{ChunkKind, Stage, TensorId, TensorState};

impl ChunkManager {
    /// Copies lists `kinds` of each `(from, to)` pair's tensor `from` into tensor `to` (of the
    /// same shape): the parameter, the fp32 master, the momentum and the variance, through the
    /// chunks' host copies. `to` then holds a payload in each list copied.
    ///
    /// The optimizer lists copy between iterations and between the end of the backward pass and
    /// the step (the masters and moments a step is about to update); the parameter list only
    /// between iterations, and only while neither tensor's chunk may hold a gradient. Fails with
    /// [`Error::WrongStage`] at other times, and with [`Error::InvalidArgument`] for a pair of
    /// different shapes, a tensor paired with itself, or a parameter chunk that may hold a
    /// gradient; nothing is copied then.
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
        match self.stage {
            None => {}
            Some(Stage::Optimizer) if !params => {}
            Some(s) => {
                return Err(Error::WrongStage {
                    call: "copy_state (between iterations; masters and moments also between \
                           the backward pass and the step)"
                        .into(),
                    stage: s.name(),
                })
            }
        }
        for &(a, b) in pairs {
            let (ta, tb) = (self.meta(a)?, self.meta(b)?);
            if a == b || ta.shape != tb.shape {
                return Err(Error::InvalidArgument(format!(
                    "copy_state from '{}' {:?} to '{}' {:?}: two tensors of one shape",
                    ta.name, ta.shape, tb.name, tb.shape
                )));
            }
            for t in [ta, tb] {
                if params && self.grads_in[t.slot.group as usize] {
                    return Err(Error::InvalidArgument(format!(
                        "copy_state of '{}': its parameter chunk may hold gradients",
                        t.name
                    )));
                }
            }
        }
        for &kind in ChunkKind::ALL.iter().filter(|k| kinds.contains(k)) {
            let es = self.list_dtype(kind).size();
            for &(a, b) in pairs {
                let (sa, sb) = (self.meta(a)?.slot, self.meta(b)?.slot);
                let mut bytes = Vec::new();
                self.read_chunk_host(ChunkPlan::chunk_no(sa.group, kind) as usize, |h| {
                    bytes.extend_from_slice(&h[sa.offset * es..(sa.offset + sa.numel) * es]);
                    Ok(())
                })?;
                self.write_chunk_host(ChunkPlan::chunk_no(sb.group, kind) as usize, |h| {
                    h[sb.offset * es..sb.offset * es + bytes.len()].copy_from_slice(&bytes);
                })?;
                let s = &mut self.tensors[b.index()].state[kind.index()];
                if *s == TensorState::Free {
                    *s = TensorState::Hold;
                }
            }
        }
        Ok(())
    }
}
