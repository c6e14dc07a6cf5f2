//! Deterministic synthetic Criteo-like click data: no download needed.
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
//! use tidemem::embedding::data::{Dataset, Drift, Synthetic, SyntheticConfig, DENSE_FEATURES};
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

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Number of dense (continuous) features per sample, as in Criteo.
pub const DENSE_FEATURES: usize = 13;

/// Criteo Kaggle (Display Advertising Challenge) table cardinalities, 26 tables.
const CRITEO_KAGGLE: [u64; 26] = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
];

/// Criteo 1TB (Terabyte click logs) table cardinalities, 26 tables.
const CRITEO_1TB: [u64; 26] = [
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10, 2209,
    11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
];

/// Avazu table cardinalities, 13 tables.
const AVAZU: [u64; 13] = [
    7, 7, 4737, 7745, 26, 8552, 559, 36, 2686408, 6729486, 8251, 5, 4,
];

/// A click-log data set whose table cardinalities the generator reproduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dataset {
    /// Criteo Kaggle (Display Advertising Challenge): 26 tables, 33,762,577 rows in all.
    CriteoKaggle,
    /// Criteo 1TB (Terabyte click logs): 26 tables, 177,944,275 rows in all.
    Criteo1Tb,
    /// Avazu: 13 tables, 9,445,823 rows in all.
    Avazu,
}

impl Dataset {
    /// Every data set, in declaration order.
    pub const ALL: [Dataset; 3] = [Dataset::CriteoKaggle, Dataset::Criteo1Tb, Dataset::Avazu];

    /// The published number of rows of each embedding table.
    pub fn cardinalities(self) -> &'static [u64] {
        match self {
            Dataset::CriteoKaggle => &CRITEO_KAGGLE,
            Dataset::Criteo1Tb => &CRITEO_1TB,
            Dataset::Avazu => &AVAZU,
        }
    }

    /// The data set's name: `"criteo-kaggle"`, `"criteo-1tb"` or `"avazu"` (what
    /// [`FromStr`] accepts and [`Display`](fmt::Display) prints).
    pub fn name(self) -> &'static str {
        match self {
            Dataset::CriteoKaggle => "criteo-kaggle",
            Dataset::Criteo1Tb => "criteo-1tb",
            Dataset::Avazu => "avazu",
        }
    }
}

impl fmt::Display for Dataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dataset {
    type Err = Error;

    /// Parses a [`Dataset::name`], ignoring ASCII case.
    fn from_str(s: &str) -> Result<Self> {
        Dataset::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                let names: Vec<&str> = Dataset::ALL.iter().map(|d| d.name()).collect();
                Error::InvalidArgument(format!(
                    "unknown dataset '{s}': expected one of {}",
                    names.join(", ")
                ))
            })
    }
}

/// Popularity drift over "days" of batches (see the [module docs](self#drift)).
///
/// Batch `index` is on day `d = index / batches_per_day`; on day `d` the popularity ranking of
/// table `t` is rotated by `floor(d * shift * N_t) mod N_t` positions through the table's fixed
/// permutation, i.e. by the fraction `shift` of the table per day.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Drift {
    /// Batches per day; must be at least 1.
    pub batches_per_day: u64,
    /// Fraction of each table's rank space the popularity ranking rotates by per day; finite and
    /// non-negative (0 means no drift).
    pub shift: f64,
}

/// Parameters of a [`Synthetic`] generator.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticConfig {
    /// Which data set's table cardinalities to use.
    pub dataset: Dataset,
    /// Zipf exponent `s` of the id popularity, `P(rank r) ∝ r^-s`: finite and `>= 0`; 0 is
    /// uniform, 1.0 (the default) is Criteo-like.
    pub zipf: f64,
    /// Factor on every table cardinality, in `(0, 1]`: table `t` gets
    /// `max(1, ceil(N_t * scale))` rows.
    pub scale: f64,
    /// Seed of everything: permutations, hidden model, sample streams.
    pub seed: u64,
    /// Popularity drift over days; `None` (the default) keeps the popularity fixed.
    pub drift: Option<Drift>,
}

impl SyntheticConfig {
    /// Default configuration for `dataset`: Zipf 1.0, full scale, seed 0, no drift.
    pub fn new(dataset: Dataset) -> Self {
        Self {
            dataset,
            zipf: 1.0,
            scale: 1.0,
            seed: 0,
            drift: None,
        }
    }

    /// Sets the Zipf exponent.
    pub fn with_zipf(mut self, zipf: f64) -> Self {
        self.zipf = zipf;
        self
    }

    /// Sets the cardinality scale.
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = scale;
        self
    }

    /// Sets the seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Turns popularity drift on.
    pub fn with_drift(mut self, drift: Drift) -> Self {
        self.drift = Some(drift);
        self
    }
}

/// One batch of samples.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Number of samples.
    pub size: usize,
    /// Dense features, `size * DENSE_FEATURES` values, row-major by sample; all `>= 0`.
    pub dense: Vec<f32>,
    /// Categorical ids, `ids[table][sample]`, each below that table's (scaled) cardinality.
    pub ids: Vec<Vec<u32>>,
    /// Click labels, 0.0 or 1.0, one per sample.
    pub labels: Vec<f32>,
}

impl Batch {
    /// The dense features of one sample.
    ///
    /// # Panics
    /// If `sample >= self.size`.
    pub fn dense_row(&self, sample: usize) -> &[f32] {
        &self.dense[sample * DENSE_FEATURES..(sample + 1) * DENSE_FEATURES]
    }
}

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
    /// [`Error::InvalidArgument`] if `zipf` is negative or not finite, `scale` is not in
    /// `(0, 1]`, or the drift has `batches_per_day == 0` or a negative or non-finite `shift`.
    pub fn new(config: SyntheticConfig) -> Result<Self> {
        if !config.zipf.is_finite() || config.zipf < 0.0 {
            return Err(Error::InvalidArgument(format!(
                "zipf exponent must be finite and >= 0, got {}",
                config.zipf
            )));
        }
        if !(config.scale > 0.0 && config.scale <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "scale must be in (0, 1], got {}",
                config.scale
            )));
        }
        if let Some(drift) = config.drift {
            if drift.batches_per_day == 0 {
                return Err(Error::InvalidArgument(
                    "drift.batches_per_day must be at least 1".into(),
                ));
            }
            if !drift.shift.is_finite() || drift.shift < 0.0 {
                return Err(Error::InvalidArgument(format!(
                    "drift.shift must be finite and >= 0, got {}",
                    drift.shift
                )));
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
                perm: Permutation::new(rows, derive(seed, domain::PERMUTATION, t as u64)),
                hash_key: derive(seed, domain::ID_HASH, t as u64),
                amplitude,
            })
            .collect();

        // Dense features and their part of the hidden model.
        let mut rng = Rng::new(derive(seed, domain::DENSE_MODEL, 0));
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
            return Err(Error::InvalidArgument(format!(
                "{rows} rows over all tables do not fit 32-bit ids"
            )));
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
    pub fn batch(&self, index: u64, size: usize) -> Batch {
        let seed = self.config.seed;
        let day = self.day(index);
        let shift = self.config.drift.map_or(0.0, |d| d.shift);

        let ids: Vec<Vec<u32>> = self
            .tables
            .iter()
            .enumerate()
            .map(|(t, table)| {
                let mut rng = Rng::new(stream_seed(seed, index, LANE_TABLE0 + t as u64));
                let offset = rank_offset(day, shift, table.rows);
                (0..size)
                    .map(|_| {
                        let rank = table.zipf.sample(&mut rng);
                        table.perm.apply(wrap_add(rank - 1, offset, table.rows)) as u32
                    })
                    .collect()
            })
            .collect();

        let mut rng = Rng::new(stream_seed(seed, index, LANE_DENSE));
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

        let mut rng = Rng::new(stream_seed(seed, index, LANE_LABEL));
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

// ---------------------------------------------------------------------------------------------
// Randomness: SplitMix64 for seeding and hashing, xoshiro256** for streams.
// ---------------------------------------------------------------------------------------------

/// The SplitMix64 finalizer: a bijective, well-mixing 64-bit hash.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A value derived from the seed for `(domain, index)`.
fn derive(seed: u64, domain: u64, index: u64) -> u64 {
    mix64(mix64(seed ^ domain).wrapping_add(index.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
}

/// Seed of the random stream of `lane` in batch `index`.
fn stream_seed(seed: u64, index: u64, lane: u64) -> u64 {
    mix64(derive(seed, domain::STREAM, index) ^ mix64(lane.wrapping_add(0x6a09_e667_f3bc_c909)))
}

/// A uniform value in `[0, 1)` from the top 53 bits of `x`.
fn unit_f64(x: u64) -> f64 {
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// xoshiro256** (Blackman & Vigna), seeded through SplitMix64.
#[derive(Clone, Debug)]
struct Rng {
    s: [u64; 4],
}

impl Rng {
    fn new(seed: u64) -> Self {
        // Four consecutive SplitMix64 outputs: mix64 is a bijection, so at most one is zero and
        // the state is never all zero.
        let mut state = seed;
        let mut next = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            mix64(state)
        };
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`.
    fn next_f64(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }

    /// Uniform in `0..n` (multiply-shift; bias below `n / 2^64`).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

// ---------------------------------------------------------------------------------------------
// Zipf sampling by rejection-inversion.
// ---------------------------------------------------------------------------------------------

/// Zipf law over `1..=n`, `P(k) ∝ k^-s`, sampled by rejection-inversion (W. Hörmann and
/// G. Derflinger, "Rejection-inversion to generate variates from monotone discrete
/// distributions", ACM TOMACS 6(3), 1996), in the formulation of Apache Commons RNG's
/// `RejectionInversionZipfSampler`. O(1) memory; expected O(1) time with a high acceptance
/// rate for every `s >= 0`.
#[derive(Clone, Debug)]
struct Zipf {
    n: u64,
    exponent: f64,
    /// `H(1.5) - 1`.
    h_integral_x1: f64,
    /// `H(n + 0.5)`.
    h_integral_n: f64,
    /// The squeeze: `k - x <= s` accepts without evaluating `H`.
    s: f64,
}

impl Zipf {
    fn new(n: u64, exponent: f64) -> Self {
        let mut z = Self {
            n: n.max(1),
            exponent,
            h_integral_x1: 0.0,
            h_integral_n: 0.0,
            s: 0.0,
        };
        z.h_integral_x1 = z.h_integral(1.5) - 1.0;
        z.h_integral_n = z.h_integral(z.n as f64 + 0.5);
        z.s = 2.0 - z.h_integral_inverse(z.h_integral(2.5) - z.h(2.0));
        z
    }

    /// A rank in `1..=n`.
    fn sample(&self, rng: &mut Rng) -> u64 {
        if self.n == 1 {
            return 1;
        }
        if self.exponent == 0.0 {
            return 1 + rng.below(self.n);
        }
        loop {
            // u is uniform in (H(1.5) - 1, H(n + 0.5)].
            let u = self.h_integral_n + rng.next_f64() * (self.h_integral_x1 - self.h_integral_n);
            let x = self.h_integral_inverse(u);
            // `as` saturates (and maps NaN to 0); clamp into the support.
            let k = ((x + 0.5) as u64).clamp(1, self.n);
            let kf = k as f64;
            if kf - x <= self.s || u >= self.h_integral(kf + 0.5) - self.h(kf) {
                return k;
            }
        }
    }

    /// `h(x) = x^-s`.
    fn h(&self, x: f64) -> f64 {
        (-self.exponent * x.ln()).exp()
    }

    /// `H(x) = ∫_1^x t^-s dt = (x^(1-s) - 1) / (1 - s)`, or `ln x` for `s = 1`, computed stably.
    fn h_integral(&self, x: f64) -> f64 {
        let log_x = x.ln();
        helper2((1.0 - self.exponent) * log_x) * log_x
    }

    /// Inverse of [`h_integral`](Self::h_integral).
    fn h_integral_inverse(&self, x: f64) -> f64 {
        let t = (x * (1.0 - self.exponent)).max(-1.0);
        (helper1(t) * x).exp()
    }
}

/// `ln(1 + x) / x`, continuous at 0.
fn helper1(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

/// `(e^x - 1) / x`, continuous at 0.
fn helper2(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x))
    }
}

// ---------------------------------------------------------------------------------------------
// Keyed permutation of 0..n: Feistel network over the next power of two, with cycle-walking.
// ---------------------------------------------------------------------------------------------

const FEISTEL_ROUNDS: usize = 4;

/// A keyed pseudo-random permutation of `0..n` in O(1) memory.
///
/// The domain is `0..2^bits` with `2^bits` the smallest power of two `>= max(n, 4)` (so less than
/// `2n` for `n >= 3`). Each round splits `x` into its high `bits / 2` bits `L` and low
/// `bits - bits / 2` bits `R` and outputs `R · 2^(bits/2) + (L ⊕ F_k(R))`, which is invertible
/// whatever `F`. The round function is a keyed multiply-shift hash (Dietzfelbinger et al.),
/// `F_k(R)` = the top `bits / 2` bits of `(R ⊕ a_k) · m_k mod 2^64` with random `a_k` and odd
/// `m_k`: one multiplication per round, so a permutation costs a few nanoseconds. Values that
/// land outside `0..n` are walked through the permutation again until they land inside
/// (cycle-walking), which restricts a permutation of the power-of-two domain to one of `0..n`;
/// since the domain is less than twice `n`, that takes fewer than two passes on average.
#[derive(Clone, Debug)]
struct Permutation {
    n: u64,
    /// Width of the low part `R`.
    lo_bits: u32,
    /// Width of the high part `L`.
    hi_bits: u32,
    /// Per round: the xor key `a_k` and the odd multiplier `m_k`.
    keys: [(u64, u64); FEISTEL_ROUNDS],
}

impl Permutation {
    fn new(n: u64, key: u64) -> Self {
        let bits = n.max(4).next_power_of_two().trailing_zeros();
        let hi_bits = bits / 2;
        let mut keys = [(0, 0); FEISTEL_ROUNDS];
        for (i, k) in keys.iter_mut().enumerate() {
            let i = 2 * i as u64;
            *k = (
                derive(key, 0x6665_6973_7465_6c21, i),
                derive(key, 0x6665_6973_7465_6c21, i + 1) | 1,
            );
        }
        Self {
            n,
            lo_bits: bits - hi_bits,
            hi_bits,
            keys,
        }
    }

    /// One pass of the Feistel network over `0..2^bits`.
    fn round_trip(&self, mut x: u64) -> u64 {
        let lo_mask = (1u64 << self.lo_bits) - 1;
        // hi_bits >= 1, so the shift is below 64.
        let f_shift = 64 - self.hi_bits;
        for &(a, m) in &self.keys {
            let hi = x >> self.lo_bits;
            let lo = x & lo_mask;
            x = (lo << self.hi_bits) | (hi ^ ((lo ^ a).wrapping_mul(m) >> f_shift));
        }
        x
    }

    /// The image of `x < n`.
    fn apply(&self, x: u64) -> u64 {
        debug_assert!(x < self.n.max(1));
        if self.n <= 1 {
            return x;
        }
        let mut y = self.round_trip(x);
        while y >= self.n {
            y = self.round_trip(y);
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};

    fn gen(config: SyntheticConfig) -> Synthetic {
        Synthetic::new(config).expect("valid config")
    }

    fn invalid(config: SyntheticConfig) -> String {
        match Synthetic::new(config) {
            Err(Error::InvalidArgument(msg)) => msg,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    /// The `k` ids with the highest counts (ties broken by id, so the result is deterministic).
    fn hottest(counts: &HashMap<u32, u64>, k: usize) -> HashSet<u32> {
        let mut v: Vec<(u32, u64)> = counts.iter().map(|(&id, &c)| (id, c)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v.into_iter().take(k).map(|(id, _)| id).collect()
    }

    fn count_table(
        g: &Synthetic,
        table: usize,
        batches: std::ops::Range<u64>,
        size: usize,
    ) -> HashMap<u32, u64> {
        let mut counts = HashMap::new();
        for i in batches {
            for &id in &g.batch(i, size).ids[table] {
                *counts.entry(id).or_insert(0) += 1;
            }
        }
        counts
    }

    #[test]
    fn published_cardinalities() {
        let sum = |d: Dataset| d.cardinalities().iter().sum::<u64>();
        assert_eq!(Dataset::CriteoKaggle.cardinalities().len(), 26);
        assert_eq!(Dataset::Criteo1Tb.cardinalities().len(), 26);
        assert_eq!(Dataset::Avazu.cardinalities().len(), 13);
        assert_eq!(sum(Dataset::CriteoKaggle), 33_762_577);
        assert_eq!(sum(Dataset::Criteo1Tb), 177_944_275);
        assert_eq!(sum(Dataset::Avazu), 9_445_823);
        // Every id fits the u32 of `Batch::ids`.
        for d in Dataset::ALL {
            assert!(d
                .cardinalities()
                .iter()
                .all(|&n| n >= 1 && n <= u64::from(u32::MAX)));
        }
    }

    #[test]
    fn dataset_names_round_trip() {
        for d in Dataset::ALL {
            assert_eq!(d.name().parse::<Dataset>().unwrap(), d);
            assert_eq!(d.to_string(), d.name());
            assert_eq!(d.name().to_uppercase().parse::<Dataset>().unwrap(), d);
        }
        assert_eq!(Dataset::Criteo1Tb.name(), "criteo-1tb");
        match "criteo".parse::<Dataset>() {
            Err(Error::InvalidArgument(msg)) => {
                for d in Dataset::ALL {
                    assert!(msg.contains(d.name()), "{msg}");
                }
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn rejects_bad_configs() {
        let base = SyntheticConfig::new(Dataset::Avazu);
        for zipf in [-0.5, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(invalid(base.clone().with_zipf(zipf)).contains("zipf"));
        }
        for scale in [0.0, -0.1, 1.0001, 2.0, f64::NAN, f64::INFINITY] {
            assert!(invalid(base.clone().with_scale(scale)).contains("scale"));
        }
        let drift = |batches_per_day, shift| {
            base.clone().with_drift(Drift {
                batches_per_day,
                shift,
            })
        };
        assert!(invalid(drift(0, 0.1)).contains("batches_per_day"));
        for shift in [-0.1, f64::NAN, f64::INFINITY] {
            assert!(invalid(drift(10, shift)).contains("shift"));
        }
        // The edges of the valid ranges are accepted.
        gen(base.clone().with_zipf(0.0).with_scale(1.0));
        gen(base.clone().with_scale(f64::MIN_POSITIVE));
        gen(drift(1, 0.0));
        gen(base.with_zipf(40.0));
    }

    #[test]
    fn scale_shrinks_cardinalities() {
        let full = gen(SyntheticConfig::new(Dataset::CriteoKaggle));
        assert_eq!(full.cardinalities(), Dataset::CriteoKaggle.cardinalities());
        let half = gen(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(0.5));
        let expect: Vec<u64> = CRITEO_KAGGLE.iter().map(|n| n.div_ceil(2)).collect();
        assert_eq!(half.cardinalities(), &expect[..]);
        assert_eq!(half.cardinalities()[1], 292); // ceil(583 / 2)
        let tiny = gen(SyntheticConfig::new(Dataset::Criteo1Tb).with_scale(1e-9));
        assert!(tiny.cardinalities().iter().all(|&n| n == 1));
        let small = gen(SyntheticConfig::new(Dataset::Criteo1Tb).with_scale(1e-3));
        assert_eq!(small.cardinalities()[0], 45_834); // ceil(45,833.188)
        assert_eq!(small.cardinalities()[5], 1); // ceil(0.003)
        assert_eq!(small.num_tables(), 26);

        let offsets = half.table_offsets();
        assert_eq!(offsets.len(), 27);
        assert_eq!(offsets[0], 0);
        assert_eq!(offsets[1], 730);
        assert_eq!(offsets[26], expect.iter().sum::<u64>());
        assert!(offsets
            .windows(2)
            .zip(&expect)
            .all(|(w, &n)| w[1] - w[0] == n));
    }

    #[test]
    fn batches_are_deterministic() {
        let config = SyntheticConfig::new(Dataset::CriteoKaggle)
            .with_scale(0.01)
            .with_seed(3);
        let a = gen(config.clone());
        let first = a.batch(5, 300);
        assert_eq!(first.size, 300);
        assert_eq!(first, a.batch(5, 300));
        // Same batch from a fresh generator that produced other batches first.
        let b = gen(config.clone());
        for i in [9, 0, 4, 6] {
            b.batch(i, 77);
        }
        assert_eq!(b.batch(5, 300), first);
        // A shorter batch is a prefix of a longer one.
        let short = b.batch(5, 100);
        assert_eq!(short.dense[..], first.dense[..100 * DENSE_FEATURES]);
        assert_eq!(short.labels[..], first.labels[..100]);
        for t in 0..b.num_tables() {
            assert_eq!(short.ids[t][..], first.ids[t][..100]);
        }
        // Other index, other seed: other data.
        let other = a.batch(6, 300);
        assert_ne!(other.dense, first.dense);
        assert_ne!(other.ids[2], first.ids[2]);
        let reseeded = gen(config.with_seed(4)).batch(5, 300);
        assert_ne!(reseeded.dense, first.dense);
        assert_ne!(reseeded.ids[2], first.ids[2]);
        assert_ne!(reseeded.labels, first.labels);
        // The empty batch is well-formed.
        let empty = a.batch(0, 0);
        assert_eq!(empty.ids.len(), 26);
        assert!(empty.dense.is_empty() && empty.labels.is_empty() && empty.ids[0].is_empty());
    }

    #[test]
    fn ids_stay_in_range() {
        for d in Dataset::ALL {
            for zipf in [0.0, 1.0, 2.0] {
                for scale in [1e-6, 1e-3] {
                    let config = SyntheticConfig::new(d).with_scale(scale).with_zipf(zipf);
                    let config = config.with_drift(Drift {
                        batches_per_day: 1,
                        shift: 0.37,
                    });
                    let g = gen(config);
                    for index in 0..3 {
                        let batch = g.batch(index, 500);
                        assert_eq!(batch.ids.len(), g.num_tables());
                        for (ids, &n) in batch.ids.iter().zip(g.cardinalities()) {
                            assert_eq!(ids.len(), 500);
                            assert!(ids.iter().all(|&id| u64::from(id) < n), "{d} {n}");
                        }
                        assert_eq!(batch.dense.len(), 500 * DENSE_FEATURES);
                        assert!(batch.dense.iter().all(|x| x.is_finite() && *x >= 0.0));
                        assert!(batch.labels.iter().all(|&y| y == 0.0 || y == 1.0));
                    }
                }
            }
        }
    }

    #[test]
    fn permutation_is_a_bijection() {
        for n in [1u64, 2, 3, 4, 5, 7, 8, 9, 17, 1000, 1023, 1024, 1025, 4099] {
            for key in [0, 1, 0xdead_beef] {
                let p = Permutation::new(n, key);
                let mut seen = vec![false; n as usize];
                for x in 0..n {
                    let y = p.apply(x);
                    assert!(y < n, "n={n} key={key}: {x} -> {y}");
                    assert!(!seen[y as usize], "n={n} key={key}: {y} hit twice");
                    seen[y as usize] = true;
                }
            }
        }
        // It scrambles: few fixed points, and the image of 0..10 is not 0..10.
        let p = Permutation::new(1000, 42);
        assert!((0..1000).filter(|&x| p.apply(x) == x).count() < 10);
        assert!((0..10).map(|x| p.apply(x)).any(|y| y >= 10));
        // Different keys, different permutations.
        let q = Permutation::new(1000, 43);
        assert!((0..1000).filter(|&x| p.apply(x) == q.apply(x)).count() < 10);
    }

    /// Generalized harmonic number `Σ_{r=1}^{n} r^-s`.
    fn harmonic(n: u64, s: f64) -> f64 {
        (1..=n).map(|r| (r as f64).powf(-s)).sum()
    }

    #[test]
    fn zipf_top_percent_share_matches_analytic() {
        let n = 1_000_000;
        let z = Zipf::new(n, 1.0);
        let mut rng = Rng::new(11);
        let samples = 1_000_000;
        let top = (0..samples)
            .filter(|_| z.sample(&mut rng) <= n / 100)
            .count();
        let share = top as f64 / samples as f64;
        let expected = harmonic(n / 100, 1.0) / harmonic(n, 1.0);
        assert!((expected - 0.68).abs() < 0.01, "{expected}");
        assert!(
            (share - expected).abs() < 0.02 * expected,
            "share {share}, expected {expected}"
        );
    }

    #[test]
    fn zipf_matches_exact_pmf_on_small_support() {
        let n = 10;
        for s in [0.0, 0.5, 1.0, 2.5] {
            let z = Zipf::new(n, s);
            let mut rng = Rng::new(5);
            let samples = 200_000;
            let mut counts = [0u64; 10];
            for _ in 0..samples {
                let k = z.sample(&mut rng);
                assert!((1..=n).contains(&k));
                counts[(k - 1) as usize] += 1;
            }
            let norm = harmonic(n, s);
            for (i, &c) in counts.iter().enumerate() {
                let p = ((i + 1) as f64).powf(-s) / norm;
                let sd = (samples as f64 * p * (1.0 - p)).sqrt();
                let dev = (c as f64 - samples as f64 * p).abs();
                assert!(
                    dev < 5.0 * sd + 1.0,
                    "s={s} rank {}: {c} vs {}",
                    i + 1,
                    samples as f64 * p
                );
            }
        }
    }

    #[test]
    fn zipf_zero_is_uniform_and_large_exponents_terminate() {
        let z = Zipf::new(100, 0.0);
        let mut rng = Rng::new(9);
        let mut counts = [0u64; 100];
        for _ in 0..100_000 {
            counts[(z.sample(&mut rng) - 1) as usize] += 1;
        }
        // Expected 1000 each, sd ~31.
        assert!(
            counts.iter().all(|&c| (850..=1150).contains(&c)),
            "{counts:?}"
        );
        for s in [20.0, 1e3, 1e12] {
            let z = Zipf::new(50_000_000, s);
            assert!((0..1000).all(|_| z.sample(&mut rng) == 1), "s={s}");
        }
        // Large tables at s = 1 reach deep ranks.
        let z = Zipf::new(50_000_000, 1.0);
        let max = (0..100_000).map(|_| z.sample(&mut rng)).max().unwrap();
        assert!(max > 10_000_000 && max <= 50_000_000, "{max}");
    }

    #[test]
    fn hottest_id_is_scattered() {
        let g = gen(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(0.1));
        let mut zero_hottest = 0;
        let mut checked = 0;
        for (t, table) in g.tables.iter().enumerate() {
            if table.rows < 100 {
                continue;
            }
            let counts = count_table(&g, t, 0..2, 4096);
            let (&top, _) = counts
                .iter()
                .max_by_key(|&(&id, &c)| (c, std::cmp::Reverse(id)))
                .unwrap();
            assert_eq!(u64::from(top), table.perm.apply(0), "table {t}");
            zero_hottest += usize::from(top == 0);
            checked += 1;
        }
        assert!(checked >= 14);
        assert_eq!(zero_hottest, 0);
    }

    #[test]
    fn dense_features_match_their_moments() {
        let g = gen(SyntheticConfig::new(Dataset::Avazu).with_seed(21));
        let batch = g.batch(0, 20_000);
        for j in 0..DENSE_FEATURES {
            let (mean, sd) = log_count_moments(g.count_scale[j]);
            let col: Vec<f64> = (0..batch.size)
                .map(|i| f64::from(batch.dense_row(i)[j]))
                .collect();
            let m = col.iter().sum::<f64>() / col.len() as f64;
            let v = col.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / col.len() as f64;
            assert!(
                (m - mean).abs() < 0.05 * sd,
                "feature {j}: mean {m} vs {mean}"
            );
            assert!(
                (v.sqrt() / sd - 1.0).abs() < 0.05,
                "feature {j}: sd {} vs {sd}",
                v.sqrt()
            );
        }
    }

    #[test]
    fn labels_have_criteo_rate_and_signal() {
        let configs = [
            SyntheticConfig::new(Dataset::CriteoKaggle),
            SyntheticConfig::new(Dataset::CriteoKaggle)
                .with_scale(0.01)
                .with_seed(1),
            SyntheticConfig::new(Dataset::Criteo1Tb)
                .with_scale(0.001)
                .with_seed(2),
            SyntheticConfig::new(Dataset::Avazu)
                .with_scale(0.1)
                .with_seed(3),
            SyntheticConfig::new(Dataset::Avazu)
                .with_zipf(0.0)
                .with_seed(4),
        ];
        for config in configs {
            let g = gen(config.clone());
            let batch = g.batch(1, 16_384);
            let rate = batch.labels.iter().sum::<f32>() / batch.size as f32;
            assert!((0.15..=0.35).contains(&rate), "{config:?}: rate {rate}");

            let mut by_logit: Vec<(f64, f32)> = (0..batch.size)
                .map(|i| (g.true_logit(&batch, i), batch.labels[i]))
                .collect();
            by_logit.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (low, high) = by_logit.split_at(batch.size / 2);
            let mean =
                |v: &[(f64, f32)]| v.iter().map(|x| f64::from(x.1)).sum::<f64>() / v.len() as f64;
            let (low, high) = (mean(low), mean(high));
            assert!(high - low > 0.2, "{config:?}: {high} vs {low}");
        }
    }

    #[test]
    fn drift_moves_the_hot_set() {
        let base = SyntheticConfig::new(Dataset::CriteoKaggle)
            .with_scale(0.1)
            .with_seed(8);
        let drifting = gen(base.clone().with_drift(Drift {
            batches_per_day: 4,
            shift: 0.05,
        }));
        let fixed = gen(base.clone());
        let table = 2; // about a million rows at this scale
        let overlap = |g: &Synthetic| {
            let day0 = hottest(&count_table(g, table, 0..4, 8192), 100);
            let day1 = hottest(&count_table(g, table, 4..8, 8192), 100);
            day0.intersection(&day1).count()
        };
        assert_eq!((drifting.day(3), drifting.day(4), fixed.day(4)), (0, 1, 0));
        let moved = overlap(&drifting);
        let stable = overlap(&fixed);
        assert!(moved < 10, "drifting hot sets overlap by {moved}");
        assert!(stable > 60, "fixed hot sets overlap by only {stable}");
        // Day 0 is the same with and without drift, and shift 0 is no drift at all.
        assert_eq!(drifting.batch(2, 256), fixed.batch(2, 256));
        let still = gen(base.with_drift(Drift {
            batches_per_day: 1,
            shift: 0.0,
        }));
        assert_eq!(still.batch(9, 256), fixed.batch(9, 256));
    }

    #[test]
    fn rank_offset_follows_the_formula() {
        assert_eq!(rank_offset(0, 0.3, 1000), 0);
        assert_eq!(rank_offset(1, 0.3, 1000), 300);
        assert_eq!(rank_offset(2, 0.3, 1000), 600);
        assert_eq!(rank_offset(4, 0.3, 1000), 200); // 1200 mod 1000
        assert_eq!(rank_offset(4, 1.3, 1000), 200); // the integer part of shift does not matter
        assert_eq!(rank_offset(1, 0.1, 3), 0); // floor(0.3)
        assert_eq!(rank_offset(4, 0.1, 3), 1); // floor(1.2)
        assert!(rank_offset(u64::MAX, 0.999, 48_937_457) < 48_937_457);
        assert_eq!(rank_offset(7, 0.5, 1), 0);
    }

    #[test]
    fn concat_ids_offsets_each_table() {
        let g =
            Synthetic::new(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(0.001)).unwrap();
        let b = g.batch(3, 5);
        let ids = g.concat_ids(&b).unwrap();
        let offsets = g.table_offsets();
        assert_eq!(ids.len(), 5 * g.num_tables());
        for (t, col) in b.ids.iter().enumerate() {
            for (s, &id) in col.iter().enumerate() {
                let got = ids[t * 5 + s] as u64;
                assert_eq!(got, offsets[t] + id as u64);
                assert!(got < offsets[t + 1]);
            }
        }
    }

    #[test]
    fn generator_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Synthetic>();
        assert_send_sync::<Batch>();
        let g = gen(SyntheticConfig::new(Dataset::Avazu).with_scale(0.01));
        let here = g.batch(12, 64);
        let there = std::thread::scope(|s| s.spawn(|| g.batch(12, 64)).join().unwrap());
        assert_eq!(here, there);
    }
}
