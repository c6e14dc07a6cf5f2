mod vocab;

use std::fmt;
use std::io::{BufRead, Read, Write};

pub use vocab::Vocabulary;

use super::{Batch, DENSE_FEATURES};
use crate::error::{Error, Result};
use crate::rng::mix64;

/// Number of categorical columns (embedding tables) of a Criteo line.
pub const CATEGORICAL_FEATURES: usize = 26;

/// Number of tab-separated columns of a Criteo line: label, dense, categorical.
pub const COLUMNS: usize = 1 + DENSE_FEATURES + CATEGORICAL_FEATURES;

/// How many malformed line numbers a [`TsvReport`] keeps (it counts them all).
pub const MAX_REPORTED_LINES: usize = 100;

/// The id of categorical value `value` in a table of `cardinality` rows under [`IdMap::Hash`]:
/// `mix64(value) mod cardinality`, with `mix64` the SplitMix64 finalizer
/// ([`crate::rng::mix64`]), fixed across versions and platforms. Returns 0 when `cardinality`
/// is 0.
///
/// ```
/// use tidemem::data::criteo::hash_id;
/// assert!(hash_id(0x05db_9164, 1460) < 1460);
/// assert_eq!(hash_id(7, 1), 0);
/// ```
pub fn hash_id(value: u32, cardinality: u64) -> u32 {
    if cardinality == 0 {
        return 0;
    }
    (mix64(u64::from(value)) % cardinality) as u32
}

/// The dense transform: `ln(1 + max(x, 0))`, computed in `f64` and rounded to `f32`; a missing
/// value (`None`) counts as 0.
///
/// ```
/// use tidemem::data::criteo::dense_transform;
/// assert_eq!(dense_transform(Some(0)), 0.0);
/// assert_eq!(dense_transform(Some(-5)), 0.0);
/// assert_eq!(dense_transform(None), 0.0);
/// assert_eq!(dense_transform(Some(9)), 10f64.ln() as f32);
/// ```
pub fn dense_transform(x: Option<i64>) -> f32 {
    let x = x.unwrap_or(0).max(0);
    (x as f64).ln_1p() as f32
}

/// How categorical values become ids.
#[derive(Clone, Debug, PartialEq)]
pub enum IdMap {
    /// [`hash_id`] of the value modulo the table's cardinality; a missing value is id 0 (which
    /// hashed values may share).
    Hash,
    /// Ids from a [`Vocabulary`] built over the data: [`Vocabulary::MISSING`] for a missing
    /// value, [`Vocabulary::OOV`] for a value the vocabulary does not hold.
    Vocabulary(Vocabulary),
}

/// What a [`TsvReader`] needs: the id mapping and the number of rows of each table.
#[derive(Clone, Debug, PartialEq)]
pub struct TsvConfig {
    /// How categorical values become ids.
    pub ids: IdMap,
    /// Rows of each of the [`CATEGORICAL_FEATURES`] tables: every id of table `t` is below
    /// `cardinalities[t]`. At least 1 and at most `2^32` each (at least 2 with a vocabulary,
    /// which the vocabulary was built with).
    pub cardinalities: Vec<u64>,
}

/// Why a line was skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Malformed {
    /// The line does not have [`COLUMNS`] tab-separated columns.
    ColumnCount {
        /// Columns found.
        found: usize,
    },
    /// The label is not `0` or `1`.
    Label,
    /// A dense value is not a (64-bit) integer.
    Dense {
        /// Dense column, `0..DENSE_FEATURES`.
        column: usize,
    },
    /// A categorical value is not 1 to 8 hexadecimal digits.
    Categorical {
        /// Categorical column (table), `0..CATEGORICAL_FEATURES`.
        column: usize,
    },
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Malformed::ColumnCount { found } => write!(f, "{found} columns, expected {COLUMNS}"),
            Malformed::Label => f.write_str("label is not 0 or 1"),
            Malformed::Dense { column } => write!(f, "dense column {column} is not an integer"),
            Malformed::Categorical { column } => {
                write!(f, "categorical column {column} is not 1 to 8 hex digits")
            }
        }
    }
}

/// One skipped line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MalformedLine {
    /// 1-based line number in the input.
    pub line: u64,
    /// What was wrong with it (the first problem found, left to right).
    pub kind: Malformed,
}

/// What a [`TsvReader`] has read so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TsvReport {
    /// Lines read, good and malformed.
    pub lines: u64,
    /// Good lines, i.e. samples returned in batches.
    pub samples: u64,
    /// Malformed lines skipped, all of them.
    pub malformed: u64,
    /// The first [`MAX_REPORTED_LINES`] malformed lines, in input order.
    pub malformed_lines: Vec<MalformedLine>,
}

impl TsvReport {
    fn record(&mut self, line: u64, kind: Malformed) {
        self.malformed += 1;
        if self.malformed_lines.len() < MAX_REPORTED_LINES {
            self.malformed_lines.push(MalformedLine { line, kind });
        }
    }
}

/// One parsed line: the raw values, before the dense transform and the id mapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TsvRow {
    /// The click label, 0 or 1 (written as is: [`write_tsv`] refuses other values).
    pub label: u8,
    /// The integer dense values; `None` is an empty column.
    pub dense: [Option<i64>; DENSE_FEATURES],
    /// The categorical values; `None` is an empty column.
    pub categorical: [Option<u32>; CATEGORICAL_FEATURES],
}

impl TsvRow {
    /// Parses one line (without its `\n`; a trailing `\r` is ignored).
    ///
    /// ```
    /// use tidemem::data::criteo::{Malformed, TsvRow};
    /// assert_eq!(TsvRow::parse(b"1\t2"), Err(Malformed::ColumnCount { found: 2 }));
    /// ```
    ///
    /// # Errors
    /// The first problem of the line, columns left to right.
    pub fn parse(line: &[u8]) -> std::result::Result<Self, Malformed> {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let found = line.split(|&b| b == b'\t').count();
        if found != COLUMNS {
            return Err(Malformed::ColumnCount { found });
        }
        let mut cols = line.split(|&b| b == b'\t');
        let label = match cols.next() {
            Some(b"0") => 0,
            Some(b"1") => 1,
            _ => return Err(Malformed::Label),
        };
        let mut dense = [None; DENSE_FEATURES];
        for (column, (slot, field)) in dense.iter_mut().zip(cols.by_ref()).enumerate() {
            *slot = parse_dense(field).ok_or(Malformed::Dense { column })?;
        }
        let mut categorical = [None; CATEGORICAL_FEATURES];
        for (column, (slot, field)) in categorical.iter_mut().zip(cols).enumerate() {
            *slot = parse_hex(field).ok_or(Malformed::Categorical { column })?;
        }
        Ok(Self {
            label,
            dense,
            categorical,
        })
    }

    /// The line in Criteo format, without the `\n`: label, dense values in decimal, categorical
    /// values as 8 lower-case hex digits, missing values empty.
    pub fn to_line(&self) -> String {
        let mut s = String::with_capacity(COLUMNS * 9);
        s.push_str(if self.label == 0 { "0" } else { "1" });
        for x in &self.dense {
            s.push('\t');
            if let Some(x) = x {
                s.push_str(&x.to_string());
            }
        }
        for v in &self.categorical {
            s.push('\t');
            if let Some(v) = v {
                s.push_str(&format!("{v:08x}"));
            }
        }
        s
    }
}

/// `Some(None)` for an empty field, `Some(Some(x))` for an integer, `None` otherwise.
fn parse_dense(field: &[u8]) -> Option<Option<i64>> {
    if field.is_empty() {
        return Some(None);
    }
    let digits = field.strip_prefix(b"-").unwrap_or(field);
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    // ASCII digits (and a sign) are valid UTF-8.
    std::str::from_utf8(field).ok()?.parse().ok().map(Some)
}

/// `Some(None)` for an empty field, `Some(Some(v))` for 1 to 8 hex digits, `None` otherwise.
fn parse_hex(field: &[u8]) -> Option<Option<u32>> {
    if field.is_empty() {
        return Some(None);
    }
    if field.len() > 8 || !field.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let v = field.iter().fold(0u32, |acc, &b| {
        (acc << 4) | (b as char).to_digit(16).unwrap_or(0)
    });
    Some(Some(v))
}

/// Writes `rows` in the Criteo format, one line each, `\n`-terminated.
///
/// ```
/// use tidemem::data::criteo::{write_tsv, TsvRow};
/// # fn main() -> tidemem::Result<()> {
/// let row = TsvRow { label: 1, dense: [Some(-1); 13], categorical: [Some(0xab); 26] };
/// let mut out = Vec::new();
/// write_tsv(&mut out, &[row.clone()])?;
/// assert_eq!(TsvRow::parse(out.strip_suffix(b"\n").unwrap()), Ok(row));
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::BadValue`] if a label is neither 0 nor 1 (checked before anything is written),
/// [`Error::Io`] if the writer fails.
pub fn write_tsv<W: Write>(mut writer: W, rows: &[TsvRow]) -> Result<()> {
    if let Some(i) = rows.iter().position(|r| r.label > 1) {
        return Err(Error::BadValue {
            what: format!("the label of row {i}"),
            value: f64::from(rows[i].label),
            want: "0 or 1",
        });
    }
    let io = |source| Error::Io {
        during: "writing a Criteo TSV line",
        source,
    };
    for row in rows {
        writer.write_all(row.to_line().as_bytes()).map_err(io)?;
        writer.write_all(b"\n").map_err(io)?;
    }
    writer.flush().map_err(io)
}

/// The rows of a (synthetic) batch with [`CATEGORICAL_FEATURES`] tables, as a Criteo file would
/// hold them: dense feature `y` becomes the count `round(exp(y) - 1)` (so
/// [`dense_transform`] gives `y` back up to `f32` rounding for the generator's
/// `ln(1 + count)` values), id `i` becomes the categorical value `i`, label 1.0 becomes 1.
///
/// # Errors
/// [`Error::Length`] if the batch does not have [`CATEGORICAL_FEATURES`] tables or its vectors
/// do not match its size.
pub fn rows_from_batch(batch: &Batch) -> Result<Vec<TsvRow>> {
    let size = batch.size;
    let length = |what: String, got: usize, expected: usize| {
        if got == expected {
            Ok(())
        } else {
            Err(Error::Length {
                what,
                got,
                expected,
            })
        }
    };
    length(
        "tables of a batch as Criteo rows".into(),
        batch.ids.len(),
        CATEGORICAL_FEATURES,
    )?;
    length(
        format!("dense values of a batch of {size} samples ({DENSE_FEATURES} a sample)"),
        batch.dense.len(),
        size * DENSE_FEATURES,
    )?;
    length(
        format!("labels of a batch of {size} samples"),
        batch.labels.len(),
        size,
    )?;
    for (t, c) in batch.ids.iter().enumerate() {
        length(
            format!("ids of table {t} of a batch of {size} samples"),
            c.len(),
            size,
        )?;
    }
    Ok((0..batch.size)
        .map(|i| {
            let mut dense = [None; DENSE_FEATURES];
            for (d, &y) in dense.iter_mut().zip(batch.dense_row(i)) {
                *d = Some((f64::from(y).exp() - 1.0).round().max(0.0) as i64);
            }
            let mut categorical = [None; CATEGORICAL_FEATURES];
            for (c, col) in categorical.iter_mut().zip(&batch.ids) {
                *c = Some(col[i]);
            }
            TsvRow {
                label: u8::from(batch.labels[i] > 0.5),
                dense,
                categorical,
            }
        })
        .collect())
}

/// The longest line a reader takes (a Criteo line is a few hundred bytes): past it the input
/// is not a TSV of samples (`/dev/zero`, a binary file), and reading on would grow without
/// bound.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// Reads the lines of `reader` one by one into `line` (cleared first, `\n` stripped); `false` at
/// the end of the input. A line longer than [`MAX_LINE_BYTES`] is [`Error::TooLarge`].
fn read_line<R: BufRead>(reader: &mut R, line: &mut Vec<u8>) -> Result<bool> {
    line.clear();
    let n = reader
        .by_ref()
        .take(MAX_LINE_BYTES as u64 + 1)
        .read_until(b'\n', line)
        .map_err(|source| Error::Io {
            during: "reading a Criteo TSV line",
            source,
        })?;
    if line.len() > MAX_LINE_BYTES && line.last() != Some(&b'\n') {
        return Err(Error::TooLarge {
            what: "a Criteo TSV line (no end of line within the limit: is the input a text \
                   file of samples?)"
                .into(),
            requested: line.len() as u128,
            limit: MAX_LINE_BYTES as u64,
        });
    }
    if line.last() == Some(&b'\n') {
        line.pop();
    }
    Ok(n > 0)
}

/// A streaming reader (and a writer) of the Criteo click-log TSV format.
///
/// Each line is one sample: a label (`0` or `1`), [`DENSE_FEATURES`] integer dense columns and
/// [`CATEGORICAL_FEATURES`] categorical columns written as hexadecimal strings (8 digits in the
/// published files; 1 to 8 are accepted), 40 columns separated by tabs. Any dense or categorical
/// column may be empty (a missing value); the label may not. A trailing `\r` is ignored.
///
/// [`TsvReader`] turns the lines into the crate's [`Batch`]es, the same type the synthetic
/// generator makes, so a trainer takes either:
///
/// - dense value `x` becomes `ln(1 + max(x, 0))` (negative values are clipped to 0, a missing
///   value counts as 0), as the reference DLRM does; the logarithm is taken in `f64` and rounded
///   once to `f32`;
/// - a categorical value becomes an id below its table's cardinality through an [`IdMap`]:
///   [`IdMap::Hash`] ([`hash_id`]: a fixed 64-bit hash modulo the cardinality, missing → 0) or
///   [`IdMap::Vocabulary`] (a [`Vocabulary`] built from a first pass over the data: ids by
///   frequency, with reserved ids for missing and unseen values).
///
/// A malformed line (a wrong number of columns, a label other than `0`/`1`, a dense value that
/// is not an integer, a categorical value that is not hexadecimal) is skipped and counted in the
/// reader's [`TsvReport`], with its 1-based line number (the first [`MAX_REPORTED_LINES`]).
/// Reading never panics and never stops on a bad line; only an I/O error of the underlying
/// reader ends it with an error.
///
/// [`write_tsv`] writes [`TsvRow`]s in the same format, and [`rows_from_batch`] turns a
/// synthetic batch into rows, so tests and examples make their own files: nothing to download.
///
/// ```
/// use std::io::Cursor;
/// use tidemem::data::criteo::{hash_id, IdMap, TsvConfig, TsvReader};
///
/// # fn main() -> tidemem::Result<()> {
/// let mut line = vec!["1".to_string(), "3".into(), "-1".into(), String::new()];
/// line.extend(std::iter::repeat_n("0".to_string(), 10)); // the other dense columns
/// line.push("68fd1e64".into());
/// line.extend(std::iter::repeat_n(String::new(), 25)); // missing categorical values
/// let text = format!("{}\nnot a criteo line\n", line.join("\t"));
///
/// let config = TsvConfig { ids: IdMap::Hash, cardinalities: vec![1000; 26] };
/// let mut reader = TsvReader::new(Cursor::new(text), config)?;
/// let batch = reader.next_batch(128)?.expect("one good line");
/// assert_eq!(batch.size, 1);
/// assert_eq!(batch.labels, [1.0]);
/// assert_eq!(batch.dense[..3], [(4f64).ln() as f32, 0.0, 0.0]);
/// assert_eq!(batch.ids[0][0], hash_id(0x68fd_1e64, 1000));
/// assert_eq!(batch.ids[1][0], 0); // missing
/// assert!(reader.next_batch(128)?.is_none());
/// assert_eq!(reader.report().malformed, 1);
/// assert_eq!(reader.report().malformed_lines[0].line, 2);
/// # Ok(()) }
/// ```
///
/// A streaming reader of Criteo TSV lines into [`Batch`]es (see the [`TsvReader`]).
///
/// Reads one line at a time from any [`BufRead`]: a file of any size streams through a
/// [`BufReader`](std::io::BufReader).
///
/// ```
/// use std::fs::File;
/// use std::io::BufReader;
/// use tidemem::data::criteo::{write_tsv, IdMap, TsvConfig, TsvReader, TsvRow};
///
/// # fn main() -> tidemem::Result<()> {
/// let rows: Vec<TsvRow> = (0..10u8)
///     .map(|i| TsvRow { label: i % 2, dense: [Some(i.into()); 13], categorical: [Some(i.into()); 26] })
///     .collect();
/// let mut file = tempfile::tempfile().unwrap();
/// write_tsv(&mut file, &rows)?;
/// std::io::Seek::rewind(&mut file).unwrap();
///
/// let config = TsvConfig { ids: IdMap::Hash, cardinalities: vec![100; 26] };
/// let mut reader = TsvReader::new(BufReader::new(file), config)?;
/// let mut sizes = Vec::new();
/// while let Some(batch) = reader.next_batch(4)? {
///     sizes.push(batch.size);
/// }
/// assert_eq!(sizes, [4, 4, 2]);
/// assert_eq!(reader.report().samples, 10);
/// assert_eq!(reader.report().malformed, 0);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TsvReader<R> {
    reader: R,
    config: TsvConfig,
    report: TsvReport,
    line: Vec<u8>,
}

impl<R: BufRead> TsvReader<R> {
    /// A reader over `reader`; nothing is read yet.
    ///
    /// # Errors
    /// [`Error::Length`] if `config` does not have [`CATEGORICAL_FEATURES`] cardinalities,
    /// [`Error::TooFew`] or [`Error::TooLarge`] if one is 0 or above `2^32`, and
    /// [`Error::Conflict`] if (with a vocabulary) they differ from what the vocabulary was built
    /// with.
    pub fn new(reader: R, config: TsvConfig) -> Result<Self> {
        validate_cardinalities(&config.cardinalities)?;
        if let IdMap::Vocabulary(v) = &config.ids {
            if v.cardinalities() != config.cardinalities.as_slice() {
                return Err(Error::Conflict {
                    what: format!(
                        "a vocabulary built for cardinalities {:?}",
                        v.cardinalities()
                    ),
                    with: format!("a config of cardinalities {:?}", config.cardinalities),
                });
            }
        }
        Ok(Self {
            reader,
            config,
            report: TsvReport::default(),
            line: Vec::new(),
        })
    }

    /// What has been read so far.
    pub fn report(&self) -> &TsvReport {
        &self.report
    }

    /// The configuration.
    pub fn config(&self) -> &TsvConfig {
        &self.config
    }

    /// Gives the underlying reader back.
    pub fn into_inner(self) -> R {
        self.reader
    }

    /// The next batch of up to `n` samples (fewer only at the end of the input), skipping and
    /// counting malformed lines; `None` once no good line is left.
    ///
    /// # Errors
    /// [`Error::TooFew`] if `n` is 0; [`Error::Io`] if the underlying reader fails
    /// (the samples of the batch in progress are then lost; the lines before it were returned).
    pub fn next_batch(&mut self, n: usize) -> Result<Option<Batch>> {
        if n == 0 {
            return Err(Error::TooFew {
                what: "samples of a batch".into(),
                got: 0,
                need: 1,
            });
        }
        // Reserve for the batch, but not for an absurd `n` the input may never fill.
        let cap = n.min(1 << 16);
        let mut batch = Batch {
            size: 0,
            dense: Vec::with_capacity(cap * DENSE_FEATURES),
            ids: (0..CATEGORICAL_FEATURES)
                .map(|_| Vec::with_capacity(cap))
                .collect(),
            labels: Vec::with_capacity(cap),
        };
        while batch.size < n && read_line(&mut self.reader, &mut self.line)? {
            self.report.lines += 1;
            let row = match TsvRow::parse(&self.line) {
                Ok(row) => row,
                Err(kind) => {
                    self.report.record(self.report.lines, kind);
                    continue;
                }
            };
            self.report.samples += 1;
            batch.size += 1;
            batch.labels.push(f32::from(row.label));
            batch
                .dense
                .extend(row.dense.iter().map(|&x| dense_transform(x)));
            for (t, (col, &v)) in batch.ids.iter_mut().zip(&row.categorical).enumerate() {
                col.push(self.id(t, v));
            }
        }
        Ok((batch.size > 0).then_some(batch))
    }

    fn id(&self, table: usize, value: Option<u32>) -> u32 {
        match &self.config.ids {
            IdMap::Hash => value.map_or(0, |v| hash_id(v, self.config.cardinalities[table])),
            IdMap::Vocabulary(vocab) => vocab.id(table, value),
        }
    }
}

/// [`CATEGORICAL_FEATURES`] cardinalities, each in `1..=2^32`.
fn validate_cardinalities(cardinalities: &[u64]) -> Result<()> {
    if cardinalities.len() != CATEGORICAL_FEATURES {
        return Err(Error::Length {
            what: "cardinalities (one a table of a Criteo line)".into(),
            got: cardinalities.len(),
            expected: CATEGORICAL_FEATURES,
        });
    }
    if let Some((t, &n)) = cardinalities
        .iter()
        .enumerate()
        .find(|(_, &n)| n == 0 || n > 1 << 32)
    {
        let what = format!("the cardinality of table {t}");
        return Err(if n == 0 {
            Error::TooFew {
                what,
                got: 0,
                need: 1,
            }
        } else {
            Error::TooLarge {
                what,
                requested: u128::from(n),
                limit: 1 << 32,
            }
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_line_is_refused_not_read_forever() {
        let mut line = Vec::new();
        let mut zeros = std::io::BufReader::new(std::io::repeat(0));
        let e = read_line(&mut zeros, &mut line).unwrap_err();
        assert!(
            matches!(e, Error::TooLarge { limit, .. } if limit == MAX_LINE_BYTES as u64),
            "{e}"
        );
        let mut short = std::io::Cursor::new(b"a\tb\nc".to_vec());
        assert!(read_line(&mut short, &mut line).unwrap());
        assert_eq!(line, b"a\tb");
        assert!(read_line(&mut short, &mut line).unwrap());
        assert_eq!(line, b"c");
        assert!(!read_line(&mut short, &mut line).unwrap());
    }
}
