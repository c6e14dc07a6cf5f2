//! Activations: row-major `[rows, cols]` device tensors from the store's non-model pool.

use std::fmt;
use std::sync::Arc;

use crate::device::{CachingAllocator, Device, DeviceView, Input, PoolBlock, Stream};
use crate::dtype::{decode_f32, encode_f32, DType};
use crate::error::{Error, Result};

/// An activation (or its gradient): `rows × cols` elements of `dtype`, row-major, in a block of
/// the store's non-model pool ([`Pass::pool`](crate::store::Pass::pool)), so the tide counts
/// it while it lives.
///
/// A clone shares the memory (the block returns to the pool when the last handle drops):
/// a saved input ([`LayerNormSaved::h`](super::LayerNormSaved::h)) is the same activation the caller keeps,
/// not a copy. Rows are samples (`batch × sequence`), columns features.
#[derive(Clone)]
pub struct Act {
    block: Arc<PoolBlock>,
    device: Device,
    rows: usize,
    cols: usize,
    dtype: DType,
}

impl fmt::Debug for Act {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Act")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl Act {
    /// An activation of `[rows, cols]` of `dtype` from `pool`, its contents unspecified.
    /// Fails with [`Error::Empty`] for an empty shape, [`Error::Overflow`] for one whose bytes
    /// overflow, and with the pool's error when it has no room.
    pub fn alloc(pool: &CachingAllocator, rows: usize, cols: usize, dtype: DType) -> Result<Act> {
        let bytes = rows
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| Error::Overflow {
                what: format!("the bytes of an activation of [{rows}, {cols}] {dtype}"),
            })?;
        if bytes == 0 {
            return Err(Error::Empty {
                what: format!("an activation of [{rows}, {cols}] {dtype}"),
            });
        }
        Ok(Act {
            block: Arc::new(pool.alloc(bytes)?),
            device: pool.device().clone(),
            rows,
            cols,
            dtype,
        })
    }

    /// An activation holding `values` (`rows × cols`, row-major, converted to `dtype`), copied
    /// on `stream` without the host waiting ([`Device::upload_to`]): for input data and tests.
    pub fn upload(
        pool: &CachingAllocator,
        stream: &Stream,
        rows: usize,
        cols: usize,
        dtype: DType,
        values: &[f32],
    ) -> Result<Act> {
        let Some(n) = rows.checked_mul(cols) else {
            return Err(Error::Overflow {
                what: format!("the elements of an activation of [{rows}, {cols}]"),
            });
        };
        if values.len() != n {
            return Err(Error::Length {
                what: format!("values for an activation of [{rows}, {cols}]"),
                got: values.len(),
                expected: n,
            });
        }
        let act = Act::alloc(pool, rows, cols, dtype)?;
        let bytes = encode_f32(values, dtype);
        act.device.upload_to(stream, &bytes, act.view())?;
        Ok(act)
    }

    /// The values as f32 on the host, after the work enqueued on `stream`.
    pub fn to_f32(&self, stream: &Stream) -> Result<Vec<f32>> {
        let bytes = self.device.download(stream, self.input())?;
        Ok(decode_f32(&bytes, self.dtype))
    }

    /// The memory, for an op to write (exactly [`Act::len_bytes`]).
    pub fn view(&self) -> DeviceView<'_> {
        DeviceView::from(&**self.block)
            .slice(0, self.len_bytes())
            .expect("the block holds the activation's bytes")
    }

    /// The memory, for an op to read.
    pub fn input(&self) -> Input<'_> {
        self.view().into()
    }

    /// Rows (samples).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements.
    pub(crate) fn numel(&self) -> usize {
        self.rows * self.cols
    }

    /// Bytes.
    pub fn len_bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// Whether `other` is the same memory (a clone of this activation).
    pub fn same_memory(&self, other: &Act) -> bool {
        Arc::ptr_eq(&self.block, &other.block)
    }

    /// Checks that this activation, named `what` in the error, has `cols` columns of `dtype`
    /// and, when given, `rows` rows: [`Error::ActivationShape`] otherwise.
    pub fn expect(&self, what: &str, rows: Option<usize>, cols: usize, dtype: DType) -> Result<()> {
        let rows_ok = rows.is_none_or(|r| r == self.rows);
        if rows_ok && self.cols == cols && self.dtype == dtype {
            return Ok(());
        }
        Err(Error::ActivationShape {
            what: what.to_string(),
            rows: self.rows,
            cols: self.cols,
            dtype: self.dtype,
            expected_rows: rows,
            expected_cols: cols,
            expected_dtype: dtype,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimConfig;

    #[test]
    fn upload_round_trips_and_clones_share_memory() {
        let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
        let s = dev.new_stream().unwrap();
        let pool = CachingAllocator::new(dev);
        let a = Act::upload(&pool, &s, 2, 3, DType::F16, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]).unwrap();
        assert_eq!((a.shape(), a.len_bytes()), ([2, 3], 12));
        assert_eq!(a.to_f32(&s).unwrap(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);
        let b = a.clone();
        assert!(b.same_memory(&a));
        let c = Act::alloc(&pool, 2, 3, DType::F16).unwrap();
        assert!(!c.same_memory(&a));
        assert!(a.expect("a", Some(2), 3, DType::F16).is_ok());
        assert!(matches!(
            a.expect("a", Some(2), 4, DType::F16),
            Err(Error::ActivationShape {
                cols: 3,
                expected_cols: 4,
                ..
            })
        ));
        assert!(a.expect("a", None, 3, DType::F32).is_err());
        assert!(Act::alloc(&pool, 0, 3, DType::F32).is_err());
        assert!(Act::upload(&pool, &s, 2, 2, DType::F32, &[1.0; 3]).is_err());
    }

    #[test]
    fn activations_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Act>();
    }
}
