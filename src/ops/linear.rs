//! A fully connected layer on the device, `Y[N, out] = X[N, in]·Wᵀ + b`, with the weight stored
//! `[out, in]` (PyTorch's `nn.Linear`, llm.c), composed of [`gemm`](crate::ops::gemm()) and the
//! bias ops:
//!
//! * forward: [`bias_rows`] writes `b` into every row of `Y`, then one GEMM with β = 1 adds
//!   `X·Wᵀ` — the bias costs one write of `Y` and no extra read (without a bias: β = 0);
//! * backward: `dX (+)= dY·W`, `dW (+)= dYᵀ·X` (GEMMs with β = 0, or 1 to accumulate, e.g. over
//!   micro-batches), and `db (+)= Σ_rows dY` ([`bias_grad`], deterministic).
//!
//! All of one element type except `db`, which may be f32 (what a mixed-precision trainer's
//! gradient holds) or the storage type. A GPT-2 `Conv1D` weight (`[in, out]`) is the transpose:
//! load it transposed, or call [`gemm`](crate::ops::gemm()) directly with `trans_b(false)`.
//!
//! ```
//! use tidemem::device::{Device, SimConfig};
//! use tidemem::ops::linear::{linear_forward, LinearShape};
//! use tidemem::DType;
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let s = dev.new_stream()?;
//! let shape = LinearShape { rows: 1, inputs: 2, outputs: 2 };
//! let x = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 2.0]))?;
//! let w = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 0.0, 1.0, 1.0]))?; // [out, in]
//! let b = dev.upload(&s, bytemuck::cast_slice(&[0.5f32, -1.0]))?;
//! let y = dev.alloc(8)?;
//! linear_forward(&dev, &s, shape, &x, &w, Some((&b).into()), &y, DType::F32)?;
//! let y: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &y)?);
//! assert_eq!(y, [1.5, 2.0]);
//! # Ok(()) }
//! ```

use crate::device::{Device, DeviceView, Input, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::bias::{bias_grad, bias_rows, BiasGrad};
use crate::ops::gemm::{gemm, Gemm};

/// The shape of a linear layer: `rows` samples of `inputs` features → `outputs` features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearShape {
    /// Samples (`N`: batch × sequence).
    pub rows: usize,
    /// Input features.
    pub inputs: usize,
    /// Output features.
    pub outputs: usize,
}

/// The gradients [`linear_backward`] writes. `dx`, `dw` and `db` are each optional (a frozen
/// weight, a first layer that needs no input gradient, no bias).
#[derive(Clone, Copy, Debug, Default)]
pub struct LinearGrads<'a> {
    /// `[rows, inputs]`, and whether to add to it (`+=`) rather than overwrite.
    pub dx: Option<(DeviceView<'a>, bool)>,
    /// `[outputs, inputs]`, and whether to add to it.
    pub dw: Option<(DeviceView<'a>, bool)>,
    /// The bias gradient (`[outputs]`, f32 or the storage type) and its scratch, at least
    /// [`bias_grad_scratch_bytes`](crate::ops::bias_grad_scratch_bytes)`(rows, outputs)`.
    pub db: Option<BiasGradOut<'a>>,
}

/// Where [`linear_backward`] writes the bias gradient.
#[derive(Clone, Copy, Debug)]
pub struct BiasGradOut<'a> {
    /// `[outputs]`.
    pub db: DeviceView<'a>,
    /// `db`'s element type.
    pub dtype: DType,
    /// Add to `db` rather than overwrite it.
    pub accumulate: bool,
    /// Scratch for the ordered column sums.
    pub scratch: DeviceView<'a>,
}

/// `y = x·wᵀ + b` on `stream`: `x` `[rows, inputs]`, `w` `[outputs, inputs]`, `b`
/// `[outputs]` (optional), `y` `[rows, outputs]`, all of `dtype`.
#[allow(clippy::too_many_arguments)]
pub fn linear_forward<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    shape: LinearShape,
    x: impl Into<Input<'a>>,
    w: impl Into<Input<'b>>,
    b: Option<Input<'_>>,
    y: impl Into<DeviceView<'c>>,
    dtype: DType,
) -> Result<()> {
    let (x, w, y) = (x.into(), w.into(), y.into());
    // the GEMM's operands are checked before the bias is written: nothing is written on error
    for (name, len, rows, cols) in [
        ("x", x.len(), shape.rows, shape.inputs),
        ("w", w.len(), shape.outputs, shape.inputs),
        ("y", y.len(), shape.rows, shape.outputs),
    ] {
        let need = rows
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(dtype.size()));
        let Some(need) = need else {
            return Err(Error::Overflow {
                what: format!("linear: the bytes of `{name}` [{rows}, {cols}] of {dtype}"),
            });
        };
        if len < need {
            return Err(Error::TooFew {
                what: format!("linear: bytes in the view of `{name}` [{rows}, {cols}] of {dtype}"),
                got: len,
                need,
            });
        }
    }
    let mut g = Gemm::new(shape.rows, shape.outputs, shape.inputs).trans_b(true);
    if let Some(b) = b {
        bias_rows(dev, stream, b, y, shape.rows, shape.outputs, dtype)?;
        g = g.beta(1.0);
    }
    gemm(dev, stream, &g, x, w, y, dtype)
}

/// The gradients of [`linear_forward`] on `stream` from `dy` `[rows, outputs]`: `dx = dy·w`,
/// `dw = dyᵀ·x`, `db = Σ_rows dy`, each into its slot of `grads` (overwritten or added to).
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    shape: LinearShape,
    x: impl Into<Input<'a>>,
    w: impl Into<Input<'b>>,
    dy: impl Into<Input<'c>>,
    grads: LinearGrads<'_>,
    dtype: DType,
) -> Result<()> {
    let (x, w, dy) = (x.into(), w.into(), dy.into());
    let beta = |acc: bool| if acc { 1.0 } else { 0.0 };
    if let Some((dx, acc)) = grads.dx {
        let g = Gemm::new(shape.rows, shape.inputs, shape.outputs).beta(beta(acc));
        gemm(dev, stream, &g, dy, w, dx, dtype)?;
    }
    if let Some((dw, acc)) = grads.dw {
        let g = Gemm::new(shape.outputs, shape.inputs, shape.rows)
            .trans_a(true)
            .beta(beta(acc));
        gemm(dev, stream, &g, dy, x, dw, dtype)?;
    }
    if let Some(db) = grads.db {
        let ops = BiasGrad {
            dy,
            db: db.db,
            db_dtype: db.dtype,
            accumulate: db.accumulate,
            scratch: db.scratch,
        };
        bias_grad(dev, stream, ops, shape.rows, shape.outputs, dtype)?;
    }
    Ok(())
}
