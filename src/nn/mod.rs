//! Layers written on the trainer API ([`crate::store`]) and the device ops ([`crate::ops`]):
//! [`Linear`], [`LayerNorm`] and [`gelu`], and of them GPT-2's [`CausalSelfAttention`],
//! [`Mlp`] and pre-LayerNorm transformer [`Block`], its token and position [`Embedding`] and
//! the [`LmHead`] tied to the token embedding with the fused cross-entropy, over activations ([`Act`]) from the store's
//! non-model pool, so the tide sees them.
//!
//! A layer holds the ids of its parameters. `forward` fetches them through the
//! [`ForwardPass`](crate::store::ForwardPass), runs its op on the pass's stream reading the
//! parameters in place in their chunks, and returns its output (plus, for [`LayerNorm`], what
//! its backward needs); the caller keeps the inputs the backward needs. `backward` fetches
//! again, computes the input's gradient first (it reads the parameters), then writes the
//! parameters' gradients into their slots on the device — no host round trip. A layer applied
//! more than once per iteration (tied weights) adds its shares instead ([`WeightUse::Shared`]).
//! Activations and parameters are of the store's parameter dtype (f32, f16 or bf16; the ops
//! compute in f32).
//!
//! # Example
//!
//! `LayerNorm → Linear → GELU → Linear`, one forward and backward from an upstream gradient of
//! ones:
//!
//! ```
//! use tidemem::nn::{gelu, gelu_backward, Act, LayerNorm, Linear};
//! use tidemem::prelude::*;
//!
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let mut cfg = ManagerConfig::new(64, Policy::Tide);
//! cfg.param_dtype = DType::F32;
//! let mut m = ChunkManager::new(dev, cfg)?;
//! let ln = LayerNorm::register(&mut m, "ln", 4, 1e-5)?;
//! let fc = Linear::register(&mut m, "fc", 4, 8, true, None)?;
//! let proj = Linear::register(&mut m, "proj", 8, 4, true, None)?;
//!
//! let fwd = m.forward()?;
//! let x = Act::upload(fwd.pool(), fwd.stream(), 2, 4, DType::F32, &[1., 2., 3., 4., 0., 1., 0., 1.])?;
//! let (h, ln_saved) = ln.forward(&fwd, &x, None)?;
//! let z = fc.forward(&fwd, &h)?;
//! let (a, z_saved) = gelu(&fwd, &z)?;
//! let y = proj.forward(&fwd, &a)?;
//! assert_eq!(y.shape(), [2, 4]);
//! fwd.finish()?;
//!
//! let bwd = m.backward()?;
//! let dy = Act::upload(bwd.pool(), bwd.stream(), 2, 4, DType::F32, &[1.0; 8])?;
//! let da = proj.backward(&bwd, &a, &dy, true)?.expect("asked for dx");
//! let dz = gelu_backward(&bwd, &z_saved, &da)?;
//! let dh = fc.backward(&bwd, &h, &dz, true)?.expect("asked for dx");
//! let dx = ln.backward(&bwd, &ln_saved, &dh, None)?;
//! assert_eq!(dx.shape(), [2, 4]);
//! bwd.finish()?;
//!
//! // the gradients, in the parameters' slots: db = Σ_rows dy
//! assert_eq!(m.read(proj.bias.unwrap())?, vec![2.0; 4]);
//! # Ok(()) }
//! ```

mod act;
mod attention;
mod block;
mod checkpoint;
mod embedding;
mod gelu;
mod layernorm;
mod layout;
mod linear;
mod lm_head;
mod loss;
mod losses;
mod mlp;
mod relu;
mod sequential;

pub use act::Act;
pub use attention::{
    attend, attend_backward, heads_backward, heads_forward, Attended, CausalSelfAttention,
    CausalSelfAttentionSaved, HeadsCore, HeadsCoreSaved, HeadsSaved,
};
pub use block::{by_rank_block, Block, BlockOn, BlockSaved};
pub use checkpoint::{CheckpointSaved, Checkpointed};
pub use embedding::{Embedding, EmbeddingSaved};
pub use gelu::{gelu, gelu_backward, GeluSaved};
pub use layernorm::{LayerNorm, LayerNormSaved};
pub use layout::{EmbeddingOn, HeadOn, Layout, LinearOn, NormOn, Pair, Serial, Unsplit};
pub use linear::{Linear, WeightUse};
pub use lm_head::{LmHead, LmHeadSaved};
pub use loss::Loss;
pub use losses::{BceWithLogitsLoss, CrossEntropyLoss, MseLoss};
pub use mlp::{Mlp, MlpSaved};
pub use relu::{relu, relu_backward, Gelu, Relu, ReluSaved};
pub use sequential::{Layer, LinearInput, Sequential, SequentialSaved};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::store::{Guard, PassKind};

/// Checks that tensor `i` of a guard has `shape` and the store's dtype `d`.
fn check_param<K: PassKind>(g: &Guard<'_, K>, i: usize, shape: &[usize], d: DType) -> Result<()> {
    let p = g.param(i)?;
    if p.shape() != shape || p.dtype() != d {
        return Err(Error::ParamShape {
            tensor: g.ids()[i].0,
            shape: p.shape().to_vec(),
            dtype: p.dtype(),
            expected: shape.to_vec(),
            expected_dtype: d,
        });
    }
    Ok(())
}

/// Checks a LayerNorm's ε (finite, ≥ 0) for layer `name`: [`Error::BadValue`] otherwise.
pub(crate) fn check_eps(name: &str, eps: f32) -> Result<()> {
    if eps.is_finite() && eps >= 0.0 {
        return Ok(());
    }
    Err(Error::BadValue {
        what: format!("'{name}': layer norm eps"),
        value: f64::from(eps),
        want: "finite and ≥ 0",
    })
}

/// Checks a loss (or gradient) scale `what` (finite, > 0): [`Error::BadValue`] otherwise.
pub(crate) fn check_scale(what: &str, scale: f32) -> Result<()> {
    if scale.is_finite() && scale > 0.0 {
        return Ok(());
    }
    Err(Error::BadValue {
        what: what.to_string(),
        value: f64::from(scale),
        want: "positive and finite",
    })
}

/// Checks the split of `whose` `channels` into `heads`: both positive
/// ([`Error::TooFew`]), the channels a multiple of the heads ([`Error::NotMultiple`]).
fn check_heads(whose: &str, channels: usize, heads: usize) -> Result<()> {
    for (what, n) in [("channels", channels), ("heads", heads)] {
        if n == 0 {
            return Err(Error::TooFew {
                what: format!("{what} of {whose}"),
                got: 0,
                need: 1,
            });
        }
    }
    if !channels.is_multiple_of(heads) {
        return Err(Error::NotMultiple {
            what: "channels",
            value: channels,
            of: "attention heads",
            divisor: heads,
        });
    }
    Ok(())
}

/// Checks that an attention's `rows` are `batch × seq`, neither zero: [`Error::Empty`],
/// [`Error::Overflow`] or [`Error::Length`] otherwise.
fn check_rows(rows: usize, batch: usize, seq: usize) -> Result<()> {
    if batch == 0 || seq == 0 {
        return Err(Error::Empty {
            what: format!("an attention over batch {batch} × sequence {seq}"),
        });
    }
    match batch.checked_mul(seq) {
        None => Err(Error::Overflow {
            what: format!("the rows of an attention over batch {batch} × sequence {seq}"),
        }),
        Some(n) if n != rows => Err(Error::Length {
            what: format!("rows of an attention over batch {batch} × sequence {seq}"),
            got: rows,
            expected: n,
        }),
        Some(_) => Ok(()),
    }
}

/// The input gradient of a [`Linear::backward`] that was asked for one.
fn asked_dx(dx: Option<Act>) -> Result<Act> {
    dx.ok_or_else(|| Error::Internal {
        what: "a linear backward asked for dx gave none".into(),
    })
}

/// A seed from a layer's name (64-bit FNV-1a): the same name, the same initial weights.
fn hash_name(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_differ_by_name_and_repeat() {
        assert_eq!(hash_name("fc1"), hash_name("fc1"));
        assert_ne!(hash_name("fc1"), hash_name("fc2"));
        assert_eq!(hash_name(""), 0xcbf2_9ce4_8422_2325);
    }

    #[test]
    fn layers_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Linear>();
        send_sync::<LayerNorm>();
        send_sync::<LayerNormSaved>();
        send_sync::<Block>();
        send_sync::<BlockSaved>();
        send_sync::<Embedding>();
        send_sync::<EmbeddingSaved>();
        send_sync::<LmHead>();
        send_sync::<LmHeadSaved>();
    }
}
