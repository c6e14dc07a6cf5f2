//! Placement and eviction as pure decision logic.
//!
//! The [`Scheduler`] keeps a model of where every chunk's payload is (device, host, both) and
//! whether the device copy is dirty, and answers each moment's accesses with the [`Move`]s that make
//! them possible. It never touches memory: the chunk manager carries the moves out with real copies,
//! and the simulator only adds up their bytes, so both run the very same decisions.

use serde::Serialize;

use super::trace::{Access, ChunkDesc, ChunkNo, Target, Trace, UseIndex};
use crate::error::{Error, Result};
use crate::tensor::ChunkKind;

/// Moments the prefetcher looks ahead at most.
const PREFETCH_WINDOW: usize = 16;

/// Eviction and placement policy.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Policy {
    /// Ours: evict the chunk used farthest in the future; keep the host copy of a chunk while it is
    /// on the device and track dirtiness, so evicting a clean chunk moves no byte; prefetch the next
    /// chunks of the trace within the budget.
    Tide,
    /// PatrickStar: farthest next use, move semantics (a chunk lives in one place, every eviction
    /// copies it back), no prefetch.
    PatrickStar,
    /// Least recently used victim, host copies kept (isolates the victim choice).
    Lru,
    /// Gemini-style static placement: the first `device_fraction` of parameter chunks stay on the
    /// device once loaded; every other chunk is moved back to the host as soon as it is released.
    /// `device_fraction = 0` is the all-host policy of ZeRO-Offload.
    Static {
        /// Fraction of parameter chunks kept on the device.
        device_fraction: f64,
    },
}

impl Policy {
    /// Name used in reports (`tide`, `patrickstar`, `lru`, `static-0.50`).
    pub fn name(&self) -> String {
        match self {
            Policy::Tide => "tide".into(),
            Policy::PatrickStar => "patrickstar".into(),
            Policy::Lru => "lru".into(),
            Policy::Static { device_fraction } => format!("static-{device_fraction:.2}"),
        }
    }

    /// Parses `tide`, `patrickstar`, `lru`, `static:F` (or `static` for all-host).
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        Ok(match s.as_str() {
            "tide" => Policy::Tide,
            "patrickstar" | "ps" => Policy::PatrickStar,
            "lru" => Policy::Lru,
            "static" | "all-host" | "zero-offload" => Policy::Static {
                device_fraction: 0.0,
            },
            _ => match s
                .strip_prefix("static:")
                .or_else(|| s.strip_prefix("static-"))
            {
                Some(f) => {
                    let device_fraction: f64 = f.parse().map_err(|_| Error::Parse {
                        what: "static fraction",
                        input: f.to_string(),
                        expected: "a number in [0, 1]".into(),
                    })?;
                    if !(0.0..=1.0).contains(&device_fraction) {
                        return Err(Error::BadValue {
                            what: "the static fraction".into(),
                            value: device_fraction,
                            want: "in [0, 1]",
                        });
                    }
                    Policy::Static { device_fraction }
                }
                None => {
                    return Err(Error::Parse {
                        what: "policy",
                        input: s,
                        expected: "tide, patrickstar (ps), lru, static (all-host, zero-offload) \
                                   or static:F with F in [0, 1]"
                            .into(),
                    })
                }
            },
        })
    }

    /// The four policies compared in reports, with all-host as the static one.
    pub fn all() -> Vec<Policy> {
        vec![
            Policy::Tide,
            Policy::PatrickStar,
            Policy::Lru,
            Policy::Static {
                device_fraction: 0.0,
            },
        ]
    }

    /// Whether a chunk keeps its host copy while on the device.
    pub(crate) fn keeps_host_copy(&self) -> bool {
        matches!(self, Policy::Tide | Policy::Lru)
    }
}

/// Device and host sizes the scheduler plans for.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct SchedulerConfig {
    /// Device bytes (chunks + non-model data).
    pub capacity: u64,
    /// Share of `capacity` the scheduler plans with (the rest absorbs fragmentation).
    pub overall_fraction: f64,
    /// During warm-up, when the tide is not yet known: share of the planned bytes given to chunks.
    pub warmup_chunk_fraction: f64,
    /// Bytes kept free at every moment on top of the non-model peak (e.g. gather buffers).
    pub reserve: u64,
    /// Most chunks loaded ahead of their use and not yet used.
    pub max_prefetch: usize,
}

impl SchedulerConfig {
    /// Defaults for a device of `capacity` bytes: plan with 90 %, give chunks half of it during
    /// warm-up, no reserve, two prefetches in flight.
    pub fn new(capacity: u64) -> Self {
        SchedulerConfig {
            capacity,
            overall_fraction: 0.9,
            warmup_chunk_fraction: 0.5,
            reserve: 0,
            max_prefetch: 2,
        }
    }

    fn overall(&self) -> u64 {
        (self.capacity as f64 * self.overall_fraction) as u64
    }
}

/// One action the scheduler orders, in the order it must be carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Move {
    /// Give the chunk its first payload, on the host, with its tensors' initial values.
    Materialize {
        /// Chunk.
        chunk: ChunkNo,
    },
    /// Copy the host payload to a new device copy.
    Load {
        /// Chunk.
        chunk: ChunkNo,
        /// Loaded ahead of its use.
        prefetch: bool,
    },
    /// Copy the device payload back to the host (allocating the host copy if it was freed).
    WriteBack {
        /// Chunk.
        chunk: ChunkNo,
    },
    /// Free the device copy (after any write-back ordered before it).
    Drop {
        /// Chunk.
        chunk: ChunkNo,
    },
    /// Free the host copy (move semantics, after a load).
    FreeHost {
        /// Chunk.
        chunk: ChunkNo,
    },
}

/// Bytes and counts of the moves ordered so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MoveStats {
    /// Host→device bytes.
    pub h2d_bytes: u64,
    /// Device→host bytes.
    pub d2h_bytes: u64,
    /// Loads (demand and prefetch).
    pub loads: u64,
    /// Loads issued ahead of use.
    pub prefetches: u64,
    /// Write-backs.
    pub write_backs: u64,
    /// Of the write-backs, those made ahead of an eviction
    /// (the overlapped step's, as a host group's gradients come down): the chunk stays on the device, and its eviction later
    /// is a clean drop.
    pub early_write_backs: u64,
    /// Device copies dropped without a transfer (clean).
    pub clean_drops: u64,
    /// Chunks materialized.
    pub materialized: u64,
}

impl MoveStats {
    /// Component-wise difference `self - earlier` (0 where `earlier` is the larger).
    pub fn since(&self, earlier: &MoveStats) -> MoveStats {
        MoveStats {
            h2d_bytes: self.h2d_bytes.saturating_sub(earlier.h2d_bytes),
            d2h_bytes: self.d2h_bytes.saturating_sub(earlier.d2h_bytes),
            loads: self.loads.saturating_sub(earlier.loads),
            prefetches: self.prefetches.saturating_sub(earlier.prefetches),
            write_backs: self.write_backs.saturating_sub(earlier.write_backs),
            early_write_backs: self
                .early_write_backs
                .saturating_sub(earlier.early_write_backs),
            clean_drops: self.clean_drops.saturating_sub(earlier.clean_drops),
            materialized: self.materialized.saturating_sub(earlier.materialized),
        }
    }
}

/// Where a chunk's payload is, as the scheduler models it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ChunkStatus {
    /// Has a payload somewhere (not RELEASED).
    pub materialized: bool,
    /// A device copy exists (and is current: stale device copies are dropped at once).
    pub(crate) on_device: bool,
    /// Host memory is allocated for the chunk.
    pub(crate) host_alloc: bool,
    /// The host copy is current.
    pub(crate) host_valid: bool,
    /// Accesses in progress (tensors in COMPUTE): the chunk may not move.
    pub in_use: u32,
    /// Pinned by the caller (e.g. during a collective): may not move.
    pub pinned: bool,
    /// Loaded ahead of use and not used since.
    pub prefetched: bool,
}

impl ChunkStatus {
    /// The device copy is newer than the host copy.
    pub(crate) fn dirty(&self) -> bool {
        self.on_device && !self.host_valid
    }
}

/// The placement state machine shared by the chunk manager and the simulator.
#[derive(Debug)]
pub struct Scheduler {
    policy: Policy,
    cfg: SchedulerConfig,
    chunks: Vec<ChunkDesc>,
    st: Vec<ChunkStatus>,
    last_use: Vec<u64>,
    resident: Vec<bool>,
    trace: Option<Trace>,
    index: UseIndex,
    moment: Option<usize>,
    clock: u64,
    device_used: u64,
    device_peak: u64,
    host_used: u64,
    host_peak: u64,
    stats: MoveStats,
}

impl Scheduler {
    /// A scheduler for `chunks` under `policy`.
    pub fn new(policy: Policy, cfg: SchedulerConfig, chunks: Vec<ChunkDesc>) -> Result<Self> {
        if !(cfg.overall_fraction > 0.0 && cfg.overall_fraction <= 1.0) {
            return Err(Error::BadValue {
                what: "the overall fraction".into(),
                value: cfg.overall_fraction,
                want: "in (0, 1]",
            });
        }
        if !(cfg.warmup_chunk_fraction > 0.0 && cfg.warmup_chunk_fraction <= 1.0) {
            return Err(Error::BadValue {
                what: "the warm-up chunk fraction".into(),
                value: cfg.warmup_chunk_fraction,
                want: "in (0, 1]",
            });
        }
        let n = chunks.len();
        let mut resident = vec![false; n];
        if let Policy::Static { device_fraction } = policy {
            let params: Vec<usize> = (0..n)
                .filter(|&i| chunks[i].kind == ChunkKind::Param)
                .collect();
            let keep = (device_fraction * params.len() as f64).ceil() as usize;
            for &i in params.iter().take(keep) {
                resident[i] = true;
            }
        }
        Ok(Scheduler {
            policy,
            cfg,
            st: vec![ChunkStatus::default(); n],
            last_use: vec![0; n],
            resident,
            chunks,
            trace: None,
            index: UseIndex::default(),
            moment: None,
            clock: 0,
            device_used: 0,
            device_peak: 0,
            host_used: 0,
            host_peak: 0,
            stats: MoveStats::default(),
        })
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The chunks.
    pub fn chunks(&self) -> &[ChunkDesc] {
        &self.chunks
    }

    /// Status of one chunk.
    pub(crate) fn status(&self, chunk: ChunkNo) -> Option<ChunkStatus> {
        self.st.get(chunk as usize).copied()
    }

    /// Chunk bytes on the device.
    pub fn device_used(&self) -> u64 {
        self.device_used
    }

    /// Largest `device_used` so far.
    pub fn device_peak(&self) -> u64 {
        self.device_peak
    }

    /// Chunk bytes allocated on the host (host and file tiers together).
    pub fn host_used(&self) -> u64 {
        self.host_used
    }

    /// Largest `host_used` so far.
    pub fn host_peak(&self) -> u64 {
        self.host_peak
    }

    /// Moves ordered so far.
    pub fn stats(&self) -> MoveStats {
        self.stats
    }

    /// The installed steady-state trace, if warm-up is over.
    pub fn trace(&self) -> Option<&Trace> {
        self.trace.as_ref()
    }

    /// Current moment of the iteration (`None` before the first tick).
    pub fn moment(&self) -> Option<usize> {
        self.moment
    }

    /// Installs the trace of a complete warm-up iteration: from now on budgets follow the tide and
    /// victims are chosen by next use.
    pub fn install_trace(&mut self, trace: Trace) {
        self.index = trace.index(self.chunks.len());
        self.trace = Some(trace);
    }

    /// Drops the installed trace: warm-up's budgets and victims again, until the next trace is
    /// installed (an iteration unlike the ones to come was recorded).
    pub(crate) fn forget_trace(&mut self) {
        self.trace = None;
        self.index = UseIndex::default();
    }

    /// Starts a new iteration: the next tick is moment 0.
    pub fn start_iteration(&mut self) {
        self.moment = None;
    }

    /// Opens the next moment and returns its index.
    pub fn tick(&mut self) -> usize {
        let m = self.moment.map_or(0, |m| m + 1);
        self.moment = Some(m);
        m
    }

    /// Device bytes chunks may use at moment `m`.
    pub(crate) fn budget_at(&self, m: usize) -> u64 {
        let overall = self.cfg.overall();
        match &self.trace {
            Some(t) => overall
                .saturating_sub(t.reserve_at(m))
                .saturating_sub(self.cfg.reserve),
            None => ((overall as f64 * self.cfg.warmup_chunk_fraction) as u64)
                .saturating_sub(self.cfg.reserve),
        }
    }

    /// Device bytes chunks may use now.
    pub fn budget(&self) -> u64 {
        self.budget_at(self.moment.unwrap_or(0))
    }

    fn check(&self, chunk: ChunkNo) -> Result<usize> {
        let i = chunk as usize;
        if i >= self.chunks.len() {
            return Err(Error::IndexOutOfRange {
                what: "chunk".into(),
                index: i,
                len: self.chunks.len(),
            });
        }
        Ok(i)
    }

    fn bytes(&self, i: usize) -> u64 {
        self.chunks[i].bytes
    }

    fn distance(&self, i: usize) -> u64 {
        self.index
            .distance(i as ChunkNo, self.moment.unwrap_or(0) as u64)
    }

    fn candidates(&self, exclude: &[ChunkNo]) -> Vec<usize> {
        (0..self.chunks.len())
            .filter(|&i| {
                let s = &self.st[i];
                s.on_device
                    && s.in_use == 0
                    && !s.pinned
                    && !self.resident[i]
                    && !exclude.contains(&(i as ChunkNo))
            })
            .collect()
    }

    /// Orders eviction candidates, first victim first.
    fn order_victims(&self, c: &mut [usize]) {
        let warm = self.trace.is_none();
        match self.policy {
            Policy::Lru => c.sort_unstable_by_key(|&i| (self.last_use[i], i)),
            _ if warm => c.sort_unstable(),
            Policy::Tide => c.sort_by_cached_key(|&i| {
                (std::cmp::Reverse(self.distance(i)), self.st[i].dirty(), i)
            }),
            Policy::PatrickStar => {
                c.sort_by_cached_key(|&i| (std::cmp::Reverse(self.distance(i)), i))
            }
            Policy::Static { .. } => c.sort_unstable(),
        }
    }

    fn evict(&mut self, i: usize, moves: &mut Vec<Move>) {
        let b = self.bytes(i);
        let s = self.st[i];
        debug_assert!(s.on_device && s.in_use == 0);
        if s.dirty() {
            self.write_back(i, moves);
        } else {
            self.stats.clean_drops += 1;
        }
        moves.push(Move::Drop {
            chunk: i as ChunkNo,
        });
        self.st[i].on_device = false;
        self.st[i].prefetched = false;
        self.device_used -= b;
    }

    fn write_back(&mut self, i: usize, moves: &mut Vec<Move>) {
        let b = self.bytes(i);
        if !self.st[i].host_alloc {
            self.st[i].host_alloc = true;
            self.host_used += b;
            self.host_peak = self.host_peak.max(self.host_used);
        }
        moves.push(Move::WriteBack {
            chunk: i as ChunkNo,
        });
        self.st[i].host_valid = true;
        self.stats.d2h_bytes += b;
        self.stats.write_backs += 1;
    }

    fn load(&mut self, i: usize, prefetch: bool, moves: &mut Vec<Move>) {
        let b = self.bytes(i);
        moves.push(Move::Load {
            chunk: i as ChunkNo,
            prefetch,
        });
        self.st[i].on_device = true;
        self.st[i].prefetched = prefetch;
        self.device_used += b;
        self.device_peak = self.device_peak.max(self.device_used);
        self.stats.h2d_bytes += b;
        self.stats.loads += 1;
        if prefetch {
            self.stats.prefetches += 1;
        }
        if !self.policy.keeps_host_copy() {
            moves.push(Move::FreeHost {
                chunk: i as ChunkNo,
            });
            self.st[i].host_alloc = false;
            self.st[i].host_valid = false;
            self.host_used -= b;
        }
    }

    fn materialize(&mut self, i: usize, moves: &mut Vec<Move>) {
        let b = self.bytes(i);
        moves.push(Move::Materialize {
            chunk: i as ChunkNo,
        });
        self.st[i].materialized = true;
        self.st[i].host_alloc = true;
        self.st[i].host_valid = true;
        self.host_used += b;
        self.host_peak = self.host_peak.max(self.host_used);
        self.stats.materialized += 1;
    }

    /// Serves one moment's accesses: returns the moves that put every chunk where it is needed,
    /// and marks the chunks in use until [`Scheduler::release`]. A chunk may be named more than
    /// once (one access per tensor); it then stays in use until released as many times. Nothing changes when it fails: if
    /// the device chunks cannot fit in the budget whatever is evicted, it returns
    /// [`Error::BudgetExceeded`] with the numbers.
    pub fn fetch(&mut self, accesses: &[Access]) -> Result<Vec<Move>> {
        // Merge duplicate chunks; one chunk cannot be needed in two places at once.
        let mut acc: Vec<Access> = Vec::with_capacity(accesses.len());
        for a in accesses {
            self.check(a.chunk)?;
            match acc.iter_mut().find(|b| b.chunk == a.chunk) {
                Some(b) if b.target != a.target => {
                    return Err(Error::Conflict {
                        what: format!("chunk {} needed on the device", a.chunk),
                        with: "the same chunk needed on the host at the same moment".into(),
                    })
                }
                Some(b) => b.write |= a.write,
                None => acc.push(*a),
            }
        }
        for a in &acc {
            let s = &self.st[a.chunk as usize];
            if s.in_use > 0 && s.on_device != (a.target == Target::Device) {
                return Err(Error::Conflict {
                    what: format!("moving chunk {}", a.chunk),
                    with: format!(
                        "its use on the {}",
                        if s.on_device { "device" } else { "host" }
                    ),
                });
            }
        }
        let m = self.moment.unwrap_or(0);
        let budget = self.budget_at(m);
        let here: Vec<ChunkNo> = acc.iter().map(|a| a.chunk).collect();
        // Feasibility first, so a refusal changes nothing.
        // A host write (or move semantics) ends the device copy of a host access.
        let ends_device_copy = |a: &Access| a.write || !self.policy.keeps_host_copy();
        let freed_by_host: u64 = acc
            .iter()
            .filter(|a| a.target == Target::Host && ends_device_copy(a))
            .map(|a| a.chunk as usize)
            .filter(|&i| self.st[i].on_device)
            .map(|i| self.bytes(i))
            .sum();
        let need: u64 = acc
            .iter()
            .filter(|a| a.target == Target::Device && !self.st[a.chunk as usize].on_device)
            .map(|a| self.bytes(a.chunk as usize))
            .sum();
        let after = self.device_used - freed_by_host;
        // Candidates are only needed when something must go.
        let mut cands = if self.device_used + need > budget {
            self.candidates(&here)
        } else {
            Vec::new()
        };
        let evictable: u64 = cands.iter().map(|&i| self.bytes(i)).sum();
        if after + need > budget && after + need - evictable > budget {
            let unevictable = after - evictable;
            return Err(Error::BudgetExceeded {
                moment: m,
                requested: need
                    + acc
                        .iter()
                        .filter(|a| {
                            a.target == Target::Device && self.st[a.chunk as usize].on_device
                        })
                        .map(|a| self.bytes(a.chunk as usize))
                        .sum::<u64>(),
                budget,
                capacity: self.cfg.capacity,
                non_model_peak: self.trace.as_ref().map_or(0, |t| t.reserve_at(m)),
                unevictable,
                chunks: device_chunks(&acc),
                tensors: Vec::new(),
            });
        }
        let mut moves = Vec::new();
        self.clock += 1;
        for a in &acc {
            let i = a.chunk as usize;
            if !self.st[i].materialized {
                self.materialize(i, &mut moves);
            }
        }
        // Host accesses: bring dirty copies back, and end the device copy where the host writes
        // (or under move semantics).
        for a in acc.iter().filter(|a| a.target == Target::Host) {
            let i = a.chunk as usize;
            if !self.st[i].on_device {
                continue;
            }
            if a.write || !self.policy.keeps_host_copy() {
                self.evict(i, &mut moves);
            } else if self.st[i].dirty() {
                self.write_back(i, &mut moves);
            }
        }
        // Device accesses: make room, then load.
        if self.device_used + need > budget {
            self.order_victims(&mut cands);
            for i in cands {
                if self.device_used + need <= budget {
                    break;
                }
                self.evict(i, &mut moves);
            }
        }
        for a in acc.iter().filter(|a| a.target == Target::Device) {
            let i = a.chunk as usize;
            if !self.st[i].on_device {
                self.load(i, false, &mut moves);
            }
            self.st[i].prefetched = false;
            if a.write {
                self.st[i].host_valid = false;
            }
        }
        // One use per access as given: a chunk named twice (two tensors of one op) needs two
        // releases before it may move.
        for a in accesses {
            let i = a.chunk as usize;
            self.st[i].in_use += 1;
            self.last_use[i] = self.clock;
        }
        Ok(moves)
    }

    /// Writes a dirty chunk nobody is using back to the host now, ahead of its eviction (the
    /// gradients of a group a host optimizer steps during backward): the host copy becomes
    /// current, so evicting the chunk later moves no byte. No move for a chunk that is not on
    /// the device, clean, or in use.
    pub(crate) fn write_back_now(&mut self, chunk: ChunkNo) -> Result<Vec<Move>> {
        let i = self.check(chunk)?;
        let mut moves = Vec::new();
        if self.st[i].dirty() && self.st[i].in_use == 0 {
            self.write_back(i, &mut moves);
            self.stats.early_write_backs += 1;
        }
        Ok(moves)
    }

    /// Counts an upload the manager made outside a move: the new host copy of a chunk that
    /// stays on the device went into its device copy (a host group's parameters stepped
    /// during backward), as a load would have.
    pub(crate) fn count_upload(&mut self, chunk: ChunkNo) -> Result<()> {
        let i = self.check(chunk)?;
        self.stats.h2d_bytes += self.bytes(i);
        self.stats.loads += 1;
        Ok(())
    }

    /// Ends the use of chunks fetched earlier. Static policies move non-resident chunks back
    /// right away.
    pub fn release(&mut self, chunks: &[ChunkNo]) -> Result<Vec<Move>> {
        for &c in chunks {
            let i = self.check(c)?;
            let times = chunks.iter().filter(|&&d| d == c).count();
            if (self.st[i].in_use as usize) < times {
                return Err(Error::TooFew {
                    what: format!("uses of chunk {c}, released {times} times"),
                    got: self.st[i].in_use as usize,
                    need: times,
                });
            }
        }
        let mut moves = Vec::new();
        for &c in chunks {
            let i = c as usize;
            self.st[i].in_use -= 1;
            if matches!(self.policy, Policy::Static { .. })
                && self.st[i].in_use == 0
                && self.st[i].on_device
                && !self.resident[i]
                && !self.st[i].pinned
            {
                self.evict(i, &mut moves);
            }
        }
        Ok(moves)
    }

    /// Pins or unpins a chunk (a pinned chunk never moves).
    pub fn set_pinned(&mut self, chunk: ChunkNo, pinned: bool) -> Result<()> {
        let i = self.check(chunk)?;
        self.st[i].pinned = pinned;
        Ok(())
    }

    /// Loads ahead: the chunks next used on the device, in trace order, while each fits in the free
    /// room of the budget of every moment until its use (a prefetch never evicts), with
    /// at most `max_prefetch` loaded and not yet used. Only [`Policy::Tide`] prefetches.
    pub fn prefetch(&mut self) -> Vec<Move> {
        let mut moves = Vec::new();
        if self.policy != Policy::Tide {
            return moves;
        }
        let (Some(trace), Some(m)) = (self.trace.as_ref(), self.moment) else {
            return moves;
        };
        let n = trace.len();
        if n == 0 || m + 1 >= n {
            return moves;
        }
        let mut min_budget = self.budget_at(m);
        let mut wanted: Vec<(usize, u64)> = Vec::new();
        // Look a bounded number of moments ahead: prefetching is about the next few chunks, and
        // the scan runs at every fetch.
        let window = PREFETCH_WINDOW.max(4 * self.cfg.max_prefetch);
        for u in m + 1..n.min(m + 1 + window) {
            min_budget = min_budget.min(self.budget_at(u));
            for a in &trace.moments[u].accesses {
                let i = a.chunk as usize;
                if a.target == Target::Device
                    && i < self.st.len()
                    && self.st[i].materialized
                    && !self.st[i].on_device
                    && !wanted.iter().any(|w| w.0 == i)
                {
                    wanted.push((i, min_budget));
                }
            }
            if wanted.len() >= self.cfg.max_prefetch {
                break;
            }
        }
        if wanted.is_empty() {
            return moves;
        }
        let in_flight = self.st.iter().filter(|s| s.prefetched).count();
        let room = self.cfg.max_prefetch.saturating_sub(in_flight);
        for (i, limit) in wanted.into_iter().take(room) {
            if self.device_used + self.bytes(i) > limit {
                // Only free room: a prefetch never evicts, so it cannot add a transfer.
                break;
            }
            self.load(i, true, &mut moves);
        }
        moves
    }

    /// Gives a chunk that never had a payload its host copy (initial values), outside any
    /// moment: for a checkpoint load that overwrites it.
    pub(crate) fn materialize_on_host(&mut self, chunk: ChunkNo) -> Result<Vec<Move>> {
        let i = self.check(chunk)?;
        let mut moves = Vec::new();
        if !self.st[i].materialized {
            self.materialize(i, &mut moves);
        }
        Ok(moves)
    }

    /// Makes the host copy of a chunk current (writing back a dirty device copy) without moving
    /// it; with `drop_device` the device copy is freed too. Refused for a chunk in use on the device.
    pub(crate) fn sync_host(&mut self, chunk: ChunkNo, drop_device: bool) -> Result<Vec<Move>> {
        let i = self.check(chunk)?;
        let mut moves = Vec::new();
        let s = self.st[i];
        if !s.materialized {
            return Ok(moves);
        }
        if s.on_device && s.in_use > 0 {
            return Err(Error::Conflict {
                what: format!("syncing chunk {chunk} to the host"),
                with: "its use on the device".into(),
            });
        }
        if s.on_device {
            // a chunk lives in one place under move semantics
            if drop_device || !self.policy.keeps_host_copy() {
                self.evict(i, &mut moves);
            } else if s.dirty() {
                self.write_back(i, &mut moves);
            }
        }
        Ok(moves)
    }
}

/// Home tier of every chunk for a host budget: chunks go to host memory until it is full, then to
/// the file tier, optimizer state first (variance, momentum, masters), parameters last. Returns
/// `true` for chunks that live on the file tier.
pub fn spill_to_file(chunks: &[ChunkDesc], host_budget: Option<u64>) -> Vec<bool> {
    let mut file = vec![false; chunks.len()];
    let Some(budget) = host_budget else {
        return file;
    };
    let total: u64 = chunks.iter().map(|c| c.bytes).sum();
    if total <= budget {
        return file;
    }
    let mut order: Vec<usize> = (0..chunks.len()).collect();
    // spill the coldest kinds first, later groups before earlier ones within a kind
    order.sort_by_key(|&i| {
        (
            chunks[i].kind.spill_rank(),
            std::cmp::Reverse(chunks[i].group),
        )
    });
    let mut excess = total - budget;
    for i in order {
        if excess == 0 {
            break;
        }
        file[i] = true;
        excess = excess.saturating_sub(chunks[i].bytes);
    }
    file
}

/// The distinct chunks `acc` needs on the device, in order.
fn device_chunks(acc: &[Access]) -> Vec<u32> {
    let mut v: Vec<u32> = Vec::new();
    for a in acc.iter().filter(|a| a.target == Target::Device) {
        if !v.contains(&a.chunk) {
            v.push(a.chunk);
        }
    }
    v
}
