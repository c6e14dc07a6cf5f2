//! The safetensors file format every checkpoint is written in: a streaming writer and a
//! validating reader, knowing nothing of what the tensors are. The chunk manager's checkpoints
//! (`ChunkManager::save_checkpoint`, in `chunk`), the ZeRO ranks' (`ZeroManager`, in `zero`),
//! the embedding tables' (`EmbeddingCache::save`, in `embedding`) and the Hugging Face export
//! (`write_hf`) are built on it.
//!
//! # Writing
//!
//! The writer streams tensor bytes (a model or a table may be larger than RAM), so it writes the
//! format's header itself, into a file beside the target that replaces it only once complete
//! and synced: a save that fails midway, or a process killed midway, leaves an earlier
//! checkpoint as it was. On the way:
//!
//! - **The target.** An existing target must be a regular file: a directory, a device, a fifo
//!   or a socket is refused ([`Error::NotAFile`]), never replaced. A symbolic link is followed
//!   to its final target, which is replaced atomically (the temporary file is made in the final
//!   target's directory), so the link stays a link.
//! - **The temporary file** is `<name>.<pid>.<n>.partial` beside the final target, created like
//!   any other file (mode 0666 less the umask). A save first removes the temporary files of
//!   earlier saves to the same target whose writing process is dead (`/proc/<pid>` is gone;
//!   where there is no `/proc`, none is removed), so a killed save leaves no garbage for long.
//! - **Checksums.** The CRC-32 of every tensor's bytes is computed as they stream by and kept
//!   in the header's metadata under `crc32/<tensor>` (eight hex digits). The header is written
//!   first with zeros there and rewritten in place, at the same length, once the data is done.
//!   Metadata keys starting with `crc32/` are reserved.
//! - **Finite values.** Every element of an F32, F16, BF16 or F64 tensor is checked as it
//!   streams by (an element split across two writes included): a NaN or an infinity fails the
//!   save with [`Error::NonFinite`], naming the tensor and the element, before anything
//!   replaces the target. A checkpoint never replaces a good one with diverged state.
//! - **Errors name the caller's path**, never the temporary file's ([`Error::FileIo`]).
//!
//! # Reading
//!
//! The reader maps the file and validates it with the `safetensors` crate; the format's errors
//! become sentences saying what is wrong with which file ([`Error::Checkpoint`]). A path that
//! is not a regular file (a directory: the checkpoint of several ranks?) is refused as such.
//! [`Reader::tensors`] verifies every tensor's checksum (once per open file) before returning
//! any data, so a flipped bit or a zeroed region is refused ([`Error::ChecksumMismatch`])
//! before a load changes anything. A file with no checksums at all (written before they were
//! added, or by another program: a Hugging Face file) is read unverified; one with some
//! checksums must have one for every tensor.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use safetensors::tensor::{Metadata, SafeTensorError};
use safetensors::{Dtype, SafeTensors};

use crate::dtype::DType;
use crate::error::{Error, Result};

pub(crate) fn io(during: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { during, source }
}

/// An I/O error on the file the caller named `path`.
pub(crate) fn io_at(during: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.to_path_buf();
    move |source| Error::FileIo {
        during,
        path,
        source,
    }
}

/// An error about the checkpoint at `path`.
pub(crate) fn bad(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        what: what.to_string(),
    }
}

/// The metadata key prefix of the tensors' checksums: `crc32/<tensor>`.
const CRC_KEY: &str = "crc32/";

/// The metadata key of the header's own checksum (no tensor may be named `__header__`).
const HEADER_CRC_KEY: &str = "crc32/__header__";

/// The environment variable that lets a crate checkpoint without checksums load (unverified).
pub(crate) const LEGACY_ENV: &str = "TIDEMEM_LEGACY_LOAD";

/// The checksum of a header whose header checksum reads as zeros: the CRC-32 of `header`
/// (the JSON text) with the 8 hex digits at `at` taken as `0`s.
fn header_crc(header: &[u8], at: usize) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&header[..at]);
    h.update(b"00000000");
    h.update(&header[at + 8..]);
    h.finalize()
}

/// Where the 8 hex digits of the header checksum start in `header`, if it has exactly one.
fn header_crc_at(header: &[u8]) -> Option<usize> {
    let pattern = format!("\"{HEADER_CRC_KEY}\":\"");
    let pattern = pattern.as_bytes();
    let mut found = header
        .windows(pattern.len())
        .enumerate()
        .filter(|(_, w)| *w == pattern)
        .map(|(i, _)| i + pattern.len());
    let at = found.next()?;
    (found.next().is_none() && at + 8 <= header.len()).then_some(at)
}

/// Ends the process at the named point of a save protocol when the environment variable
/// `TIDEMEM_FAILPOINT` names it: the state a kill there leaves is the state a crash leaves, and
/// tests check that a checkpoint survives it. Not part of the API.
pub(crate) fn failpoint(point: &str) {
    if std::env::var_os("TIDEMEM_FAILPOINT").is_some_and(|v| v == point) {
        std::process::exit(86);
    }
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
    /// Its size in bytes, `None` past `usize`.
    fn bytes(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(self.dtype.size(), |n, &d| n.checked_mul(d))
    }
}

/// A float element type whose values the writer checks for NaN and infinity.
#[derive(Clone, Copy, Debug)]
enum Float {
    F16,
    BF16,
    F32,
    F64,
}

impl Float {
    fn of(d: Dtype) -> Option<Float> {
        match d {
            Dtype::F16 => Some(Float::F16),
            Dtype::BF16 => Some(Float::BF16),
            Dtype::F32 => Some(Float::F32),
            Dtype::F64 => Some(Float::F64),
            _ => None,
        }
    }

    fn size(self) -> usize {
        match self {
            Float::F16 | Float::BF16 => 2,
            Float::F32 => 4,
            Float::F64 => 8,
        }
    }

    /// The first element of `bytes` (little-endian, whole elements) that is NaN or infinite:
    /// its exponent bits are all ones.
    fn first_non_finite(self, bytes: &[u8]) -> Option<usize> {
        fn find<const N: usize>(bytes: &[u8], bad: impl Fn([u8; N]) -> bool) -> Option<usize> {
            const BLOCK: usize = 1024;
            let elem = |b: &[u8]| {
                let mut e = [0u8; N];
                e.copy_from_slice(b);
                bad(e)
            };
            // a branch-free pass a block at a time (it vectorises); the position only in a
            // block that holds a bad value
            for (k, block) in bytes.chunks(N * BLOCK).enumerate() {
                if block.chunks_exact(N).fold(false, |any, b| any | elem(b)) {
                    return block.chunks_exact(N).position(elem).map(|i| k * BLOCK + i);
                }
            }
            None
        }
        match self {
            Float::F16 => find(bytes, |b| u16::from_le_bytes(b) & 0x7c00 == 0x7c00),
            Float::BF16 => find(bytes, |b| u16::from_le_bytes(b) & 0x7f80 == 0x7f80),
            Float::F32 => find(bytes, |b| {
                u32::from_le_bytes(b) & 0x7f80_0000 == 0x7f80_0000
            }),
            Float::F64 => find(bytes, |b| {
                u64::from_le_bytes(b) & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000
            }),
        }
    }
}

/// The first element of `bytes` (little-endian values of `dtype`) that is NaN or infinite;
/// `None` for a type that is not a float.
pub(crate) fn first_non_finite(dtype: Dtype, bytes: &[u8]) -> Option<usize> {
    Float::of(dtype).and_then(|f| f.first_non_finite(bytes))
}

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
        self.written += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// What a file that is not a regular file is, for [`Error::NotAFile`].
fn kind_of(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        return "directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_char_device() {
            return "character device";
        }
        if t.is_block_device() {
            return "block device";
        }
        if t.is_fifo() {
            return "fifo";
        }
        if t.is_socket() {
            return "socket";
        }
    }
    "special file"
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
    let target = save_target(path)?;
    if target.file_name().is_none() {
        return Err(bad(path, "the path names no file"));
    }
    remove_stale_partials(&target);
    let tmp = Partial::create(&target).map_err(io_at("creating a file beside", path))?;
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

/// A checkpoint file mapped for reading.
pub(crate) struct Reader {
    path: PathBuf,
    map: memmap2::Mmap,
    /// Whether the file must carry checksums (a file of this crate's), unless
    /// [`LEGACY_ENV`] asks otherwise.
    strict: bool,
    /// Set once every checksum matched.
    verified: OnceLock<()>,
}

/// Whether the user asked for checkpoints without checksums to load ([`LEGACY_ENV`]`=1`).
pub(crate) fn legacy_allowed() -> bool {
    std::env::var_os(LEGACY_ENV).is_some_and(|v| v == "1")
}

impl Reader {
    /// Opens and maps `path`, a checkpoint of this crate: a regular file (a directory is
    /// refused as such) whose header matches its checksum, which it must have (unless
    /// [`LEGACY_ENV`]`=1`).
    pub(crate) fn open(path: &Path) -> Result<Reader> {
        Self::open_with(path, true)
    }

    /// Opens and maps `path`, a file that may come from elsewhere (a Hugging Face model):
    /// checksums, when it has them, are verified; none are required.
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
        // SAFETY: the map is read-only; like every reader of a file, this assumes no other
        // process truncates the checkpoint while it is being read (a save never does: it
        // renames a new file over the old one).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_at("mapping", path))?;
        let r = Reader {
            path: path.to_path_buf(),
            map,
            strict,
            verified: OnceLock::new(),
        };
        r.verify_header()?;
        Ok(r)
    }

    /// Checks the header against its checksum, if it has one; a strict reader's file must.
    fn verify_header(&self) -> Result<()> {
        // the format's own checks first, so that a file that is not safetensors says so
        SafeTensors::read_metadata(&self.map).map_err(|e| self.explain(e))?;
        let n = u64::from_le_bytes(self.map[..8].try_into().expect("8 bytes")) as usize;
        let header = &self.map[8..8 + n];
        let Some(at) = header_crc_at(header) else {
            if self.strict && !legacy_allowed() {
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

    /// The tensors, after the format's checks (header, offsets, sizes) and, the first time,
    /// every tensor's checksum when the file has them.
    pub(crate) fn tensors(&self) -> Result<SafeTensors<'_>> {
        let st = SafeTensors::deserialize(&self.map).map_err(|e| self.explain(e))?;
        if self.verified.get().is_none() {
            self.verify(&st)?;
            let _ = self.verified.set(());
        }
        Ok(st)
    }

    /// The header's metadata: keys and values, the checksums included.
    fn raw_metadata(&self) -> Result<BTreeMap<String, String>> {
        let (_, meta): (usize, Metadata) =
            SafeTensors::read_metadata(&self.map).map_err(|e| self.explain(e))?;
        Ok(meta
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default())
    }

    /// The file's metadata (empty when it has none), without the checksums.
    pub(crate) fn metadata(&self) -> Result<BTreeMap<String, String>> {
        let mut meta = self.raw_metadata()?;
        meta.retain(|k, _| !k.starts_with(CRC_KEY));
        Ok(meta)
    }

    /// Checks every tensor's data against its checksum, if the file has checksums.
    fn verify(&self, st: &SafeTensors<'_>) -> Result<()> {
        let mut sums = BTreeMap::new();
        for (k, v) in self.raw_metadata()? {
            if k == HEADER_CRC_KEY {
                continue;
            }
            if let Some(name) = k.strip_prefix(CRC_KEY) {
                let crc = u32::from_str_radix(&v, 16).map_err(|_| {
                    self.bad(format!(
                        "the checksum of tensor '{name}' is '{v}', not 8 hex digits"
                    ))
                })?;
                sums.insert(name.to_string(), crc);
            }
        }
        if sums.is_empty() {
            if self.strict && !legacy_allowed() && !st.names().is_empty() {
                return Err(Error::Unverified {
                    path: self.path.clone(),
                    what: "no tensor checksums",
                });
            }
            return Ok(());
        }
        let mut names = st.names();
        names.sort();
        for name in names {
            let Some(&want) = sums.get(name.as_str()) else {
                return Err(self.bad(format!("it has checksums, but none for tensor '{name}'")));
            };
            let view = st.tensor(name).map_err(|e| self.explain(e))?;
            if crc32fast::hash(view.data()) != want {
                return Err(Error::ChecksumMismatch {
                    path: self.path.clone(),
                    tensor: name.clone(),
                });
            }
        }
        if let Some(name) = sums.keys().find(|n| st.tensor(n).is_err()) {
            return Err(self.bad(format!(
                "it has a checksum for tensor '{name}', which it does not hold"
            )));
        }
        Ok(())
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// An error about this file.
    pub(crate) fn bad(&self, what: impl std::fmt::Display) -> Error {
        bad(&self.path, what)
    }

    /// A `safetensors` error about this file, in words.
    pub(crate) fn explain(&self, e: SafeTensorError) -> Error {
        self.bad(describe(e, &self.map))
    }
}

/// What a `safetensors` error says about `file`, in words.
fn describe(e: SafeTensorError, file: &[u8]) -> String {
    let len = file.len();
    let header_len = file
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, u64::from_le_bytes);
    let after = len.saturating_sub(8);
    match e {
        SafeTensorError::HeaderTooSmall => format!(
            "not a safetensors file (truncated header): it has {len} bytes, fewer than the 8 \
             that give the header's length"
        ),
        SafeTensorError::HeaderTooLarge => format!(
            "not a safetensors file: its first 8 bytes give a header of {header_len} bytes, \
             more than a safetensors header may have"
        ),
        SafeTensorError::InvalidHeaderLength => format!(
            "truncated, or not a safetensors file: the header says {header_len} bytes but the \
             file has {after} after the length"
        ),
        SafeTensorError::InvalidHeader => {
            "not a safetensors file: its header is not UTF-8 text".into()
        }
        SafeTensorError::InvalidHeaderStart | SafeTensorError::InvalidHeaderDeserialization => {
            "not a safetensors file: its header is not a JSON table of tensors".into()
        }
        SafeTensorError::MetadataIncompleteBuffer => {
            let declared = file
                .get(8..)
                .and_then(|rest| rest.get(..usize::try_from(header_len).ok()?))
                .and_then(|h| serde_json::from_slice::<serde_json::Value>(h).ok())
                .and_then(|v| {
                    v.as_object()?
                        .values()
                        .filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64())
                        .max()
                })
                .unwrap_or(0);
            let held = after.saturating_sub(header_len as usize);
            format!(
                "truncated or padded: the header describes {declared} bytes of tensor data, \
                 the file holds {held}"
            )
        }
        SafeTensorError::InvalidOffset(name) => format!(
            "the header gives tensor '{name}' data offsets that do not follow the tensor \
             before it"
        ),
        SafeTensorError::TensorInvalidInfo => {
            "the header gives a tensor data offsets that do not fit its shape and type".into()
        }
        SafeTensorError::ValidationOverflow => {
            "the header gives a tensor a shape too large to address".into()
        }
        SafeTensorError::TensorNotFound(name) => format!("it has no tensor '{name}'"),
        SafeTensorError::InvalidTensorView(dtype, shape, n) => {
            format!("a {dtype:?} tensor of shape {shape:?} cannot be {n} bytes")
        }
        SafeTensorError::IoError(e) => format!("read error: {e}"),
        SafeTensorError::JsonError(e) => format!("its header is not valid JSON: {e}"),
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
        assert!(Reader::open(&p).unwrap().tensors().is_err());
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
            let e = Reader::open(&p).and_then(|r| r.tensors().map(|_| ()));
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
