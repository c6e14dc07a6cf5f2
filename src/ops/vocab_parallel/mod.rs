//! Vocab-parallel (Megatron-style tensor-parallel) token embedding and cross-entropy: rank `r`
//! of `P` holds the rows `start..start + V_r` of the token table `wte` `[V, C]` and of the tied
//! LM head — a [`VocabShard`]. The ops here are one rank's device work; the layer that calls
//! them runs the all-reduces between them (these ops run no collective).
//!
//! **Embedding** ([`vocab_embedding_forward`]): `out[n] = table[tokens[n] − start]` when this
//! rank owns `tokens[n]`, zeros otherwise; the all-reduce (SUM) of `out` over the ranks then
//! holds the one owner's row. Backward ([`vocab_embedding_backward`]): `dtable[row] (+)= Σ
//! dout[n]` over the positions whose token is this rank's local row `row`, written (rows no
//! owned token names become 0) or accumulated (those rows kept). It is **deterministic**
//! without atomics: the host groups the owned positions by row — a [`VocabPlan`], the
//! [`EncoderPlan`](crate::ops::EncoderPlan)'s layout restricted to the shard — and each row sums
//! its positions in order.
//!
//! **Cross-entropy** over logits `[N, Vp]` whose first `V_r` columns are this rank's vocabulary
//! (the rest padding), targets `[N]` i32 in `0..V`, in three steps:
//! 1. [`vocab_ce_max`]: each row's maximum over the local columns; the layer all-reduces (MAX)
//!    them into `m`.
//! 2. [`vocab_ce_sums`]: `S_r = Σ_j exp(x_j − m)` over the local columns and the target's
//!    `x_t − m` where this rank owns the target (0 elsewhere); the layer all-reduces (SUM) both
//!    into `S` and `pred`.
//! 3. [`vocab_ce_grad`]: the logits' gradient `(exp(x_j − m)/S − [j = t])·grad_scale` written
//!    **over the logits** (0 in the padding), and optionally the losses `ln S − pred`.
//!
//! A row whose target is the ignore index gets 0 statistics in step 2 (`S_r = 0`, `x_t − m =
//! 0`), and loss 0 and gradient 0 in step 3 (whatever `S` and `m` are). Statistics and losses
//! are f32; storage f32, f16 or bf16 with f32 math. The kernels (`kernels/vocab_parallel.cu`)
//! reduce a row with one block of [`VOCAB_CE_THREADS`] threads, in the order of
//! [`cross_entropy_forward`](crate::ops::cross_entropy_forward) (on one rank, `P = 1`, the three steps give the
//! fused op's bits), with `math.cuh`'s exp and ln; the CPU twins mirror them bit for bit.
//!
//! **Ids out of range.** A token or target outside `0..V` (a target that is not the ignore
//! index) is a typed error of [`VocabPlan::new`] and of the simulated device (reported at the
//! next synchronisation, nothing written). CUDA cannot report it: the embedding writes NaN over
//! that position's row, the cross-entropy NaN statistics, loss and gradient (over the local
//! columns) for that row. Ids owned by another rank are no error.
//!
//! ```
//! use tidemem::device::{Device, SimConfig};
//! use tidemem::ops::vocab_parallel::*;
//! use tidemem::DType;
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let s = dev.new_stream()?;
//! let up = |v: &[f32]| dev.upload(&s, bytemuck::cast_slice(v));
//! let get = |b| -> tidemem::Result<Vec<f32>> { Ok(bytemuck::pod_collect_to_vec(&dev.download(&s, b)?)) };
//! // V = 3 tokens of C = 1 channel over 2 ranks: rank 1 holds tokens 1 and 2.
//! let shard = VocabShard::of_rank(3, 1, 2)?;
//! assert_eq!((shard.start, shard.rows), (1, 2));
//! let tokens = dev.upload(&s, bytemuck::cast_slice(&[2i32, 0]))?;
//! let (table, out) = (up(&[10.0, 20.0])?, dev.alloc(8)?);
//! vocab_embedding_forward(&dev, &s, &tokens, &table, &out, &shard, 1, DType::F32)?;
//! assert_eq!(get(&out)?, [20.0, 0.0]); // token 0 is rank 0's
//!
//! // Cross-entropy on one rank (P = 1: the all-reduces are the identity).
//! let ce = VocabCrossEntropy::new(VocabShard::new(2, 0, 2)?, -100, 1.0);
//! let (logits, targets) = (up(&[0.0, 0.0])?, dev.upload(&s, bytemuck::cast_slice(&[1i32]))?);
//! let (m, sum, pred, loss) = (dev.alloc(4)?, dev.alloc(4)?, dev.alloc(4)?, dev.alloc(4)?);
//! vocab_ce_max(&dev, &s, &logits, &m, &ce, DType::F32)?;
//! let sums = VocabCeSums {
//!     logits: (&logits).into(),
//!     targets: (&targets).into(),
//!     global_max: (&m).into(),
//!     sum_exp: (&sum).into(),
//!     target_logit: (&pred).into(),
//! };
//! vocab_ce_sums(&dev, &s, sums, &ce, DType::F32)?;
//! let grad = VocabCeGrad {
//!     logits: (&logits).into(),
//!     targets: (&targets).into(),
//!     global_max: (&m).into(),
//!     global_sum: (&sum).into(),
//!     global_target: Some((&pred).into()),
//!     losses: Some((&loss).into()),
//! };
//! vocab_ce_grad(&dev, &s, grad, &ce, DType::F32)?;
//! assert!((get(&loss)?[0] - std::f32::consts::LN_2).abs() < 1e-6);
//! assert_eq!(get(&logits)?, [0.5, -0.5]);
//! # Ok(()) }
//! ```

pub(crate) mod cross_entropy;
pub(crate) mod embedding;

pub use cross_entropy::{
    vocab_ce_grad, vocab_ce_max, vocab_ce_sums, VocabCeGrad, VocabCeSums, VocabCrossEntropy,
    VOCAB_CE_THREADS,
};
pub use embedding::{vocab_embedding_backward, vocab_embedding_forward, VocabPlan};

use crate::device::LaunchInfo;
use crate::error::{Error, Result};
use crate::ops::cross_entropy::MAX_VOCAB;

/// The rows of the vocabulary one rank holds: tokens `start..start + rows` of `0..vocab`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabShard {
    /// `V`: the whole vocabulary (`1 ≤ V ≤` [`MAX_VOCAB`]; ids are i32).
    pub vocab: usize,
    /// The first token this rank holds.
    pub start: usize,
    /// `V_r ≥ 1`: the tokens (table rows, logit columns) this rank holds; `start + V_r ≤ V`.
    pub rows: usize,
}

impl VocabShard {
    /// The shard `start..start + rows` of `0..vocab`, checked (see the fields): anything else
    /// is an [`Error::InvalidArgument`].
    pub fn new(vocab: usize, start: usize, rows: usize) -> Result<Self> {
        let s = VocabShard { vocab, start, rows };
        s.rule()
            .map_err(|why| Error::InvalidArgument(format!("vocab shard: {why}")))?;
        Ok(s)
    }

    /// Rank `rank`'s shard of `ranks`: tokens `⌊rank·V/P⌋..⌊(rank + 1)·V/P⌋` (shards differ by
    /// at most one row when `P` does not divide `V`). `rank ≥ ranks` is an
    /// [`Error::IndexOutOfRange`], `ranks > V` an [`Error::TooFew`].
    pub fn of_rank(vocab: usize, rank: usize, ranks: usize) -> Result<Self> {
        if rank >= ranks {
            return Err(Error::IndexOutOfRange {
                what: "rank of a vocabulary split".into(),
                index: rank,
                len: ranks,
            });
        }
        if ranks > vocab {
            return Err(Error::TooFew {
                what: format!("tokens in a vocabulary split over {ranks} ranks"),
                got: vocab,
                need: ranks,
            });
        }
        // u128: `rank · V` may overflow usize.
        let at = |r: usize| (r as u128 * vocab as u128 / ranks as u128) as usize;
        Self::new(vocab, at(rank), at(rank + 1) - at(rank))
    }

    /// One past the last token of the shard.
    pub fn end(&self) -> usize {
        self.start + self.rows
    }

    /// Whether this shard holds `token`.
    pub fn owns(&self, token: i32) -> bool {
        token >= 0 && (token as usize) >= self.start && (token as usize) - self.start < self.rows
    }

    /// `Err(why)` when the shard breaks its rules.
    fn rule(&self) -> std::result::Result<(), String> {
        shard_rule(self.vocab as u64, self.start as u64, self.rows as u64)
    }
}

/// The shard rules on launch parameters: `1 ≤ V ≤ MAX_VOCAB`, `rows ≥ 1`, `start + rows ≤ V`.
fn shard_rule(vocab: u64, start: u64, rows: u64) -> std::result::Result<(), String> {
    let fits = start.checked_add(rows).is_some_and(|e| e <= vocab);
    if vocab == 0 || vocab > MAX_VOCAB as u64 || rows == 0 || !fits {
        return Err(format!(
            "the shard needs 1 ≤ V ≤ {MAX_VOCAB}, V_r ≥ 1 and start + V_r ≤ V, got V = {vocab}, \
             start = {start}, V_r = {rows}"
        ));
    }
    Ok(())
}

/// [`shard_rule`] as the op's error.
fn check_shard(info: &LaunchInfo<'_>, vocab: u64, start: u64, rows: u64) -> Result<()> {
    shard_rule(vocab, start, rows).map_err(|why| info.desc.error(why))
}

/// The first of `ids` outside `0..vocab` that is not `ignore` (`None` ignores nothing).
fn bad_id(ids: &[i32], vocab: u64, ignore: Option<i32>) -> Option<usize> {
    ids.iter()
        .position(|&t| Some(t) != ignore && (t < 0 || t as u64 >= vocab))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_vocabulary() {
        for (v, p) in [(50usize, 3usize), (1, 1), (7, 7), (50_257, 8), (10, 4)] {
            let mut next = 0;
            for r in 0..p {
                let s = VocabShard::of_rank(v, r, p).unwrap();
                assert_eq!(s.start, next, "{v} over {p}");
                assert!(s.rows == v / p || s.rows == v / p + 1);
                next = s.end();
            }
            assert_eq!(next, v);
        }
        let s = VocabShard::of_rank(50, 1, 3).unwrap();
        assert_eq!((s.start, s.rows), (16, 17));
        assert!(s.owns(16) && s.owns(32) && !s.owns(33) && !s.owns(15) && !s.owns(-1));
        assert!(VocabShard::of_rank(2, 0, 3).is_err());
        assert!(VocabShard::of_rank(5, 2, 2).is_err());
        assert!(VocabShard::new(5, 3, 3).is_err());
        assert!(VocabShard::new(5, 0, 0).is_err());
        assert!(VocabShard::new(0, 0, 1).is_err());
        assert!(VocabShard::new(usize::MAX, usize::MAX, 1).is_err());
        assert!(VocabShard::new(5, 4, 1).is_ok());
    }

    #[test]
    fn bad_ids_are_found() {
        assert_eq!(bad_id(&[0, 4, -100], 5, Some(-100)), None);
        assert_eq!(bad_id(&[0, 4, -100], 5, None), Some(2));
        assert_eq!(bad_id(&[0, 5], 5, None), Some(1));
    }
}
