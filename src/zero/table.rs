//! The tensor table of a [`ZeroManager`]: registration, closing it into this rank's manager,
//! the communication groups of tensors, and every tensor's state.

use super::ZeroManager;
use crate::chunk::{check_distinct, numel_of, Slot};
use crate::device::DeviceView;
use crate::error::{Error, Result};
use crate::tensor::{next_state, Init, TensorId, TensorState, TrainEvent};

pub(super) struct ZTensor {
    pub(super) name: String,
    pub(super) shape: Vec<usize>,
    pub(super) init: Init,
    pub(super) slot: Slot,
    pub(super) state: TensorState,
    pub(super) fwd_uses: u32,
    pub(super) bwd_uses: u32,
    /// Fetches ahead ([`ZeroManager::fetch_ahead`]) not yet released.
    pub(super) ahead: u32,
    pub(super) grad: bool,
    /// Id in this rank's manager, for tensors of owned groups.
    pub(super) local: Option<TensorId>,
    /// The share of its squared gradient norm the optimizer counts (see
    /// [`crate::chunk::ChunkManager::set_norm_share`]).
    pub(super) norm_share: f64,
}

impl ZeroManager {
    /// Registers a parameter on every rank (same calls, same order everywhere).
    pub fn register(&mut self, name: &str, shape: &[usize], init: Init) -> Result<TensorId> {
        if self.closed {
            return Err(Error::Conflict {
                what: format!("registering '{name}'"),
                with: "a closed registration (it closed at the first fetch)".into(),
            });
        }
        let numel = numel_of(name, shape)?;
        let slot = self.layout.push(numel)?;
        self.tensors.push(ZTensor {
            name: name.to_string(),
            shape: shape.to_vec(),
            init,
            slot,
            state: TensorState::Free,
            fwd_uses: 0,
            bwd_uses: 0,
            ahead: 0,
            grad: false,
            local: None,
            norm_share: 1.0,
        });
        Ok(TensorId(self.tensors.len() as u32 - 1))
    }

    /// Closes the open chunk and pads the layout with empty chunk groups so that the next
    /// tensor starts a group rank 0 owns. Registering the same tensors again after it packs them
    /// as the first time, each copy owned by the rank that owns the original: a state copy
    /// between the two ([`ZeroManager::copy_state`], PipeDream-2BW's two weight versions) then
    /// stays on every rank, with no message. Before the first fetch.
    pub fn align_to_ranks(&mut self) -> Result<()> {
        if self.closed {
            return Err(Error::Conflict {
                what: "align_to_ranks".into(),
                with: "a closed registration (it closed at the first fetch)".into(),
            });
        }
        self.layout.pad_groups(self.comm.world());
        Ok(())
    }

    /// Counts `share` of tensor `id`'s squared gradient norm in the gradient statistics (see
    /// [`crate::chunk::ChunkManager::set_norm_share`]); before the first fetch.
    pub fn set_norm_share(&mut self, id: TensorId, share: f64) -> Result<()> {
        if self.closed {
            return Err(Error::Conflict {
                what: "setting a norm share".into(),
                with: "a closed registration (it closed at the first fetch)".into(),
            });
        }
        if !(share > 0.0 && share <= 1.0) {
            return Err(Error::BadValue {
                what: "a norm share".into(),
                value: share,
                want: "in (0, 1]",
            });
        }
        self.tensors
            .get_mut(id.index())
            .ok_or(Error::UnknownTensor { id: id.0 })?
            .norm_share = share;
        Ok(())
    }

    /// Whether this rank owns the chunk of `id`.
    pub fn owns(&self, id: TensorId) -> bool {
        self.tensors
            .get(id.index())
            .is_some_and(|t| t.slot.group as usize % self.comm.world() == self.comm.rank())
    }

    /// Name and shape of a tensor, and its slot in the global layout.
    pub fn tensor_info(&self, id: TensorId) -> Result<(&str, &[usize], Slot)> {
        let t = self
            .tensors
            .get(id.index())
            .ok_or(Error::UnknownTensor { id: id.0 })?;
        Ok((&t.name, &t.shape, t.slot))
    }
    /// Closes registration: the owned groups go into this rank's manager, one chunk each, at the
    /// same offsets as in the global layout.
    pub(super) fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        let (n, r) = (self.world(), self.comm.rank());
        let groups = self.layout.groups();
        if groups < n {
            return Err(Error::TooFew {
                what: format!(
                    "chunk groups the model packs into, one for each of {n} ranks (use smaller \
                     chunks)"
                ),
                got: groups,
                need: n,
            });
        }
        if self.prefetch.depth > 0 && self.prefetch.reserve.is_empty() {
            // Room for `depth` gather buffers during warm-up, one block each so that each can
            // serve a gather later; allocated first, so a failure changes nothing.
            let largest = (0..groups.div_ceil(n))
                .map(|j| n * self.slot_elems(j) * self.es())
                .max()
                .unwrap_or(0);
            let depth = self.prefetch.depth.min(groups.div_ceil(n));
            let reserve = (0..depth)
                .map(|_| self.pool.alloc(largest))
                .collect::<Result<Vec<_>>>()?;
            self.prefetch.reserve = reserve;
        }
        for g in (r..groups).step_by(n) {
            self.local.seal_chunk()?;
            for &t in &self.layout.group_tensors[g].clone() {
                let zt = &self.tensors[t as usize];
                let id = self.local.register(&zt.name, &zt.shape, zt.init.clone())?;
                let (_, _, slot) = self.local.tensor_info(id)?;
                if slot.offset != zt.slot.offset {
                    return Err(Error::Internal {
                        what: format!(
                            "tensor '{}' packs at offset {} locally but {} globally",
                            zt.name, slot.offset, zt.slot.offset
                        ),
                    });
                }
                self.local.set_norm_share(id, zt.norm_share)?;
                self.tensors[t as usize].local = Some(id);
            }
        }
        self.local.close()?;
        self.gathers = (0..groups.div_ceil(n)).map(|_| None).collect();
        self.closed = true;
        Ok(())
    }

    /// Elements of one rank's slot in communication group `j` (its largest chunk).
    pub(super) fn slot_elems(&self, j: usize) -> usize {
        let n = self.world();
        let end = ((j + 1) * n).min(self.layout.groups());
        self.layout.group_elems[j * n..end]
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
    }

    /// Tensors of communication group `j`.
    pub(super) fn comm_group_tensors(&self, j: usize) -> Vec<u32> {
        let n = self.world();
        let end = ((j + 1) * n).min(self.layout.groups());
        (j * n..end)
            .flat_map(|g| self.layout.group_tensors[g].iter().copied())
            .collect()
    }

    /// Local ids of the tensors of the group this rank owns in communication group `j`.
    pub(super) fn owned_local(&self, j: usize) -> Vec<(u32, TensorId)> {
        let g = j * self.world() + self.comm.rank();
        if g >= self.layout.groups() {
            return Vec::new();
        }
        self.layout.group_tensors[g]
            .iter()
            .map(|&t| (t, self.tensors[t as usize].local.expect("owned")))
            .collect()
    }
    pub(super) fn check(&self, ids: &[TensorId], ev: TrainEvent) -> Result<()> {
        for &id in ids {
            let t = self
                .tensors
                .get(id.index())
                .ok_or(Error::UnknownTensor { id: id.0 })?;
            if next_state(t.state, ev).is_none() {
                return Err(Error::IllegalTransition {
                    tensor: t.name.clone(),
                    list: "param",
                    state: t.state,
                    event: ev,
                });
            }
        }
        check_distinct(ids)
    }

    pub(super) fn apply(&mut self, id: TensorId, ev: TrainEvent) {
        let t = &mut self.tensors[id.index()];
        t.state = next_state(t.state, ev).expect("checked");
    }

    pub(super) fn comm_group(&self, id: TensorId) -> usize {
        self.tensors[id.index()].slot.group as usize / self.world()
    }

    pub(super) fn view_of(&self, id: TensorId) -> Result<DeviceView<'_>> {
        let t = &self.tensors[id.index()];
        let (n, es) = (self.world(), self.es());
        let j = t.slot.group as usize / n;
        let q = t.slot.group as usize % n;
        let g = self.gathers[j].as_ref().ok_or_else(|| Error::Internal {
            what: format!("tensor '{}' is not gathered on this rank", t.name),
        })?;
        let slot = self.slot_elems(j) * es;
        g.buf.view(q * slot + t.slot.offset * es, t.slot.numel * es)
    }
}
