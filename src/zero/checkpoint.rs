//! Checkpoints of a [`ZeroManager`]: one file per rank, each at the path its rank names, saved
//! so that the set of files always holds one complete save every rank can load, whenever the
//! process is killed (see the [module docs](crate::zero#checkpoints)).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::ZeroManager;
use crate::checkpoint::{bad, failpoint, io_at, save_target, sibling, Reader, Written};
use crate::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::optim::HybridAdam;

/// Checkpoint metadata keys of a [`ZeroManager`] shard.
const META_RANK: &str = "zero.rank";
const META_WORLD: &str = "zero.world";
const META_SAVE: &str = "zero.save";

/// The previous generation of the file `target`.
fn previous(target: &Path) -> PathBuf {
    sibling(target, ".prev")
}

/// One of a rank's files: the current or the previous generation.
struct Generation {
    file: Reader,
    save: i64,
    current: bool,
}

/// The save a file's metadata names (0 for a file from before save identities).
fn save_of(file: &Reader) -> Result<i64> {
    match file.metadata()?.get(META_SAVE) {
        None => Ok(0),
        Some(v) => v
            .parse()
            .map_err(|_| file.bad(format!("its {META_SAVE} is '{v}', not a number"))),
    }
}

/// This rank's files of `path`, current first, with their saves; at least one, or the error
/// of the current file (one that cannot be read is passed over when the other can).
fn generations(path: &Path) -> Result<Vec<Generation>> {
    let target = save_target(path)?;
    let mut found = Vec::new();
    let mut errors = Vec::new();
    for (file, current) in [(path.to_path_buf(), true), (previous(&target), false)] {
        match Reader::open(&file).and_then(|file| {
            let save = save_of(&file)?;
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

impl ZeroManager {
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

    /// Saves this rank's shard (the tensors of the chunks it owns, by their global names) and
    /// `adam`'s counters to `path`, as [`HybridAdam::save_checkpoint`] does, with the rank, the
    /// world size and the save's identity in the metadata: every rank saves its own file.
    /// Every rank must call it.
    ///
    /// The ranks agree (one-word all-reduces) at every step of the save, so that a failure on
    /// one rank (a full disk, a non-finite value, a target that is a directory) fails the save
    /// on every rank, the failing rank with its own error and the others with
    /// [`Error::RankFailed`] naming it; no file is replaced unless every rank wrote its own.
    /// While the new files replace the old ones, each rank keeps the newest save every rank
    /// holds as `path.prev`, removed once every rank holds the new save: a process killed at
    /// any point leaves a set of files [`ZeroManager::load_checkpoint`] loads, the earlier
    /// save or the new one (see the [module docs](crate::zero#checkpoints)). Between
    /// iterations only; closes registration.
    pub fn save_checkpoint(&mut self, adam: &HybridAdam, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let rank = self.comm.rank();
        let point = |p: &str| failpoint(&format!("zero.save.{p}.rank{rank}"));
        let ready = self
            .idle("save_checkpoint")
            .and_then(|()| self.close())
            .and_then(|()| adam.checkpoint_metadata());
        // every rank leaves here alike (an error everywhere unless all are ready), and otherwise
        // makes every later collective of the save
        self.comm.agree(ready.is_ok())?;
        let mut meta = ready?;
        // the saves this rank's files hold now (unreadable ones are replaced)
        let have: Vec<(bool, i64)> = generations(path)
            .map(|gs| gs.iter().map(|g| (g.current, g.save)).collect())
            .unwrap_or_default();
        let saves: Vec<i64> = have.iter().map(|h| h.1).collect();
        let (keep, _) = self.newest_common(&saves)?;
        let newest = saves.iter().copied().max();
        let drawn = if rank == 0 { now_micros() } else { i64::MIN };
        let mut id = [drawn.max(newest.map_or(i64::MIN, |n| n.saturating_add(1)))];
        self.comm.all_reduce_host(&mut id, ReduceOp::Max)?;
        meta.insert(META_RANK.into(), rank.to_string());
        meta.insert(META_WORLD.into(), self.world().to_string());
        meta.insert(META_SAVE.into(), id[0].to_string());
        let written = self.local.save_checkpoint_unpersisted(path, &meta);
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

    /// Loads this rank's shard and `adam`'s counters from the files that
    /// [`ZeroManager::save_checkpoint`] wrote at `path` on the same rank of a group of the same
    /// size. Every rank must call it: the ranks agree on the newest save every rank has a file
    /// of (a save a kill interrupted leaves the earlier one in `path.prev`, see the
    /// [module docs](crate::zero#checkpoints)); each checks its file of that save (metadata,
    /// tensors, checksums); the ranks agree that every file fits, and only then does any rank
    /// load. Otherwise every
    /// rank fails and none changes: a rank whose files hold another save fails with
    /// [`Error::SaveMismatch`] (files of different runs, or saves, put together), the others
    /// with [`Error::RankFailed`]. Between iterations only; closes registration.
    pub fn load_checkpoint(&mut self, adam: &mut HybridAdam, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        // every local failure, closing registration included, goes into the agreement, so that
        // no rank waits for one that returned early; the file stays open from check to load
        let listed = self
            .idle("load_checkpoint")
            .and_then(|()| self.close())
            .and_then(|()| generations(path));
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
                .check_shard(adam, &g.file)
                .map(|meta| Some((meta, g.file))),
            // no save every rank holds: a rank that lacks the first candidate says so, the
            // others hear of it from the agreement
            None if found.contains(&first) => Ok(None),
            None => Err(mismatch()),
        };
        self.comm.agree(mine.is_ok())?;
        // (a rank always lacks the first candidate when no save is common, so `None` does not
        // pass the agreement)
        let (meta, file) = mine?.ok_or_else(mismatch)?;
        // the same save has the same step everywhere; files of before save identities are
        // all save 0, and must at least agree on the step
        let steps = adam.checkpoint_steps(&meta)? as i64;
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
        let done = self
            .local
            .load_checkpoint_file(&file, |_| Ok(()))
            .and_then(|meta| adam.restore_metadata(&meta));
        // a load that failed on one rank after the agreement is reported on every rank
        self.comm.agree(done.is_ok())?;
        done
    }

    /// This rank's file fits: saved by this rank of this group, for this optimizer and these
    /// tensors, its checksums verified. Returns its metadata.
    fn check_shard(&self, adam: &HybridAdam, file: &Reader) -> Result<BTreeMap<String, String>> {
        let meta = file.metadata()?;
        let (r, n) = (self.comm.rank().to_string(), self.world().to_string());
        if meta.get(META_RANK) != Some(&r) || meta.get(META_WORLD) != Some(&n) {
            return Err(file.bad(format!(
                "it was saved by rank {} of {}, this is rank {r} of {n}",
                meta.get(META_RANK).map_or("?", String::as_str),
                meta.get(META_WORLD).map_or("?", String::as_str),
            )));
        }
        adam.check_metadata(&meta)?;
        self.local.check_checkpoint(file)
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
    }
}
