//! Per-table vocabularies of categorical values, built from a first pass over a Criteo file.

use std::collections::HashMap;
use std::io::BufRead;

use super::{read_line, validate_cardinalities, TsvReport, TsvRow, CATEGORICAL_FEATURES};
use crate::error::{Error, Result};

/// A map from each table's categorical values to dense ids, by frequency.
///
/// Built by [`Vocabulary::build`] from a pass over the data (malformed lines are skipped, as the
/// reader skips them). In table `t`, id [`MISSING`](Self::MISSING) (0) is a missing value, id
/// [`OOV`](Self::OOV) (1) a value the vocabulary does not hold, and ids `2, 3, ...` are the
/// values seen, most frequent first, values of equal count in order of first appearance. A table
/// of cardinality `N` keeps its `N - 2` most frequent values; the rest map to `OOV`.
///
/// ```
/// use std::io::Cursor;
/// use tidemem::data::criteo::{TsvRow, Vocabulary};
///
/// # fn main() -> tidemem::Result<()> {
/// let row = |v| TsvRow { label: 0, dense: [None; 13], categorical: [Some(v); 26] };
/// let text: String = [row(7), row(9), row(9)].iter().map(|r| r.to_line() + "\n").collect();
/// let (vocab, report) = Vocabulary::build(Cursor::new(text), &[100; 26])?;
/// assert_eq!(report.samples, 3);
/// assert_eq!(vocab.id(0, Some(9)), 2); // the most frequent value
/// assert_eq!(vocab.id(0, Some(7)), 3);
/// assert_eq!(vocab.id(0, Some(8)), Vocabulary::OOV);
/// assert_eq!(vocab.id(0, None), Vocabulary::MISSING);
/// assert_eq!(vocab.len(0), 2);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Vocabulary {
    tables: Vec<HashMap<u32, u32>>,
    cardinalities: Vec<u64>,
}

impl Vocabulary {
    /// The id of a missing value.
    pub const MISSING: u32 = 0;
    /// The id of a value outside the vocabulary.
    pub const OOV: u32 = 1;
    /// The first id of a value.
    const FIRST: u32 = 2;

    /// Counts the values of every good line of `reader` and numbers them (see the type's
    /// docs), keeping at most `cardinalities[t] - 2` values in table `t`. Returns the
    /// vocabulary and the report of the pass (malformed lines are skipped and reported).
    ///
    /// # Errors
    /// [`Error::Length`] if there are not [`CATEGORICAL_FEATURES`] cardinalities,
    /// [`Error::TooFew`] or [`Error::TooLarge`] if one is outside `2..=2^32`; [`Error::Io`] if
    /// the reader fails.
    pub fn build<R: BufRead>(mut reader: R, cardinalities: &[u64]) -> Result<(Self, TsvReport)> {
        validate_cardinalities(cardinalities)?;
        if let Some((t, &n)) = cardinalities.iter().enumerate().find(|(_, &n)| n < 2) {
            return Err(Error::TooFew {
                what: format!(
                    "the cardinality of table {t} (a vocabulary needs the missing and OOV ids)"
                ),
                got: n as usize,
                need: 2,
            });
        }
        // value -> (count, first appearance)
        let mut counts: Vec<HashMap<u32, (u64, u64)>> = vec![HashMap::new(); CATEGORICAL_FEATURES];
        let mut report = TsvReport::default();
        let mut line = Vec::new();
        while read_line(&mut reader, &mut line)? {
            report.lines += 1;
            match TsvRow::parse(&line) {
                Ok(row) => {
                    report.samples += 1;
                    for (table, v) in counts.iter_mut().zip(row.categorical) {
                        if let Some(v) = v {
                            let order = table.len() as u64;
                            table.entry(v).or_insert((0, order)).0 += 1;
                        }
                    }
                }
                Err(kind) => report.record(report.lines, kind),
            }
        }
        let tables = counts
            .into_iter()
            .zip(cardinalities)
            .map(|(table, &n)| {
                let mut values: Vec<(u32, (u64, u64))> = table.into_iter().collect();
                values.sort_unstable_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.1 .1.cmp(&b.1 .1)));
                let keep = usize::try_from(n - 2).unwrap_or(usize::MAX);
                values
                    .into_iter()
                    .take(keep)
                    .zip(Self::FIRST..)
                    .map(|((v, _), id)| (v, id))
                    .collect()
            })
            .collect();
        Ok((
            Self {
                tables,
                cardinalities: cardinalities.to_vec(),
            },
            report,
        ))
    }

    /// The id of `value` in `table`: [`MISSING`](Self::MISSING) for `None`,
    /// [`OOV`](Self::OOV) for a value not held (or a table index out of range).
    pub fn id(&self, table: usize, value: Option<u32>) -> u32 {
        match value {
            None => Self::MISSING,
            Some(v) => self
                .tables
                .get(table)
                .and_then(|t| t.get(&v).copied())
                .unwrap_or(Self::OOV),
        }
    }

    /// Number of values table `table` holds (its ids are `2..2 + len`); 0 for a table index
    /// out of range.
    pub fn len(&self, table: usize) -> usize {
        self.tables.get(table).map_or(0, HashMap::len)
    }

    /// Whether no table holds a value.
    pub fn is_empty(&self) -> bool {
        self.tables.iter().all(HashMap::is_empty)
    }

    /// The cardinalities the vocabulary was built with: every id of table `t` is below
    /// `cardinalities()[t]`.
    pub fn cardinalities(&self) -> &[u64] {
        &self.cardinalities
    }
}
