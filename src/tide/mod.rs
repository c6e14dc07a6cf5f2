//! The tide: the warm-up trace of non-model memory and chunk use, the device budget it gives at
//! every moment, and the placement policies that decide which chunks stay on the device.
//!
//! Everything here is pure decision logic over chunk numbers and byte counts, shared by the
//! chunk manager, which carries the [`Move`]s out with real
//! copies, and the simulator, which only counts them.
//!
//! ```
//! use tidemem::tensor::ChunkKind;
//! use tidemem::tide::{Access, ChunkDesc, Move, Policy, Scheduler, SchedulerConfig, Target};
//! # fn main() -> tidemem::Result<()> {
//! let chunks = (0..3).map(|g| ChunkDesc { bytes: 100, kind: ChunkKind::Param, group: g }).collect();
//! let mut cfg = SchedulerConfig::new(250);
//! cfg.overall_fraction = 1.0;
//! cfg.warmup_chunk_fraction = 1.0;
//! let mut s = Scheduler::new(Policy::Tide, cfg, chunks)?;
//! for c in 0..3 {
//!     s.tick();
//!     let moves = s.fetch(&[Access { chunk: c, target: Target::Device, write: false }])?;
//!     s.release(&[c])?;
//!     if c == 2 {
//!         // the third chunk does not fit: chunk 0 is evicted, and being clean it moves no byte
//!         assert_eq!(moves[1..], [Move::Drop { chunk: 0 }, Move::Load { chunk: 2, prefetch: false }]);
//!     }
//! }
//! assert_eq!(s.stats().d2h_bytes, 0);
//! # Ok(()) }
//! ```

mod bound;
mod scheduler;
mod sizing;
mod trace;

pub use bound::{lower_bound, Bound};
pub use scheduler::{
    spill_to_file, ChunkStatus, Move, MoveStats, Policy, Scheduler, SchedulerConfig,
};
pub use sizing::Sizing;
pub use trace::{Access, ChunkDesc, ChunkNo, Moment, Target, Trace, Tracer, UseIndex, NEVER};
