//! `exp` and `ln` in f32 that the CPU twins and the CUDA kernels compute bit for bit alike.
//!
//! The host's libm and CUDA's `expf`/`logf` differ by an ulp here and there, so an op built on
//! them can promise only a tolerance between its twin and the GPU. These two are written once,
//! as a fixed sequence of correctly rounded f32 operations (Cody–Waite range reduction and a
//! minimax polynomial, the Cephes coefficients), and mirrored in `kernels/math.cuh` with the
//! `__f*_rn` intrinsics: the same inputs give the same bits on the CPU, the emulator and a GPU
//! (NVRTC compiles with `--fmad=false`, Rust never fuses). Written without branches on the
//! hot path, they vectorise in the twins' loops.
//!
//! Accuracy (tested against f64 over the whole range): `exp` within 2 ulp where the result is
//! a normal f32, 0 where it would be subnormal (`x < -87.33654`), `+inf` above `88.72283`;
//! `ln` within 2 ulp on every positive finite input, subnormals included.

// Decimal literals as written in `math.cuh` (both sides round them to the same f32).
#![allow(clippy::excessive_precision)]

use std::f32::consts::LOG2_E as LOG2E;
const LN2_HI: f32 = 0.693_359_375;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Largest `x` whose `exp` is finite in f32 (rounded down).
pub const EXP_MAX: f32 = 88.722_83;
/// Smallest `x` whose `exp` is a normal f32 (rounded up); below it `exp` gives 0.
pub const EXP_MIN: f32 = -87.336_54;
const SQRT_HALF: f32 = 0.707_106_77;

/// A power of two, `2^e` for `e` in `-126..=127`.
#[inline(always)]
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// e^x in f32, bitwise equal to `tm_exp` of `kernels/math.cuh`.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(EXP_MIN, EXP_MAX);
    let n = (xc * LOG2E + 0.5).floor();
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let y = (p * (r * r) + r) + 1.0;
    // `n as i32` without a conversion instruction: `n` is an integer in -126..=128, so
    // `n + 1.5·2²³` is exact and holds `n` in its low mantissa bits. (A saturating `as` does
    // not vectorise: LLVM converts such a vector lane by lane.) The same integer as the
    // kernel's `(int)n`.
    let ni = (n + 12_582_912.0).to_bits() as i32 - 0x4b40_0000;
    let n1 = ni.min(127);
    let out = (y * pow2(n1)) * pow2(ni - n1);
    if x.is_nan() {
        x
    } else if x > EXP_MAX {
        f32::INFINITY
    } else if x < EXP_MIN {
        0.0
    } else {
        out
    }
}

/// The natural logarithm in f32, bitwise equal to `tm_log` of `kernels/math.cuh`: NaN for a
/// negative input or NaN, `-inf` at ±0, `+inf` at `+inf`.
#[inline(always)]
pub fn ln(x: f32) -> f32 {
    // Subnormals are scaled into the normal range first.
    let sub = x < f32::MIN_POSITIVE;
    let xs = if sub { x * 8_388_608.0 } else { x }; // 2^23
    let bits = xs.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 126 - if sub { 23 } else { 0 };
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f00_0000); // [0.5, 1)
    if m < SQRT_HALF {
        e -= 1;
        m = (m + m) - 1.0;
    } else {
        m -= 1.0;
    }
    let z = m * m;
    let mut p = 7.037_683_6e-2_f32;
    p = p * m - 1.151_461e-1;
    p = p * m + 1.167_699_9e-1;
    p = p * m - 1.242_014_1e-1;
    p = p * m + 1.424_932_3e-1;
    p = p * m - 1.666_805_8e-1;
    p = p * m + 2.000_071_4e-1;
    p = p * m - 2.499_999_4e-1;
    p = p * m + 3.333_333_1e-1;
    let fe = e as f32;
    let mut y = (p * m) * z;
    y += fe * LN2_LO;
    y -= 0.5 * z;
    let r = (m + y) + fe * LN2_HI;
    if x.is_nan() || x < 0.0 {
        f32::NAN
    } else if x == 0.0 {
        f32::NEG_INFINITY
    } else if x == f32::INFINITY {
        x
    } else {
        r
    }
}

/// tanh in f32 from [`exp`], bitwise equal to `tm_tanh` of `kernels/math.cuh`:
/// `sign(x)·(1 − 2/(e^{2|x|} + 1))`. Its error is absolute (within 2⁻²² of the exact value),
/// not relative: near 0 it loses relative precision, which is harmless where it is used,
/// inside `1 ± tanh` (GELU).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let t = 1.0 - 2.0 / (exp(2.0 * x.abs()) + 1.0);
    if x.is_nan() {
        x
    } else {
        t.copysign(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in ulp between an f32 and the exact value.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        let ulp = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()) as f64;
        (got as f64 - want).abs() / ulp
    }

    #[test]
    fn exp_within_two_ulp_over_its_range() {
        let (mut worst, mut at) = (0.0f64, 0.0f32);
        let mut x = EXP_MIN;
        while x <= EXP_MAX {
            let u = ulps(exp(x), (x as f64).exp());
            if u > worst {
                (worst, at) = (u, x);
            }
            x = f32::from_bits(if x < 0.0 {
                x.to_bits() - 997
            } else {
                x.to_bits() + 997
            });
            if x.to_bits() == 0x8000_0000 || (x < 0.0 && x > -1e-30) {
                x = 0.0;
            }
        }
        assert!(worst <= 2.0, "exp: {worst} ulp at {at}");
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(EXP_MAX).is_finite() && exp(EXP_MAX) > 3.4e38);
        assert!(exp(EXP_MIN) >= f32::MIN_POSITIVE);
    }

    #[test]
    fn ln_within_two_ulp_on_positive_floats() {
        let (mut worst, mut at) = (0.0f64, 0.0f32);
        let mut bits = 1u32; // the smallest subnormal
        while bits < f32::INFINITY.to_bits() {
            let x = f32::from_bits(bits);
            let want = (x as f64).ln();
            if want != 0.0 {
                let u = ulps(ln(x), want);
                if u > worst {
                    (worst, at) = (u, x);
                }
            }
            bits += 1009;
        }
        assert!(worst <= 2.0, "ln: {worst} ulp at {at:e}");
        assert_eq!(ln(1.0), 0.0);
    }

    #[test]
    fn tanh_within_an_absolute_bound() {
        let mut worst = 0.0f64;
        for i in -200_000..=200_000 {
            let x = i as f32 * 1e-4;
            worst = worst.max((tanh(x) as f64 - (x as f64).tanh()).abs());
        }
        assert!(worst <= 2f64.powi(-22), "tanh: {worst:e}");
        assert_eq!(tanh(100.0), 1.0);
        assert_eq!(tanh(-100.0), -1.0);
        assert_eq!(tanh(0.0), 0.0);
        assert!(tanh(f32::NAN).is_nan());
    }

    #[test]
    fn ln_edges() {
        assert_eq!(ln(0.0), f32::NEG_INFINITY);
        assert_eq!(ln(-0.0), f32::NEG_INFINITY);
        assert_eq!(ln(f32::INFINITY), f32::INFINITY);
        assert!(ln(-1.0).is_nan() && ln(f32::NAN).is_nan());
        assert!((ln(f32::MAX) - 88.722_84).abs() < 1e-4);
    }
}
