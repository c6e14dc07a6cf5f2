//! Where a step's time goes: phases on the device's timeline, spans on the host.
//!
//! While a device profiles ([`Device::start_profile`]), the stores mark where each phase of an
//! iteration begins on their compute stream ([`Device::mark_phase`]: forward at the first
//! fetch, backward at the end of forward, the optimizer at the end of backward, and
//! [`Phase::Between`] once the step ends), with events that carry the device's time (CUDA's
//! timing events; the completion time on a simulated device's engine). The time from one mark
//! to the next belongs to the earlier mark's phase, so the device phases add up to the device's
//! timeline, idle gaps included: a device waiting for its host shows there. The host measures
//! its own spans by wall clock ([`Device::host_span`]): a trainer's wait for data, the
//! optimizer's host groups, the chunk manager's moves, the cached embedding's preparation, and
//! the device's blocking waits (counted by the device itself).
//!
//! When the device does not profile, a mark or a span costs one atomic load.
//!
//! ```
//! use tidemem::device::{Device, HostPhase, Phase, SimConfig};
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let s = dev.new_stream()?;
//! dev.start_profile();
//! dev.mark_phase(&s, Phase::Forward)?;
//! {
//!     let _data = dev.host_span(HostPhase::Data); // timed until dropped
//! }
//! dev.mark_phase(&s, Phase::Between)?;
//! let t = dev.stop_profile()?;
//! assert!(t.forward >= 0.0 && t.data >= 0.0);
//! assert_eq!(t.backward, 0.0);
//! # Ok(()) }
//! ```

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use super::backend::{Backend, RawEvent};
use crate::error::Result;

/// A phase of an iteration on the device's timeline, from its mark to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// From a forward pass's first fetch to the end of forward.
    Forward,
    /// From the end of forward to the end of backward.
    Backward,
    /// From the end of backward to the end of the step (the optimizer's device work).
    Optimizer,
    /// From the end of a step to the next forward: batch uploads, work outside the passes, and
    /// the device idle while the host prepares.
    Between,
}

/// A span of host wall time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostPhase {
    /// A trainer waiting for its next batch.
    Data,
    /// The optimizer stepping its host groups.
    Optimizer,
    /// The chunk manager deciding and issuing chunk moves (a move that waits for memory
    /// included).
    ChunkMoves,
    /// Blocking waits for the device ([`super::DeviceStats::blocking_waits`]).
    Waits,
    /// The cached embedding preparing a batch (decisions, row moves, the backward plan).
    Embedding,
}

/// Seconds spent in each phase: device phases on the device's timeline (they add up to it),
/// host spans in wall time (they may overlap the device's phases and each other: a blocking wait
/// inside the optimizer's host step counts in both).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PhaseTimes {
    /// Device: forward.
    pub forward: f64,
    /// Device: backward.
    pub backward: f64,
    /// Device: the optimizer.
    pub optimizer: f64,
    /// Device: between steps.
    pub(crate) between: f64,
    /// Host: waiting for data.
    pub data: f64,
    /// Host: the optimizer's host groups.
    pub host_optimizer: f64,
    /// Host: chunk moves.
    pub(crate) chunk_moves: f64,
    /// Host: blocking waits.
    pub host_waits: f64,
    /// Host: the cached embedding's preparation.
    pub embedding: f64,
}

impl PhaseTimes {
    /// Every time divided by `steps` (unchanged for 0).
    pub fn per_step(&self, steps: usize) -> PhaseTimes {
        let k = if steps == 0 { 1.0 } else { 1.0 / steps as f64 };
        let mut t = *self;
        for (_, _, v) in t.fields_mut() {
            *v *= k;
        }
        t
    }

    /// The device's timeline: the sum of the device phases.
    pub fn device_total(&self) -> f64 {
        self.forward + self.backward + self.optimizer + self.between
    }

    /// `(name, where it is measured, seconds)` for each phase, device phases first: the rows of a
    /// profile table.
    pub fn rows(&self) -> Vec<(&'static str, &'static str, f64)> {
        let mut t = *self;
        t.fields_mut()
            .into_iter()
            .map(|(n, w, v)| (n, w, *v))
            .collect()
    }

    fn fields_mut(&mut self) -> [(&'static str, &'static str, &mut f64); 9] {
        [
            ("forward", "device", &mut self.forward),
            ("backward", "device", &mut self.backward),
            ("optimizer", "device", &mut self.optimizer),
            ("between steps", "device", &mut self.between),
            ("data", "host", &mut self.data),
            ("host optimizer", "host", &mut self.host_optimizer),
            ("chunk moves", "host", &mut self.chunk_moves),
            ("blocking waits", "host", &mut self.host_waits),
            ("embedding preparation", "host", &mut self.embedding),
        ]
    }

    fn host_mut(&mut self, p: HostPhase) -> &mut f64 {
        match p {
            HostPhase::Data => &mut self.data,
            HostPhase::Optimizer => &mut self.host_optimizer,
            HostPhase::ChunkMoves => &mut self.chunk_moves,
            HostPhase::Waits => &mut self.host_waits,
            HostPhase::Embedding => &mut self.embedding,
        }
    }

    fn device_mut(&mut self, p: Phase) -> &mut f64 {
        match p {
            Phase::Forward => &mut self.forward,
            Phase::Backward => &mut self.backward,
            Phase::Optimizer => &mut self.optimizer,
            Phase::Between => &mut self.between,
        }
    }
}

/// A table of the phases in milliseconds, device phases with their share of the device's
/// timeline.
impl std::fmt::Display for PhaseTimes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let total = self.device_total();
        writeln!(
            f,
            "{:<22} {:>6} {:>10} {:>7}",
            "phase", "where", "ms", "share"
        )?;
        for (name, place, v) in self.rows() {
            let share = if place == "device" && total > 0.0 {
                format!("{:.1}%", 100.0 * v / total)
            } else {
                String::new()
            };
            writeln!(f, "{name:<22} {place:>6} {:>10.3} {share:>7}", v * 1e3)?;
        }
        write!(
            f,
            "{:<22} {:>6} {:>10.3}",
            "device timeline",
            "device",
            total * 1e3
        )
    }
}

/// A device's profile: on or off, the marks whose intervals are not yet known, the totals.
#[derive(Default)]
pub(super) struct Profiler {
    on: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Marks in recording order; the front one's interval ends at the next.
    marks: VecDeque<(Phase, RawEvent)>,
    /// Timing events whose intervals are counted, for reuse.
    spare: Vec<RawEvent>,
    times: PhaseTimes,
}

impl Profiler {
    pub(super) fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub(super) fn start(&self) {
        let mut s = self.state.lock();
        let marks: Vec<_> = s.marks.drain(..).map(|(_, e)| e).collect();
        s.spare.extend(marks);
        s.times = PhaseTimes::default();
        self.on.store(true, Ordering::Relaxed);
    }

    /// Records a mark of `phase` with `record` (which records the event on the stream).
    pub(super) fn mark(
        &self,
        backend: &dyn Backend,
        phase: Phase,
        record: impl FnOnce(&RawEvent) -> Result<()>,
    ) -> Result<()> {
        let mut s = self.state.lock();
        let ev = match s.spare.pop() {
            Some(e) => e,
            None => backend.new_timing_event()?,
        };
        record(&ev)?;
        s.marks.push_back((phase, ev));
        s.resolve(backend, false)
    }

    pub(super) fn add_host(&self, phase: HostPhase, seconds: f64) {
        *self.state.lock().times.host_mut(phase) += seconds;
    }

    /// Stops profiling and returns the totals, waiting for the last mark (a wait of the
    /// profile's own, not counted in the device's statistics).
    pub(super) fn stop(&self, backend: &dyn Backend) -> Result<PhaseTimes> {
        self.on.store(false, Ordering::Relaxed);
        let mut s = self.state.lock();
        if let Some((_, last)) = s.marks.back() {
            backend.sync_event(last)?;
        }
        s.resolve(backend, true)?;
        let t = s.times;
        let marks: Vec<_> = s.marks.drain(..).map(|(_, e)| e).collect();
        s.spare.extend(marks);
        Ok(t)
    }
}

impl State {
    /// Counts the interval of every mark whose successor has completed (all of them when
    /// `all`, the last one being complete).
    fn resolve(&mut self, backend: &dyn Backend, all: bool) -> Result<()> {
        while self.marks.len() >= 2 {
            let (start, end) = (&self.marks[0].1, &self.marks[1].1);
            let done = all || (backend.query_event(end)? && backend.query_event(start)?);
            if !done {
                break;
            }
            let (phase, start) = self.marks.pop_front().expect("two marks");
            let end = &self.marks[0].1;
            if let Some(dt) = backend.elapsed(&start, end)? {
                *self.times.device_mut(phase) += dt;
            }
            self.spare.push(start);
        }
        Ok(())
    }
}

/// A span of host time, added to its [`HostPhase`] when dropped (nothing when the device was not
/// profiling at its start).
#[must_use = "a span measures until it is dropped"]
pub struct HostSpan {
    pub(super) open: Option<(super::Device, Instant)>,
    pub(super) phase: HostPhase,
}

impl Drop for HostSpan {
    fn drop(&mut self) {
        if let Some((d, t0)) = self.open.take() {
            d.inner
                .profiler
                .add_host(self.phase, t0.elapsed().as_secs_f64());
        }
    }
}
