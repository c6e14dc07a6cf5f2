//! The safetensors file format every checkpoint is written in: a streaming writer and a
//! validating reader, knowing nothing of what the tensors are. The chunk manager's checkpoints
//! (`ChunkManager::save_checkpoint`, in `chunk`) and the embedding tables'
//! (`EmbeddingCache::save`, in `embedding`) are built on it.
//!
//! The writer streams tensor bytes (a model or a table may be larger than RAM), so it writes the
//! format's header itself, into a file beside the target that replaces it only once complete:
//! a save that fails midway leaves an earlier checkpoint as it was. The reader validates a file
//! with the `safetensors` crate over a memory map.

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};

use crate::dtype::DType;
use crate::error::{Error, Result};

pub(crate) fn io(during: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { during, source }
}

/// An error about the checkpoint at `path`.
pub(crate) fn bad(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("checkpoint {}: {what}", path.display()))
}

/// The safetensors element type of a [`DType`].
pub(crate) fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F64 => Dtype::F64,
        DType::U8 => Dtype::U8,
        DType::I32 => Dtype::I32,
        DType::U32 => Dtype::U32,
        DType::I64 => Dtype::I64,
        DType::U64 => Dtype::U64,
    }
}

/// The [`DType`] of a safetensors float type.
pub(crate) fn from_st_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// One tensor of a file to write.
pub(crate) struct Entry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Counts the bytes written through it.
struct Counting<W> {
    inner: W,
    written: usize,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A complete checkpoint beside its target, not yet in its place: [`Written::persist`] renames
/// it over the target; dropped, it is removed and the target stays as it was. Lets data-parallel
/// ranks write all their files before any replaces an earlier one.
#[must_use = "a written checkpoint is removed unless persisted"]
pub(crate) struct Written {
    tmp: tempfile::NamedTempFile,
    path: PathBuf,
    dir: PathBuf,
}

impl Written {
    /// Renames the file over its target and syncs the directory, so the rename survives a crash.
    pub(crate) fn persist(self) -> Result<()> {
        self.tmp.persist(&self.path).map_err(|e| Error::Io {
            during: "replacing a checkpoint",
            source: e.error,
        })?;
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io("syncing a checkpoint's directory"))
    }
}

/// Writes a safetensors file holding `entries`, in that order, and `metadata` beside `path`:
/// `data` writes every tensor's little-endian bytes in the same order, exactly as many as
/// declared. [`Written::persist`] puts it in place.
pub(crate) fn write_unpersisted(
    path: &Path,
    metadata: &BTreeMap<String, String>,
    entries: &[Entry],
    data: impl FnOnce(&mut dyn Write) -> Result<()>,
) -> Result<Written> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut at = 0usize;
    for e in entries {
        let end = at + e.bytes();
        let dtype = serde_json::to_value(e.dtype).map_err(|err| bad(path, err))?;
        let prev = header.insert(
            e.name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": e.shape, "data_offsets": [at, end] }),
        );
        if prev.is_some() || e.name == "__metadata__" {
            return Err(bad(path, format!("two tensors are named '{}'", e.name)));
        }
        at = end;
    }
    let mut header = serde_json::to_vec(&header).map_err(|e| bad(path, e))?;
    // Pad the header with spaces so the data starts 8-byte aligned.
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    // A file of its own beside the target (two saves to one path never share one), renamed
    // over the target once complete and synced; removed on any error before that.
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut prefix = path.file_name().unwrap_or_default().to_os_string();
    prefix.push(".");
    let tmp = tempfile::Builder::new()
        .prefix(&prefix)
        .suffix(".partial")
        .tempfile_in(&dir)
        .map_err(io("creating a checkpoint"))?;
    {
        let mut out = Counting {
            inner: BufWriter::with_capacity(1 << 20, tmp.as_file()),
            written: 0,
        };
        out.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(io("writing a checkpoint"))?;
        out.write_all(&header).map_err(io("writing a checkpoint"))?;
        let start = out.written;
        data(&mut out)?;
        if out.written - start != at {
            return Err(bad(
                path,
                format!(
                    "{} bytes of tensors written, {at} declared",
                    out.written - start
                ),
            ));
        }
        out.flush().map_err(io("writing a checkpoint"))?;
    }
    tmp.as_file()
        .sync_all()
        .map_err(io("writing a checkpoint"))?;
    Ok(Written {
        tmp,
        path: path.to_path_buf(),
        dir,
    })
}

/// A checkpoint file mapped for reading.
pub(crate) struct Reader {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl Reader {
    pub(crate) fn open(path: &Path) -> Result<Reader> {
        let file = std::fs::File::open(path).map_err(io("opening a checkpoint"))?;
        // SAFETY: the map is read-only; like every reader of a file, this assumes no other
        // process truncates the checkpoint while it is being read.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io("mapping a checkpoint"))?;
        Ok(Reader {
            path: path.to_path_buf(),
            map,
        })
    }

    /// The tensors, after the format's checks (header, offsets, sizes).
    pub(crate) fn tensors(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.map).map_err(|e| self.bad(e))
    }

    /// The file's metadata (empty when it has none).
    pub(crate) fn metadata(&self) -> Result<BTreeMap<String, String>> {
        let (_, meta): (usize, Metadata) =
            SafeTensors::read_metadata(&self.map).map_err(|e| self.bad(e))?;
        Ok(meta
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default())
    }

    pub(crate) fn bad(&self, what: impl std::fmt::Display) -> Error {
        bad(&self.path, what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(
        path: &Path,
        metadata: &BTreeMap<String, String>,
        entries: &[Entry],
        data: impl FnOnce(&mut dyn Write) -> Result<()>,
    ) -> Result<()> {
        write_unpersisted(path, metadata, entries, data)?.persist()
    }

    #[test]
    fn writes_what_safetensors_reads_and_never_half_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.safetensors");
        let meta = BTreeMap::from([("k".to_string(), "v".to_string())]);
        let entries = [
            Entry {
                name: "a".into(),
                dtype: Dtype::F32,
                shape: vec![2],
            },
            Entry {
                name: "b".into(),
                dtype: Dtype::F16,
                shape: vec![1, 3],
            },
        ];
        write(&p, &meta, &entries, |out| {
            out.write_all(bytemuck::cast_slice(&[1.0f32, 2.0])).unwrap();
            out.write_all(&[1, 2, 3, 4, 5, 6]).unwrap();
            Ok(())
        })
        .unwrap();
        // not in place until persisted
        let other = dir.path().join("other.safetensors");
        let w = write_unpersisted(&other, &meta, &entries[..1], |out| {
            out.write_all(&[0; 8]).unwrap();
            Ok(())
        })
        .unwrap();
        assert!(!other.exists());
        drop(w);
        assert!(!other.exists(), "dropped, not persisted");
        let r = Reader::open(&p).unwrap();
        assert_eq!(r.metadata().unwrap(), meta);
        let st = r.tensors().unwrap();
        assert_eq!(
            st.tensor("a").unwrap().data(),
            bytemuck::cast_slice::<f32, u8>(&[1.0, 2.0])
        );
        assert_eq!(st.tensor("b").unwrap().shape(), [1, 3]);
        let before = std::fs::read(&p).unwrap();
        // too few bytes, a failing writer, a repeated name: the earlier file stays
        let short = write(&p, &meta, &entries, |out| {
            out.write_all(&[0; 9]).unwrap();
            Ok(())
        });
        assert!(matches!(short, Err(Error::InvalidArgument(_))), "{short:?}");
        let failing = write(&p, &meta, &entries, |_| {
            Err(Error::InvalidArgument("x".into()))
        });
        assert!(failing.is_err());
        let twice = [
            Entry {
                name: "a".into(),
                dtype: Dtype::F32,
                shape: vec![1],
            },
            Entry {
                name: "a".into(),
                dtype: Dtype::F32,
                shape: vec![1],
            },
        ];
        assert!(write(&p, &meta, &twice, |_| Ok(())).is_err());
        assert_eq!(std::fs::read(&p).unwrap(), before);
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            left,
            vec![std::ffi::OsString::from("c.safetensors")],
            "no partial file"
        );
        std::fs::write(&p, b"not a checkpoint").unwrap();
        assert!(Reader::open(&p).unwrap().tensors().is_err());
    }
}
