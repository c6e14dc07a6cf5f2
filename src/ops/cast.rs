use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::device::kernel::{grid_stride, param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};

abi! {
    /// The parameters of `kernels/cast.cu` (`cast.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct CastParams {
        /// Elements.
        pub n: u64,
    }
}

const FLOATS: &[DType] = &DType::FLOATS;

abi! {
    /// The cast op: `src` (read) converted into `dst` (written), both of one of the model floats.
    static CAST: KernelDesc = KernelDesc {
        name: "cast",
        operands: &[
            OperandSpec::read("src", FLOATS),
            OperandSpec::write("dst", FLOATS),
        ],
        params: param_layout!(CastParams, "cast.cuh", [n]),
        check: Some(check),
        twin,
        cuda: CudaSide::Nvrtc {
            source: "cast.cu",
            plan,
        },
    };
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: CastParams = info.params()?;
    let (from, to) = (info.dtype(0), info.dtype(1));
    if from == to {
        return Err(Error::UnsupportedCast {
            from: from.unwrap_or(DType::F32),
            to: to.unwrap_or(DType::F32),
        });
    }
    if info.len(0) as u64 != p.n || info.len(1) as u64 != p.n {
        return Err(info.desc.error(format!(
            "cast of {} {} elements into room for {} {} elements (n = {})",
            info.len(0),
            from.map_or("?", |d| d.name()),
            info.len(1),
            to.map_or("?", |d| d.name()),
            p.n
        )));
    }
    Ok(())
}

fn plan(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let (from, to) = (info.dtype(0), info.dtype(1));
    let name = format!(
        "cast_{}_{}",
        from.map_or("?", |d| d.name()),
        to.map_or("?", |d| d.name())
    );
    Ok(grid_stride(name, info.len(0)))
}

fn twin(args: &mut TwinArgs<'_>) -> Result<()> {
    let (from, to) = (args.dtype(0), args.dtype(1));
    let (Some(from), Some(to)) = (from, to) else {
        return Err(args.desc().error("cast operands missing"));
    };
    let src = args.read(0)?;
    let dst = args.take(1)?;
    cast_bytes(src, from, dst, to)
}

/// Element-type conversion between fp32, fp16 and bf16 (round-to-nearest-even): the op
/// ([`cast`], on a device) and its CPU twin ([`cast_bytes`]); CUDA runs `kernels/cast.cu`.
/// fp16↔bf16 goes through fp32, which is exact on the way up, so both sides round once.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// let src = dev.upload(&s, bytemuck::cast_slice(&[1.5f32, -2.0]))?;
/// let dst = dev.alloc(4)?;
/// tidemem::ops::cast(&dev, &s, &src, DType::F32, &dst, DType::BF16)?;
/// let h = dev.download(&s, &dst)?;
/// assert_eq!(half::bf16::from_le_bytes([h[0], h[1]]).to_f32(), 1.5);
/// # Ok(()) }
/// ```
///
/// Converts the elements of `src` (type `from`) into `dst` (type `to`) on `stream`, with
/// round-to-nearest-even; the same type is a plain device copy. Both ranges hold the same
/// number of elements and must not overlap.
pub fn cast<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    src: impl Into<Input<'a>>,
    from: DType,
    dst: impl Into<DeviceView<'b>>,
    to: DType,
) -> Result<()> {
    let (src, dst) = (src.into(), dst.into());
    if from == to && src.len() == dst.len() && from.is_model_float() {
        if !src.offset().is_multiple_of(from.size()) || !src.len().is_multiple_of(from.size()) {
            return Err(Error::Misaligned {
                what: "cast source",
                value: src.offset(),
                align: from.size(),
            });
        }
        return dev.copy_d2d(stream, src, dst);
    }
    let params = CastParams {
        n: (src.len() / from.size()) as u64,
    };
    dev.launch(
        stream,
        &CAST,
        &[Some(Operand::input(src, from)), Some(Operand::new(dst, to))],
        bytemuck::bytes_of(&params),
    )
}

/// Whether `from → to` is a supported conversion (every pair of distinct model floats is).
pub fn check_supported(from: DType, to: DType) -> Result<()> {
    if from == to || !from.is_model_float() || !to.is_model_float() {
        return Err(Error::UnsupportedCast { from, to });
    }
    Ok(())
}

fn typed<'a, T: bytemuck::Pod>(b: &'a [u8], what: &'static str) -> Result<&'a [T]> {
    bytemuck::try_cast_slice(b).map_err(|_| Error::Misaligned {
        what,
        value: b.as_ptr() as usize,
        align: std::mem::align_of::<T>(),
    })
}

fn typed_mut<'a, T: bytemuck::Pod>(b: &'a mut [u8], what: &'static str) -> Result<&'a mut [T]> {
    let p = b.as_ptr() as usize;
    bytemuck::try_cast_slice_mut(b).map_err(|_| Error::Misaligned {
        what,
        value: p,
        align: std::mem::align_of::<T>(),
    })
}

/// Converts the elements in `src` (of type `from`) into `dst` (of type `to`). Both slices must
/// be aligned for their element types and hold the same number of elements.
pub fn cast_bytes(src: &[u8], from: DType, dst: &mut [u8], to: DType) -> Result<()> {
    if !src.len().is_multiple_of(from.size())
        || !dst.len().is_multiple_of(to.size())
        || src.len() / from.size() != dst.len() / to.size()
    {
        return Err(Error::SizeMismatch {
            src: src.len(),
            dst: dst.len(),
        });
    }
    const S: &str = "source pointer";
    const D: &str = "destination pointer";
    match (from, to) {
        (DType::F32, DType::F16) => {
            typed_mut::<f16>(dst, D)?.convert_from_f32_slice(typed(src, S)?)
        }
        (DType::F32, DType::BF16) => {
            typed_mut::<bf16>(dst, D)?.convert_from_f32_slice(typed(src, S)?)
        }
        (DType::F16, DType::F32) => typed::<f16>(src, S)?.convert_to_f32_slice(typed_mut(dst, D)?),
        (DType::BF16, DType::F32) => {
            typed::<bf16>(src, S)?.convert_to_f32_slice(typed_mut(dst, D)?)
        }
        (DType::F16, DType::BF16) => {
            for (d, s) in typed_mut::<bf16>(dst, D)?
                .iter_mut()
                .zip(typed::<f16>(src, S)?)
            {
                *d = bf16::from_f32(s.to_f32());
            }
        }
        (DType::BF16, DType::F16) => {
            for (d, s) in typed_mut::<f16>(dst, D)?
                .iter_mut()
                .zip(typed::<bf16>(src, S)?)
            {
                *d = f16::from_f32(s.to_f32());
            }
        }
        _ => return Err(Error::UnsupportedCast { from, to }),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_to_nearest_even() {
        // 1 + 2^-11 lies exactly between two f16 values: ties to even (1.0).
        let x = [
            1.0f32 + 2f32.powi(-11),
            1.0 + 3.0 * 2f32.powi(-11),
            65504.0,
            1e-8,
            -2.5,
        ];
        let mut out = [0u8; 10];
        cast_bytes(bytemuck::cast_slice(&x), DType::F32, &mut out, DType::F16).unwrap();
        let h: &[f16] = bytemuck::cast_slice(&out);
        assert_eq!(h[0].to_f32(), 1.0);
        assert_eq!(h[1].to_f32(), 1.0 + 2.0 * 2f32.powi(-10));
        assert_eq!(h[2].to_f32(), 65504.0);
        assert_eq!(h[4].to_f32(), -2.5);
    }

    #[test]
    fn round_trips_are_exact_on_the_way_up() {
        let bits: Vec<u16> = (0..=u16::MAX).step_by(7).collect();
        for (t, wide) in [(DType::F16, DType::F32), (DType::BF16, DType::F32)] {
            let mut f = vec![0f32; bits.len()];
            cast_bytes(
                bytemuck::cast_slice(&bits),
                t,
                bytemuck::cast_slice_mut(&mut f),
                wide,
            )
            .unwrap();
            let mut back = vec![0u16; bits.len()];
            cast_bytes(
                bytemuck::cast_slice(&f),
                wide,
                bytemuck::cast_slice_mut(&mut back),
                t,
            )
            .unwrap();
            for (a, b) in bits.iter().zip(&back) {
                let nan = f[bits.iter().position(|x| x == a).unwrap()].is_nan();
                assert!(nan || a == b, "{t}: {a:#x} -> {b:#x}");
            }
        }
    }

    #[test]
    fn bad_lengths_and_same_type_are_errors() {
        let mut out = [0u8; 4];
        assert!(matches!(
            cast_bytes(&[0u8; 12], DType::F32, &mut out, DType::F16),
            Err(Error::SizeMismatch { .. })
        ));
        assert!(check_supported(DType::F16, DType::F16).is_err());
    }
}
