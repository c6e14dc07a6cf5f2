//! The Adam step on 8-bit moments as a device op ([`adam8`]): its descriptors, and the CPU step
//! ([`CpuAdam::step8`]) as the simulated device's twin. CUDA runs `kernels/adam8.cu`, which
//! performs the same operations in the same order, so the codes, scales and parameters are the
//! same bits on every backend.

use super::cpu::{Grad, GradInPlace, ParamCopy};
use super::cpu8::Moments8;
use super::quant8::{check_quant8, QUANT8_BLOCK};
use super::{copy_place, AdamParams, AdamScalars, CpuAdam, LAYOUT};
use crate::device::kernel::Grid;
use crate::device::{
    CudaSide, Device, DeviceView, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream, TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};

const F32: &[DType] = &[DType::F32];
const U8: &[DType] = &[DType::U8];
const LOW: &[DType] = &[DType::F16, DType::BF16];

abi! {
    /// An Adam step on 8-bit moments: fp32 `p`, the moments' codes and block scales read and
    /// written, the gradient read, and an optional fp16 or bf16 copy of the new parameters.
    static ADAM8: KernelDesc = KernelDesc {
        name: "adam8",
        operands: &[
            OperandSpec::read_write("params", F32),
            OperandSpec::read_write("momentum codes", U8),
            OperandSpec::read_write("variance codes", U8),
            OperandSpec::read_write("momentum scales", F32),
            OperandSpec::read_write("variance scales", F32),
            OperandSpec::read("gradient", &DType::FLOATS),
            OperandSpec::write("parameter copy", LOW).optional(),
        ],
        params: LAYOUT,
        check: Some(check),
        twin,
        cuda: CudaSide::Nvrtc {
            source: "adam8.cu",
            plan,
        },
    };
}

abi! {
    /// [`ADAM8`] with the fp16 or bf16 copy of the new parameters written over the gradient.
    static ADAM8_IN_PLACE: KernelDesc = KernelDesc {
        name: "adam8_in_place",
        operands: &[
            OperandSpec::read_write("params", F32),
            OperandSpec::read_write("momentum codes", U8),
            OperandSpec::read_write("variance codes", U8),
            OperandSpec::read_write("momentum scales", F32),
            OperandSpec::read_write("variance scales", F32),
            OperandSpec::read_write("gradient", LOW),
        ],
        params: LAYOUT,
        check: Some(check),
        twin,
        cuda: CudaSide::Nvrtc {
            source: "adam8.cu",
            plan: plan_in_place,
        },
    };
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: AdamParams = info.params()?;
    let n = p.n as usize;
    let blocks = n.div_ceil(QUANT8_BLOCK);
    for (i, spec) in info.desc.operands.iter().enumerate() {
        let want = if i == 3 || i == 4 { blocks } else { n };
        if info.present(i) && info.len(i) != want {
            return Err(Error::Length {
                what: format!(
                    "elements of the 8-bit Adam's {} for {n} parameters",
                    spec.name
                ),
                got: info.len(i),
                expected: want,
            });
        }
    }
    Ok(())
}

fn grad_name(info: &LaunchInfo<'_>) -> &'static str {
    info.dtype(5).map_or("?", |d| d.name())
}

/// One thread block a block of values, as many as CUDA allows, strided beyond.
fn grid(entry: String, n: usize) -> Vec<Grid> {
    if n == 0 {
        return vec![];
    }
    let blocks = n.div_ceil(QUANT8_BLOCK).min(1 << 20) as u32;
    vec![Grid::linear(entry, blocks, QUANT8_BLOCK as u32)]
}

fn plan(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let copy = info.dtype(6).map_or("none", |d| d.name());
    let p: AdamParams = info.params()?;
    Ok(grid(
        format!("adam8_g{}_c{copy}", grad_name(info)),
        p.n as usize,
    ))
}

fn plan_in_place(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let p: AdamParams = info.params()?;
    Ok(grid(
        format!("adam8_g{}_inplace", grad_name(info)),
        p.n as usize,
    ))
}

fn twin(args: &mut TwinArgs<'_>) -> Result<()> {
    let p: AdamParams = args.params()?;
    let n = p.n as usize;
    let params = args.take_as::<f32>(0)?;
    let moments = Moments8 {
        momentum: args.take(1)?,
        variance: args.take(2)?,
        momentum_scales: args.take_as::<f32>(3)?,
        variance_scales: args.take_as::<f32>(4)?,
    };
    let cpu = CpuAdam::new();
    let lengths = || args.desc().error("operand lengths differ from n");
    if params.len() != n {
        return Err(lengths());
    }
    if std::ptr::eq(args.desc(), &ADAM8_IN_PLACE) {
        let g = match args.dtype(5) {
            Some(DType::F16) => GradInPlace::F16(args.take_as(5)?),
            Some(DType::BF16) => GradInPlace::Bf16(args.take_as(5)?),
            _ => return Err(args.desc().error("the gradient is not F16 or BF16")),
        };
        return cpu.step8_in_place(&p.s, params, moments, g);
    }
    let g = match args.dtype(5) {
        Some(DType::F32) => Grad::F32(args.read_as(5)?),
        Some(DType::F16) => Grad::F16(args.read_as(5)?),
        Some(DType::BF16) => Grad::Bf16(args.read_as(5)?),
        _ => return Err(args.desc().error("the gradient is not a model float")),
    };
    let copy = match (args.present(6), args.dtype(6)) {
        (false, _) => ParamCopy::None,
        (true, Some(DType::F16)) => ParamCopy::F16(args.take_as(6)?),
        (true, Some(DType::BF16)) => ParamCopy::Bf16(args.take_as(6)?),
        _ => return Err(args.desc().error("the copy is not F16 or BF16")),
    };
    cpu.step8(&p.s, params, moments, g, copy)
}

/// The operands of [`adam8`].
#[derive(Debug)]
pub struct Adam8Operands<'a> {
    /// fp32 parameters (`n` elements).
    pub params: DeviceView<'a>,
    /// The momentum's codes (`n` bytes, [`Quant8Map::Signed`](super::Quant8Map::Signed)).
    pub momentum: DeviceView<'a>,
    /// The variance's codes (`n` bytes, [`Quant8Map::Unsigned`](super::Quant8Map::Unsigned)).
    pub variance: DeviceView<'a>,
    /// The momentum's block scales (`ceil(n / QUANT8_BLOCK)` f32).
    pub momentum_scales: DeviceView<'a>,
    /// The variance's block scales.
    pub variance_scales: DeviceView<'a>,
    /// The gradient.
    pub grad: DeviceView<'a>,
    /// The gradient's element type.
    pub grad_dtype: DType,
    /// The F16/BF16 copy of the new parameters: the gradient's own range (the gradient is
    /// replaced), a range that overlaps no operand, or `None`.
    pub copy: Option<(DeviceView<'a>, DType)>,
}

/// One Adam step on 8-bit moments on `stream` ([`CpuAdam::step8`]'s arithmetic: the same bits on
/// the simulated device, which runs it, and on CUDA).
pub fn adam8(dev: &Device, stream: &Stream, s: &AdamScalars, ops: Adam8Operands<'_>) -> Result<()> {
    let n = ops.params.len() / 4;
    check_quant8(n, ops.momentum.len(), ops.momentum_scales.len() / 4)?;
    check_quant8(n, ops.variance.len(), ops.variance_scales.len() / 4)?;
    let params = AdamParams::new(n, s);
    let bytes = bytemuck::bytes_of(&params);
    let state = [
        Some(Operand::new(ops.params, DType::F32)),
        Some(Operand::new(ops.momentum, DType::U8)),
        Some(Operand::new(ops.variance, DType::U8)),
        Some(Operand::new(ops.momentum_scales, DType::F32)),
        Some(Operand::new(ops.variance_scales, DType::F32)),
    ];
    let grad = Operand::new(ops.grad, ops.grad_dtype);
    let [a, b, c, d, e] = state;
    match copy_place("an 8-bit Adam step", ops.copy, &ops.grad, ops.grad_dtype)? {
        None => dev.launch(stream, &ADAM8_IN_PLACE, &[a, b, c, d, e, Some(grad)], bytes),
        Some(copy) => dev.launch(stream, &ADAM8, &[a, b, c, d, e, Some(grad), copy], bytes),
    }
}
