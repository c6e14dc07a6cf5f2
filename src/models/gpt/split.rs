//! A GPT split over a 1D tensor-parallel group.

use super::blocks::{Blocks, StageSplit};
use super::ends::Ends;
use super::model::{default_init, Gpt, IGNORE_INDEX};
use super::GptConfig;
use crate::error::{Error, Result};
use crate::nn::LayerNorm;
use crate::parallel::{Shard, VocabEmbedding1D, VocabHead1D};
use crate::store::ParamStore;

impl Gpt {
    /// Registers rank `shard`'s part of the model split over a 1D tensor-parallel group
    /// (Megatron's layout, [`OneD`](crate::parallel::OneD)): each block's `c_attn` and `c_fc` column-parallel,
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
        let split = StageSplit::OneD(shard);
        let blocks = Blocks::register(store, cfg, 0..cfg.layers, split, &init)?;
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
        // the row-parallel biases live on the first rank only
        params.extend(blocks.named_params(0));
        params.push(("ln_f.weight".to_string(), ln_f.gamma));
        params.push(("ln_f.bias".to_string(), ln_f.beta));
        // every rank holds `wpe` and the LayerNorms whole: each counts 1/P of their gradients'
        // squared norm, so the group's sum counts them once (the blocks' set theirs)
        let share = 1.0 / shard.size as f64;
        for id in [wpe, ln_f.gamma, ln_f.beta] {
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
