//! The shape of a GPT-2 model: presets and checks.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Targets equal to it count for nothing (PyTorch's default).
pub const IGNORE_INDEX: i32 = -100;

/// The shape of a GPT-2-style decoder: `layers` pre-LayerNorm blocks of `channels` channels and
/// `heads` heads, a vocabulary of `vocab` tokens and `max_seq` positions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    /// `L`: transformer blocks.
    pub layers: usize,
    /// `C`: channels.
    pub channels: usize,
    /// `NH`: attention heads (`C` must divide by it).
    pub heads: usize,
    /// `V`: tokens.
    pub vocab: usize,
    /// `maxT`: positions (the longest sequence).
    pub max_seq: usize,
    /// LayerNorm's ε (GPT-2: 1e-5).
    pub eps: f32,
}

impl GptConfig {
    /// The presets: `gpt2-tiny` (4 blocks of 128 channels over bytes, 64 positions: the tests'
    /// and the default run's model), `gpt2` = `gpt2-small` = `124M` (12, 768, 12),
    /// `gpt2-medium` = `350M` (24, 1024, 16), `gpt2-large` = `774M` (36, 1280, 20), `gpt2-xl` =
    /// `gpt2-1.5b` = `1.5B` (48, 1600, 25), and GPT-3's shapes `gpt3-2.7b` (32, 2560, 32),
    /// `gpt3-6.7b` (32, 4096, 32), `gpt3-13b` (40, 5120, 40) over GPT-2's vocabulary; all but
    /// the tiny one have 50,257 tokens and 1,024 positions.
    pub fn preset(name: &str) -> Option<GptConfig> {
        let (layers, channels, heads) = match name.to_ascii_lowercase().as_str() {
            "gpt2-tiny" | "tiny" => {
                return Some(GptConfig {
                    layers: 4,
                    channels: 128,
                    heads: 4,
                    vocab: 256,
                    max_seq: 64,
                    eps: 1e-5,
                })
            }
            "gpt2" | "gpt2-small" | "124m" => (12, 768, 12),
            "gpt2-medium" | "350m" => (24, 1024, 16),
            "gpt2-large" | "774m" => (36, 1280, 20),
            "gpt2-xl" | "gpt2-1.5b" | "1.5b" => (48, 1600, 25),
            "gpt3-2.7b" => (32, 2560, 32),
            "gpt3-6.7b" => (32, 4096, 32),
            "gpt3-13b" => (40, 5120, 40),
            _ => return None,
        };
        Some(GptConfig {
            layers,
            channels,
            heads,
            vocab: 50257,
            max_seq: 1024,
            eps: 1e-5,
        })
    }

    /// The preset names [`GptConfig::preset`] knows.
    pub const PRESETS: &'static [&'static str] = &[
        "gpt2-tiny",
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "gpt3-2.7b",
        "gpt3-6.7b",
        "gpt3-13b",
    ];

    /// Checks the shape: no zero dimension, heads dividing the channels, a vocabulary that
    /// token ids (`i32`) can name, and element counts that fit in memory arithmetic.
    pub fn validate(&self) -> Result<()> {
        for (what, n) in [
            ("GPT layers", self.layers),
            ("GPT channels", self.channels),
            ("GPT attention heads", self.heads),
            ("GPT vocabulary tokens", self.vocab),
            ("GPT positions (max_seq)", self.max_seq),
        ] {
            if n == 0 {
                return Err(Error::TooFew {
                    what: what.into(),
                    got: 0,
                    need: 1,
                });
            }
        }
        if !self.channels.is_multiple_of(self.heads) {
            return Err(Error::NotMultiple {
                what: "channels",
                value: self.channels,
                of: "attention heads",
                divisor: self.heads,
            });
        }
        if self.vocab > i32::MAX as usize {
            return Err(Error::TooLarge {
                what: "GPT vocabulary tokens (token ids are i32)".into(),
                requested: self.vocab as u128,
                limit: i32::MAX as u64,
            });
        }
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            return Err(Error::BadValue {
                what: "GPT LayerNorm's eps".into(),
                value: f64::from(self.eps),
                want: "positive and finite",
            });
        }
        let c = self.channels as u128;
        let total = (self.vocab as u128 + self.max_seq as u128) * c
            + self.layers as u128 * (12 * c * c + 13 * c)
            + 2 * c;
        if total >= 1 << 40 {
            return Err(Error::TooLarge {
                what: format!(
                    "parameters of GPT shape L{} C{} H{} V{} T{}",
                    self.layers, self.channels, self.heads, self.vocab, self.max_seq
                ),
                requested: total,
                limit: (1 << 40) - 1,
            });
        }
        Ok(())
    }

    /// Parameters: `(V + maxT)·C + L·(12C² + 13C) + 2C` (the LM head is tied to `wte`).
    pub fn params(&self) -> u64 {
        let c = self.channels as u64;
        (self.vocab as u64 + self.max_seq as u64) * c
            + self.layers as u64 * (12 * c * c + 13 * c)
            + 2 * c
    }

    /// Every parameter's name and shape in registration order, as the crate holds them
    /// (linear weights `[outputs, inputs]`): `wte.weight` `[V, C]`, `wpe.weight` `[maxT, C]`,
    /// then per block `h.{i}.ln_1.{weight,bias}`, `h.{i}.attn.c_attn.{weight [3C, C], bias}`,
    /// `h.{i}.attn.c_proj.{weight [C, C], bias}`, `h.{i}.ln_2.*`,
    /// `h.{i}.mlp.c_fc.{weight [4C, C], bias}`, `h.{i}.mlp.c_proj.{weight [C, 4C], bias}`, and
    /// `ln_f.{weight,bias}`: Hugging Face GPT-2's names, whose `Conv1D` weights are stored
    /// transposed (`[inputs, outputs]`).
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let c = self.channels;
        let mut v = vec![
            ("wte.weight".to_string(), vec![self.vocab, c]),
            ("wpe.weight".to_string(), vec![self.max_seq, c]),
        ];
        for i in 0..self.layers {
            let p = |s: &str| format!("h.{i}.{s}");
            v.extend([
                (p("ln_1.weight"), vec![c]),
                (p("ln_1.bias"), vec![c]),
                (p("attn.c_attn.weight"), vec![3 * c, c]),
                (p("attn.c_attn.bias"), vec![3 * c]),
                (p("attn.c_proj.weight"), vec![c, c]),
                (p("attn.c_proj.bias"), vec![c]),
                (p("ln_2.weight"), vec![c]),
                (p("ln_2.bias"), vec![c]),
                (p("mlp.c_fc.weight"), vec![4 * c, c]),
                (p("mlp.c_fc.bias"), vec![4 * c]),
                (p("mlp.c_proj.weight"), vec![c, 4 * c]),
                (p("mlp.c_proj.bias"), vec![c]),
            ]);
        }
        v.push(("ln_f.weight".to_string(), vec![c]));
        v.push(("ln_f.bias".to_string(), vec![c]));
        v
    }

    /// Training FLOPs per token at sequence length `seq` (llm.c's count: `6N + 6·L·C·T`).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        6.0 * self.params() as f64 + 6.0 * (self.layers * self.channels * seq) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_gpt2_sizes() {
        let small = GptConfig::preset("gpt2").unwrap();
        assert_eq!(small.params(), 124_439_808);
        assert_eq!(GptConfig::preset("124M").unwrap(), small);
        let xl = GptConfig::preset("gpt2-xl").unwrap();
        assert_eq!(xl.params(), 1_557_611_200);
        for name in GptConfig::PRESETS {
            GptConfig::preset(name).unwrap().validate().unwrap();
        }
        assert!(GptConfig::preset("gpt5").is_none());
        let tiny = GptConfig::preset("gpt2-tiny").unwrap();
        let n: usize = tiny
            .param_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert_eq!(n as u64, tiny.params());
    }

    #[test]
    fn bad_shapes_are_refused() {
        let mut c = GptConfig::preset("gpt2-tiny").unwrap();
        c.heads = 3;
        assert!(matches!(
            c.validate(),
            Err(Error::NotMultiple {
                value: 128,
                divisor: 3,
                ..
            })
        ));
        c.heads = 0;
        assert!(matches!(
            c.validate(),
            Err(Error::TooFew {
                got: 0,
                need: 1,
                ..
            })
        ));
        let mut c = GptConfig::preset("gpt2-tiny").unwrap();
        c.eps = f32::NAN;
        assert!(matches!(c.validate(), Err(Error::BadValue { .. })));
        let mut c = GptConfig::preset("gpt2-tiny").unwrap();
        c.vocab = i32::MAX as usize + 1;
        assert!(matches!(
            c.validate(),
            Err(Error::TooLarge { limit, .. }) if limit == i32::MAX as u64
        ));
        let mut c = GptConfig::preset("gpt2-tiny").unwrap();
        c.channels = 1 << 20;
        c.heads = 1;
        assert!(matches!(
            c.validate(),
            Err(Error::TooLarge { limit, .. }) if limit == (1 << 40) - 1
        ));
    }
}
