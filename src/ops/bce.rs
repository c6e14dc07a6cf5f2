use crate::device::kernel::{grid_stride, param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::float::{simd, with_float, Float};
use crate::ops::math;

abi! {
    /// The parameters of `kernels/bce.cu` (`bce.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct BceParams {
        /// Elements.
        pub n: u64,
        /// The gradient's factor: `dlogits = (σ(x) − y)·scale`.
        pub scale: f32,
        /// Zero.
        pub pad: u32,
    }
}

abi! {
    /// The fused sigmoid + binary cross-entropy: `logits` (a model float) and `labels` (f32) read;
    /// `loss` (f32) written, `dlogits` (the logits' type) and `probs` (f32) written when present.
    static BCE_WITH_LOGITS: KernelDesc = KernelDesc {
        name: "bce_with_logits",
        operands: &[
            OperandSpec::read("logits", &DType::FLOATS),
            OperandSpec::read("labels", &[DType::F32]),
            OperandSpec::write("loss", &[DType::F32]),
            OperandSpec::write("dlogits", &DType::FLOATS).optional(),
            OperandSpec::write("probs", &[DType::F32]).optional(),
        ],
        params: param_layout!(BceParams, "bce.cuh", [n, scale, pad]),
        check: Some(check),
        twin,
        cuda: CudaSide::Nvrtc {
            source: "bce.cu",
            plan,
        },
    };
}

/// The check of a launch or a twin run: every present operand holds `n` elements, `dlogits`
/// has the logits' type, `scale` is finite.
fn check_operands(
    desc: &'static KernelDesc,
    p: &BceParams,
    operand: impl Fn(usize) -> Option<(DType, usize)>,
) -> Result<()> {
    if !p.scale.is_finite() {
        return Err(desc.error(format!("the gradient scale {} is not finite", p.scale)));
    }
    let logits = operand(0).map(|o| o.0);
    for (i, spec) in desc.operands.iter().enumerate() {
        let Some((d, len)) = operand(i) else { continue };
        if len as u64 != p.n {
            return Err(desc.error(format!(
                "operand `{}` holds {len} {d} elements: shape [{len}], every operand is [n] = \
                 [{}]",
                spec.name, p.n
            )));
        }
        if spec.name == "dlogits" && Some(d) != logits {
            return Err(desc.error(format!(
                "operand `dlogits` is {d}, the logits are {}: the gradient has the logits' type",
                logits.map_or("?", |d| d.name())
            )));
        }
    }
    Ok(())
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: BceParams = info.params()?;
    check_operands(info.desc, &p, |i| info.dtype(i).map(|d| (d, info.len(i))))
}

fn plan(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let t = info.dtype(0).map_or("?", |d| d.name());
    Ok(grid_stride(format!("bce_with_logits_{t}"), info.len(0)))
}

/// The loss and `σ(x)` of one logit `x` and label `y`, in the kernel's order of operations.
#[inline(always)]
pub fn bce(x: f32, y: f32) -> (f32, f32) {
    let u = math::exp(-x.abs());
    let v = 1.0 + u;
    let r = 1.0 / v;
    let sigma = if x >= 0.0 { r } else { u * r };
    // ln(1 + u) = ln(v) + (u − (v − 1))/v: the second term puts back what rounding 1 + u lost
    // (`v − 1` and `u − (v − 1)` are exact), so small `u` keep their relative accuracy.
    let ln_1p = math::ln(v) + (u - (v - 1.0)) * r;
    let relu = if x > 0.0 { x } else { 0.0 };
    ((relu - x * y) + ln_1p, sigma)
}

/// The gradient of the loss with respect to the logit, times `scale`.
#[inline(always)]
pub fn bce_grad(sigma: f32, y: f32, scale: f32) -> f32 {
    (sigma - y) * scale
}

/// The twin's loop, with the optional outputs decided once.
#[inline(always)]
fn run<T: Float>(
    x: &[T],
    y: &[f32],
    loss: &mut [f32],
    dl: Option<&mut [T]>,
    pr: Option<&mut [f32]>,
    scale: f32,
) {
    let n = loss.len();
    let (x, y) = (&x[..n], &y[..n]);
    match (dl, pr) {
        (Some(dl), Some(pr)) => {
            let (dl, pr) = (&mut dl[..n], &mut pr[..n]);
            for i in 0..n {
                let (l, s) = bce(x[i].get(), y[i]);
                loss[i] = l;
                dl[i] = T::put(bce_grad(s, y[i], scale));
                pr[i] = s;
            }
        }
        (Some(dl), None) => {
            let dl = &mut dl[..n];
            for i in 0..n {
                let (l, s) = bce(x[i].get(), y[i]);
                loss[i] = l;
                dl[i] = T::put(bce_grad(s, y[i], scale));
            }
        }
        (None, Some(pr)) => {
            let pr = &mut pr[..n];
            for i in 0..n {
                let (l, s) = bce(x[i].get(), y[i]);
                loss[i] = l;
                pr[i] = s;
            }
        }
        (None, None) => {
            for i in 0..n {
                loss[i] = bce(x[i].get(), y[i]).0;
            }
        }
    }
}

fn typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: BceParams = a.params()?;
    let (x, y) = (a.read_as::<T>(0)?, a.read_as::<f32>(1)?);
    let loss = a.take_as::<f32>(2)?;
    let dl = if a.present(3) {
        Some(a.take_as::<T>(3)?)
    } else {
        None
    };
    let pr = if a.present(4) {
        Some(a.take_as::<f32>(4)?)
    } else {
        None
    };
    let lens = [
        Some(x.len()),
        Some(y.len()),
        Some(loss.len()),
        dl.as_ref().map(|v| v.len()),
        pr.as_ref().map(|v| v.len()),
    ];
    check_operands(a.desc(), &p, |i| a.dtype(i).zip(lens[i]))?;
    simd(
        #[inline(always)]
        || run(x, y, loss, dl, pr, p.scale),
    );
    Ok(())
}

fn twin(a: &mut TwinArgs<'_>) -> Result<()> {
    with_float!(a.dtype(0).unwrap_or(DType::F32), T => typed::<T>(a))
}

/// What [`bce_with_logits`] writes: the loss always, the gradient and the probabilities when
/// given. Each holds one value per logit.
#[derive(Clone, Copy, Debug)]
pub struct BceOutputs<'a> {
    /// The loss per element, f32.
    pub loss: DeviceView<'a>,
    /// `(σ(x) − y)·scale`, of the logits' type.
    pub dlogits: Option<DeviceView<'a>>,
    /// `σ(x)`, f32.
    pub probs: Option<DeviceView<'a>>,
}

/// Sigmoid and binary cross-entropy on logits, fused forward and backward
/// ([`bce_with_logits`]): per element, from a logit `x` (f32, f16 or bf16) and a label `y` (f32,
/// 0/1 or soft), the loss (f32)
/// `max(x, 0) − x·y + ln(1 + e^{−|x|})` — the numerically stable form, finite for every finite
/// `x` — and optionally the gradient `dlogits = (σ(x) − y)·scale` (the logits' type; `scale` is
/// the loss's weight, `1/N` for a mean over N) and the probability `σ(x)` (f32, for AUC and
/// accuracy). The gradient goes to an output of its own, never over the logits: the logits stay
/// readable (metrics, a second loss), and at one logit a sample the saving would be small.
///
/// With `u = e^{−|x|}` and `v = 1 + u` (rounded), `ln(1 + u)` is computed as
/// `ln(v) + (u − (v − 1))·(1/v)`, which puts back what rounding `1 + u` lost and so keeps its
/// relative accuracy for small `u`; `σ(x)` is `1/v` for `x ≥ 0` and `u·(1/v)` below (one
/// division for both). Only [`math::exp`] and [`math::ln`], the division and
/// single rounded operations: the CUDA kernel (`kernels/bce.cu`) and the CPU twin agree bit for
/// bit. Labels are taken as given (no check that they lie in [0, 1]).
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::ops::{bce_with_logits, BceOutputs};
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// let logits = dev.upload(&s, bytemuck::cast_slice(&[0.0f32, 2.0]))?;
/// let labels = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 0.0]))?;
/// let (loss, dlogits) = (dev.alloc(8)?, dev.alloc(8)?);
/// let out = BceOutputs { loss: (&loss).into(), dlogits: Some((&dlogits).into()), probs: None };
/// bce_with_logits(&dev, &s, &logits, &labels, DType::F32, 0.5, out)?;
/// let loss: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &loss)?);
/// let grad: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &dlogits)?);
/// assert!((loss[0] - std::f32::consts::LN_2).abs() < 1e-6);
/// assert!((grad[0] + 0.25).abs() < 1e-6); // (σ(0) − 1)·0.5
/// # Ok(()) }
/// ```
///
/// Sigmoid + binary cross-entropy on `stream` (see [`bce_with_logits`]): for `n` logits of
/// `dtype` and `n` f32 labels, writes the loss, and the gradient scaled by `scale` and the
/// probabilities where `out` asks for them. No output may overlap another operand; a wrong
/// length or type, or a `scale` that is not finite, is an error, and nothing is written.
pub fn bce_with_logits<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    logits: impl Into<Input<'a>>,
    labels: impl Into<Input<'b>>,
    dtype: DType,
    scale: f32,
    out: BceOutputs<'_>,
) -> Result<()> {
    let logits = logits.into();
    let p = BceParams {
        n: (logits.len() / dtype.size()) as u64,
        scale,
        pad: 0,
    };
    let ops = [
        Some(Operand::input(logits, dtype)),
        Some(Operand::input(labels, DType::F32)),
        Some(Operand::new(out.loss, DType::F32)),
        out.dlogits.map(|v| Operand::new(v, dtype)),
        out.probs.map(|v| Operand::new(v, DType::F32)),
    ];
    dev.launch(stream, &BCE_WITH_LOGITS, &ops, bytemuck::bytes_of(&p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loss64(x: f64, y: f64) -> f64 {
        x.max(0.0) - x * y + (-x.abs()).exp().ln_1p()
    }

    fn sigmoid64(x: f64) -> f64 {
        1.0 / (1.0 + (-x).exp())
    }

    #[test]
    fn loss_and_sigmoid_match_f64() {
        let (mut worst_l, mut worst_s) = (0.0f64, 0.0f64);
        for i in -6000..=6000 {
            let x = i as f32 * 0.01;
            for y in [0.0f32, 1.0, 0.3] {
                let (l, s) = bce(x, y);
                let (wl, ws) = (loss64(x as f64, y as f64), sigmoid64(x as f64));
                worst_l = worst_l.max((l as f64 - wl).abs() / (wl.abs() + 1e-30));
                worst_s = worst_s.max((s as f64 - ws).abs() / ws);
            }
        }
        // Relative: a few ulp of f32 where the loss is not the difference of two large terms
        // (with soft labels and |x| large it is, and the error is absolute there, ~ulp of |x|).
        assert!(worst_s <= 4e-7, "sigmoid: {worst_s:e}");
        let mut worst_hard = 0.0f64;
        for i in -6000..=6000 {
            let x = i as f32 * 0.01;
            for y in [0.0f32, 1.0] {
                let wl = loss64(x as f64, y as f64);
                worst_hard = worst_hard.max((bce(x, y).0 as f64 - wl).abs() / wl);
            }
        }
        assert!(worst_hard <= 4e-7, "loss: {worst_hard:e}");
        assert!(worst_l.is_finite());
    }

    #[test]
    fn small_losses_keep_their_relative_accuracy() {
        // x = 30, y = 1: the loss is e^-30 ≈ 9.4e-14, far below f32's epsilon at 1.
        for x in [10.0f32, 20.0, 30.0, 80.0] {
            let want = loss64(x as f64, 1.0);
            let got = bce(x, 1.0).0 as f64;
            assert!(
                (got - want).abs() <= 4e-7 * want,
                "{x}: {got:e} vs {want:e}"
            );
            let got = bce(-x, 0.0).0 as f64;
            assert!(
                (got - want).abs() <= 4e-7 * want,
                "{x}: {got:e} vs {want:e}"
            );
        }
        assert_eq!(bce(100.0, 1.0).0, 0.0);
        assert_eq!(bce(0.0, 1.0).0, std::f32::consts::LN_2);
        assert_eq!(bce(0.0, 0.5).1, 0.5);
        assert!(bce(f32::NAN, 1.0).0.is_nan() && bce(f32::NAN, 1.0).1.is_nan());
        assert_eq!(bce(f32::INFINITY, 0.0).1, 1.0);
        assert_eq!(bce(f32::NEG_INFINITY, 1.0).1, 0.0);
    }

    #[test]
    fn gradient_matches_finite_differences() {
        for i in -200..=200 {
            let x = i as f64 * 0.05 + 0.003;
            for y in [0.0, 1.0, 0.7] {
                let h = 1e-5;
                let fd = (loss64(x + h, y) - loss64(x - h, y)) / (2.0 * h);
                let (_, s) = bce(x as f32, y as f32);
                let g = bce_grad(s, y as f32, 1.0) as f64;
                assert!(
                    (g - fd).abs() <= 1e-6 + 1e-6 * fd.abs(),
                    "{x} {y}: {g} vs {fd}"
                );
                assert_eq!(bce_grad(s, y as f32, 0.25), (s - y as f32) * 0.25);
            }
        }
    }

    #[test]
    fn a_twin_run_directly_checks_its_lengths() {
        use crate::device::HostOperand;
        let (x, y) = ([0.5f32; 4], [1.0f32; 3]);
        let mut loss = [7.0f32; 4];
        let p = BceParams {
            n: 4,
            scale: 1.0,
            pad: 0,
        };
        let ops = vec![
            HostOperand::Read(bytemuck::cast_slice(&x), DType::F32),
            HostOperand::Read(bytemuck::cast_slice(&y), DType::F32),
            HostOperand::Write(bytemuck::cast_slice_mut(&mut loss), DType::F32),
            HostOperand::Absent,
            HostOperand::Absent,
        ];
        let mut args = TwinArgs::new(&BCE_WITH_LOGITS, ops, bytemuck::bytes_of(&p)).unwrap();
        let err = (BCE_WITH_LOGITS.twin)(&mut args).unwrap_err();
        assert!(err.to_string().contains("`labels`"), "{err}");
        assert_eq!(loss, [7.0; 4]);
    }
}
