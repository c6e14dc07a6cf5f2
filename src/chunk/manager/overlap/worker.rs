//! The worker side of a host group's early step: the job it is handed, and the step itself,
//! block by block over the group's elements, split over threads.

use std::ops::Range;

use crossbeam::channel::Sender;

use super::BlockStep;
use super::HostBlock;
use crate::chunk::manager::HostSlot;
use crate::device::{HostBuffer, Pending};
use crate::error::{Error, Result};

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
    pub(super) grads: Grads,
    pub(super) out: HostBuffer,
    pub(super) orig: [HostBuffer; 3],
    pub(super) shadow: [HostBuffer; 3],
    pub(super) ranges: Vec<Range<usize>>,
    pub(super) elem_bytes: usize,
    pub(super) threads: usize,
    pub(super) step: BlockStep,
    pub(super) done: Sender<Finished>,
}

/// A job's buffers back from the worker.
pub(super) struct Finished {
    /// The gradients, untouched (`None` if their copy failed).
    pub(super) grads: Option<HostBuffer>,
    /// The new parameters (in flight while an upload reads them).
    pub(super) out: HostSlot,
    pub(super) orig: [HostBuffer; 3],
    pub(super) shadow: [HostBuffer; 3],
    pub(super) result: Result<()>,
}

/// A worker's job: waits for the gradients, then steps the shadows block by block.
pub(super) fn run_job(job: Job) -> Finished {
    let Job {
        grads,
        mut out,
        orig,
        mut shadow,
        ranges,
        elem_bytes,
        threads,
        step,
        done: _,
    } = job;
    let grads = match grads {
        Grads::Copy(p) => p.wait_quiet(),
        Grads::Host(h) => Ok(h),
    };
    let (grads, result) = match grads {
        Err(e) => (None, Err(e)),
        Ok(grads) => {
            let r = step_group(
                &grads,
                &mut out,
                &orig,
                &mut shadow,
                &ranges,
                elem_bytes,
                threads,
                &step,
            );
            (Some(grads), r)
        }
    };
    Finished {
        grads,
        out: HostSlot::Ready(out),
        orig,
        shadow,
        result,
    }
}

fn f32s(b: &[u8]) -> Result<&[f32]> {
    bytemuck::try_cast_slice(b).map_err(|_| Error::Misaligned {
        what: "host chunk",
        value: b.as_ptr() as usize,
        align: 4,
    })
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
    grad: &'a [u8],
    out: &'a mut [u8],
    orig: [&'a [f32]; 3],
    shadow: [&'a mut [f32]; 3],
}

/// Copies the originals to the shadows (and the gradients' chunk to `out`, whose untouched
/// ranges hold parameters) and steps the gradient ranges, split over threads.
#[allow(clippy::too_many_arguments)]
fn step_group(
    grads: &[u8],
    out: &mut [u8],
    orig: &[HostBuffer; 3],
    shadow: &mut [HostBuffer; 3],
    ranges: &[Range<usize>],
    es: usize,
    threads: usize,
    step: &BlockStep,
) -> Result<()> {
    let n = grads.len() / es;
    let orig = [f32s(&orig[0])?, f32s(&orig[1])?, f32s(&orig[2])?];
    let [s0, s1, s2] = shadow;
    let mut shadow = [f32s_mut(s0)?, f32s_mut(s1)?, f32s_mut(s2)?];
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
        let [a, b, c] = shadow;
        let (a0, a1) = a.split_at_mut(len);
        let (b0, b1) = b.split_at_mut(len);
        let (c0, c1) = c.split_at_mut(len);
        shadow = [a1, b1, c1];
        split.push(Part {
            lo,
            grad: &grads[lo * es..(lo + len) * es],
            out: o,
            orig: orig.map(|x| &x[lo..lo + len]),
            shadow: [a0, b0, c0],
        });
        lo += len;
    }
    std::thread::scope(|scope| {
        let mut parts = split.into_iter();
        let first = parts.next();
        let handles: Vec<_> = parts
            .map(|part| scope.spawn(move || step_part(part, ranges, es, step)))
            .collect();
        let mut result = first.map_or(Ok(()), |part| step_part(part, ranges, es, step));
        for h in handles {
            let r = h.join().unwrap_or_else(|_| {
                Err(Error::InvalidArgument("a host-step thread panicked".into()))
            });
            result = result.and(r);
        }
        result
    })
}

fn step_part(part: Part<'_>, ranges: &[Range<usize>], es: usize, step: &BlockStep) -> Result<()> {
    let Part {
        lo,
        grad,
        out,
        orig,
        shadow: [ma, mo, va],
    } = part;
    let n = ma.len();
    let mut b = 0;
    while b < n {
        let e = (b + BLOCK).min(n);
        ma[b..e].copy_from_slice(&orig[0][b..e]);
        mo[b..e].copy_from_slice(&orig[1][b..e]);
        va[b..e].copy_from_slice(&orig[2][b..e]);
        out[b * es..e * es].copy_from_slice(&grad[b * es..e * es]);
        for r in ranges {
            // the range in this part's coordinates, cut to the block
            let x = r.start.saturating_sub(lo).max(b);
            let y = r.end.saturating_sub(lo).min(e);
            if x < y {
                step(HostBlock {
                    grad: &grad[x * es..y * es],
                    param: &mut out[x * es..y * es],
                    master: &mut ma[x..y],
                    momentum: &mut mo[x..y],
                    variance: &mut va[x..y],
                })?;
            }
        }
        b = e;
    }
    Ok(())
}
