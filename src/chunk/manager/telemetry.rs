//! What the manager tells about itself: the event log, tide samples, move statistics and the
//! bytes on every tier.

use serde::Serialize;
use serde_json::json;

use super::{ChunkManager, HostSlot};
use crate::error::{Error, Result};
use crate::profile::{ChromeTrace, TidePoint, Track};
use crate::tide::{MoveStats, Scheduler, Sizing, Trace};

/// Chunk bytes per kind (index [`ChunkKind::index`](crate::tensor::ChunkKind::index)) on each
/// tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Device bytes.
    pub device: [u64; 4],
    /// Host memory bytes.
    pub host: [u64; 4],
    /// File-tier bytes.
    pub file: [u64; 4],
}

impl Usage {
    /// Total over kinds for one tier.
    pub fn total(tier: &[u64; 4]) -> u64 {
        tier.iter().sum()
    }
}

/// What an entry of the manager's event log records. Serialized (and named by
/// [`LogKind::name`]) in kebab case: `moment`, `fetch`, `optimizer`, `materialize`, `load`,
/// `prefetch`, `write-back`, `drop`, `free-host`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogKind {
    /// A moment opened (`n` is its index).
    Moment,
    /// A fetch of `n` tensors for forward or backward (its duration covers the moves it made).
    Fetch,
    /// The optimizer pass over group `n`.
    Optimizer,
    /// Chunk `n` got its first payload, on the host.
    Materialize,
    /// Chunk `n` loaded to the device on demand.
    Load,
    /// Chunk `n` loaded to the device ahead of its use.
    Prefetch,
    /// Chunk `n`'s device copy written back to the host.
    WriteBack,
    /// Chunk `n`'s device copy dropped.
    Drop,
    /// Chunk `n`'s host copy freed.
    FreeHost,
}

impl LogKind {
    /// Every kind.
    pub const ALL: [LogKind; 9] = [
        LogKind::Moment,
        LogKind::Fetch,
        LogKind::Optimizer,
        LogKind::Materialize,
        LogKind::Load,
        LogKind::Prefetch,
        LogKind::WriteBack,
        LogKind::Drop,
        LogKind::FreeHost,
    ];

    /// The kebab-case name (as serialized).
    pub fn name(self) -> &'static str {
        match self {
            LogKind::Moment => "moment",
            LogKind::Fetch => "fetch",
            LogKind::Optimizer => "optimizer",
            LogKind::Materialize => "materialize",
            LogKind::Load => "load",
            LogKind::Prefetch => "prefetch",
            LogKind::WriteBack => "write-back",
            LogKind::Drop => "drop",
            LogKind::FreeHost => "free-host",
        }
    }
}

impl std::fmt::Display for LogKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One entry of the manager's event log (for Chrome traces).
#[derive(Clone, Debug, Serialize)]
pub struct LogEntry {
    /// Microseconds since the manager was created.
    pub(crate) t_us: f64,
    /// Duration in microseconds (0 for instants).
    pub(crate) dur_us: f64,
    /// What happened.
    pub what: LogKind,
    /// Chunk number, or the moment index for `moment`.
    pub n: u64,
    /// Bytes involved.
    pub bytes: u64,
    /// Chunk bytes on the device after it, and the budget at the moment.
    pub(crate) device_chunks: u64,
    /// Budget at the moment.
    pub budget: u64,
}

/// Device memory at one moment of the last complete iteration (for the tide plot).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct TideSample {
    /// Non-model bytes (peak over the moment).
    pub non_model: u64,
    /// Chunk bytes on the device.
    pub chunks: u64,
    /// Chunk budget (`None` during warm-up).
    pub budget: Option<u64>,
}

impl ChunkManager {
    /// Starts logging moments and moves (see [`ChunkManager::log`]).
    pub fn enable_log(&mut self) {
        self.log = Some(Vec::new());
    }

    /// The event log (empty unless [`ChunkManager::enable_log`] was called).
    pub fn log(&self) -> &[LogEntry] {
        self.log.as_deref().unwrap_or(&[])
    }

    pub(super) fn now_us(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1e6
    }

    pub(super) fn note(&mut self, what: LogKind, n: u64, bytes: u64, t0: f64) {
        if self.log.is_some() {
            let t = self.now_us();
            let (dc, b) = self
                .sched
                .as_ref()
                .map_or((0, 0), |s| (s.device_used(), s.budget()));
            if let Some(l) = self.log.as_mut() {
                l.push(LogEntry {
                    t_us: t0,
                    dur_us: t - t0,
                    what,
                    n,
                    bytes,
                    device_chunks: dc,
                    budget: b,
                });
            }
        }
    }

    pub(super) fn sample(&mut self) {
        let s = self.sched.as_ref().expect("scheduler");
        let budget = s.trace().map(|_| s.budget());
        let chunks = s.device_used();
        // read when the moment opened: nothing allocates non-model memory within a moment
        let non_model = self.non_model_now;
        self.samples.push(TideSample {
            non_model,
            chunks,
            budget,
        });
    }

    /// The highest non-model device memory seen at any moment of this iteration or the last
    /// complete one (0 without a non-model allocator).
    pub fn non_model_peak(&self) -> u64 {
        self.samples
            .iter()
            .chain(&self.last_samples)
            .map(|s| s.non_model)
            .max()
            .unwrap_or(0)
            .max(
                self.non_model
                    .as_ref()
                    .map_or(0, |p| p.stats().peak_allocated as u64),
            )
    }

    /// Iterations completed (`end_step` or `skip_step` calls; the demo model's step count).
    #[cfg(feature = "demo")]
    pub(crate) fn iterations_done(&self) -> u64 {
        self.iterations
    }

    /// Whether warm-up is over (a trace is installed).
    pub fn is_steady(&self) -> bool {
        !self.warm
    }

    /// The installed trace.
    pub fn trace(&self) -> Option<&Trace> {
        self.sched.as_ref().and_then(|s| s.trace())
    }

    /// What this model needs of a device ([`Sizing`]: the non-model peak, the largest single
    /// moment, the smallest device under a policy), from the trace of the warm-up iteration.
    /// Run one iteration on a device with room for everything and end it with
    /// [`ChunkManager::end_step`] (a skipped step discards the trace) first.
    ///
    /// ```
    /// use tidemem::chunk::{ChunkManager, ManagerConfig};
    /// use tidemem::device::{CachingAllocator, Device, SimConfig};
    /// use tidemem::tensor::{Init, Stage};
    /// use tidemem::tide::Policy;
    /// # fn main() -> tidemem::Result<()> {
    /// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
    /// let mut m = ChunkManager::new(dev.clone(), ManagerConfig::new(1024, Policy::Tide))?;
    /// m.set_non_model_allocator(CachingAllocator::new(dev));
    /// let big = m.register("big", &[3000], Init::Zeros)?; // a chunk of its own
    /// let small = m.register("small", &[10], Init::Zeros)?;
    /// m.fetch(&[big, small], Stage::Forward)?;
    /// m.release(&[big, small], Stage::Forward)?;
    /// m.end_forward()?;
    /// m.fetch(&[big, small], Stage::Backward)?;
    /// m.write_grad(big, &[0.0; 3000])?;
    /// m.write_grad(small, &[0.0; 10])?;
    /// m.release(&[big, small], Stage::Backward)?;
    /// m.end_backward()?;
    /// m.step_host(|_| Ok(()))?; // the optimizer's visits belong to the iteration too
    /// m.end_step()?;
    /// let s = m.sizing()?;
    /// // both chunks at once (fp16: 6,000 and 2,048 bytes)
    /// assert_eq!(s.largest_moment(), 8048);
    /// # Ok(()) }
    /// ```
    pub fn sizing(&self) -> Result<Sizing> {
        self.sizing_now()
    }

    /// What a model needs of a device, measured: registers it on `dev` (a device with room for
    /// all of it, e.g. a simulated one of 1 TiB, whose memory is touched only as used) with
    /// `build`, runs one whole `iteration` (forward, backward and the optimizer's step, ended
    /// by it) with every chunk welcome on the device, and returns the [`Sizing`] of the
    /// recorded iteration: the non-model peak, the largest single moment, the smallest device
    /// that trains ([`Sizing::smallest_device`]) and a device for a share of the chunks
    /// ([`Sizing::device_for`]). `cfg` is the configuration the model will train with (its
    /// chunk size and dtypes; the scheduler's capacity and fractions are the probe's).
    ///
    /// ```
    /// use tidemem::nn::{Act, Linear};
    /// use tidemem::prelude::*;
    ///
    /// # fn main() -> tidemem::Result<()> {
    /// let roomy = Device::sim(SimConfig::with_capacity(1 << 40))?;
    /// let mut cfg = ManagerConfig::new(1 << 12, Policy::Tide);
    /// cfg.param_dtype = DType::F32;
    /// let sizing = ChunkManager::probe(
    ///     roomy,
    ///     cfg,
    ///     |m| Linear::register(m, "fc", 64, 64, true, None),
    ///     |m, fc| {
    ///         let fwd = m.forward()?;
    ///         let x = Act::upload(fwd.pool(), fwd.stream(), 8, 64, DType::F32, &[0.5; 512])?;
    ///         let y = fc.forward(&fwd, &x)?;
    ///         fwd.finish()?;
    ///         let bwd = m.backward()?;
    ///         fc.backward(&bwd, &x, &y, false)?;
    ///         bwd.finish()?;
    ///         m.step(&mut HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-3)))?)?;
    ///         Ok(())
    ///     },
    /// )?;
    /// assert!(sizing.model_data_bytes() >= 4 * 65 * 64); // the f32 parameters at least
    /// let least = sizing.smallest_device(Policy::Tide, |c| sizing.config_for(c))?;
    /// assert!(least >= sizing.largest_moment());
    /// # Ok(()) }
    /// ```
    pub fn probe<M>(
        dev: crate::device::Device,
        mut cfg: super::ManagerConfig,
        build: impl FnOnce(&mut ChunkManager) -> Result<M>,
        iteration: impl FnOnce(&mut ChunkManager, &M) -> Result<()>,
    ) -> Result<Sizing> {
        cfg.scheduler.capacity = dev.mem_info()?.total as u64;
        cfg.scheduler.overall_fraction = 1.0;
        cfg.scheduler.warmup_chunk_fraction = 1.0;
        let mut m = ChunkManager::new(dev.clone(), cfg)?;
        m.set_non_model_allocator(crate::device::CachingAllocator::new(dev));
        let model = build(&mut m)?;
        iteration(&mut m, &model)?;
        m.sizing()
    }

    fn sizing_now(&self) -> Result<Sizing> {
        let s = self.sched.as_ref();
        match (s, s.and_then(|s| s.trace())) {
            (Some(s), Some(t)) => Sizing::new(t.clone(), s.chunks().to_vec()),
            _ => Err(Error::OutOfOrder {
                call: "sizing",
                needs: "a complete warm-up iteration (ended by end_step)",
            }),
        }
    }

    /// Moves ordered since the manager was created.
    pub fn stats(&self) -> MoveStats {
        self.sched
            .as_ref()
            .map_or_else(MoveStats::default, |s| s.stats())
    }

    /// Moves of the last complete iteration.
    pub fn last_iteration(&self) -> MoveStats {
        self.last_iter
    }

    /// Device memory at every moment of the last complete iteration.
    pub(crate) fn tide_samples(&self) -> &[TideSample] {
        &self.last_samples
    }

    /// The scheduler (after the first fetch).
    pub fn scheduler(&self) -> Option<&Scheduler> {
        self.sched.as_ref()
    }

    /// Exact chunk bytes per kind on every tier, from the payloads that exist.
    pub fn usage(&self) -> Usage {
        let mut u = Usage::default();
        for (c, p) in self.payload.iter().enumerate() {
            let k = c % 4;
            let b = self.chunk_bytes(c) as u64;
            if p.device.is_some() {
                u.device[k] += b;
            }
            if !matches!(p.host, HostSlot::None) {
                if self.file_tier[c] {
                    u.file[k] += b;
                } else {
                    u.host[k] += b;
                }
            }
        }
        u
    }
}

impl ChunkManager {
    /// The log ([`ChunkManager::enable_log`]) as a Chrome trace (open it in Perfetto): moments,
    /// fetches and optimizer visits, copies, evictions, and the device's chunk bytes against
    /// the budget as a counter.
    pub fn chrome_trace(&self) -> ChromeTrace {
        let mut t = ChromeTrace::new();
        let (moments, fetches, copies, evictions) = (Track(1), Track(2), Track(3), Track(4));
        t.name_track(moments, "moments");
        t.name_track(fetches, "fetch / optimizer");
        t.name_track(copies, "copies (enqueue)");
        t.name_track(evictions, "evictions");
        for e in self.log() {
            let args = json!({ "n": e.n, "bytes": e.bytes, "device_chunks": e.device_chunks, "budget": e.budget });
            let name = e.what.name();
            match e.what {
                LogKind::Moment => {
                    t.instant(&format!("moment {}", e.n), "moment", moments, e.t_us, args);
                    t.counter(
                        "device chunk bytes",
                        e.t_us,
                        &[
                            ("chunks", e.device_chunks as f64),
                            ("budget", e.budget as f64),
                        ],
                    );
                }
                LogKind::Fetch | LogKind::Optimizer => {
                    t.complete(name, "fetch", fetches, e.t_us, e.dur_us, args)
                }
                LogKind::Load | LogKind::Prefetch | LogKind::WriteBack => t.complete(
                    &format!("{name} chunk {}", e.n),
                    "copy",
                    copies,
                    e.t_us,
                    e.dur_us,
                    args,
                ),
                LogKind::Drop | LogKind::FreeHost => t.instant(
                    &format!("{name} chunk {}", e.n),
                    "evict",
                    evictions,
                    e.t_us,
                    args,
                ),
                LogKind::Materialize => t.instant(name, "other", evictions, e.t_us, args),
            }
        }
        t
    }

    /// Device memory at every moment of the last complete iteration, as the tide plot draws
    /// it ([`crate::profile::write_tide_svg`]).
    pub fn tide_points(&self) -> Vec<TidePoint> {
        self.tide_samples()
            .iter()
            .map(|s| TidePoint {
                non_model: s.non_model,
                chunks: s.chunks,
                budget: s.budget,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_kinds_serialize_as_their_names() {
        for k in LogKind::ALL {
            assert_eq!(serde_json::to_value(k).unwrap(), k.name());
            assert_eq!(k.to_string(), k.name());
        }
        assert_eq!(LogKind::WriteBack.name(), "write-back");
        assert_eq!(LogKind::FreeHost.name(), "free-host");
    }
}
