//! LayerNorm over the rows of an activation, fused with the residual add (GPT-2's blocks).

use super::act::Act;
use super::check_param;
use crate::device::PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::layernorm::Residual;
use crate::ops::{
    layernorm_backward, layernorm_backward_scratch_bytes, layernorm_forward, LayerNormBackward,
    LayerNormForward,
};
use crate::store::{BackwardPass, ForwardPass, ParamStore, PassKind};
use crate::tensor::{Init, TensorId};

/// LayerNorm over `cols` features (PyTorch's `nn.LayerNorm(cols)`): per row,
/// `y = (h − mean)·rstd·γ + β` with `rstd = 1/√(var + eps)` (biased variance), where `h` is the
/// input, or `x + r` when a residual is given (the residual stream; see
/// [`ops::layernorm`](crate::ops::layernorm_forward)). γ and β are `[cols]` parameters; activations are of
/// the store's parameter dtype, the statistics f32.
///
/// Backward writes dγ and dβ through [`Guard::accumulate_grad`](crate::store::Guard::accumulate_grad)
/// from f32 sums in the pool: a LayerNorm used once gets them cast straight into its slots, one
/// applied several times the sum of its uses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNorm {
    /// `[cols]` scale γ.
    pub gamma: TensorId,
    /// `[cols]` shift β.
    pub beta: TensorId,
    /// Features.
    pub cols: usize,
    /// Added to the variance.
    pub eps: f32,
}

/// What [`LayerNorm::forward`] keeps for the backward: the normalised input `h` (the input
/// itself, shared, or `x + r`) and the f32 row means and reciprocal standard deviations.
#[derive(Debug)]
pub struct LayerNormSaved {
    h: Act,
    /// `[rows]` means, then `[rows]` rstd, f32.
    stats: PoolBlock,
}

impl LayerNormSaved {
    /// The normalised input: `x + r` with a residual (the residual stream's next value, which
    /// the caller carries on), else the input `x` itself.
    pub fn h(&self) -> &Act {
        &self.h
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.h.rows()
    }
}

impl LayerNorm {
    /// Registers `{name}.weight` (γ, ones) and `{name}.bias` (β, zeros), both `[cols]`.
    pub fn register(
        store: &mut impl ParamStore,
        name: &str,
        cols: usize,
        eps: f32,
    ) -> Result<LayerNorm> {
        LayerNorm::register_with(store, name, cols, eps, Init::Constant(1.0), Init::Zeros)
    }

    /// Registers γ and β with the given initialisations.
    pub fn register_with(
        store: &mut impl ParamStore,
        name: &str,
        cols: usize,
        eps: f32,
        gamma: Init,
        beta: Init,
    ) -> Result<LayerNorm> {
        if cols == 0 {
            return Err(Error::TooFew {
                what: format!("columns of layer norm '{name}'"),
                got: 0,
                need: 1,
            });
        }
        super::check_eps(name, eps)?;
        let gamma = store.register(&format!("{name}.weight"), &[cols], gamma)?;
        let beta = store.register(&format!("{name}.bias"), &[cols], beta)?;
        Ok(LayerNorm {
            gamma,
            beta,
            cols,
            eps,
        })
    }

    fn check_params<K: PassKind>(&self, g: &crate::store::Guard<'_, K>, d: DType) -> Result<()> {
        check_param(g, 0, &[self.cols], d)?;
        check_param(g, 1, &[self.cols], d)
    }

    /// Normalises `x` `[N, cols]`, or `h = x + residual` when given (same shape): returns `y`
    /// and what the backward needs. Shapes and types are checked before anything runs
    /// ([`Error::ActivationShape`]).
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, LayerNormSaved)> {
        let d = pass.param_dtype();
        x.expect("x", None, self.cols, d)?;
        if let Some(r) = residual {
            r.expect("residual", Some(x.rows()), self.cols, d)?;
        }
        let rows = x.rows();
        let g = pass.fetch(&[self.gamma, self.beta])?;
        self.check_params(&g, d)?;
        let pool = pass.pool();
        let y = Act::alloc(pool, rows, self.cols, d)?;
        let stats = pool.alloc(2 * rows * 4)?;
        let h = match residual {
            Some(_) => Some(Act::alloc(pool, rows, self.cols, d)?),
            None => None,
        };
        let ops = LayerNormForward {
            x: x.input(),
            residual: residual.zip(h.as_ref()).map(|(r, h)| Residual {
                r: r.input(),
                h: h.view(),
            }),
            gamma: g.param(0)?.into(),
            beta: g.param(1)?.into(),
            y: y.view(),
            mean: stats.view(0, rows * 4)?,
            rstd: stats.view(rows * 4, rows * 4)?,
        };
        layernorm_forward(
            pass.device(),
            pass.stream(),
            ops,
            rows,
            self.cols,
            self.eps,
            d,
        )?;
        let h = h.unwrap_or_else(|| x.clone());
        Ok((y, LayerNormSaved { h, stats }))
    }

    /// The backward of [`LayerNorm::forward`] from the output's gradient `dy`: returns the
    /// input's gradient — added to `dx_into` (the residual stream's gradient, returned shared)
    /// when given, else in a new activation — and writes dγ, dβ. Shapes and types are checked
    /// before anything runs; `dx_into` may not be `dy` or the saved input.
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: &LayerNormSaved,
        dy: &Act,
        dx_into: Option<&Act>,
    ) -> Result<Act> {
        let d = pass.param_dtype();
        let rows = saved.rows();
        saved.h.expect("saved input", None, self.cols, d)?;
        dy.expect("dy", Some(rows), self.cols, d)?;
        if let Some(dx) = dx_into {
            dx.expect("dx", Some(rows), self.cols, d)?;
            if dx.same_memory(dy) || dx.same_memory(&saved.h) {
                return Err(Error::Operands {
                    op: "layer norm backward",
                    reason: "`dx` is the memory of `dy` or of the saved input".into(),
                });
            }
        }
        let g = pass.fetch(&[self.gamma, self.beta])?;
        self.check_params(&g, d)?;
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let c4 = self.cols * 4;
        // dγ then dβ, f32: the op adds to them
        let sums = pool.alloc(2 * c4)?;
        let (dgamma, dbeta) = (sums.view(0, c4)?, sums.view(c4, c4)?);
        dev.memset(s, sums.view(0, 2 * c4)?, 0)?;
        let scratch_bytes = layernorm_backward_scratch_bytes(rows, self.cols);
        let scratch = pool.alloc(scratch_bytes)?;
        let dx = match dx_into {
            Some(dx) => dx.clone(),
            None => Act::alloc(pool, rows, self.cols, d)?,
        };
        let ops = LayerNormBackward {
            dy: dy.input(),
            h: saved.h.input(),
            mean: saved.stats.view(0, rows * 4)?.into(),
            rstd: saved.stats.view(rows * 4, rows * 4)?.into(),
            gamma: g.param(0)?.into(),
            dx: dx.view(),
            accumulate: dx_into.is_some(),
            dgamma,
            dbeta,
            param_grad_dtype: DType::F32,
            scratch: scratch.view(0, scratch_bytes)?,
        };
        layernorm_backward(dev, s, ops, rows, self.cols, d)?;
        // after the op read γ: the slots are the parameters' memory
        g.accumulate_grad(0, dgamma, DType::F32)?;
        g.accumulate_grad(1, dbeta, DType::F32)?;
        Ok(dx)
    }
}
