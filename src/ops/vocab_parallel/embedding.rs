//! The masked token lookup of a vocab shard and its deterministic backward (see
//! [the module](super)).

use super::{bad_id, check_shard, VocabShard};
use crate::device::kernel::{grid_stride, param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::embedding::device::embedding_threads;
use crate::ops::embedding::{plan_backward, BagMode};
use crate::ops::encoder::split_plan;
use crate::ops::float::{simd, with_float, Float};
use crate::ops::rows::{elements, expect, Operands};

abi! {
    /// The parameters of `vocab_embedding_forward` (`vocab_parallel.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct VocabEmbeddingParams {
        /// Positions (tokens), `N`.
        pub n: u64,
        /// Channels `C ≥ 1`.
        pub c: u64,
        /// Rows of the local table, `V_r`.
        pub rows: u64,
        /// The first token the local table holds.
        pub start: u64,
        /// The whole vocabulary, `V`.
        pub vocab: u64,
    }
}

abi! {
    /// The parameters of `vocab_embedding_backward` (`vocab_parallel.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct VocabEmbeddingBackwardParams {
        /// Positions, `N` (rows of `dout`).
        pub n: u64,
        /// Channels `C ≥ 1`.
        pub c: u64,
        /// Rows of the local table's gradient, `V_r`.
        pub rows: u64,
        /// Distinct local rows of the plan, `U`.
        pub distinct: u64,
        /// Positions the plan holds (those whose token the shard owns), `M ≤ N`.
        pub owned: u64,
        /// 1: `dtable += sums`; 0: `dtable = sums`, rows the plan does not name zeroed.
        pub accumulate: u32,
        /// Zero.
        pub pad: u32,
    }
}

const FLOATS: &[DType] = &DType::FLOATS;

abi! {
    /// Masked lookup: tokens and the local table read, `out` written.
    static VOCAB_EMBEDDING_FORWARD: KernelDesc = KernelDesc {
        name: "vocab_embedding_forward",
        operands: &[
            OperandSpec::read("tokens", &[DType::I32]),
            OperandSpec::read("table", FLOATS),
            OperandSpec::write("out", FLOATS),
        ],
        params: param_layout!(
            VocabEmbeddingParams,
            "vocab_parallel.cuh",
            [n, c, rows, start, vocab]
        ),
        check: Some(check_forward),
        twin: |a| with_float!(a.dtype(1).unwrap_or(DType::F32), T => forward_typed::<T>(a)),
        cuda: CudaSide::Nvrtc {
            source: "vocab_parallel.cu",
            plan: plan_forward,
        },
    };
}

abi! {
    /// The lookup's backward: `dout` and the plan (u32 words, [`VocabPlan::to_words`]) read, the
    /// local table's gradient written or accumulated into.
    static VOCAB_EMBEDDING_BACKWARD: KernelDesc = KernelDesc {
        name: "vocab_embedding_backward",
        operands: &[
            OperandSpec::read("dout", FLOATS),
            OperandSpec::read("plan", &[DType::U32]),
            OperandSpec::read_write("dtable", FLOATS),
        ],
        params: param_layout!(
            VocabEmbeddingBackwardParams,
            "vocab_parallel.cuh",
            [n, c, rows, distinct, owned, accumulate, pad]
        ),
        check: Some(check_backward),
        twin: |a| with_float!(a.dtype(0).unwrap_or(DType::F32), T => backward_typed::<T>(a)),
        cuda: CudaSide::Nvrtc {
            source: "vocab_parallel.cu",
            plan: plan_backward_grids,
        },
    };
}

fn channels_rule(info: &LaunchInfo<'_>, c: u64) -> Result<()> {
    if c == 0 {
        return Err(info.desc.error("the shape needs C ≥ 1, got C = 0"));
    }
    Ok(())
}

fn check_forward(info: &LaunchInfo<'_>) -> Result<()> {
    let p: VocabEmbeddingParams = info.params()?;
    channels_rule(info, p.c)?;
    check_shard(info, p.vocab, p.start, p.rows)?;
    let d = info.dtype(1).unwrap_or(DType::F32);
    let (table, out) = (elements(info, p.rows, p.c)?, elements(info, p.n, p.c)?);
    expect(
        info,
        0,
        &format!("[N] = [{}]", p.n),
        p.n as usize,
        DType::I32,
    )?;
    expect(
        info,
        1,
        &format!("[V_r, C] = [{}, {}]", p.rows, p.c),
        table,
        d,
    )?;
    expect(info, 2, &format!("[N, C] = [{}, {}]", p.n, p.c), out, d)
}

fn check_backward(info: &LaunchInfo<'_>) -> Result<()> {
    let p: VocabEmbeddingBackwardParams = info.params()?;
    channels_rule(info, p.c)?;
    if p.rows == 0 || p.owned > p.n || p.accumulate > 1 || p.pad != 0 {
        return Err(info.desc.error(format!(
            "the plan needs V_r ≥ 1, at most N owned positions and accumulate 0 or 1, got {p:?}"
        )));
    }
    let d = info.dtype(0).unwrap_or(DType::F32);
    let words = elements(info, p.distinct, 2)?
        .saturating_add(1)
        .saturating_add(p.owned as usize);
    let (dout, dtable) = (elements(info, p.n, p.c)?, elements(info, p.rows, p.c)?);
    expect(info, 0, &format!("[N, C] = [{}, {}]", p.n, p.c), dout, d)?;
    expect(info, 1, "2·U + 1 + M plan words", words, DType::U32)?;
    expect(
        info,
        2,
        &format!("[V_r, C] = [{}, {}]", p.rows, p.c),
        dtable,
        d,
    )
}

fn rows_grid(entry: String, rows: u64, c: u64) -> Vec<Grid> {
    if rows == 0 {
        return vec![];
    }
    let threads = embedding_threads(c as usize);
    vec![Grid::linear(entry, rows.min(65_535) as u32, threads)]
}

fn plan_forward(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let p: VocabEmbeddingParams = info.params()?;
    let t = info.dtype(1).map_or("?", |d| d.name());
    Ok(rows_grid(format!("vocab_embedding_forward_{t}"), p.n, p.c))
}

fn plan_backward_grids(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let p: VocabEmbeddingBackwardParams = info.params()?;
    let t = info.dtype(0).map_or("?", |d| d.name());
    let mut v = vec![];
    if p.accumulate == 0 {
        let all = (p.rows * p.c) as usize;
        v.extend(grid_stride(
            format!("vocab_embedding_backward_zero_{t}"),
            all,
        ));
    }
    let entry = format!("vocab_embedding_backward_rows_{t}");
    v.extend(rows_grid(entry, p.distinct, p.c));
    Ok(v)
}

fn token_error(tokens: &[i32], pos: usize, vocab: u64) -> String {
    format!(
        "token {} at position {pos} is outside 0..{vocab}",
        tokens[pos]
    )
}

fn forward_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: VocabEmbeddingParams = a.params()?;
    let mut o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    let tokens = o.read::<i32>(0)?;
    if let Some(pos) = bad_id(tokens, p.vocab, None) {
        return Err(forward_token_error(&p, tokens, pos));
    }
    let (table, out) = (o.read::<T>(1)?, o.write::<T>(2)?);
    let (c, start, rows) = (p.c as usize, p.start as i64, p.rows as i64);
    simd(
        #[inline(always)]
        || {
            for (o, &tok) in out.chunks_exact_mut(c).zip(tokens) {
                let local = tok as i64 - start;
                if (0..rows).contains(&local) {
                    o.copy_from_slice(&table[local as usize * c..][..c]);
                } else {
                    o.fill(T::ZERO);
                }
            }
        },
    );
    Ok(())
}

fn forward_token_error(p: &VocabEmbeddingParams, tokens: &[i32], pos: usize) -> Error {
    VOCAB_EMBEDDING_FORWARD.error(token_error(tokens, pos, p.vocab))
}

fn backward_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: VocabEmbeddingBackwardParams = a.params()?;
    let mut o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    let (n, c) = (p.n as usize, p.c as usize);
    let words = o.read::<u32>(1)?;
    let (rows, row_ptr, entries) = split_plan(words, p.distinct as usize, p.rows as usize, n)
        .map_err(|why| VOCAB_EMBEDDING_BACKWARD.error(why))?;
    let dout = o.read::<T>(0)?;
    let dtable = o.write::<T>(2)?;
    let accumulate = p.accumulate == 1;
    let mut acc = vec![0f32; c];
    simd(
        #[inline(always)]
        || {
            if !accumulate {
                dtable.fill(T::ZERO);
            }
            for (u, &r) in rows.iter().enumerate() {
                acc.fill(0.0);
                for &pos in &entries[row_ptr[u] as usize..row_ptr[u + 1] as usize] {
                    for (a, &x) in acc.iter_mut().zip(&dout[pos as usize * c..][..c]) {
                        *a += x.get();
                    }
                }
                let g = &mut dtable[r as usize * c..][..c];
                if accumulate {
                    for (g, &a) in g.iter_mut().zip(&acc) {
                        *g = T::put(g.get() + a);
                    }
                } else {
                    T::narrow(&acc, g);
                }
            }
        },
    );
    Ok(())
}

/// The host side of [`vocab_embedding_backward`]: the positions of a batch whose token the
/// shard owns, grouped by local row (token − start) in first-occurrence order, each group's
/// positions in order — the [`EncoderPlan`](crate::ops::EncoderPlan) layout (from the
/// embedding bags' [`plan_backward`], each position a bag of one owned token or none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VocabPlan {
    shard: VocabShard,
    positions: usize,
    rows: Vec<u32>,
    row_ptr: Vec<u32>,
    entries: Vec<u32>,
}

impl VocabPlan {
    /// The plan of `tokens` (`[N]`, e.g. `[B, T]` row-major) for `shard`. A token outside
    /// `0..shard.vocab` is an [`Error::TokenOutOfRange`], `N ≥ 2³²` an [`Error::TooLarge`], a
    /// shard breaking [`VocabShard`]'s rules an [`Error::InvalidArgument`].
    pub fn new(tokens: &[i32], shard: &VocabShard) -> Result<Self> {
        let fail = |why: String| Err(Error::InvalidArgument(format!("vocab plan: {why}")));
        if let Err(why) = shard.rule() {
            return fail(why);
        }
        if let Some(pos) = bad_id(tokens, shard.vocab as u64, None) {
            return Err(Error::TokenOutOfRange {
                token: tokens[pos].into(),
                position: pos,
                vocab: shard.vocab,
            });
        }
        if tokens.len() >= u32::MAX as usize {
            return Err(Error::TooLarge {
                what: "positions of a vocab plan (u32 entries)".into(),
                requested: tokens.len() as u128,
                limit: u32::MAX as u64 - 1,
            });
        }
        // Position p is bag p: one index (its local row) when owned, none otherwise.
        let mut ids = Vec::with_capacity(tokens.len());
        let mut offsets = Vec::with_capacity(tokens.len() + 1);
        offsets.push(0u32);
        for &t in tokens {
            if shard.owns(t) {
                ids.push((t as usize - shard.start) as u32);
            }
            offsets.push(ids.len() as u32);
        }
        let plan = plan_backward(&ids, &offsets, None, BagMode::Sum)?;
        Ok(VocabPlan {
            shard: *shard,
            positions: tokens.len(),
            rows: plan.rows,
            row_ptr: plan.row_ptr,
            entries: plan.entries,
        })
    }

    /// The shard the plan is for.
    pub fn shard(&self) -> &VocabShard {
        &self.shard
    }

    /// Positions of the batch (`N`).
    pub(crate) fn positions(&self) -> usize {
        self.positions
    }

    /// Positions whose token the shard owns (`M`).
    pub fn owned(&self) -> usize {
        self.entries.len()
    }

    /// Distinct local rows (`U`).
    pub fn distinct(&self) -> usize {
        self.rows.len()
    }

    /// The distinct local rows (token − start), in first-occurrence order.
    pub fn rows(&self) -> &[u32] {
        &self.rows
    }

    /// `U + 1` starts into [`entries`](Self::entries): local row `rows[u]` is at positions
    /// `entries[row_ptr[u]..row_ptr[u + 1]]`.
    pub fn row_ptr(&self) -> &[u32] {
        &self.row_ptr
    }

    /// The owned positions, grouped by row, in order within each group.
    pub fn entries(&self) -> &[u32] {
        &self.entries
    }

    /// Words of the device copy: `2·U + 1 + M`.
    pub(crate) fn words(&self) -> usize {
        self.rows.len() + self.row_ptr.len() + self.entries.len()
    }

    /// The device copy: rows, then row starts, then entries, as u32 words.
    pub fn to_words(&self) -> Vec<u32> {
        let mut w = Vec::with_capacity(self.words());
        w.extend_from_slice(&self.rows);
        w.extend_from_slice(&self.row_ptr);
        w.extend_from_slice(&self.entries);
        w
    }
}

/// Masked lookup on `stream`: `out[n, :] = table[tokens[n] − start, :]` where `shard` owns
/// `tokens[n]`, zeros elsewhere; `tokens` `[N]` i32, `table` `[V_r, C]` and `out` `[N, C]` of
/// `dtype` (`C = channels`). Summed over the ranks' shards (an all-reduce), `out` is the full
/// table's lookup. See [the module](super) for tokens out of range.
#[allow(clippy::too_many_arguments)]
pub fn vocab_embedding_forward<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    tokens: impl Into<Input<'a>>,
    table: impl Into<Input<'b>>,
    out: impl Into<DeviceView<'c>>,
    shard: &VocabShard,
    channels: usize,
    dtype: DType,
) -> Result<()> {
    let tokens = tokens.into();
    let p = VocabEmbeddingParams {
        n: (tokens.len() / 4) as u64,
        c: channels as u64,
        rows: shard.rows as u64,
        start: shard.start as u64,
        vocab: shard.vocab as u64,
    };
    let ops = [
        Some(Operand::input(tokens, DType::I32)),
        Some(Operand::input(table, dtype)),
        Some(Operand::new(out, dtype)),
    ];
    let desc = &VOCAB_EMBEDDING_FORWARD;
    dev.launch(stream, desc, &ops, bytemuck::bytes_of(&p))
}

/// The lookup's backward on `stream`: `dtable[row, :] (+)= Σ dout[n, :]` over the positions
/// whose token is the shard's local row `row` (`dout` `[N, C]`, `dtable` `[V_r, C]`, of
/// `dtype`; `C = channels`). `plan` is the batch's [`VocabPlan`] and `plan_words` its
/// [`to_words`](VocabPlan::to_words) on the device (u32). `accumulate`: add the sums to
/// `dtable` (rows no owned token names unchanged); otherwise write them (those rows 0). The
/// result is deterministic: each row sums its positions in order, in f32, rounded once.
#[allow(clippy::too_many_arguments)]
pub fn vocab_embedding_backward<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    dout: impl Into<Input<'a>>,
    plan: &VocabPlan,
    plan_words: impl Into<Input<'b>>,
    dtable: impl Into<DeviceView<'c>>,
    channels: usize,
    accumulate: bool,
    dtype: DType,
) -> Result<()> {
    let p = VocabEmbeddingBackwardParams {
        n: plan.positions() as u64,
        c: channels as u64,
        rows: plan.shard().rows as u64,
        distinct: plan.distinct() as u64,
        owned: plan.owned() as u64,
        accumulate: accumulate as u32,
        pad: 0,
    };
    let ops = [
        Some(Operand::input(dout, dtype)),
        Some(Operand::input(plan_words, DType::U32)),
        Some(Operand::new(dtable, dtype)),
    ];
    let desc = &VOCAB_EMBEDDING_BACKWARD;
    dev.launch(stream, desc, &ops, bytemuck::bytes_of(&p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_keeps_owned_positions_by_local_row() {
        let shard = VocabShard::new(10, 4, 3).unwrap();
        let p = VocabPlan::new(&[5, 1, 4, 5, 9, 6, 5], &shard).unwrap();
        assert_eq!(p.rows(), [1, 0, 2]);
        assert_eq!(p.row_ptr(), [0, 3, 4, 5]);
        assert_eq!(p.entries(), [0, 3, 6, 2, 5]);
        assert_eq!((p.positions(), p.owned(), p.distinct()), (7, 5, 3));
        assert_eq!(p.to_words().len(), p.words());
        assert_eq!(p.words(), 2 * 3 + 1 + 5);
        let none = VocabPlan::new(&[0, 1], &shard).unwrap();
        assert_eq!((none.owned(), none.distinct(), none.words()), (0, 0, 1));
        assert!(VocabPlan::new(&[10], &shard).is_err());
        assert!(VocabPlan::new(&[-1], &shard).is_err());
        let bad = VocabShard {
            vocab: 10,
            start: 8,
            rows: 3,
        };
        assert!(VocabPlan::new(&[0], &bad).is_err());
    }
}
