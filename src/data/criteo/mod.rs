//! Deterministic synthetic Criteo-like click data: no download needed.
//!
//! [`TsvReader`] reads (and writes) the Criteo TSV format into the same [`Batch`]es, so a
//! trainer takes synthetic or real click logs alike.
//!
//! [`Synthetic`] generates batches of samples shaped like the Criteo Kaggle, Criteo 1TB and Avazu
//! click logs: [`DENSE_FEATURES`] non-negative dense features, one categorical id per table over
//! the published table cardinalities (optionally shrunk by a scale), and a 0/1 label.
//!
//! # Ids
//!
//! For table `t` with `N_t` rows, a sample first draws a popularity rank `r` in `1..=N_t` from a
//! Zipf law, `P(r) ∝ r^-s` (`s` = [`SyntheticConfig::zipf`]; `s = 0` is uniform), with the
//! rejection-inversion sampler of Hörmann & Derflinger (1996): O(1) expected work per sample
//! and O(1) memory per table, whatever `N_t`. The rank is then mapped to an id through a fixed
//! pseudo-random permutation of `0..N_t` per table (a keyed Feistel network over the next
//! power of two with cycle-walking, keyed by the seed and the table index), so the hottest ids
//! are scattered over the table rather than being ids 0, 1, 2: a frequency-aware cache has
//! reordering work to do.
//!
//! # Drift
//!
//! With [`SyntheticConfig::drift`] set, batch `index` belongs to day `d = index / batches_per_day`
//! (with no drift, every batch is on day 0). On day `d` rank `r` of table `t` maps to
//!
//! ```text
//! id = perm_t((r - 1 + o_t(d)) mod N_t),   o_t(d) = floor(d * shift * N_t) mod N_t
//! ```
//!
//! so each day the popularity ranking rotates by the fraction `shift` of the table through the
//! fixed permutation: with `shift * N_t` larger than the hot set, the hot ids of day `d + 1` are
//! disjoint from those of day `d`, and a frequency order computed on day 0 goes stale. The
//! integer part of `shift` has no effect (`shift` and `shift + 1` give the same trace); tables
//! with `shift * N_t < 1` move only every few days. The product is evaluated in `f64`, after
//! reducing `shift` to its fractional part. The random streams do not depend on the drift, so
//! day 0 of a drifting trace, and every day of a trace with `shift = 0`, equal the trace
//! without drift.
//!
//! # Labels
//!
//! Labels come from a fixed hidden logistic model, so that training can show AUROC rising:
//!
//! ```text
//! logit = Σ_j w_j (x_j - μ_j) / σ_j + Σ_t (h_t(id_t) - c_t) - bias
//! label ~ Bernoulli(sigmoid(logit))
//! ```
//!
//! where `x_j = ln(1 + floor(m_j E))` are the dense features (`E ~ Exp(1)`: a count-like
//! variate with a scale `m_j` between 0.5 and 500 fixed by the seed), `w` is a fixed weight
//! vector drawn from the seed (with `|w|² = 1`), `μ_j`, `σ_j` are the exact mean and standard
//! deviation of feature `j`, `h_t` is a hash of (seed, table, id) mapped uniformly to `[-a, a]`
//! with `a = sqrt(3 / tables)` (so the id terms together have about unit variance), `c_t` is the
//! expected value of `h_t` under the day-0 id distribution (so the id terms are centred), and
//! `bias` is chosen so that the positive rate is about 25% (Criteo's is about 25%; the id part
//! is centred for day 0, so on later days of a drifting trace the rate wanders by a few
//! points). [`Synthetic::true_logit`] returns this logit for a generated sample, e.g. to compare
//! a trained model's AUROC with the Bayes-optimal one.
//!
//! # Determinism
//!
//! Everything is a function of the [`SyntheticConfig`], the batch index and the batch size:
//! [`Synthetic::batch`] does not depend on which other batches were generated, in which order or
//! on which thread. Each batch uses independent random streams per table (and for the dense
//! features and the labels) derived from `(seed, index)`, so the first `k` samples of a batch of
//! size `n > k` are the samples of the batch of size `k` with the same index.
//!
//! ```
//! use tidemem::data::criteo::{Dataset, Drift, Synthetic, SyntheticConfig, DENSE_FEATURES};
//! # fn main() -> tidemem::Result<()> {
//! let config = SyntheticConfig::new("criteo-kaggle".parse::<Dataset>()?)
//!     .with_scale(0.01)
//!     .with_seed(7)
//!     .with_drift(Drift { batches_per_day: 100, shift: 0.05 });
//! let gen = Synthetic::new(config)?;
//! assert_eq!(gen.num_tables(), 26);
//! assert_eq!(gen.cardinalities()[2], 101_313); // ceil(10,131,227 × 0.01)
//!
//! let batch = gen.batch(3, 1024);
//! assert_eq!(batch.dense.len(), 1024 * DENSE_FEATURES);
//! for (ids, &n) in batch.ids.iter().zip(gen.cardinalities()) {
//!     assert!(ids.iter().all(|&id| u64::from(id) < n));
//! }
//! assert!(batch.labels.iter().all(|&y| y == 0.0 || y == 1.0));
//! assert_eq!(gen.batch(3, 1024), batch); // deterministic
//!
//! // One id space for all tables: table t's id i becomes offsets[t] + i.
//! let offsets = gen.table_offsets();
//! let global = offsets[2] + u64::from(batch.ids[2][0]);
//! assert!(global < offsets[3]);
//! # Ok(()) }
//! ```

mod config;
#[cfg(test)]
mod tests;
pub(crate) mod tsv;

pub use config::{Batch, Dataset, Drift, SyntheticConfig, DENSE_FEATURES};
pub use tsv::{
    dense_transform, hash_id, rows_from_batch, write_tsv, IdMap, Malformed, MalformedLine,
    TsvConfig, TsvReader, TsvReport, TsvRow, Vocabulary, CATEGORICAL_FEATURES, COLUMNS,
    MAX_REPORTED_LINES,
};

use super::permutation::Permutation;
use super::rng::{derive_seed, mix64, unit_f64, Rng, Xoshiro256};
use super::zipf::Zipf;
use crate::error::{Error, Result};

/// Variance of the dense part of the hidden logit (`|w|²` on standardized features).
const DENSE_LOGIT_VAR: f64 = 1.0;
/// Variance of the id part of the hidden logit, split evenly over the tables.
const ID_LOGIT_VAR: f64 = 1.0;
/// Target positive rate.
const POSITIVE_RATE: f64 = 0.25;
/// Ranks whose probability mass is used to centre the id terms of the hidden logit.
const CENTRE_RANKS: u64 = 1024;

/// Domain separators for the values derived from the seed.
mod domain {
    pub const PERMUTATION: u64 = 0x7065_726d_7574_6521;
    pub const ID_HASH: u64 = 0x6964_2d68_6173_6821;
    pub const DENSE_MODEL: u64 = 0x6465_6e73_652d_6d21;
    pub const STREAM: u64 = 0x7374_7265_616d_2121;
}

/// Stream lanes inside one batch.
const LANE_DENSE: u64 = 0;
const LANE_LABEL: u64 = 1;
const LANE_TABLE0: u64 = 2;

/// A deterministic generator of synthetic Criteo-like batches (see the [module docs](self)).
///
/// Holds O(tables) state and no per-row tables, so full-size Criteo 1TB costs a few kilobytes.
/// It is `Send + Sync`: batches can be generated from several threads at once.
#[derive(Clone, Debug)]
pub struct Synthetic {
    config: SyntheticConfig,
    cardinalities: Vec<u64>,
    tables: Vec<Table>,
    /// Dense feature `j` is `ln(1 + floor(count_scale[j] * Exp(1)))`.
    count_scale: [f64; DENSE_FEATURES],
    /// `w_j / σ_j` of the hidden model.
    dense_coef: [f64; DENSE_FEATURES],
    /// `Σ_j w_j μ_j / σ_j + Σ_t c_t + bias`, subtracted from the raw logit.
    logit_offset: f64,
}

/// Per-table state.
#[derive(Clone, Debug)]
struct Table {
    rows: u64,
    zipf: Zipf,
    perm: Permutation,
    /// Key of the id hash `h_t`.
    hash_key: u64,
    /// Half-width `a` of the id term `h_t ∈ [-a, a]`.
    amplitude: f64,
}

impl Table {
    /// `h_t(id)`, uniform in `[-a, a]` over ids.
    fn id_term(&self, id: u32) -> f64 {
        self.amplitude * (2.0 * unit_f64(mix64(u64::from(id) ^ self.hash_key)) - 1.0)
    }
}

impl Synthetic {
    /// Builds a generator.
    ///
    /// # Errors
    /// [`Error::BadValue`] if `zipf` is negative or not finite, `scale` is not in `(0, 1]`, or
    /// the drift's `shift` is negative or not finite; [`Error::TooFew`] if the drift has
    /// `batches_per_day == 0`.
    pub fn new(config: SyntheticConfig) -> Result<Self> {
        if !config.zipf.is_finite() || config.zipf < 0.0 {
            return Err(Error::BadValue {
                what: "zipf exponent".into(),
                value: config.zipf,
                want: "finite and >= 0",
            });
        }
        if !(config.scale > 0.0 && config.scale <= 1.0) {
            return Err(Error::BadValue {
                what: "scale".into(),
                value: config.scale,
                want: "in (0, 1]",
            });
        }
        if let Some(drift) = config.drift {
            if drift.batches_per_day == 0 {
                return Err(Error::TooFew {
                    what: "drift.batches_per_day".into(),
                    got: 0,
                    need: 1,
                });
            }
            if !drift.shift.is_finite() || drift.shift < 0.0 {
                return Err(Error::BadValue {
                    what: "drift.shift".into(),
                    value: drift.shift,
                    want: "finite and >= 0",
                });
            }
        }

        let seed = config.seed;
        let cardinalities: Vec<u64> = config
            .dataset
            .cardinalities()
            .iter()
            .map(|&n| scaled_rows(n, config.scale))
            .collect();
        let amplitude = (3.0 * ID_LOGIT_VAR / cardinalities.len() as f64).sqrt();
        let tables: Vec<Table> = cardinalities
            .iter()
            .enumerate()
            .map(|(t, &rows)| Table {
                rows,
                zipf: Zipf::new(rows, config.zipf),
                perm: Permutation::new(rows, derive_seed(seed, domain::PERMUTATION, t as u64)),
                hash_key: derive_seed(seed, domain::ID_HASH, t as u64),
                amplitude,
            })
            .collect();

        // Dense features and their part of the hidden model.
        let mut rng = Xoshiro256::new(derive_seed(seed, domain::DENSE_MODEL, 0));
        let mut count_scale = [0.0; DENSE_FEATURES];
        let mut w = [0.0; DENSE_FEATURES];
        for j in 0..DENSE_FEATURES {
            // Count scales from 0.5 to 500, log-uniformly.
            count_scale[j] = 0.5 * 1000f64.powf(rng.next_f64());
            w[j] = 2.0 * rng.next_f64() - 1.0;
        }
        let norm = w.iter().map(|x| x * x).sum::<f64>().sqrt();
        let mut dense_coef = [0.0; DENSE_FEATURES];
        let mut offset = 0.0;
        for j in 0..DENSE_FEATURES {
            let (mean, sd) = log_count_moments(count_scale[j]);
            dense_coef[j] = w[j] * DENSE_LOGIT_VAR.sqrt() / norm / sd;
            offset += dense_coef[j] * mean;
        }

        // Centre each id term on its expected value under the day-0 distribution, over the
        // hottest ranks (the tail's hash values average out).
        for table in &tables {
            offset += table.expected_id_term(0);
        }

        // With the logit ~ N(-bias, σ²), E[sigmoid] ≈ sigmoid(-bias / sqrt(1 + πσ²/8)).
        let var = DENSE_LOGIT_VAR + ID_LOGIT_VAR;
        let bias =
            (1.0 / POSITIVE_RATE - 1.0).ln() * (1.0 + std::f64::consts::PI * var / 8.0).sqrt();
        offset += bias;

        Ok(Self {
            config,
            cardinalities,
            tables,
            count_scale,
            dense_coef,
            logit_offset: offset,
        })
    }

    /// The configuration this generator was built from.
    pub fn config(&self) -> &SyntheticConfig {
        &self.config
    }

    /// Rows of each table after scaling: `max(1, ceil(N_t * scale))`.
    pub fn cardinalities(&self) -> &[u64] {
        &self.cardinalities
    }

    /// Number of embedding tables (26 for Criteo, 13 for Avazu).
    pub fn num_tables(&self) -> usize {
        self.cardinalities.len()
    }

    /// Exclusive prefix sums of [`cardinalities`](Self::cardinalities), `num_tables() + 1` values:
    /// id `i` of table `t` is row `offsets[t] + i` of the concatenation of all tables, and the
    /// last value is the total number of rows.
    pub fn table_offsets(&self) -> Vec<u64> {
        let mut offsets = Vec::with_capacity(self.cardinalities.len() + 1);
        let mut sum = 0;
        offsets.push(0);
        for &n in &self.cardinalities {
            sum += n;
            offsets.push(sum);
        }
        offsets
    }

    /// The ids of `batch` in one id space over all tables, table-major (every sample of table
    /// 0, then of table 1, ...): id `i` of table `t` becomes `table_offsets()[t] + i`, as a
    /// cache over the concatenated tables takes them. Fails when the tables hold more rows than
    /// a `u32` numbers.
    pub fn concat_ids(&self, batch: &Batch) -> Result<Vec<u32>> {
        let offsets = self.table_offsets();
        let rows = *offsets.last().expect("at least the leading 0");
        if rows > u32::MAX as u64 {
            return Err(Error::TooLarge {
                what: "rows over all tables, as 32-bit ids".into(),
                requested: u128::from(rows),
                limit: u64::from(u32::MAX),
            });
        }
        let mut ids = Vec::with_capacity(batch.size * batch.ids.len());
        for (col, &o) in batch.ids.iter().zip(&offsets) {
            ids.extend(col.iter().map(|&id| (o + id as u64) as u32));
        }
        Ok(ids)
    }

    /// The drift day of batch `index`: `index / batches_per_day`, or 0 without drift.
    pub fn day(&self, index: u64) -> u64 {
        match self.config.drift {
            Some(drift) => index / drift.batches_per_day,
            None => 0,
        }
    }

    /// Generates batch `index` with `size` samples.
    ///
    /// Deterministic in (configuration, `index`, `size`); a batch's first `k` samples do not
    /// depend on `size >= k`.
    ///
    /// # Panics
    /// Where [`Synthetic::try_batch`] fails: when the batch's bytes overflow or exceed the
    /// machine's memory. Take `try_batch` for sizes a user chose.
    pub fn batch(&self, index: u64, size: usize) -> Batch {
        self.try_batch(index, size)
            .unwrap_or_else(|e| panic!("Synthetic::batch: {e}"))
    }

    /// [`Synthetic::batch`], with the size checked before anything is allocated.
    ///
    /// # Errors
    /// [`Error::TooLarge`] when the batch's bytes ([`Batch::bytes_for`]) overflow or exceed
    /// what the machine holds ([`crate::limits::host_limit`]).
    pub fn try_batch(&self, index: u64, size: usize) -> Result<Batch> {
        Batch::bytes_for(size, self.tables.len())?;
        Ok(self.generate(index, size))
    }

    /// Batch `index` of `size` samples, whose bytes were checked.
    fn generate(&self, index: u64, size: usize) -> Batch {
        let seed = self.config.seed;
        let day = self.day(index);
        let shift = self.config.drift.map_or(0.0, |d| d.shift);

        let ids: Vec<Vec<u32>> = self
            .tables
            .iter()
            .enumerate()
            .map(|(t, table)| {
                let mut rng = Xoshiro256::new(stream_seed(seed, index, LANE_TABLE0 + t as u64));
                let offset = rank_offset(day, shift, table.rows);
                (0..size)
                    .map(|_| {
                        let rank = table.zipf.sample(&mut rng);
                        table.perm.apply(wrap_add(rank - 1, offset, table.rows)) as u32
                    })
                    .collect()
            })
            .collect();

        let mut rng = Xoshiro256::new(stream_seed(seed, index, LANE_DENSE));
        let mut dense = Vec::with_capacity(size * DENSE_FEATURES);
        for _ in 0..size {
            for &scale in &self.count_scale {
                // Exp(1) via inversion; 1 - u is in (0, 1].
                let e = -(1.0 - rng.next_f64()).ln();
                let count = (scale * e).floor();
                // `count` is a whole number, so `ln(count + 1)` is exact where `ln_1p` is slower.
                dense.push((count + 1.0).ln() as f32);
            }
        }

        let mut rng = Xoshiro256::new(stream_seed(seed, index, LANE_LABEL));
        let labels = (0..size)
            .map(|i| {
                let logit = self.logit(&dense[i * DENSE_FEATURES..(i + 1) * DENSE_FEATURES], |t| {
                    ids[t][i]
                });
                if rng.next_f64() < sigmoid(logit) {
                    1.0
                } else {
                    0.0
                }
            })
            .collect();

        Batch {
            size,
            dense,
            ids,
            labels,
        }
    }

    /// The hidden model's logit for `sample` of `batch` (a batch of this generator): the label
    /// was drawn as `Bernoulli(sigmoid(true_logit))`. Ranking samples by it gives the best
    /// achievable AUROC.
    ///
    /// # Panics
    /// If `sample >= batch.size` or the batch has fewer tables than the generator.
    pub fn true_logit(&self, batch: &Batch, sample: usize) -> f64 {
        self.logit(batch.dense_row(sample), |t| batch.ids[t][sample])
    }

    fn logit(&self, dense: &[f32], id: impl Fn(usize) -> u32) -> f64 {
        let dense_part: f64 = dense
            .iter()
            .zip(&self.dense_coef)
            .map(|(&x, &c)| f64::from(x) * c)
            .sum();
        let id_part: f64 = self
            .tables
            .iter()
            .enumerate()
            .map(|(t, table)| table.id_term(id(t)))
            .sum();
        dense_part + id_part - self.logit_offset
    }
}

impl Table {
    /// Expected `h_t(id)` with the ranks rotated by `offset`, over the `CENTRE_RANKS` hottest
    /// ranks, the rest of the mass counting as 0 (its hash values average out).
    fn expected_id_term(&self, offset: u64) -> f64 {
        let top = self.rows.min(CENTRE_RANKS);
        let s = self.zipf.exponent;
        // Normalizer Σ_{r<=N} r^-s: exact over the top ranks, midpoint integral beyond.
        let head: f64 = (1..=top).map(|r| (r as f64).powf(-s)).sum();
        let tail = if top < self.rows {
            self.zipf.h_integral(self.rows as f64 + 0.5) - self.zipf.h_integral(top as f64 + 0.5)
        } else {
            0.0
        };
        let total = head + tail;
        (1..=top)
            .map(|r| {
                let id = self.perm.apply(wrap_add(r - 1, offset, self.rows)) as u32;
                (r as f64).powf(-s) / total * self.id_term(id)
            })
            .sum()
    }
}

/// `max(1, ceil(n * scale))`.
fn scaled_rows(n: u64, scale: f64) -> u64 {
    ((n as f64 * scale).ceil() as u64).clamp(1, n.max(1))
}

/// `floor(day * shift * rows) mod rows`, with `shift` first reduced to its fractional part
/// (exact, and the integer part only adds multiples of `rows`).
fn rank_offset(day: u64, shift: f64, rows: u64) -> u64 {
    if day == 0 || shift == 0.0 || rows <= 1 {
        return 0;
    }
    let x = day as f64 * shift.fract() * rows as f64;
    let off = (x % rows as f64).floor() as u64;
    off.min(rows - 1)
}

/// `(a + b) mod n` for `a, b < n`.
fn wrap_add(a: u64, b: u64, n: u64) -> u64 {
    let s = a + b;
    if s >= n {
        s - n
    } else {
        s
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Mean and standard deviation of `ln(1 + floor(m * E))`, `E ~ Exp(1)`: `floor(m E)` is
/// geometric with `P(k) = (1 - p) p^k`, `p = exp(-1/m)`, summed over the `k` whose tail mass
/// `p^k` is above 1e-17 (about `39 m` terms).
fn log_count_moments(m: f64) -> (f64, f64) {
    let p = (-1.0 / m).exp();
    let terms = (1e-17f64.ln() / p.ln()).ceil() as u64;
    let mut prob = 1.0 - p;
    let (mut s1, mut s2, mut mass) = (0.0, 0.0, 0.0);
    for k in 0..=terms {
        let x = (k as f64).ln_1p();
        s1 += prob * x;
        s2 += prob * x * x;
        mass += prob;
        prob *= p;
    }
    let mean = s1 / mass;
    let var = (s2 / mass - mean * mean).max(1e-12);
    (mean, var.sqrt())
}

/// Seed of the random stream of `lane` in batch `index`.
fn stream_seed(seed: u64, index: u64, lane: u64) -> u64 {
    mix64(
        derive_seed(seed, domain::STREAM, index) ^ mix64(lane.wrapping_add(0x6a09_e667_f3bc_c909)),
    )
}
