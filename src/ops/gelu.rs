use crate::device::kernel::param_layout;
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::float::{simd, with_float, Float};
use crate::ops::math;
use crate::ops::rows::{elementwise_plan, expect_elementwise};

abi! {
    /// The parameters of `kernels/gelu.cu` (`gelu.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct GeluParams {
        /// Elements.
        pub n: u64,
    }
}

const K0: f32 = 0.797_884_6; // √(2/π), rounded to f32 as the kernel's literal
const K1: f32 = 0.044715;

const FLOATS: &[DType] = &DType::FLOATS;

abi! {
    /// GELU forward: `x` read, `y` written, one element type.
    static GELU_FORWARD: KernelDesc = KernelDesc {
        name: "gelu_forward",
        operands: &[
            OperandSpec::read("x", FLOATS),
            OperandSpec::write("y", FLOATS),
        ],
        params: param_layout!(GeluParams, "gelu.cuh", [n]),
        check: Some(check),
        twin: forward_twin,
        cuda: CudaSide::Nvrtc {
            source: "gelu.cu",
            plan: |info| elementwise_plan(info, "gelu_forward"),
        },
    };
}

abi! {
    /// GELU backward: `x` and `dy` read, `dx` written, one element type.
    static GELU_BACKWARD: KernelDesc = KernelDesc {
        name: "gelu_backward",
        operands: &[
            OperandSpec::read("x", FLOATS),
            OperandSpec::read("dy", FLOATS),
            OperandSpec::write("dx", FLOATS),
        ],
        params: param_layout!(GeluParams, "gelu.cuh", [n]),
        check: Some(check),
        twin: backward_twin,
        cuda: CudaSide::Nvrtc {
            source: "gelu.cu",
            plan: |info| elementwise_plan(info, "gelu_backward"),
        },
    };
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: GeluParams = info.params()?;
    expect_elementwise(info, p.n)
}

#[inline(always)]
fn tanh_arg(x: f32) -> f32 {
    K0 * (x + K1 * (x * x * x))
}

/// GELU of one value, in the kernel's order of operations.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    let t = math::tanh(tanh_arg(x));
    (0.5 * x) * (1.0 + t)
}

/// The gradient `dy · GELU'(x)`, in the kernel's order of operations.
#[inline(always)]
pub fn gelu_grad(x: f32, dy: f32) -> f32 {
    let t = math::tanh(tanh_arg(x));
    let du = K0 * (1.0 + (3.0 * K1) * (x * x));
    let sech2 = 1.0 - t * t;
    let left = 0.5 * (1.0 + t);
    let right = ((0.5 * x) * sech2) * du;
    dy * (left + right)
}

fn forward_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let x = a.read_as::<T>(0)?;
    let y = a.take_as::<T>(1)?;
    simd(
        #[inline(always)]
        || {
            for (y, &x) in y.iter_mut().zip(x) {
                *y = T::put(gelu(x.get()));
            }
        },
    );
    Ok(())
}

fn backward_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let (x, dy) = (a.read_as::<T>(0)?, a.read_as::<T>(1)?);
    let dx = a.take_as::<T>(2)?;
    simd(
        #[inline(always)]
        || {
            for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
                *dx = T::put(gelu_grad(x.get(), dy.get()));
            }
        },
    );
    Ok(())
}

fn forward_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    with_float!(a.dtype(0).unwrap_or(DType::F32), T => forward_typed::<T>(a))
}

fn backward_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    with_float!(a.dtype(0).unwrap_or(DType::F32), T => backward_typed::<T>(a))
}

fn params(x: &Input<'_>, dtype: DType) -> GeluParams {
    GeluParams {
        n: (x.len() / dtype.size()) as u64,
    }
}

/// GELU with the tanh approximation, as GPT-2 uses it:
/// `y = x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))`, forward ([`gelu_forward`]) and backward
/// ([`gelu_backward`]), on f32, f16 or bf16 storage with f32 math. CUDA runs `kernels/gelu.cu`;
/// the CPU twin computes in the same order with the same single roundings, and both take tanh
/// from [`math::tanh`] (`tm_tanh` in `kernels/math.cuh`), not from a libm, so the two agree bit
/// for bit on every backend.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// let x = dev.upload(&s, bytemuck::cast_slice(&[-1.0f32, 0.0, 2.0]))?;
/// let y = dev.alloc(12)?;
/// tidemem::ops::gelu_forward(&dev, &s, &x, &y, DType::F32)?;
/// let y: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &y)?);
/// assert!((y[2] - 1.9546).abs() < 1e-4 && y[1] == 0.0);
/// # Ok(()) }
/// ```
///
/// `y = GELU(x)` elementwise on `stream`; `x` and `y` hold the same number of `dtype` elements
/// and do not overlap.
pub fn gelu_forward<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    x: impl Into<Input<'a>>,
    y: impl Into<DeviceView<'b>>,
    dtype: DType,
) -> Result<()> {
    let (x, y) = (x.into(), y.into());
    let p = params(&x, dtype);
    let ops = [Some(Operand::input(x, dtype)), Some(Operand::new(y, dtype))];
    dev.launch(stream, &GELU_FORWARD, &ops, bytemuck::bytes_of(&p))
}

/// `dx = dy · GELU'(x)` elementwise on `stream`; all three hold the same number of `dtype`
/// elements, and `dx` overlaps neither input.
pub fn gelu_backward<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    x: impl Into<Input<'a>>,
    dy: impl Into<Input<'b>>,
    dx: impl Into<DeviceView<'c>>,
    dtype: DType,
) -> Result<()> {
    let (x, dy, dx) = (x.into(), dy.into(), dx.into());
    let p = params(&x, dtype);
    let ops = [
        Some(Operand::input(x, dtype)),
        Some(Operand::input(dy, dtype)),
        Some(Operand::new(dx, dtype)),
    ];
    dev.launch(stream, &GELU_BACKWARD, &ops, bytemuck::bytes_of(&p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gelu64(x: f64) -> f64 {
        let k0 = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (k0 * (x + 0.044715 * x * x * x)).tanh())
    }

    #[test]
    fn forward_matches_f64_reference() {
        for i in -400..=400 {
            let x = i as f32 * 0.025;
            let (got, want) = (gelu(x) as f64, gelu64(x as f64));
            assert!(
                (got - want).abs() <= 2e-7 + 2e-6 * want.abs(),
                "{x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        for i in -300..=300 {
            let x = i as f64 * 0.02 + 0.001;
            let h = 1e-5;
            let fd = (gelu64(x + h) - gelu64(x - h)) / (2.0 * h);
            let got = gelu_grad(x as f32, 1.0) as f64;
            assert!(
                (got - fd).abs() <= 1e-5 + 1e-5 * fd.abs(),
                "{x}: {got} vs {fd}"
            );
            assert_eq!(gelu_grad(x as f32, 2.0), 2.0 * gelu_grad(x as f32, 1.0));
        }
    }
}
