//! Cutting a model's layers into contiguous pipeline stages balanced by parameter count.

use std::ops::Range;

use super::no_stages;
use crate::{Error, Result};

/// Contiguous stages of a model's layers and the parameters each holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// Each stage's layers, in order, together `0..L`.
    pub stages: Vec<Range<usize>>,
    /// Each stage's parameters (the first stage's and the last's with their extras).
    pub params: Vec<u64>,
}

impl Partition {
    /// The largest stage's parameters.
    pub fn max_params(&self) -> u64 {
        self.params.iter().copied().max().unwrap_or(0)
    }

    /// Each stage's number of layers.
    pub fn sizes(&self) -> Vec<usize> {
        self.stages.iter().map(|r| r.len()).collect()
    }
}

/// Cuts `layers` (each layer's parameter count) into `stages` contiguous, non-empty stages
/// whose largest parameter count (`first_extra` added to the first stage, e.g. the
/// embeddings, and `last_extra` to the last, e.g. the head) is the least possible; among
/// the best cuts, each stage takes as many layers as it can, first stage first. Exact (dynamic
/// programming, `O(P·L²)`).
///
/// Fails with [`Error::TooFew`] for no stage and when `layers.len() < stages`, and
/// [`Error::Overflow`] when the parameter counts do not add up in a `u64`.
///
/// ```
/// use tidemem::parallel::pipeline::partition;
///
/// let p = partition(&[4, 4, 4, 4, 4, 4], 10, 2, 3).unwrap();
/// assert_eq!(p.sizes(), [1, 3, 2]); // 14 | 12 | 10
/// assert_eq!(p.max_params(), 14);
/// ```
pub fn partition(
    layers: &[u64],
    first_extra: u64,
    last_extra: u64,
    stages: usize,
) -> Result<Partition> {
    let l = layers.len();
    if stages == 0 {
        return Err(no_stages("stages of a pipeline"));
    }
    if l < stages {
        return Err(Error::TooFew {
            what: format!("layers to fill {stages} pipeline stages"),
            got: l,
            need: stages,
        });
    }
    let overflow = || Error::Overflow {
        what: "the parameter total of the layers with the extras".into(),
    };
    let mut prefix = vec![0u64; l + 1];
    for (i, &x) in layers.iter().enumerate() {
        prefix[i + 1] = prefix[i].checked_add(x).ok_or_else(overflow)?;
    }
    prefix[l]
        .checked_add(first_extra)
        .and_then(|x| x.checked_add(last_extra))
        .ok_or_else(overflow)?;
    // the parameters of stage k of `stages` holding layers i..j
    let cost = |k: usize, i: usize, j: usize| {
        let mut c = prefix[j] - prefix[i];
        if k == 0 {
            c += first_extra;
        }
        if k + 1 == stages {
            c += last_extra;
        }
        c
    };
    // best[k][j]: the least largest stage of stages k..P holding layers j..L
    let inf = u64::MAX;
    let mut best = vec![vec![inf; l + 1]; stages + 1];
    best[stages][l] = 0;
    for k in (0..stages).rev() {
        for j in 0..l {
            // stage k takes j..e, leaving at least one layer per later stage
            let left = stages - k - 1;
            for e in j + 1..=l - left {
                let rest = best[k + 1][e];
                if rest == inf {
                    continue;
                }
                best[k][j] = best[k][j].min(cost(k, j, e).max(rest));
            }
        }
    }
    let target = best[0][0];
    let (mut ranges, mut params, mut j) = (Vec::with_capacity(stages), Vec::new(), 0);
    for k in 0..stages {
        let left = stages - k - 1;
        let e = (j + 1..=l - left)
            .rev()
            .find(|&e| best[k + 1][e] != inf && cost(k, j, e).max(best[k + 1][e]) <= target)
            // the optimum is reachable; counts too large to add are the only way to miss it
            .ok_or_else(overflow)?;
        ranges.push(j..e);
        params.push(cost(k, j, e));
        j = e;
    }
    Ok(Partition {
        stages: ranges,
        params,
    })
}

/// Checks a given cut: `sizes` (layers per stage) must be non-empty stages adding up to
/// `layers`; returns it as a [`Partition`] with each stage's parameters (`counts` per layer,
/// the extras on the first and last stage).
///
/// Fails with [`Error::TooFew`] for no stage, [`Error::Length`] when the sizes do not add up
/// to the layers, [`Error::Empty`] for a stage of no layer and [`Error::Overflow`].
pub fn check_partition(
    sizes: &[usize],
    counts: &[u64],
    first_extra: u64,
    last_extra: u64,
) -> Result<Partition> {
    if sizes.is_empty() {
        return Err(no_stages("stages in the partition's sizes"));
    }
    let sum = sizes
        .iter()
        .try_fold(0usize, |a, &b| a.checked_add(b))
        .ok_or_else(|| Error::Overflow {
            what: format!("the layers of the stage sizes {sizes:?}"),
        })?;
    if sum != counts.len() {
        return Err(Error::Length {
            what: format!("layers in the stage sizes {sizes:?}"),
            got: sum,
            expected: counts.len(),
        });
    }
    if let Some(stage) = sizes.iter().position(|&s| s == 0) {
        return Err(Error::Empty {
            what: format!("stage {stage} of the partition"),
        });
    }
    let (mut stages, mut params, mut at) = (Vec::new(), Vec::new(), 0);
    let last = sizes.len() - 1;
    for (k, &n) in sizes.iter().enumerate() {
        let mut c = counts[at..at + n]
            .iter()
            .try_fold(0u64, |a, &b| a.checked_add(b));
        if k == 0 {
            c = c.and_then(|c| c.checked_add(first_extra));
        }
        if k == last {
            c = c.and_then(|c| c.checked_add(last_extra));
        }
        params.push(c.ok_or_else(|| Error::Overflow {
            what: format!("the parameter count of stage {k} with its extras"),
        })?);
        stages.push(at..at + n);
        at += n;
    }
    Ok(Partition { stages, params })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every cut into `p` non-empty stages, by brute force.
    fn all_cuts(l: usize, p: usize) -> Vec<Vec<usize>> {
        if p == 1 {
            return vec![vec![l]];
        }
        (1..=l - (p - 1))
            .flat_map(|n| {
                all_cuts(l - n, p - 1).into_iter().map(move |mut rest| {
                    rest.insert(0, n);
                    rest
                })
            })
            .collect()
    }

    #[test]
    fn errors() {
        assert!(matches!(
            partition(&[1, 2], 0, 0, 0),
            Err(Error::TooFew {
                got: 0,
                need: 1,
                ..
            })
        ));
        assert!(matches!(
            partition(&[1, 2], 0, 0, 3),
            Err(Error::TooFew {
                got: 2,
                need: 3,
                ..
            })
        ));
        assert!(matches!(
            partition(&[u64::MAX, 1], 0, 0, 1),
            Err(Error::Overflow { .. })
        ));
        assert!(matches!(
            check_partition(&[1, 1], &[1, 1, 1], 0, 0),
            Err(Error::Length {
                got: 2,
                expected: 3,
                ..
            })
        ));
        assert!(matches!(
            check_partition(&[2, 0, 1], &[1, 1, 1], 0, 0),
            Err(Error::Empty { ref what }) if what == "stage 1 of the partition"
        ));
        assert!(matches!(
            check_partition(&[], &[], 0, 0),
            Err(Error::TooFew {
                got: 0,
                need: 1,
                ..
            })
        ));
        assert!(matches!(
            check_partition(&[1], &[u64::MAX], 1, 0),
            Err(Error::Overflow { .. })
        ));
        let p = check_partition(&[1, 2], &[5, 1, 1], 3, 4).unwrap();
        assert_eq!(p.params, [8, 6]);
        assert_eq!(p.stages, [0..1, 1..3]);
    }

    proptest! {
        #[test]
        fn optimal_by_brute_force(
            counts in proptest::collection::vec(0u64..50, 1..9),
            first in 0u64..60,
            last in 0u64..60,
            p in 1usize..5,
        ) {
            prop_assume!(counts.len() >= p);
            let got = partition(&counts, first, last, p).unwrap();
            let again = check_partition(&got.sizes(), &counts, first, last).unwrap();
            prop_assert_eq!(&again, &got);
            let best = all_cuts(counts.len(), p)
                .iter()
                .map(|s| check_partition(s, &counts, first, last).unwrap().max_params())
                .min()
                .unwrap();
            prop_assert_eq!(got.max_params(), best);
        }
    }
}
