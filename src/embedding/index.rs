//! The index maps of the embedding cache and its per-batch decisions, without any memory: which
//! rows miss, which cached rows to evict (and which of those need writing back), where each
//! missed row goes, and the slot of every id.
//!
//! # Memory per row
//! Two 32-bit maps over the table's `N` rows, **8 bytes per row**: `id → host row` (the frequency
//! permutation) and `host row → slot`. Per cached slot: `slot → host row` (4 B), an eviction key
//! (8 B), a use count (4 B), a dirty flag (1 B) and a bit marking the slots a decision uses, 17
//! bytes and a bit per slot. For Criteo 1TB (177.9M rows, 1% cached) that is 1.45 GB against
//! 2.85 GB for two 64-bit maps. The ids and rows of the last few prefetched batches are kept
//! too (8 bytes per id, see [`CacheIndex::prefetch`]).

use super::policy::{key, row_of_key, CachePolicy};
use crate::error::{Error, Result};

/// Marks an empty slot or an uncached row.
pub const NONE: u32 = u32::MAX;

/// Batches of recent prefetches whose rows the index keeps for their prepares, at least.
const PREFETCHED_BATCHES: usize = 4;

/// What preparing one batch decided. Moves must run in order: write back, then admit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CachePlan {
    /// The cache slot of every id of the batch, in the batch's order.
    pub slots: Vec<u32>,
    /// Evicted dirty rows to copy device → host before their slots are reused: `(slot, host row)`.
    pub write_back: Vec<(u32, u32)>,
    /// Missed rows to copy host → device: `(slot, host row)`, in ascending host row order.
    pub admit: Vec<(u32, u32)>,
    /// Evicted rows (clean and dirty).
    pub evicted: usize,
    /// Id occurrences whose row was cached before this batch.
    pub hits: usize,
    /// Id occurrences whose row was not.
    pub misses: usize,
    /// Distinct rows the batch uses.
    pub(crate) unique: usize,
}

/// Counters over the life of a [`CacheIndex`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Batches prepared.
    pub batches: u64,
    /// Id occurrences served from the cache.
    pub hits: u64,
    /// Id occurrences that missed.
    pub misses: u64,
    /// Rows admitted (host → device).
    pub admitted: u64,
    /// Rows evicted.
    pub evicted: u64,
    /// Dirty rows written back (device → host), by eviction or flush.
    pub(crate) written_back: u64,
    /// Rows admitted by [`CacheIndex::prefetch`] (also counted in `admitted`).
    pub prefetched: u64,
}

impl IndexStats {
    /// Hits over id occurrences (0 when nothing was prepared).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

/// Index maps and eviction decisions of a cache of `capacity` rows over a table of `rows` rows.
#[derive(Clone, Debug)]
pub struct CacheIndex {
    id_to_row: Vec<u32>,
    row_to_slot: Vec<u32>,
    slot_to_row: Vec<u32>,
    keys: Vec<u64>,
    /// One bit per slot: the slot is used by (or kept for) the decision being made.
    used: Vec<u64>,
    count: Vec<u32>,
    dirty: Vec<bool>,
    /// Free slots, lowest on top.
    free: Vec<u32>,
    tick: u32,
    policy: CachePolicy,
    stats: IndexStats,
    /// Ids and host rows of the batches of the last [`CacheIndex::prefetch`]: preparing one of
    /// them reuses its rows instead of looking every id up again.
    prefetched: Vec<(Vec<u32>, Vec<u32>)>,
}

impl CacheIndex {
    /// An empty cache of `capacity` slots over `rows` rows, in identity order (id `i` is host
    /// row `i`) until [`CacheIndex::reorder`]. Its maps are refused with [`Error::TooLarge`]
    /// when they would not fit in the machine's memory.
    pub fn new(rows: usize, capacity: usize, policy: CachePolicy) -> Result<Self> {
        if rows == 0 || capacity == 0 {
            let (what, got) = if rows == 0 {
                ("rows of an embedding cache", rows)
            } else {
                ("slots of an embedding cache", capacity)
            };
            return Err(Error::TooFew {
                what: what.into(),
                got,
                need: 1,
            });
        }
        if rows >= NONE as usize || capacity >= NONE as usize {
            let (what, requested) = if rows >= NONE as usize {
                ("rows of an embedding cache (u32 indices)", rows)
            } else {
                ("slots of an embedding cache (u32 indices)", capacity)
            };
            return Err(Error::TooLarge {
                what: what.into(),
                requested: requested as u128,
                limit: u64::from(NONE) - 1,
            });
        }
        let capacity = capacity.min(rows);
        // two u32 maps a row; per slot its row, key, use bit, count, dirty flag and free entry
        let what = || format!("bytes of the index of a cache of {capacity} slots over {rows} rows");
        let per_rows = crate::limits::host_bytes(what, &[rows, 8])?;
        let per_slots = crate::limits::host_bytes(what, &[capacity, 4 + 8 + 1 + 4 + 1 + 4])?;
        crate::limits::host_bytes(what, &[per_rows.saturating_add(per_slots)])?;
        Ok(Self {
            id_to_row: (0..rows as u32).collect(),
            row_to_slot: vec![NONE; rows],
            slot_to_row: vec![NONE; capacity],
            keys: vec![0; capacity],
            used: vec![0; capacity.div_ceil(64)],
            count: vec![0; capacity],
            dirty: vec![false; capacity],
            free: (0..capacity as u32).rev().collect(),
            tick: 0,
            policy,
            stats: IndexStats::default(),
            prefetched: Vec::new(),
        })
    }

    /// Rows of the table.
    pub fn rows(&self) -> usize {
        self.row_to_slot.len()
    }

    /// Slots of the cache.
    pub fn capacity(&self) -> usize {
        self.slot_to_row.len()
    }

    /// Occupied slots.
    pub fn cached(&self) -> usize {
        self.capacity() - self.free.len()
    }

    /// The policy.
    pub fn policy(&self) -> &CachePolicy {
        &self.policy
    }

    /// Replaces the policy of an empty cache (keys are set as rows are admitted).
    pub(crate) fn set_policy(&mut self, policy: CachePolicy) {
        debug_assert_eq!(self.cached(), 0);
        self.policy = policy;
    }

    /// Counters so far.
    pub fn stats(&self) -> IndexStats {
        self.stats
    }

    /// Bytes of host memory the maps take (with the rows kept of prefetched batches).
    pub(crate) fn map_bytes(&self) -> usize {
        let memo: usize = self
            .prefetched
            .iter()
            .map(|(ids, rows)| 4 * (ids.len() + rows.len()))
            .sum();
        8 * self.rows() + 17 * self.capacity() + self.capacity().div_ceil(64) * 8 + memo
    }

    /// The host row of `id`.
    pub fn row_of(&self, id: u32) -> Option<u32> {
        self.id_to_row.get(id as usize).copied()
    }

    /// The host row of every id: `perm[id] = row`.
    pub(crate) fn permutation(&self) -> &[u32] {
        &self.id_to_row
    }

    /// The slot holding host row `row`, if cached.
    pub fn slot_of_row(&self, row: u32) -> Option<u32> {
        match self.row_to_slot.get(row as usize) {
            Some(&s) if s != NONE => Some(s),
            _ => None,
        }
    }

    /// The host row in `slot`, if occupied.
    pub fn row_in_slot(&self, slot: u32) -> Option<u32> {
        match self.slot_to_row.get(slot as usize) {
            Some(&r) if r != NONE => Some(r),
            _ => None,
        }
    }

    /// Whether `slot` holds a row changed since it was admitted.
    #[cfg(test)]
    fn is_dirty(&self, slot: u32) -> bool {
        self.dirty.get(slot as usize).copied().unwrap_or(false)
    }

    /// Orders host rows by descending `counts[id]` (ties by id), so the most frequent id becomes
    /// host row 0. Returns the new permutation; the caller moves the table's rows to match.
    /// Only an empty cache can be reordered.
    pub fn reorder(&mut self, counts: &[u64]) -> Result<&[u32]> {
        if counts.len() != self.rows() {
            return Err(Error::Length {
                what: "frequency counts for a reorder (one per row)".into(),
                got: counts.len(),
                expected: self.rows(),
            });
        }
        if self.cached() != 0 {
            return Err(Error::OutOfOrder {
                call: "reorder",
                needs: "an empty cache (flush and clear it)",
            });
        }
        self.prefetched.clear();
        let mut order: Vec<u32> = (0..self.rows() as u32).collect();
        order.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
        for (row, &id) in order.iter().enumerate() {
            self.id_to_row[id as usize] = row as u32;
        }
        Ok(&self.id_to_row)
    }

    /// Checks every id and maps it to its host row.
    pub(crate) fn rows_of(&self, ids: &[u32]) -> Result<Vec<u32>> {
        ids.iter()
            .enumerate()
            .map(|(i, &id)| {
                self.row_of(id).ok_or_else(|| Error::IdOutOfRange {
                    table: None,
                    id: u64::from(id),
                    position: i,
                    rows: self.rows(),
                })
            })
            .collect()
    }

    /// Decides one batch: maps ids to slots, evicting and admitting as needed. Fails, changing
    /// nothing, on an id out of range or a batch with more distinct rows than slots.
    pub fn prepare(&mut self, ids: &[u32]) -> Result<CachePlan> {
        // a batch the last prefetch looked up: its rows are known (the ids were checked then)
        let known = self
            .prefetched
            .iter()
            .position(|(p, _)| p.as_slice() == ids)
            .map(|k| self.prefetched.remove(k).1);
        let (rows, slots) = self.lookup(ids, 0, known)?;
        self.decide(&rows, slots, &[], false)
    }

    /// Checks every id and maps it to its host row and current slot (or [`NONE`]); with the
    /// rows `known`, only to the slots. Large batches are split over threads: the maps are
    /// read-only here, and their random reads are most of a decision's time. An error names
    /// the first bad id, at `base` + its position.
    fn lookup(
        &self,
        ids: &[u32],
        base: usize,
        known: Option<Vec<u32>>,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        let n = ids.len();
        let have_rows = known.is_some();
        let mut rows = known.unwrap_or_else(|| vec![0u32; n]);
        let mut slots = vec![0u32; n];
        let work = |ids: &[u32], rows: &mut [u32], slots: &mut [u32], at: usize| {
            if have_rows {
                for (r, s) in rows.iter().zip(slots) {
                    *s = self.row_to_slot[*r as usize];
                }
                return None;
            }
            for (i, ((&id, r), s)) in ids.iter().zip(rows).zip(slots).enumerate() {
                match self.id_to_row.get(id as usize) {
                    Some(&row) => {
                        *r = row;
                        *s = self.row_to_slot[row as usize];
                    }
                    None => return Some((at + i, id)),
                }
            }
            None
        };
        let threads = std::thread::available_parallelism()
            .map_or(1, |t| t.get())
            .min(8)
            .min(n >> 15)
            .max(1);
        let bad = if threads == 1 {
            work(ids, &mut rows, &mut slots, base)
        } else {
            let chunk = n.div_ceil(threads);
            std::thread::scope(|sc| {
                let hs: Vec<_> = ids
                    .chunks(chunk)
                    .zip(rows.chunks_mut(chunk))
                    .zip(slots.chunks_mut(chunk))
                    .enumerate()
                    .map(|(k, ((i, r), s))| sc.spawn(move || work(i, r, s, base + k * chunk)))
                    .collect();
                hs.into_iter()
                    .filter_map(|h| h.join().expect("a lookup thread does not panic"))
                    .min()
            })
        };
        match bad {
            Some((i, id)) => Err(Error::IdOutOfRange {
                table: None,
                id: u64::from(id),
                position: i,
                rows: self.rows(),
            }),
            None => Ok((rows, slots)),
        }
    }

    /// Makes the union of `batches` resident in one decision, so that preparing each of them
    /// afterwards hits on every id and moves nothing (as long as nothing else is prepared in
    /// between). The slots in `keep` (a batch still in flight) are not evicted either.
    ///
    /// The index keeps the ids and host rows of these batches (and of a few earlier prefetched
    /// batches not prepared yet), so that preparing one of them skips the id → row lookup.
    ///
    /// The plan's `hits` and `misses` count distinct rows of the union, `slots` is empty, and
    /// the hit and miss counters are left to the batches' own prepares; admitted rows count in
    /// [`IndexStats::prefetched`]. Not available with [`CachePolicy::Optimal`], whose keys follow
    /// its trace batch by batch. Fails, changing nothing, on an id out of range, a slot in
    /// `keep` that holds no row, or a union (with `keep`) larger than the cache.
    pub fn prefetch(&mut self, batches: &[&[u32]], keep: &[u32]) -> Result<CachePlan> {
        if matches!(self.policy, CachePolicy::Optimal(_)) {
            return Err(Error::Conflict {
                what: "prefetch".into(),
                with: "the offline optimal policy, whose keys follow its trace batch by batch"
                    .into(),
            });
        }
        if let Some(&s) = keep.iter().find(|&&s| self.row_in_slot(s).is_none()) {
            return Err(Error::Empty {
                what: format!("slot {s}, to keep,"),
            });
        }
        let total = batches.iter().map(|b| b.len()).sum();
        let (mut rows, mut slots) = (Vec::with_capacity(total), Vec::with_capacity(total));
        let mut looked_up = Vec::with_capacity(batches.len());
        for b in batches {
            let (r, s) = self.lookup(b, rows.len(), None)?;
            rows.extend_from_slice(&r);
            slots.extend(s);
            looked_up.push((b.to_vec(), r));
        }
        let mut plan = self.decide(&rows, slots, keep, true)?;
        plan.slots.clear();
        // the batches of earlier prefetches not prepared yet are kept too, up to a few
        let keep_batches = batches.len().max(PREFETCHED_BATCHES);
        let old = self
            .prefetched
            .len()
            .saturating_sub(keep_batches - looked_up.len());
        self.prefetched.drain(..old);
        self.prefetched.extend(looked_up);
        Ok(plan)
    }

    /// One decision over `rows` (whose current slots are `cached`): the slots of `keep` and of
    /// every cached row in `rows` are safe from eviction; missed rows are admitted. A prefetch
    /// does not count uses.
    fn decide(
        &mut self,
        rows: &[u32],
        cached: Vec<u32>,
        keep: &[u32],
        prefetch: bool,
    ) -> Result<CachePlan> {
        if let CachePolicy::Optimal(t) = &self.policy {
            t.check_current()?;
        }
        // a bit per slot (the whole set stays in the first cache levels, unlike a stamp per
        // slot), set without a branch on whether it was set
        self.used.fill(0);
        let used = &mut self.used;
        let mut mark = |s: u32| -> usize {
            let (w, b) = ((s >> 6) as usize, s & 63);
            let was = (used[w] >> b) & 1;
            used[w] |= 1 << b;
            1 - was as usize
        };
        let mut plan = CachePlan::default();
        let mut missed: Vec<u32> = Vec::new();
        let mut hit_unique = 0usize;
        for (&row, &slot) in rows.iter().zip(&cached) {
            if slot != NONE {
                hit_unique += mark(slot);
                plan.hits += 1;
            } else {
                missed.push(row);
            }
        }
        let kept: usize = keep.iter().map(|&s| mark(s)).sum();
        plan.slots = cached;
        plan.misses = missed.len();
        missed.sort_unstable();
        missed.dedup();
        plan.unique = hit_unique + missed.len();
        if kept + plan.unique > self.capacity() {
            // The next decision clears the used bits: nothing else changed.
            return Err(Error::CacheTooSmall {
                unique: kept + plan.unique,
                capacity: self.capacity(),
            });
        }
        if prefetch {
            plan.hits = hit_unique;
            plan.misses = missed.len();
        }
        if let CachePolicy::Optimal(t) = &self.policy {
            // every row, hits too, before anything changes: the keys it sets after must not fail
            for &r in rows {
                t.next_use(r)?;
            }
        }
        // Victims: the occupied slots this decision does not use, smallest keys first.
        let need = missed.len().saturating_sub(self.free.len());
        if need > 0 {
            // keys alone (every key ends in its row, so its slot is found again), half the
            // bytes to select over
            let used = &self.used;
            let mut cand: Vec<u64> = self
                .slot_to_row
                .iter()
                .zip(&self.keys)
                .enumerate()
                .filter(|&(s, (&row, _))| row != NONE && (used[s >> 6] >> (s & 63)) & 1 == 0)
                .map(|(_, (_, &k))| k)
                .collect();
            if need < cand.len() {
                cand.select_nth_unstable(need);
                cand.truncate(need);
            }
            let mut victims: Vec<u32> = cand
                .iter()
                .map(|&k| {
                    let s = self.row_to_slot[row_of_key(k) as usize];
                    debug_assert_eq!(self.slot_to_row[s as usize], row_of_key(k), "stale key");
                    s
                })
                .collect();
            victims.sort_unstable();
            for s in victims {
                let row = self.slot_to_row[s as usize];
                if self.dirty[s as usize] {
                    plan.write_back.push((s, row));
                    self.dirty[s as usize] = false;
                }
                self.row_to_slot[row as usize] = NONE;
                self.slot_to_row[s as usize] = NONE;
                self.free.push(s);
                plan.evicted += 1;
            }
            // Keep the lowest free slot on top.
            self.free.sort_unstable_by(|a, b| b.cmp(a));
        }
        for &row in &missed {
            let slot = self.free.pop().expect("room was made above");
            self.row_to_slot[row as usize] = slot;
            self.slot_to_row[slot as usize] = row;
            self.used[(slot >> 6) as usize] |= 1 << (slot & 63);
            self.count[slot as usize] = 0;
            self.dirty[slot as usize] = false;
            // every occupied slot's key names its row (victims are found through it); the
            // policy sets the real key below
            self.keys[slot as usize] = key(0, row);
            plan.admit.push((slot, row));
        }
        self.stats.admitted += plan.admit.len() as u64;
        self.stats.evicted += plan.evicted as u64;
        self.stats.written_back += plan.write_back.len() as u64;
        if prefetch {
            // Admitted rows get the key of a row not used yet; uses are counted by the
            // batches' own prepares.
            for &(slot, row) in &plan.admit {
                let primary = if matches!(self.policy, CachePolicy::Lru) {
                    self.tick
                } else {
                    0
                };
                self.keys[slot as usize] = key(primary, row);
            }
            self.stats.prefetched += plan.admit.len() as u64;
            return Ok(plan);
        }
        if plan.misses > 0 {
            for (s, &row) in plan.slots.iter_mut().zip(rows) {
                if *s == NONE {
                    *s = self.row_to_slot[row as usize];
                }
            }
        }
        if matches!(self.policy, CachePolicy::Lfu) {
            // uses counted for the only policy whose keys read them
            for &s in &plan.slots {
                self.count[s as usize] = self.count[s as usize].saturating_add(1);
            }
        }
        self.tick = self.tick.saturating_add(1);
        self.update_keys(rows, &plan)?;
        self.stats.batches += 1;
        self.stats.hits += plan.hits as u64;
        self.stats.misses += plan.misses as u64;
        Ok(plan)
    }

    fn update_keys(&mut self, rows: &[u32], plan: &CachePlan) -> Result<()> {
        match &mut self.policy {
            CachePolicy::Frequency => {
                for &(slot, row) in &plan.admit {
                    self.keys[slot as usize] = key(0, row);
                }
            }
            CachePolicy::Lfu | CachePolicy::Lru => {
                let lfu = matches!(self.policy, CachePolicy::Lfu);
                for (&slot, &row) in plan.slots.iter().zip(rows) {
                    let primary = if lfu {
                        self.count[slot as usize]
                    } else {
                        self.tick
                    };
                    self.keys[slot as usize] = key(primary, row);
                }
            }
            CachePolicy::Optimal(t) => {
                for (&slot, &row) in plan.slots.iter().zip(rows) {
                    let next = t.next_use(row)?;
                    self.keys[slot as usize] = key(u32::MAX - next, row);
                }
                t.advance();
            }
        }
        Ok(())
    }

    /// Admits host rows `0..n` (the hottest after a reorder) into free slots, for a warm start.
    /// Returns the admissions to copy host → device.
    pub fn preload(&mut self, n: usize) -> Vec<(u32, u32)> {
        let mut admit = Vec::new();
        for row in 0..self.rows().min(n) as u32 {
            if self.row_to_slot[row as usize] != NONE {
                continue;
            }
            let Some(slot) = self.free.pop() else { break };
            self.row_to_slot[row as usize] = slot;
            self.slot_to_row[slot as usize] = row;
            self.count[slot as usize] = 0;
            self.dirty[slot as usize] = false;
            self.keys[slot as usize] = key(0, row);
            admit.push((slot, row));
        }
        self.stats.admitted += admit.len() as u64;
        admit
    }

    /// Marks slots as changed on the device (their rows must be written back before eviction).
    pub(crate) fn mark_dirty(&mut self, slots: &[u32]) -> Result<()> {
        for &s in slots {
            if self.row_in_slot(s).is_none() {
                return Err(Error::Empty {
                    what: format!("slot {s}, to mark dirty,"),
                });
            }
        }
        for &s in slots {
            self.dirty[s as usize] = true;
        }
        Ok(())
    }

    /// Every dirty `(slot, row)`, marking them clean: the rows to write back for a flush.
    pub fn take_dirty(&mut self) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for s in 0..self.capacity() {
            if self.dirty[s] {
                self.dirty[s] = false;
                out.push((s as u32, self.slot_to_row[s]));
            }
        }
        self.stats.written_back += out.len() as u64;
        out
    }

    /// Marks every row clean without writing anything back: the rows are about to be replaced
    /// (a checkpoint load).
    pub(crate) fn forget_dirty(&mut self) {
        self.dirty.fill(false);
    }

    /// Empties the cache. Dirty rows must have been written back ([`CacheIndex::take_dirty`]).
    pub(crate) fn clear(&mut self) -> Result<()> {
        if let Some(s) = self.dirty.iter().position(|&d| d) {
            return Err(Error::Conflict {
                what: "clearing the cache".into(),
                with: format!("dirty slot {s} (write the cache back first)"),
            });
        }
        for s in 0..self.capacity() {
            let r = self.slot_to_row[s];
            if r != NONE {
                self.row_to_slot[r as usize] = NONE;
                self.slot_to_row[s] = NONE;
            }
        }
        self.free = (0..self.capacity() as u32).rev().collect();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::rng::{Rng, SplitMix64};
    use crate::embedding::OptimalTrace;

    fn check_invariants(ix: &CacheIndex) {
        let mut occupied = 0;
        for s in 0..ix.capacity() as u32 {
            if let Some(r) = ix.row_in_slot(s) {
                occupied += 1;
                assert_eq!(ix.slot_of_row(r), Some(s));
            } else {
                assert!(!ix.is_dirty(s));
            }
        }
        assert_eq!(occupied, ix.cached());
        let mapped = (0..ix.rows() as u32)
            .filter(|&r| ix.slot_of_row(r).is_some())
            .count();
        assert_eq!(mapped, occupied);
    }

    #[test]
    fn hits_misses_and_slots() {
        let mut ix = CacheIndex::new(10, 4, CachePolicy::Frequency).unwrap();
        let p = ix.prepare(&[3, 5, 3]).unwrap();
        assert_eq!((p.hits, p.misses, p.unique), (0, 3, 2));
        assert_eq!(p.admit, vec![(0, 3), (1, 5)]);
        assert_eq!(p.slots, vec![0, 1, 0]);
        let p = ix.prepare(&[5, 7]).unwrap();
        assert_eq!((p.hits, p.misses), (1, 1));
        assert_eq!(p.slots, vec![1, 2]);
        assert_eq!(ix.stats().hits, 1);
        assert_eq!(ix.stats().misses, 4);
        check_invariants(&ix);
    }

    #[test]
    fn prefetch_makes_the_next_batches_hit_and_keeps_the_batch_in_flight() {
        for policy in [CachePolicy::Frequency, CachePolicy::Lfu, CachePolicy::Lru] {
            let mut ix = CacheIndex::new(100, 6, policy).unwrap();
            let inflight = ix.prepare(&[10, 11]).unwrap();
            ix.mark_dirty(&inflight.slots).unwrap();
            let other = ix.prepare(&[20, 21]).unwrap();
            ix.mark_dirty(&other.slots).unwrap();
            // Rows 10 and 11 are kept; one of 20 and 21 makes room and is written back.
            let p = ix
                .prefetch(&[&[1, 2, 10], &[2, 3]], &inflight.slots)
                .unwrap();
            assert_eq!((p.hits, p.misses, p.unique), (1, 3, 4));
            assert_eq!(p.evicted, 1, "{}", ix.policy().name());
            assert_eq!(p.write_back.len(), 1);
            assert!(p.slots.is_empty());
            assert!(ix.slot_of_row(10).is_some() && ix.slot_of_row(11).is_some());
            assert_eq!(ix.stats().prefetched, 3);
            let before = ix.stats();
            for b in [&[1u32, 2, 10][..], &[2, 3]] {
                let q = ix.prepare(b).unwrap();
                assert_eq!((q.misses, q.evicted, q.admit.len()), (0, 0, 0));
            }
            assert_eq!(ix.stats().admitted, before.admitted);
            assert_eq!(ix.stats().batches, before.batches + 2);
            check_invariants(&ix);
        }
    }

    /// Preparing a prefetched batch reuses the rows the prefetch looked up, deciding exactly
    /// what a fresh lookup would; a few earlier prefetched batches are kept, the oldest go first.
    #[test]
    fn prepare_reuses_the_rows_of_prefetched_batches() {
        let batches: Vec<Vec<u32>> = (0..8u32)
            .map(|b| (0..40).map(|i| (i * 7 + b * 13) % 97).collect())
            .collect();
        for policy in [CachePolicy::Frequency, CachePolicy::Lfu, CachePolicy::Lru] {
            let mut ix = CacheIndex::new(100, 60, policy).unwrap();
            let counts: Vec<u64> = (0..100).map(|i| (i * 31 % 17) as u64).collect();
            ix.reorder(&counts).unwrap();
            for k in 0..batches.len() - 1 {
                ix.prefetch(&[&batches[k + 1]], &[]).unwrap();
                let mut fresh = ix.clone();
                fresh.prefetched.clear();
                let known = ix.prefetched.len();
                let p = ix.prepare(&batches[k]).unwrap();
                assert_eq!(p, fresh.prepare(&batches[k]).unwrap());
                assert_eq!(ix.row_to_slot, fresh.row_to_slot);
                assert_eq!(ix.keys, fresh.keys);
                if k > 0 {
                    assert_eq!(ix.prefetched.len(), known - 1, "batch {k} was known");
                }
            }
            // at most PREFETCHED_BATCHES kept, the oldest dropped
            for b in &batches {
                ix.prefetch(&[b], &[]).unwrap();
            }
            assert_eq!(ix.prefetched.len(), PREFETCHED_BATCHES);
            assert_eq!(
                ix.prefetched[0].0,
                batches[batches.len() - PREFETCHED_BATCHES]
            );
            let many: Vec<&[u32]> = batches.iter().take(6).map(|b| &b[..10]).collect();
            ix.prefetch(&many, &[]).unwrap();
            assert_eq!(
                ix.prefetched.len(),
                6,
                "a larger prefetch keeps all of its batches"
            );
            ix.take_dirty();
            ix.clear().unwrap();
            ix.reorder(&vec![1; 100]).unwrap();
            assert!(
                ix.prefetched.is_empty(),
                "a new permutation forgets the rows"
            );
        }
    }

    #[test]
    fn prefetch_refuses_bad_input_and_the_optimal_policy() {
        let mut ix = CacheIndex::new(10, 3, CachePolicy::Lru).unwrap();
        let p = ix.prepare(&[1, 2]).unwrap();
        let before = (ix.stats(), ix.slot_of_row(1), ix.slot_of_row(2));
        // Two kept rows and two new ones do not fit in three slots.
        assert!(matches!(
            ix.prefetch(&[&[3], &[4]], &p.slots),
            Err(Error::CacheTooSmall {
                unique: 4,
                capacity: 3
            })
        ));
        assert!(ix.prefetch(&[&[3, 10]], &[]).is_err());
        assert!(ix.prefetch(&[&[3]], &[2]).is_err(), "slot 2 is empty");
        assert_eq!(before, (ix.stats(), ix.slot_of_row(1), ix.slot_of_row(2)));
        let trace = OptimalTrace::new([vec![1u32]]).unwrap();
        let mut opt = CacheIndex::new(10, 3, CachePolicy::Optimal(trace)).unwrap();
        assert!(opt.prefetch(&[&[1]], &[]).is_err());
        check_invariants(&ix);
    }

    #[test]
    fn large_batches_are_looked_up_in_parallel_alike() {
        let n = 100_000usize;
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % 50_000).collect();
        let mut ix = CacheIndex::new(60_000, 50_000, CachePolicy::Lru).unwrap();
        let p = ix.prepare(&ids).unwrap();
        assert_eq!((p.unique, p.misses, p.admit.len()), (50_000, n, 50_000));
        for (&id, &slot) in ids.iter().zip(&p.slots) {
            assert_eq!(ix.slot_of_row(ix.row_of(id).unwrap()), Some(slot));
        }
        let mut bad = ids.clone();
        bad[90_000] = 60_000;
        bad[70_000] = 60_001;
        let before = ix.stats();
        let e = ix.prepare(&bad).unwrap_err().to_string();
        assert!(e.contains("id 60001 at position 70000"), "{e}");
        let e = ix
            .prefetch(&[&ids[..10], &bad], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("position 70010"), "{e}");
        assert_eq!(ix.stats(), before);
        check_invariants(&ix);
    }

    #[test]
    fn too_many_rows_and_bad_ids_change_nothing() {
        let mut ix = CacheIndex::new(10, 2, CachePolicy::Lru).unwrap();
        ix.prepare(&[1, 2]).unwrap();
        let before = (ix.stats(), ix.slot_of_row(1), ix.slot_of_row(2));
        assert!(matches!(
            ix.prepare(&[3, 4, 5]),
            Err(Error::CacheTooSmall {
                unique: 3,
                capacity: 2
            })
        ));
        assert!(matches!(
            ix.prepare(&[1, 10]),
            Err(Error::IdOutOfRange {
                id: 10,
                position: 1,
                ..
            })
        ));
        assert_eq!(before, (ix.stats(), ix.slot_of_row(1), ix.slot_of_row(2)));
        // The failed batch's used bits do not protect its rows later.
        let p = ix.prepare(&[7, 8]).unwrap();
        assert_eq!(p.evicted, 2);
        check_invariants(&ix);
        assert!(CacheIndex::new(0, 1, CachePolicy::Lru).is_err());
        assert!(CacheIndex::new(1, 0, CachePolicy::Lru).is_err());
    }

    #[test]
    fn frequency_evicts_the_rarest_row_not_in_the_batch() {
        let mut ix = CacheIndex::new(100, 3, CachePolicy::Frequency).unwrap();
        ix.prepare(&[1, 50, 90]).unwrap();
        // 90 is the rarest but the batch uses it: 50 goes.
        let p = ix.prepare(&[90, 2]).unwrap();
        assert_eq!(p.evicted, 1);
        assert_eq!(ix.slot_of_row(50), None);
        assert!(ix.slot_of_row(90).is_some() && ix.slot_of_row(1).is_some());
        check_invariants(&ix);
    }

    #[test]
    fn lru_and_lfu_victims() {
        let mut ix = CacheIndex::new(10, 2, CachePolicy::Lru).unwrap();
        ix.prepare(&[1]).unwrap();
        ix.prepare(&[2]).unwrap();
        ix.prepare(&[1]).unwrap();
        ix.prepare(&[3]).unwrap(); // 2 is least recent
        assert_eq!(ix.slot_of_row(2), None);
        let mut ix = CacheIndex::new(10, 2, CachePolicy::Lfu).unwrap();
        ix.prepare(&[1, 1, 1]).unwrap();
        ix.prepare(&[2]).unwrap();
        ix.prepare(&[2]).unwrap();
        ix.prepare(&[3]).unwrap(); // 2 has two uses, 1 three
        assert_eq!(ix.slot_of_row(2), None);
        assert!(ix.slot_of_row(1).is_some());
    }

    #[test]
    fn only_dirty_victims_are_written_back() {
        let mut ix = CacheIndex::new(10, 2, CachePolicy::Lru).unwrap();
        let p = ix.prepare(&[1, 2]).unwrap();
        ix.mark_dirty(&p.slots[..1]).unwrap();
        let p = ix.prepare(&[3, 4]).unwrap();
        assert_eq!(p.evicted, 2);
        assert_eq!(p.write_back, vec![(0, 1)]);
        assert_eq!(ix.stats().written_back, 1);
        assert!(ix.mark_dirty(&[5]).is_err());
        ix.mark_dirty(&[1]).unwrap();
        assert!(ix.clear().is_err());
        assert_eq!(ix.take_dirty(), vec![(1, 4)]);
        ix.clear().unwrap();
        assert_eq!(ix.cached(), 0);
        check_invariants(&ix);
    }

    #[test]
    fn reorder_puts_the_hottest_id_first_and_preload_takes_the_hottest() {
        let mut ix = CacheIndex::new(5, 2, CachePolicy::Frequency).unwrap();
        let perm = ix.reorder(&[1, 9, 0, 9, 4]).unwrap().to_vec();
        assert_eq!(perm, vec![3, 0, 4, 1, 2]);
        let admit = ix.preload(2);
        assert_eq!(admit, vec![(0, 0), (1, 1)]);
        let p = ix.prepare(&[1, 3]).unwrap();
        assert_eq!(p.hits, 2);
        assert!(ix.reorder(&[0; 5]).is_err());
        assert!(ix.reorder(&[0; 4]).is_err());
    }

    /// A batch the optimal policy's trace does not hold (even one that only hits) fails before
    /// anything changes, and the index goes on as if it had not been asked.
    #[test]
    fn an_optimal_trace_mismatch_changes_nothing() {
        let trace = vec![vec![0, 1], vec![2, 3], vec![3]];
        let mut ix = CacheIndex::new(
            10,
            2,
            CachePolicy::Optimal(OptimalTrace::new(&trace).unwrap()),
        )
        .unwrap();
        ix.prepare(&[0, 1]).unwrap();
        let before = (
            ix.row_to_slot.clone(),
            ix.slot_to_row.clone(),
            ix.keys.clone(),
        );
        // row 0 hits but is not in the trace's batch 1
        assert!(ix.prepare(&[0, 2]).is_err());
        assert_eq!(
            (
                ix.row_to_slot.clone(),
                ix.slot_to_row.clone(),
                ix.keys.clone()
            ),
            before
        );
        ix.prepare(&[2, 3]).unwrap();
        ix.prepare(&[3]).unwrap();
        check_invariants(&ix);
    }

    /// Belady's MIN never loses to the online policies on the same trace.
    #[test]
    fn optimal_beats_online_policies() {
        let mut rng = SplitMix64::new(7);
        let mut rnd = move || rng.next_u32();
        let trace: Vec<Vec<u32>> = (0..60)
            .map(|_| (0..8).map(|_| (rnd() % 40).min(rnd() % 40)).collect())
            .collect();
        let run = |policy: CachePolicy| {
            let mut ix = CacheIndex::new(40, 10, policy).unwrap();
            for b in &trace {
                ix.prepare(b).unwrap();
                check_invariants(&ix);
            }
            ix.stats().hits
        };
        let opt = run(CachePolicy::Optimal(OptimalTrace::new(&trace).unwrap()));
        for p in [CachePolicy::Frequency, CachePolicy::Lfu, CachePolicy::Lru] {
            let name = p.name();
            let h = run(p);
            assert!(opt >= h, "optimal {opt} < {name} {h}");
        }
        // Past the trace's end the optimal policy refuses.
        let mut ix = CacheIndex::new(
            40,
            10,
            CachePolicy::Optimal(OptimalTrace::new(&trace[..1]).unwrap()),
        )
        .unwrap();
        ix.prepare(&trace[0]).unwrap();
        assert!(ix.prepare(&trace[0]).is_err());
    }
}
