//! Composition: the [`Layer`] trait and the [`Sequential`] container, which keeps what each
//! layer saved and runs the backward in reverse itself.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};

use super::act::Act;
use super::layernorm::{LayerNorm, LayerNormSaved};
use super::linear::Linear;
use crate::error::{Error, Result};
use crate::store::{BackwardPass, ForwardPass};
use crate::tensor::TensorId;

/// A layer with one input and one output: its forward returns what its own backward takes
/// (`Saved`, a type of the layer's, so a hand-written backward cannot be handed another
/// layer's saved state), and a [`Sequential`] can chain it. [`Linear`], [`LayerNorm`],
/// [`Relu`](super::Relu), [`Gelu`](super::Gelu) and [`Sequential`] are layers; a layer written
/// by hand implements the trait to join them.
pub trait Layer: Send + Sync {
    /// What the forward keeps for the backward.
    type Saved: Send + 'static;

    /// The output for `x`, from the pass's pool, and what the backward needs.
    fn forward(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, Self::Saved)>;

    /// The backward from what the forward saved and the output's gradient `dy`: writes the
    /// parameters' gradients into their slots and returns the input's gradient when `need_dx`
    /// (a layer may return it anyway; the first layer of a model is not asked for it).
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: Self::Saved,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>>;

    /// The parameters the layer fetches, in order (none by default).
    fn params(&self) -> Vec<TensorId> {
        Vec::new()
    }
}

/// What a [`Linear`] run as a [`Layer`] keeps for its backward: its input, in a type of its
/// own (an activation's saved state cannot take its place).
#[derive(Clone, Debug)]
pub struct LinearInput(Act);

impl LinearInput {
    /// The layer's input.
    pub fn input(&self) -> &Act {
        &self.0
    }
}

impl Layer for Linear {
    type Saved = LinearInput;

    fn forward(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, LinearInput)> {
        Ok((Linear::forward(self, pass, x)?, LinearInput(x.clone())))
    }

    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: LinearInput,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        Linear::backward(self, pass, &saved.0, dy, need_dx)
    }

    fn params(&self) -> Vec<TensorId> {
        Linear::params(self)
    }
}

impl Layer for LayerNorm {
    type Saved = LayerNormSaved;

    fn forward(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, LayerNormSaved)> {
        LayerNorm::forward(self, pass, x, None)
    }

    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: LayerNormSaved,
        dy: &Act,
        _need_dx: bool,
    ) -> Result<Option<Act>> {
        LayerNorm::backward(self, pass, &saved, dy, None).map(Some)
    }

    fn params(&self) -> Vec<TensorId> {
        vec![self.gamma, self.beta]
    }
}

/// A [`Layer`] behind a pointer: its saved state type-erased, checked when it comes back.
trait AnyLayer: Send + Sync {
    fn forward_any(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, Box<dyn Any + Send>)>;
    fn backward_any(
        &self,
        pass: &BackwardPass<'_>,
        saved: Box<dyn Any + Send>,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>>;
    fn params_any(&self) -> Vec<TensorId>;
}

impl<L: Layer> AnyLayer for L {
    fn forward_any(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, Box<dyn Any + Send>)> {
        let (y, saved) = self.forward(pass, x)?;
        Ok((y, Box::new(saved)))
    }

    fn backward_any(
        &self,
        pass: &BackwardPass<'_>,
        saved: Box<dyn Any + Send>,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        let saved = saved
            .downcast::<L::Saved>()
            .map_err(|_| Error::SavedMismatch {
                layer: std::any::type_name::<L>().into(),
            })?;
        self.backward(pass, *saved, dy, need_dx)
    }

    fn params_any(&self) -> Vec<TensorId> {
        self.params()
    }
}

/// Layers run one after the other: [`Sequential::forward`] runs them in order and keeps what
/// each saved ([`SequentialSaved`]); [`Sequential::backward`] runs their backwards in reverse
/// from the output's gradient, so a model is registration, one forward, one loss and one
/// backward call. A `Sequential` is itself a [`Layer`].
///
/// # Example
///
/// A 4 → 8 → 3 GELU classifier, one step of its forward, loss and backward:
///
/// ```
/// use tidemem::nn::{Act, CrossEntropyLoss, Gelu, Linear, Sequential};
/// use tidemem::optim::{AdamConfig, HybridAdam, HybridConfig};
/// use tidemem::prelude::*;
///
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let mut cfg = ManagerConfig::new(64, Policy::Tide);
/// cfg.param_dtype = DType::F32;
/// let mut m = ChunkManager::new(dev, cfg)?;
/// let model = Sequential::new()
///     .push(Linear::register(&mut m, "fc1", 4, 8, true, None)?)
///     .push(Gelu)
///     .push(Linear::register(&mut m, "fc2", 8, 3, true, None)?);
/// let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-2)))?;
///
/// let fwd = m.forward()?;
/// let x = Act::upload(fwd.pool(), fwd.stream(), 2, 4, DType::F32, &[0.5; 8])?;
/// let (logits, saved) = model.forward(&fwd, &x)?;
/// let (loss, dlogits) = CrossEntropyLoss::new(3)?.forward(&fwd, &adam, logits, &[0, 2])?;
/// fwd.finish()?;
/// let bwd = m.backward()?;
/// model.backward(&bwd, saved, &dlogits, false)?;
/// bwd.finish()?;
/// m.step(&mut adam)?;
/// assert!((loss.read()? - 3f32.ln()).abs() < 0.5);
/// # Ok(()) }
/// ```
pub struct Sequential {
    id: u64,
    layers: Vec<Box<dyn AnyLayer>>,
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequential")
            .field("layers", &self.layers.len())
            .finish()
    }
}

impl Default for Sequential {
    fn default() -> Self {
        Sequential::new()
    }
}

/// What [`Sequential::forward`] keeps: each layer's saved state, for the backward of the same
/// `Sequential` only.
pub struct SequentialSaved {
    of: u64,
    saved: Vec<Box<dyn Any + Send>>,
}

impl std::fmt::Debug for SequentialSaved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequentialSaved")
            .field("layers", &self.saved.len())
            .finish()
    }
}

impl Sequential {
    /// A container of no layer (its forward is the identity).
    pub fn new() -> Sequential {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Sequential {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            layers: Vec::new(),
        }
    }

    /// The container with `layer` appended.
    #[allow(clippy::should_implement_trait)]
    pub fn push(mut self, layer: impl Layer + 'static) -> Sequential {
        self.layers.push(Box::new(layer));
        self
    }

    /// The layers in it.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether it holds no layer.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Every layer's parameters, in order.
    pub fn params(&self) -> Vec<TensorId> {
        self.layers.iter().flat_map(|l| l.params_any()).collect()
    }

    /// The layers' forwards in order from `x`: the last output and what the backward needs.
    pub fn forward(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, SequentialSaved)> {
        let mut saved = Vec::with_capacity(self.layers.len());
        let mut y = x.clone();
        for l in &self.layers {
            let (out, s) = l.forward_any(pass, &y)?;
            saved.push(s);
            y = out;
        }
        Ok((y, SequentialSaved { of: self.id, saved }))
    }

    /// The layers' backwards in reverse from the output's gradient `dy`: the parameters'
    /// gradients into their slots, and the input's gradient when `need_dx` (the first layer is
    /// asked for it only then). `saved` must come from this container's forward, else
    /// [`Error::SavedMismatch`].
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: SequentialSaved,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        if saved.of != self.id || saved.saved.len() != self.layers.len() {
            return Err(Error::SavedMismatch {
                layer: "a Sequential".into(),
            });
        }
        let mut g = dy.clone();
        for (i, (l, s)) in self.layers.iter().zip(saved.saved).enumerate().rev() {
            let need = i > 0 || need_dx;
            match l.backward_any(pass, s, &g, need)? {
                Some(dx) => g = dx,
                None if need => {
                    return Err(Error::Internal {
                        what: format!("layer {i} of a Sequential gave no input gradient"),
                    })
                }
                None => return Ok(None),
            }
        }
        Ok(Some(g))
    }
}

impl Layer for Sequential {
    type Saved = SequentialSaved;

    fn forward(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, SequentialSaved)> {
        Sequential::forward(self, pass, x)
    }

    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: SequentialSaved,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        Sequential::backward(self, pass, saved, dy, need_dx)
    }

    fn params(&self) -> Vec<TensorId> {
        Sequential::params(self)
    }
}
