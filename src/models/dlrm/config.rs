//! The shape of a DLRM: presets and checks.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ops::interaction::{InteractionShape, MAX_INTERACTION_DIM, MAX_INTERACTION_ROWS};

/// A linear layer's `(inputs, outputs)`.
pub(super) type LayerShape = (usize, usize);

/// The shape of a DLRM (facebookresearch/dlrm's `dot` interaction): `dense_features` dense
/// inputs through the bottom MLP (`dense_features → bottom[0] → … → bottom[last] = dim`, ReLU
/// after every layer), `tables` embedding bags of `dim` columns, the dot interaction of the
/// `F = tables + 1` vectors (the strict lower triangle of `T·Tᵀ` after the dense vector:
/// [`DlrmConfig::top_inputs`] `= dim + F(F−1)/2` values) and the top MLP
/// (`top_inputs → top[0] → … → top[last] = 1`, ReLU between, the last layer's logit into the
/// fused sigmoid + BCE).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DlrmConfig {
    /// Dense features per sample (Criteo: 13).
    pub dense_features: usize,
    /// Sparse features: embedding tables, one pooled bag each per sample (Criteo: 26).
    pub tables: usize,
    /// `d`: the embedding width, which the bottom MLP's last layer must output.
    pub dim: usize,
    /// The bottom MLP's layer widths (outputs), the last equal to `dim`.
    pub bottom: Vec<usize>,
    /// The top MLP's layer widths (outputs), the last equal to 1 (the logit).
    pub top: Vec<usize>,
}

impl DlrmConfig {
    /// The Criteo Kaggle configuration of facebookresearch/dlrm
    /// (`bench/dlrm_s_criteo_kaggle.sh`): `d = 16`, bottom 13-512-256-64-16, top 367-512-256-1.
    pub fn kaggle() -> DlrmConfig {
        DlrmConfig {
            dense_features: 13,
            tables: 26,
            dim: 16,
            bottom: vec![512, 256, 64, 16],
            top: vec![512, 256, 1],
        }
    }

    /// TorchRec's Criteo 1TB DLRM: `d = 128`, dense 13-512-256-128, over
    /// 479-1024-1024-512-256-1.
    pub fn torchrec() -> DlrmConfig {
        DlrmConfig {
            dense_features: 13,
            tables: 26,
            dim: 128,
            bottom: vec![512, 256, 128],
            top: vec![1024, 1024, 512, 256, 1],
        }
    }

    /// A tiny model on Criteo's inputs (13 dense features, 26 tables) for tests: `d = 4`,
    /// bottom 13-8-4, top 355-8-1.
    pub fn tiny() -> DlrmConfig {
        DlrmConfig {
            dense_features: 13,
            tables: 26,
            dim: 4,
            bottom: vec![8, 4],
            top: vec![8, 1],
        }
    }

    /// A preset by name: `kaggle`, `torchrec` or `tiny` (case-insensitive).
    pub fn preset(name: &str) -> Option<DlrmConfig> {
        match name.to_ascii_lowercase().as_str() {
            "kaggle" | "criteo-kaggle" => Some(DlrmConfig::kaggle()),
            "torchrec" | "criteo-1tb" => Some(DlrmConfig::torchrec()),
            "tiny" => Some(DlrmConfig::tiny()),
            _ => None,
        }
    }

    /// The preset names [`DlrmConfig::preset`] knows.
    pub const PRESETS: &'static [&'static str] = &["kaggle", "torchrec", "tiny"];

    /// `F`: the vectors the interaction stacks, the tables and the dense vector.
    pub fn vectors(&self) -> usize {
        self.tables + 1
    }

    /// The interaction's shape for a batch of `batch` samples.
    pub fn interaction(&self, batch: usize) -> InteractionShape {
        InteractionShape {
            batch,
            features: self.tables,
            dim: self.dim,
        }
    }

    /// The top MLP's input width, `dim + F(F−1)/2` (Kaggle: 16 + 351 = 367).
    pub fn top_inputs(&self) -> usize {
        self.interaction(0).out_width()
    }

    /// Checks the shape: every width and count positive, the bottom MLP ending in `dim`, the
    /// top MLP in one logit, and the interaction within its limits. Otherwise
    /// [`Error::TooFew`] (a zero count or width), [`Error::TooLarge`] (past the interaction's
    /// limits), [`Error::Empty`] (an MLP of no layer) or [`Error::Length`] (an MLP that ends
    /// in another width), naming what is wrong.
    pub(crate) fn check(&self) -> Result<()> {
        for (what, n) in [
            ("DLRM dense features", self.dense_features),
            ("DLRM tables", self.tables),
            ("DLRM embedding dim", self.dim),
        ] {
            if n == 0 {
                return Err(Error::TooFew {
                    what: what.into(),
                    got: 0,
                    need: 1,
                });
            }
        }
        // the interaction takes at most MAX_INTERACTION_ROWS - 1 tables and dim
        // MAX_INTERACTION_DIM
        if self.tables >= MAX_INTERACTION_ROWS {
            return Err(Error::TooLarge {
                what: format!("DLRM tables (of dim {}) for the interaction", self.dim),
                requested: self.tables as u128,
                limit: (MAX_INTERACTION_ROWS - 1) as u64,
            });
        }
        if self.dim > MAX_INTERACTION_DIM {
            return Err(Error::TooLarge {
                what: format!(
                    "DLRM embedding dim (of {} tables) for the interaction",
                    self.tables
                ),
                requested: self.dim as u128,
                limit: MAX_INTERACTION_DIM as u64,
            });
        }
        for (name, widths) in [("bottom", &self.bottom), ("top", &self.top)] {
            if widths.is_empty() {
                return Err(Error::Empty {
                    what: format!("the DLRM {name} MLP's widths"),
                });
            }
            if let Some(i) = widths.iter().position(|&w| w == 0) {
                return Err(Error::TooFew {
                    what: format!("the width of layer {i} of the DLRM {name} MLP {widths:?}"),
                    got: 0,
                    need: 1,
                });
            }
        }
        // non-empty: checked above
        let (bottom, top) = (
            self.bottom[self.bottom.len() - 1],
            self.top[self.top.len() - 1],
        );
        if bottom != self.dim {
            return Err(Error::Length {
                what: format!(
                    "outputs of the DLRM bottom MLP {:?} (it ends in the embedding dim)",
                    self.bottom
                ),
                got: bottom,
                expected: self.dim,
            });
        }
        if top != 1 {
            return Err(Error::Length {
                what: format!(
                    "outputs of the DLRM top MLP {:?} (it ends in the logit)",
                    self.top
                ),
                got: top,
                expected: 1,
            });
        }
        Ok(())
    }

    /// The layers as `(inputs, outputs)`, bottom then top.
    pub(super) fn layer_shapes(&self) -> (Vec<LayerShape>, Vec<LayerShape>) {
        let chain = |first: usize, widths: &[usize]| {
            let mut inputs = first;
            widths
                .iter()
                .map(|&w| (std::mem::replace(&mut inputs, w), w))
                .collect::<Vec<_>>()
        };
        (
            chain(self.dense_features, &self.bottom),
            chain(self.top_inputs(), &self.top),
        )
    }

    /// MLP parameters (weights and biases).
    pub fn mlp_params(&self) -> usize {
        let (b, t) = self.layer_shapes();
        b.iter().chain(&t).map(|&(i, o)| i * o + o).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_derive_the_top_input() {
        assert_eq!(DlrmConfig::kaggle().top_inputs(), 367);
        assert_eq!(DlrmConfig::torchrec().top_inputs(), 128 + 351);
        assert_eq!(DlrmConfig::tiny().top_inputs(), 355);
        for name in DlrmConfig::PRESETS {
            let c = DlrmConfig::preset(name).unwrap();
            c.check().unwrap();
            assert_eq!(c.vectors(), 27);
        }
        assert!(DlrmConfig::preset("nope").is_none());
        let (b, t) = DlrmConfig::kaggle().layer_shapes();
        assert_eq!(b, [(13, 512), (512, 256), (256, 64), (64, 16)]);
        assert_eq!(t, [(367, 512), (512, 256), (256, 1)]);
    }

    #[test]
    fn bad_shapes_are_refused() {
        let bad = [
            DlrmConfig {
                bottom: vec![8, 5],
                ..DlrmConfig::tiny()
            },
            DlrmConfig {
                top: vec![8, 2],
                ..DlrmConfig::tiny()
            },
            DlrmConfig {
                top: vec![],
                ..DlrmConfig::tiny()
            },
            DlrmConfig {
                bottom: vec![0, 4],
                ..DlrmConfig::tiny()
            },
            DlrmConfig {
                tables: 0,
                ..DlrmConfig::tiny()
            },
            DlrmConfig {
                tables: MAX_INTERACTION_ROWS,
                ..DlrmConfig::tiny()
            },
        ];
        let typed: [fn(&Error) -> bool; 6] = [
            |e| {
                matches!(
                    e,
                    Error::Length {
                        got: 5,
                        expected: 4,
                        ..
                    }
                )
            },
            |e| {
                matches!(
                    e,
                    Error::Length {
                        got: 2,
                        expected: 1,
                        ..
                    }
                )
            },
            |e| matches!(e, Error::Empty { .. }),
            |e| {
                matches!(
                    e,
                    Error::TooFew {
                        got: 0,
                        need: 1,
                        ..
                    }
                )
            },
            |e| {
                matches!(
                    e,
                    Error::TooFew {
                        got: 0,
                        need: 1,
                        ..
                    }
                )
            },
            |e| {
                matches!(e, Error::TooLarge { requested, limit, .. }
                    if *requested == MAX_INTERACTION_ROWS as u128
                        && *limit == (MAX_INTERACTION_ROWS - 1) as u64)
            },
        ];
        for (c, ok) in bad.iter().zip(typed) {
            let r = c.check();
            assert!(matches!(&r, Err(e) if ok(e)), "{c:?}: {r:?}");
        }
    }
}
