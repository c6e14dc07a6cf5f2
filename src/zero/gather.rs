//! Gather buffers of a [`ZeroManager`], and the prefetch that starts gathers ahead of their
//! first use.

use std::sync::Arc;

use super::ZeroManager;
use crate::comm::Elem;
use crate::device::{Event, PoolBlock};
use crate::error::{Error, Result};
use crate::tensor::{Stage, TensorId, TensorState};

pub(super) struct Gather {
    pub(super) buf: Arc<PoolBlock>,
    /// Whether this rank's owned chunk is held fetched in the rank's manager (backward).
    pub(super) held: bool,
    /// For a gather made ahead: recorded on the communication stream after its all-gather;
    /// the compute stream waits for it before touching the buffer.
    pub(super) ready: Option<Event>,
    /// Whether a fetch has used the buffer (false for a gather made ahead until its first
    /// fetch), which decides a forward's first uses the same way on every rank.
    pub(super) used: bool,
}

/// Prefetch of gathers: the recorded order of first uses and where this stage is in it.
#[derive(Default)]
pub(super) struct Prefetch {
    pub(super) depth: usize,
    /// Communication groups in the order forward (0) and backward (1) first used them during
    /// warm-up.
    pub(super) order: [Vec<usize>; 2],
    pub(super) recording: bool,
    pub(super) cursor: usize,
    pub(super) on_order: bool,
    /// Room for `depth` gather buffers, held in the pool during warm-up.
    pub(super) reserve: Vec<PoolBlock>,
    /// Every rank's manager has finished its warm-up (agreed in `step`, so that every rank
    /// records and prefetches alike).
    pub(super) all_steady: bool,
}

impl ZeroManager {
    /// Gathers communication group `j`: this rank's owned chunk into its slot, then the
    /// all-gather, on the compute stream, or on the communication stream when `ahead`.
    pub(super) fn gather(&mut self, j: usize, stage: Stage, ahead: bool) -> Result<()> {
        let (n, r, es) = (self.world(), self.comm.rank(), self.es());
        let slot = self.slot_elems(j) * es;
        let owned = self.owned_local(j);
        let ids: Vec<TensorId> = owned.iter().map(|&(_, id)| id).collect();
        let already_fwd = !ids.is_empty()
            && self.local.state(ids[0], crate::chunk::ChunkKind::Param)?
                == TensorState::HoldAfterFwd;
        let mut held = false;
        let buf = Arc::new(self.pool.alloc(n * slot)?);
        let dev = self.comm.device().clone();
        let mine = buf.view(r * slot, slot)?;
        dev.memset(&self.stream, mine, 0)?;
        if (stage == Stage::Forward && already_fwd) || (stage == Stage::Backward && ahead) {
            // A second forward gather (a shared parameter): the chunk was fetched once this
            // forward; its values are unchanged, copy them without a second use. A backward
            // gather made ahead: copy the values without a use too; the owned chunk is fetched
            // and held for its gradients at the group's first use, where the tide has it.
            for &(t, id) in &owned {
                let zt = &self.tensors[t as usize];
                let (off, len) = (zt.slot.offset * es, zt.slot.numel * es);
                self.local
                    .copy_param_into(id, buf.view(r * slot + off, len)?)?;
            }
        } else if !ids.is_empty() {
            let views = self.local.fetch(&ids, stage)?;
            for (v, &(t, _)) in views.iter().zip(&owned) {
                let off = self.tensors[t as usize].slot.offset * es;
                dev.copy_d2d(
                    &self.stream,
                    v.view(),
                    buf.view(r * slot + off, v.view().len())?,
                )?;
            }
            drop(views);
            if stage == Stage::Forward {
                self.local.release(&ids, stage)?;
            } else {
                held = true;
            }
        }
        let elem = Elem::from(self.local.param_dtype());
        let mut ready = None;
        if ahead {
            let filled = dev.new_event()?;
            dev.record(&self.stream, &filled)?;
            dev.wait_event(&self.comm_stream, &filled)?;
        }
        let stream = if ahead {
            &self.comm_stream
        } else {
            &*self.stream
        };
        self.comm.all_gather(
            stream,
            buf.view(r * slot, slot)?,
            buf.view(0, n * slot)?,
            elem,
        )?;
        if ahead {
            let done = dev.new_event()?;
            dev.record(&self.comm_stream, &done)?;
            ready = Some(done);
            self.stats.prefetched += 1;
        }
        self.stats.gathers += 1;
        self.stats.gathered_bytes += (n * slot) as u64;
        self.gathers[j] = Some(Gather {
            buf,
            held,
            used: !ahead,
            ready,
        });
        Ok(())
    }

    /// Orders the compute stream after the all-gather of group `j` if it was made ahead.
    pub(super) fn wait_ready(&self, j: usize) -> Result<()> {
        match self.gathers[j].as_ref().and_then(|g| g.ready.as_ref()) {
            Some(ev) => self.comm.device().wait_event(&self.stream, ev),
            None => Ok(()),
        }
    }

    /// The first use of group `j` in `stage`: recorded during warm-up; afterwards, if it is the
    /// use the record expects, the next `depth` groups of the record are gathered ahead.
    pub(super) fn first_use(&mut self, j: usize, stage: Stage) -> Result<()> {
        let p = &mut self.prefetch;
        if p.depth == 0 {
            return Ok(());
        }
        let order = &mut p.order[usize::from(stage == Stage::Backward)];
        if p.recording {
            order.push(j);
            return Ok(());
        }
        if !p.on_order || order.get(p.cursor) != Some(&j) {
            p.on_order = false;
            return Ok(());
        }
        p.cursor += 1;
        let next: Vec<usize> = order[p.cursor..(p.cursor + p.depth).min(order.len())].to_vec();
        for k in next {
            if self.gathers[k].is_none() {
                self.gather(k, stage, true)?;
            }
        }
        Ok(())
    }

    /// Fetches and holds this rank's owned chunk of group `j` for its gradients, if a gather
    /// made ahead in backward did not.
    pub(super) fn hold_owned(&mut self, j: usize) -> Result<()> {
        if self.gathers[j].as_ref().is_none_or(|g| g.held) {
            return Ok(());
        }
        let ids: Vec<TensorId> = self.owned_local(j).iter().map(|&(_, id)| id).collect();
        if !ids.is_empty() {
            drop(self.local.fetch(&ids, Stage::Backward)?);
            self.gathers[j].as_mut().expect("gathered").held = true;
        }
        Ok(())
    }

    pub(super) fn take_gather(&mut self, j: usize) -> Result<Gather> {
        let g = self.gathers[j].as_ref().expect("gathered");
        if Arc::strong_count(&g.buf) > 1 {
            return Err(Error::ViewAlive {
                what: format!("communication group {j}"),
                during: "release",
            });
        }
        // A prefetched buffer never used: the pool may hand it to the compute stream next.
        self.wait_ready(j)?;
        Ok(self.gathers[j].take().expect("gathered"))
    }
}
