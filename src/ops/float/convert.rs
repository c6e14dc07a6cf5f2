//! Conversions between f32 and the 16-bit model floats written as branch-free integer and
//! float operations, so that the twins' loops vectorise around them (`half`'s conversions test
//! for F16C at every call, or branch, and stay scalar). The results are `half`'s, bit for bit:
//! widening is exact, narrowing rounds to nearest even (overflow to ±inf), a NaN stays a NaN
//! with its payload kept where it fits and the quiet bit set.

/// The bits of an f16 as f32 (exact).
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    // Giesen's half_to_float: move exponent and mantissa into place and rebias; infinities and
    // NaNs get the f32 exponent, zeros and subnormals are normalised by one exact subtraction.
    const SHIFTED_EXP: u32 = 0x7c00 << 13;
    let h = h as u32;
    let shifted = (h & 0x7fff) << 13;
    let exp = shifted & SHIFTED_EXP;
    let normal = shifted + ((127 - 15) << 23);
    let quiet = if (h & 0x7fff) > 0x7c00 {
        0x0040_0000
    } else {
        0
    };
    let special = (normal + ((128 - 16) << 23)) | quiet;
    let magic = f32::from_bits(113 << 23);
    let sub = (f32::from_bits(normal + (1 << 23)) - magic).to_bits();
    let o = if exp == SHIFTED_EXP {
        special
    } else if exp == 0 {
        sub
    } else {
        normal
    };
    f32::from_bits(o | (h & 0x8000) << 16)
}

/// `x` rounded to the nearest f16 (ties to even), as bits.
#[inline(always)]
pub(crate) fn f32_to_f16(x: f32) -> u16 {
    // Giesen's float_to_half_fast3_rtne.
    const F16_MAX: u32 = (127 + 16) << 23; // 65536: from here on, infinity
    const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23; // 0.5
    let bits = x.to_bits();
    let sign = bits & 0x8000_0000;
    let a = bits ^ sign;
    // NaN: quieted, the top of the payload kept.
    let nan = 0x7e00 | ((a >> 13) & 0x3ff);
    let big = if a > 0x7f80_0000 { nan } else { 0x7c00 };
    // Below f16's smallest normal: one f32 addition rounds at 2^-24, f16's subnormal step.
    let sub = (f32::from_bits(a) + f32::from_bits(DENORM_MAGIC))
        .to_bits()
        .wrapping_sub(DENORM_MAGIC);
    // Normal: rebias, then round to nearest even on the 13 bits dropped.
    let odd = (a >> 13) & 1;
    let normal = a
        .wrapping_add(((15u32).wrapping_sub(127)) << 23)
        .wrapping_add(0xfff)
        .wrapping_add(odd)
        >> 13;
    let o = if a >= F16_MAX {
        big
    } else if a < (113 << 23) {
        sub
    } else {
        normal
    };
    (o | (sign >> 16)) as u16
}

/// The bits of a bf16 as f32 (exact; a NaN is quieted).
#[inline(always)]
pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let quiet = if (h & 0x7fff) > 0x7f80 { 0x40 } else { 0 };
    f32::from_bits((h | quiet) << 16)
}

/// `x` rounded to the nearest bf16 (ties to even), as bits; a NaN is quieted.
#[inline(always)]
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let o = if (b & 0x7fff_ffff) > 0x7f80_0000 {
        (b >> 16) | 0x40
    } else {
        rounded
    };
    o as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn widening_is_halfs_for_every_pattern() {
        for h in 0..=u16::MAX {
            let (a, b) = (f16_to_f32(h), f16::from_bits(h).to_f32());
            assert_eq!(a.to_bits(), b.to_bits(), "f16 {h:#06x}: {a} vs {b}");
            let (a, b) = (bf16_to_f32(h), bf16::from_bits(h).to_f32());
            assert_eq!(a.to_bits(), b.to_bits(), "bf16 {h:#06x}: {a} vs {b}");
        }
    }

    #[test]
    fn narrowing_is_halfs() {
        let check = |x: f32| {
            let (a, b) = (f32_to_f16(x), f16::from_f32(x).to_bits());
            assert_eq!(a, b, "f16 of {x:e} ({:#010x})", x.to_bits());
            let (a, b) = (f32_to_bf16(x), bf16::from_f32(x).to_bits());
            assert_eq!(a, b, "bf16 of {x:e} ({:#010x})", x.to_bits());
        };
        // A stride through every f32 pattern, and every f16 value with its neighbours, the
        // ties between two f16 values, and the edges.
        let mut bits = 0u32;
        while let Some(next) = bits.checked_add(65_521) {
            check(f32::from_bits(bits));
            bits = next;
        }
        for h in 0..=u16::MAX {
            let x = f16::from_bits(h).to_f32();
            for d in [-1i32, 0, 1] {
                check(f32::from_bits(x.to_bits().wrapping_add(d as u32)));
            }
            let next = f16::from_bits(h.wrapping_add(1)).to_f32();
            check(((x as f64 + next as f64) / 2.0) as f32);
            let x = bf16::from_bits(h).to_f32();
            check(f32::from_bits(x.to_bits() | 0x8000));
            check(f32::from_bits(x.to_bits() | 0x7fff));
        }
        for x in [
            0.0,
            -0.0,
            65504.0,
            65519.99,
            65520.0,
            f32::MAX,
            f32::INFINITY,
            f32::MIN_POSITIVE,
        ] {
            check(x);
            check(-x);
        }
    }
}
