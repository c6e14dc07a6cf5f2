//! Where the batches come from: the synthetic generator (with its hidden model, the ceiling on
//! that data) or a Criteo TSV file.

use std::collections::VecDeque;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tidemem::data::criteo::{Batch, IdMap, Synthetic, TsvConfig, TsvReader, TsvReport, Vocabulary};
use tidemem::data::{Ahead, AheadStats};
use tidemem::prelude::*;

/// Held-out synthetic batches start at this index: disjoint from the training batches.
pub const HELD_OUT: u64 = 1 << 40;

/// A stream of training batches and a held-out set.
pub enum Source {
    /// Synthetic Criteo-like data: batch `i` is `gen.batch(i, size)`.
    Synthetic { gen: Box<Synthetic>, next: u64 },
    /// A Criteo TSV file read in one pass, batches read ahead (for the id counts) kept in
    /// `ahead`.
    Tsv {
        reader: Box<TsvReader<BufReader<File>>>,
        ahead: VecDeque<Batch>,
        path: PathBuf,
    },
}

fn open(path: &Path) -> Result<BufReader<File>> {
    let io = |source| Error::FileIo {
        during: "opening",
        path: path.to_path_buf(),
        source,
    };
    // a fifo or a device would be read forever, or block for a writer
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(Error::NotAFile {
            path: path.to_path_buf(),
            kind: if meta.is_dir() {
                "directory"
            } else {
                "fifo, device or socket"
            },
        });
    }
    let f = File::open(path).map_err(io)?;
    Ok(BufReader::with_capacity(1 << 20, f))
}

/// The reader's configuration: ids hashed into `cardinalities`, or numbered by a vocabulary
/// built over the file first (one more pass; every table then keeps at least 2 rows).
pub fn tsv_config(path: &Path, cardinalities: &[u64], vocab: bool) -> Result<TsvConfig> {
    // a vocabulary keeps two ids (missing and out-of-vocabulary) in every table
    let cardinalities: Vec<u64> = if vocab {
        cardinalities.iter().map(|&n| n.max(2)).collect()
    } else {
        cardinalities.to_vec()
    };
    let ids = if vocab {
        let (v, report) = Vocabulary::build(open(path)?, &cardinalities)?;
        if report.malformed > 0 {
            eprintln!(
                "{}: the vocabulary pass skipped {} malformed lines",
                path.display(),
                report.malformed
            );
        }
        IdMap::Vocabulary(v)
    } else {
        IdMap::Hash
    };
    Ok(TsvConfig { ids, cardinalities })
}

impl Source {
    /// A TSV source over `path`.
    pub fn tsv(path: &Path, config: TsvConfig) -> Result<Source> {
        Ok(Source::Tsv {
            reader: Box::new(TsvReader::new(open(path)?, config)?),
            ahead: VecDeque::new(),
            path: path.to_path_buf(),
        })
    }

    /// Rows of every table.
    pub fn cardinalities(&self) -> Vec<u64> {
        match self {
            Source::Synthetic { gen, .. } => gen.cardinalities().to_vec(),
            Source::Tsv { reader, .. } => reader.config().cardinalities.clone(),
        }
    }

    /// The training batches of `size` samples from here on (after those taken by
    /// [`Source::held_out`], starting with those [`Source::peek`] looked at), built on worker
    /// threads at most `depth` ahead: the same batches in the same order as building each
    /// before its step. Synthetic batches are built by `workers` threads; a file is read by
    /// one.
    pub fn batches(self, size: usize, depth: usize, workers: usize) -> Result<Batches> {
        match self {
            Source::Synthetic { gen, next } => {
                let gen: Arc<Synthetic> = Arc::from(gen);
                let ahead = Ahead::indexed(next..HELD_OUT, depth, workers, move |i| {
                    Ok((gen.try_batch(i, size)?, None))
                })?;
                Ok(Batches { ahead, tsv: None })
            }
            Source::Tsv {
                mut reader,
                mut ahead,
                path,
            } => {
                let report = reader.report().clone();
                // each batch travels with what the reader had met once it was read
                let ahead = Ahead::sequential(depth, move || {
                    let b = match ahead.pop_front() {
                        Some(b) => Some(b),
                        None => reader.next_batch(size)?,
                    };
                    Ok(b.map(|b| (b, Some(reader.report().clone()))))
                })?;
                Ok(Batches {
                    ahead,
                    tsv: Some((path, report)),
                })
            }
        }
    }

    /// The next `n` training batches without consuming them (fewer at the end of a file).
    pub fn peek(&mut self, n: usize, size: usize) -> Result<Vec<Batch>> {
        match self {
            Source::Synthetic { gen, next } => {
                Ok((0..n as u64).map(|i| gen.batch(*next + i, size)).collect())
            }
            Source::Tsv { reader, ahead, .. } => {
                while ahead.len() < n {
                    match reader.next_batch(size)? {
                        Some(b) => ahead.push_back(b),
                        None => break,
                    }
                }
                Ok(ahead.iter().take(n).cloned().collect())
            }
        }
    }

    /// `n` held-out batches: synthetic ones from a disjoint index range, or the first `n`
    /// batches of `eval` (a second file), or else the first `n` batches of the training file,
    /// which training then skips.
    pub fn held_out(&mut self, n: usize, size: usize, eval: Option<&Path>) -> Result<Vec<Batch>> {
        match self {
            Source::Synthetic { gen, .. } => Ok((0..n as u64)
                .map(|i| gen.batch(HELD_OUT + i, size))
                .collect()),
            Source::Tsv { reader, .. } => {
                let mut out = Vec::new();
                let mut other = match eval {
                    Some(p) => Some(TsvReader::new(open(p)?, reader.config().clone())?),
                    None => None,
                };
                while out.len() < n {
                    let b = match other.as_mut() {
                        Some(r) => r.next_batch(size)?,
                        None => reader.next_batch(size)?,
                    };
                    match b {
                        Some(b) => out.push(b),
                        None => break,
                    }
                }
                if out.is_empty() {
                    let r = other.as_ref().map_or(reader.report(), |o| o.report());
                    let first = r
                        .malformed_lines
                        .first()
                        .map_or(String::new(), |m| format!(" (line {}: {})", m.line, m.kind));
                    return Err(Error::InvalidArgument(format!(
                        "no held-out sample: none of the {} lines read is a good sample, {} \
                         malformed{first}",
                        r.lines, r.malformed
                    )));
                }
                Ok(out)
            }
        }
    }

    /// The hidden model's click probabilities (synthetic data only).
    pub fn hidden_probs(&self, b: &Batch) -> Option<Vec<f32>> {
        match self {
            Source::Synthetic { gen, .. } => Some(
                (0..b.size)
                    .map(|s| (1.0 / (1.0 + (-gen.true_logit(b, s)).exp())) as f32)
                    .collect(),
            ),
            Source::Tsv { .. } => None,
        }
    }
}

/// The training batches, built ahead of the step ([`Source::batches`]).
pub struct Batches {
    /// Each batch, with the TSV reader's report once it was read (a file's batches).
    ahead: Ahead<(Batch, Option<TsvReport>)>,
    /// A file's path and what its reader met up to the last batch delivered.
    tsv: Option<(PathBuf, TsvReport)>,
}

impl Batches {
    /// The next training batch (`None` at the end of a file), waiting if it is not built yet.
    pub fn next(&mut self) -> Result<Option<Batch>> {
        Ok(self.ahead.recv()?.map(|(b, report)| {
            if let (Some((_, r)), Some(report)) = (self.tsv.as_mut(), report) {
                *r = report;
            }
            b
        }))
    }

    /// Batches delivered, and how many the step had to wait for.
    pub fn stats(&self) -> AheadStats {
        self.ahead.stats()
    }

    /// What the TSV reader met (lines, samples, malformed lines with their numbers) up to the
    /// last batch delivered.
    pub fn report(&self) -> Option<(&Path, &TsvReport)> {
        self.tsv.as_ref().map(|(path, r)| (path.as_path(), r))
    }
}

/// The ids of `tables` (in that order) over the batches `counted`, in one id space (table
/// `tables[k]`'s ids shifted by the rows of the tables before it in the list), and the most
/// distinct ids one batch holds: the counts a cache is reordered by, and what it must hold.
pub fn counted_ids(
    counted: &[Batch],
    tables: &[usize],
    rows: &[usize],
) -> Result<(Vec<u32>, usize)> {
    let total: u64 = tables.iter().map(|&t| rows[t] as u64).sum();
    if total > u64::from(u32::MAX) {
        return Err(Error::InvalidArgument(format!(
            "{total} rows over the tables do not fit 32-bit ids"
        )));
    }
    let (mut ids, mut largest) = (Vec::new(), 0);
    for b in counted {
        let mut mine = Vec::with_capacity(b.size * tables.len());
        let mut base = 0u64;
        for &t in tables {
            mine.extend(b.ids[t].iter().map(|&id| (base + u64::from(id)) as u32));
            base += rows[t] as u64;
        }
        ids.extend_from_slice(&mine);
        mine.sort_unstable();
        mine.dedup();
        largest = largest.max(mine.len());
    }
    Ok((ids, largest))
}
