//! GPT-2's pre-LayerNorm transformer block, written once over a [`Layout`].

use std::sync::Arc;

use super::act::Act;
use super::attention::{attend, attend_backward, Attended, HeadsCore};
use super::gelu::{gelu, gelu_backward, GeluSaved};
use super::layout::{Layout, LinearOn, NormOn, Pair, Serial};
use super::linear::WeightUse;
use crate::error::Result;
use crate::ops::attention::Attention;
use crate::ops::{add, Axpby};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// A pre-LayerNorm transformer block as GPT-2's, on layout `L`:
/// `h1 = x + attn(ln_1(x))`, `out = h1 + mlp(ln_2(h1))`, with
/// `attn(y) = attn_proj(attention(c_attn(y)))` and `mlp(y) = mlp_proj(GELU(c_fc(y)))`.
///
/// `ln_2` runs fused with the first residual add (it takes the attention's output and the
/// residual `x`, and yields `h1` with its normalisation); backward carries the residual
/// stream's gradient in one buffer that `ln_2` and then `ln_1` add their input gradients into.
/// The same code runs serially ([`Serial`]) and on every tensor-parallel layout: the layout
/// splits the linears, LayerNorms and heads, and adds the collectives.
///
/// # Example
///
/// One serial block of 8 channels and 2 heads over 2 sequences of 3 tokens:
///
/// ```
/// use tidemem::nn::{Act, Block, BlockOn, Serial};
/// use tidemem::prelude::*;
///
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 22))?;
/// let mut cfg = ManagerConfig::new(256, Policy::Tide);
/// cfg.param_dtype = DType::F32;
/// let mut m = ChunkManager::new(dev, cfg)?;
/// let init = |name: &str| Block::default_init(name, 8);
/// let block = Block::register(&mut m, Serial, "h.0", [8, 2], 1e-5, &init)?;
/// assert_eq!(block.params().len(), 12);
///
/// let fwd = m.forward()?;
/// let x = Act::upload(fwd.pool(), fwd.stream(), 6, 8, DType::F32, &[0.5; 48])?;
/// let (out, saved) = block.forward(&fwd, &x, [2, 3], None)?;
/// assert_eq!(out.shape(), [6, 8]);
/// fwd.finish()?;
///
/// let mut bwd = m.backward()?;
/// let dout = Act::upload(bwd.pool(), bwd.stream(), 6, 8, DType::F32, &[1.0; 48])?;
/// let dx = block.backward(&mut bwd, &saved, &dout, None)?;
/// assert_eq!(dx.shape(), [6, 8]);
/// bwd.finish()?;
/// // the output bias's gradient: Σ_rows dout
/// assert_eq!(m.read(block.mlp_proj.bias.unwrap())?, vec![6.0; 8]);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Block<L: Layout = Serial> {
    /// How the layers are split (the rank's place).
    pub layout: L,
    /// LayerNorm before the attention.
    pub ln_1: L::Norm,
    /// The query/key/value projection `C → 3C` (`{name}.attn.c_attn`).
    pub c_attn: L::Linear,
    /// The attention's output projection `C → C` (`{name}.attn.c_proj`).
    pub attn_proj: L::Linear,
    /// LayerNorm before the MLP.
    pub ln_2: L::Norm,
    /// The MLP's `C → 4C` (`{name}.mlp.c_fc`).
    pub c_fc: L::Linear,
    /// The MLP's `4C → C` (`{name}.mlp.c_proj`).
    pub mlp_proj: L::Linear,
    /// Heads `H` of the whole block.
    pub heads: usize,
    /// Channels `C` of the whole block.
    pub channels: usize,
    /// How the linears write their weight gradients ([`WeightUse::Shared`] for a block run
    /// more than once an iteration, as a pipeline stage runs it once per micro-batch).
    pub uses: WeightUse,
}

/// What [`Block::forward`] keeps for the backward.
#[derive(Debug)]
pub struct BlockSaved<L: Layout = Serial> {
    ln_1: <L::Norm as NormOn<L>>::Saved,
    c_attn: <L::Linear as LinearOn<L>>::Saved,
    heads: Attended,
    attn_proj: <L::Linear as LinearOn<L>>::Saved,
    ln_2: <L::Norm as NormOn<L>>::Saved,
    c_fc: <L::Linear as LinearOn<L>>::Saved,
    pre: GeluSaved,
    mlp_proj: <L::Linear as LinearOn<L>>::Saved,
    op: Attention,
}

impl<L: Layout> BlockSaved<L> {
    /// This rank's part of `h1 = x + attn(ln_1(x))`, the residual stream between the halves.
    pub fn h1(&self) -> &Act {
        L::Norm::input(&self.ln_2)
    }
}

impl<L: Layout> Block<L> {
    /// Registers this rank's part of block `name` of `[channels, heads]` on `layout`, under
    /// GPT-2's names (`{name}.ln_1.*`, `{name}.attn.c_attn.*`, `{name}.attn.c_proj.*`,
    /// `{name}.ln_2.*`, `{name}.mlp.c_fc.*`, `{name}.mlp.c_proj.*`, weight then bias), each
    /// with the values of its master: `init(param name)` gives the whole tensor's initialiser
    /// (linear weights `[outputs, inputs]`). Fails before registering anything when the
    /// channels, heads or `eps` do not suit the layout (naming what does not divide what).
    pub fn register<S: ParamStore>(
        store: &mut S,
        layout: L,
        name: &str,
        [channels, heads]: [usize; 2],
        eps: f32,
        init: &dyn Fn(&str) -> Init,
    ) -> Result<Block<L>> {
        layout.check_split(name, channels, heads)?;
        super::check_eps(name, eps)?;
        let c = channels;
        let p = |s: &str| format!("{name}.{s}");
        let masters = |s: &str| {
            [
                init(&p(&format!("{s}.weight"))),
                init(&p(&format!("{s}.bias"))),
            ]
        };
        let ln = |store: &mut S, s: &str| {
            let [g, b] = masters(s);
            layout.register_norm(store, &p(s), c, eps, [&g, &b])
        };
        let lin = |store: &mut S, s: &str, io: [usize; 2], pair: Pair| {
            let [w, b] = masters(s);
            layout.register_linear(store, &p(s), io, pair, [&w, &b])
        };
        let ln_1 = ln(store, "ln_1")?;
        let c_attn = lin(store, "attn.c_attn", [c, 3 * c], Pair::Column { parts: 3 })?;
        let attn_proj = lin(store, "attn.c_proj", [c, c], Pair::Row)?;
        let ln_2 = ln(store, "ln_2")?;
        let c_fc = lin(store, "mlp.c_fc", [c, 4 * c], Pair::Column { parts: 1 })?;
        let mlp_proj = lin(store, "mlp.c_proj", [4 * c, c], Pair::Row)?;
        Ok(Block {
            layout,
            ln_1,
            c_attn,
            attn_proj,
            ln_2,
            c_fc,
            mlp_proj,
            heads,
            channels,
            uses: WeightUse::Once,
        })
    }

    /// The parameters with their names under `name` (`{name}.ln_1.weight`, …), in
    /// registration order, where this rank holds them.
    pub fn named_params(&self, name: &str) -> Vec<(String, TensorId)> {
        let layers = [
            ("ln_1", self.ln_1.params()),
            ("attn.c_attn", self.c_attn.params()),
            ("attn.c_proj", self.attn_proj.params()),
            ("ln_2", self.ln_2.params()),
            ("mlp.c_fc", self.c_fc.params()),
            ("mlp.c_proj", self.mlp_proj.params()),
        ];
        let mut v = Vec::with_capacity(12);
        for (layer, ids) in layers {
            for (id, p) in ids.into_iter().zip(["weight", "bias"]) {
                v.push((format!("{name}.{layer}.{p}"), id));
            }
        }
        v
    }

    /// The same block with its linears writing gradient shares ([`WeightUse::Shared`]): a
    /// block run more than once an iteration, as a pipeline stage runs it once per
    /// micro-batch.
    pub fn shared(self) -> Block<L> {
        Block {
            uses: WeightUse::Shared,
            ..self
        }
    }

    /// Heads this rank's attention computes.
    pub fn local_heads(&self) -> usize {
        self.layout.heads(self.heads)
    }
}

/// A transformer block on layout `L`, whatever its family: what a model's stack of blocks
/// runs. GPT-2's [`Block`] is one; a model family brings its own, and every placement and
/// schedule runs it.
pub trait BlockOn<L: Layout>: Clone + std::fmt::Debug + PartialEq + Send + Sync {
    /// What the forward keeps for the backward.
    type Saved: Send;

    /// The block on this rank's part `x` of a batch of `[batch, seq]` sequences (rows
    /// batch-major; serially `[batch·seq, C]`), with the attention (where the block has one)
    /// computed by `core` (over this rank's heads; e.g. a sequence ring's) or locally with
    /// `None`: this rank's part of the output and what the backward needs, on the layout's
    /// groups. The input's shape and type are checked before anything runs.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        batch_seq: [usize; 2],
        core: Option<&dyn HeadsCore>,
    ) -> Result<(Act, Self::Saved)>;

    /// The backward of [`BlockOn::forward`] (with the same `core`) from this rank's part of
    /// the output's gradient `dout`: writes every parameter's gradient and returns the
    /// input's (a new activation; `dout` is not changed).
    fn backward(
        &self,
        pass: &mut BackwardPass<'_>,
        saved: &Self::Saved,
        dout: &Act,
        core: Option<&dyn HeadsCore>,
    ) -> Result<Act>;

    /// The parameters in registration order, where this rank holds them.
    fn params(&self) -> Vec<TensorId>;
}

impl<L: Layout> BlockOn<L> for Block<L> {
    type Saved = BlockSaved<L>;

    fn params(&self) -> Vec<TensorId> {
        let mut v = self.ln_1.params();
        v.extend(self.c_attn.params());
        v.extend(self.attn_proj.params());
        v.extend(self.ln_2.params());
        v.extend(self.c_fc.params());
        v.extend(self.mlp_proj.params());
        v
    }

    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        batch_seq: [usize; 2],
        core: Option<&dyn HeadsCore>,
    ) -> Result<(Act, BlockSaved<L>)> {
        let l = &self.layout;
        let d = pass.param_dtype();
        x.expect("x", None, l.cols(self.channels), d)?;
        let head_dim = self.channels / self.heads;
        let op = l.attention(x.rows(), batch_seq, l.heads(self.heads), head_dim)?;
        let (y1, ln_1) = self.ln_1.forward_on(l, pass, x, None)?;
        let (qkv, c_attn) = self.c_attn.forward_on(l, pass, &y1)?;
        drop(y1);
        let (merged, heads) = attend(pass, &op, core, &qkv)?;
        drop(qkv);
        let (a, attn_proj) = self.attn_proj.forward_on(l, pass, &merged)?;
        drop(merged);
        // h1 = x + a, and its normalisation, in one op
        let (y2, ln_2) = self.ln_2.forward_on(l, pass, &a, Some(x))?;
        drop(a);
        let (pre, c_fc) = self.c_fc.forward_on(l, pass, &y2)?;
        drop(y2);
        let (act, pre) = gelu(pass, &pre)?;
        let (m, mlp_proj) = self.mlp_proj.forward_on(l, pass, &act)?;
        drop(act);
        let out = Act::alloc(pass.pool(), x.rows(), x.cols(), d)?;
        let one = Axpby {
            alpha: 1.0,
            beta: 1.0,
        };
        let h1 = L::Norm::input(&ln_2);
        add(
            pass.device(),
            pass.stream(),
            one,
            h1.input(),
            m.input(),
            out.view(),
            d,
        )?;
        let saved = BlockSaved {
            ln_1,
            c_attn,
            heads,
            attn_proj,
            ln_2,
            c_fc,
            pre,
            mlp_proj,
            op,
        };
        Ok((out, saved))
    }

    fn backward(
        &self,
        pass: &mut BackwardPass<'_>,
        saved: &BlockSaved<L>,
        dout: &Act,
        core: Option<&dyn HeadsCore>,
    ) -> Result<Act> {
        let (l, uses) = (&self.layout, self.uses);
        let h1 = saved.h1();
        let (rows, cols, d) = (h1.rows(), h1.cols(), pass.param_dtype());
        dout.expect("dout", Some(rows), cols, d)?;
        // the residual stream's gradient: dout, then + ln_2's dx, then + ln_1's dx
        let dres = Act::alloc(pass.pool(), rows, cols, d)?;
        pass.device()
            .copy_d2d(pass.stream(), dout.input(), dres.view())?;
        let dact = self
            .mlp_proj
            .backward_on(l, pass, &saved.mlp_proj, dout, uses)?;
        let dpre = gelu_backward(pass, &saved.pre, &dact)?;
        drop(dact);
        let dy2 = self.c_fc.backward_on(l, pass, &saved.c_fc, &dpre, uses)?;
        drop(dpre);
        self.ln_2.backward_on(l, pass, &saved.ln_2, &dy2, &dres)?;
        drop(dy2);
        let dmerged = self
            .attn_proj
            .backward_on(l, pass, &saved.attn_proj, &dres, uses)?;
        let dqkv = attend_backward(pass, &saved.op, core, &saved.heads, &dmerged)?;
        drop(dmerged);
        let dy1 = self
            .c_attn
            .backward_on(l, pass, &saved.c_attn, &dqkv, uses)?;
        drop(dqkv);
        self.ln_1.backward_on(l, pass, &saved.ln_1, &dy1, &dres)?;
        Ok(dres)
    }
}

impl Block<Serial> {
    /// GPT-2's initialisation of parameter `name` of a block of `channels` channels, on its
    /// own: LayerNorms γ 1, β 0, biases zero, weights uniform in ±1/√inputs from a seed
    /// of the layer's name ([`Linear::default_init`](super::Linear::default_init)).
    pub fn default_init(name: &str, channels: usize) -> Init {
        if name.ends_with(".bias") {
            Init::Zeros
        } else if name.contains(".ln_") {
            Init::Constant(1.0)
        } else {
            let inputs = if name.ends_with("mlp.c_proj.weight") {
                4 * channels
            } else {
                channels
            };
            super::Linear::default_init(name.trim_end_matches(".weight"), inputs)
        }
    }
}

/// The master of a column linear with `parts` stacked output blocks, reordered so that each
/// of `ranks` column blocks of its outputs holds its share of every part side by side: output
/// `o'` = `r·(parts·n) + s·n + a` (rank block `r`, part `s`, `a < n = outputs/(parts·ranks)`)
/// is master output `s·outputs/parts + r·n + a`. Element `e` of the reordered `[outputs,
/// inputs]` (`inputs = 1` for a bias). Layouts that split a column linear's outputs into
/// contiguous blocks register this, so that the attention finds its heads' queries, keys and
/// values in its block.
pub fn by_rank_block(
    master: &Init,
    [inputs, outputs]: [usize; 2],
    parts: usize,
    ranks: usize,
) -> Init {
    if parts <= 1 || ranks <= 1 {
        return master.clone();
    }
    let (m, n, block) = (master.clone(), outputs / (parts * ranks), outputs / parts);
    Init::Fn(Arc::new(move |e| {
        let (o, col) = (e / inputs, e % inputs);
        let (r, rest) = (o / (parts * n), o % (parts * n));
        let (s, a) = (rest / n, rest % n);
        m.value((s * block + r * n + a) * inputs + col)
    }))
}
