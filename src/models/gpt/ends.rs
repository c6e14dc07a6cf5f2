//! The two ends of a GPT: the token embedding and the LM head tied to it, whole or with the
//! vocabulary split over a tensor-parallel group.

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::nn::{Act, EmbSaved, Embedding, LmHead, LmSaved, Loss};
use crate::parallel::{VocabEmbSaved, VocabEmbedding1D, VocabHead1D, VocabHeadSaved};
use crate::store::{BackwardPass, ForwardPass};
use crate::tensor::TensorId;

/// The token and position embedding and the LM head tied to `wte`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ends {
    /// `wte` whole on this rank ([`Embedding`], [`LmHead`] with the fused cross-entropy).
    Whole {
        /// `wte` and `wpe`.
        embedding: Embedding,
        /// The head over `wte`.
        head: LmHead,
    },
    /// `wte`'s rows split over a 1D tensor-parallel group ([`VocabEmbedding1D`],
    /// [`VocabHead1D`] with the cross-entropy over the whole vocabulary).
    Split {
        /// This rank's `wte` rows and `wpe`.
        embedding: VocabEmbedding1D,
        /// The head over those rows.
        head: VocabHead1D,
    },
}

/// What the embedding keeps for its backward.
#[derive(Debug)]
pub(super) enum EmbKept {
    Whole(Box<EmbSaved>),
    Split(Box<VocabEmbSaved>),
}

/// What the head keeps for its backward.
#[derive(Debug)]
pub(super) enum HeadKept {
    Whole(LmSaved),
    Split(VocabHeadSaved),
}

/// The group a split end needs.
fn group(tp: Option<&Communicator>) -> Result<&Communicator> {
    tp.ok_or_else(|| Error::InvalidArgument("a vocab-split model runs with its group".into()))
}

impl Ends {
    /// `wte` (this rank's rows when split).
    pub fn wte(&self) -> TensorId {
        match self {
            Ends::Whole { embedding, .. } => embedding.wte,
            Ends::Split { embedding, .. } => embedding.wte,
        }
    }

    /// `wpe`.
    pub fn wpe(&self) -> TensorId {
        match self {
            Ends::Whole { embedding, .. } => embedding.wpe,
            Ends::Split { embedding, .. } => embedding.wpe,
        }
    }

    /// The embedding of `tokens` at positions `first .. first + seq` of their sequences.
    pub(super) fn embed(
        &self,
        fwd: &ForwardPass<'_>,
        tp: Option<&Communicator>,
        tokens: &[i32],
        [batch, seq, first]: [usize; 3],
    ) -> Result<(Act, EmbKept)> {
        match self {
            Ends::Whole { embedding, .. } => {
                let (x, s) = embedding.forward_at(fwd, tokens, batch, seq, first)?;
                Ok((x, EmbKept::Whole(Box::new(s))))
            }
            Ends::Split { embedding, .. } => {
                let (x, s) = embedding.forward_at(fwd, group(tp)?, tokens, batch, seq, first)?;
                Ok((x, EmbKept::Split(Box::new(s))))
            }
        }
    }

    pub(super) fn head_forward(
        &self,
        fwd: &ForwardPass<'_>,
        tp: Option<&Communicator>,
        h: &Act,
        targets: &[i32],
        scale: f32,
    ) -> Result<(Loss, HeadKept)> {
        match self {
            Ends::Whole { head, .. } => {
                let (l, s) = head.forward_deferred(fwd, h, targets, scale)?;
                Ok((l, HeadKept::Whole(s)))
            }
            Ends::Split { head, .. } => {
                let (l, s) = head.forward(fwd, group(tp)?, h, targets, scale)?;
                Ok((Loss::ready(l), HeadKept::Split(s)))
            }
        }
    }

    pub(super) fn head_backward(
        &self,
        bwd: &BackwardPass<'_>,
        tp: Option<&Communicator>,
        kept: &HeadKept,
    ) -> Result<Act> {
        match (self, kept) {
            (Ends::Whole { head, .. }, HeadKept::Whole(s)) => head.backward(bwd, s),
            (Ends::Split { head, .. }, HeadKept::Split(s)) => head.backward(bwd, group(tp)?, s),
            _ => Err(Error::InvalidArgument(
                "the head's saved state is of the other kind".into(),
            )),
        }
    }

    pub(super) fn embed_backward(
        &self,
        bwd: &BackwardPass<'_>,
        kept: &EmbKept,
        dout: &Act,
    ) -> Result<()> {
        match (self, kept) {
            (Ends::Whole { embedding, .. }, EmbKept::Whole(s)) => embedding.backward(bwd, s, dout),
            (Ends::Split { embedding, .. }, EmbKept::Split(s)) => embedding.backward(bwd, s, dout),
            _ => Err(Error::InvalidArgument(
                "the embedding's saved state is of the other kind".into(),
            )),
        }
    }
}
