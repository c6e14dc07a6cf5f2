//! What the layouts' ends share: a model's first layer (a token embedding with a position
//! embedding, [`TokenPosition`]) and its last (a final LayerNorm with a head, [`NormHead`]),
//! each layout bringing its own parts; the checks of what splits, and the position
//! embedding's ids.

use crate::error::{Error, Result};
use crate::nn::Act;
use crate::ops::{add_in_place, Axpby};
use crate::store::ForwardPass;

/// A model's first layer on a layout: the token embedding `wte` and the position embedding
/// `wpe`, each this rank's part.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenPosition<T, P> {
    /// The token embedding.
    pub wte: T,
    /// The position embedding.
    pub wpe: P,
}

/// A model's last layer on a layout: the final LayerNorm and the head tied to a `wte` part,
/// each this rank's part.
#[derive(Clone, Debug, PartialEq)]
pub struct NormHead<N, H> {
    /// The final LayerNorm.
    pub ln_f: N,
    /// The head, with its cross-entropy.
    pub head: H,
}

/// What a split end's hint says.
const HINT: &str = "the ends split over the tensor group (pad the vocabulary, GPT-2's 50257 to \
                    50304, or keep the ends whole: EndsLayout::Whole)";

/// Fails unless ends of `[vocab, positions, channels]` split on a grid of side `q`: the
/// vocabulary and the positions by `q`, the channels by `q²`.
pub(crate) fn check_grid_ends(q: usize, [vocab, positions, channels]: [usize; 3]) -> Result<()> {
    if q == 0 {
        return Err(Error::Empty {
            what: "the grid the ends split over (q = 0)".into(),
        });
    }
    for (what, n, by, parts) in [
        ("vocabulary", vocab, "q", q),
        ("positions", positions, "q", q),
        ("channels", channels, "q²", q * q),
    ] {
        if !n.is_multiple_of(parts) {
            return Err(Error::NotSplit {
                layer: HINT.into(),
                what,
                value: n,
                parts,
                by,
            });
        }
    }
    Ok(())
}

/// Fails unless a vocabulary of `vocab` tokens splits over a 1D group of `size` ranks.
pub(crate) fn check_rows_ends(size: usize, vocab: usize) -> Result<()> {
    if size == 0 {
        return Err(Error::Empty {
            what: "the 1D group the ends split over".into(),
        });
    }
    if vocab < size {
        return Err(Error::TooFew {
            what: format!(
                "vocabulary tokens of ends split over a 1D group of {size} ranks (pad the \
                 vocabulary, or keep the ends whole: EndsLayout::Whole)"
            ),
            got: vocab,
            need: size,
        });
    }
    Ok(())
}

/// The token embedding of `tokens` plus the position embedding of their positions (`first
/// ..` of sequences of `seq`), from `wte` and `wpe` run on the ids: the token embedding's
/// output, with both saved states.
pub(crate) fn token_plus_position<A, B>(
    pass: &ForwardPass<'_>,
    tokens: &[i32],
    [seq, first]: [usize; 2],
    wte: impl FnOnce(&[i32]) -> Result<(Act, A)>,
    wpe: impl FnOnce(&[i32]) -> Result<(Act, B)>,
) -> Result<(Act, (A, B))> {
    let positions: Vec<i32> = (0..tokens.len())
        .map(|n| (first + n % seq.max(1)) as i32)
        .collect();
    let (x, st) = wte(tokens)?;
    let (p, sp) = wpe(&positions)?;
    let one = Axpby {
        alpha: 1.0,
        beta: 1.0,
    };
    add_in_place(
        pass.device(),
        pass.stream(),
        one,
        x.view(),
        p.input(),
        x.dtype(),
    )?;
    Ok((x, (st, sp)))
}
