//! The model floats as the CPU twins see them: storage in f32, f16 or bf16, math in f32.
//! Widening is exact; narrowing rounds to nearest even, as `store_f32` in
//! `kernels/common.cuh` does.

use half::{bf16, f16};

mod convert;

/// A storage type of model floats (`f32`, `f16`, `bf16`).
pub trait Float: bytemuck::Pod + Send + Sync {
    /// Positive zero.
    const ZERO: Self;

    /// The value as f32 (exact).
    fn get(self) -> f32;
    /// `x` rounded to this type (nearest even).
    fn put(x: f32) -> Self;

    /// Whether the value is greater than zero (false for NaN and both zeros).
    #[inline(always)]
    fn positive(self) -> bool {
        self.get() > 0.0
    }

    /// `src` widened to f32: `src` itself for f32, else converted into `buf`, which must be at
    /// least as long.
    #[inline(always)]
    fn widen<'a>(src: &'a [Self], buf: &'a mut [f32]) -> &'a [f32] {
        let buf = &mut buf[..src.len()];
        for (o, &x) in buf.iter_mut().zip(src) {
            *o = x.get();
        }
        buf
    }

    /// `src` rounded into `dst` (the shorter length).
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        for (o, &x) in dst.iter_mut().zip(src) {
            *o = Self::put(x);
        }
    }
}

impl Float for f32 {
    const ZERO: f32 = 0.0;
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
    #[inline(always)]
    fn put(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn widen<'a>(src: &'a [f32], _buf: &'a mut [f32]) -> &'a [f32] {
        src
    }
}

// The 16-bit conversions are `half`'s results computed without branches (`convert`), so the
// twins' loops vectorise.
impl Float for f16 {
    const ZERO: f16 = f16::ZERO;
    #[inline(always)]
    fn get(self) -> f32 {
        convert::f16_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn put(x: f32) -> Self {
        f16::from_bits(convert::f32_to_f16(x))
    }
    #[inline(always)]
    fn positive(self) -> bool {
        let b = self.to_bits();
        // Sign clear, not zero, not NaN: from the bits, without widening.
        b & 0x8000 == 0 && b != 0 && b <= 0x7c00
    }
}

impl Float for bf16 {
    const ZERO: bf16 = bf16::ZERO;
    #[inline(always)]
    fn get(self) -> f32 {
        convert::bf16_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn put(x: f32) -> Self {
        bf16::from_bits(convert::f32_to_bf16(x))
    }
    #[inline(always)]
    fn positive(self) -> bool {
        let b = self.to_bits();
        b & 0x8000 == 0 && b != 0 && b <= 0x7f80
    }
}

/// Runs `f` compiled for the widest vector unit the host has (AVX-512, else AVX2 + FMA,
/// detected at run time), so the twins' loops vectorise without building the whole crate for
/// one CPU. `f`'s body is inlined into a `#[target_feature]` function: mark the closure
/// `#[inline(always)]`, and the helpers it calls too. Results are the same bits on every path
/// (Rust never contracts `a * b + c` into an FMA, and every operation is IEEE).
#[inline(always)]
pub(crate) fn simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512dq")
        {
            // SAFETY: the features were detected on this CPU.
            return unsafe { x86::avx512(f) };
        }
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the features were detected on this CPU.
            return unsafe { x86::avx2(f) };
        }
    }
    f()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    /// # Safety
    /// The CPU has AVX-512 F, BW, VL and DQ.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
        f()
    }
}

/// Evaluates `$body` with the type alias `$T` bound to the Rust type of the model float
/// `$dtype` (a [`DType`](crate::DType): `F16` → `half::f16`, `BF16` → `half::bf16`, anything
/// else → `f32`; a descriptor's signature has already limited the types).
macro_rules! with_float {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::dtype::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::dtype::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            _ => {
                type $T = f32;
                $body
            }
        }
    };
}
pub(crate) use with_float;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn size_of_float(d: DType) -> usize {
        with_float!(d, T => std::mem::size_of::<T>())
    }

    #[test]
    fn dispatch_picks_the_storage_type() {
        assert_eq!(size_of_float(DType::F32), 4);
        assert_eq!(size_of_float(DType::F16), 2);
        assert_eq!(size_of_float(DType::BF16), 2);
    }

    #[test]
    fn positive_is_greater_than_zero() {
        for b in 0..=u16::MAX {
            let (h, bf) = (f16::from_bits(b), bf16::from_bits(b));
            assert_eq!(h.positive(), h.to_f32() > 0.0, "{b:#x}");
            assert_eq!(bf.positive(), bf.to_f32() > 0.0, "{b:#x}");
        }
        for x in [0.0f32, -0.0, 1e-45, -1e-45, f32::NAN, f32::INFINITY] {
            assert_eq!(x.positive(), x > 0.0, "{x}");
        }
    }

    #[test]
    fn narrowing_rounds_to_nearest_even() {
        // 1 + 2^-11 lies halfway between two f16 values: it rounds to the even one (1.0).
        assert_eq!(f16::put(1.0 + 2f32.powi(-11)).get(), 1.0);
        assert_eq!(bf16::put(1.0 + 2f32.powi(-8)).get(), 1.0);
        assert_eq!(
            bf16::put(1.0 + 3.0 * 2f32.powi(-8)).get(),
            1.0 + 2f32.powi(-6)
        );
    }
}
