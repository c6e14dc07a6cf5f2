use serde::Serialize;

use crate::error::{Error, Result};

/// Settings of a [`LossScaler`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ScalerConfig {
    /// The first scale.
    pub init_scale: f32,
    /// Factor applied after `growth_interval` clean steps (> 1).
    pub growth: f32,
    /// Factor applied on an overflow (in (0, 1)).
    pub backoff: f32,
    /// Clean steps in a row before the scale grows (≥ 1).
    pub growth_interval: u32,
    /// Overflows tolerated before the scale backs off (1: back off on every overflow).
    pub hysteresis: u32,
    /// Lowest scale.
    pub min_scale: f32,
    /// Highest scale.
    pub max_scale: f32,
}

impl Default for ScalerConfig {
    /// 2¹⁶, growth 2 every 1000 clean steps, backoff 0.5, hysteresis 2, scales in [1, 2²⁴].
    fn default() -> Self {
        ScalerConfig {
            init_scale: 65536.0,
            growth: 2.0,
            backoff: 0.5,
            growth_interval: 1000,
            hysteresis: 2,
            min_scale: 1.0,
            max_scale: 16_777_216.0,
        }
    }
}

impl ScalerConfig {
    /// A constant scale: it never grows or backs off (overflowing steps are still skipped).
    pub fn fixed(scale: f32) -> Self {
        ScalerConfig {
            init_scale: scale,
            growth: 1.0,
            backoff: 1.0,
            growth_interval: u32::MAX,
            hysteresis: 1,
            min_scale: scale,
            max_scale: scale,
        }
    }
}

/// What an update did to the scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ScaleUpdate {
    /// Clean step; the scale is unchanged.
    Kept,
    /// Clean step that completed an interval; the scale grew.
    Grew,
    /// Overflow within the hysteresis allowance; the scale is unchanged.
    Tolerated,
    /// Overflow; the scale backed off.
    BackedOff,
}

/// Dynamic loss scaling for fp16 training.
///
/// The trainer multiplies its loss by [`LossScaler::scale`], so small gradients survive fp16;
/// the optimizer divides them back out. After each step the scaler is told whether a gradient
/// overflowed (an infinite or NaN element):
///
/// * **Overflow.** The step is skipped. If the hysteresis allows more overflows, the scale is
///   kept and the allowance shrinks by one. Otherwise the scale is multiplied by `backoff`
///   (never below `min_scale`). The run of clean steps restarts either way.
/// * **Clean step.** After `growth_interval` clean steps in a row, the scale is multiplied by
///   `growth` (never above `max_scale`) and the hysteresis allowance is restored.
///
/// ```
/// use tidemem::optim::{LossScaler, ScalerConfig, ScaleUpdate};
/// let mut s = LossScaler::new(ScalerConfig { growth_interval: 2, hysteresis: 1, ..ScalerConfig::default() }).unwrap();
/// assert_eq!(s.scale(), 65536.0);
/// assert_eq!(s.update(true), ScaleUpdate::BackedOff);
/// assert_eq!(s.scale(), 32768.0);
/// s.update(false);
/// assert_eq!(s.update(false), ScaleUpdate::Grew);
/// assert_eq!(s.scale(), 65536.0);
/// ```
///
/// The dynamic loss-scale state machine.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LossScaler {
    cfg: ScalerConfig,
    scale: f32,
    clean: u32,
    allowance: u32,
}

impl LossScaler {
    /// A scaler at `cfg.init_scale`.
    pub fn new(cfg: ScalerConfig) -> Result<Self> {
        let ok = cfg.init_scale.is_finite()
            && cfg.min_scale > 0.0
            && cfg.min_scale <= cfg.init_scale
            && cfg.init_scale <= cfg.max_scale
            && cfg.max_scale.is_finite()
            && cfg.growth >= 1.0
            && cfg.growth.is_finite()
            && cfg.backoff > 0.0
            && cfg.backoff <= 1.0
            && cfg.growth_interval >= 1
            && cfg.hysteresis >= 1;
        if !ok {
            return Err(Error::Conflict {
                what: format!("loss-scaler settings {cfg:?}"),
                with: "each other: 0 < min ≤ init ≤ max (finite), growth ≥ 1, 0 < backoff ≤ 1, \
                       growth interval and hysteresis ≥ 1"
                    .into(),
            });
        }
        Ok(LossScaler {
            cfg,
            scale: cfg.init_scale,
            clean: 0,
            allowance: cfg.hysteresis,
        })
    }

    /// The scale to multiply the loss by.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Clean steps since the last growth or overflow.
    pub fn clean_steps(&self) -> u32 {
        self.clean
    }

    /// Overflows still tolerated before a backoff.
    pub fn allowance(&self) -> u32 {
        self.allowance
    }

    /// The settings.
    pub fn config(&self) -> &ScalerConfig {
        &self.cfg
    }

    /// Puts the scaler back where a checkpoint found it: `scale`, clean steps and allowance
    /// (as [`LossScaler::scale`], [`LossScaler::clean_steps`] and [`LossScaler::allowance`]
    /// returned them). Fails, changing nothing, on a scale outside the configured range.
    pub fn restore(&mut self, scale: f32, clean: u32, allowance: u32) -> Result<()> {
        if !(scale >= self.cfg.min_scale && scale <= self.cfg.max_scale) {
            return Err(Error::BadValue {
                what: format!(
                    "a restored loss scale (the configured range is [{}, {}])",
                    self.cfg.min_scale, self.cfg.max_scale
                ),
                value: scale.into(),
                want: "inside the configured range",
            });
        }
        // a scaler whose every factor is a power of two only ever holds powers of two
        let pow2 = |x: f32| x.is_normal() && x > 0.0 && x.to_bits() & 0x007f_ffff == 0;
        let c = &self.cfg;
        let factors = [c.init_scale, c.growth, c.backoff, c.min_scale, c.max_scale];
        if factors.into_iter().all(pow2) && !pow2(scale) {
            return Err(Error::BadValue {
                what: "a restored loss scale (every factor of this scaler is a power of two, \
                       so is every scale it reaches)"
                    .into(),
                value: scale.into(),
                want: "a power of two",
            });
        }
        if clean >= self.cfg.growth_interval || allowance == 0 || allowance > self.cfg.hysteresis {
            return Err(Error::Conflict {
                what: format!("{clean} clean steps with an allowance of {allowance}"),
                with: format!(
                    "a loss scaler of growth interval {} and hysteresis {} (clean < interval, \
                     1 ≤ allowance ≤ hysteresis)",
                    self.cfg.growth_interval, self.cfg.hysteresis
                ),
            });
        }
        self.scale = scale;
        self.clean = clean;
        self.allowance = allowance;
        Ok(())
    }

    /// Takes the outcome of a step: `overflow` when a gradient was infinite or NaN.
    pub fn update(&mut self, overflow: bool) -> ScaleUpdate {
        if overflow {
            self.clean = 0;
            if self.allowance > 1 {
                self.allowance -= 1;
                return ScaleUpdate::Tolerated;
            }
            self.scale = (self.scale * self.cfg.backoff).max(self.cfg.min_scale);
            return ScaleUpdate::BackedOff;
        }
        self.clean += 1;
        if self.clean >= self.cfg.growth_interval {
            self.clean = 0;
            self.allowance = self.cfg.hysteresis;
            self.scale = (self.scale * self.cfg.growth).min(self.cfg.max_scale);
            return ScaleUpdate::Grew;
        }
        ScaleUpdate::Kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(interval: u32, hysteresis: u32) -> ScalerConfig {
        ScalerConfig {
            init_scale: 1024.0,
            growth_interval: interval,
            hysteresis,
            ..ScalerConfig::default()
        }
    }

    #[test]
    fn overflow_backs_off_and_clean_steps_grow() {
        let mut s = LossScaler::new(cfg(3, 1)).unwrap();
        assert_eq!(s.update(true), ScaleUpdate::BackedOff);
        assert_eq!(s.scale(), 512.0);
        assert_eq!(s.update(false), ScaleUpdate::Kept);
        assert_eq!(s.update(false), ScaleUpdate::Kept);
        // an overflow restarts the run of clean steps
        assert_eq!(s.update(true), ScaleUpdate::BackedOff);
        assert_eq!(s.scale(), 256.0);
        for _ in 0..2 {
            assert_eq!(s.update(false), ScaleUpdate::Kept);
        }
        assert_eq!(s.update(false), ScaleUpdate::Grew);
        assert_eq!(s.scale(), 512.0);
        assert_eq!(s.clean_steps(), 0);
    }

    #[test]
    fn hysteresis_tolerates_overflows_until_growth_restores_it() {
        let mut s = LossScaler::new(cfg(2, 3)).unwrap();
        assert_eq!(s.update(true), ScaleUpdate::Tolerated);
        assert_eq!(s.update(true), ScaleUpdate::Tolerated);
        assert_eq!(s.scale(), 1024.0);
        assert_eq!(s.update(true), ScaleUpdate::BackedOff);
        assert_eq!(s.update(true), ScaleUpdate::BackedOff);
        assert_eq!(s.scale(), 256.0);
        assert_eq!(s.allowance(), 1);
        s.update(false);
        assert_eq!(s.update(false), ScaleUpdate::Grew);
        assert_eq!(s.allowance(), 3);
        assert_eq!(s.update(true), ScaleUpdate::Tolerated);
    }

    #[test]
    fn bounds_hold_and_bad_settings_are_errors() {
        let mut s = LossScaler::new(ScalerConfig {
            min_scale: 512.0,
            max_scale: 2048.0,
            ..cfg(1, 1)
        })
        .unwrap();
        for _ in 0..5 {
            s.update(false);
        }
        assert_eq!(s.scale(), 2048.0);
        for _ in 0..5 {
            s.update(true);
        }
        assert_eq!(s.scale(), 512.0);
        let mut f = LossScaler::new(ScalerConfig::fixed(8.0)).unwrap();
        f.update(true);
        f.update(false);
        assert_eq!(f.scale(), 8.0);
        for bad in [
            ScalerConfig {
                backoff: 0.0,
                ..cfg(1, 1)
            },
            ScalerConfig {
                growth_interval: 0,
                ..cfg(1, 1)
            },
            ScalerConfig {
                init_scale: f32::INFINITY,
                ..cfg(1, 1)
            },
            ScalerConfig {
                min_scale: 4096.0,
                ..cfg(1, 1)
            },
        ] {
            assert!(LossScaler::new(bad).is_err());
        }
    }
}
