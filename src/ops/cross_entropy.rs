use crate::device::kernel::{param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::float::{simd, with_float, Float};
use crate::ops::rows::{elements, expect};
use crate::ops::{lanes, math};

abi! {
    /// The parameters of `kernels/cross_entropy.cu` (`cross_entropy.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct CrossEntropyParams {
        /// Rows.
        pub n: u64,
        /// Columns of the vocabulary (the first `v` of each row).
        pub v: u64,
        /// Elements per row (`vp ≥ v`).
        pub vp: u64,
        /// Rows whose target equals it count for nothing.
        pub ignore_index: i32,
        /// The factor of the gradient (e.g. 1 / the rows counted).
        pub grad_scale: f32,
    }
}

/// Threads per block (one block per row) of the cross-entropy kernels; the reduction order
/// depends on it, so it is fixed (`CE_THREADS` in `cross_entropy.cuh`).
pub const CROSS_ENTROPY_THREADS: u32 = 256;
const LANES: usize = CROSS_ENTROPY_THREADS as usize;

/// The largest vocabulary (targets are i32).
pub const MAX_VOCAB: usize = i32::MAX as usize;

/// The shape and scalars of a cross-entropy launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropy {
    /// `V`: the vocabulary, the columns that count (≥ 1, ≤ [`MAX_VOCAB`]).
    pub vocab: usize,
    /// `Vp ≥ V`: elements per row of the logits (columns `V..Vp` are padding).
    pub padded_vocab: usize,
    /// Rows whose target is this value have loss 0 and gradient 0 (PyTorch's default is -100).
    pub ignore_index: i32,
    /// The gradient's factor, e.g. `1 / rows counted` for a mean loss.
    pub grad_scale: f32,
}

const FLOATS: &[DType] = &DType::FLOATS;

abi! {
    /// Cross-entropy losses only: logits and targets read, losses written.
    static CROSS_ENTROPY_FORWARD: KernelDesc = KernelDesc {
        name: "cross_entropy_forward",
        operands: &[
            OperandSpec::read("logits", FLOATS),
            OperandSpec::read("targets", &[DType::I32]),
            OperandSpec::write("losses", &[DType::F32]),
        ],
        params: param_layout!(
            CrossEntropyParams,
            "cross_entropy.cuh",
            [n, v, vp, ignore_index, grad_scale]
        ),
        check: Some(check),
        twin: |a| with_float!(a.dtype(0).unwrap_or(DType::F32), T => twin_typed::<T>(a, false)),
        cuda: CudaSide::Nvrtc {
            source: "cross_entropy.cu",
            plan: |info| plan(info, "cross_entropy_forward"),
        },
    };
}

abi! {
    /// Cross-entropy losses and the logits' gradient, written over the logits (read and written);
    /// targets read, losses written.
    static CROSS_ENTROPY_FORWARD_BACKWARD: KernelDesc = KernelDesc {
        name: "cross_entropy_forward_backward",
        operands: &[
            OperandSpec::read_write("logits", FLOATS),
            OperandSpec::read("targets", &[DType::I32]),
            OperandSpec::write("losses", &[DType::F32]),
        ],
        params: param_layout!(
            CrossEntropyParams,
            "cross_entropy.cuh",
            [n, v, vp, ignore_index, grad_scale]
        ),
        check: Some(check),
        twin: |a| with_float!(a.dtype(0).unwrap_or(DType::F32), T => twin_typed::<T>(a, true)),
        cuda: CudaSide::Nvrtc {
            source: "cross_entropy.cu",
            plan: |info| plan(info, "cross_entropy_forward_backward"),
        },
    };
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: CrossEntropyParams = info.params()?;
    if p.v == 0 || p.v > MAX_VOCAB as u64 || p.vp < p.v {
        return Err(info.desc.error(format!(
            "the vocabulary needs 1 ≤ V ≤ {MAX_VOCAB} and V ≤ Vp, got V = {} and Vp = {}",
            p.v, p.vp
        )));
    }
    let logits = elements(info, p.n, p.vp)?;
    let n = elements(info, p.n, 1)?;
    let d = info.dtype(0).unwrap_or(DType::F32);
    expect(
        info,
        0,
        &format!("[N, Vp] = [{}, {}]", p.n, p.vp),
        logits,
        d,
    )?;
    expect(info, 1, &format!("[N] = [{n}]"), n, DType::I32)?;
    expect(info, 2, &format!("[N] = [{n}]"), n, DType::F32)
}

fn plan(info: &LaunchInfo<'_>, entry: &str) -> Result<Vec<Grid>> {
    let p: CrossEntropyParams = info.params()?;
    if p.n == 0 {
        return Ok(vec![]);
    }
    let t = info.dtype(0).map_or("?", |d| d.name());
    Ok(vec![Grid::linear(
        format!("{entry}_{t}"),
        p.n.min(65_535) as u32,
        CROSS_ENTROPY_THREADS,
    )])
}

/// The first row whose target is neither in `0..vocab` nor `ignore_index`.
fn bad_target(targets: &[i32], vocab: usize, ignore_index: i32) -> Option<usize> {
    targets
        .iter()
        .position(|&t| t != ignore_index && (t < 0 || t as usize >= vocab))
}

fn target_error(targets: &[i32], row: usize, vocab: usize, ignore_index: i32) -> String {
    format!(
        "target {} of row {row} is outside 0..{vocab} and not the ignore index {ignore_index}",
        targets[row]
    )
}

/// Checks targets on the host: every one lies in `0..vocab` or is `ignore_index`.
pub fn check_targets(targets: &[i32], vocab: usize, ignore_index: i32) -> Result<()> {
    match bad_target(targets, vocab, ignore_index) {
        None => Ok(()),
        Some(row) => Err(Error::TokenOutOfRange {
            token: targets[row].into(),
            position: row,
            vocab,
        }),
    }
}

/// The row's maximum `m` and `Σ exp(x_j − m)` in the kernel's order; `buf` (room for `x`
/// rounded up to whole blocks of [`CROSS_ENTROPY_THREADS`]) holds `exp(x_j − m)` after. The
/// padding is `-inf`, whose `exp` is 0: it changes neither the maximum nor a thread's sum
/// (`p + 0 = p` for the non-negative partials) and keeps the `exp` loop free of a scalar tail.
#[inline(always)]
fn row_stats<T: Float>(x: &[T], buf: &mut [f32]) -> (f32, f32) {
    let n = x.len();
    let full = n / 32 * 32;
    let mut mx = [f32::NEG_INFINITY; 32];
    for (b, x) in buf.chunks_exact_mut(32).zip(x.chunks_exact(32)) {
        for l in 0..32 {
            b[l] = x[l].get();
            mx[l] = mx[l].max(b[l]);
        }
    }
    let (tail, pad) = buf[full..].split_at_mut(n - full);
    for (b, &x) in tail.iter_mut().zip(&x[full..]) {
        *b = x.get();
    }
    pad.fill(f32::NEG_INFINITY);
    for (m, &b) in mx.iter_mut().zip(&buf[full..]) {
        *m = m.max(b);
    }
    let m = lanes::max_lanes(mx);
    let mut sums = [0f32; LANES];
    for b in buf.chunks_exact_mut(LANES) {
        for l in 0..LANES {
            b[l] = math::exp(b[l] - m);
            sums[l] += b[l];
        }
    }
    (m, lanes::block_sum(&sums))
}

/// `v` rounded up to whole blocks of [`CROSS_ENTROPY_THREADS`].
fn whole_blocks(v: usize) -> usize {
    v.div_ceil(LANES) * LANES
}

/// The gradient of one counted row over its `V` columns (from `buf` = `exp(x_j − m)`), the
/// padding zeroed.
#[inline(always)]
fn write_grad<T: Float>(row: &mut [T], buf: &[f32], target: usize, inv: f32, scale: f32) {
    let (live, pad) = row.split_at_mut(buf.len());
    for (g, &e) in live.iter_mut().zip(buf) {
        *g = T::put((e * inv) * scale);
    }
    live[target] = T::put((buf[target] * inv - 1.0) * scale);
    pad.fill(T::put(0.0));
}

fn twin_typed<T: Float>(a: &mut TwinArgs<'_>, grad: bool) -> Result<()> {
    let p: CrossEntropyParams = a.params()?;
    let (v, vp) = (p.v as usize, p.vp as usize);
    let targets = a.read_as::<i32>(1)?;
    if let Some(row) = bad_target(targets, v, p.ignore_index) {
        let why = target_error(targets, row, v, p.ignore_index);
        return Err(a.desc().error(why));
    }
    let mut buf = vec![0f32; whole_blocks(v)];
    let mut logits_in: &[T] = &[];
    let mut logits_out: &mut [T] = &mut [];
    if grad {
        logits_out = a.take_as::<T>(0)?;
    } else {
        logits_in = a.read_as::<T>(0)?;
    }
    let losses = a.take_as::<f32>(2)?;
    let logits_len = if grad {
        logits_out.len()
    } else {
        logits_in.len()
    };
    let fit = targets.len() as u64 == p.n && losses.len() == targets.len() && v <= vp;
    if !fit || logits_len as u64 != p.n * p.vp {
        return Err(a.desc().error(format!("operands do not fit {p:?}")));
    }
    simd(
        #[inline(always)]
        || {
            for (r, (&t, loss)) in targets.iter().zip(losses.iter_mut()).enumerate() {
                let row = r * vp..(r + 1) * vp;
                if t == p.ignore_index {
                    *loss = 0.0;
                    if grad {
                        logits_out[row].fill(T::put(0.0));
                    }
                    continue;
                }
                let t = t as usize;
                let x = if grad {
                    &logits_out[row.clone()]
                } else {
                    &logits_in[row.clone()]
                };
                let xt = x[t].get();
                let (m, sum) = row_stats(&x[..v], &mut buf);
                *loss = math::ln(sum) - (xt - m);
                if grad {
                    let e = &buf[..v];
                    write_grad(&mut logits_out[row], e, t, 1.0 / sum, p.grad_scale);
                }
            }
        },
    );
    Ok(())
}

fn params(desc: &KernelDesc, targets: &Input<'_>, ce: &CrossEntropy) -> Result<CrossEntropyParams> {
    if ce.vocab == 0 || ce.vocab > MAX_VOCAB || ce.padded_vocab < ce.vocab {
        return Err(desc.error(format!(
            "the vocabulary needs 1 ≤ V ≤ {MAX_VOCAB} and V ≤ Vp, got V = {} and Vp = {}",
            ce.vocab, ce.padded_vocab
        )));
    }
    Ok(CrossEntropyParams {
        n: (targets.len() / 4) as u64,
        v: ce.vocab as u64,
        vp: ce.padded_vocab as u64,
        ignore_index: ce.ignore_index,
        grad_scale: ce.grad_scale,
    })
}

/// Fused softmax cross-entropy over the vocabulary, as llm.c's classifier: logits `[N, Vp]`
/// (rows of `Vp ≥ V` elements, of which the first `V` are the vocabulary and the rest padding,
/// as GPT-2's 50 257 tokens padded to 50 304), targets `[N]` (i32). Per row `n` with target `t`:
/// `loss[n] = ln Σ_j exp(x_j − m) − (x_t − m)` (`m` the row's maximum, `j < V`), and in the same
/// pass ([`cross_entropy_forward_backward`]) the logits' gradient written **over the logits**:
/// `(softmax(x)_j − [j = t])·grad_scale` for `j < V`, 0 in the padding. A row whose target is
/// the ignore index has loss 0 and gradient 0. [`cross_entropy_forward`] writes only the losses
/// and leaves the logits untouched (evaluation).
///
/// The maximum, the sum, the loss and the gradient's arithmetic are f32 whatever the storage
/// (f32, f16 or bf16); one `ln` per row. CUDA (`kernels/cross_entropy.cu`) runs one block of
/// [`CROSS_ENTROPY_THREADS`] threads per row (thread `k` takes the columns `k, k + 256, …`;
/// warps reduce by the xor butterfly, the block adds the warps' totals in order); the CPU twin
/// keeps that order and uses [`math::exp`]/[`math::ln`], so the two agree bit for bit.
///
/// **Targets out of range.** A target outside `0..V` that is not the ignore index is a typed
/// error of the simulated device (reported at the next synchronisation, with no byte written).
/// CUDA cannot report it: such a row gets the loss NaN and, in the fused op, the gradient NaN
/// over its `V` columns (0 in the padding), so a loss or gradient check (`grad_stats`, a loss
/// scaler) sees it; nothing is read or written outside the operands. Targets on the host can
/// be checked before upload with [`check_targets`].
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::ops::CrossEntropy;
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// // Two rows of V = 2 logits padded to 3; the second row is ignored.
/// let logits = dev.upload(&s, bytemuck::cast_slice(&[0.0f32, 0.0, 7.0, 1.0, 2.0, 3.0]))?;
/// let targets = dev.upload(&s, bytemuck::cast_slice(&[1i32, -100]))?;
/// let losses = dev.alloc(8)?;
/// let ce = CrossEntropy { vocab: 2, padded_vocab: 3, ignore_index: -100, grad_scale: 1.0 };
/// tidemem::ops::cross_entropy_forward_backward(&dev, &s, &logits, &targets, &losses, &ce, DType::F32)?;
/// let loss: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &losses)?);
/// let grad: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &logits)?);
/// assert!((loss[0] - std::f32::consts::LN_2).abs() < 1e-6 && loss[1] == 0.0);
/// assert_eq!(grad, [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]);
/// # Ok(()) }
/// ```
///
/// Cross-entropy losses on `stream`: `losses[n]` (f32) of the logits' row `n` (`[N, Vp]`
/// `dtype` elements, read only) against `targets[n]` (i32, `N` of them); the logits are left
/// as they are. See [`cross_entropy_forward`] for the formula, ignored rows and targets out of range.
pub fn cross_entropy_forward<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    logits: impl Into<Input<'a>>,
    targets: impl Into<Input<'b>>,
    losses: impl Into<DeviceView<'c>>,
    ce: &CrossEntropy,
    dtype: DType,
) -> Result<()> {
    let (logits, targets, losses) = (logits.into(), targets.into(), losses.into());
    let p = params(&CROSS_ENTROPY_FORWARD, &targets, ce)?;
    let ops = [
        Some(Operand::input(logits, dtype)),
        Some(Operand::input(targets, DType::I32)),
        Some(Operand::new(losses, DType::F32)),
    ];
    dev.launch(stream, &CROSS_ENTROPY_FORWARD, &ops, bytemuck::bytes_of(&p))
}

/// Cross-entropy losses and, in the same pass, the logits' gradient written over the logits
/// (`[N, Vp]` `dtype` elements): `(softmax − onehot(target))·grad_scale` on the `V` columns, 0
/// on the padding and on ignored rows. `losses` (f32) and `targets` (i32) hold `N` elements and
/// overlap nothing else. See [`cross_entropy_forward`].
pub fn cross_entropy_forward_backward<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    logits: impl Into<DeviceView<'a>>,
    targets: impl Into<Input<'b>>,
    losses: impl Into<DeviceView<'c>>,
    ce: &CrossEntropy,
    dtype: DType,
) -> Result<()> {
    let (logits, targets, losses) = (logits.into(), targets.into(), losses.into());
    let p = params(&CROSS_ENTROPY_FORWARD_BACKWARD, &targets, ce)?;
    let ops = [
        Some(Operand::new(logits, dtype)),
        Some(Operand::input(targets, DType::I32)),
        Some(Operand::new(losses, DType::F32)),
    ];
    let desc = &CROSS_ENTROPY_FORWARD_BACKWARD;
    dev.launch(stream, desc, &ops, bytemuck::bytes_of(&p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_matches_f64_and_its_gradient_sums_to_zero() {
        for v in [1usize, 2, 255, 256, 257, 1000] {
            let x: Vec<f32> = (0..v).map(|j| ((j * 29 % 17) as f32 - 8.0) * 0.6).collect();
            let mut buf = vec![0f32; whole_blocks(v)];
            let (m, sum) = row_stats(&x, &mut buf);
            let t = v / 3;
            let loss = math::ln(sum) - (x[t] - m);
            let m64 = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            let s64: f64 = x.iter().map(|&b| (b as f64 - m64).exp()).sum();
            let want = s64.ln() + m64 - x[t] as f64;
            assert!(
                (loss as f64 - want).abs() <= 2e-6 * (1.0 + want.abs()),
                "{v}"
            );
            let mut g = vec![f32::NAN; v + 5];
            write_grad(&mut g, &buf[..v], t, 1.0 / sum, 1.0);
            let total: f64 = g.iter().map(|&v| v as f64).sum();
            assert!(total.abs() < 1e-5, "{v}: {total}");
            assert!(g[v..].iter().all(|&v| v.to_bits() == 0));
        }
    }

    #[test]
    fn targets_are_checked_on_the_host() {
        assert!(check_targets(&[0, 4, -100], 5, -100).is_ok());
        assert!(check_targets(&[0, 5], 5, -100).is_err());
        assert!(check_targets(&[-1], 5, -100).is_err());
        assert!(check_targets(&[7], 5, 7).is_ok());
    }
}
