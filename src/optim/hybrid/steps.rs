//! The group steps of [`HybridAdam`](super::HybridAdam): one chunk group on the host or the
//! device, one block of a host group during backward, the restore after an overflow, and the
//! host-side conversions they share.

use std::ops::Range;

use crate::chunk::{
    scales_at, ChunkKind, ChunkManager, DeviceMoments, GroupChunks, GroupVisit, HostBlock,
    HostMoments,
};
use crate::device::{Device, HostPhase, HostSpan};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::cast::cast_bytes;
use crate::ops::{self, Adam8Operands, AdamOperands, Moments8, QUANT8_BLOCK};
use crate::optim::adam::AdamScalars;
use crate::optim::{CpuAdam, Grad, GradInPlace, ParamCopy};
use crate::tide::Target;

#[cfg(doc)]
use super::HybridConfig;

/// What identifies a step for overlap: its scalars, and for a step with shadows how many
/// groups step on the device (an in-place step is kept whatever the device takes: a group
/// stepped early is skipped by the device's pass).
pub(super) fn overlap_key(s: &AdamScalars, device_groups: usize, in_place: bool) -> Vec<u8> {
    let mut key = bytemuck::bytes_of(s).to_vec();
    match in_place {
        true => key.extend_from_slice(b"in place"),
        false => key.extend_from_slice(&(device_groups as u64).to_le_bytes()),
    }
    key
}

/// One block of a host group's step during backward: the same kernel calls as
/// [`adam_group`]'s on the same elements, so the same bits.
pub(super) fn step_block(
    cpu: &CpuAdam,
    s: &AdamScalars,
    dt: DType,
    b: HostBlock<'_>,
) -> Result<()> {
    let HostBlock {
        grad,
        in_place,
        param,
        master,
        moments,
        ..
    } = b;
    // (a step is handed the gradient ranges only: in place, the gradients are in `param`)
    if grad.is_none() && !in_place {
        return Ok(());
    }
    let moments = match moments {
        HostMoments::F32 { momentum, variance } => Moms::F32(momentum, variance),
        HostMoments::Int8(m) => Moms::Int8(m),
    };
    host_step(cpu, s, dt, grad, param, master, moments)
}

/// Adam's moments of a range of elements on the host.
enum Moms<'a> {
    F32(&'a mut [f32], &'a mut [f32]),
    Int8(Moments8<'a>),
}

impl Moms<'_> {
    fn step(
        self,
        cpu: &CpuAdam,
        s: &AdamScalars,
        p: &mut [f32],
        g: Grad<'_>,
        c: ParamCopy<'_>,
    ) -> Result<()> {
        match self {
            Moms::F32(m, v) => cpu.step(s, p, m, v, g, c),
            Moms::Int8(m) => cpu.step8(s, p, m, g, c),
        }
    }

    fn step_in_place(
        self,
        cpu: &CpuAdam,
        s: &AdamScalars,
        p: &mut [f32],
        g: GradInPlace<'_>,
    ) -> Result<()> {
        match self {
            Moms::F32(m, v) => cpu.step_in_place(s, p, m, v, g),
            Moms::Int8(m) => cpu.step8_in_place(s, p, m, g),
        }
    }
}

/// The elements an 8-bit step of gradient range `r` of a group of `n` elements covers: whole
/// blocks (tensors start on a block, so the elements past `r` up to the block's end, or the
/// group's, are padding), and the blocks' indices.
fn blocks_of(r: &Range<usize>, n: usize) -> Result<(Range<usize>, Range<usize>)> {
    if !r.start.is_multiple_of(QUANT8_BLOCK) {
        return Err(Error::Internal {
            what: format!(
                "a gradient range of an 8-bit group starts at element {}, not on a block",
                r.start
            ),
        });
    }
    let end = r.end.next_multiple_of(QUANT8_BLOCK).min(n);
    Ok((
        r.start..end,
        r.start / QUANT8_BLOCK..end.div_ceil(QUANT8_BLOCK),
    ))
}

/// One host step of the fp32 master `p` and the moments `m` with the gradients in `grad`, or
/// with `None` in `param` (a parameter chunk holding its gradients), writing the new
/// parameters to `param` in the parameter dtype `dt`.
fn host_step(
    cpu: &CpuAdam,
    s: &AdamScalars,
    dt: DType,
    grad: Option<&[u8]>,
    param: &mut [u8],
    p: &mut [f32],
    m: Moms<'_>,
) -> Result<()> {
    match (grad, dt) {
        (grad, DType::F32) => {
            let g: &[f32] = match grad {
                Some(g) => typed(g)?,
                None => typed_mut(param)?,
            };
            m.step(cpu, s, p, Grad::F32(g), ParamCopy::None)?;
            param.copy_from_slice(bytemuck::cast_slice(p));
            Ok(())
        }
        (Some(g), DType::F16) => m.step(
            cpu,
            s,
            p,
            Grad::F16(typed(g)?),
            ParamCopy::F16(typed_mut(param)?),
        ),
        (Some(g), DType::BF16) => m.step(
            cpu,
            s,
            p,
            Grad::Bf16(typed(g)?),
            ParamCopy::Bf16(typed_mut(param)?),
        ),
        (None, DType::F16) => m.step_in_place(cpu, s, p, GradInPlace::F16(typed_mut(param)?)),
        (None, DType::BF16) => m.step_in_place(cpu, s, p, GradInPlace::Bf16(typed_mut(param)?)),
        (_, other) => Err(Error::WrongDType {
            what: "parameters stepped by HybridAdam".into(),
            dtype: other,
            expected: "a model float (F32, F16 or BF16)",
        }),
    }
}

/// One block of a host group's fold during backward (an accumulated micro-batch): the same
/// arithmetic as the serial fold on the same elements, into the group's pending accumulator
/// (`acc + gradient × inv` where there are gradients, `acc` elsewhere), the parameters given
/// back their values from the masters.
pub(super) fn fold_block(acc: &Accumulators, inv: f32, dt: DType, b: HostBlock<'_>) -> Result<()> {
    let n = b.param.len() / dt.size();
    let (lo, hi) = (b.offset, b.offset + n);
    let a = acc.acc[b.group].read();
    let mut p = acc.pending[b.group].lock();
    if a.len() < hi || p.len() < hi {
        return Err(Error::Internal {
            what: format!(
                "group {}'s accumulator holds {} elements, not {hi}",
                b.group,
                a.len().min(p.len())
            ),
        });
    }
    match b.grad {
        None => p[lo..hi].copy_from_slice(&a[lo..hi]),
        Some(grad) => {
            let mut g = vec![0.0f32; n];
            to_f32(grad, dt, &mut g)?;
            for ((x, &y), &z) in p[lo..hi].iter_mut().zip(&g).zip(&a[lo..hi]) {
                let mut v = z;
                v += y * inv;
                *x = v;
            }
            from_f32(&b.master[..n], b.param, dt)?;
        }
    }
    Ok(())
}

/// The fp32 gradient accumulators of every group, and the ones a fold during backward writes
/// (swapped in once the fold is kept), shared with the worker thread.
#[derive(Debug, Default)]
pub(super) struct Accumulators {
    pub(super) acc: Vec<parking_lot::RwLock<Vec<f32>>>,
    pub(super) pending: Vec<parking_lot::Mutex<Vec<f32>>>,
}

impl Accumulators {
    /// Zeroed accumulators for groups of `group_elems` elements.
    pub(super) fn new(group_elems: &[usize]) -> Self {
        Accumulators {
            acc: group_elems
                .iter()
                .map(|&n| parking_lot::RwLock::new(vec![0.0; n]))
                .collect(),
            pending: group_elems
                .iter()
                .map(|&n| parking_lot::Mutex::new(vec![0.0; n]))
                .collect(),
        }
    }
}

/// What identifies a fold for overlap: the accumulators it writes, the micro-batch and the
/// loss scale's inverse.
pub(super) fn fold_key(micro: u32, inv: f32, acc: &std::sync::Arc<Accumulators>) -> Vec<u8> {
    let mut key = b"fold".to_vec();
    key.extend_from_slice(&(std::sync::Arc::as_ptr(acc) as usize as u64).to_le_bytes());
    key.extend_from_slice(&micro.to_le_bytes());
    key.extend_from_slice(&inv.to_bits().to_le_bytes());
    key
}

/// Restores the parameters the gradients overwrote from the fp32 masters.
pub(super) fn restore(m: &mut ChunkManager, place: impl FnMut(usize) -> Target) -> Result<()> {
    m.visit_groups(&[ChunkKind::Param, ChunkKind::Master], place, |v| {
        let dt = v.param_dtype;
        let es = dt.size();
        match v.chunks {
            GroupChunks::Host {
                param,
                master: Some(master),
                ..
            } => {
                for r in &v.ranges {
                    from_f32(&master[r.clone()], &mut param[r.start * es..r.end * es], dt)?;
                }
            }
            GroupChunks::Device {
                device,
                stream,
                param,
                master: Some(master),
                ..
            } => {
                for r in &v.ranges {
                    ops::cast(
                        device,
                        stream,
                        master.view(r.start * 4, r.len() * 4)?,
                        DType::F32,
                        param.view(r.start * es, r.len() * es)?,
                        dt,
                    )?;
                }
            }
            _ => unreachable!("the master chunk was asked for"),
        }
        Ok(())
    })
}

/// Times a host group's step as [`HostPhase::Optimizer`] when the device profiles.
pub(super) fn host_span(dev: &Device, v: &GroupVisit<'_>) -> Option<HostSpan> {
    matches!(v.chunks, GroupChunks::Host { .. }).then(|| dev.host_span(HostPhase::Optimizer))
}

/// Steps one group: on the device with [`crate::device::Device::adam`], on the host with the
/// CPU kernel. `acc` replaces the gradients in the parameter chunk when given (accumulation).
/// With `delayed`, the parameters are written from the masters as they were before the update
/// ([`HybridConfig::delayed_params`]).
pub(super) fn adam_group(
    cpu: &CpuAdam,
    s: &AdamScalars,
    v: GroupVisit<'_>,
    acc: Option<&[f32]>,
    delayed: bool,
) -> Result<()> {
    let dt = v.param_dtype;
    let es = dt.size();
    match v.chunks {
        GroupChunks::Host {
            param,
            master: Some(p),
            moments: Some(mut moments),
        } => {
            let n = p.len();
            for r in &v.ranges {
                let (r, b) = match &moments {
                    HostMoments::F32 { .. } => (r.clone(), 0..0),
                    HostMoments::Int8(_) => blocks_of(r, n)?,
                };
                let m = match &mut moments {
                    HostMoments::F32 { momentum, variance } => {
                        Moms::F32(&mut momentum[r.clone()], &mut variance[r.clone()])
                    }
                    HostMoments::Int8(m) => Moms::Int8(Moments8 {
                        momentum: &mut m.momentum[r.clone()],
                        variance: &mut m.variance[r.clone()],
                        momentum_scales: &mut m.momentum_scales[b.clone()],
                        variance_scales: &mut m.variance_scales[b],
                    }),
                };
                let p = &mut p[r.clone()];
                let bytes = &mut param[r.start * es..r.end * es];
                let before = delayed.then(|| p.to_vec());
                match (acc, dt) {
                    (Some(a), DType::F32) => {
                        m.step(cpu, s, p, Grad::F32(&a[r.clone()]), ParamCopy::None)?;
                        bytes.copy_from_slice(bytemuck::cast_slice(p));
                    }
                    (Some(a), DType::F16) => m.step(
                        cpu,
                        s,
                        p,
                        Grad::F32(&a[r.clone()]),
                        ParamCopy::F16(typed_mut(bytes)?),
                    )?,
                    (Some(a), DType::BF16) => m.step(
                        cpu,
                        s,
                        p,
                        Grad::F32(&a[r.clone()]),
                        ParamCopy::Bf16(typed_mut(bytes)?),
                    )?,
                    (None, dt) => host_step(cpu, s, dt, None, bytes, p, m)?,
                    (_, other) => {
                        return Err(Error::WrongDType {
                            what: "parameters stepped by HybridAdam".into(),
                            dtype: other,
                            expected: "a model float (F32, F16 or BF16)",
                        })
                    }
                }
                if let Some(before) = before {
                    write_params(bytes, &before, dt)?;
                }
            }
            Ok(())
        }
        GroupChunks::Device {
            device,
            stream,
            param,
            master: Some(p),
            moments: Some(moments),
        } => {
            if acc.is_some() {
                return Err(Error::Internal {
                    what: "accumulated gradients of a device group (they live on the host)".into(),
                });
            }
            let n = p.len() / 4;
            for r in &v.ranges {
                let (r, blocks) = match moments {
                    DeviceMoments::F32 { .. } => (r.clone(), 0..0),
                    DeviceMoments::Int8 { .. } => blocks_of(r, n)?,
                };
                let f = |b| f32_span(b, &r);
                let grad = param.view(r.start * es, r.len() * es)?;
                let before = if delayed {
                    let b = device.alloc(r.len() * 4)?;
                    device.copy_d2d(stream, f(p)?, b.view(0, r.len() * 4)?)?;
                    Some(b)
                } else {
                    None
                };
                let copy = (dt != DType::F32).then_some((grad, dt));
                match moments {
                    DeviceMoments::F32 { momentum, variance } => ops::adam(
                        device,
                        stream,
                        s,
                        AdamOperands {
                            params: f(p)?,
                            momentum: f(momentum)?,
                            variance: f(variance)?,
                            grad,
                            grad_dtype: dt,
                            copy,
                        },
                    )?,
                    DeviceMoments::Int8 {
                        momentum,
                        variance,
                        elems,
                    } => {
                        let b = &blocks;
                        let at = scales_at(elems) + 4 * b.start;
                        ops::adam8(
                            device,
                            stream,
                            s,
                            Adam8Operands {
                                params: f(p)?,
                                momentum: momentum.view(r.start, r.len())?,
                                variance: variance.view(r.start, r.len())?,
                                momentum_scales: momentum.view(at, 4 * b.len())?,
                                variance_scales: variance.view(at, 4 * b.len())?,
                                grad,
                                grad_dtype: dt,
                                copy,
                            },
                        )?
                    }
                }
                if dt == DType::F32 {
                    device.copy_d2d(stream, f(p)?, grad)?;
                }
                if let Some(b) = before {
                    ops::cast(
                        device,
                        stream,
                        b.view(0, r.len() * 4)?,
                        DType::F32,
                        grad,
                        dt,
                    )?;
                }
            }
            Ok(())
        }
        _ => unreachable!("all four chunks were asked for"),
    }
}

/// Writes `values` over a host range of parameters of `dt` (rounded to nearest even).
fn write_params(bytes: &mut [u8], values: &[f32], dt: DType) -> Result<()> {
    match dt {
        DType::F32 => bytes.copy_from_slice(bytemuck::cast_slice(values)),
        DType::F16 => {
            let out: &mut [half::f16] = typed_mut(bytes)?;
            out.iter_mut()
                .zip(values)
                .for_each(|(o, &v)| *o = half::f16::from_f32(v));
        }
        DType::BF16 => {
            let out: &mut [half::bf16] = typed_mut(bytes)?;
            out.iter_mut()
                .zip(values)
                .for_each(|(o, &v)| *o = half::bf16::from_f32(v));
        }
        other => {
            return Err(Error::WrongDType {
                what: "parameters written by HybridAdam".into(),
                dtype: other,
                expected: "a model float (F32, F16 or BF16)",
            })
        }
    }
    Ok(())
}

fn f32_span<'a>(
    b: &'a crate::device::DeviceBuffer,
    r: &std::ops::Range<usize>,
) -> Result<crate::device::DeviceView<'a>> {
    b.view(r.start * 4, r.len() * 4)
}

fn typed<T: bytemuck::Pod>(b: &[u8]) -> Result<&[T]> {
    bytemuck::try_cast_slice(b).map_err(|_| Error::Misaligned {
        what: "host chunk range",
        value: b.as_ptr() as usize,
        align: std::mem::align_of::<T>(),
    })
}

fn typed_mut<T: bytemuck::Pod>(b: &mut [u8]) -> Result<&mut [T]> {
    let p = b.as_ptr() as usize;
    bytemuck::try_cast_slice_mut(b).map_err(|_| Error::Misaligned {
        what: "host chunk range",
        value: p,
        align: std::mem::align_of::<T>(),
    })
}

/// Decodes `bytes` (elements of `dt`) into `out`.
pub(super) fn to_f32(bytes: &[u8], dt: DType, out: &mut [f32]) -> Result<()> {
    if dt == DType::F32 {
        out.copy_from_slice(
            bytemuck::try_cast_slice(bytes).map_err(|_| Error::Misaligned {
                what: "host chunk range",
                value: bytes.as_ptr() as usize,
                align: 4,
            })?,
        );
        return Ok(());
    }
    cast_bytes(bytes, dt, bytemuck::cast_slice_mut(out), DType::F32)
}

/// Encodes `src` into `bytes` (elements of `dt`), rounding to nearest even.
pub(super) fn from_f32(src: &[f32], bytes: &mut [u8], dt: DType) -> Result<()> {
    if dt == DType::F32 {
        bytes.copy_from_slice(bytemuck::cast_slice(src));
        return Ok(());
    }
    cast_bytes(bytemuck::cast_slice(src), DType::F32, bytes, dt)
}
