//! The three device steps of the vocab-parallel cross-entropy (see [the module](super)).

use super::{bad_id, check_shard, VocabShard};
use crate::device::kernel::{param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::float::{simd, with_float, Float};
use crate::ops::rows::{elements, expect, Operands};
use crate::ops::{lanes, math};

abi! {
    /// The parameters of the cross-entropy steps (`VocabCeParams` in `vocab_parallel.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct VocabCeParams {
        /// Rows, `N`.
        pub n: u64,
        /// The local vocabulary columns of each row, `V_r` (the first `V_r` elements).
        pub rows: u64,
        /// Elements per row of the logits (`≥ V_r`; the rest is padding).
        pub stride: u64,
        /// The token of local column 0.
        pub start: u64,
        /// The whole vocabulary, `V` (targets lie in `0..V`).
        pub vocab: u64,
        /// Rows whose target equals it count for nothing.
        pub ignore_index: i32,
        /// The gradient's factor (read by the gradient step only).
        pub grad_scale: f32,
    }
}

/// Threads per block (one block per row) of the cross-entropy kernels; the reduction order
/// depends on it, so it is fixed (`VP_CE_THREADS` in `vocab_parallel.cuh`), as
/// [`CROSS_ENTROPY_THREADS`](crate::ops::CROSS_ENTROPY_THREADS).
pub const VOCAB_CE_THREADS: u32 = 256;
const LANES: usize = VOCAB_CE_THREADS as usize;

/// The shard, padding and scalars of the vocab-parallel cross-entropy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VocabCrossEntropy {
    /// The vocabulary columns this rank holds.
    pub shard: VocabShard,
    /// Elements per row of the local logits (`≥ shard.rows`; columns past `shard.rows` are
    /// padding: never read, zeroed by the gradient step).
    pub padded_rows: usize,
    /// Rows whose target is this value count for nothing (PyTorch's default is -100).
    pub ignore_index: i32,
    /// The gradient's factor, e.g. `1 / rows counted` (over all ranks' batch) for a mean loss.
    pub grad_scale: f32,
}

impl VocabCrossEntropy {
    /// Unpadded logits (`padded_rows = shard.rows`).
    pub fn new(shard: VocabShard, ignore_index: i32, grad_scale: f32) -> Self {
        VocabCrossEntropy {
            shard,
            padded_rows: shard.rows,
            ignore_index,
            grad_scale,
        }
    }

    fn params(&self, n: usize) -> VocabCeParams {
        VocabCeParams {
            n: n as u64,
            rows: self.shard.rows as u64,
            stride: self.padded_rows as u64,
            start: self.shard.start as u64,
            vocab: self.shard.vocab as u64,
            ignore_index: self.ignore_index,
            grad_scale: self.grad_scale,
        }
    }
}

const FLOATS: &[DType] = &DType::FLOATS;
const F32: &[DType] = &[DType::F32];
const I32: &[DType] = &[DType::I32];

const LAYOUT: crate::device::ParamLayout = param_layout!(
    VocabCeParams,
    "vocab_parallel.cuh",
    [n, rows, stride, start, vocab, ignore_index, grad_scale]
);

abi! {
    /// Step 1: each row's maximum over the local columns. Logits read, `row_max` (f32) written.
    static VOCAB_CE_MAX: KernelDesc = KernelDesc {
        name: "vocab_ce_max",
        operands: &[
            OperandSpec::read("logits", FLOATS),
            OperandSpec::write("row_max", F32),
        ],
        params: LAYOUT,
        check: Some(check),
        twin: |a| with_float!(a.dtype(0).unwrap_or(DType::F32), T => max_typed::<T>(a)),
        cuda: CudaSide::Nvrtc {
            source: "vocab_parallel.cu",
            plan: |info| plan(info, "vocab_ce_max"),
        },
    };
}

abi! {
    /// Step 2: `Σ exp(x − m)` over the local columns and the owned target's `x_t − m`. Logits,
    /// targets and the all-reduced maxima read; `sum_exp` and `target_logit` (f32) written.
    static VOCAB_CE_SUMS: KernelDesc = KernelDesc {
        name: "vocab_ce_sums",
        operands: &[
            OperandSpec::read("logits", FLOATS),
            OperandSpec::read("targets", I32),
            OperandSpec::read("global_max", F32),
            OperandSpec::write("sum_exp", F32),
            OperandSpec::write("target_logit", F32),
        ],
        params: LAYOUT,
        check: Some(check),
        twin: |a| with_float!(a.dtype(0).unwrap_or(DType::F32), T => sums_typed::<T>(a)),
        cuda: CudaSide::Nvrtc {
            source: "vocab_parallel.cu",
            plan: |info| plan(info, "vocab_ce_sums"),
        },
    };
}

abi! {
    /// Step 3: the gradient written over the logits (read and written) and, when both are
    /// given, the losses `ln S − pred` (`global_target` read, `losses` written). Targets and the
    /// all-reduced maxima and sums read.
    static VOCAB_CE_GRAD: KernelDesc = KernelDesc {
        name: "vocab_ce_grad",
        operands: &[
            OperandSpec::read_write("logits", FLOATS),
            OperandSpec::read("targets", I32),
            OperandSpec::read("global_max", F32),
            OperandSpec::read("global_sum", F32),
            OperandSpec::read("global_target", F32).optional(),
            OperandSpec::write("losses", F32).optional(),
        ],
        params: LAYOUT,
        check: Some(check),
        twin: |a| with_float!(a.dtype(0).unwrap_or(DType::F32), T => grad_typed::<T>(a)),
        cuda: CudaSide::Nvrtc {
            source: "vocab_parallel.cu",
            plan: |info| plan(info, "vocab_ce_grad"),
        },
    };
}

/// The shape check of the three steps: the shard, `stride ≥ V_r`, logits `[N, stride]`, the
/// targets `[N]` i32 and every statistic `[N]` f32; `global_target` and `losses` together.
fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: VocabCeParams = info.params()?;
    check_shard(info, p.vocab, p.start, p.rows)?;
    if p.stride < p.rows {
        return Err(info.desc.error(format!(
            "the padded row needs Vp ≥ V_r, got Vp = {} and V_r = {}",
            p.stride, p.rows
        )));
    }
    let d = info.dtype(0).unwrap_or(DType::F32);
    let logits = elements(info, p.n, p.stride)?;
    let n = elements(info, p.n, 1)?;
    let shape = format!("[N, Vp] = [{}, {}]", p.n, p.stride);
    expect(info, 0, &shape, logits, d)?;
    let row = format!("[N] = [{n}]");
    for (i, spec) in info.desc.operands.iter().enumerate().skip(1) {
        let t = if spec.name == "targets" {
            DType::I32
        } else {
            DType::F32
        };
        expect(info, i, &row, n, t)?;
    }
    if info.desc.operands.len() == 6 && info.present(4) != info.present(5) {
        return Err(info
            .desc
            .error("operands `global_target` and `losses` are both given or both left out"));
    }
    Ok(())
}

fn plan(info: &LaunchInfo<'_>, entry: &str) -> Result<Vec<Grid>> {
    let p: VocabCeParams = info.params()?;
    if p.n == 0 {
        return Ok(vec![]);
    }
    let t = info.dtype(0).map_or("?", |d| d.name());
    Ok(vec![Grid::linear(
        format!("{entry}_{t}"),
        p.n.min(65_535) as u32,
        VOCAB_CE_THREADS,
    )])
}

/// The targets, checked: each in `0..V` or the ignore index (the twin's typed error).
fn checked_targets<'a>(
    o: &Operands<'a>,
    p: &VocabCeParams,
    desc: &KernelDesc,
) -> Result<&'a [i32]> {
    let targets = o.read::<i32>(1)?;
    match bad_id(targets, p.vocab, Some(p.ignore_index)) {
        None => Ok(targets),
        Some(r) => Err(desc.error(format!(
            "target {} of row {r} is outside 0..{} and not the ignore index {}",
            targets[r], p.vocab, p.ignore_index
        ))),
    }
}

/// The local column of target `t` (in `0..V`), or `None` when another rank owns it.
#[inline(always)]
fn local(t: i32, p: &VocabCeParams) -> Option<usize> {
    let l = (t as u64).wrapping_sub(p.start);
    (l < p.rows).then_some(l as usize)
}

/// The row's maximum as the kernel finds it (exact in any order), plus `+0` so that a maximum
/// of `-0` and `+0` is `+0` on both sides.
#[inline(always)]
fn row_max<T: Float>(x: &[T]) -> f32 {
    let mut mx = [f32::NEG_INFINITY; 32];
    let (chunks, rest) = x.as_chunks::<32>();
    for ch in chunks {
        for l in 0..32 {
            mx[l] = mx[l].max(ch[l].get());
        }
    }
    for (m, &v) in mx.iter_mut().zip(rest) {
        *m = m.max(v.get());
    }
    lanes::max_lanes(mx) + 0.0
}

/// `Σ_j exp(x_j − m)` in the kernel's order: thread `l` sums the columns `l, l + 256, …` from
/// `+0`, then [`lanes::block_sum`].
#[inline(always)]
fn row_sum_exp<T: Float>(x: &[T], m: f32) -> f32 {
    let mut sums = [0f32; LANES];
    let (chunks, rest) = x.as_chunks::<LANES>();
    for ch in chunks {
        for l in 0..LANES {
            sums[l] += math::exp(ch[l].get() - m);
        }
    }
    for (s, &v) in sums.iter_mut().zip(rest) {
        *s += math::exp(v.get() - m);
    }
    lanes::block_sum(&sums)
}

fn max_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: VocabCeParams = a.params()?;
    let mut o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    let (v, vp) = (p.rows as usize, p.stride as usize);
    let logits = o.read::<T>(0)?;
    let out = o.write::<f32>(1)?;
    simd(
        #[inline(always)]
        || {
            for (m, x) in out.iter_mut().zip(logits.chunks_exact(vp)) {
                *m = row_max(&x[..v]);
            }
        },
    );
    Ok(())
}

fn sums_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: VocabCeParams = a.params()?;
    let mut o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    let targets = checked_targets(&o, &p, &VOCAB_CE_SUMS)?;
    let (v, vp) = (p.rows as usize, p.stride as usize);
    let (logits, gmax) = (o.read::<T>(0)?, o.read::<f32>(2)?);
    let (sum_exp, target_logit) = (o.write::<f32>(3)?, o.write::<f32>(4)?);
    simd(
        #[inline(always)]
        || {
            for (r, &t) in targets.iter().enumerate() {
                if t == p.ignore_index {
                    (sum_exp[r], target_logit[r]) = (0.0, 0.0);
                    continue;
                }
                let (x, m) = (&logits[r * vp..][..v], gmax[r]);
                sum_exp[r] = row_sum_exp(x, m);
                target_logit[r] = local(t, &p).map_or(0.0, |j| x[j].get() - m);
            }
        },
    );
    Ok(())
}

fn grad_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: VocabCeParams = a.params()?;
    let mut o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    let targets = checked_targets(&o, &p, &VOCAB_CE_GRAD)?;
    let (v, vp) = (p.rows as usize, p.stride as usize);
    let (gmax, gsum) = (o.read::<f32>(2)?, o.read::<f32>(3)?);
    let gtarget = o.read_opt::<f32>(4)?;
    let logits = o.write::<T>(0)?;
    let mut losses = o.write_opt::<f32>(5)?;
    let scale = p.grad_scale;
    simd(
        #[inline(always)]
        || {
            for (r, (&t, row)) in targets.iter().zip(logits.chunks_exact_mut(vp)).enumerate() {
                let (m, s) = (gmax[r], gsum[r]);
                if t == p.ignore_index {
                    row.fill(T::ZERO);
                    if let Some(l) = losses.as_deref_mut() {
                        l[r] = 0.0;
                    }
                    continue;
                }
                if let (Some(l), Some(g)) = (losses.as_deref_mut(), gtarget) {
                    l[r] = math::ln(s) - g[r];
                }
                let inv = 1.0 / s;
                let (live, pad) = row.split_at_mut(v);
                let target = local(t, &p).map(|j| (j, math::exp(live[j].get() - m)));
                for g in live.iter_mut() {
                    *g = T::put((math::exp(g.get() - m) * inv) * scale);
                }
                if let Some((j, e)) = target {
                    live[j] = T::put((e * inv - 1.0) * scale);
                }
                pad.fill(T::ZERO);
            }
        },
    );
    Ok(())
}

fn rows_of(stat: &DeviceView<'_>) -> usize {
    stat.len() / 4
}

/// Step 1 on `stream`: `row_max[n]` (f32, `N` of them) = the maximum of the logits' row `n`
/// over the shard's `V_r` columns (`logits` `[N, Vp]` of `dtype`, read only). All-reduce
/// (MAX) the result over the ranks before [`vocab_ce_sums`].
pub fn vocab_ce_max<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    logits: impl Into<Input<'a>>,
    row_max: impl Into<DeviceView<'b>>,
    ce: &VocabCrossEntropy,
    dtype: DType,
) -> Result<()> {
    let row_max = row_max.into();
    let p = ce.params(rows_of(&row_max));
    let ops = [
        Some(Operand::input(logits, dtype)),
        Some(Operand::new(row_max, DType::F32)),
    ];
    dev.launch(stream, &VOCAB_CE_MAX, &ops, bytemuck::bytes_of(&p))
}

/// The operands of [`vocab_ce_sums`]: `[N]` statistics (f32) and targets (i32).
#[derive(Clone, Copy, Debug)]
pub struct VocabCeSums<'a> {
    /// `[N, Vp]` local logits (read).
    pub logits: Input<'a>,
    /// `[N]` targets in `0..V` or the ignore index.
    pub targets: Input<'a>,
    /// `[N]` the all-reduced (MAX) row maxima `m`.
    pub global_max: Input<'a>,
    /// `[N]` written: `Σ_j exp(x_j − m)` over the local columns (0 on ignored rows).
    pub sum_exp: DeviceView<'a>,
    /// `[N]` written: `x_t − m` where the shard owns the target, else 0 (0 on ignored rows).
    pub target_logit: DeviceView<'a>,
}

/// Step 2 on `stream` (see [`VocabCeSums`]). All-reduce (SUM) `sum_exp` into `S` and
/// `target_logit` into `pred` over the ranks before [`vocab_ce_grad`] (exactly one rank
/// holds each counted row's target, so `pred` is that rank's value).
pub fn vocab_ce_sums(
    dev: &Device,
    stream: &Stream,
    ops: VocabCeSums<'_>,
    ce: &VocabCrossEntropy,
    dtype: DType,
) -> Result<()> {
    let p = ce.params(ops.targets.len() / 4);
    let operands = [
        Some(Operand::input(ops.logits, dtype)),
        Some(Operand::input(ops.targets, DType::I32)),
        Some(Operand::input(ops.global_max, DType::F32)),
        Some(Operand::new(ops.sum_exp, DType::F32)),
        Some(Operand::new(ops.target_logit, DType::F32)),
    ];
    dev.launch(stream, &VOCAB_CE_SUMS, &operands, bytemuck::bytes_of(&p))
}

/// The operands of [`vocab_ce_grad`]: `[N]` statistics (f32) and targets (i32).
#[derive(Clone, Copy, Debug)]
pub struct VocabCeGrad<'a> {
    /// `[N, Vp]` local logits, overwritten with their gradient.
    pub logits: DeviceView<'a>,
    /// `[N]` targets in `0..V` or the ignore index.
    pub targets: Input<'a>,
    /// `[N]` the all-reduced (MAX) row maxima `m`.
    pub global_max: Input<'a>,
    /// `[N]` the all-reduced (SUM) `S = Σ exp(x − m)` over the whole vocabulary.
    pub global_sum: Input<'a>,
    /// `[N]` the all-reduced (SUM) target logits `pred = x_t − m`; given with `losses`.
    pub global_target: Option<Input<'a>>,
    /// `[N]` written: `ln S − pred`, 0 on ignored rows; given with `global_target`.
    pub losses: Option<DeviceView<'a>>,
}

/// Step 3 on `stream` (see [`VocabCeGrad`]): the logits' gradient `(exp(x_j − m)/S − [j =
/// t])·grad_scale` over the shard's columns (the one-hot only on the rank that owns `t`), 0 in
/// the padding and on ignored rows, written over the logits; and the losses when asked for
/// (the same on every rank).
pub fn vocab_ce_grad(
    dev: &Device,
    stream: &Stream,
    ops: VocabCeGrad<'_>,
    ce: &VocabCrossEntropy,
    dtype: DType,
) -> Result<()> {
    let p = ce.params(ops.targets.len() / 4);
    let operands = [
        Some(Operand::new(ops.logits, dtype)),
        Some(Operand::input(ops.targets, DType::I32)),
        Some(Operand::input(ops.global_max, DType::F32)),
        Some(Operand::input(ops.global_sum, DType::F32)),
        ops.global_target.map(|g| Operand::input(g, DType::F32)),
        ops.losses.map(|l| Operand::new(l, DType::F32)),
    ];
    dev.launch(stream, &VOCAB_CE_GRAD, &operands, bytemuck::bytes_of(&p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_reductions_follow_the_threads() {
        for v in [1usize, 31, 256, 257, 1000] {
            let x: Vec<f32> = (0..v).map(|j| ((j * 29 % 17) as f32 - 8.0) * 0.6).collect();
            let m = row_max(&x);
            assert_eq!(m, x.iter().copied().fold(f32::NEG_INFINITY, f32::max));
            let mut lanes_sum = [0f32; LANES];
            for (j, &xj) in x.iter().enumerate() {
                lanes_sum[j % LANES] += math::exp(xj - m);
            }
            let s = row_sum_exp(&x, m);
            assert_eq!(s.to_bits(), lanes::block_sum(&lanes_sum).to_bits(), "{v}");
            let want: f64 = x.iter().map(|&xj| (xj as f64 - m as f64).exp()).sum();
            assert!((s as f64 - want).abs() <= 1e-6 * want, "{v}");
        }
        assert_eq!(row_max(&[-0.0f32, 0.0]).to_bits(), 0);
        assert_eq!(row_max(&[-0.0f32]).to_bits(), 0);
        assert_eq!(row_max(&[f32::NAN, -3.0]), -3.0);
    }

    #[test]
    fn targets_map_to_local_columns() {
        let p = VocabCrossEntropy::new(VocabShard::new(50, 16, 17).unwrap(), -100, 1.0).params(1);
        assert_eq!(local(16, &p), Some(0));
        assert_eq!(local(32, &p), Some(16));
        assert_eq!(local(33, &p), None);
        assert_eq!(local(15, &p), None);
        assert_eq!(local(0, &p), None);
    }
}
