use crate::device::kernel::param_layout;
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::float::{simd, with_float, Float};
use crate::ops::rows::{elementwise_plan, expect_elementwise, Operands};

abi! {
    /// The parameters of `kernels/relu.cu` (`relu.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct ReluParams {
        /// Elements.
        pub n: u64,
    }
}

const FLOATS: &[DType] = &DType::FLOATS;

abi! {
    /// ReLU forward: `x` read, `y` written, one element type.
    static RELU_FORWARD: KernelDesc = KernelDesc {
        name: "relu_forward",
        operands: &[
            OperandSpec::read("x", FLOATS),
            OperandSpec::write("y", FLOATS),
        ],
        params: param_layout!(ReluParams, "relu.cuh", [n]),
        check: Some(check),
        twin: forward_twin,
        cuda: CudaSide::Nvrtc {
            source: "relu.cu",
            plan: |info| elementwise_plan(info, "relu_forward"),
        },
    };
}

abi! {
    /// ReLU backward: `x` and `dy` read, `dx` written, one element type.
    static RELU_BACKWARD: KernelDesc = KernelDesc {
        name: "relu_backward",
        operands: &[
            OperandSpec::read("x", FLOATS),
            OperandSpec::read("dy", FLOATS),
            OperandSpec::write("dx", FLOATS),
        ],
        params: param_layout!(ReluParams, "relu.cuh", [n]),
        check: Some(check),
        twin: backward_twin,
        cuda: CudaSide::Nvrtc {
            source: "relu.cu",
            plan: |info| elementwise_plan(info, "relu_backward"),
        },
    };
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: ReluParams = info.params()?;
    expect_elementwise(info, p.n)
}

fn forward_typed<T: Float>(mut o: Operands<'_>) -> Result<()> {
    let x = o.read::<T>(0)?;
    let y = o.write::<T>(1)?;
    simd(
        #[inline(always)]
        || {
            for (y, &x) in y.iter_mut().zip(x) {
                *y = if x.positive() { x } else { T::ZERO };
            }
        },
    );
    Ok(())
}

fn backward_typed<T: Float>(mut o: Operands<'_>) -> Result<()> {
    let (x, dy) = (o.read::<T>(0)?, o.read::<T>(1)?);
    let dx = o.write::<T>(2)?;
    simd(
        #[inline(always)]
        || {
            for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
                *dx = if x.positive() { dy } else { T::ZERO };
            }
        },
    );
    Ok(())
}

fn forward_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: ReluParams = a.params()?;
    let o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    with_float!(o.dtype(0).unwrap_or(DType::F32), T => forward_typed::<T>(o))
}

fn backward_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: ReluParams = a.params()?;
    let o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    with_float!(o.dtype(0).unwrap_or(DType::F32), T => backward_typed::<T>(o))
}

fn params(x: &Input<'_>, dtype: DType) -> ReluParams {
    ReluParams {
        n: (x.len() / dtype.size()) as u64,
    }
}

/// ReLU, forward ([`relu_forward`]: `y = x` where `x > 0`, else 0) and backward
/// ([`relu_backward`]: `dx = dy` where `x > 0`, else 0), on f32, f16 or bf16 storage. Values are
/// kept or replaced by +0, never rounded, so CUDA (`kernels/relu.cu`) and the CPU twin agree
/// bit for bit; NaN and −0 give +0. The backward may be given the forward's output for `x`:
/// it is positive exactly where the input is.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// let x = dev.upload(&s, bytemuck::cast_slice(&[-1.0f32, 0.0, 2.0]))?;
/// let y = dev.alloc(12)?;
/// tidemem::ops::relu_forward(&dev, &s, &x, &y, DType::F32)?;
/// let y: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &y)?);
/// assert_eq!(y, [0.0, 0.0, 2.0]);
/// # Ok(()) }
/// ```
///
/// `y = max(x, 0)` elementwise on `stream` (see [`relu_forward`]); `x` and `y` hold the same
/// number of `dtype` elements and do not overlap.
pub fn relu_forward<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    x: impl Into<Input<'a>>,
    y: impl Into<DeviceView<'b>>,
    dtype: DType,
) -> Result<()> {
    let (x, y) = (x.into(), y.into());
    let p = params(&x, dtype);
    let ops = [Some(Operand::input(x, dtype)), Some(Operand::new(y, dtype))];
    dev.launch(stream, &RELU_FORWARD, &ops, bytemuck::bytes_of(&p))
}

/// `dx = dy` where `x > 0`, else 0, elementwise on `stream`; all three hold the same number of
/// `dtype` elements, and `dx` overlaps neither input.
pub fn relu_backward<'a, 'b, 'c>(
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
    dev.launch(stream, &RELU_BACKWARD, &ops, bytemuck::bytes_of(&p))
}
