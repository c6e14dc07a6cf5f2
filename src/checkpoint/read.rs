//! The validating reader: the header read and checked whole at open, tensor data read in
//! bounded pieces, one tensor at a time, never mapped (a file truncated while it is read
//! fails a read with an error instead of killing the process with SIGBUS, and a checkpoint
//! larger than host memory is never copied whole).

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use safetensors::tensor::SafeTensorError;
use safetensors::Dtype;
use serde::Deserialize;

use super::{
    bad, describe, header_crc, header_crc_at, io_at, kind_of, legacy_allowed, Float, CRC_KEY,
    HEADER_CRC_KEY,
};
use crate::error::{Error, Result};

/// The largest header the format allows (as the `safetensors` crate does).
const MAX_HEADER: u64 = 100_000_000;

/// The bytes a verification pass reads at a time (a multiple of every element size).
const PIECE: usize = 8 << 20;

/// A tensor as the header describes it.
#[derive(Clone, Debug)]
pub(crate) struct Info {
    dtype: Dtype,
    shape: Vec<usize>,
    /// Its data's offsets from the start of the data.
    start: u64,
    end: u64,
}

impl Info {
    pub(crate) fn dtype(&self) -> Dtype {
        self.dtype
    }

    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Its data's size in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.end - self.start
    }
}

/// A tensor entry of the header's JSON.
#[derive(Deserialize)]
struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (u64, u64),
}

/// A checkpoint file open for reading.
pub(crate) struct Reader {
    path: PathBuf,
    file: File,
    /// Where the tensor data starts: after the length and the header.
    data_start: u64,
    /// The tensors by name.
    tensors: BTreeMap<String, Info>,
    /// The header's metadata, the checksums included.
    raw_meta: BTreeMap<String, String>,
    /// Whether the file must carry checksums (a file of this crate's), unless
    /// [`LEGACY_ENV`](super::LEGACY_ENV) asks otherwise.
    strict: bool,
    /// Set once every checksum and value passed.
    verified: OnceLock<()>,
}

impl Reader {
    /// Opens `path`, a checkpoint of this crate: a regular file (a directory is refused as
    /// such) whose header matches its checksum, which it must have (unless
    /// [`LEGACY_ENV`](super::LEGACY_ENV)`=1`).
    pub(crate) fn open(path: &Path) -> Result<Reader> {
        Self::open_with(path, true)
    }

    /// Opens `path`, a file that may come from elsewhere (a Hugging Face model): checksums,
    /// when it has them, are verified; none are required.
    pub(crate) fn open_foreign(path: &Path) -> Result<Reader> {
        Self::open_with(path, false)
    }

    fn open_with(path: &Path, strict: bool) -> Result<Reader> {
        let meta = std::fs::metadata(path).map_err(io_at("opening", path))?;
        if !meta.is_file() {
            return Err(Error::NotAFile {
                path: path.to_path_buf(),
                kind: kind_of(meta.file_type()),
            });
        }
        let file = File::open(path).map_err(io_at("opening", path))?;
        let len = file.metadata().map_err(io_at("opening", path))?.len();
        let format = |e: SafeTensorError, header: Option<&[u8]>, n: u64| {
            bad(path, describe(e, len, n, header))
        };
        if len < 8 {
            return Err(format(SafeTensorError::HeaderTooSmall, None, 0));
        }
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)
            .map_err(io_at("reading", path))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER {
            return Err(format(SafeTensorError::HeaderTooLarge, None, n));
        }
        if n > len - 8 {
            return Err(format(SafeTensorError::InvalidHeaderLength, None, n));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(io_at("reading", path))?;
        let (tensors, raw_meta) = parse(&header).map_err(|e| format(e, Some(&header), n))?;
        let r = Reader {
            path: path.to_path_buf(),
            file,
            data_start: 8 + n,
            tensors,
            raw_meta,
            strict,
            verified: OnceLock::new(),
        };
        let end = r.tensors.values().map(|t| t.end).max().unwrap_or(0);
        if end != len - 8 - n {
            return Err(format(
                SafeTensorError::MetadataIncompleteBuffer,
                Some(&header),
                n,
            ));
        }
        r.verify_header(&header)?;
        Ok(r)
    }

    /// Checks the header against its checksum, if it has one; a strict reader's file must.
    fn verify_header(&self, header: &[u8]) -> Result<()> {
        let Some(at) = header_crc_at(header) else {
            // a file that does not say it is this crate's is refused by its caller's format
            // check, or by its missing tensor checksums
            let ours = self
                .raw_meta
                .get("format")
                .is_some_and(|f| f.starts_with("tidemem-"));
            if self.strict && ours && !legacy_allowed() {
                return Err(Error::Unverified {
                    path: self.path.clone(),
                    what: "no header checksum",
                });
            }
            return Ok(());
        };
        let want = std::str::from_utf8(&header[at..at + 8])
            .ok()
            .and_then(|h| u32::from_str_radix(h, 16).ok());
        if want != Some(header_crc(header, at)) {
            return Err(Error::HeaderChecksumMismatch {
                path: self.path.clone(),
            });
        }
        Ok(())
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The tensors' names, sorted.
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Tensor `name`, as the header describes it.
    pub(crate) fn info(&self, name: &str) -> Option<&Info> {
        self.tensors.get(name)
    }

    /// Tensor `name` or an error saying the file lacks it.
    fn entry(&self, name: &str) -> Result<&Info> {
        self.info(name)
            .ok_or_else(|| self.bad(format!("it has no tensor '{name}'")))
    }

    /// Tensor `name`'s bytes, after the whole file's data was verified (once per open file).
    pub(crate) fn read(&self, name: &str) -> Result<Vec<u8>> {
        let t = self.entry(name)?;
        let n = usize::try_from(t.bytes()).unwrap_or(usize::MAX);
        let mut buf = Vec::new();
        buf.try_reserve_exact(n).map_err(|_| Error::TooLarge {
            what: format!(
                "tensor '{name}' of {}, read into host memory",
                self.path.display()
            ),
            requested: u128::from(t.bytes()),
            limit: crate::limits::host_limit(),
        })?;
        buf.resize(n, 0);
        self.read_into(name, &mut buf)?;
        Ok(buf)
    }

    /// Reads tensor `name`'s bytes into `dst`, of its size, after the whole file's data was
    /// verified (once per open file).
    pub(crate) fn read_into(&self, name: &str, dst: &mut [u8]) -> Result<()> {
        self.verify()?;
        let t = self.entry(name)?;
        if dst.len() as u64 != t.bytes() {
            return Err(Error::Internal {
                what: format!(
                    "a read of {} bytes of tensor '{name}', which has {}",
                    dst.len(),
                    t.bytes()
                ),
            });
        }
        self.read_at(name, t.start, dst)
    }

    /// Reads `dst.len()` bytes of tensor `name` from data offset `at`.
    fn read_at(&self, name: &str, at: u64, dst: &mut [u8]) -> Result<()> {
        self.file
            .read_exact_at(dst, self.data_start + at)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => self.bad(format!(
                    "it was truncated while being read: tensor '{name}' ends past its end"
                )),
                _ => io_at("reading", &self.path)(e),
            })
    }

    /// The header's metadata: keys and values, the checksums included.
    fn raw_metadata(&self) -> &BTreeMap<String, String> {
        &self.raw_meta
    }

    /// The file's metadata (empty when it has none), without the checksums.
    pub(crate) fn metadata(&self) -> Result<BTreeMap<String, String>> {
        let mut meta = self.raw_metadata().clone();
        meta.retain(|k, _| !k.starts_with(CRC_KEY));
        Ok(meta)
    }

    /// [`Reader::verify_with`] no tensor that must not be negative.
    pub(crate) fn verify(&self) -> Result<()> {
        self.verify_with(|_| false)
    }

    /// Checks every tensor's data against its checksum and, in a file of this crate's, its
    /// values (finite; not negative in the tensors `non_negative` names), once per open file
    /// (the first call's rule holds), reading one piece of one tensor at a time. A file without
    /// checksums passes only where none are required (a foreign file: its values are the
    /// caller's to check) or the user asked for an unverified load (values unchecked too).
    pub(crate) fn verify_with(&self, non_negative: fn(&str) -> bool) -> Result<()> {
        if self.verified.get().is_some() {
            return Ok(());
        }
        let mut sums = BTreeMap::new();
        for (k, v) in self.raw_metadata() {
            if k == HEADER_CRC_KEY {
                continue;
            }
            if let Some(name) = k.strip_prefix(CRC_KEY) {
                let crc = u32::from_str_radix(v, 16).map_err(|_| {
                    self.bad(format!(
                        "the checksum of tensor '{name}' is '{v}', not 8 hex digits"
                    ))
                })?;
                sums.insert(name.to_string(), crc);
            }
        }
        if sums.is_empty() && !self.tensors.is_empty() {
            if self.strict && !legacy_allowed() {
                return Err(Error::Unverified {
                    path: self.path.clone(),
                    what: "no tensor checksums",
                });
            }
            let _ = self.verified.set(());
            return Ok(());
        }
        if let Some(name) = sums.keys().find(|n| !self.tensors.contains_key(*n)) {
            return Err(self.bad(format!(
                "it has a checksum for tensor '{name}', which it does not hold"
            )));
        }
        let mut piece = Vec::new();
        for (name, t) in &self.tensors {
            let Some(&want) = sums.get(name) else {
                return Err(self.bad(format!("it has checksums, but none for tensor '{name}'")));
            };
            let float = Float::of(t.dtype).filter(|_| self.strict);
            let non_negative = self.strict && non_negative(name);
            let mut hasher = crc32fast::Hasher::new();
            let mut at = 0u64;
            while at < t.bytes() {
                let n = (t.bytes() - at).min(PIECE as u64) as usize;
                piece.resize(n, 0);
                self.read_at(name, t.start + at, &mut piece)?;
                hasher.update(&piece);
                let first = (at / float.map_or(1, |f| f.size() as u64)) as usize;
                if let Some(i) = float.and_then(|f| f.first_non_finite(&piece)) {
                    return Err(Error::NonFinite {
                        path: self.path.clone(),
                        tensor: name.clone(),
                        index: (first + i) as u64,
                        saving: false,
                    });
                }
                if non_negative {
                    if let Some(i) = first_negative(t.dtype, &piece) {
                        return Err(self.bad(format!(
                            "'{name}' element {} is negative: a second moment is a mean of \
                             squares",
                            first + i
                        )));
                    }
                }
                at += n as u64;
            }
            if hasher.finalize() != want {
                return Err(Error::ChecksumMismatch {
                    path: self.path.clone(),
                    tensor: name.clone(),
                });
            }
        }
        let _ = self.verified.set(());
        Ok(())
    }

    /// An error about this file.
    pub(crate) fn bad(&self, what: impl std::fmt::Display) -> Error {
        bad(&self.path, what)
    }
}

/// The first negative element of `bytes`, little-endian f32 (other types are not checked).
fn first_negative(dtype: Dtype, bytes: &[u8]) -> Option<usize> {
    if dtype != Dtype::F32 {
        return None;
    }
    bytes
        .chunks_exact(4)
        .position(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) < 0.0)
}

/// The tensors and the metadata of a header, checked as the format requires: JSON text, a
/// table of tensors whose data offsets follow each other from 0 and fit their shapes and
/// types.
type Parsed = (BTreeMap<String, Info>, BTreeMap<String, String>);

fn parse(header: &[u8]) -> std::result::Result<Parsed, SafeTensorError> {
    let text = std::str::from_utf8(header).map_err(|_| SafeTensorError::InvalidHeader)?;
    let table: BTreeMap<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|_| SafeTensorError::InvalidHeaderDeserialization)?;
    let mut meta = BTreeMap::new();
    let mut entries = Vec::new();
    for (name, v) in table {
        if name == "__metadata__" {
            meta = serde_json::from_value(v)
                .map_err(|_| SafeTensorError::InvalidHeaderDeserialization)?;
            continue;
        }
        let e: Entry =
            serde_json::from_value(v).map_err(|_| SafeTensorError::InvalidHeaderDeserialization)?;
        entries.push((name, e));
    }
    entries.sort_by_key(|(_, e)| e.data_offsets);
    let mut tensors = BTreeMap::new();
    let mut at = 0u64;
    for (name, e) in entries {
        let (start, end) = e.data_offsets;
        if start != at || end < start {
            return Err(SafeTensorError::InvalidOffset(name));
        }
        let bytes = e
            .shape
            .iter()
            .try_fold(e.dtype.size() as u64, |n, &d| n.checked_mul(d as u64))
            .ok_or(SafeTensorError::ValidationOverflow)?;
        if end - start != bytes {
            return Err(SafeTensorError::TensorInvalidInfo);
        }
        at = end;
        tensors.insert(
            name,
            Info {
                dtype: e.dtype,
                shape: e.shape,
                start,
                end,
            },
        );
    }
    Ok((tensors, meta))
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::checkpoint::{io, write_unpersisted, Entry};

    /// A checkpoint of `a` (f32 [4]: `values`) and `variance/b` (f32 [2]: `variance`).
    fn written(path: &Path, values: [f32; 4], variance: [f32; 2]) {
        let entries = [
            Entry {
                name: "a".into(),
                dtype: Dtype::F32,
                shape: vec![4],
            },
            Entry {
                name: "variance/b".into(),
                dtype: Dtype::F32,
                shape: vec![2],
            },
        ];
        let meta = BTreeMap::from([
            ("adam.steps".to_string(), "2".to_string()),
            ("format".to_string(), "tidemem-test".to_string()),
        ]);
        write_unpersisted(path, &meta, &entries, |out| {
            out.write_all(bytemuck::cast_slice(&values))
                .and_then(|()| out.write_all(bytemuck::cast_slice(&variance)))
                .map_err(io("test"))
        })
        .unwrap()
        .persist()
        .unwrap();
    }

    /// Replaces the first `from` in the file's header by `to`, of the same length.
    fn edit_header(path: &Path, from: &str, to: &str) {
        let mut bytes = std::fs::read(path).unwrap();
        let at = bytes
            .windows(from.len())
            .position(|w| w == from.as_bytes())
            .unwrap();
        bytes[at..at + to.len()].copy_from_slice(to.as_bytes());
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn every_byte_of_the_header_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.safetensors");
        written(&p, [1.0; 4], [0.5; 2]);
        let r = Reader::open(&p).unwrap();
        assert_eq!(
            r.read("a").unwrap(),
            bytemuck::cast_slice::<f32, u8>(&[1.0; 4])
        );
        // a step count, a type, a name: each refused by the header's checksum
        for (from, to) in [
            ("\"adam.steps\":\"2\"", "\"adam.steps\":\"3\""),
            ("\"F32\"", "\"I32\""),
            ("\"a\":{", "\"c\":{"),
        ] {
            written(&p, [1.0; 4], [0.5; 2]);
            edit_header(&p, from, to);
            assert!(
                matches!(Reader::open(&p), Err(Error::HeaderChecksumMismatch { .. })),
                "{from} → {to}"
            );
        }
        // checksums renamed away: no header checksum, refused as unverifiable
        written(&p, [1.0; 4], [0.5; 2]);
        edit_header(&p, "crc32/__header__", "xrc32/__header__");
        assert!(matches!(
            Reader::open(&p),
            Err(Error::Unverified {
                what: "no header checksum",
                ..
            })
        ));
        // a foreign file needs none (its tensors' checksums still hold)
        Reader::open_foreign(&p).unwrap().verify().unwrap();
    }

    #[test]
    fn values_a_run_cannot_reach_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.safetensors");
        written(&p, [1.0; 4], [0.5, -0.25]);
        let r = Reader::open(&p).unwrap();
        let e = r.verify_with(|n| n.starts_with("variance/")).unwrap_err();
        assert!(
            e.to_string().contains("'variance/b' element 1 is negative"),
            "{e}"
        );
        // a NaN cannot be saved: written behind the writer's back, with a matching checksum
        written(&p, [1.0; 4], [0.5; 2]);
        let mut bytes = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let data = 8 + n;
        bytes[data + 8..data + 12].copy_from_slice(&f32::NAN.to_le_bytes());
        let crc = format!("{:08x}", crc32fast::hash(&bytes[data..data + 16]));
        let header = std::str::from_utf8(&bytes[8..data]).unwrap().to_string();
        let old = &header[header.find("\"crc32/a\":\"").unwrap() + 11..][..8];
        let mut header = header.replace(old, &crc).into_bytes();
        let at = header_crc_at(&header).unwrap();
        let sum = format!("{:08x}", header_crc(&header, at));
        header[at..at + 8].copy_from_slice(sum.as_bytes());
        bytes[8..data].copy_from_slice(&header);
        std::fs::write(&p, &bytes).unwrap();
        let e = Reader::open(&p).unwrap().verify().unwrap_err();
        assert!(
            matches!(&e, Error::NonFinite { tensor, index: 2, saving: false, .. } if tensor == "a"),
            "{e}"
        );
    }

    #[test]
    fn a_file_truncated_while_read_is_an_error_not_a_signal() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.safetensors");
        written(&p, [1.0; 4], [0.5; 2]);
        let r = Reader::open(&p).unwrap();
        let len = std::fs::metadata(&p).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(len - 4)
            .unwrap();
        let e = r.read("variance/b").unwrap_err();
        assert!(e.to_string().contains("truncated while being read"), "{e}");
    }
}
