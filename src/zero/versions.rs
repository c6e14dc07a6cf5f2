//! Copies of tensor state between two registrations of the same parameters on a ZeRO rank
//! (PipeDream-2BW's two weight versions, see [`crate::chunk::ChunkManager::copy_state`]).

use super::ZeroManager;
use crate::comm::Elem;
use crate::device::HostBuffer;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::{ChunkKind, TensorId};

impl ZeroManager {
    /// [`ChunkManager::copy_state`](crate::chunk::ChunkManager::copy_state) over the ranks:
    /// each `(from, to)` pair's lists `kinds` copied from the rank that owns `from` to the rank
    /// that owns `to`: in place when one rank owns both, else by a broadcast from `from`'s
    /// owner. Every rank must call it with the same pairs (a collective). The same moments and
    /// checks as the single manager's (the parameter list between iterations only); a failed
    /// check on any rank fails every rank before anything is copied. A failure while copying
    /// (an allocation, a transfer, a broadcast) leaves some pairs copied, and the other ranks
    /// fail in the broadcast they wait in, at the communicator's timeout at the latest.
    pub fn copy_state(
        &mut self,
        pairs: &[(TensorId, TensorId)],
        kinds: &[ChunkKind],
    ) -> Result<()> {
        let params = kinds.contains(&ChunkKind::Param);
        let checked = self.check_pairs(pairs, params);
        self.comm.agree(checked.is_ok())?;
        let local = checked?;
        self.local.note_state_copies(kinds);
        // the pairs this rank owns both tensors of, in one copy of its manager
        let mine: Vec<(TensorId, TensorId)> =
            local.iter().filter_map(|&(la, lb)| la.zip(lb)).collect();
        if !mine.is_empty() {
            self.local.copy_state(&mine, kinds)?;
        }
        // the others from their owners (the pairs are disjoint: the order does not matter)
        let (n, me) = (self.world(), self.comm.rank());
        let owner = |z: &Self, id: TensorId| z.tensors[id.index()].slot.group as usize % n;
        for &kind in ChunkKind::ALL.iter().filter(|k| kinds.contains(k)) {
            for (&(a, b), &(la, lb)) in pairs.iter().zip(&local) {
                let (oa, ob) = (owner(self, a), owner(self, b));
                if oa != ob {
                    self.send_state(kind, (a, la, oa), (lb, ob), me)?;
                }
            }
        }
        Ok(())
    }

    /// Records the next iteration as the warm-up again: this rank's manager's tide trace and the
    /// order of first uses its gathers are prefetched by (every rank must do the same).
    pub(crate) fn rewarm(&mut self) -> Result<()> {
        self.local.rewarm()?;
        self.prefetch.all_steady = false;
        Ok(())
    }

    /// Refuses tensors this rank owns whose parameter chunk may hold gradients.
    pub(crate) fn check_params_clean(&self, ids: &[TensorId]) -> Result<()> {
        let owned: Vec<TensorId> = ids
            .iter()
            .filter_map(|id| self.tensors.get(id.index()).and_then(|t| t.local))
            .collect();
        self.local.check_params_clean(&owned)
    }

    /// The pairs' ids in this rank's manager (`None` where another rank owns the tensor),
    /// after checking them: one shape, two tensors, and with `params` no owned parameter chunk
    /// that may hold gradients.
    fn check_pairs(
        &mut self,
        pairs: &[(TensorId, TensorId)],
        params: bool,
    ) -> Result<Vec<(Option<TensorId>, Option<TensorId>)>> {
        self.close()?;
        crate::chunk::check_copy(self.stage, params, &self.tensors, pairs, |t| {
            (&t.name, &t.shape)
        })?;
        let mut local = Vec::with_capacity(pairs.len());
        for &(a, b) in pairs {
            let (la, lb) = (self.tensors[a.index()].local, self.tensors[b.index()].local);
            if params {
                let owned: Vec<TensorId> = [la, lb].into_iter().flatten().collect();
                self.local.check_params_clean(&owned)?;
            }
            local.push((la, lb));
        }
        Ok(local)
    }

    /// Tensor `a`'s list `kind` (owned by rank `oa`, `la` here if that is this rank) into
    /// tensor `lb` on rank `ob`, by a broadcast from `oa` (every rank takes part).
    fn send_state(
        &mut self,
        kind: ChunkKind,
        (a, la, oa): (TensorId, Option<TensorId>, usize),
        (lb, ob): (Option<TensorId>, usize),
        me: usize,
    ) -> Result<()> {
        let dt = if kind == ChunkKind::Param {
            self.local.param_dtype()
        } else {
            DType::F32
        };
        let len = self.tensors[a.index()].slot.numel * dt.size();
        let dev = self.comm.device().clone();
        let buf = self.pool.alloc(len.max(4))?;
        let view = buf.view(0, len)?;
        if let (true, Some(la)) = (me == oa, la) {
            let bytes = self.local.tensor_bytes(la, kind)?;
            let host = HostBuffer::from_slice(&bytes)?;
            dev.copy_h2d(&self.stream, host, view)?.wait()?;
        }
        self.comm
            .broadcast(&self.stream, view, Elem::from(dt), oa)?;
        self.comm.wait(&self.stream)?;
        if let (true, Some(lb)) = (me == ob, lb) {
            let bytes = dev.download(&self.stream, view)?;
            self.local.set_tensor_bytes(lb, kind, &bytes)?;
        }
        Ok(())
    }
}
