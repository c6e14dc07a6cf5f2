//! What a collective's buffers hold and how it reduces them: [`Elem`], [`ReduceOp`], and the
//! host element types ([`HostElem`]).

use std::fmt;

use serde::Serialize;

use crate::dtype::DType;

/// Element type of a collective's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Elem {
    /// Unsigned bytes.
    U8,
    /// 32-bit signed integers.
    I32,
    /// 64-bit signed integers.
    I64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
}

impl Elem {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Elem::U8 => 1,
            Elem::F16 | Elem::BF16 => 2,
            Elem::I32 | Elem::F32 => 4,
            Elem::I64 | Elem::F64 => 8,
        }
    }

    /// Short lowercase name.
    pub const fn name(self) -> &'static str {
        match self {
            Elem::U8 => "u8",
            Elem::I32 => "i32",
            Elem::I64 => "i64",
            Elem::F16 => "f16",
            Elem::BF16 => "bf16",
            Elem::F32 => "f32",
            Elem::F64 => "f64",
        }
    }
}

impl From<DType> for Elem {
    fn from(d: DType) -> Self {
        match d {
            DType::F32 => Elem::F32,
            DType::F16 => Elem::F16,
            DType::BF16 => Elem::BF16,
        }
    }
}

impl fmt::Display for Elem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction of a reducing collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum (NaN wins on the in-process backend).
    Max,
    /// Minimum (NaN wins on the in-process backend).
    Min,
    /// Sum divided by the world size (integer types truncate).
    Avg,
}

/// Host element types the host helpers ([`Communicator::all_reduce_host`]) accept.
///
/// [`Communicator::all_reduce_host`]: super::Communicator::all_reduce_host
pub trait HostElem: bytemuck::Pod {
    /// The collective element type.
    const ELEM: Elem;
}

impl HostElem for u8 {
    const ELEM: Elem = Elem::U8;
}
impl HostElem for i32 {
    const ELEM: Elem = Elem::I32;
}
impl HostElem for i64 {
    const ELEM: Elem = Elem::I64;
}
impl HostElem for f32 {
    const ELEM: Elem = Elem::F32;
}
impl HostElem for f64 {
    const ELEM: Elem = Elem::F64;
}
