//! Checkpoints of a [`ZeroManager`]: one file per rank, each at the path its rank names, saved
//! so that the set of files always holds one complete save every rank can load, whenever the
//! process is killed (the protocol is [`RankFiles`]'; see the
//! [module docs](crate::zero#checkpoints)).

use std::path::Path;

use super::rank_files::{Holds, RankFiles};
use super::ZeroManager;
use crate::comm::Communicator;
use crate::error::Result;
use crate::optim::HybridAdam;

impl ZeroManager {
    /// Records what the model is, saved with every shard and checked by every load (the public
    /// path: [`ParamStore::describe_model`](crate::store::ParamStore::describe_model)).
    pub(crate) fn describe_model(&mut self, key: &str, value: &str) -> Result<()> {
        self.local.describe_model(key, value)
    }

    /// Saves this rank's shard (the tensors of the chunks it owns, by their global names) and
    /// `adam`'s counters to `path`, as [`HybridAdam::save_checkpoint`] does, with the rank, the
    /// world size and the save's identity in the metadata: every rank saves its own file.
    /// Every rank must call it.
    ///
    /// The ranks agree (one-word all-reduces) at every step of the save, so that a failure on
    /// one rank (a full disk, a non-finite value, a target that is a directory) fails the save
    /// on every rank, the failing rank with its own error and the others with
    /// [`Error::RankFailed`](crate::Error::RankFailed) naming it; no file is replaced unless
    /// every rank wrote its own. While the new files replace the old ones, each rank keeps the
    /// newest save every rank holds as `path.prev`, removed once every rank holds the new save:
    /// a process killed at any point leaves a set of files [`ZeroManager::load_checkpoint`]
    /// loads, the earlier save or the new one (see the [module docs](crate::zero#checkpoints)).
    /// Between iterations only; closes registration.
    pub fn save_checkpoint(&mut self, adam: &HybridAdam, path: impl AsRef<Path>) -> Result<()> {
        self.save_over(None, adam, path.as_ref())
    }

    /// [`ZeroManager::save_checkpoint`] with the ranks of `world` (this group's ranks and
    /// those of the other groups a model-parallel run saves with it) agreeing on the save, or
    /// this group's alone; the file carries the rank and size of that group.
    pub(crate) fn save_over(
        &mut self,
        world: Option<&Communicator>,
        adam: &HybridAdam,
        path: &Path,
    ) -> Result<()> {
        let ready = self.idle("save_checkpoint").and_then(|()| self.close());
        RankFiles {
            comm: world.unwrap_or(&self.comm),
            holds: Holds::Shard,
        }
        .save(path, ready, &mut self.local, adam)
    }

    /// Loads this rank's shard and `adam`'s counters from the files that
    /// [`ZeroManager::save_checkpoint`] wrote at `path` on the same rank of a group of the same
    /// size. Every rank must call it: the ranks agree on the newest save every rank has a file
    /// of (a save a kill interrupted leaves the earlier one in `path.prev`, see the
    /// [module docs](crate::zero#checkpoints)); each checks its file of that save (metadata,
    /// tensors, checksums); the ranks agree that every file fits, and only then does any rank
    /// load. Otherwise every rank fails and none changes: a rank whose files hold another save
    /// fails with [`Error::SaveMismatch`](crate::Error::SaveMismatch) (files of different
    /// runs, or saves, put together), the others with
    /// [`Error::RankFailed`](crate::Error::RankFailed). Between iterations only; closes
    /// registration.
    pub fn load_checkpoint(&mut self, adam: &mut HybridAdam, path: impl AsRef<Path>) -> Result<()> {
        self.load_over(None, adam, path.as_ref())
    }

    /// [`ZeroManager::load_checkpoint`] of a save of [`ZeroManager::save_over`] `world`.
    pub(crate) fn load_over(
        &mut self,
        world: Option<&Communicator>,
        adam: &mut HybridAdam,
        path: &Path,
    ) -> Result<()> {
        let ready = self.idle("load_checkpoint").and_then(|()| self.close());
        RankFiles {
            comm: world.unwrap_or(&self.comm),
            holds: Holds::Shard,
        }
        .load(path, ready, &mut self.local, adam)
    }
}
