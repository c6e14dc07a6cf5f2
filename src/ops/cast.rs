//! Element-type conversion between fp32, fp16 and bf16 (round-to-nearest-even), the CPU twin of
//! `kernels/convert.cu`. fp16↔bf16 goes through fp32, which is exact on the way up, so both
//! sides round once.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Whether `from → to` is a supported conversion (every pair of distinct types is).
pub fn check_supported(from: DType, to: DType) -> Result<()> {
    if from == to {
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
