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
//!   in the header's metadata under `crc32/<tensor>` (eight hex digits); the header's own
//!   CRC-32 (of its JSON text with its own eight digits read as `0`s) under `crc32/__header__`,
//!   so that names, dtypes, shapes, offsets and every metadata value (step counts, the loss
//!   scale, ranks, the model's description) are covered too. The header is written first with
//!   zeros there and rewritten in place, at the same length, once the data is done. Metadata
//!   keys starting with `crc32/` are reserved, and no tensor may be named `__header__`.
//! - **Finite values.** Every element of an F32, F16, BF16 or F64 tensor is checked as it
//!   streams by (an element split across two writes included): a NaN or an infinity fails the
//!   save with [`Error::NonFinite`], naming the tensor and the element, before anything
//!   replaces the target. A checkpoint never replaces a good one with diverged state.
//! - **Errors name the caller's path**, never the temporary file's ([`Error::FileIo`]).
//!
//! # Reading
//!
//! The reader never maps the file: it reads the header (at most the format's 100 MB) and checks
//! it as the `safetensors` crate would, then reads tensor data with bounded reads, one piece of
//! one tensor at a time, so that a checkpoint larger than host memory is never copied whole
//! and a file truncated while it is read fails the read ([`Error::Checkpoint`]: "truncated
//! while being read") instead of killing the process with SIGBUS. The format's errors become
//! sentences saying what is wrong with which file ([`Error::Checkpoint`]). A path that is not
//! a regular file (a directory: the checkpoint of several ranks?) is refused as such.
//!
//! A checkpoint of this crate (metadata `format = tidemem-…`) must match its header checksum
//! ([`Error::HeaderChecksumMismatch`]) at open. Before any data is returned, every tensor's
//! checksum is verified (once per open file: [`Error::ChecksumMismatch`] names a damaged
//! tensor) and every float value checked finite ([`Error::NonFinite`], as the import and the
//! save refuse), the variances of a chunk checkpoint not negative, so that nothing a run could
//! not have written loads. A checkpoint of this crate without checksums (written by an older
//! version, or with them deleted) is refused ([`Error::Unverified`]) unless the environment
//! variable `TIDEMEM_LEGACY_LOAD=1` asks for an unverified load (then neither checksums nor
//! values are checked). A file from elsewhere (a Hugging Face model, read by `read_hf`) needs
//! no checksums; one with some must have one for every tensor.

use std::path::Path;

use safetensors::tensor::SafeTensorError;
use safetensors::Dtype;

use crate::dtype::DType;
use crate::error::Error;

mod read;
mod write;

pub(crate) use read::{Info, Reader};
pub(crate) use write::{save_target, sibling, write_file, write_unpersisted, Written};

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
/// tests check that a checkpoint survives it. A thread that reaches the point
/// `TIDEMEM_FAILPOINT_HOLD` names waits there until the process ends (at the other point), so
/// that a test orders two ranks' steps as a slow rank would. Not part of the API.
pub(crate) fn failpoint(point: &str) {
    if failpoint_armed(point) {
        std::process::exit(86);
    }
    if std::env::var_os("TIDEMEM_FAILPOINT_HOLD").is_some_and(|v| v == point)
        && std::env::var_os("TIDEMEM_FAILPOINT").is_some()
    {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
}

/// Whether `TIDEMEM_FAILPOINT` names `point` (a caller makes the state it leaves first).
pub(crate) fn failpoint_armed(point: &str) -> bool {
    std::env::var_os("TIDEMEM_FAILPOINT").is_some_and(|v| v == point)
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

/// Whether the user asked for checkpoints without checksums to load ([`LEGACY_ENV`]`=1`).
pub(crate) fn legacy_allowed() -> bool {
    std::env::var_os(LEGACY_ENV).is_some_and(|v| v == "1")
}

/// What a `safetensors` error says about a file of `len` bytes whose first 8 give a header
/// of `header_len` bytes (`header`, when it was read), in words.
fn describe(e: SafeTensorError, len: u64, header_len: u64, header: Option<&[u8]>) -> String {
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
            let declared = header
                .and_then(|h| serde_json::from_slice::<serde_json::Value>(h).ok())
                .and_then(|v| {
                    v.as_object()?
                        .values()
                        .filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64())
                        .max()
                })
                .unwrap_or(0);
            let held = after.saturating_sub(header_len);
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
