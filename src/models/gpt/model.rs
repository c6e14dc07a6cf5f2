//! The GPT-2 model over a store: registration, one training iteration's forward and backward
//! (with or without activation checkpointing), and an evaluation forward.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::Serialize;

use super::plan::Plan;
use super::variant::{RegisterAt, Variant};
use super::{EndsLayout, Gpt2, GptConfig, IGNORE_INDEX};
use crate::error::{Error, Result};
use crate::nn::{Layout, Serial, WeightUse};
use crate::optim::StepReport;
use crate::parallel::pipeline::StageReport;
use crate::parallel::Placement;
use crate::store::ParamStore;
use crate::tensor::{Init, TensorId};

/// GPT-2's σ = 0.02, as the bound of a uniform of that deviation.
const INIT_BOUND: f32 = 0.034_641_016;

/// What [`train_step`](super::train_step) did.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TrainStep {
    /// The mean loss over the micro-batches (in a pipeline, the last stage's, on every stage).
    pub loss: f32,
    /// The optimizer's report of the last micro-batch (the step proper).
    pub report: StepReport,
    /// Tokens seen (targets counted or not).
    pub tokens: usize,
    /// In a pipeline, what the stage's schedule did (micro-batches in flight, messages,
    /// seconds waiting).
    #[serde(skip)]
    pub stage: Option<StageReport>,
}

/// A GPT-2 model whose parameters live in a store: the token and position embedding, `L`
/// pre-LayerNorm [`Block`](crate::nn::Block)s, the final LayerNorm and the LM head tied to `wte` (one parameter
/// with two uses: the store sums their gradient shares) — or a rank's part of it on its
/// placement `P` ([`Serial`], or a tensor-parallel [`Placement`]) as a [`Plan`] places it:
/// the blocks split over the tensor group, the ends split too or whole ([`EndsLayout`]), and
/// in a pipeline, the stage's range of blocks with the ends it holds (the first stage the
/// embedding, the last `ln_f` and the head over its own copy of `wte`).
///
/// # Example
///
/// Two iterations of `gpt2-tiny` shrunk to 2 blocks, each block checkpointed:
///
/// ```
/// use tidemem::models::gpt::{Gpt, GptConfig, GptBatch, Plan};
/// use tidemem::prelude::*;
///
/// # fn main() -> tidemem::Result<()> {
/// let mut cfg = GptConfig::preset("gpt2-tiny").unwrap();
/// cfg.layers = 2;
/// let dev = Device::sim(SimConfig::with_capacity(64 << 20))?;
/// let mut m = ChunkManager::new(dev, ManagerConfig::new(1 << 16, Policy::Tide))?;
/// let gpt = Gpt::register(&mut m, &cfg, 0)?;
/// let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adamw(1e-3, 0.0)))?;
/// let tokens: Vec<i32> = (0..32).map(|i| i % 7).collect();
/// let targets: Vec<i32> = (1..33).map(|i| i % 7).collect();
/// let batch = GptBatch { tokens: &tokens, targets: &targets, batch: 2, seq: 16 };
/// let plan = Plan { checkpoint: true, ..Plan::default() };
/// let first = gpt.forward_backward(&mut m, &plan, &batch, 1.0)?;
/// m.step(&mut adam)?;
/// let second = gpt.forward_backward(&mut m, &plan, &batch, 1.0)?;
/// m.step(&mut adam)?;
/// assert!(second < first);
/// # Ok(()) }
/// ```
///
/// A model is registered for one placement and runs on it: its blocks and ends hold that
/// layout's groups, and a model of one placement is not one of another. This does not compile:
///
/// ```compile_fail
/// use tidemem::models::gpt::{train_step, Gpt, GptBatch, Plan};
/// use tidemem::parallel::{Cube, OneD};
/// use tidemem::prelude::*;
///
/// fn step(gpt: &Gpt<Cube>, m: &mut ChunkManager, plan: &Plan<'_>, adam: &mut HybridAdam,
///         b: GptBatch<'_>) -> tidemem::Result<()> {
///     train_step(gpt, m, plan, adam, &[b]).map(drop)
/// }
///
/// fn run(gpt: &Gpt<OneD>, m: &mut ChunkManager, plan: &Plan<'_>, adam: &mut HybridAdam,
///        b: GptBatch<'_>) -> tidemem::Result<()> {
///     step(gpt, m, plan, adam, b) // a 1D model where a 3D one runs: a type error
/// }
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt<P: Layout = Serial, V: Variant = Gpt2> {
    /// The family: its block and its ends.
    pub variant: V,
    /// The whole model's shape.
    pub config: GptConfig,
    /// This rank's pipeline stage.
    pub stage: usize,
    /// Stages in the pipeline (1 without one).
    pub stages: usize,
    /// The blocks this rank holds (their indices in the model).
    pub layers: Range<usize>,
    pub(super) blocks: Vec<V::Block<P>>,
    pub(super) ends: V::Ends<P>,
    pub(super) params: Vec<(String, TensorId)>,
}

/// One micro-batch: `batch` rows of `seq` tokens (row-major) and their next-token targets
/// (targets equal to [`IGNORE_INDEX`] count for nothing).
#[derive(Clone, Copy, Debug)]
pub struct GptBatch<'a> {
    /// Input tokens `[batch·seq]`.
    pub tokens: &'a [i32],
    /// Targets `[batch·seq]`.
    pub targets: &'a [i32],
    /// Rows.
    pub batch: usize,
    /// Tokens per row (at most the model's positions).
    pub seq: usize,
}

impl GptBatch<'_> {
    /// Checks the batch against a model of shape `cfg`: `batch × seq` tokens and as many
    /// targets, at most `maxT` positions, targets in the vocabulary or ignored.
    pub(crate) fn check(&self, cfg: &GptConfig) -> Result<()> {
        let n = self.batch.checked_mul(self.seq).filter(|&n| n > 0);
        if n != Some(self.tokens.len()) || self.targets.len() != self.tokens.len() {
            return Err(Error::BatchShape {
                batch: self.batch,
                seq: self.seq,
                tokens: self.tokens.len(),
                targets: self.targets.len(),
            });
        }
        if self.seq > cfg.max_seq {
            return Err(Error::SeqTooLong {
                seq: self.seq,
                max: cfg.max_seq,
            });
        }
        crate::ops::check_targets(self.targets, cfg.vocab, IGNORE_INDEX)
    }
}

impl Gpt {
    /// Registers the whole model's parameters in `store` (names and order of
    /// [`GptConfig::param_shapes`]) with GPT-2's initialisation drawn from `seed`: weights of
    /// σ 0.02 (uniform), the residual projections' (`c_proj`) scaled by `1/√(2L)`, biases zero,
    /// LayerNorms γ 1, β 0.
    pub fn register(store: &mut impl ParamStore, cfg: &GptConfig, seed: u64) -> Result<Gpt> {
        Gpt::register_on(store, &Plan::default(), cfg, |name, _| {
            Ok(default_init(cfg, name, seed))
        })
    }

    /// Registers the whole model with each parameter's initial values from
    /// `init(name, shape)` (shapes as the crate holds them, linear weights `[outputs,
    /// inputs]`), e.g. from an imported checkpoint. An error from `init` stops the
    /// registration.
    pub fn register_with(
        store: &mut impl ParamStore,
        cfg: &GptConfig,
        init: impl FnMut(&str, &[usize]) -> Result<Init>,
    ) -> Result<Gpt> {
        Gpt::register_on(store, &Plan::default(), cfg, init)
    }
}

impl<P: Placement> Gpt<P> {
    /// Registers the model with the values of an imported Hugging Face checkpoint
    /// ([`read_hf`](super::read_hf)), placed as `plan` says.
    pub fn register_hf(
        store: &mut impl ParamStore,
        plan: &Plan<'_>,
        weights: &super::HfWeights,
    ) -> Result<Gpt<P>> {
        Gpt::register_on(store, plan, weights.config(), |name, _| {
            // read_hf holds every parameter of its config
            weights.init(name).ok_or_else(|| Error::Internal {
                what: format!("the imported weights have no '{name}'"),
            })
        })
    }

    /// Registers this rank's part of GPT-2 as `plan` places it
    /// ([`Gpt::register_variant`] with [`Gpt2`]).
    pub fn register_on(
        store: &mut impl ParamStore,
        plan: &Plan<'_>,
        cfg: &GptConfig,
        init: impl FnMut(&str, &[usize]) -> Result<Init>,
    ) -> Result<Gpt<P>> {
        Gpt::register_variant(store, plan, Gpt2, cfg, init)
    }
}

impl<P: Placement, V: Variant> Gpt<P, V> {
    /// Registers this rank's part of the model of family `variant` as `plan` places it,
    /// each parameter (shard) with the values of its whole master `init(name, shape)`
    /// (called for every parameter of [`Variant::param_shapes`] first: an error registers
    /// nothing), so that the split model computes what the whole one does. The blocks are
    /// split over the grid's tensor group (1D, 2D, 2.5D or 3D), the ends split with them or
    /// whole ([`Plan::ends`]); a pipeline stage holds its range of blocks, the first stage
    /// the embedding and the last the head (with its own copy of a tied weight), and its
    /// layers write gradient shares (a stage runs each once per micro-batch). Replicated
    /// parameters count their share of the squared gradient norm (`1/T` over the tensor
    /// group, `1/2` for a tied weight's two copies, `1/d` for a 2.5D grid's depth replicas).
    /// Fails, before registering anything, on shapes that do not split.
    pub fn register_variant(
        store: &mut impl ParamStore,
        plan: &Plan<'_>,
        variant: V,
        cfg: &GptConfig,
        mut init: impl FnMut(&str, &[usize]) -> Result<Init>,
    ) -> Result<Gpt<P, V>> {
        cfg.validate()?;
        let layout = P::of_grid(plan.grid)?;
        // what the tensors' shapes do not tell (the heads), and the rest of the shape, so
        // that a checkpoint of another model with the same tensors is refused
        for (key, value) in [
            ("gpt.layers", cfg.layers.to_string()),
            ("gpt.channels", cfg.channels.to_string()),
            ("gpt.heads", cfg.heads.to_string()),
            ("gpt.vocab", cfg.vocab.to_string()),
            ("gpt.max_seq", cfg.max_seq.to_string()),
            ("gpt.eps", format!("{:?}", cfg.eps)),
        ] {
            store.describe_model(key, &value)?;
        }
        let inits = variant
            .param_shapes(cfg)
            .iter()
            .map(|(n, s)| Ok((n.clone(), init(n, s)?)))
            .collect::<Result<BTreeMap<_, _>>>()?;
        let master = |n: &str| inits.get(n).cloned().unwrap_or(Init::Zeros);
        let (stage, stages) = plan.stage();
        let layers = plan.layers(cfg)?;
        let split = !P::WHOLE && plan.ends == EndsLayout::Split;
        if split {
            layout.check_ends([cfg.vocab, cfg.max_seq, cfg.channels])?;
        }
        let uses = match stages {
            1 => WeightUse::Once,
            _ => WeightUse::Shared,
        };
        let at = RegisterAt {
            cfg,
            master: &master,
            uses,
            replicated: 1.0 / plan.tensor_size() as f64,
            copies: if stages > 1 { 2.0 } else { 1.0 },
            ends: [stage == 0, stage + 1 == stages],
            split,
        };
        let mut params = Vec::new();
        let mut ends = variant.register_first(store, &at, layout.clone(), &mut params)?;
        let blocks = layers
            .clone()
            .map(|i| {
                let name = format!("h.{i}");
                variant.register_block(store, layout.clone(), &name, &at, &mut params)
            })
            .collect::<Result<Vec<_>>>()?;
        variant.register_last(&mut ends, store, &at, &mut params)?;
        Ok(Gpt {
            variant,
            config: cfg.clone(),
            stage,
            stages,
            layers,
            blocks,
            ends,
            params,
        })
    }
}

impl<P: Layout> Gpt<P> {
    /// Writes the model's fp32 master weights as a Hugging Face GPT-2 `safetensors` file
    /// ([`write_hf`](super::write_hf)), between iterations. The model must be whole on this
    /// rank.
    pub fn save_hf(
        &self,
        m: &mut crate::chunk::ChunkManager,
        path: impl AsRef<std::path::Path>,
    ) -> Result<()> {
        if !self.whole() {
            return Err(Error::Conflict {
                what: "exporting a Hugging Face file".into(),
                with: "a rank of a split model: it holds a part of it; export the whole model"
                    .into(),
            });
        }
        super::write_hf(path, &self.config, |name| {
            let id = self.param(name).ok_or_else(|| Error::Internal {
                what: format!("the whole model has no '{name}'"),
            })?;
            m.master(id)
        })
    }
}

impl<P: Layout, V: Variant> Gpt<P, V> {
    /// Whether this rank holds the whole model (no pipeline, no tensor split).
    pub(super) fn whole(&self) -> bool {
        self.stages == 1 && P::WHOLE
    }

    /// Every parameter's name and id on this rank, in registration order (a shard under its
    /// master's name).
    pub fn named_params(&self) -> &[(String, TensorId)] {
        &self.params
    }

    /// The id of the parameter named `name` (e.g. `h.0.attn.c_attn.weight`) on this rank.
    pub fn param(&self, name: &str) -> Option<TensorId> {
        self.params.iter().find(|(n, _)| n == name).map(|p| p.1)
    }
}

/// GPT-2's initialisation of parameter `name` (see [`Gpt::register`]).
pub fn default_init(cfg: &GptConfig, name: &str, seed: u64) -> Init {
    let uniform = |bound: f32| Init::Uniform {
        seed: fnv(name) ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        lo: -bound,
        hi: bound,
    };
    if name.ends_with(".bias") {
        Init::Zeros
    } else if name.starts_with("ln_f") || name.contains(".ln_") {
        Init::Constant(1.0)
    } else if name.ends_with("c_proj.weight") {
        uniform(INIT_BOUND / (2.0 * cfg.layers as f32).sqrt())
    } else {
        uniform(INIT_BOUND)
    }
}

/// 64-bit FNV-1a of a name.
fn fnv(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
