use serde::Serialize;

use crate::error::{Error, Result};
pub(crate) use crate::ops::AdamScalars;

/// How weight decay enters the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum WeightDecay {
    /// Adam: `wd · p` is added to the gradient (L2 regularization).
    L2,
    /// AdamW: the parameter is multiplied by `1 − lr · wd` before the update.
    Decoupled,
}

/// Adam and AdamW: the settings, the per-step scalars every kernel receives, and an f64
/// reference implementation the kernels are tested against.
///
/// One element of a step, in the order every kernel (CPU paths and `kernels/adam.cu`) computes
/// it, in f32:
///
/// ```text
/// g  = grad · grad_scale                     (loss-scale and clipping folded into grad_scale)
/// g  = g + l2 · p                            (Adam's L2 weight decay; l2 = 0 for AdamW)
/// m  = β1 · m + (1 − β1) · g
/// v  = β2 · v + (1 − β2) · g²
/// d  = √v · (1/√(1 − β2ᵗ)) + ε
/// p  = p − ((lr · wd) · p + (lr / (1 − β1ᵗ)) · (m / d))
///                                            (lr · wd: AdamW's decoupled decay; 0 for Adam)
/// ```
///
/// Without bias correction both correction terms are 1.
///
/// Settings of Adam / AdamW.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f32,
    /// Decay of the first moment.
    pub beta1: f32,
    /// Decay of the second moment.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Weight decay coefficient.
    pub weight_decay: f32,
    /// How weight decay is applied.
    pub decay: WeightDecay,
    /// Whether the moments are bias-corrected.
    pub bias_correction: bool,
}

impl AdamConfig {
    /// Adam with PyTorch's defaults (β = (0.9, 0.999), ε = 1e-8, no weight decay).
    pub fn adam(lr: f32) -> Self {
        AdamConfig {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decay: WeightDecay::L2,
            bias_correction: true,
        }
    }

    /// AdamW with decoupled weight decay `weight_decay`.
    pub fn adamw(lr: f32, weight_decay: f32) -> Self {
        AdamConfig {
            weight_decay,
            decay: WeightDecay::Decoupled,
            ..Self::adam(lr)
        }
    }

    /// Checks that every setting is finite and in range.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, v: f32, want| {
            Err(Error::BadValue {
                what: format!("Adam {what}"),
                value: v.into(),
                want,
            })
        };
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("lr", self.lr, "finite and at least 0");
        }
        for (what, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(what, b, "in [0, 1)");
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("eps", self.eps, "finite and above 0");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", self.weight_decay, "finite and at least 0");
        }
        Ok(())
    }

    /// The scalars of step `step` (counted from 1) with gradients multiplied by `grad_scale`.
    pub fn scalars(&self, step: u64, grad_scale: f32) -> Result<AdamScalars> {
        self.validate()?;
        if step == 0 {
            return Err(Error::BadValue {
                what: "an Adam step's number".into(),
                value: 0.0,
                want: "at least 1 (steps are counted from 1)",
            });
        }
        if !grad_scale.is_finite() {
            return Err(Error::BadValue {
                what: "an Adam step's gradient scale".into(),
                value: grad_scale.into(),
                want: "finite",
            });
        }
        let t = step.min(i32::MAX as u64) as i32;
        let (bc1, bc2) = if self.bias_correction {
            (
                1.0 - (self.beta1 as f64).powi(t),
                1.0 - (self.beta2 as f64).powi(t),
            )
        } else {
            (1.0, 1.0)
        };
        let (l2, decoupled) = match self.decay {
            WeightDecay::L2 => (self.weight_decay, 0.0),
            WeightDecay::Decoupled => (0.0, (self.lr as f64 * self.weight_decay as f64) as f32),
        };
        Ok(AdamScalars {
            grad_scale,
            l2,
            beta1: self.beta1,
            one_minus_beta1: 1.0 - self.beta1,
            beta2: self.beta2,
            one_minus_beta2: 1.0 - self.beta2,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            eps: self.eps,
            decoupled,
            step_size: (self.lr as f64 / bc1) as f32,
        })
    }
}

/// Reference Adam in f64 over f64 state, following the formula of the module docs without
/// rounding; the kernels are tested against it. The four slices must have one length.
pub fn reference_step(
    cfg: &AdamConfig,
    step: u64,
    grad_scale: f64,
    p: &mut [f64],
    m: &mut [f64],
    v: &mut [f64],
    grad: &[f64],
) -> Result<()> {
    if let Some(&len) = [m.len(), v.len(), grad.len()]
        .iter()
        .find(|&&l| l != p.len())
    {
        return Err(Error::SizeMismatch {
            src: len,
            dst: p.len(),
        });
    }
    let t = step as i32;
    let (b1, b2) = (cfg.beta1 as f64, cfg.beta2 as f64);
    let (bc1, bc2) = if cfg.bias_correction {
        (1.0 - b1.powi(t), 1.0 - b2.powi(t))
    } else {
        (1.0, 1.0)
    };
    let (lr, wd) = (cfg.lr as f64, cfg.weight_decay as f64);
    for i in 0..p.len() {
        let mut g = grad[i] * grad_scale;
        if cfg.decay == WeightDecay::L2 {
            g += wd * p[i];
        }
        m[i] = b1 * m[i] + (1.0 - b1) * g;
        v[i] = b2 * v[i] + (1.0 - b2) * g * g;
        let d = v[i].sqrt() / bc2.sqrt() + cfg.eps as f64;
        let decay = if cfg.decay == WeightDecay::Decoupled {
            lr * wd * p[i]
        } else {
            0.0
        };
        p[i] -= decay + lr / bc1 * (m[i] / d);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_errors() {
        let mut c = AdamConfig::adam(1e-3);
        c.beta1 = 1.0;
        assert!(c.validate().is_err());
        let mut c = AdamConfig::adam(f32::NAN);
        assert!(c.validate().is_err());
        c.lr = 1e-3;
        assert!(c.scalars(0, 1.0).is_err());
        assert!(c.scalars(1, f32::INFINITY).is_err());
        c.eps = 0.0;
        assert!(c.scalars(1, 1.0).is_err());
    }

    #[test]
    fn scalars_fold_bias_correction_and_decay() {
        let c = AdamConfig::adamw(0.1, 0.01);
        let s = c.scalars(1, 0.5).unwrap();
        assert!((s.step_size - 0.1 / 0.1).abs() < 1e-6);
        assert!((s.inv_sqrt_bc2 - 1.0 / 0.001f32.sqrt()).abs() < 1e-3);
        assert_eq!(s.l2, 0.0);
        assert!((s.decoupled - 0.001).abs() < 1e-10);
        let a = AdamConfig {
            weight_decay: 0.01,
            ..AdamConfig::adam(0.1)
        };
        let s = a.scalars(3, 1.0).unwrap();
        assert_eq!((s.l2, s.decoupled), (0.01, 0.0));
    }
}
