use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Device, DeviceBuffer};
use crate::error::{Error, Result};

const SMALL: usize = 1 << 20;
const SMALL_ROUND: usize = 512;
const LARGE_ROUND: usize = 128 << 10;

/// Rounds a request up to the size class the allocator serves it from.
pub fn round_size(bytes: usize) -> usize {
    let r = if bytes < SMALL {
        SMALL_ROUND
    } else {
        LARGE_ROUND
    };
    bytes.max(1).div_ceil(r).saturating_mul(r)
}

/// Counters of a [`CachingAllocator`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes in live blocks (rounded sizes).
    pub allocated: usize,
    /// Highest `allocated` since creation or the last [`CachingAllocator::reset_peak`].
    pub peak_allocated: usize,
    /// Bytes held from the device: live blocks plus the cache.
    pub reserved: usize,
    /// Highest `reserved` since creation or the last reset.
    pub(crate) peak_reserved: usize,
    /// Allocations served from the cache.
    pub cache_hits: u64,
    /// Allocations that went to the device.
    pub device_allocs: u64,
}

/// Live and reserved bytes with their peaks (see [`Shared::bytes`]).
#[derive(Debug, Default)]
struct Bytes {
    allocated: AtomicUsize,
    peak_allocated: AtomicUsize,
    reserved: AtomicUsize,
    peak_reserved: AtomicUsize,
}

impl Bytes {
    /// Adds `delta` (signed) to a counter and raises its peak; callers hold the state lock.
    fn add(value: &AtomicUsize, peak: &AtomicUsize, delta: isize) {
        let v = value.load(Ordering::Relaxed).wrapping_add_signed(delta);
        value.store(v, Ordering::Release);
        if v > peak.load(Ordering::Relaxed) {
            peak.store(v, Ordering::Release);
        }
    }
    /// The peak since the last restart, restarting it at the current value.
    fn take_peak(value: &AtomicUsize, peak: &AtomicUsize) -> usize {
        let now = value.load(Ordering::Acquire);
        peak.swap(now, Ordering::AcqRel).max(now)
    }
}

#[derive(Debug, Default)]
struct State {
    free: BTreeMap<usize, Vec<DeviceBuffer>>,
    stats: PoolStats,
}

/// Called when the device is full with the bytes an allocation needs, to make memory available
/// (e.g. by giving back buffers kept for reuse, or waiting for the copies that still hold
/// evicted buffers).
pub type Reclaim = Arc<dyn Fn(usize) + Send + Sync>;

struct Shared {
    device: Device,
    state: Mutex<State>,
    /// The byte counters and their peaks, written only under `state`'s lock and read without
    /// it, so the tide tracer's read at every moment takes no lock.
    bytes: Bytes,
    reclaim: Mutex<Option<Reclaim>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// A caching allocator for non-model data (activations, workspaces).
///
/// Freed blocks go back to a per-size cache instead of the device, so the steady state of a
/// training loop allocates nothing from the backend. It reports the bytes in use and the bytes
/// reserved from the device, each with a peak that [`CachingAllocator::reset_peak`] restarts: the
/// tide tracer reads the peak of every period between two moments.
///
/// Sizes are rounded up to 512 bytes (below 1 MiB) or to 128 KiB (above), and a cached block is
/// reused for a request when it is at most 25% larger, which bounds the waste per block. When the
/// device is full the cache is emptied and the allocation retried once before
/// [`Error::OutOfMemory`] is returned.
///
/// The caching allocator. Cheap to clone; clones share one cache.
///
/// ```
/// use tidemem::device::{CachingAllocator, Device, SimConfig};
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(16 << 20))?;
/// let pool = CachingAllocator::new(dev);
/// let a = pool.alloc(3000)?;            // rounded to 3072 bytes
/// assert_eq!(pool.stats().allocated, 3072);
/// drop(a);                              // back to the cache, not the device
/// assert_eq!(pool.stats().reserved, 3072);
/// let _b = pool.alloc(2900)?;           // served from the cache
/// assert_eq!(pool.stats().cache_hits, 1);
/// pool.reset_peak();
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct CachingAllocator {
    shared: Arc<Shared>,
}

/// A block of device memory from a [`CachingAllocator`]; returns to the cache on drop.
/// Dereferences to its [`DeviceBuffer`] (whose length is the rounded size; [`PoolBlock::requested`]
/// is what was asked for).
#[derive(Debug)]
pub struct PoolBlock {
    buf: Option<DeviceBuffer>,
    requested: usize,
    shared: Arc<Shared>,
}

impl PoolBlock {
    /// Bytes asked for (the buffer may be larger).
    pub fn requested(&self) -> usize {
        self.requested
    }
}

impl Deref for PoolBlock {
    type Target = DeviceBuffer;
    fn deref(&self) -> &DeviceBuffer {
        self.buf
            .as_ref()
            .expect("block holds its buffer until dropped")
    }
}

impl Drop for PoolBlock {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let mut st = self.shared.state.lock();
            let b = &self.shared.bytes;
            Bytes::add(&b.allocated, &b.peak_allocated, -(buf.len() as isize));
            st.free.entry(buf.len()).or_default().push(buf);
        }
    }
}

impl CachingAllocator {
    /// An allocator over `device`.
    pub fn new(device: Device) -> Self {
        CachingAllocator {
            shared: Arc::new(Shared {
                device,
                state: Mutex::new(State::default()),
                bytes: Bytes::default(),
                reclaim: Mutex::new(None),
            }),
        }
    }

    /// Sets what runs when the device is full before the allocation is retried once (the
    /// chunk manager waits for its streams, which may still hold evicted chunks).
    pub(crate) fn set_reclaim(&self, reclaim: Option<Reclaim>) {
        *self.shared.reclaim.lock() = reclaim;
    }

    /// The device blocks come from.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// A block of at least `bytes` bytes.
    pub fn alloc(&self, bytes: usize) -> Result<PoolBlock> {
        if bytes > isize::MAX as usize / 2 {
            return Err(Error::TooLarge {
                what: "bytes of a pool request (more than any device holds)".into(),
                requested: bytes as u128,
                limit: (isize::MAX as usize / 2) as u64,
            });
        }
        let size = round_size(bytes);
        let mut st = self.shared.state.lock();
        let hit = st
            .free
            .range(size..=size + size / 4)
            .next()
            .map(|(&k, _)| k);
        let buf = match hit {
            Some(k) => {
                let list = st.free.get_mut(&k).expect("key just found");
                let b = list.pop().expect("lists in the map are non-empty");
                if list.is_empty() {
                    st.free.remove(&k);
                }
                st.stats.cache_hits += 1;
                b
            }
            None => {
                let b = match self.shared.device.alloc(size) {
                    Ok(b) => b,
                    Err(Error::OutOfMemory { .. }) => {
                        // give back the cache, let the owner of the other device memory finish
                        // releasing what it freed (without the lock: the hook may free blocks),
                        // and try once more
                        let cached: usize = st.free.iter().map(|(k, v)| k * v.len()).sum();
                        st.free.clear();
                        let n = &self.shared.bytes;
                        Bytes::add(&n.reserved, &n.peak_reserved, -(cached as isize));
                        let reclaim = self.shared.reclaim.lock().clone();
                        if let Some(r) = reclaim {
                            drop(st);
                            r(size);
                            st = self.shared.state.lock();
                        }
                        self.shared.device.alloc(size)?
                    }
                    Err(e) => return Err(e),
                };
                st.stats.device_allocs += 1;
                let n = &self.shared.bytes;
                Bytes::add(&n.reserved, &n.peak_reserved, size as isize);
                b
            }
        };
        let n = &self.shared.bytes;
        Bytes::add(&n.allocated, &n.peak_allocated, buf.len() as isize);
        drop(st);
        Ok(PoolBlock {
            buf: Some(buf),
            requested: bytes,
            shared: self.shared.clone(),
        })
    }

    /// Current counters.
    pub fn stats(&self) -> PoolStats {
        let st = self.shared.state.lock();
        let b = &self.shared.bytes;
        let get = |a: &AtomicUsize| a.load(Ordering::Acquire);
        PoolStats {
            allocated: get(&b.allocated),
            peak_allocated: get(&b.peak_allocated),
            reserved: get(&b.reserved),
            peak_reserved: get(&b.peak_reserved),
            ..st.stats
        }
    }

    /// The peak and current live bytes, then restarts both peaks at the current values: what
    /// the tide tracer reads at every moment. Takes no lock. An allocation on another thread
    /// at the same instant may keep its bytes in the restarted peak (an overstatement, never
    /// an understatement).
    pub(crate) fn take_peak(&self) -> (usize, usize) {
        let b = &self.shared.bytes;
        Bytes::take_peak(&b.reserved, &b.peak_reserved);
        let peak = Bytes::take_peak(&b.allocated, &b.peak_allocated);
        (peak, b.allocated.load(Ordering::Acquire))
    }

    /// Restarts both peaks at the current values (call at each moment of the tide).
    pub fn reset_peak(&self) {
        self.take_peak();
    }

    /// Gives cached blocks back to the device, the largest first, until at least `bytes` are
    /// given back or the cache is empty; returns the bytes given back.
    pub fn release(&self, bytes: usize) -> usize {
        let mut st = self.shared.state.lock();
        let mut freed = 0;
        while freed < bytes {
            let Some(mut e) = st.free.last_entry() else {
                break;
            };
            let size = *e.key();
            e.get_mut().pop();
            if e.get().is_empty() {
                e.remove();
            }
            freed += size;
        }
        let b = &self.shared.bytes;
        Bytes::add(&b.reserved, &b.peak_reserved, -(freed as isize));
        freed
    }

    /// Returns every cached block to the device; returns the bytes released.
    pub(crate) fn empty_cache(&self) -> usize {
        self.release(usize::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimConfig;

    fn pool(cap: usize) -> CachingAllocator {
        CachingAllocator::new(Device::sim(SimConfig::with_capacity(cap)).unwrap())
    }

    #[test]
    fn rounding() {
        assert_eq!(round_size(0), 512);
        assert_eq!(round_size(512), 512);
        assert_eq!(round_size(513), 1024);
        assert_eq!(round_size(SMALL), SMALL);
        assert_eq!(round_size(SMALL + 1), SMALL + LARGE_ROUND);
    }

    #[test]
    fn peak_tracks_and_resets() {
        let p = pool(64 << 20);
        let a = p.alloc(4 << 20).unwrap();
        let b = p.alloc(2 << 20).unwrap();
        drop(a);
        let s = p.stats();
        assert_eq!(s.allocated, 2 << 20);
        assert_eq!(s.peak_allocated, 6 << 20);
        assert_eq!(s.reserved, 6 << 20);
        p.reset_peak();
        assert_eq!(p.stats().peak_allocated, 2 << 20);
        drop(b);
        assert_eq!(p.stats().peak_allocated, 2 << 20);
        assert_eq!(p.stats().allocated, 0);
    }

    #[test]
    fn reuses_only_close_sizes() {
        let p = pool(64 << 20);
        drop(p.alloc(8 << 20).unwrap());
        let _small = p.alloc(1 << 20).unwrap(); // 8 MiB block is far too big: new allocation
        assert_eq!(p.stats().cache_hits, 0);
        let _big = p.alloc(7 << 20).unwrap(); // within 25%: reused
        assert_eq!(p.stats().cache_hits, 1);
        assert_eq!(p.stats().device_allocs, 2);
    }

    #[test]
    fn oom_empties_cache_then_errors() {
        let p = pool(10 << 20);
        drop(p.alloc(7 << 20).unwrap());
        // 7 MiB cached (too big to reuse) + 4 MiB new does not fit: the cache is released and
        // the retry succeeds.
        let b = p.alloc(4 << 20).unwrap();
        assert_eq!(p.stats().reserved, 4 << 20);
        let e = p.alloc(7 << 20).unwrap_err();
        match e {
            Error::OutOfMemory {
                requested,
                free,
                capacity,
                ..
            } => {
                assert_eq!(requested, 7 << 20);
                assert_eq!(free, 6 << 20);
                assert_eq!(capacity, 10 << 20);
            }
            other => panic!("unexpected {other}"),
        }
        drop(b);
        assert_eq!(p.empty_cache(), 4 << 20);
        assert_eq!(p.device().mem_info().unwrap().free, 10 << 20);
    }

    #[test]
    fn a_full_device_runs_the_reclaim_hook_and_retries() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let dev = Device::sim(crate::device::SimConfig::with_capacity(4096)).unwrap();
        let pool = CachingAllocator::new(dev.clone());
        let hog = Arc::new(parking_lot::Mutex::new(Some(dev.alloc(4096).unwrap())));
        assert!(pool.alloc(1024).is_err(), "no hook: the device stays full");
        let calls = Arc::new(AtomicUsize::new(0));
        let (h, c) = (hog.clone(), calls.clone());
        pool.set_reclaim(Some(Arc::new(move |bytes| {
            assert_eq!(bytes, 1024);
            c.fetch_add(1, Ordering::Relaxed);
            h.lock().take();
        })));
        assert!(pool.alloc(1024).is_ok(), "the hook released the memory");
        assert_eq!(calls.load(Ordering::Relaxed), 1);
    }
}
