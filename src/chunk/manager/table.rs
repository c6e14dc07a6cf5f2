//! The manager's tensor table: registration, and every tensor's state in the four lists.

use super::{ChunkManager, HostSlot};
use crate::chunk::layout::Slot;
use crate::chunk::plan::ChunkPlan;
use crate::chunk::tensors::numel_of;
use crate::error::{Error, Result};
use crate::tensor::{next_state, ChunkKind, Init, TensorId, TensorState, TrainEvent};
use crate::tide::ChunkNo;

pub(super) struct TensorMeta {
    pub(super) name: String,
    pub(super) shape: Vec<usize>,
    pub(super) init: Init,
    pub(super) slot: Slot,
    pub(super) state: [TensorState; 4],
    pub(super) fwd_uses: u32,
    pub(super) bwd_uses: u32,
    /// Fetches for a later iteration's forward ([`ChunkManager::fetch_ahead`]) not yet released.
    pub(super) ahead: u32,
    pub(super) grad: bool,
    /// The share of the gradient's squared norm this process counts (see
    /// [`ChunkManager::set_norm_share`]).
    pub(super) norm_share: f64,
}

impl ChunkManager {
    /// Registers a parameter; it is packed after the previous one. Registration closes at the
    /// first fetch.
    pub fn register(&mut self, name: &str, shape: &[usize], init: Init) -> Result<TensorId> {
        if self.sched.is_some() {
            return Err(Error::Conflict {
                what: format!("registering '{name}'"),
                with: "a closed registration (it closed at the first fetch)".into(),
            });
        }
        let numel = numel_of(name, shape)?;
        let slot = self.layout.push(numel)?;
        self.tensors.push(TensorMeta {
            name: name.to_string(),
            shape: shape.to_vec(),
            init,
            slot,
            state: [TensorState::Free; 4],
            fwd_uses: 0,
            bwd_uses: 0,
            ahead: 0,
            grad: false,
            norm_share: 1.0,
        });
        Ok(TensorId(self.tensors.len() as u32 - 1))
    }

    /// Closes the open chunk: the next registered tensor starts a new chunk group (e.g. at a
    /// module boundary).
    pub(crate) fn seal_chunk(&mut self) -> Result<()> {
        if self.sched.is_some() {
            return Err(Error::Conflict {
                what: "sealing a chunk".into(),
                with: "a closed registration (it closed at the first fetch)".into(),
            });
        }
        self.layout.seal();
        Ok(())
    }

    /// Name, shape and slot of a tensor.
    pub fn tensor_info(&self, id: TensorId) -> Result<(&str, &[usize], Slot)> {
        let t = self.meta(id)?;
        Ok((&t.name, &t.shape, t.slot))
    }

    /// State of a tensor in one list.
    pub fn state(&self, id: TensorId, kind: ChunkKind) -> Result<TensorState> {
        Ok(self.meta(id)?.state[kind.index()])
    }

    /// Number of registered tensors.
    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// State of a chunk: the highest-priority state of its tensors, `None` for RELEASED (no
    /// payload anywhere).
    pub fn chunk_state(&self, group: usize, kind: ChunkKind) -> Option<TensorState> {
        if group >= self.layout.groups() {
            return None;
        }
        let c = ChunkPlan::chunk_no(group as u32, kind) as usize;
        let p = self.payload.get(c)?;
        if matches!(p.host, HostSlot::None) && p.device.is_none() {
            return None;
        }
        self.layout.group_tensors.get(group).map(|ts| {
            ts.iter()
                .map(|&t| self.tensors[t as usize].state[kind.index()])
                .max_by_key(|s| s.priority())
                .unwrap_or(TensorState::Free)
        })
    }

    /// Id of the device buffer holding chunk `kind` of `group`, if it is on the device (a chunk
    /// that moves gets a new buffer).
    pub fn device_buffer_id(&self, group: usize, kind: ChunkKind) -> Option<u64> {
        if group >= self.layout.groups() {
            return None;
        }
        let c = ChunkPlan::chunk_no(group as u32, kind) as usize;
        self.payload.get(c)?.device.as_ref().map(|b| b.id())
    }

    pub(super) fn meta(&self, id: TensorId) -> Result<&TensorMeta> {
        self.tensors
            .get(id.index())
            .ok_or(Error::UnknownTensor { id: id.0 })
    }

    pub(super) fn chunk_of(&self, id: TensorId, kind: ChunkKind) -> ChunkNo {
        ChunkPlan::chunk_no(self.tensors[id.index()].slot.group, kind)
    }

    pub(super) fn check_transition(
        &self,
        ids: &[TensorId],
        kind: ChunkKind,
        ev: TrainEvent,
    ) -> Result<()> {
        for &id in ids {
            let t = self.meta(id)?;
            let s = t.state[kind.index()];
            if next_state(s, ev).is_none() {
                return Err(Error::IllegalTransition {
                    tensor: t.name.clone(),
                    list: kind.name(),
                    state: s,
                    event: ev,
                });
            }
        }
        Ok(())
    }

    pub(super) fn apply(&mut self, id: TensorId, kind: ChunkKind, ev: TrainEvent) {
        let t = &mut self.tensors[id.index()];
        let s = &mut t.state[kind.index()];
        *s = next_state(*s, ev).expect("transition checked before");
    }

    pub(super) fn check_nothing_fetched(&self, end_of: &str) -> Result<()> {
        match self
            .tensors
            .iter()
            .find(|t| t.state[0] == TensorState::Compute)
        {
            Some(t) => Err(Error::Conflict {
                what: format!("the end of {end_of}"),
                with: format!("tensor '{}', still fetched (release it first)", t.name),
            }),
            None => Ok(()),
        }
    }

    /// Tensors of group `g`: id, offset and length in elements, and whether a gradient was
    /// written into its parameter slot this iteration.
    /// Counts `share` (in (0, 1]) of tensor `id`'s squared gradient norm in the optimizer's
    /// gradient statistics: `1/P` for a parameter every rank of a tensor-parallel group of `P`
    /// holds whole, so that the statistics summed over the group count it once (the global
    /// norm clipping needs). 1 by default.
    pub fn set_norm_share(&mut self, id: TensorId, share: f64) -> Result<()> {
        if !(share > 0.0 && share <= 1.0) {
            return Err(Error::BadValue {
                what: "a norm share".into(),
                value: share,
                want: "in (0, 1]",
            });
        }
        self.meta(id)?;
        self.tensors[id.index()].norm_share = share;
        Ok(())
    }

    /// The tensors of group `g` whose norm share is not 1, as (element range in the group,
    /// share), with `written` only those whose gradient was written this iteration.
    pub(crate) fn partial_shares(
        &self,
        g: usize,
        written: bool,
    ) -> Vec<(std::ops::Range<usize>, f64)> {
        self.layout.group_tensors[g]
            .iter()
            .map(|&t| &self.tensors[t as usize])
            .filter(|m| m.norm_share != 1.0 && (m.grad || !written))
            .map(|m| (m.slot.offset..m.slot.offset + m.slot.numel, m.norm_share))
            .collect()
    }

    pub(super) fn group_tensors(&self, g: usize) -> Vec<(TensorId, usize, usize, bool)> {
        self.layout.group_tensors[g]
            .iter()
            .map(|&t| {
                let m = &self.tensors[t as usize];
                (TensorId(t), m.slot.offset, m.slot.numel, m.grad)
            })
            .collect()
    }
}
