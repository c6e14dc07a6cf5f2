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

/// Host memory tiers: page-aligned ordinary memory, pinned (page-locked) memory from the CUDA
/// driver, and a file-backed tier through `memmap2` for data larger than host memory.
///
/// All three are one type, [`HostBuffer`], so a chunk can sit on any tier and be copied to a
/// device from any of them. Its bytes are always initialised (zero-filled on allocation).
///
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
/// Every buffer's disk space is reserved before it is mapped (`fallocate`; on a filesystem
/// without it, by writing zeros), so a full disk is [`Error::FileTierFull`] from
/// [`FileStore::alloc`], never a `SIGBUS` when a page of a sparse file is first touched.
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
/// // more than the disk holds: a typed error with the numbers, nothing mapped
/// let err = store.alloc(1 << 50).unwrap_err();
/// assert!(matches!(err, tidemem::Error::FileTierFull { requested, .. } if requested == 1 << 50));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct FileStore {
    dir: PathBuf,
    used: Arc<AtomicUsize>,
}

impl FileStore {
    /// A store whose files live in `dir` (created if missing). A directory that cannot be made
    /// or takes no file (read-only, `/proc`) is refused now, naming it ([`Error::FileIo`]),
    /// not at the first spill.
    pub fn new(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let at = |during| {
            let path = dir.clone();
            move |source| Error::FileIo {
                during,
                path,
                source,
            }
        };
        std::fs::create_dir_all(&dir).map_err(at("creating the file tier's directory"))?;
        tempfile::tempfile_in(&dir).map_err(at("creating a file in the file tier's directory"))?;
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

    /// Bytes this process may still write on the filesystem of the store's directory
    /// (`statvfs`: the blocks available to unprivileged users, or every free block for root);
    /// `None` where the filesystem does not say.
    pub fn available_bytes(&self) -> Option<u64> {
        space::available(&self.dir)
    }

    /// Maps a new zero-filled file of `len` bytes, its disk space reserved first.
    ///
    /// # Errors
    /// [`Error::FileTierFull`] (with `len`, the directory, the free bytes and the OS error)
    /// when the filesystem cannot hold `len` more bytes: more than
    /// [`available_bytes`](Self::available_bytes) is refused without touching the disk, and a
    /// reservation the filesystem refuses (full, over quota, past its file-size limit) is
    /// undone. [`Error::Io`] for other failures of the file or the mapping.
    pub fn alloc(&self, len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Ok(HostBuffer::empty());
        }
        let io = |during| {
            let path = self.dir.clone();
            move |source| Error::FileIo {
                during,
                path,
                source,
            }
        };
        let file = tempfile::tempfile_in(&self.dir).map_err(io("creating a file-tier file in"))?;
        self.reserve(&file, len)?;
        // SAFETY: the file is unlinked and private to this mapping, so no other process or
        // handle can truncate or modify it while it is mapped; its blocks are reserved, so no
        // page of the mapping faults for want of disk space.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }
            .map_err(io("mapping a file-tier file in"))?;
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

    /// Sizes the fresh, empty `file` to `len` bytes with every block allocated on disk.
    fn reserve(&self, file: &std::fs::File, len: usize) -> Result<()> {
        let full = |source| Error::FileTierFull {
            requested: len,
            dir: self.dir.clone(),
            available: self.available_bytes(),
            source,
        };
        // Refused before asking: a filesystem that allocates as it goes (ext4) would otherwise
        // fill the disk up to the last block before it gave up.
        if self.available_bytes().is_some_and(|free| len as u64 > free) {
            return Err(full(space::no_space()));
        }
        match space::allocate(file, len) {
            Ok(()) => Ok(()),
            Err(e) if space::is_unsupported(&e) => space::write_zeros(file, len).map_err(|e| {
                if space::is_full(&e) {
                    full(e)
                } else {
                    Error::Io {
                        during: "writing zeros to reserve a file-tier file",
                        source: e,
                    }
                }
            }),
            Err(e) if space::is_full(&e) => Err(full(e)),
            Err(source) => Err(Error::Io {
                during: "reserving the disk space of a file-tier file",
                source,
            }),
        }
    }
}

/// Disk space: what a filesystem has free, and reserving it for a file.
mod space {
    use std::fs::File;
    use std::io;
    use std::path::Path;

    /// Bytes of zeros written at a time where `fallocate` is not supported.
    const ZEROS: usize = 1 << 20;

    /// What `ENOSPC` says.
    pub(super) fn no_space() -> io::Error {
        #[cfg(unix)]
        return io::Error::from_raw_os_error(libc::ENOSPC);
        #[cfg(not(unix))]
        return io::Error::from(io::ErrorKind::StorageFull);
    }

    /// Whether `e` says the filesystem (or the quota, or the size one file may have) is spent.
    pub(super) fn is_full(e: &io::Error) -> bool {
        #[cfg(unix)]
        if matches!(
            e.raw_os_error(),
            Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG)
        ) {
            return true;
        }
        matches!(
            e.kind(),
            io::ErrorKind::StorageFull | io::ErrorKind::FileTooLarge
        )
    }

    /// Whether `e` says the filesystem cannot preallocate.
    pub(super) fn is_unsupported(e: &io::Error) -> bool {
        #[cfg(unix)]
        if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOSYS)) {
            return true;
        }
        e.kind() == io::ErrorKind::Unsupported
    }

    /// Allocates the blocks of bytes `0..len` of `file` (growing it to `len`).
    #[cfg(target_os = "linux")]
    pub(super) fn allocate(file: &File, len: usize) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let len =
            libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        loop {
            // SAFETY: the descriptor belongs to `file`, open for writing for the whole call;
            // fallocate reads and writes no memory of this process.
            if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Allocates the blocks of bytes `0..len` of `file` (growing it to `len`).
    #[cfg(all(unix, not(target_os = "linux")))]
    pub(super) fn allocate(file: &File, len: usize) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let len =
            libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        loop {
            // SAFETY: the descriptor belongs to `file`, open for writing for the whole call;
            // posix_fallocate reads and writes no memory of this process.
            match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
                0 => return Ok(()),
                libc::EINTR => continue,
                code => return Err(io::Error::from_raw_os_error(code)),
            }
        }
    }

    /// Allocates the blocks of bytes `0..len` of `file`: not supported here.
    #[cfg(not(unix))]
    pub(super) fn allocate(_file: &File, _len: usize) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }

    /// Writes `len` zero bytes to `file` from its start, so every block is allocated.
    pub(super) fn write_zeros(file: &File, len: usize) -> io::Result<()> {
        use std::io::Write;
        let zeros = vec![0u8; ZEROS.min(len)];
        let mut out = file;
        let mut left = len;
        while left > 0 {
            let n = left.min(zeros.len());
            out.write_all(&zeros[..n])?;
            left -= n;
        }
        out.flush()
    }

    /// Bytes this process may write on the filesystem of `dir`, when it says.
    #[cfg(unix)]
    // The widths of the statvfs fields differ between platforms.
    #[allow(clippy::unnecessary_cast)]
    pub(super) fn available(dir: &Path) -> Option<u64> {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: statvfs is plain old data; all zeros is a valid value of it.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `path` is a NUL-terminated string and `st` a writable statvfs, both alive for
        // the call.
        if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 || st.f_blocks == 0 {
            return None;
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let blocks = if root { st.f_bfree } else { st.f_bavail } as u64;
        let frsize = if st.f_frsize > 0 {
            st.f_frsize
        } else {
            st.f_bsize
        } as u64;
        Some(blocks.saturating_mul(frsize))
    }

    /// Bytes this process may write on the filesystem of `dir`: unknown here.
    #[cfg(not(unix))]
    pub(super) fn available(_dir: &Path) -> Option<u64> {
        None
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

    #[test]
    fn file_store_refuses_more_than_the_disk_holds() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path()).unwrap();
        let Some(free) = store.available_bytes() else {
            eprintln!("skipped: the filesystem of the temporary directory reports no free space");
            return;
        };
        // a terabyte past the free space: never there, but not past ext4's file-size limit,
        // so a sparse file of this size would be created (and fault on first touch)
        for len in [free.saturating_add(1 << 40), 1 << 50] {
            let len = usize::try_from(len).unwrap_or(usize::MAX);
            match store.alloc(len) {
                Err(Error::FileTierFull {
                    requested,
                    dir: d,
                    available,
                    source,
                }) => {
                    assert_eq!((requested, d.as_path()), (len, dir.path()));
                    assert!(available.is_some());
                    let msg = Error::FileTierFull {
                        requested,
                        dir: d,
                        available,
                        source,
                    }
                    .to_string();
                    assert!(msg.contains(&len.to_string()), "{msg}");
                    assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
                }
                other => panic!("{len} bytes on a disk with {free} free: {other:?}"),
            }
        }
        assert_eq!(store.used_bytes(), 0);
        assert_eq!(std::fs::read_dir(store.dir()).unwrap().count(), 0);
    }

    #[cfg(unix)]
    #[test]
    fn reserved_files_have_their_blocks() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let len = (3 << 20) + 5;
        let f = tempfile::tempfile().unwrap();
        space::allocate(&f, len)
            .or_else(|e| match space::is_unsupported(&e) {
                true => space::write_zeros(&f, len),
                false => Err(e),
            })
            .unwrap();
        let g = tempfile::tempfile().unwrap();
        space::write_zeros(&g, len).unwrap();
        for file in [&f, &g] {
            let m = file.metadata().unwrap();
            assert_eq!(m.len(), len as u64);
            // st_blocks counts 512-byte units: every byte is backed, nothing is sparse
            assert!(m.blocks() * 512 >= len as u64, "{} blocks", m.blocks());
            let mut tail = [1u8; 4096];
            file.read_exact_at(&mut tail, len as u64 - 4096).unwrap();
            assert!(tail.iter().all(|&b| b == 0));
        }
        assert!(space::is_full(&space::no_space()));
        assert!(!space::is_full(&std::io::Error::from(
            std::io::ErrorKind::PermissionDenied
        )));
    }
}
