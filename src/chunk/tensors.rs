//! What the chunk manager and the data-parallel ZeRO manager share about tensors: views of
//! fetched tensors, the checks of a registration and an access, the element encodings, and the
//! trainer API (`crate::store`) builds on.

use std::sync::Arc;

use crate::device::{DeviceBuffer, DeviceView, PoolBlock};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::TensorId;

/// Memory of a fetched tensor on the device: valid until the tensor is released.
#[derive(Clone, Debug)]
pub struct TensorView {
    /// The tensor.
    pub id: TensorId,
    /// Element type.
    pub dtype: DType,
    /// Elements.
    pub numel: usize,
    buf: ViewBuf,
    offset: usize,
}

/// What a view keeps alive: a chunk's device copy, or a pooled buffer (a ZeRO gather buffer).
#[derive(Clone, Debug)]
pub(crate) enum ViewBuf {
    Chunk(Arc<DeviceBuffer>),
    Pooled(Arc<PoolBlock>),
}

impl TensorView {
    pub(crate) fn new(
        id: TensorId,
        dtype: DType,
        numel: usize,
        buf: ViewBuf,
        offset: usize,
    ) -> Self {
        TensorView {
            id,
            dtype,
            numel,
            buf,
            offset,
        }
    }

    /// The device memory of the tensor, for copies and kernels.
    pub fn view(&self) -> DeviceView<'_> {
        let buf: &DeviceBuffer = match &self.buf {
            ViewBuf::Chunk(b) => b,
            ViewBuf::Pooled(b) => b,
        };
        // in range by construction: the slot lies inside its chunk
        buf.view(self.offset, self.numel * self.dtype.size())
            .expect("tensor slot inside its chunk")
    }
}

/// Elements of a tensor of `shape`: an error for none or more than `usize` holds.
pub(crate) fn numel_of(name: &str, shape: &[usize]) -> Result<usize> {
    // every list's bytes (4 per element at most) must be addressable
    match shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) {
        Some(n) if n > 0 && n <= isize::MAX as usize / 4 => Ok(n),
        Some(0) => Err(Error::Empty {
            what: format!("tensor '{name}' of shape {shape:?}"),
        }),
        Some(n) => Err(Error::TooLarge {
            what: format!("elements of tensor '{name}' of shape {shape:?} (4 bytes each)"),
            requested: n as u128,
            limit: (isize::MAX as usize / 4) as u64,
        }),
        None => Err(Error::Overflow {
            what: format!("the elements of tensor '{name}' of shape {shape:?}"),
        }),
    }
}

pub(crate) fn check_distinct(ids: &[TensorId]) -> Result<()> {
    if ids.is_empty() {
        return Err(Error::Empty {
            what: "the tensors of an access".into(),
        });
    }
    for (i, a) in ids.iter().enumerate() {
        if ids[i + 1..].contains(a) {
            return Err(Error::Conflict {
                what: format!("tensor {a}"),
                with: "itself: it is listed twice in one access".into(),
            });
        }
    }
    Ok(())
}

/// Adds `times` forward uses to each of `ids` (an id listed twice counts twice), the uses a
/// store declares without a fetch: `uses(t)` gives tensor `t`'s name and forward-use count.
/// Every id must be known and already fetched in this forward pass (a count above 0), and the
/// counts must not overflow; otherwise nothing changes.
pub(crate) fn add_forward_uses<T>(
    tensors: &mut [T],
    ids: &[TensorId],
    times: u32,
    uses: fn(&mut T) -> (&str, &mut u32),
) -> Result<()> {
    let mut want = Vec::with_capacity(ids.len());
    for &id in ids {
        let t = tensors
            .get_mut(id.index())
            .ok_or(Error::UnknownTensor { id: id.0 })?;
        let (name, n) = uses(t);
        if *n == 0 {
            return Err(Error::Conflict {
                what: format!("declaring forward uses of '{name}'"),
                with: "a forward pass that has not fetched it (fetch it first)".into(),
            });
        }
        let added = ids.iter().filter(|&&x| x == id).count() as u64 * u64::from(times);
        if u64::from(*n) + added > u64::from(u32::MAX) {
            return Err(Error::TooLarge {
                what: format!("forward uses of '{name}'"),
                requested: u128::from(*n) + u128::from(added),
                limit: u64::from(u32::MAX),
            });
        }
        want.push(id);
    }
    for id in want {
        *uses(&mut tensors[id.index()]).1 += times;
    }
    Ok(())
}

/// Encodes f32 values as `dtype` little-endian bytes (see [`crate::dtype::encode_f32`]).
pub fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    crate::dtype::encode_f32(v, dtype)
}

/// Decodes `dtype` little-endian bytes to f32 (see [`crate::dtype::decode_f32`]).
pub fn decode(b: &[u8], dtype: DType) -> Vec<f32> {
    crate::dtype::decode_f32(b, dtype)
}

/// The check of a fetch ahead, the same on both stores: every tensor of `ids` is known and
/// unused by this iteration (`uses(t)`: its name and its forward and backward uses), so its
/// slot holds its parameter and no backward of this iteration will write it.
pub(crate) fn check_unused<T>(
    tensors: &[T],
    ids: &[TensorId],
    uses: fn(&T) -> (&str, u32, u32),
) -> Result<()> {
    check_distinct(ids)?;
    for &id in ids {
        let t = tensors
            .get(id.index())
            .ok_or(Error::UnknownTensor { id: id.0 })?;
        let (name, fwd, bwd) = uses(t);
        if fwd > 0 || bwd > 0 {
            return Err(Error::Conflict {
                what: format!("a fetch ahead of '{name}'"),
                with: format!(
                    "its uses in this iteration ({fwd} forward, {bwd} backward): a fetch ahead \
                     is for tensors whose backward comes in a later iteration"
                ),
            });
        }
    }
    Ok(())
}

/// The checks of a state copy's moment and pairs, the same on both stores: the optimizer lists
/// copy between iterations and after the backward pass, the parameter list (`params`) between
/// iterations only; each pair is two known tensors of one shape (`shape(t)`: name and shape),
/// and no tensor is written twice or both read and written.
pub(crate) fn check_copy<T>(
    stage: Option<crate::tensor::Stage>,
    params: bool,
    tensors: &[T],
    pairs: &[(TensorId, TensorId)],
    shape: fn(&T) -> (&str, &[usize]),
) -> Result<()> {
    use crate::tensor::Stage;
    match stage {
        None => {}
        Some(Stage::Optimizer) if !params => {}
        Some(s) => {
            return Err(Error::WrongStage {
                call: "copy_state (between iterations; masters and moments also between the \
                       backward pass and the step)"
                    .into(),
                stage: s.name(),
            })
        }
    }
    let get = |id: TensorId| {
        tensors
            .get(id.index())
            .map(shape)
            .ok_or(Error::UnknownTensor { id: id.0 })
    };
    for (k, &(a, b)) in pairs.iter().enumerate() {
        let ((na, sa), (nb, sb)) = (get(a)?, get(b)?);
        if a == b || sa != sb {
            return Err(Error::Conflict {
                what: format!("copy_state from '{na}' {sa:?}"),
                with: format!(
                    "'{nb}' {sb:?}: a pair copies between two distinct tensors of one shape"
                ),
            });
        }
        let clash = pairs
            .iter()
            .enumerate()
            .any(|(j, &(x, y))| (j != k && y == b) || x == b);
        if clash {
            return Err(Error::Conflict {
                what: format!("copy_state writing '{nb}'"),
                with: "another pair that writes or reads it (the pairs' tensors to write are \
                       written once and read by none)"
                    .into(),
            });
        }
    }
    Ok(())
}
