//! The worker side of a host group's early step: the job it is handed, and the step itself,
//! block by block over the group's elements, split over threads.

use std::ops::Range;

use crossbeam::channel::Sender;

use super::BlockStep;
use super::HostBlock;
use crate::chunk::manager::HostSlot;
use crate::device::{HostBuffer, Pending};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::grad_stats::{grad_stats_split, GradStats};

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

/// One thread's share of a group: the elements `lo..` of every operand.
struct Part<'a> {
    lo: usize,
    /// The gradients, or `None` where `out` holds them (in place).
    grad: Option<&'a [u8]>,
    out: &'a mut [u8],
    /// The lent chunks' elements (read, and for a fold handed to the step).
    orig: Vec<&'a mut [f32]>,
    /// Their copies (a step's).
    shadow: Vec<&'a mut [f32]>,
}

/// Splits each slice at `len`, keeping the tail in place and returning the head.
fn split_heads<'a>(v: &mut Vec<&'a mut [f32]>, len: usize) -> Vec<&'a mut [f32]> {
    let mut heads = Vec::with_capacity(v.len());
    for x in v.iter_mut() {
        let (a, b) = std::mem::take(x).split_at_mut(len);
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
    let mut orig: Vec<&mut [f32]> = orig
        .iter_mut()
        .map(|b| f32s_mut(b))
        .collect::<Result<_>>()?;
    let mut shadow: Vec<&mut [f32]> = shadow
        .iter_mut()
        .map(|b| f32s_mut(b))
        .collect::<Result<_>>()?;
    let parts = threads.min(n / MIN_PER_THREAD).max(1);
    // split on 64-element boundaries, as the CPU kernel does
    let per = n.div_ceil(parts).div_ceil(64) * 64;
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
        for (s, o) in shadow.iter_mut().zip(orig.iter()) {
            s[b..e].copy_from_slice(&o[b..e]);
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
            let mut s = state.iter_mut().map(|v| &mut v[x..y]);
            let (master, momentum, variance) = (s.next(), s.next(), s.next());
            (g.step)(HostBlock {
                group: g.group,
                offset: lo + x,
                grad: grad.filter(|_| has).map(|d| &d[x * es..y * es]),
                in_place: has && grad.is_none(),
                param: &mut out[x * es..y * es],
                master: master.unwrap_or_default(),
                momentum: momentum.unwrap_or_default(),
                variance: variance.unwrap_or_default(),
            })?;
        }
        b = e;
    }
    Ok(())
}
