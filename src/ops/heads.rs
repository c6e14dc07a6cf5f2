//! The layouts around attention, pure data movement (the same bits on every backend):
//!
//! * [`qkv_split`]: the fused projection's output `qkv` `[B, T, 3, H, D]` (GPT-2's `c_attn`:
//!   queries, keys and values side by side, each `C = H·D` channels split into heads) into
//!   `q`, `k`, `v` `[B, H, T, D]`, one contiguous `[T, D]` matrix per (batch, head) for the
//!   batched GEMMs; [`qkv_merge`] is its backward (`dq`, `dk`, `dv` into `dqkv`).
//! * [`heads_merge`]: the attention output `y` `[B, H, T, D]` back into `[B, T, C]`;
//!   [`heads_split`] is its backward.
//!
//! ```
//! use tidemem::device::{Device, SimConfig};
//! use tidemem::ops::heads::{heads_merge, Heads};
//! use tidemem::DType;
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let s = dev.new_stream()?;
//! // B = 1, T = 2, H = 2, D = 1: y[h][t] = 10·h + t
//! let y = dev.upload(&s, bytemuck::cast_slice(&[0.0f32, 1.0, 10.0, 11.0]))?;
//! let out = dev.alloc(16)?;
//! heads_merge(&dev, &s, Heads::new(1, 2, 2, 1), &y, &out, DType::F32)?;
//! let out: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &out)?);
//! assert_eq!(out, [0.0, 10.0, 1.0, 11.0]); // [t][h]
//! # Ok(()) }
//! ```

use crate::device::kernel::{grid_stride, param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The shape of multi-head attention's tensors (`kernels/heads.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct HeadsParams {
    /// Batch `B`.
    pub batch: u64,
    /// Sequence length `T`.
    pub seq: u64,
    /// Heads `H`.
    pub heads: u64,
    /// Channels per head `D` (the model's channels are `C = H·D`).
    pub(crate) head_dim: u64,
}

/// The shape `[B, T, H, D]` of one attention layer's activations.
pub type Heads = HeadsParams;

impl HeadsParams {
    /// `B`, `T`, `H`, `D`.
    pub fn new(batch: usize, seq: usize, heads: usize, head_dim: usize) -> Self {
        HeadsParams {
            batch: batch as u64,
            seq: seq as u64,
            heads: heads as u64,
            head_dim: head_dim as u64,
        }
    }

    /// Elements of one `[B, H, T, D]` tensor, or `None` on overflow.
    pub(crate) fn elems(&self) -> Option<usize> {
        let n = self
            .batch
            .checked_mul(self.seq)?
            .checked_mul(self.heads)?
            .checked_mul(self.head_dim)?;
        usize::try_from(n).ok()
    }
}

const FLOATS: &[DType] = &DType::FLOATS;
const LAYOUT: crate::device::ParamLayout =
    param_layout!(HeadsParams, "heads.cuh", [batch, seq, heads, head_dim]);

abi! {
    /// `qkv` `[B, T, 3, H, D]` → `q`, `k`, `v` `[B, H, T, D]`.
    static QKV_SPLIT: KernelDesc = KernelDesc {
        name: "qkv_split",
        operands: &[
            OperandSpec::read("qkv", FLOATS),
            OperandSpec::write("q", FLOATS),
            OperandSpec::write("k", FLOATS),
            OperandSpec::write("v", FLOATS),
        ],
        params: LAYOUT,
        check: Some(|i| check(i, 3)),
        twin: |a| move_twin(a, Move::QkvSplit),
        cuda: CudaSide::Nvrtc {
            source: "heads.cu",
            plan: |i| plan(i, "qkv_split"),
        },
    };
}

abi! {
    /// `dq`, `dk`, `dv` `[B, H, T, D]` → `dqkv` `[B, T, 3, H, D]` (the backward of [`QKV_SPLIT`]).
    static QKV_MERGE: KernelDesc = KernelDesc {
        name: "qkv_merge",
        operands: &[
            OperandSpec::read("dq", FLOATS),
            OperandSpec::read("dk", FLOATS),
            OperandSpec::read("dv", FLOATS),
            OperandSpec::write("dqkv", FLOATS),
        ],
        params: LAYOUT,
        check: Some(|i| check(i, 3)),
        twin: |a| move_twin(a, Move::QkvMerge),
        cuda: CudaSide::Nvrtc {
            source: "heads.cu",
            plan: |i| plan(i, "qkv_merge"),
        },
    };
}

abi! {
    /// `y` `[B, H, T, D]` → `out` `[B, T, H, D]`.
    static HEADS_MERGE: KernelDesc = KernelDesc {
        name: "heads_merge",
        operands: &[
            OperandSpec::read("y", FLOATS),
            OperandSpec::write("out", FLOATS),
        ],
        params: LAYOUT,
        check: Some(|i| check(i, 1)),
        twin: |a| move_twin(a, Move::HeadsMerge),
        cuda: CudaSide::Nvrtc {
            source: "heads.cu",
            plan: |i| plan(i, "heads_merge"),
        },
    };
}

abi! {
    /// `dout` `[B, T, H, D]` → `dy` `[B, H, T, D]` (the backward of [`HEADS_MERGE`]).
    static HEADS_SPLIT: KernelDesc = KernelDesc {
        name: "heads_split",
        operands: &[
            OperandSpec::read("dout", FLOATS),
            OperandSpec::write("dy", FLOATS),
        ],
        params: LAYOUT,
        check: Some(|i| check(i, 1)),
        twin: |a| move_twin(a, Move::HeadsSplit),
        cuda: CudaSide::Nvrtc {
            source: "heads.cu",
            plan: |i| plan(i, "heads_split"),
        },
    };
}

/// Every operand holds `[B, H, T, D]` elements, except the interleaved one (`qkv`/`dqkv`:
/// `parts` times that), all of one type.
fn check(info: &LaunchInfo<'_>, parts: usize) -> Result<()> {
    let p: HeadsParams = info.params()?;
    let n = p
        .elems()
        .ok_or_else(|| info.desc.error(format!("{p:?} overflows")))?;
    let d = info.dtype(0);
    for (i, spec) in info.desc.operands.iter().enumerate() {
        let interleaved = spec.name.contains("qkv");
        let want = if interleaved { n * parts } else { n };
        let shape = if interleaved {
            format!(
                "[{}, {}, {parts}, {}, {}]",
                p.batch, p.seq, p.heads, p.head_dim
            )
        } else {
            format!("[{}, {}, {}, {}]", p.batch, p.heads, p.seq, p.head_dim)
        };
        if info.len(i) != want || info.dtype(i) != d {
            return Err(info.desc.error(format!(
                "operand `{}` holds {} {} elements; its shape {shape} needs {want} of the first \
                 operand's type ({})",
                spec.name,
                info.len(i),
                info.dtype(i).map_or("?", |d| d.name()),
                d.map_or("?", |d| d.name())
            )));
        }
    }
    Ok(())
}

fn plan(info: &LaunchInfo<'_>, entry: &str) -> Result<Vec<Grid>> {
    let p: HeadsParams = info.params()?;
    let bytes = info.dtype(0).map_or(4, |d| d.size());
    Ok(grid_stride(
        format!("{entry}_b{bytes}"),
        p.elems().unwrap_or(0),
    ))
}

#[derive(Clone, Copy)]
enum Move {
    QkvSplit,
    QkvMerge,
    HeadsMerge,
    HeadsSplit,
}

/// For each `[B, H, T, D]` row (the D elements of one (b, h, t)): its start there and in the
/// `[B, T, parts, H, D]` layout, part `part`.
fn rows(p: &HeadsParams, parts: usize, part: usize) -> impl Iterator<Item = (usize, usize)> {
    let (b, t, h, d) = (
        p.batch as usize,
        p.seq as usize,
        p.heads as usize,
        p.head_dim as usize,
    );
    let c = h * d;
    (0..b).flat_map(move |bi| {
        (0..h).flat_map(move |hi| {
            (0..t).map(move |ti| {
                let split = ((bi * h + hi) * t + ti) * d;
                let inter = ((bi * t + ti) * parts + part) * c + hi * d;
                (split, inter)
            })
        })
    })
}

fn move_typed<T: bytemuck::Pod>(a: &mut TwinArgs<'_>, how: Move) -> Result<()> {
    let p: HeadsParams = a.params()?;
    let d = p.head_dim as usize;
    match how {
        Move::QkvSplit => {
            let qkv = a.read_as::<T>(0)?;
            for (part, slot) in [(0, 1), (1, 2), (2, 3)] {
                let out = a.take_as::<T>(slot)?;
                for (s, i) in rows(&p, 3, part) {
                    out[s..s + d].copy_from_slice(&qkv[i..i + d]);
                }
            }
        }
        Move::QkvMerge => {
            let dqkv = a.take_as::<T>(3)?;
            for part in 0..3 {
                let src = a.read_as::<T>(part)?;
                for (s, i) in rows(&p, 3, part) {
                    dqkv[i..i + d].copy_from_slice(&src[s..s + d]);
                }
            }
        }
        Move::HeadsMerge => {
            let y = a.read_as::<T>(0)?;
            let out = a.take_as::<T>(1)?;
            for (s, i) in rows(&p, 1, 0) {
                out[i..i + d].copy_from_slice(&y[s..s + d]);
            }
        }
        Move::HeadsSplit => {
            let dout = a.read_as::<T>(0)?;
            let dy = a.take_as::<T>(1)?;
            for (s, i) in rows(&p, 1, 0) {
                dy[s..s + d].copy_from_slice(&dout[i..i + d]);
            }
        }
    }
    Ok(())
}

fn move_twin(a: &mut TwinArgs<'_>, how: Move) -> Result<()> {
    match a.dtype(0).map_or(4, |d| d.size()) {
        2 => move_typed::<u16>(a, how),
        _ => move_typed::<u32>(a, how),
    }
}

fn launch(
    dev: &Device,
    stream: &Stream,
    desc: &'static KernelDesc,
    shape: Heads,
    ops: [Option<Operand<'_>>; 2],
) -> Result<()> {
    dev.launch(stream, desc, &ops, bytemuck::bytes_of(&shape))
}

fn shape_ok(shape: &Heads) -> Result<()> {
    shape.elems().map(|_| ()).ok_or_else(|| Error::Overflow {
        what: format!("attention shape {shape:?}"),
    })
}

/// `q`, `k`, `v` `[B, H, T, D]` from `qkv` `[B, T, 3·H·D]`, on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn qkv_split<'a, 'b, 'c, 'd>(
    dev: &Device,
    stream: &Stream,
    shape: Heads,
    qkv: impl Into<Input<'a>>,
    q: impl Into<DeviceView<'b>>,
    k: impl Into<DeviceView<'c>>,
    v: impl Into<DeviceView<'d>>,
    dtype: DType,
) -> Result<()> {
    shape_ok(&shape)?;
    let ops = [
        Some(Operand::input(qkv.into(), dtype)),
        Some(Operand::new(q.into(), dtype)),
        Some(Operand::new(k.into(), dtype)),
        Some(Operand::new(v.into(), dtype)),
    ];
    dev.launch(stream, &QKV_SPLIT, &ops, bytemuck::bytes_of(&shape))
}

/// `dqkv` `[B, T, 3·H·D]` from `dq`, `dk`, `dv` `[B, H, T, D]`, on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn qkv_merge<'a, 'b, 'c, 'd>(
    dev: &Device,
    stream: &Stream,
    shape: Heads,
    dq: impl Into<Input<'a>>,
    dk: impl Into<Input<'b>>,
    dv: impl Into<Input<'c>>,
    dqkv: impl Into<DeviceView<'d>>,
    dtype: DType,
) -> Result<()> {
    shape_ok(&shape)?;
    let ops = [
        Some(Operand::input(dq.into(), dtype)),
        Some(Operand::input(dk.into(), dtype)),
        Some(Operand::input(dv.into(), dtype)),
        Some(Operand::new(dqkv.into(), dtype)),
    ];
    dev.launch(stream, &QKV_MERGE, &ops, bytemuck::bytes_of(&shape))
}

/// `out` `[B, T, H·D]` from `y` `[B, H, T, D]`, on `stream`.
pub fn heads_merge<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    shape: Heads,
    y: impl Into<Input<'a>>,
    out: impl Into<DeviceView<'b>>,
    dtype: DType,
) -> Result<()> {
    shape_ok(&shape)?;
    let ops = [
        Some(Operand::input(y.into(), dtype)),
        Some(Operand::new(out.into(), dtype)),
    ];
    launch(dev, stream, &HEADS_MERGE, shape, ops)
}

/// `dy` `[B, H, T, D]` from `dout` `[B, T, H·D]`, on `stream`.
pub fn heads_split<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    shape: Heads,
    dout: impl Into<Input<'a>>,
    dy: impl Into<DeviceView<'b>>,
    dtype: DType,
) -> Result<()> {
    shape_ok(&shape)?;
    let ops = [
        Some(Operand::input(dout.into(), dtype)),
        Some(Operand::new(dy.into(), dtype)),
    ];
    launch(dev, stream, &HEADS_SPLIT, shape, ops)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimConfig;

    fn f32s(dev: &Device, s: &Stream, b: &crate::device::DeviceBuffer) -> Vec<f32> {
        bytemuck::pod_collect_to_vec(&dev.download(s, b).unwrap())
    }

    #[test]
    fn split_then_merge_round_trips_and_matches_the_index_formula() {
        let dev = Device::sim(SimConfig::with_capacity(1 << 22)).unwrap();
        let s = dev.new_stream().unwrap();
        let (b, t, h, d) = (2, 3, 4, 5);
        let sh = Heads::new(b, t, h, d);
        let n = b * t * h * d;
        let qkv: Vec<f32> = (0..3 * n).map(|i| i as f32).collect();
        let src = dev.upload(&s, bytemuck::cast_slice(&qkv)).unwrap();
        let parts: Vec<_> = (0..3).map(|_| dev.alloc(4 * n).unwrap()).collect();
        qkv_split(
            &dev,
            &s,
            sh,
            &src,
            &parts[0],
            &parts[1],
            &parts[2],
            DType::F32,
        )
        .unwrap();
        for (part, buf) in parts.iter().enumerate() {
            let got = f32s(&dev, &s, buf);
            for bi in 0..b {
                for hi in 0..h {
                    for ti in 0..t {
                        for di in 0..d {
                            let want = qkv[((bi * t + ti) * 3 + part) * h * d + hi * d + di];
                            assert_eq!(got[((bi * h + hi) * t + ti) * d + di], want);
                        }
                    }
                }
            }
        }
        let back = dev.alloc(12 * n).unwrap();
        qkv_merge(
            &dev,
            &s,
            sh,
            &parts[0],
            &parts[1],
            &parts[2],
            &back,
            DType::F32,
        )
        .unwrap();
        assert_eq!(f32s(&dev, &s, &back), qkv);

        let out = dev.alloc(4 * n).unwrap();
        heads_merge(&dev, &s, sh, &parts[1], &out, DType::F32).unwrap();
        let again = dev.alloc(4 * n).unwrap();
        heads_split(&dev, &s, sh, &out, &again, DType::F32).unwrap();
        assert_eq!(f32s(&dev, &s, &again), f32s(&dev, &s, &parts[1]));
    }

    #[test]
    fn wrong_sizes_and_types_are_refused_before_any_write() {
        let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
        let s = dev.new_stream().unwrap();
        let sh = Heads::new(1, 2, 2, 2);
        let y = dev.upload(&s, &[0u8; 32]).unwrap();
        let out = dev.upload(&s, &[7u8; 28]).unwrap();
        let e = heads_merge(&dev, &s, sh, &y, &out, DType::F32).unwrap_err();
        assert!(e.to_string().contains("[1, 2, 2, 2]"), "{e}");
        assert_eq!(dev.download(&s, &out).unwrap(), vec![7u8; 28]);
        let half = dev.upload(&s, &[7u8; 16]).unwrap();
        assert!(heads_merge(&dev, &s, sh, &y, &half, DType::F16).is_err());
        assert_eq!(dev.download(&s, &half).unwrap(), vec![7u8; 16]);
        let huge = Heads::new(usize::MAX, 2, 2, 2);
        assert!(heads_merge(&dev, &s, huge, &y, &out, DType::F32).is_err());
    }
}
