//! The streaming writer: a file written beside its target, checked as it streams by
//! (checksums, finite values), and put in place by a rename once complete and synced.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{
    bad, header_crc, header_crc_at, io_at, kind_of, Entry, Float, CRC_KEY, HEADER_CRC_KEY,
};
use crate::error::{Error, Result};

/// Follows the tensor data as it streams by: every entry's CRC-32, and the first non-finite
/// value of a float entry.
struct Scan {
    /// Each entry's end (a byte offset into the data) and its float type, if checked.
    ends: Vec<(usize, Option<Float>)>,
    /// The entry the next byte belongs to.
    at: usize,
    /// Bytes seen.
    pos: usize,
    /// Where entry `at` starts.
    start: usize,
    /// The bytes of an element split across two writes.
    carry: [u8; 8],
    carry_len: usize,
    hasher: crc32fast::Hasher,
    /// The checksums of the entries done.
    crcs: Vec<u32>,
    /// The first non-finite value: entry and element.
    non_finite: Option<(usize, u64)>,
}

impl Scan {
    fn new(ends: Vec<(usize, Option<Float>)>) -> Scan {
        let mut s = Scan {
            ends,
            at: 0,
            pos: 0,
            start: 0,
            carry: [0; 8],
            carry_len: 0,
            hasher: crc32fast::Hasher::new(),
            crcs: Vec::new(),
            non_finite: None,
        };
        s.close_finished();
        s
    }

    /// Takes in the next bytes; false once a non-finite value was seen.
    fn feed(&mut self, mut buf: &[u8]) -> bool {
        if self.non_finite.is_some() {
            return false;
        }
        while !buf.is_empty() && self.at < self.ends.len() {
            let (end, float) = self.ends[self.at];
            let (part, rest) = buf.split_at((end - self.pos).min(buf.len()));
            self.hasher.update(part);
            if let Some(f) = float {
                if !self.check(f, part) {
                    return false;
                }
            }
            self.pos += part.len();
            buf = rest;
            self.close_finished();
        }
        // bytes past the last entry: counted by the writer, which refuses them
        self.pos += buf.len();
        true
    }

    /// Checks the elements of `part`, the next bytes of entry `at`.
    fn check(&mut self, f: Float, mut part: &[u8]) -> bool {
        let es = f.size();
        // the element the first byte of `part` belongs to (a split one counts from its start)
        let mut elem = (self.pos - self.start) / es;
        if self.carry_len > 0 {
            let need = (es - self.carry_len).min(part.len());
            self.carry[self.carry_len..self.carry_len + need].copy_from_slice(&part[..need]);
            self.carry_len += need;
            part = &part[need..];
            if self.carry_len < es {
                return true;
            }
            self.carry_len = 0;
            if f.first_non_finite(&self.carry[..es]).is_some() {
                self.non_finite = Some((self.at, elem as u64));
                return false;
            }
            elem += 1;
        }
        let whole = part.len() / es * es;
        if let Some(i) = f.first_non_finite(&part[..whole]) {
            self.non_finite = Some((self.at, (elem + i) as u64));
            return false;
        }
        let rest = &part[whole..];
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carry_len = rest.len();
        true
    }

    /// Closes the entries that end where the data seen ends (empty ones included).
    fn close_finished(&mut self) {
        while self.at < self.ends.len() && self.pos == self.ends[self.at].0 {
            let h = std::mem::replace(&mut self.hasher, crc32fast::Hasher::new());
            self.crcs.push(h.finalize());
            self.start = self.pos;
            self.carry_len = 0;
            self.at += 1;
        }
    }
}

/// Where the tensor data goes: through the [`Scan`] into the file.
struct Sink<'a> {
    out: BufWriter<&'a File>,
    scan: Scan,
    written: usize,
    /// The tensors' bytes the file declares.
    total: usize,
    /// The file's own error, kept to report with the caller's path.
    failed: Option<std::io::Error>,
}

impl Write for Sink<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.scan.feed(buf) {
            // the writer reports the typed error; this only stops the caller
            return Err(std::io::Error::other("a non-finite value"));
        }
        if let Err(e) = self.out.write_all(buf) {
            let kind = e.kind();
            self.failed.get_or_insert(e);
            return Err(kind.into());
        }
        let before = self.written;
        self.written += buf.len();
        if before * 2 < self.total && self.written * 2 >= self.total {
            // half the tensors on disk, the rest not: what a crash in the middle leaves
            let half = "checkpoint.write.half";
            if super::failpoint_armed(half) {
                let _ = self.out.flush();
                super::failpoint(half);
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// The file a save to `path` replaces: `path` itself, or the final target of the symbolic
/// links it names (which need not exist yet). An existing target that is not a regular file is
/// refused.
pub(crate) fn save_target(path: &Path) -> Result<PathBuf> {
    let mut p = path.to_path_buf();
    // as many links as the kernel follows
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(p),
            Err(e) => return Err(io_at("looking up", path)(e)),
            Ok(m) if m.file_type().is_symlink() => {
                let link = std::fs::read_link(&p).map_err(io_at("reading the link", path))?;
                p = match p.parent() {
                    Some(dir) => dir.join(link),
                    None => link,
                };
            }
            Ok(m) if m.is_file() => return Ok(p),
            Ok(m) => {
                return Err(Error::NotAFile {
                    path: path.to_path_buf(),
                    kind: kind_of(m.file_type()),
                })
            }
        }
    }
    Err(bad(path, "too many levels of symbolic links"))
}

/// The directory of `file` (`.` for a bare name).
fn dir_of(file: &Path) -> PathBuf {
    match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// `file` with `suffix` appended to its name.
pub(crate) fn sibling(file: &Path, suffix: &str) -> PathBuf {
    let mut name = file.as_os_str().to_os_string();
    name.push(suffix);
    PathBuf::from(name)
}

/// Syncs the directory of `file`, so that a rename in it survives a crash.
pub(crate) fn sync_dir_of(file: &Path, path: &Path) -> Result<()> {
    File::open(dir_of(file))
        .and_then(|d| d.sync_all())
        .map_err(io_at("syncing the directory of", path))
}

/// A temporary file beside a target, removed when dropped unless it was renamed.
struct Partial {
    file: File,
    path: PathBuf,
    renamed: bool,
}

impl Partial {
    /// `<target>.<pid>.<n>.partial`, new (mode 0666 less the umask, as any file).
    fn create(target: &Path) -> std::io::Result<Partial> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let pid = std::process::id();
        loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = sibling(target, &format!(".{pid}.{n}.partial"));
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(file) => {
                    return Ok(Partial {
                        file,
                        path,
                        renamed: false,
                    })
                }
                // a file of an earlier process that had this pid, not removed yet
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < (1 << 20) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.renamed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Removes the temporary files of earlier saves to `target` whose writing process is dead.
/// Without `/proc` nothing tells a dead writer from a live one, and nothing is removed.
fn remove_stale_partials(target: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Some(name) = target.file_name().and_then(|n| n.to_str()) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir_of(target)) else {
        return;
    };
    let prefix = format!("{name}.");
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(mid) = file
            .to_str()
            .and_then(|f| f.strip_prefix(&prefix))
            .and_then(|f| f.strip_suffix(".partial"))
        else {
            continue;
        };
        let Some((pid, n)) = mid.split_once('.') else {
            continue;
        };
        let (Ok(pid), Ok(_)) = (pid.parse::<u32>(), n.parse::<u64>()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// A complete checkpoint beside its target, not yet in its place: [`Written::persist`] renames
/// it over the target; dropped, it is removed and the target stays as it was. Lets data-parallel
/// ranks write all their files before any replaces an earlier one.
#[must_use = "a written checkpoint is removed unless persisted"]
pub(crate) struct Written {
    tmp: Partial,
    /// The path the caller named.
    path: PathBuf,
    /// The file it replaces (the final target of a symbolic link).
    target: PathBuf,
}

impl Written {
    /// The file [`Written::persist`] replaces: the path the caller named, or the final target
    /// of the links it names.
    pub(crate) fn target(&self) -> &Path {
        &self.target
    }

    /// Renames the file over its target and syncs the directory, so the rename survives a crash.
    pub(crate) fn persist(mut self) -> Result<()> {
        std::fs::rename(&self.tmp.path, &self.target).map_err(io_at("replacing", &self.path))?;
        self.tmp.renamed = true;
        sync_dir_of(&self.target, &self.path)
    }
}

/// The file a save to `path` replaces and a new temporary file beside it, the temporary files
/// of earlier writers that died removed first.
fn beside(path: &Path) -> Result<(PathBuf, Partial)> {
    let target = save_target(path)?;
    if target.file_name().is_none() {
        return Err(bad(path, "the path names no file"));
    }
    remove_stale_partials(&target);
    let tmp = Partial::create(&target).map_err(io_at("creating a file beside", path))?;
    Ok((target, tmp))
}

/// Makes a write past the process's file-size limit (`ulimit -f`) fail with `EFBIG`, an
/// error the writer reports and cleans up after, instead of killing the process with
/// `SIGXFSZ` and leaving its temporary file behind. Once per process; a program that handles
/// `SIGXFSZ` itself keeps its handler.
fn file_size_limit_is_an_error() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: `sigaction` with a null new action only reads the current disposition into
        // `old`, a zeroed `sigaction` this call owns; `signal` then sets SIG_IGN only where the
        // disposition is the default (terminate), so no handler of the program is replaced.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGXFSZ, std::ptr::null(), &mut old) == 0
                && old.sa_sigaction == libc::SIG_DFL
            {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            }
        }
    });
}

/// Writes `bytes` to `path` as a save does: into a file beside the final target, synced, then
/// renamed over it, so that a full disk or a kill leaves the earlier file (or none) and never
/// a truncated one; errors name `path` ([`Error::FileIo`]) and what was being written.
pub(crate) fn write_file(path: &Path, bytes: &[u8], during: &'static str) -> Result<()> {
    file_size_limit_is_an_error();
    let (target, mut tmp) = beside(path)?;
    (&tmp.file)
        .write_all(bytes)
        .and_then(|()| tmp.file.sync_all())
        .map_err(io_at(during, path))?;
    std::fs::rename(&tmp.path, &target).map_err(io_at(during, path))?;
    tmp.renamed = true;
    sync_dir_of(&target, path)
}

/// The header of a file of `entries` (their data offsets in order) with `metadata` and the
/// entries' checksums, padded with spaces so that the data starts 8-byte aligned.
fn header(
    path: &Path,
    metadata: &BTreeMap<String, String>,
    entries: &[Entry],
    offsets: &[(usize, usize)],
    crcs: &[u32],
) -> Result<Vec<u8>> {
    let mut meta = metadata.clone();
    for (e, crc) in entries.iter().zip(crcs) {
        meta.insert(format!("{CRC_KEY}{}", e.name), format!("{crc:08x}"));
    }
    // zeros now, the checksum of the whole header (these zeros included) once it is text
    meta.insert(HEADER_CRC_KEY.into(), "00000000".into());
    let mut header = serde_json::Map::new();
    if !meta.is_empty() {
        header.insert("__metadata__".into(), serde_json::json!(meta));
    }
    for (e, &(start, end)) in entries.iter().zip(offsets) {
        let dtype = serde_json::to_value(e.dtype).map_err(|err| bad(path, err))?;
        header.insert(
            e.name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": e.shape, "data_offsets": [start, end] }),
        );
    }
    let mut header = serde_json::to_vec(&header).map_err(|e| bad(path, e))?;
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let at = header_crc_at(&header)
        .ok_or_else(|| bad(path, "the header's checksum key is not in its text once"))?;
    let crc = format!("{:08x}", header_crc(&header, at));
    header[at..at + 8].copy_from_slice(crc.as_bytes());
    Ok(header)
}

/// Writes a safetensors file holding `entries`, in that order, and `metadata` beside `path`:
/// `data` writes every tensor's little-endian bytes in the same order, exactly as many as
/// declared. [`Written::persist`] puts it in place. See the [module docs](self) for what is
/// checked on the way.
pub(crate) fn write_unpersisted(
    path: &Path,
    metadata: &BTreeMap<String, String>,
    entries: &[Entry],
    data: impl FnOnce(&mut dyn Write) -> Result<()>,
) -> Result<Written> {
    if let Some(k) = metadata.keys().find(|k| k.starts_with(CRC_KEY)) {
        return Err(bad(
            path,
            format!("metadata key '{k}' is reserved for the tensors' checksums"),
        ));
    }
    let mut offsets = Vec::with_capacity(entries.len());
    let mut names = std::collections::HashSet::new();
    let mut at = 0usize;
    for e in entries {
        if e.name == "__header__" {
            return Err(bad(path, "a tensor may not be named '__header__'"));
        }
        if !names.insert(e.name.as_str()) || e.name == "__metadata__" {
            return Err(bad(path, format!("two tensors are named '{}'", e.name)));
        }
        let end = e
            .bytes()
            .and_then(|n| at.checked_add(n))
            .ok_or_else(|| bad(path, format!("tensor '{}' is too large", e.name)))?;
        offsets.push((at, end));
        at = end;
    }
    let placeholder = header(path, metadata, entries, &offsets, &vec![0; entries.len()])?;
    file_size_limit_is_an_error();
    let (target, tmp) = beside(path)?;
    let ends = entries
        .iter()
        .zip(&offsets)
        .map(|(e, o)| (o.1, Float::of(e.dtype)))
        .collect();
    let crcs = {
        let mut out = BufWriter::with_capacity(1 << 20, &tmp.file);
        out.write_all(&(placeholder.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&placeholder))
            .map_err(io_at("writing", path))?;
        let mut sink = Sink {
            out,
            scan: Scan::new(ends),
            written: 0,
            total: at,
            failed: None,
        };
        let streamed = data(&mut sink);
        if let Some((i, index)) = sink.scan.non_finite {
            return Err(Error::NonFinite {
                path: path.to_path_buf(),
                tensor: entries[i].name.clone(),
                index,
                saving: true,
            });
        }
        if let Some(e) = sink.failed.take() {
            return Err(io_at("writing", path)(e));
        }
        streamed?;
        if sink.written != at {
            return Err(bad(
                path,
                format!("{} bytes of tensors written, {at} declared", sink.written),
            ));
        }
        sink.out.flush().map_err(io_at("writing", path))?;
        sink.scan.crcs
    };
    // the checksums in place of the zeros: the same length, since each is 8 hex digits
    let done = header(path, metadata, entries, &offsets, &crcs)?;
    if done.len() != placeholder.len() {
        return Err(bad(path, "the header changed length with its checksums"));
    }
    (&tmp.file)
        .seek(SeekFrom::Start(8))
        .and_then(|_| (&tmp.file).write_all(&done))
        .and_then(|()| tmp.file.sync_all())
        .map_err(io_at("writing", path))?;
    Ok(Written {
        tmp,
        path: path.to_path_buf(),
        target,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{io, Reader};
    use safetensors::Dtype;

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
        assert_eq!(
            r.read("a").unwrap(),
            bytemuck::cast_slice::<f32, u8>(&[1.0, 2.0])
        );
        assert_eq!(r.info("b").unwrap().shape(), [1, 3]);
        let before = std::fs::read(&p).unwrap();
        // too few bytes, a failing writer, a repeated name: the earlier file stays
        let short = write(&p, &meta, &entries, |out| {
            out.write_all(&[0; 9]).unwrap();
            Ok(())
        });
        assert!(matches!(short, Err(Error::Checkpoint { .. })), "{short:?}");
        let failing = write(&p, &meta, &entries, |_| {
            Err(Error::Io {
                during: "writing a test checkpoint",
                source: std::io::Error::other("x"),
            })
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
        assert!(Reader::open(&p).is_err());
    }

    /// A NaN whose bytes arrive in two writes is found, at its element, in every float type.
    #[test]
    fn non_finite_values_are_found_across_writes() {
        let f16_nan = half::f16::NAN.to_le_bytes().to_vec();
        let bf16_inf = half::bf16::INFINITY.to_le_bytes().to_vec();
        let cases: [(Dtype, Vec<u8>, Vec<u8>); 4] = [
            (
                Dtype::F32,
                1.5f32.to_le_bytes().to_vec(),
                f32::NAN.to_le_bytes().to_vec(),
            ),
            (
                Dtype::F64,
                2.0f64.to_le_bytes().to_vec(),
                f64::NEG_INFINITY.to_le_bytes().to_vec(),
            ),
            (Dtype::F16, half::f16::ONE.to_le_bytes().to_vec(), f16_nan),
            (
                Dtype::BF16,
                half::bf16::ONE.to_le_bytes().to_vec(),
                bf16_inf,
            ),
        ];
        for (dtype, good, bad_value) in cases {
            // elements 0..5 good, element 3 bad; fed one, three, then the rest of the bytes
            let mut bytes = Vec::new();
            for i in 0..5 {
                bytes.extend(if i == 3 { &bad_value } else { &good });
            }
            let es = good.len();
            for split in [1, es / 2, 3 * es + 1, 3 * es + es - 1] {
                let mut scan = Scan::new(vec![(4, None), (4 + bytes.len(), Float::of(dtype))]);
                assert!(scan.feed(&[0; 4]), "an unchecked entry");
                let ok = scan.feed(&bytes[..split]) && scan.feed(&bytes[split..]);
                assert!(!ok, "{dtype:?} split at {split}");
                assert_eq!(scan.non_finite, Some((1, 3)), "{dtype:?} split at {split}");
            }
            let mut scan = Scan::new(vec![(4 * es, Float::of(dtype))]);
            assert!(scan.feed(&bytes[..es]) && scan.feed(&bytes[es..3 * es]));
        }
        // integers are not checked; checksums cover every entry, empty ones too
        let mut scan = Scan::new(vec![(0, None), (4, None), (4, Float::of(Dtype::F32))]);
        assert!(scan.feed(&u32::MAX.to_le_bytes()));
        assert_eq!(
            scan.crcs,
            vec![0, crc32fast::hash(&u32::MAX.to_le_bytes()), 0]
        );
    }

    #[test]
    fn format_errors_are_sentences() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.safetensors");
        let entries = [Entry {
            name: "a".into(),
            dtype: Dtype::F32,
            shape: vec![4],
        }];
        write(&p, &BTreeMap::new(), &entries, |out| {
            out.write_all(&[0; 16]).map_err(io("test"))
        })
        .unwrap();
        let whole = std::fs::read(&p).unwrap();
        let message = |bytes: &[u8]| {
            std::fs::write(&p, bytes).unwrap();
            let e = Reader::open(&p).and_then(|r| r.verify());
            match e {
                Err(Error::Checkpoint { what, .. }) => what,
                other => panic!("{other:?}"),
            }
        };
        assert!(message(&whole[..5]).contains("truncated header"));
        let n = whole.len() - 8 - 16;
        assert!(
            message(&whole[..20])
                .contains(&format!("the header says {n} bytes but the file has 12")),
            "{}",
            message(&whole[..20])
        );
        let m = message(&whole[..whole.len() - 3]);
        assert!(
            m.contains("describes 16 bytes of tensor data, the file holds 13"),
            "{m}"
        );
        let mut huge = whole.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(message(&huge).contains("more than a safetensors header may have"));
    }
}
