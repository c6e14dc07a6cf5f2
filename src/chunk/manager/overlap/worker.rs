//! The worker side of a host group's early step: the job it is handed, and the step itself,
//! block by block over the group's elements, split over threads.

use std::ops::Range;

use crossbeam::channel::Sender;

use super::BlockStep;
use super::HostBlock;
use crate::chunk::manager::{HostMoments, HostSlot};
use crate::chunk::moments::split8;
use crate::chunk::plan::MomentStorage;
use crate::device::{HostBuffer, Pending};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::grad_stats::{grad_stats_split, GradStats};
use crate::ops::{Moments8, QUANT8_BLOCK};

/// Elements a worker copies to the shadows and steps at a time (192 KiB of fp32 state).
const BLOCK: usize = 16 << 10;
/// Fewest elements worth a thread of their own.
const MIN_PER_THREAD: usize = 1 << 15;

/// The gradients as the worker gets them: on their way down, or on the host.
pub(super) enum Grads {
    Copy(Pending<HostBuffer>),
    Host(HostBuffer),
}

/// A group's step as the worker gets it.
pub(super) struct Job {
    pub(super) group: usize,
    pub(super) grads: Grads,
    /// The buffer for the new parameters; `None` in place: they overwrite the gradients,
    /// whose statistics are taken first.
    pub(super) out: Option<HostBuffer>,
    /// The ranges whose gradient statistics a step takes before it steps, in the order the
    /// optimizer's statistics read them (none for a fold).
    pub(super) stat_ranges: Vec<Range<usize>>,
    pub(super) dtype: DType,
    /// The lent chunks: master, momentum and variance for a step; the master for a fold.
    pub(super) orig: Vec<HostBuffer>,
    /// Their copies the step updates (none for a fold, which reads the master only).
    pub(super) shadow: Vec<HostBuffer>,
    pub(super) ranges: Vec<Range<usize>>,
    pub(super) elem_bytes: usize,
    /// How the lent momentum and variance hold their values.
    pub(super) moments: MomentStorage,
    pub(super) threads: usize,
    pub(super) step: BlockStep,
    /// Every block is handed over, `grad` `None` outside the gradients (a fold).
    pub(super) every_block: bool,
    /// Where the statistics go as soon as they are taken, ahead of the step.
    pub(super) stats_to: Option<Sender<Vec<GradStats>>>,
    pub(super) done: Sender<Finished>,
}

/// A job's buffers back from the worker.
pub(super) struct Finished {
    /// The gradients, untouched (`None` if their copy failed, or in place).
    pub(super) grads: Option<HostBuffer>,
    /// Whether the gradients reached the host.
    pub(super) copied: bool,
    /// The statistics of `stat_ranges`.
    pub(super) stats: Vec<GradStats>,
    /// The new parameters (in flight while an upload reads them).
    pub(super) out: HostSlot,
    pub(super) orig: Vec<HostBuffer>,
    pub(super) shadow: Vec<HostBuffer>,
    pub(super) result: Result<()>,
}

/// A worker's job: waits for the gradients, then steps the shadows block by block.
pub(super) fn run_job(job: Job) -> Finished {
    let Job {
        group,
        grads,
        out,
        stat_ranges,
        dtype,
        mut orig,
        mut shadow,
        ranges,
        elem_bytes,
        moments,
        threads,
        step,
        every_block,
        stats_to,
        done: _,
    } = job;
    let grads = match grads {
        Grads::Copy(p) => p.wait_quiet(),
        Grads::Host(h) => Ok(h),
    };
    let mut grads = match grads {
        Ok(grads) => grads,
        Err(e) => {
            return Finished {
                grads: None,
                copied: false,
                stats: Vec::new(),
                out: out.map_or(HostSlot::None, HostSlot::Ready),
                orig,
                shadow,
                result: Err(e),
            }
        }
    };
    // the statistics the optimizer reads of the group, before the step (a fold takes none)
    let stats = stat_ranges
        .iter()
        .map(|r| {
            grad_stats_split(
                &grads[r.start * elem_bytes..r.end * elem_bytes],
                dtype,
                threads,
            )
        })
        .collect::<Result<Vec<_>>>();
    let stats = match stats {
        Ok(stats) => {
            if let Some(to) = stats_to {
                let _ = to.send(stats.clone());
            }
            stats
        }
        Err(e) => {
            return Finished {
                grads: Some(grads),
                copied: true,
                stats: Vec::new(),
                out: out.map_or(HostSlot::None, HostSlot::Ready),
                orig,
                shadow,
                result: Err(e),
            }
        }
    };
    let g = Group {
        group,
        ranges: &ranges,
        es: elem_bytes,
        moments,
        every_block,
        step: &step,
    };
    let (grads, out, result) = match out {
        Some(mut out) => {
            let io = Io::Beside(&grads, &mut out);
            let result = step_group(&g, io, &mut orig, &mut shadow, threads);
            (Some(grads), out, result)
        }
        None => {
            let result = step_group(&g, Io::InPlace(&mut grads), &mut orig, &mut shadow, threads);
            (None, grads, result)
        }
    };
    Finished {
        grads,
        copied: true,
        stats,
        out: HostSlot::Ready(out),
        orig,
        shadow,
        result,
    }
}

/// Where a step reads the gradients and writes the new parameters.
enum Io<'a> {
    /// From the gradients into a buffer of their own (the gradients' bytes copied there
    /// first, so the ranges without gradients hold parameters).
    Beside(&'a [u8], &'a mut [u8]),
    /// Over the gradients.
    InPlace(&'a mut [u8]),
}

/// What every part of a group's step shares.
struct Group<'a> {
    group: usize,
    ranges: &'a [Range<usize>],
    es: usize,
    moments: MomentStorage,
    every_block: bool,
    step: &'a BlockStep,
}

fn f32s_mut(b: &mut [u8]) -> Result<&mut [f32]> {
    let p = b.as_ptr() as usize;
    bytemuck::try_cast_slice_mut(b).map_err(|_| Error::Misaligned {
        what: "host chunk",
        value: p,
        align: 4,
    })
}

/// One lent list's elements: f32 values, or 8-bit codes and the scales of their blocks (the
/// first element on a block).
enum List<'a> {
    F32(&'a mut [f32]),
    Int8(&'a mut [u8], &'a mut [f32]),
}

impl<'a> List<'a> {
    /// List `i` of a group's lent chunks (master, momentum, variance) of `n` elements.
    fn of(b: &'a mut [u8], i: usize, moments: MomentStorage, n: usize) -> Result<Self> {
        match (i, moments) {
            (1 | 2, MomentStorage::Int8) => {
                let (codes, scales) = split8(b, n)?;
                Ok(List::Int8(codes, scales))
            }
            _ => Ok(List::F32(f32s_mut(b)?)),
        }
    }

    /// The first `len` elements (a block multiple for 8 bits) and the rest.
    fn split_at(self, len: usize) -> (Self, Self) {
        match self {
            List::F32(v) => {
                let (a, b) = v.split_at_mut(len);
                (List::F32(a), List::F32(b))
            }
            List::Int8(c, s) => {
                let blocks = len.div_ceil(QUANT8_BLOCK).min(s.len());
                let (ca, cb) = c.split_at_mut(len);
                let (sa, sb) = s.split_at_mut(blocks);
                (List::Int8(ca, sa), List::Int8(cb, sb))
            }
        }
    }

    /// Elements `x..y` (`x` on a block for 8 bits) and their blocks' scales.
    fn range(&mut self, x: usize, y: usize) -> List<'_> {
        match self {
            List::F32(v) => List::F32(&mut v[x..y]),
            List::Int8(c, s) => List::Int8(
                &mut c[x..y],
                &mut s[x / QUANT8_BLOCK..y.div_ceil(QUANT8_BLOCK)],
            ),
        }
    }

    /// Copies elements `x..y` of `from` (the same kind of list) into this one.
    fn copy_range(&mut self, from: &mut List<'_>, x: usize, y: usize) {
        match (self.range(x, y), from.range(x, y)) {
            (List::F32(a), List::F32(b)) => a.copy_from_slice(b),
            (List::Int8(ca, sa), List::Int8(cb, sb)) => {
                ca.copy_from_slice(cb);
                sa.copy_from_slice(sb);
            }
            _ => unreachable!("a shadow is of its chunk's kind"),
        }
    }
}

/// One thread's share of a group: the elements `lo..` of every operand.
struct Part<'a> {
    lo: usize,
    /// The gradients, or `None` where `out` holds them (in place).
    grad: Option<&'a [u8]>,
    out: &'a mut [u8],
    /// The lent chunks' elements (read, and for a fold handed to the step).
    orig: Vec<List<'a>>,
    /// Their copies (a step's).
    shadow: Vec<List<'a>>,
}

/// Splits each list at `len`, keeping the tail in place and returning the head.
fn split_heads<'a>(v: &mut Vec<List<'a>>, len: usize) -> Vec<List<'a>> {
    let mut heads = Vec::with_capacity(v.len());
    for x in v.iter_mut() {
        let (a, b) = std::mem::replace(x, List::F32(&mut [])).split_at(len);
        heads.push(a);
        *x = b;
    }
    heads
}

/// Copies the originals to the shadows (and the gradients' chunk to `out`, whose untouched
/// ranges hold parameters) and steps the gradient ranges, split over threads.
fn step_group(
    g: &Group<'_>,
    io: Io<'_>,
    orig: &mut [HostBuffer],
    shadow: &mut [HostBuffer],
    threads: usize,
) -> Result<()> {
    let es = g.es;
    let (grads, out) = match io {
        Io::Beside(grads, out) => (Some(grads), out),
        Io::InPlace(out) => (None, out),
    };
    let n = out.len() / es;
    let mut orig: Vec<List<'_>> = orig
        .iter_mut()
        .enumerate()
        .map(|(i, b)| List::of(b, i, g.moments, n))
        .collect::<Result<_>>()?;
    let mut shadow: Vec<List<'_>> = shadow
        .iter_mut()
        .enumerate()
        .map(|(i, b)| List::of(b, i, g.moments, n))
        .collect::<Result<_>>()?;
    let parts = threads.min(n / MIN_PER_THREAD).max(1);
    // split on 64-element boundaries, as the CPU kernel does (on the 8-bit blocks, 256)
    let per = n.div_ceil(parts).div_ceil(QUANT8_BLOCK) * QUANT8_BLOCK;
    let mut split = Vec::with_capacity(parts);
    let mut rest = out;
    let mut lo = 0;
    while lo < n {
        let len = per.min(n - lo);
        let (o, r) = rest.split_at_mut(len * es);
        rest = r;
        split.push(Part {
            lo,
            grad: grads.map(|g| &g[lo * es..(lo + len) * es]),
            out: o,
            orig: split_heads(&mut orig, len),
            shadow: split_heads(&mut shadow, len),
        });
        lo += len;
    }
    std::thread::scope(|scope| {
        let mut parts = split.into_iter();
        let first = parts.next();
        let handles: Vec<_> = parts
            .map(|part| scope.spawn(move || step_part(part, g)))
            .collect();
        let mut result = first.map_or(Ok(()), |part| step_part(part, g));
        for h in handles {
            let r = h.join().unwrap_or_else(|_| {
                Err(Error::Panicked {
                    what: "a host-step thread".into(),
                    message: String::new(),
                })
            });
            result = result.and(r);
        }
        result
    })
}

fn step_part(part: Part<'_>, g: &Group<'_>) -> Result<()> {
    let Part {
        lo,
        grad,
        out,
        mut orig,
        mut shadow,
    } = part;
    let es = g.es;
    let n = out.len() / es;
    let mut b = 0;
    while b < n {
        let e = (b + BLOCK).min(n);
        for (s, o) in shadow.iter_mut().zip(orig.iter_mut()) {
            s.copy_range(o, b, e);
        }
        if let Some(grad) = grad {
            out[b * es..e * es].copy_from_slice(&grad[b * es..e * es]);
        }
        // the block cut at the gradient ranges (in this part's coordinates): the pieces with
        // gradients, and for a fold the ones between them too
        let mut at = b;
        let cuts = g.ranges.iter().filter_map(|r| {
            let x = r.start.saturating_sub(lo).max(b);
            let y = r.end.saturating_sub(lo).min(e);
            (x < y).then_some((x, y))
        });
        let mut pieces: Vec<(usize, usize, bool)> = Vec::new();
        for (x, y) in cuts {
            if g.every_block && at < x {
                pieces.push((at, x, false));
            }
            // an 8-bit step covers its last block whole (past the range, padding), as the
            // serial step does
            let y = match g.moments {
                MomentStorage::Int8 if !g.every_block => y.next_multiple_of(QUANT8_BLOCK).min(e),
                _ => y,
            };
            pieces.push((x, y, true));
            at = y;
        }
        if g.every_block && at < e {
            pieces.push((at, e, false));
        }
        for (x, y, has) in pieces {
            let state = if shadow.is_empty() {
                &mut orig
            } else {
                &mut shadow
            };
            let mut s = state.iter_mut().map(|v| v.range(x, y));
            let (master, momentum, variance) = (s.next(), s.next(), s.next());
            let master = match master {
                Some(List::F32(m)) => m,
                None => &mut [],
                Some(List::Int8(..)) => unreachable!("masters are f32"),
            };
            let moments = match (momentum, variance) {
                (Some(List::F32(momentum)), Some(List::F32(variance))) => {
                    HostMoments::F32 { momentum, variance }
                }
                (Some(List::Int8(m, ms)), Some(List::Int8(v, vs))) => HostMoments::Int8(Moments8 {
                    momentum: m,
                    variance: v,
                    momentum_scales: ms,
                    variance_scales: vs,
                }),
                _ => HostMoments::F32 {
                    momentum: &mut [],
                    variance: &mut [],
                },
            };
            (g.step)(HostBlock {
                group: g.group,
                offset: lo + x,
                grad: grad.filter(|_| has).map(|d| &d[x * es..y * es]),
                in_place: has && grad.is_none(),
                param: &mut out[x * es..y * es],
                master,
                moments,
            })?;
        }
        b = e;
    }
    Ok(())
}
