//! The protocol of a checkpoint that several ranks save together, one file a rank: every file
//! carries its rank, the world size and the save's identity, each rank keeps the newest save
//! every rank holds as `path.prev` while a new one replaces it, and a load takes the newest
//! save every rank holds or fails on every rank (see the [module docs](crate::zero#checkpoints)).
//! A [`ZeroManager`](super::ZeroManager)'s shards and a model-parallel rank's whole manager
//! ([`ParamStore::save_rank`](crate::store::ParamStore::save_rank)) are saved through it: a
//! [`ChunkManager`] (the shard's, or the rank's) and the optimizer's counters.

use std::path::{Path, PathBuf};

use crate::checkpoint::{bad, failpoint, io_at, save_target, sibling, Reader, Written};
use crate::chunk::ChunkManager;
use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::optim::HybridAdam;

/// What a rank's file holds, which names its metadata keys (`<prefix>.rank`, `.world`,
/// `.save`) and its failpoints (`<prefix>.save.<point>.rank<r>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Holds {
    /// A ZeRO rank's shard of the model data.
    Shard,
    /// The whole manager of a tensor-, sequence- or pipeline-parallel rank.
    Manager,
}

impl Holds {
    fn prefix(self) -> &'static str {
        match self {
            Holds::Shard => "zero",
            Holds::Manager => "ranks",
        }
    }

    fn key(self, what: &str) -> String {
        format!("{}.{what}", self.prefix())
    }

    fn name(self) -> &'static str {
        match self {
            Holds::Shard => "a ZeRO rank's shard",
            Holds::Manager => "a model-parallel rank's file (tensor, sequence or pipeline)",
        }
    }
}

/// The previous generation of the file `target`.
pub(crate) fn previous(target: &Path) -> PathBuf {
    sibling(target, ".prev")
}

/// One of a rank's files: the current or the previous generation.
struct Generation {
    file: Reader,
    save: i64,
    current: bool,
}

/// A new save's identity on rank 0: the time in microseconds (at least 1, above the files
/// of before save identities).
fn now_micros() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    i64::try_from(since).unwrap_or(i64::MAX).max(1)
}

/// Before `new` replaces its target: makes the previous generation hold save `keep` (the
/// newest save every rank holds, if any), renaming the current file to it if that holds it.
fn keep_previous(
    new: &Written,
    path: &Path,
    have: &[(bool, i64)],
    keep: Option<i64>,
) -> Result<()> {
    let Some(keep) = keep else {
        return Ok(()); // no save is complete: nothing to keep
    };
    if have.contains(&(false, keep)) {
        return Ok(()); // kept by an earlier save that did not finish
    }
    if have.contains(&(true, keep)) {
        let prev = previous(new.target());
        std::fs::rename(new.target(), &prev)
            .map_err(io_at("keeping the previous generation of", path))?;
    }
    Ok(())
}

/// The ranks of `comm`, each saving or loading its own file of one checkpoint.
pub(crate) struct RankFiles<'a> {
    pub comm: &'a Communicator,
    pub holds: Holds,
}

impl RankFiles<'_> {
    /// The save a file's metadata names (0 for a file from before save identities).
    fn save_of(&self, file: &Reader) -> Result<i64> {
        let key = self.holds.key("save");
        match file.metadata()?.get(&key) {
            None => Ok(0),
            Some(v) => v
                .parse()
                .map_err(|_| file.bad(format!("its {key} is '{v}', not a number"))),
        }
    }

    /// This rank's files of `path`, current first, with their saves; at least one, or the
    /// error of the current file (one that cannot be read is passed over when the other can).
    fn generations(&self, path: &Path) -> Result<Vec<Generation>> {
        let target = save_target(path)?;
        let mut found = Vec::new();
        let mut errors = Vec::new();
        for (file, current) in [(path.to_path_buf(), true), (previous(&target), false)] {
            match Reader::open(&file).and_then(|file| {
                let save = self.save_of(&file)?;
                Ok(Generation {
                    file,
                    save,
                    current,
                })
            }) {
                Ok(g) => found.push(g),
                Err(e) => errors.push(e),
            }
        }
        match errors.into_iter().next() {
            Some(e) if found.is_empty() => Err(e),
            _ => Ok(found),
        }
    }

    /// The newest save every rank holds, given the saves this rank's files hold; or `None`,
    /// with the first candidate (the oldest of the ranks' newest saves, which some rank then
    /// lacks). The newest save of a rank may be one a kill left on that rank alone, so the
    /// candidates go down from the oldest of the ranks' newest saves, two all-reduces each,
    /// until every rank holds one; every rank takes the same path, since the candidates are
    /// all-reduced.
    fn newest_common(&self, saves: &[i64]) -> Result<(Option<i64>, i64)> {
        let mut bound = i64::MAX;
        let mut first = None;
        loop {
            let mine = saves.iter().copied().filter(|&s| s <= bound).max();
            let mut candidate = [mine.unwrap_or(i64::MIN)];
            self.comm.all_reduce_host(&mut candidate, ReduceOp::Min)?;
            let c = candidate[0];
            let first = *first.get_or_insert(c);
            if c == i64::MIN {
                return Ok((None, first));
            }
            let mut everywhere = [i32::from(saves.contains(&c))];
            self.comm.all_reduce_host(&mut everywhere, ReduceOp::Min)?;
            if everywhere[0] == 1 {
                return Ok((Some(c), first));
            }
            // a rank lacks it: it is complete nowhere
            bound = c - 1;
        }
    }

    /// Saves `m`'s chunks and `adam`'s counters as this rank's file at `path` (as
    /// [`HybridAdam::save_checkpoint`] does), with the rank, the world size and the save's
    /// identity in the metadata; `ready` is this rank's readiness. Every rank must call it; a
    /// failure on one rank fails the save on every rank, and no file is replaced unless every
    /// rank wrote its own.
    pub(crate) fn save(
        &self,
        path: &Path,
        ready: Result<()>,
        m: &mut ChunkManager,
        adam: &HybridAdam,
    ) -> Result<()> {
        let meta = ready.and_then(|()| adam.checkpoint_metadata());
        let rank = self.comm.rank();
        let prefix = self.holds.prefix();
        let point = |p: &str| failpoint(&format!("{prefix}.save.{p}.rank{rank}"));
        // every rank leaves here alike (an error everywhere unless all are ready), and otherwise
        // makes every later collective of the save
        self.comm.agree(meta.is_ok())?;
        let mut meta = meta?;
        // the saves this rank's files hold now (unreadable ones are replaced)
        let have: Vec<(bool, i64)> = self
            .generations(path)
            .map(|gs| gs.iter().map(|g| (g.current, g.save)).collect())
            .unwrap_or_default();
        let saves: Vec<i64> = have.iter().map(|h| h.1).collect();
        let (keep, _) = self.newest_common(&saves)?;
        let newest = saves.iter().copied().max();
        let drawn = if rank == 0 { now_micros() } else { i64::MIN };
        let mut id = [drawn.max(newest.map_or(i64::MIN, |n| n.saturating_add(1)))];
        self.comm.all_reduce_host(&mut id, ReduceOp::Max)?;
        meta.insert(self.holds.key("rank"), rank.to_string());
        meta.insert(self.holds.key("world"), self.comm.world().to_string());
        meta.insert(self.holds.key("save"), id[0].to_string());
        let written = m.save_checkpoint_unpersisted(path, &meta);
        point("written");
        self.comm.agree(written.is_ok())?;
        let written = written?;
        let prev = previous(written.target());
        let done = keep_previous(&written, path, &have, keep).and_then(|()| {
            point("kept");
            written.persist()
        });
        point("renamed");
        // a rename that failed on one rank is reported on every rank, and every previous
        // generation stays
        self.comm.agree(done.is_ok())?;
        done?;
        point("agreed");
        // every rank holds the new save: the previous generation is not needed any more (one
        // left by a failed removal is replaced by the next save)
        let _ = std::fs::remove_file(prev);
        point("cleaned");
        Ok(())
    }

    /// Checks that `file` was saved by this rank of a group of this size, as what this group
    /// saves.
    fn check_rank(&self, file: &Reader) -> Result<()> {
        let meta = file.metadata()?;
        let (r, n) = (self.comm.rank().to_string(), self.comm.world().to_string());
        let get = |h: Holds, k: &str| meta.get(&h.key(k));
        let (rank, world) = (get(self.holds, "rank"), get(self.holds, "world"));
        if rank == Some(&r) && world == Some(&n) {
            return Ok(());
        }
        if rank.is_none() {
            let other = [Holds::Shard, Holds::Manager]
                .into_iter()
                .find(|&h| h != self.holds && get(h, "rank").is_some());
            return Err(file.bad(match other {
                Some(h) => format!(
                    "it is {} (rank {} of {}), and this run loads {}: resume with the layout \
                     that saved it",
                    h.name(),
                    get(h, "rank").map_or("?", String::as_str),
                    get(h, "world").map_or("?", String::as_str),
                    self.holds.name()
                ),
                None => format!(
                    "it names no rank: a one-rank checkpoint, or one saved before ranks were \
                     recorded; this run loads {}, rank {r} of {n}",
                    self.holds.name()
                ),
            }));
        }
        Err(file.bad(format!(
            "it was saved by rank {} of {}, this is rank {r} of {n}",
            rank.map_or("?", String::as_str),
            world.map_or("?", String::as_str),
        )))
    }

    /// Loads `m`'s chunks and `adam`'s counters from this rank's file of the newest save every
    /// rank holds at `path`; `ready` is this rank's readiness. Every rank must call it: the
    /// ranks agree on the save, each checks its file (rank, optimizer metadata, tensors,
    /// checksums), the ranks agree that every file fits and holds the same step, and only then
    /// does any rank load. Otherwise every rank fails and none changes: a rank whose files hold
    /// another save fails with [`Error::SaveMismatch`], the others with [`Error::RankFailed`].
    pub(crate) fn load(
        &self,
        path: &Path,
        ready: Result<()>,
        m: &mut ChunkManager,
        adam: &mut HybridAdam,
    ) -> Result<()> {
        // every local failure goes into the agreement, so that no rank waits for one that
        // returned early; the file stays open from check to load
        let listed = ready.and_then(|()| self.generations(path));
        self.comm.agree(listed.is_ok())?;
        let gens = listed?;
        let found: Vec<i64> = gens.iter().map(|g| g.save).collect();
        let (common, first) = self.newest_common(&found)?;
        let mismatch = || Error::SaveMismatch {
            path: path.to_path_buf(),
            rank: self.comm.rank(),
            wanted: first,
            found: found.clone(),
        };
        let mine = match gens.into_iter().find(|g| Some(g.save) == common) {
            Some(g) => self
                .check_rank(&g.file)
                .and_then(|()| {
                    let meta = m.check_checkpoint(&g.file)?;
                    adam.check_metadata(&meta)?;
                    adam.checkpoint_steps(&meta)
                })
                .map(|steps| Some((steps, g.file))),
            // no save every rank holds: a rank that lacks the first candidate says so, the
            // others hear of it from the agreement
            None if found.contains(&first) => Ok(None),
            None => Err(mismatch()),
        };
        self.comm.agree(mine.is_ok())?;
        // (a rank always lacks the first candidate when no save is common, so `None` does not
        // pass the agreement)
        let (steps, file) = mine?.ok_or_else(mismatch)?;
        // the same save has the same step everywhere; files of before save identities are
        // all save 0, and must at least agree on the step
        let steps = i64::try_from(steps).unwrap_or(i64::MAX);
        let (mut lo, mut hi) = ([steps], [steps]);
        self.comm.all_reduce_host(&mut lo, ReduceOp::Min)?;
        self.comm.all_reduce_host(&mut hi, ReduceOp::Max)?;
        if lo != hi {
            return Err(bad(
                path,
                format!(
                    "the ranks' checkpoints were saved at different steps ({} to {}): no rank \
                     loads",
                    lo[0], hi[0]
                ),
            ));
        }
        let done = m
            .load_checkpoint_file(&file, |_| Ok(()))
            .and_then(|meta| adam.restore_metadata(&meta));
        // a load that failed on one rank after the agreement is reported on every rank
        self.comm.agree(done.is_ok())?;
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_previous_generation_is_a_sibling_and_saves_grow() {
        assert_eq!(
            previous(Path::new("ckpt/rank1.safetensors")),
            PathBuf::from("ckpt/rank1.safetensors.prev")
        );
        let a = now_micros();
        assert!(a > 0 && now_micros() >= a);
        assert_eq!(Holds::Shard.key("save"), "zero.save");
        assert_eq!(Holds::Manager.key("rank"), "ranks.rank");
    }
}
