//! Host memory tiers: page-aligned ordinary memory, pinned (page-locked) memory from the CUDA
//! driver, and a file-backed tier through `memmap2` for data larger than host memory.
//!
//! All three are one type, [`HostBuffer`], so a chunk can sit on any tier and be copied to a
//! device from any of them. Its bytes are always initialised (zero-filled on allocation).

use std::alloc::Layout;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};

/// Alignment of paged host buffers: one page, so SIMD code and DMA engines see aligned data.
pub const HOST_ALIGN: usize = 4096;

/// Which tier a [`HostBuffer`] lives on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostKind {
    /// Ordinary page-aligned memory.
    Paged,
    /// Page-locked memory registered with the CUDA driver (not write-combined: the CPU reads it).
    Pinned,
    /// A memory-mapped, unlinked file of a [`FileStore`].
    Mapped,
}

impl HostKind {
    /// Lowercase name of the tier.
    pub const fn name(self) -> &'static str {
        match self {
            HostKind::Paged => "paged",
            HostKind::Pinned => "pinned",
            HostKind::Mapped => "mapped",
        }
    }
}

enum Owner {
    /// Zero-length buffer: nothing allocated.
    Empty,
    Paged(Layout),
    Pinned(Arc<cudarc::driver::CudaContext>),
    Mapped {
        _map: memmap2::MmapMut,
        store: Arc<AtomicUsize>,
    },
}

/// A contiguous, initialised block of host memory on one of the [`HostKind`] tiers.
///
/// It dereferences to `[u8]`; [`HostBuffer::typed`] and [`HostBuffer::typed_mut`] give views of
/// plain-old-data element types. Asynchronous copies take a `HostBuffer` by value and give it
/// back through [`Pending::wait`](crate::device::Pending::wait), so its bytes can never be read
/// while a copy into it is in flight.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    owner: Owner,
}

// SAFETY: a HostBuffer uniquely owns its allocation (like a Box<[u8]>); the pinned variant holds
// an Arc to its CUDA context, which is Send + Sync.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    fn empty() -> Self {
        HostBuffer {
            ptr: NonNull::dangling(),
            len: 0,
            owner: Owner::Empty,
        }
    }

    /// Allocates `len` zeroed bytes of ordinary page-aligned memory.
    pub fn paged(len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(Self::empty());
        }
        let layout = Layout::from_size_align(len, HOST_ALIGN).map_err(|e| Error::HostAlloc {
            requested: len,
            tier: "paged",
            reason: e.to_string(),
        })?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::HostAlloc {
            requested: len,
            tier: "paged",
            reason: "the system allocator returned null".into(),
        })?;
        Ok(HostBuffer {
            ptr,
            len,
            owner: Owner::Paged(layout),
        })
    }

    /// Copies `data` into a new paged buffer.
    pub fn from_slice(data: &[u8]) -> Result<Self> {
        let mut b = Self::paged(data.len())?;
        b.copy_from_slice(data);
        Ok(b)
    }

    /// Allocates `len` zeroed bytes of page-locked memory through the CUDA driver of `ctx`,
    /// without the write-combined flag (the CPU optimizer reads these buffers).
    pub(crate) fn pinned(ctx: &Arc<cudarc::driver::CudaContext>, len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(Self::empty());
        }
        let fail = |e: cudarc::driver::DriverError| Error::HostAlloc {
            requested: len,
            tier: "pinned",
            reason: e.to_string(),
        };
        ctx.bind_to_thread().map_err(fail)?;
        // SAFETY: the context is current on this thread; PORTABLE (not WRITECOMBINED) makes the
        // memory pinned for every context and cached for CPU reads.
        let raw = unsafe {
            cudarc::driver::result::malloc_host(len, cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE)
        }
        .map_err(fail)?;
        let ptr = NonNull::new(raw as *mut u8).ok_or_else(|| Error::HostAlloc {
            requested: len,
            tier: "pinned",
            reason: "cuMemHostAlloc returned null".into(),
        })?;
        // SAFETY: the driver returned `len` writable bytes at `ptr`; zero them so the buffer is
        // initialised before it is ever exposed as `&[u8]`.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(HostBuffer {
            ptr,
            len,
            owner: Owner::Pinned(ctx.clone()),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The tier this buffer lives on (an empty buffer reports `Paged`).
    pub fn kind(&self) -> HostKind {
        match self.owner {
            Owner::Empty | Owner::Paged(_) => HostKind::Paged,
            Owner::Pinned(_) => HostKind::Pinned,
            Owner::Mapped { .. } => HostKind::Mapped,
        }
    }

    /// The bytes viewed as elements of `T`; an error if the length is not a multiple of
    /// `size_of::<T>()`.
    pub fn typed<T: bytemuck::Pod>(&self) -> Result<&[T]> {
        bytemuck::try_cast_slice(self).map_err(|_| Error::Misaligned {
            what: "host buffer length",
            value: self.len,
            align: std::mem::size_of::<T>(),
        })
    }

    /// Mutable typed view, as [`HostBuffer::typed`].
    pub fn typed_mut<T: bytemuck::Pod>(&mut self) -> Result<&mut [T]> {
        let len = self.len;
        bytemuck::try_cast_slice_mut(self).map_err(|_| Error::Misaligned {
            what: "host buffer length",
            value: len,
            align: std::mem::size_of::<T>(),
        })
    }

    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by self (dangling but valid for
        // len 0).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        match &self.owner {
            Owner::Empty => {}
            // SAFETY: allocated by `alloc_zeroed` with exactly this layout.
            Owner::Paged(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) },
            Owner::Pinned(ctx) => {
                // A failure here leaks the pinned pages rather than panicking in drop.
                if ctx.bind_to_thread().is_ok() {
                    // SAFETY: allocated by `malloc_host` and freed once, here.
                    let _ =
                        unsafe { cudarc::driver::result::free_host(self.ptr.as_ptr() as *mut _) };
                }
            }
            Owner::Mapped { store, .. } => {
                store.fetch_sub(self.len, Ordering::Relaxed);
            }
        }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("kind", &self.kind())
            .field("len", &self.len)
            .finish()
    }
}

/// The file-backed tier: host buffers backed by unlinked files in one directory, mapped with
/// `memmap2`. The kernel pages them to disk under memory pressure, so the data may exceed RAM.
/// Files are unlinked as soon as they are mapped, so nothing is left behind after a crash.
///
/// ```
/// # fn main() -> tidemem::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let store = tidemem::device::FileStore::new(dir.path())?;
/// let mut buf = store.alloc(1 << 20)?;
/// buf[..4].copy_from_slice(&[1, 2, 3, 4]);
/// assert_eq!(store.used_bytes(), 1 << 20);
/// drop(buf);
/// assert_eq!(store.used_bytes(), 0);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct FileStore {
    dir: PathBuf,
    used: Arc<AtomicUsize>,
}

impl FileStore {
    /// A store whose files live in `dir` (created if missing).
    pub fn new(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
            during: "creating the file-store directory",
            source,
        })?;
        Ok(FileStore {
            dir,
            used: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes currently mapped through this store.
    pub fn used_bytes(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Maps a new zero-filled file of `len` bytes.
    pub fn alloc(&self, len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Ok(HostBuffer::empty());
        }
        let io = |during| move |source| Error::Io { during, source };
        let file = tempfile::tempfile_in(&self.dir).map_err(io("creating a file-tier file"))?;
        file.set_len(len as u64)
            .map_err(io("sizing a file-tier file"))?;
        // SAFETY: the file is unlinked and private to this mapping, so no other process or
        // handle can truncate or modify it while it is mapped.
        let mut map =
            unsafe { memmap2::MmapMut::map_mut(&file) }.map_err(io("mapping a file-tier file"))?;
        let ptr = NonNull::new(map.as_mut_ptr()).ok_or_else(|| Error::HostAlloc {
            requested: len,
            tier: "mapped",
            reason: "mmap returned null".into(),
        })?;
        self.used.fetch_add(len, Ordering::Relaxed);
        Ok(HostBuffer {
            ptr,
            len,
            owner: Owner::Mapped {
                _map: map,
                store: self.used.clone(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paged_is_zeroed_and_aligned() {
        for len in [0, 1, 7, 4096, 100_003] {
            let b = HostBuffer::paged(len).unwrap();
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            if len > 0 {
                assert_eq!(b.as_ptr() as usize % HOST_ALIGN, 0);
            }
        }
    }

    #[test]
    fn typed_views_check_length() {
        let mut b = HostBuffer::paged(12).unwrap();
        b.typed_mut::<f32>().unwrap()[2] = 1.5;
        assert_eq!(b.typed::<f32>().unwrap(), &[0.0, 0.0, 1.5]);
        assert!(matches!(b.typed::<f64>(), Err(Error::Misaligned { .. })));
    }

    #[test]
    fn file_store_round_trip_and_accounting() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path().join("spill")).unwrap();
        let mut a = store.alloc(3 << 20).unwrap();
        let b = store.alloc(5).unwrap();
        assert_eq!(a.kind(), HostKind::Mapped);
        assert_eq!(store.used_bytes(), (3 << 20) + 5);
        for (i, x) in a.iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        assert!(a.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
        assert!(b.iter().all(|&x| x == 0));
        drop(a);
        assert_eq!(store.used_bytes(), 5);
        // Files are unlinked at once: nothing is visible in the directory.
        assert_eq!(std::fs::read_dir(store.dir()).unwrap().count(), 0);
    }
}
