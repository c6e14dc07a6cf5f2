//! Causal multi-head self-attention (GPT-2's `attn`): `c_attn` (C → 3C), the attention op, and
//! `c_proj` (C → C).

use super::act::Act;
use super::asked_dx;
use super::linear::Linear;
use crate::error::{Error, Result};
use crate::ops::attention::{Attention, AttentionBackward, AttentionForward};
use crate::ops::heads::Heads;
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// Causal multi-head self-attention over `channels = heads · head_dim` features, as GPT-2's
/// `CausalSelfAttention`: `qkv = c_attn(x)`, per head `softmax_causal(q·kᵀ/√D)·v`, the heads
/// merged, then `y = c_proj(·)`. The attention runs
/// [`ops::attention`](crate::ops::attention) on buffers from the pass's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CausalSelfAttention {
    /// The fused query/key/value projection, `C → 3C` (queries, keys, values side by side).
    pub c_attn: Linear,
    /// The output projection, `C → C`.
    pub c_proj: Linear,
    /// Heads `H` (`C` divisible by `H`).
    pub heads: usize,
}

/// What [`CausalSelfAttention::forward`] keeps for the backward: its input, the per-head
/// `q`, `k`, `v` and attention probabilities, and the merged heads (`c_proj`'s input).
#[derive(Debug)]
pub struct CausalSelfAttentionSaved {
    x: Act,
    heads: Attended,
    merged: Act,
    batch: usize,
    seq: usize,
}

/// What [`attend`] keeps for [`attend_backward`]: the local attention's saved state, or
/// another core's.
#[derive(Debug)]
pub struct Attended(CoreKept);

#[derive(Debug)]
enum CoreKept {
    Local(HeadsSaved),
    Other(HeadsCoreSaved),
}

/// The attention between the projections of a layer's `qkv` (`[rows, 3·inner]`): by `core`,
/// or locally by `op` ([`heads_forward`]). Returns the merged heads (`[rows, inner]`).
pub fn attend(
    pass: &ForwardPass<'_>,
    op: &Attention,
    core: Option<&dyn HeadsCore>,
    qkv: &Act,
) -> Result<(Act, Attended)> {
    Ok(match core {
        None => {
            let (m, h) = heads_forward(pass, op, qkv)?;
            (m, Attended(CoreKept::Local(h)))
        }
        Some(c) => {
            let (m, h) = c.forward(pass, qkv)?;
            (m, Attended(CoreKept::Other(h)))
        }
    })
}

/// The backward of [`attend`] (with the same `op` and `core`): `dqkv` from `dmerged`.
pub fn attend_backward(
    pass: &BackwardPass<'_>,
    op: &Attention,
    core: Option<&dyn HeadsCore>,
    saved: &Attended,
    dmerged: &Act,
) -> Result<Act> {
    match (&saved.0, core) {
        (CoreKept::Local(h), None) => heads_backward(pass, op, h, dmerged),
        (CoreKept::Other(h), Some(c)) => c.backward(pass, h, dmerged),
        // run with another core than its forward
        _ => Err(Error::SavedMismatch {
            layer: "an attention (its backward run with another core than its forward)".into(),
        }),
    }
}

/// The attention between the projections: how `qkv` (`[rows, 3·inner]`, queries, keys and
/// values side by side) becomes the merged heads (`[rows, inner]`). Without one,
/// [`CausalSelfAttention`] attends over the positions of its own rows ([`heads_forward`]); a
/// sequence-parallel rank attends across the ranks that hold the other positions
/// ([`RingAttention`](crate::parallel::sequence::RingAttention)'s core).
pub trait HeadsCore: Send + Sync {
    /// The merged heads and what the backward needs.
    fn forward(&self, pass: &ForwardPass<'_>, qkv: &Act) -> Result<(Act, HeadsCoreSaved)>;
    /// `dqkv` (`[rows, 3·inner]`) from the merged heads' gradient.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: &HeadsCoreSaved,
        dmerged: &Act,
    ) -> Result<Act>;
}

/// What a [`HeadsCore`] keeps for its backward: any `Send + Sync` value, taken back by type.
pub struct HeadsCoreSaved(Box<dyn std::any::Any + Send + Sync>);

impl HeadsCoreSaved {
    /// Keeps `value`.
    pub fn new<T: std::any::Any + Send + Sync>(value: T) -> HeadsCoreSaved {
        HeadsCoreSaved(Box::new(value))
    }

    /// The value kept, if it is a `T`; [`Error::SavedMismatch`] otherwise (a saved state
    /// handed to another kind of core).
    pub fn get<T: std::any::Any>(&self) -> Result<&T> {
        self.0.downcast_ref().ok_or_else(|| Error::SavedMismatch {
            layer: "an attention core (its saved state is of another kind)".into(),
        })
    }
}

impl std::fmt::Debug for HeadsCoreSaved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HeadsCoreSaved(..)")
    }
}

impl CausalSelfAttentionSaved {
    /// The layer's input `x` `[B·T, C]` (shared with the caller's).
    pub fn x(&self) -> &Act {
        &self.x
    }

    /// `[B·H·T, T]` attention probabilities (the causal softmax's output); `None` when
    /// another [`HeadsCore`] computed the attention.
    pub fn att(&self) -> Option<&Act> {
        match &self.heads.0 {
            CoreKept::Local(h) => Some(&h.att),
            CoreKept::Other(_) => None,
        }
    }
}

impl CausalSelfAttention {
    /// Registers `{name}.c_attn.{weight,bias}` (`[3C, C]`, `[3C]`) and
    /// `{name}.c_proj.{weight,bias}` (`[C, C]`, `[C]`): weights with `init` (or
    /// [`Linear::default_init`]), biases zero. `channels` must be a positive multiple of
    /// `heads`.
    pub fn register(
        store: &mut impl ParamStore,
        name: &str,
        channels: usize,
        heads: usize,
        init: Option<Init>,
    ) -> Result<CausalSelfAttention> {
        super::check_heads(&format!("attention '{name}'"), channels, heads)?;
        let c_attn = Linear::register(
            store,
            &format!("{name}.c_attn"),
            channels,
            3 * channels,
            true,
            init.clone(),
        )?;
        let c_proj = Linear::register(
            store,
            &format!("{name}.c_proj"),
            channels,
            channels,
            true,
            init,
        )?;
        Ok(CausalSelfAttention {
            c_attn,
            c_proj,
            heads,
        })
    }

    /// Channels `C` of the output (the model's width).
    pub fn channels(&self) -> usize {
        self.c_proj.outputs
    }

    /// Channels of the heads this layer computes (`c_attn`'s outputs / 3): `C`, or the share
    /// of a tensor-parallel rank, whose `c_attn` gives its heads' `q`, `k`, `v` and whose
    /// `c_proj` takes their merged output.
    pub(crate) fn inner(&self) -> usize {
        self.c_attn.outputs / 3
    }

    /// The parameters: `c_attn`'s, then `c_proj`'s.
    pub fn params(&self) -> Vec<TensorId> {
        let mut v = self.c_attn.params();
        v.extend(self.c_proj.params());
        v
    }

    /// The op for `rows = batch × seq` rows; [`Error::Empty`], [`Error::Length`] or
    /// [`Error::Overflow`] for rows that are not, and [`Error::TooFew`],
    /// [`Error::NotMultiple`] or [`Error::Length`] for a layer whose projections and heads do
    /// not fit together.
    pub(super) fn op(&self, rows: usize, batch: usize, seq: usize) -> Result<Attention> {
        let c = self.inner();
        super::check_rows(rows, batch, seq)?;
        // the heads split c_attn's outputs into q, k, v of `c` channels, merged into c_proj
        super::check_heads("an attention (c_attn's outputs / 3)", c, self.heads)?;
        if self.c_attn.outputs != 3 * c {
            return Err(Error::Length {
                what: "attention: c_attn's outputs (q, k and v side by side)".into(),
                got: self.c_attn.outputs,
                expected: 3 * c,
            });
        }
        if self.c_proj.inputs != c {
            return Err(Error::Length {
                what: "attention: c_proj's inputs for the merged heads".into(),
                got: self.c_proj.inputs,
                expected: c,
            });
        }
        Ok(Attention::new(Heads::new(
            batch,
            seq,
            self.heads,
            c / self.heads,
        )))
    }

    /// `y = c_proj(attention(c_attn(x)))` for `x` `[B·T, C]` (rows batch-major: row `b·T + t`
    /// is token `t` of sequence `b`). Returns `y` `[B·T, C]` and what the backward needs;
    /// the scratch returns to the pool. Shapes and types are checked before anything runs
    /// ([`Error::ActivationShape`], and [`Error::Length`] or [`Error::Empty`] for rows that
    /// are not `batch × seq`).
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        batch: usize,
        seq: usize,
    ) -> Result<(Act, CausalSelfAttentionSaved)> {
        self.forward_core(pass, x, batch, seq, None)
    }

    /// [`CausalSelfAttention::forward`] with the attention between the projections computed
    /// by `core` (or locally, with `None`).
    pub(crate) fn forward_core(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        batch: usize,
        seq: usize,
        core: Option<&dyn HeadsCore>,
    ) -> Result<(Act, CausalSelfAttentionSaved)> {
        let d = pass.param_dtype();
        x.expect("x", None, self.c_attn.inputs, d)?;
        let op = self.op(x.rows(), batch, seq)?;
        let qkv = self.c_attn.forward(pass, x)?;
        let (merged, heads) = attend(pass, &op, core, &qkv)?;
        drop(qkv);
        let out = self.c_proj.forward(pass, &merged)?;
        let saved = CausalSelfAttentionSaved {
            x: x.clone(),
            heads,
            merged,
            batch,
            seq,
        };
        Ok((out, saved))
    }

    /// The backward of [`CausalSelfAttention::forward`] from the output's gradient `dy`
    /// `[B·T, C]`: writes the four parameters' gradients and returns `dx`.
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: &CausalSelfAttentionSaved,
        dy: &Act,
    ) -> Result<Act> {
        self.backward_core(pass, saved, dy, None)
    }

    /// [`CausalSelfAttention::backward`] of a forward computed by `core` (the same core).
    pub(crate) fn backward_core(
        &self,
        pass: &BackwardPass<'_>,
        saved: &CausalSelfAttentionSaved,
        dy: &Act,
        core: Option<&dyn HeadsCore>,
    ) -> Result<Act> {
        let d = pass.param_dtype();
        let rows = saved.x.rows();
        saved.x.expect("saved input", None, self.c_attn.inputs, d)?;
        dy.expect("dy", Some(rows), self.channels(), d)?;
        let op = self.op(rows, saved.batch, saved.seq)?;
        let dmerged = self
            .c_proj
            .backward(pass, &saved.merged, dy, true)
            .and_then(asked_dx)?;
        let dqkv = attend_backward(pass, &op, core, &saved.heads, &dmerged)?;
        drop(dmerged);
        self.c_attn
            .backward(pass, &saved.x, &dqkv, true)
            .and_then(asked_dx)
    }
}

/// What [`heads_forward`] keeps for [`heads_backward`]: the per-head `q`, `k`, `v`
/// (`[rows, inner]`) and the attention probabilities (`[B·H·T, T]`).
#[derive(Debug)]
pub struct HeadsSaved {
    q: Act,
    k: Act,
    v: Act,
    att: Act,
}

/// The attention between the projections, on buffers from the pass's pool: `qkv`
/// (`[rows, 3·inner]`, queries, keys and values side by side) to the merged heads
/// (`[rows, inner]`) by `op` ([`ops::attention`](crate::ops::attention)); the scratch returns
/// to the pool. For the serial layer and for a tensor-parallel rank's share of the heads.
pub fn heads_forward(
    pass: &ForwardPass<'_>,
    op: &Attention,
    qkv: &Act,
) -> Result<(Act, HeadsSaved)> {
    let (d, pool, rows) = (qkv.dtype(), pass.pool(), qkv.rows());
    let inner = qkv.cols() / 3;
    let sh = &op.shape;
    let heads = || Act::alloc(pool, rows, inner, d);
    let (q, k, v, y, merged) = (heads()?, heads()?, heads()?, heads()?, heads()?);
    let score_rows = (sh.batch * sh.heads * sh.seq) as usize;
    let scores = || Act::alloc(pool, score_rows, sh.seq as usize, d);
    let (sc, att) = (scores()?, scores()?);
    let bufs = AttentionForward {
        qkv: qkv.input(),
        q: q.view(),
        k: k.view(),
        v: v.view(),
        scores: sc.view(),
        att: att.view(),
        y: y.view(),
        out: merged.view(),
    };
    op.forward(pass.device(), pass.stream(), bufs, d)?;
    Ok((merged, HeadsSaved { q, k, v, att }))
}

/// The backward of [`heads_forward`] from the merged heads' gradient `dmerged`
/// (`[rows, inner]`): `dqkv` (`[rows, 3·inner]`).
pub fn heads_backward(
    pass: &BackwardPass<'_>,
    op: &Attention,
    saved: &HeadsSaved,
    dmerged: &Act,
) -> Result<Act> {
    let (d, pool, rows, inner) = (dmerged.dtype(), pass.pool(), dmerged.rows(), dmerged.cols());
    let heads = || Act::alloc(pool, rows, inner, d);
    let (dyh, dq, dk, dv) = (heads()?, heads()?, heads()?, heads()?);
    let scores = || Act::alloc(pool, saved.att.rows(), saved.att.cols(), d);
    let (datt, dscores) = (scores()?, scores()?);
    let dqkv = Act::alloc(pool, rows, 3 * inner, d)?;
    let bufs = AttentionBackward {
        dout: dmerged.input(),
        q: saved.q.input(),
        k: saved.k.input(),
        v: saved.v.input(),
        att: saved.att.input(),
        dy: dyh.view(),
        datt: datt.view(),
        dscores: dscores.view(),
        dq: dq.view(),
        dk: dk.view(),
        dv: dv.view(),
        dqkv: dqkv.view(),
    };
    op.backward(pass.device(), pass.stream(), bufs, d)?;
    Ok(dqkv)
}
