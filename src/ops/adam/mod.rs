mod cpu;
mod cpu8;
mod device8;
mod quant8;

pub use cpu::{CpuAdam, Grad, GradInPlace, Isa, ParamCopy};
pub(crate) use cpu::{RawKind, RawStep};
pub use cpu8::Moments8;
pub use device8::{adam8, Adam8Operands};
#[cfg(feature = "kernel-abi")]
pub use device8::{ADAM8, ADAM8_IN_PLACE};
#[cfg(not(feature = "kernel-abi"))]
pub(crate) use device8::{ADAM8, ADAM8_IN_PLACE};
pub(crate) use quant8::{dequantize8, quantize8};
pub use quant8::{Quant8Map, QUANT8_BLOCK};

use serde::Serialize;

use crate::device::kernel::{grid_stride, param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream, TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Everything one step needs per element, computed once per step (see
/// `tidemem::optim::AdamConfig::scalars`); the fields of the kernel's `AdamParams` after the count.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Serialize, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AdamScalars {
    /// Multiplies every gradient (1 / loss scale × clipping coefficient ÷ micro-batches).
    pub grad_scale: f32,
    /// L2 weight decay (0 for AdamW).
    pub l2: f32,
    /// β1.
    pub beta1: f32,
    /// 1 − β1.
    pub(crate) one_minus_beta1: f32,
    /// β2.
    pub beta2: f32,
    /// 1 − β2.
    pub(crate) one_minus_beta2: f32,
    /// 1 / √(1 − β2ᵗ).
    pub(crate) inv_sqrt_bc2: f32,
    /// ε.
    pub eps: f32,
    /// lr · wd for AdamW, 0 for Adam (subtracted as `p − decoupled · p`: a factor `1 − lr · wd`
    /// rounded to f32 would bias every step).
    pub decoupled: f32,
    /// lr / (1 − β1ᵗ).
    pub(crate) step_size: f32,
}

abi! {
    /// The parameters of `kernels/adam.cu` (`adam.cuh`): the element count, then the scalars.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct AdamParams {
        /// Elements.
        pub n: u64,
        /// The step's scalars.
        pub s: AdamScalars,
    }
}

impl AdamParams {
    /// The parameters of a step of `n` elements.
    pub fn new(n: usize, s: &AdamScalars) -> Self {
        AdamParams { n: n as u64, s: *s }
    }
}

const F32: &[DType] = &[DType::F32];
const LOW: &[DType] = &[DType::F16, DType::BF16];

const LAYOUT: crate::device::ParamLayout = param_layout!(
    AdamParams,
    "adam.cuh",
    [
        n,
        s.grad_scale,
        s.l2,
        s.beta1,
        s.one_minus_beta1,
        s.beta2,
        s.one_minus_beta2,
        s.inv_sqrt_bc2,
        s.eps,
        s.decoupled,
        s.step_size
    ]
);

abi! {
    /// An Adam step: fp32 `p`, `m`, `v` read and written, the gradient read, and an optional fp16 or
    /// bf16 copy of the new parameters written (overlapping no operand).
    static ADAM: KernelDesc = KernelDesc {
        name: "adam",
        operands: &[
            OperandSpec::read_write("params", F32),
            OperandSpec::read_write("momentum", F32),
            OperandSpec::read_write("variance", F32),
            OperandSpec::read("gradient", &DType::FLOATS),
            OperandSpec::write("parameter copy", LOW).optional(),
        ],
        params: LAYOUT,
        check: Some(check),
        twin,
        cuda: CudaSide::Nvrtc {
            source: "adam.cu",
            plan,
        },
    };
}

abi! {
    /// An Adam step whose fp16 or bf16 copy of the new parameters replaces the gradient (read, then
    /// overwritten element by element): what a chunked mixed-precision step wants.
    static ADAM_IN_PLACE: KernelDesc = KernelDesc {
        name: "adam_in_place",
        operands: &[
            OperandSpec::read_write("params", F32),
            OperandSpec::read_write("momentum", F32),
            OperandSpec::read_write("variance", F32),
            OperandSpec::read_write("gradient", LOW),
        ],
        params: LAYOUT,
        check: Some(check),
        twin,
        cuda: CudaSide::Nvrtc {
            source: "adam.cu",
            plan: plan_in_place,
        },
    };
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: AdamParams = info.params()?;
    for (i, spec) in info.desc.operands.iter().enumerate() {
        if info.present(i) && info.len(i) as u64 != p.n {
            return Err(Error::Length {
                what: format!("elements of Adam's {} for its parameters", spec.name),
                got: info.len(i),
                expected: p.n as usize,
            });
        }
    }
    Ok(())
}

fn grad_name(info: &LaunchInfo<'_>) -> &'static str {
    info.dtype(3).map_or("?", |d| d.name())
}

fn plan(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let copy = info.dtype(4).map_or("none", |d| d.name());
    let entry = format!("adam_g{}_c{copy}", grad_name(info));
    Ok(grid_stride(entry, info.len(0)))
}

fn plan_in_place(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let entry = format!("adam_g{}_inplace", grad_name(info));
    Ok(grid_stride(entry, info.len(0)))
}

fn kind(args: &TwinArgs<'_>, i: usize) -> Result<RawKind> {
    match args.dtype(i) {
        Some(DType::F32) => Ok(RawKind::F32),
        Some(DType::F16) => Ok(RawKind::F16),
        Some(DType::BF16) => Ok(RawKind::Bf16),
        _ => Err(args
            .desc()
            .error(format!("operand {i} is not a model float"))),
    }
}

fn twin(args: &mut TwinArgs<'_>) -> Result<()> {
    let p: AdamParams = args.params()?;
    let n = p.n as usize;
    let gk = kind(args, 3)?;
    let copy_kind = if args.present(4) {
        Some(kind(args, 4)?)
    } else {
        None
    };
    let pp = args.take_as::<f32>(0)?;
    let m = args.take_as::<f32>(1)?;
    let v = args.take_as::<f32>(2)?;
    let (grad, copy): (*const u8, Option<(RawKind, *mut u8)>) =
        if std::ptr::eq(args.desc(), &ADAM_IN_PLACE) {
            let g = args.take(3)?;
            (g.as_ptr(), Some((gk, g.as_mut_ptr())))
        } else {
            let g = args.read(3)?.as_ptr();
            let c = match copy_kind {
                Some(k) => Some((k, args.take(4)?.as_mut_ptr())),
                None => None,
            };
            (g, c)
        };
    if pp.len() != n || m.len() != n || v.len() != n {
        return Err(args.desc().error("operand lengths differ from n"));
    }
    let raw = RawStep {
        n,
        p: pp.as_mut_ptr(),
        m: m.as_mut_ptr(),
        v: v.as_mut_ptr(),
        grad: (gk, grad),
        copy,
    };
    // SAFETY: every pointer covers `n` elements of its type (the shape check and the launch's
    // element alignment), the slices are exclusive to this run (written operands overlap no
    // operand), and the copy is either the gradient itself (the in-place op) or disjoint.
    unsafe { CpuAdam::new().run(&p.s, raw) };
    Ok(())
}

/// The operands of [`adam`].
#[derive(Debug)]
pub struct AdamOperands<'a> {
    /// fp32 parameters.
    pub params: DeviceView<'a>,
    /// fp32 momentum.
    pub momentum: DeviceView<'a>,
    /// fp32 variance.
    pub variance: DeviceView<'a>,
    /// The gradient.
    pub grad: DeviceView<'a>,
    /// The gradient's element type.
    pub grad_dtype: DType,
    /// The low-precision (F16/BF16) copy of the new parameters: the gradient's own range (the
    /// gradient is replaced), a range that overlaps no operand, or `None`.
    pub copy: Option<(DeviceView<'a>, DType)>,
}

/// The Adam step as a device op: its parameter block, descriptors, the typed wrapper [`adam`],
/// and the CPU kernel ([`CpuAdam`]) that is both the host path of `HybridAdam` and the simulated
/// device's twin, so a step gives the same bits wherever it runs there. CUDA runs
/// `kernels/adam.cu`, which performs the same operations in the same order.
///
/// One Adam step on `stream` over the operands (see `tidemem::optim::adam` for the
/// arithmetic). The simulated device runs the CPU kernel, [`CpuAdam`], so both placements of a
/// step give the same bits there.
pub fn adam(dev: &Device, stream: &Stream, s: &AdamScalars, ops: AdamOperands<'_>) -> Result<()> {
    let n = ops.params.len() / 4;
    let params = AdamParams::new(n, s);
    let state = [
        Some(Operand::new(ops.params, DType::F32)),
        Some(Operand::new(ops.momentum, DType::F32)),
        Some(Operand::new(ops.variance, DType::F32)),
    ];
    let grad = Operand::new(ops.grad, ops.grad_dtype);
    let bytes = bytemuck::bytes_of(&params);
    let [a, b, c] = state;
    match copy_place("an Adam step", ops.copy, &ops.grad, ops.grad_dtype)? {
        None => dev.launch(stream, &ADAM_IN_PLACE, &[a, b, c, Some(grad)], bytes),
        Some(copy) => dev.launch(stream, &ADAM, &[a, b, c, Some(grad), copy], bytes),
    }
}

/// Where a step's F16/BF16 `copy` of the new parameters goes: `None` over the gradient (the
/// in-place op: the same range, the same type), else beside it (`Some(None)`: no copy).
pub(crate) fn copy_place<'a>(
    step: &str,
    copy: Option<(DeviceView<'a>, DType)>,
    grad: &DeviceView<'_>,
    grad_dtype: DType,
) -> Result<Option<Option<Operand<'a>>>> {
    match copy {
        Some((_, DType::F32)) => Err(Error::WrongDType {
            what: format!("the parameter copy of {step}"),
            dtype: DType::F32,
            expected: "F16 or BF16",
        }),
        Some((c, dt))
            if std::ptr::eq(c.buffer(), grad.buffer())
                && c.offset() == grad.offset()
                && c.len() == grad.len() =>
        {
            if dt != grad_dtype {
                return Err(Error::WrongDType {
                    what: format!("a copy in place of the gradient of {step}"),
                    dtype: dt,
                    expected: "the gradient's type",
                });
            }
            Ok(None)
        }
        copy => Ok(Some(copy.map(|(v, d)| Operand::new(v, d)))),
    }
}
