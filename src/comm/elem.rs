//! What a collective's buffers hold and how it reduces them: [`Elem`], [`ReduceOp`], and the
//! host element types ([`HostElem`]).

use serde::Serialize;

use crate::dtype::DType;

/// Element type of a collective's buffers: the crate's one [`DType`] (the name stays for the
/// collectives' signatures).
pub type Elem = DType;

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
