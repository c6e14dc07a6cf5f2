use std::fmt;

use half::{bf16, f16};
use serde::Serialize;

/// Element types: of model data (the floating-point types) and of every typed device operand
/// and collective buffer (the integer types too). One enum serves the device layer, the kernels
/// and the collectives.
///
/// Element type of a tensor, a kernel operand or a collective's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum DType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// IEEE 754 double precision.
    F64,
    /// Unsigned bytes.
    U8,
    /// 32-bit signed integers.
    I32,
    /// 32-bit unsigned integers (indices, offsets).
    U32,
    /// 64-bit signed integers.
    I64,
    /// 64-bit unsigned integers.
    U64,
}

impl DType {
    /// Every element type.
    pub const ALL: [DType; 9] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
    ];

    /// The floating-point types model data may have (parameters, gradients).
    pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Size of one element in bytes (also its alignment).
    pub const fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// Short lowercase name, as used in kernel names (`f32`, `f16`, `bf16`, `u32`, …).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
        }
    }

    /// Whether this is one of the model-data types of [`DType::FLOATS`].
    pub const fn is_model_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

/// Encodes f32 values as little-endian elements of `dtype`: fp16 and bf16 round to nearest even,
/// f64 widens exactly, and the integer types take Rust's saturating `as` conversion (NaN → 0).
/// The one codec of the crate for model data on the host.
pub fn encode_f32(v: &[f32], dtype: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * dtype.size());
    for &x in v {
        match dtype {
            DType::F32 => out.extend_from_slice(&x.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f32(x).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f32(x).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&(x as f64).to_le_bytes()),
            DType::U8 => out.push(x as u8),
            DType::I32 => out.extend_from_slice(&(x as i32).to_le_bytes()),
            DType::U32 => out.extend_from_slice(&(x as u32).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&(x as i64).to_le_bytes()),
            DType::U64 => out.extend_from_slice(&(x as u64).to_le_bytes()),
        }
    }
    out
}

/// Decodes little-endian elements of `dtype` to f32 (exact for fp16 and bf16; f64 and the wide
/// integers round to nearest). A trailing partial element is ignored.
pub fn decode_f32(b: &[u8], dtype: DType) -> Vec<f32> {
    b.chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            DType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
            DType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f32,
            DType::U8 => c[0] as f32,
            DType::I32 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32,
            DType::U32 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32,
            DType::I64 => i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f32,
            DType::U64 => u64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f32,
        })
        .collect()
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_names_are_distinct_and_consistent() {
        let names: std::collections::HashSet<_> = DType::ALL.iter().map(|d| d.name()).collect();
        assert_eq!(names.len(), DType::ALL.len());
        assert_eq!(DType::U8.size(), 1);
        assert_eq!(DType::BF16.size(), 2);
        assert_eq!(DType::U32.size(), 4);
        assert_eq!(DType::F64.size(), 8);
        assert!(DType::FLOATS.iter().all(|d| d.is_model_float()));
        assert!(!DType::U32.is_model_float());
    }

    #[test]
    fn codec_round_trips() {
        let v = [1.5f32, -2.0, 0.0, 256.0];
        for d in DType::FLOATS.into_iter().chain([DType::F64]) {
            assert_eq!(decode_f32(&encode_f32(&v, d), d), v, "{d}");
        }
        assert_eq!(
            decode_f32(&encode_f32(&[3.7, -1.0], DType::U32), DType::U32),
            [3.0, 0.0]
        );
        assert_eq!(
            encode_f32(&[1.0], DType::BF16),
            bf16::from_f32(1.0).to_le_bytes()
        );
    }
}
