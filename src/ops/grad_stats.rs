use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use serde::Serialize;

use crate::device::kernel::{param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::adam::Grad;

/// Partial sums the CUDA kernel uses (one per block; `GS_PARTIALS` in `grad_stats.cuh`).
pub const GRAD_STATS_PARTIALS: usize = 256;
/// Threads per block of the partial kernel (`GS_THREADS` in `grad_stats.cuh`).
pub const GRAD_STATS_THREADS: u32 = 1024;
/// Bytes of the output range of [`grad_stats`]: the result (two f64) and room for
/// [`GRAD_STATS_PARTIALS`] partial results.
pub const GRAD_STATS_BYTES: usize = 16 * (1 + GRAD_STATS_PARTIALS);

/// Squared L2 norm and finiteness of a gradient slice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct GradStats {
    /// Sum of squares (of the values as stored, before any unscaling).
    pub sum_sq: f64,
    /// Whether an element is infinite or NaN.
    pub nonfinite: bool,
}

impl GradStats {
    /// Combines two partial results (in a fixed order, so combining is deterministic).
    pub fn merge(self, o: GradStats) -> GradStats {
        GradStats {
            sum_sq: self.sum_sq + o.sum_sq,
            nonfinite: self.nonfinite || o.nonfinite,
        }
    }
}

abi! {
    /// The parameters of `kernels/grad_stats.cu` (`grad_stats.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct GradStatsParams {
        /// Source elements.
        pub n: u64,
    }
}

abi! {
    /// The gradient statistics op: `src` (read) summarised into `out` (f64, written: the sum, the
    /// nonfinite flag, then scratch for the partial sums).
    static GRAD_STATS: KernelDesc = KernelDesc {
        name: "grad_stats",
        operands: &[
            OperandSpec::read("src", &DType::FLOATS),
            OperandSpec::write("out", &[DType::F64]),
        ],
        params: param_layout!(GradStatsParams, "grad_stats.cuh", [n]),
        check: Some(check),
        twin,
        cuda: CudaSide::Nvrtc {
            source: "grad_stats.cu",
            plan,
        },
    };
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: GradStatsParams = info.params()?;
    if info.len(0) as u64 != p.n || info.len(1) != GRAD_STATS_BYTES / 8 {
        return Err(info.desc.error(format!(
            "{} source elements for n = {}, {} output f64 (needs {})",
            info.len(0),
            p.n,
            info.len(1),
            GRAD_STATS_BYTES / 8
        )));
    }
    Ok(())
}

fn plan(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let t = info.dtype(0).map_or("?", |d| d.name());
    Ok(vec![
        Grid::linear(
            format!("grad_stats_partial_{t}"),
            GRAD_STATS_PARTIALS as u32,
            GRAD_STATS_THREADS,
        ),
        Grid::linear("grad_stats_final", 1, GRAD_STATS_PARTIALS as u32),
    ])
}

fn twin(args: &mut TwinArgs<'_>) -> Result<()> {
    let dtype = args
        .dtype(0)
        .ok_or_else(|| args.desc().error("no source"))?;
    let st = grad_stats_of(args.read(0)?, dtype)?;
    let out = args.take(1)?;
    out[..8].copy_from_slice(&st.sum_sq.to_le_bytes());
    out[8..16].copy_from_slice(&(st.nonfinite as u8 as f64).to_le_bytes());
    Ok(())
}

/// Gradient statistics: the sum of squares (accumulated in f64) and whether an element is
/// infinite or NaN, for gradient clipping and dynamic loss scaling. The op ([`grad_stats`], on a
/// device) writes them as two f64; its CPU twin and the host path share [`grad_stats_of`]. CUDA
/// runs `kernels/grad_stats.cu`.
///
/// It takes any f32, f16 or bf16 buffer, so it is also the global norm of gradients that live
/// outside chunks (say, parameters kept out of the chunk store): add the `sum_sq` of each buffer
/// ([`GradStats::merge`], in a fixed order) and take the square root; a buffer with an infinite
/// or NaN element sets `nonfinite`.
///
/// Gradient statistics of `src` (elements of `dtype`) on `stream`: the sum of squares and
/// whether an element is infinite or NaN, written as two f64 at the start of `out`, which must
/// hold [`GRAD_STATS_BYTES`] bytes (the rest is scratch; a longer range is used in its first
/// [`GRAD_STATS_BYTES`]) at an 8-byte aligned offset. Read them with [`Device::download`] and
/// [`read_grad_stats`].
pub fn grad_stats<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    src: impl Into<Input<'a>>,
    dtype: DType,
    out: impl Into<DeviceView<'b>>,
) -> Result<()> {
    let (src, out) = (src.into(), out.into());
    if out.len() < GRAD_STATS_BYTES {
        return Err(Error::TooFew {
            what: "output bytes of gradient statistics".into(),
            got: out.len(),
            need: GRAD_STATS_BYTES,
        });
    }
    let out = out.slice(0, GRAD_STATS_BYTES)?;
    let params = GradStatsParams {
        n: (src.len() / dtype.size()) as u64,
    };
    dev.launch(
        stream,
        &GRAD_STATS,
        &[
            Some(Operand::input(src, dtype)),
            Some(Operand::new(out, DType::F64)),
        ],
        bytemuck::bytes_of(&params),
    )
}

/// Decodes the result of [`grad_stats`] from the first 16 downloaded bytes.
pub fn read_grad_stats(bytes: &[u8]) -> Result<GradStats> {
    if bytes.len() < 16 {
        return Err(Error::TooFew {
            what: "bytes of gradient statistics".into(),
            got: bytes.len(),
            need: 16,
        });
    }
    let f = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i..i + 8]);
        f64::from_le_bytes(b)
    };
    Ok(GradStats {
        sum_sq: f(0),
        nonfinite: f(8) != 0.0,
    })
}

/// Elements summed per block: squares are accumulated in f64 within a block of this many
/// consecutive elements, in order, then block sums in order, so the result does not depend on
/// the instruction set or on the alignment of the bytes.
const BLOCK: usize = 256;

/// The statistics of `bytes`, little-endian elements of `dtype` (a model float).
pub fn grad_stats_of(bytes: &[u8], dtype: DType) -> Result<GradStats> {
    if !dtype.is_model_float() {
        return Err(Error::WrongDType {
            what: "a gradient whose statistics are taken".into(),
            dtype,
            expected: "a model float (F32, F16 or BF16)",
        });
    }
    if !bytes.len().is_multiple_of(dtype.size()) {
        return Err(Error::NotMultiple {
            what: "bytes of a gradient",
            value: bytes.len(),
            of: "its element size",
            divisor: dtype.size(),
        });
    }
    let mut sum = 0.0f64;
    let mut nonfinite = false;
    let mut buf = [0.0f32; BLOCK];
    for block in bytes.chunks(BLOCK * dtype.size()) {
        let len = block.len() / dtype.size();
        decode_block(block, dtype, &mut buf[..len]);
        let mut acc = 0.0f64;
        for &x in &buf[..len] {
            let x = x as f64;
            acc += x * x;
        }
        nonfinite |= !acc.is_finite();
        sum += acc;
    }
    Ok(GradStats {
        sum_sq: sum,
        nonfinite,
    })
}

/// Widens one block to f32: through a typed slice when the bytes are aligned (the vector
/// conversions of `half`), element by element otherwise; both give the same values.
fn decode_block(block: &[u8], dtype: DType, out: &mut [f32]) {
    match dtype {
        DType::F32 => match bytemuck::try_cast_slice::<u8, f32>(block) {
            Ok(v) => out.copy_from_slice(v),
            Err(_) => {
                for (o, c) in out.iter_mut().zip(block.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        },
        DType::F16 => match bytemuck::try_cast_slice::<u8, f16>(block) {
            Ok(v) => v.convert_to_f32_slice(out),
            Err(_) => {
                for (o, c) in out.iter_mut().zip(block.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
        },
        _ => match bytemuck::try_cast_slice::<u8, bf16>(block) {
            Ok(v) => v.convert_to_f32_slice(out),
            Err(_) => {
                for (o, c) in out.iter_mut().zip(block.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
        },
    }
}

/// The statistics of a gradient slice (see [`GradStats`]).
pub fn grad_stats_host(grad: Grad<'_>) -> GradStats {
    let (bytes, dtype): (&[u8], DType) = match grad {
        Grad::F32(g) => (bytemuck::cast_slice(g), DType::F32),
        Grad::F16(g) => (bytemuck::cast_slice(g), DType::F16),
        Grad::Bf16(g) => (bytemuck::cast_slice(g), DType::BF16),
    };
    // A model float and whole elements: cannot fail.
    grad_stats_of(bytes, dtype).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_unaligned_bytes_agree() {
        let v: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.37).collect();
        let mut bytes = vec![0u8; 1];
        bytes.extend_from_slice(bytemuck::cast_slice(&v));
        let a = grad_stats_of(bytemuck::cast_slice(&v), DType::F32).unwrap();
        let b = grad_stats_of(&bytes[1..], DType::F32).unwrap();
        assert_eq!(a, b);
        let exact: f64 = v.iter().map(|&x| (x as f64) * (x as f64)).sum();
        assert!((a.sum_sq - exact).abs() <= 1e-9 * exact);
        assert!(!a.nonfinite);
        let bad = [1.0f32, f32::NAN];
        assert!(
            grad_stats_of(bytemuck::cast_slice(&bad), DType::F32)
                .unwrap()
                .nonfinite
        );
        assert!(grad_stats_of(&[0u8; 3], DType::F16).is_err());
    }
}
