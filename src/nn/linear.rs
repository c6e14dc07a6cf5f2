//! A fully connected layer over the store: `y = x·Wᵀ + b`, weight `[outputs, inputs]`.

use super::act::Act;
use super::{check_param, hash_name};
use crate::device::Input;
use crate::device::PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::linear::{linear_backward, linear_forward, LinearGrads};
use crate::ops::{self, linear, BiasGrad};
use crate::store::{Backward, BackwardPass, ForwardPass, Guard, ParamStore, PassKind};
use crate::tensor::{Init, TensorId};

/// How many times an iteration uses a layer's parameters, which decides how backward writes
/// their gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightUse {
    /// Used once per iteration: backward writes the gradients straight into the parameters'
    /// slots ([`Guard::grad`]); a second use is an error.
    #[default]
    Once,
    /// Used more than once (a layer applied twice, a weight tied to another layer): every
    /// backward use adds its share through [`Guard::accumulate_grad`], and the store writes the
    /// sum at the last use.
    Shared,
}

/// A fully connected layer (PyTorch's `nn.Linear`): `y[N, outputs] = x[N, inputs]·Wᵀ + b`,
/// the weight stored `[outputs, inputs]`, the bias `[outputs]` (optional). Forward and backward
/// run [`ops::linear`](crate::ops::linear) on the pass's stream, reading the weight in place in
/// its chunk; activations are of the store's parameter dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear {
    /// `[outputs, inputs]`.
    pub weight: TensorId,
    /// `[outputs]`, if the layer has a bias.
    pub bias: Option<TensorId>,
    /// Input features.
    pub inputs: usize,
    /// Output features.
    pub outputs: usize,
    /// How backward writes the gradients.
    pub uses: WeightUse,
}

impl Linear {
    /// Registers `{name}.weight` `[outputs, inputs]` (`init`, or [`Linear::default_init`]) and,
    /// with `bias`, `{name}.bias` `[outputs]` (zeros).
    pub fn register(
        store: &mut impl ParamStore,
        name: &str,
        inputs: usize,
        outputs: usize,
        bias: bool,
        init: Option<Init>,
    ) -> Result<Linear> {
        let weight = init.unwrap_or_else(|| Linear::default_init(name, inputs));
        let bias = bias.then_some(Init::Zeros);
        Linear::register_with(store, name, inputs, outputs, weight, bias)
    }

    /// Registers the weight with `weight` and, when `bias` is given, the bias with it.
    pub fn register_with(
        store: &mut impl ParamStore,
        name: &str,
        inputs: usize,
        outputs: usize,
        weight: Init,
        bias: Option<Init>,
    ) -> Result<Linear> {
        for (what, n) in [("inputs", inputs), ("outputs", outputs)] {
            if n == 0 {
                return Err(Error::TooFew {
                    what: format!("{what} of linear layer '{name}'"),
                    got: 0,
                    need: 1,
                });
            }
        }
        let w = store.register(&format!("{name}.weight"), &[outputs, inputs], weight)?;
        let b = match bias {
            Some(init) => Some(store.register(&format!("{name}.bias"), &[outputs], init)?),
            None => None,
        };
        Ok(Linear {
            weight: w,
            bias: b,
            inputs,
            outputs,
            uses: WeightUse::Once,
        })
    }

    /// A layer over parameters registered already (a weight tied to another layer's): the
    /// shapes come from the store; the weight must be 2-D, the bias `[outputs]`.
    pub fn from_ids(
        store: &impl ParamStore,
        weight: TensorId,
        bias: Option<TensorId>,
        uses: WeightUse,
    ) -> Result<Linear> {
        let (outputs, inputs) = match *store.tensor_shape(weight)? {
            [o, i] => (o, i),
            ref s => {
                return Err(Error::Length {
                    what: format!(
                        "dimensions of tensor {weight} {s:?} as a linear weight ([outputs, inputs])"
                    ),
                    got: s.len(),
                    expected: 2,
                })
            }
        };
        if let Some(b) = bias {
            let s = store.tensor_shape(b)?;
            if s != [outputs] {
                // the bias of a [outputs, inputs] weight is [outputs]
                let d = store.param_dtype();
                return Err(Error::ParamShape {
                    tensor: b.0,
                    shape: s.to_vec(),
                    dtype: d,
                    expected: vec![outputs],
                    expected_dtype: d,
                });
            }
        }
        Ok(Linear {
            weight,
            bias,
            inputs,
            outputs,
            uses,
        })
    }

    /// PyTorch's default: uniform in `±1/√inputs`, seeded from the layer's name (the same
    /// name, the same weights).
    pub fn default_init(name: &str, inputs: usize) -> Init {
        let bound = 1.0 / (inputs.max(1) as f32).sqrt();
        Init::Uniform {
            seed: hash_name(name),
            lo: -bound,
            hi: bound,
        }
    }

    /// The same layer with its gradients written as `uses` says: [`WeightUse::Shared`] for a
    /// layer applied more than once per iteration.
    pub(crate) fn with_uses(self, uses: WeightUse) -> Linear {
        Linear { uses, ..self }
    }

    /// The same layer, applied more than once per iteration ([`WeightUse::Shared`]).
    pub fn shared(self) -> Linear {
        self.with_uses(WeightUse::Shared)
    }

    /// The parameters, in fetch order.
    pub fn params(&self) -> Vec<TensorId> {
        std::iter::once(self.weight).chain(self.bias).collect()
    }

    fn shape(&self, rows: usize) -> linear::LinearShape {
        linear::LinearShape {
            rows,
            inputs: self.inputs,
            outputs: self.outputs,
        }
    }

    fn check_params<K: PassKind>(&self, g: &Guard<'_, K>, dtype: DType) -> Result<()> {
        check_param(g, 0, &[self.outputs, self.inputs], dtype)?;
        if self.bias.is_some() {
            check_param(g, 1, &[self.outputs], dtype)?;
        }
        Ok(())
    }

    /// `y = x·Wᵀ + b` for `x` `[N, inputs]` of the store's parameter dtype; `y` comes from the
    /// pass's pool. A wrong shape or type is [`Error::ActivationShape`], before anything runs.
    pub fn forward(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<Act> {
        let d = pass.param_dtype();
        x.expect("x", None, self.inputs, d)?;
        let g = pass.fetch(&self.params())?;
        self.check_params(&g, d)?;
        let w = g.param(0)?;
        let b = match self.bias {
            Some(_) => Some(Input::from(g.param(1)?)),
            None => None,
        };
        let y = Act::alloc(pass.pool(), x.rows(), self.outputs, d)?;
        let shape = self.shape(x.rows());
        linear_forward(
            pass.device(),
            pass.stream(),
            shape,
            x.input(),
            w,
            b,
            y.view(),
            d,
        )?;
        Ok(y)
    }

    /// The backward of [`Linear::forward`] from the saved input `x` `[N, inputs]` and the
    /// output's gradient `dy` `[N, outputs]`: `dx = dy·W` (first: it reads the weight, whose
    /// memory the gradient then overwrites) when `need_dx`, then `dW = dyᵀ·x` and
    /// `db = Σ_rows dy` into the gradient slots (as [`Linear::uses`] says). Shapes and types are
    /// checked before anything runs.
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        x: &Act,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        Ok(self.backward_to(pass, x, dy, need_dx, false)?.0)
    }

    /// [`Linear::backward`] of a layer without a bias whose weight's gradient share is
    /// returned (a pool block of `[outputs, inputs]` in the parameter dtype) instead of added
    /// to the store: for a weight whose shares are summed elsewhere (tied across pipeline
    /// stages). The weight is fetched as by [`Linear::backward`].
    pub fn backward_returning(
        &self,
        pass: &BackwardPass<'_>,
        x: &Act,
        dy: &Act,
        need_dx: bool,
    ) -> Result<(Option<Act>, PoolBlock)> {
        if self.bias.is_some() {
            return Err(Error::Conflict {
                what: "returning a linear layer's weight share (backward_returning)".into(),
                with: "a bias: the share is returned only without one".into(),
            });
        }
        let (dx, share) = self.backward_to(pass, x, dy, need_dx, true)?;
        let share = share.ok_or_else(|| Error::Internal {
            what: "the weight's share asked for was not kept".into(),
        })?;
        Ok((dx, share))
    }

    fn backward_to(
        &self,
        pass: &BackwardPass<'_>,
        x: &Act,
        dy: &Act,
        need_dx: bool,
        keep: bool,
    ) -> Result<(Option<Act>, Option<PoolBlock>)> {
        let d = pass.param_dtype();
        x.expect("x", None, self.inputs, d)?;
        dy.expect("dy", Some(x.rows()), self.outputs, d)?;
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let rows = x.rows();
        let shape = self.shape(rows);
        let g = pass.fetch(&self.params())?;
        self.check_params(&g, d)?;
        let w = g.param(0)?;
        let dx = if need_dx {
            let dx = Act::alloc(pool, rows, self.inputs, d)?;
            let grads = LinearGrads {
                dx: Some((dx.view(), false)),
                ..LinearGrads::default()
            };
            linear_backward(dev, s, shape, x.input(), w, dy.input(), grads, d)?;
            Some(dx)
        } else {
            None
        };
        // the weight's gradient: into its slot, or a share into a pool buffer
        let w_bytes = self.outputs * self.inputs * d.size();
        let dw_only = |dw| LinearGrads {
            dw: Some((dw, false)),
            ..LinearGrads::default()
        };
        let mut kept = None;
        match (self.uses, keep) {
            (_, true) => {
                let share = pool.alloc(w_bytes)?;
                let view = share.view(0, w_bytes)?;
                linear_backward(dev, s, shape, x.input(), w, dy.input(), dw_only(view), d)?;
                kept = Some(share);
            }
            (WeightUse::Once, false) => {
                let slot = g.grad(0)?.view();
                linear_backward(dev, s, shape, x.input(), w, dy.input(), dw_only(slot), d)?;
            }
            (WeightUse::Shared, false) => {
                let share = pool.alloc(w_bytes)?;
                let view = share.view(0, w_bytes)?;
                linear_backward(dev, s, shape, x.input(), w, dy.input(), dw_only(view), d)?;
                g.accumulate_grad(0, view, d)?;
            }
        }
        if self.bias.is_some() {
            self.bias_backward(pass, &g, dy)?;
        }
        Ok((dx, kept))
    }

    /// `db = Σ_rows dy` into the bias's slot (param dtype), or as an f32 share.
    fn bias_backward(
        &self,
        pass: &BackwardPass<'_>,
        g: &Guard<'_, Backward>,
        dy: &Act,
    ) -> Result<()> {
        let (d, rows, n) = (pass.param_dtype(), dy.rows(), self.outputs);
        let scratch_bytes = ops::bias_grad_scratch_bytes(rows, n);
        let scratch = pass.pool().alloc(scratch_bytes)?;
        let scratch = scratch.view(0, scratch_bytes)?;
        let share = match self.uses {
            WeightUse::Once => None,
            WeightUse::Shared => Some(pass.pool().alloc(n * 4)?),
        };
        let (db, dtype) = match &share {
            None => (g.grad(1)?.view(), d),
            Some(b) => (b.view(0, n * 4)?, DType::F32),
        };
        let ops = BiasGrad {
            dy: dy.input(),
            db,
            db_dtype: dtype,
            accumulate: false,
            scratch,
        };
        ops::bias_grad(pass.device(), pass.stream(), ops, rows, n, d)?;
        if share.is_some() {
            g.accumulate_grad(1, db, DType::F32)?;
        }
        Ok(())
    }
}
