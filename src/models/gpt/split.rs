//! A GPT split over a 1D tensor-parallel group.

use super::ends::Ends;
use super::model::{default_init, Gpt, IGNORE_INDEX};
use super::GptConfig;
use crate::error::{Error, Result};
use crate::nn::LayerNorm;
use crate::parallel::{Block1D, Shard, VocabEmbedding1D, VocabHead1D};
use crate::store::ParamStore;

impl Gpt {
    /// Registers rank `shard`'s part of the model split over a 1D tensor-parallel group
    /// (Megatron's layout, [`Block1D`]): each block's `c_attn` and `c_fc` column-parallel,
    /// `c_proj`s row-parallel, `H/P` heads a rank; `wte`'s rows split over the group with the
    /// tied head's cross-entropy over the whole vocabulary ([`Ends::Split`]); `wpe` and the
    /// LayerNorms replicated. Every shard holds the values of [`Gpt::register`]'s master for `seed`, so
    /// the split model computes what the serial one does. Run it with the `*_in` methods and
    /// the group. Fails if the heads do not split over `P`.
    pub fn register_1d(
        store: &mut impl ParamStore,
        cfg: &GptConfig,
        seed: u64,
        shard: Shard,
    ) -> Result<Gpt> {
        cfg.validate()?;
        if shard.size == 0 || !cfg.heads.is_multiple_of(shard.size) {
            return Err(Error::InvalidArgument(format!(
                "{} heads do not split over {} tensor-parallel ranks",
                cfg.heads, shard.size
            )));
        }
        let init = |name: &str| default_init(cfg, name, seed);
        let c = cfg.channels;
        let embedding = VocabEmbedding1D::register(
            store,
            cfg.vocab,
            cfg.max_seq,
            c,
            &init("wte.weight"),
            &init("wpe.weight"),
            shard,
        )?;
        let (wte, wpe) = (embedding.wte, embedding.wpe);
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let b = Block1D::register(
                store,
                &format!("h.{i}"),
                c,
                cfg.heads,
                cfg.eps,
                &init,
                shard,
            )?;
            blocks.push(b.block);
        }
        let ln_f = LayerNorm {
            gamma: store.register("ln_f.weight", &[c], init("ln_f.weight"))?,
            beta: store.register("ln_f.bias", &[c], init("ln_f.bias"))?,
            cols: c,
            eps: cfg.eps,
        };
        let head = VocabHead1D::tied(&*store, &embedding, IGNORE_INDEX)?;
        let mut params = vec![
            ("wte.weight".to_string(), wte),
            ("wpe.weight".to_string(), wpe),
        ];
        for (i, b) in blocks.iter().enumerate() {
            let names = [
                "ln_1.weight",
                "ln_1.bias",
                "attn.c_attn.weight",
                "attn.c_attn.bias",
                "attn.c_proj.weight",
                "attn.c_proj.bias",
                "ln_2.weight",
                "ln_2.bias",
                "mlp.c_fc.weight",
                "mlp.c_fc.bias",
                "mlp.c_proj.weight",
                "mlp.c_proj.bias",
            ];
            // the row-parallel biases live on the first rank only
            let ids = [
                Some(b.ln_1.gamma),
                Some(b.ln_1.beta),
                Some(b.attn.c_attn.weight),
                b.attn.c_attn.bias,
                Some(b.attn.c_proj.weight),
                b.attn.c_proj.bias,
                Some(b.ln_2.gamma),
                Some(b.ln_2.beta),
                Some(b.mlp.c_fc.weight),
                b.mlp.c_fc.bias,
                Some(b.mlp.c_proj.weight),
                b.mlp.c_proj.bias,
            ];
            for (n, id) in names.iter().zip(ids) {
                if let Some(id) = id {
                    params.push((format!("h.{i}.{n}"), id));
                }
            }
        }
        params.push(("ln_f.weight".to_string(), ln_f.gamma));
        params.push(("ln_f.bias".to_string(), ln_f.beta));
        // every rank holds `wpe` and the LayerNorms whole: each counts 1/P of their gradients'
        // squared norm, so the group's sum counts them once
        let share = 1.0 / shard.size as f64;
        let mut replicated = vec![wpe, ln_f.gamma, ln_f.beta];
        for b in &blocks {
            replicated.extend([b.ln_1.gamma, b.ln_1.beta, b.ln_2.gamma, b.ln_2.beta]);
        }
        for id in replicated {
            store.set_norm_share(id, share)?;
        }
        Ok(Gpt {
            config: cfg.clone(),
            ends: Ends::Split { embedding, head },
            blocks,
            ln_f,
            tensor: Some(shard),
            params,
        })
    }
}
