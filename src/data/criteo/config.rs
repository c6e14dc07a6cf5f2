//! What the Criteo-like generator makes and from what: the data sets and their table
//! cardinalities, the configuration, and the batches.

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
                Error::Parse {
                    what: "dataset",
                    input: s.to_string(),
                    expected: format!("one of {}", names.join(", ")),
                }
            })
    }
}

/// Popularity drift over "days" of batches (see the [module docs](super#drift)).
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

/// Parameters of a [`Synthetic`](super::Synthetic) generator.
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
    /// Host bytes of a batch of `size` samples over `tables` tables (dense features, one id
    /// per table, a label), checked against what the machine holds: [`Error::TooLarge`] when
    /// the bytes overflow or exceed [`crate::limits::host_limit`].
    ///
    /// [`Error::TooLarge`]: crate::Error::TooLarge
    pub fn bytes_for(size: usize, tables: usize) -> crate::Result<usize> {
        let per_sample = (DENSE_FEATURES + 1)
            .saturating_add(tables)
            .saturating_mul(4);
        crate::limits::host_bytes(
            || format!("bytes of a batch of {size} samples of {tables} tables"),
            &[size, per_sample],
        )
    }

    /// The dense features of one sample.
    ///
    /// # Panics
    /// If `sample >= self.size`.
    pub fn dense_row(&self, sample: usize) -> &[f32] {
        &self.dense[sample * DENSE_FEATURES..(sample + 1) * DENSE_FEATURES]
    }
}
