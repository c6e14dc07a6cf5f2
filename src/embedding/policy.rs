//! Which cached rows to evict: the policies of the embedding cache under one interface.
//!
//! A policy gives every occupied slot an eviction key; the cache evicts the occupied slots with
//! the smallest keys among those the current batch does not use. Keys break ties by host row,
//! rarer (higher) rows first, so every policy is deterministic.

use std::collections::HashMap;

use crate::error::{Error, Result};

/// The eviction policy of an [`super::CacheIndex`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CachePolicy {
    /// Dataset statistics: after [`super::CacheIndex::reorder`] host row `r` is the `r`-th most
    /// frequent id, so the cached row with the largest host row is the rarest and goes first.
    Frequency,
    /// Least frequently used, with counts of the uses seen since the row was admitted (a row's
    /// count restarts at admission).
    Lfu,
    /// Least recently used, at batch granularity.
    Lru,
    /// The offline optimum for evaluation (Belady's MIN): evict the row whose next use is
    /// farthest in a known future trace. Batches must be prepared in the trace's order.
    Optimal(OptimalTrace),
}

impl CachePolicy {
    /// The policy's name: `frequency`, `lfu`, `lru` or `optimal`.
    pub fn name(&self) -> &'static str {
        match self {
            CachePolicy::Frequency => "frequency",
            CachePolicy::Lfu => "lfu",
            CachePolicy::Lru => "lru",
            CachePolicy::Optimal(_) => "optimal",
        }
    }
}

/// The future a [`CachePolicy::Optimal`] looks at: for every batch of a trace, the next batch that
/// uses each of its rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptimalTrace {
    /// Per batch: its distinct host rows, sorted, and the index of the next batch using each
    /// (`u32::MAX` for never).
    batches: Vec<(Vec<u32>, Vec<u32>)>,
    /// The batch the next prepare must be.
    cursor: usize,
}

impl OptimalTrace {
    /// Builds the future from the host rows of every batch, in the order they will be prepared.
    pub fn new<I, B>(batches: I) -> Result<Self>
    where
        I: IntoIterator<Item = B>,
        B: AsRef<[u32]>,
    {
        let mut uniq: Vec<Vec<u32>> = Vec::new();
        for b in batches {
            let mut rows = b.as_ref().to_vec();
            rows.sort_unstable();
            rows.dedup();
            uniq.push(rows);
        }
        if uniq.len() >= u32::MAX as usize {
            return Err(Error::TooLarge {
                what: "batches of an optimal trace".into(),
                requested: uniq.len() as u128,
                limit: u64::from(u32::MAX - 1),
            });
        }
        let mut next: HashMap<u32, u32> = HashMap::new();
        let mut out = vec![(Vec::new(), Vec::new()); uniq.len()];
        for (b, rows) in uniq.into_iter().enumerate().rev() {
            let nexts = rows
                .iter()
                .map(|r| next.insert(*r, b as u32).unwrap_or(u32::MAX))
                .collect();
            out[b] = (rows, nexts);
        }
        Ok(Self {
            batches: out,
            cursor: 0,
        })
    }

    /// Number of batches in the trace.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    /// Whether the trace has no batch.
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// The batch the next prepare must be.
    pub fn position(&self) -> usize {
        self.cursor
    }

    /// The next use after the current batch of `row`, which the current batch must use.
    pub(crate) fn next_use(&self, row: u32) -> Result<u32> {
        let (rows, nexts) =
            self.batches
                .get(self.cursor)
                .ok_or_else(|| Error::IndexOutOfRange {
                    what: "the optimal policy's trace batch".into(),
                    index: self.cursor,
                    len: self.batches.len(),
                })?;
        match rows.binary_search(&row) {
            Ok(i) => Ok(nexts[i]),
            Err(_) => Err(Error::Conflict {
                what: format!("host row {row} in batch {}", self.cursor),
                with: "the optimal policy's trace, which does not have it in that batch".into(),
            }),
        }
    }

    /// Checks that the current batch exists before anything changes.
    pub(crate) fn check_current(&self) -> Result<()> {
        self.next_use(u32::MAX).map(|_| ()).or_else(|e| match e {
            Error::Conflict { .. } => Ok(()),
            e => Err(e),
        })
    }

    pub(crate) fn advance(&mut self) {
        self.cursor += 1;
    }
}

/// Packs a primary key and the host row into one ordering key: primary ascending, then rarer
/// rows (larger host row) first.
pub(crate) fn key(primary: u32, row: u32) -> u64 {
    ((primary as u64) << 32) | (u32::MAX - row) as u64
}

/// The host row a [`key`] was made for.
pub(crate) fn row_of_key(key: u64) -> u32 {
    u32::MAX - key as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optimal_trace_next_uses() {
        let t = OptimalTrace::new([vec![3, 1, 3], vec![2], vec![1, 2], vec![3]]).unwrap();
        assert_eq!(t.len(), 4);
        assert_eq!(t.next_use(1).unwrap(), 2);
        assert_eq!(t.next_use(3).unwrap(), 3);
        assert!(t.next_use(2).is_err());
        let mut t = t;
        t.advance();
        assert_eq!(t.next_use(2).unwrap(), 2);
        t.advance();
        assert_eq!(t.next_use(1).unwrap(), u32::MAX);
        assert_eq!(t.next_use(2).unwrap(), u32::MAX);
        t.advance();
        t.advance();
        assert!(t.check_current().is_err());
    }

    #[test]
    fn key_orders_by_primary_then_rarer_row() {
        assert!(key(1, 5) < key(2, 0));
        assert!(key(1, 9) < key(1, 5));
        assert_eq!(key(0, u32::MAX), 0);
        assert_eq!(row_of_key(key(7, 12_345)), 12_345);
    }
}
