//! The device layer: where bytes live and how they move.
//!
//! * [`Backend`] is the interface a device implements (allocate, enqueue a copy or a kernel on a
//!   stream, record and wait on events). Two implementations ship: [`SimBackend`], a simulated
//!   accelerator with a hard capacity whose copy engines are host threads, and [`CudaBackend`],
//!   a CUDA GPU through cudarc.
//! * [`Device`] is the safe API a user holds. It checks every argument (ownership, bounds,
//!   sizes), enforces stream ordering of every access to a device buffer (see [`order`]: an
//!   unordered access is an error, on both backends), counts the bytes moved, and hands
//!   asynchronous copies back as [`Pending`] values, so a host buffer can never be read before the
//!   copy into it completes.
//! * [`HostBuffer`] and [`FileStore`] are the host tiers; [`CachingAllocator`] serves non-model
//!   data and reports the current and peak bytes the tide tracer reads.
//!
//! ```
//! use tidemem::device::{Device, HostBuffer, SimConfig};
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(64 << 20))?;
//! let stream = dev.new_stream()?;
//! let buf = dev.alloc(1024)?;
//! let up = dev.copy_h2d(&stream, HostBuffer::from_slice(&[7u8; 1024])?, &buf)?;
//! let _src = up.wait()?; // the host buffer comes back when the copy is done
//! let back = dev.copy_d2h(&stream, &buf, HostBuffer::paged(1024)?)?.wait()?;
//! assert!(back.iter().all(|&b| b == 7));
//! # Ok(()) }
//! ```

mod backend;
mod copy;
pub(crate) mod cuda;
mod cuda_stream;
mod handles;
pub(crate) mod host;
pub(crate) mod kernel;
mod launch;
mod library;
pub mod order;
mod phases;
pub(crate) mod pool;
pub(crate) mod sim;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

pub use backend::{
    operand_infos, Backend, ForeignCall, MemInfo, Op, RawBuffer, RawEvent, RawOperand, RawStream,
};
pub use cuda::{
    device_count as cuda_device_count, driver_present as cuda_driver_present, CudaBackend,
};
pub use handles::{DeviceBuffer, DeviceView, Event, Input, Operand, Pending, Stream};
pub use host::{FileStore, HostBuffer, HostKind, HOST_ALIGN};
pub use kernel::{
    grid_stride, grid_stride_blocks, CudaSide, Grid, HostOperand, KernelDesc, LaunchInfo,
    LibraryCall, Mode, OperandInfo, OperandSpec, ParamLayout, TwinArgs,
};
pub use phases::{HostPhase, HostSpan, Phase, PhaseTimes};
pub use pool::{round_size, CachingAllocator, PoolBlock, PoolStats, Reclaim};
pub(crate) use sim::sim_threads;
pub use sim::{LinkModel, SimBackend, SimConfig, SIM_ALIGN};

pub use crate::device_id::{BackendKind, DeviceId};
use crate::error::{Error, Result};
use order::{AccessRecord, Clock, Clocks};

/// Declares [`DeviceStats`] and its atomic twin, `Counters`, from one list of fields.
macro_rules! device_stats {
    ($(#[$meta:meta])* pub struct DeviceStats { $($(#[doc = $doc:literal])* $field:ident,)* }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
        pub struct DeviceStats {
            $($(#[doc = $doc])* pub $field: u64,)*
        }

        impl DeviceStats {
            /// Component-wise difference `self - earlier` (0 where `earlier` is the larger):
            /// what happened between two readings.
            pub fn since(&self, earlier: &DeviceStats) -> DeviceStats {
                DeviceStats {
                    $($field: self.$field.saturating_sub(earlier.$field),)*
                }
            }
        }

        /// The device's running counts behind [`DeviceStats`].
        #[derive(Default)]
        struct Counters {
            $($field: AtomicU64,)*
        }

        impl Counters {
            fn read(&self) -> DeviceStats {
                DeviceStats {
                    $($field: self.$field.load(Ordering::Relaxed),)*
                }
            }
        }
    };
}

device_stats! {
/// What a device has been asked to do since it was created: bytes and copies moved, ops
/// launched, allocations, and the host's blocking waits. Counted at the [`Device`] layer, so
/// every backend counts alike (the timing-only simulated device too), and deterministic: a test
/// can assert the counts of a step ([`DeviceStats::since`]).
///
/// **Blocking waits** are the waits for device work the host has not yet seen finish: a
/// [`Device::sync_stream`], [`Device::sync_event`], or [`Pending::wait`] (and a `Pending`'s
/// drop, and so every [`Device::download`]) counts when the work it waits for is not already
/// known complete from an earlier wait or a query that answered done ([`Pending::is_ready`],
/// [`Device::event_done`]); one that finds everything observed returns at once on any device
/// and does not count. Each such wait empties a GPU's queue.
pub struct DeviceStats {
    /// Host→device bytes.
    h2d_bytes,
    /// Device→host bytes.
    d2h_bytes,
    /// Device→device bytes.
    d2d_bytes,
    /// Host→device copies.
    h2d_copies,
    /// Device→host copies.
    d2h_copies,
    /// Device→device copies.
    d2d_copies,
    /// Kernel ops launched ([`Device::launch`] of an op compiled by NVRTC; on CUDA its plan
    /// may run several grids).
    launches,
    /// Library ops launched ([`Device::launch`] of an op whose CUDA side is a library call, a
    /// cuBLAS GEMM; the simulated device runs its twin) and foreign work enqueued (an NCCL
    /// collective).
    library_calls,
    /// Memory fills ([`Device::memset`]).
    fills,
    /// Device allocations ([`Device::alloc`]): the pools' misses and everything allocated
    /// outside them (a pool hit never reaches the device).
    device_allocs,
    /// Blocking [`Device::sync_stream`] calls.
    stream_syncs,
    /// Blocking [`Device::sync_event`] calls.
    event_syncs,
    /// Blocking waits for a copy's host buffer ([`Pending::wait`] or its drop; downloads).
    pending_waits,
}
}

impl DeviceStats {
    /// Every blocking wait: stream and event synchronisations and copies waited for.
    pub fn blocking_waits(&self) -> u64 {
        self.stream_syncs + self.event_syncs + self.pending_waits
    }
}

impl Counters {
    fn add(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

struct Inner {
    backend: Box<dyn Backend>,
    id: DeviceId,
    clocks: Mutex<Clocks>,
    counters: Counters,
    next_buffer: AtomicU64,
    /// Host buffers of copies nobody waits for ([`Device::upload_to`]), freed once the host
    /// has seen their copies finish.
    detached: Mutex<Vec<Detached>>,
    /// Host buffers of finished uploads, for the next ones (pinned on CUDA).
    staging: Mutex<Vec<HostBuffer>>,
    /// What gives back device memory kept for reuse when an allocation finds the device full.
    reclaimers: Mutex<Vec<std::sync::Weak<Reclaimer>>>,
    profiler: phases::Profiler,
}

/// A host buffer a copy still reads, the event recorded after the copy, and its clock.
struct Detached {
    buf: HostBuffer,
    event: RawEvent,
    clock: order::Clock,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The device goes away: wait for the copies still reading their host buffers, or leak
        // a buffer whose copy cannot be waited for.
        for d in self.detached.get_mut().drain(..) {
            match self.backend.sync_event(&d.event) {
                Ok(()) => drop(d.buf),
                Err(_) => std::mem::forget(d.buf),
            }
        }
    }
}

/// Gives back device memory its owner keeps for reuse (e.g. evicted chunks' buffers), given the
/// bytes an allocation needs. See [`Device::add_reclaimer`].
pub type Reclaimer = dyn Fn(usize) + Send + Sync;

/// A device: the safe API over a [`Backend`]. Cheap to clone (it is an `Arc`).
#[derive(Clone)]
pub struct Device {
    inner: Arc<Inner>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl Device {
    /// Wraps a backend.
    pub fn new(backend: Box<dyn Backend>) -> Self {
        let id = backend.id();
        Device {
            inner: Arc::new(Inner {
                backend,
                id,
                clocks: Mutex::new(Clocks::default()),
                counters: Counters::default(),
                next_buffer: AtomicU64::new(1),
                detached: Mutex::new(Vec::new()),
                staging: Mutex::new(Vec::new()),
                reclaimers: Mutex::new(Vec::new()),
                profiler: phases::Profiler::default(),
            }),
        }
    }

    /// A simulated device.
    pub fn sim(config: SimConfig) -> Result<Self> {
        Ok(Self::new(Box::new(SimBackend::new(config)?)))
    }

    /// CUDA device `ordinal`; [`Error::BackendUnavailable`] when there is no driver or GPU.
    pub fn cuda(ordinal: usize) -> Result<Self> {
        Ok(Self::new(Box::new(CudaBackend::new(ordinal)?)))
    }

    /// The default device: chosen by `TIDEMEM_BACKEND` (`sim` or `cuda`) if set, otherwise CUDA
    /// device 0 when a GPU is present, else a simulated device of `TIDEMEM_SIM_CAPACITY` bytes
    /// (e.g. `2GiB`; default 1 GiB).
    pub fn default_device() -> Result<Self> {
        let choice = std::env::var("TIDEMEM_BACKEND").unwrap_or_default();
        let sim = || -> Result<Self> {
            let capacity = match std::env::var("TIDEMEM_SIM_CAPACITY") {
                Ok(s) => crate::units::parse_bytes(&s)?,
                Err(_) => 1 << 30,
            };
            Self::sim(SimConfig::with_capacity(capacity))
        };
        match choice.to_ascii_lowercase().as_str() {
            "sim" => sim(),
            "cuda" => Self::cuda(0),
            "" => Self::cuda(0).or_else(|_| sim()),
            other => Err(Error::Parse {
                what: "TIDEMEM_BACKEND",
                input: other.to_string(),
                expected: "`sim` or `cuda`".into(),
            }),
        }
    }

    /// This device's identity.
    pub fn id(&self) -> DeviceId {
        self.inner.id
    }

    /// The backend kind.
    pub fn kind(&self) -> BackendKind {
        self.inner.id.kind
    }

    /// Human-readable name.
    pub fn name(&self) -> String {
        self.inner.backend.name()
    }

    /// The backend (for kernels and backend-specific code).
    pub fn backend(&self) -> &dyn Backend {
        &*self.inner.backend
    }

    /// Whether this device checks and orders work without running it
    /// ([`SimConfig::timing_only`]): its results are meaningless, its host-side times are the
    /// program's own.
    pub fn timing_only(&self) -> bool {
        self.inner.backend.timing_only()
    }

    /// Free and total device memory.
    pub fn mem_info(&self) -> Result<MemInfo> {
        self.inner.backend.mem_info()
    }

    /// What the device has done so far (see [`DeviceStats`]).
    pub fn stats(&self) -> DeviceStats {
        self.inner.counters.read()
    }

    /// Starts (or restarts, from zero) the profile of where time goes (see [`Phase`]): from
    /// here on the stores mark their phases on the device's timeline and the host spans count.
    pub fn start_profile(&self) {
        self.inner.profiler.start();
    }

    /// Stops the profile and returns its totals ([`PhaseTimes::per_step`] divides them). It
    /// waits for the last mark to complete, a wait of the profile's own that the device's
    /// statistics do not count: call it after the measured steps.
    pub fn stop_profile(&self) -> Result<PhaseTimes> {
        self.inner.profiler.stop(&*self.inner.backend)
    }

    /// Whether the device is profiling.
    pub fn profiling(&self) -> bool {
        self.inner.profiler.on()
    }

    /// Marks, on `stream`, where `phase` begins on the device's timeline (nothing when the
    /// device is not profiling). The event it records orders nothing. Marks are meant for one
    /// stream (the compute stream the stores mark): an interval between marks on two streams
    /// is the time between their completions.
    pub fn mark_phase(&self, stream: &Stream, phase: Phase) -> Result<()> {
        if !self.inner.profiler.on() {
            return Ok(());
        }
        self.check("stream", stream.device)?;
        let backend = &*self.inner.backend;
        self.inner
            .profiler
            .mark(backend, phase, |ev| backend.record(&stream.raw, ev))
    }

    /// Times host work as `phase` until the span is dropped (nothing when the device is not
    /// profiling).
    pub fn host_span(&self, phase: HostPhase) -> HostSpan {
        HostSpan {
            open: self
                .inner
                .profiler
                .on()
                .then(|| (self.clone(), std::time::Instant::now())),
            phase,
        }
    }

    /// Allocates `bytes` of device memory (contents unspecified until written; the simulated
    /// device fills it with `0xff` bytes, so reading memory never written shows there too).
    /// Freed when the buffer is dropped, once work already enqueued on it completes.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        let raw = match self.inner.backend.alloc(bytes) {
            Err(Error::OutOfMemory { .. }) if self.reclaim(bytes) => {
                self.inner.backend.alloc(bytes)?
            }
            r => r?,
        };
        Counters::add(&self.inner.counters.device_allocs);
        Ok(DeviceBuffer {
            raw,
            len: bytes,
            device: self.inner.id,
            id: self.inner.next_buffer.fetch_add(1, Ordering::Relaxed),
            access: Mutex::new(AccessRecord::default()),
        })
    }

    /// Registers `reclaimer`, which an allocation that finds the device full runs (with the
    /// bytes it needs) before it tries once more: memory an owner keeps for reuse comes back
    /// to whoever needs it. Held weakly: dropping the last `Arc` unregisters it.
    pub fn add_reclaimer(&self, reclaimer: &Arc<Reclaimer>) {
        let mut r = self.inner.reclaimers.lock();
        r.retain(|w| w.strong_count() > 0);
        r.push(Arc::downgrade(reclaimer));
    }

    /// Runs the live reclaimers; whether there was one.
    fn reclaim(&self, bytes: usize) -> bool {
        let live: Vec<Arc<Reclaimer>> = {
            let mut r = self.inner.reclaimers.lock();
            r.retain(|w| w.strong_count() > 0);
            r.iter().filter_map(std::sync::Weak::upgrade).collect()
        };
        for f in &live {
            f(bytes);
        }
        !live.is_empty()
    }

    /// Allocates host memory suited to this device's copies: pinned on CUDA, paged on Sim.
    pub fn alloc_host(&self, bytes: usize) -> Result<HostBuffer> {
        self.inner.backend.alloc_host(bytes)
    }

    /// Creates a stream.
    pub fn new_stream(&self) -> Result<Stream> {
        let raw = self.inner.backend.new_stream()?;
        let slot = self.inner.clocks.lock().add_stream();
        Ok(Stream {
            raw,
            device: self.inner.id,
            slot,
        })
    }

    /// Creates an event (complete until first recorded).
    pub fn new_event(&self) -> Result<Event> {
        Ok(Event {
            raw: self.inner.backend.new_event()?,
            device: self.inner.id,
            clock: Mutex::new(Clock::new()),
        })
    }

    fn check(&self, what: &'static str, found: DeviceId) -> Result<()> {
        if found != self.inner.id {
            return Err(Error::WrongDevice {
                what,
                expected: self.inner.id,
                found,
            });
        }
        Ok(())
    }
    /// Records `event` on `stream`: it completes when all work enqueued on `stream` so far does.
    pub fn record(&self, stream: &Stream, event: &Event) -> Result<()> {
        self.check("stream", stream.device)?;
        self.check("event", event.device)?;
        let mut clocks = self.inner.clocks.lock();
        self.inner.backend.record(&stream.raw, &event.raw)?;
        clocks.stamp_plain(stream.slot);
        *event.clock.lock() = clocks.snapshot(stream.slot);
        Ok(())
    }

    /// Makes `stream` wait for the latest recording of `event` before running later work.
    pub fn wait_event(&self, stream: &Stream, event: &Event) -> Result<()> {
        self.check("stream", stream.device)?;
        self.check("event", event.device)?;
        let c = event.clock.lock().clone();
        self.wait_raw(stream, &event.raw, &c)
    }

    /// Makes `stream` wait for the latest recording of `event`, whose clock is `clock`.
    fn wait_raw(&self, stream: &Stream, event: &RawEvent, clock: &Clock) -> Result<()> {
        let mut clocks = self.inner.clocks.lock();
        self.inner.backend.wait(&stream.raw, event)?;
        clocks.stamp_plain(stream.slot);
        clocks.wait(stream.slot, clock);
        Ok(())
    }

    /// Blocks until the latest recording of `event` completes.
    pub fn sync_event(&self, event: &Event) -> Result<()> {
        self.check("event", event.device)?;
        let c = event.clock.lock().clone();
        if !self.inner.clocks.lock().observed(&c) {
            Counters::add(&self.inner.counters.event_syncs);
        }
        let _span = self.host_span(HostPhase::Waits);
        self.inner.backend.sync_event(&event.raw)?;
        self.inner.clocks.lock().observe(&c);
        Ok(())
    }

    /// Whether the latest recording of `event` has completed.
    pub fn event_done(&self, event: &Event) -> Result<bool> {
        self.check("event", event.device)?;
        let c = event.clock.lock().clone();
        let done = self.inner.backend.query_event(&event.raw)?;
        if done {
            // the host has seen it finish: a later wait for it does not block
            self.inner.clocks.lock().observe(&c);
        }
        Ok(done)
    }

    /// Blocks until every operation enqueued on `stream` so far completes.
    pub fn sync_stream(&self, stream: &Stream) -> Result<()> {
        self.check("stream", stream.device)?;
        let c = {
            let clocks = self.inner.clocks.lock();
            let c = clocks.snapshot(stream.slot);
            if !clocks.observed(&c) {
                Counters::add(&self.inner.counters.stream_syncs);
            }
            c
        };
        let _span = self.host_span(HostPhase::Waits);
        self.inner.backend.sync_stream(&stream.raw)?;
        self.inner.clocks.lock().observe(&c);
        Ok(())
    }

    /// Copies `data` to a new device buffer and waits for it (a convenience for tests and
    /// set-up code; the training path uses the asynchronous calls).
    pub fn upload(&self, stream: &Stream, data: &[u8]) -> Result<DeviceBuffer> {
        let buf = self.alloc(data.len())?;
        let mut host = self.alloc_host(data.len())?;
        host.copy_from_slice(data);
        self.copy_h2d(stream, host, &buf)?.wait()?;
        Ok(buf)
    }

    /// Copies a device range back to a new `Vec` and waits for it.
    pub fn download<'a>(&self, stream: &Stream, src: impl Into<Input<'a>>) -> Result<Vec<u8>> {
        let src = src.into();
        let host = self.alloc_host(src.len())?;
        Ok(self.copy_d2h(stream, src, host)?.wait()?.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn public_types_are_send_and_sync() {
        assert_send_sync::<Device>();
        assert_send_sync::<DeviceBuffer>();
        assert_send_sync::<DeviceView<'static>>();
        assert_send_sync::<Stream>();
        assert_send_sync::<Event>();
        assert_send_sync::<Pending<HostBuffer>>();
        assert_send_sync::<HostBuffer>();
        assert_send_sync::<FileStore>();
        assert_send_sync::<CachingAllocator>();
        assert_send_sync::<PoolBlock>();
        assert_send_sync::<SimBackend>();
        assert_send_sync::<CudaBackend>();
        assert_send_sync::<Error>();
    }

    #[test]
    fn an_upload_after_a_download_in_flight_waits_on_the_device() {
        let dev = Device::sim(SimConfig::with_capacity(1 << 16)).unwrap();
        let (copy, other) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
        let a = dev.upload(&copy, &[5u8; 64]).unwrap();
        let b = dev.alloc(64).unwrap();
        let before = dev.stats();
        let down = dev
            .copy_d2h(&copy, &a, HostBuffer::paged(64).unwrap())
            .unwrap();
        // up again from the same host buffer, on another stream, without the host waiting
        let up = dev.copy_h2d_after(&other, down, &b).unwrap();
        assert_eq!(dev.stats().since(&before).blocking_waits(), 0);
        assert!(up.wait().unwrap().iter().all(|&x| x == 5));
        assert_eq!(dev.download(&other, &b).unwrap(), vec![5u8; 64]);
        // a size mismatch is refused (the download it was handed is waited for)
        let down = dev
            .copy_d2h(&copy, &a, HostBuffer::paged(64).unwrap())
            .unwrap();
        let small = dev.alloc(32).unwrap();
        assert!(matches!(
            dev.copy_h2d_after(&copy, down, &small),
            Err(Error::SizeMismatch { src: 64, dst: 32 })
        ));
    }

    /// Uploads above this size are staged through paged memory (a quarter of the cap).
    const MAX_STAGING_FOR_TEST: usize = 16 << 20;

    #[test]
    fn uploads_reuse_their_staging_buffers() {
        let dev = Device::sim(SimConfig::with_capacity(64 << 20)).unwrap();
        let s = dev.new_stream().unwrap();
        let buf = dev.alloc(100).unwrap();
        let staged = |dev: &Device| dev.inner.detached.lock().last().map(|d| d.buf.as_ptr());
        dev.upload_to(&s, &[0; 100], &buf).unwrap();
        let first = staged(&dev);
        for i in 1..4u8 {
            dev.sync_stream(&s).unwrap();
            dev.upload_to(&s, &[i; 100], &buf).unwrap();
            // the finished upload's buffer came back and serves this one
            assert_eq!(staged(&dev), first, "upload {i}");
            assert_eq!(dev.inner.detached.lock().len(), 1);
        }
        assert_eq!(dev.download(&s, &buf).unwrap(), vec![3u8; 100]);
        // a large upload goes through paged memory it does not keep
        let big = dev.alloc(MAX_STAGING_FOR_TEST + 1).unwrap();
        dev.upload_to(&s, &vec![1u8; big.len()], &big).unwrap();
        dev.sync_stream(&s).unwrap();
        dev.upload_to(&s, &[5; 100], &buf).unwrap();
        assert!(dev
            .inner
            .staging
            .lock()
            .iter()
            .all(|b| b.len() <= MAX_STAGING_FOR_TEST));
    }

    #[test]
    fn partial_host_copies() {
        let dev = Device::sim(SimConfig::with_capacity(1 << 16)).unwrap();
        let s = dev.new_stream().unwrap();
        let buf = dev.alloc(8).unwrap();
        let host = HostBuffer::from_slice(&[9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9]).unwrap();
        let host = dev
            .copy_h2d_part(&s, host, 2, &buf)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(
            dev.download(&s, &buf).unwrap(),
            vec![1, 2, 3, 4, 5, 6, 7, 8]
        );
        let out = HostBuffer::paged(6).unwrap();
        let out = dev
            .copy_d2h_part(&s, buf.view(4, 4).unwrap(), out, 1)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(&out[..], &[0, 5, 6, 7, 8, 0]);
        assert!(matches!(
            dev.copy_h2d_part(&s, host, 5, &buf),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            dev.copy_d2h_part(&s, &buf, out, 1),
            Err(Error::OutOfBounds { .. })
        ));
        assert_eq!(dev.stats().h2d_bytes, 8);
        assert_eq!(dev.stats().d2h_bytes, 8 + 4);
    }
}
