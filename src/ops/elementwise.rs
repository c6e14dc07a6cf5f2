use half::{bf16, f16};

use crate::device::kernel::{grid_stride, param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::float::{simd, with_float, Float};
use crate::ops::rows::{expect_elementwise, Operands};

abi! {
    /// The parameters of `add` and `add_in_place` (`AddParams` in `kernels/elementwise.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct AddParams {
        /// Elements.
        pub n: u64,
        /// Scale of `a` (of `z`, in place).
        pub alpha: f32,
        /// Scale of `b`.
        pub beta: f32,
    }
}

abi! {
    /// The parameters of `scale` (`ScaleParams` in `kernels/elementwise.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct ScaleParams {
        /// Elements.
        pub n: u64,
        /// The factor.
        pub alpha: f32,
        /// Zero.
        pub pad: u32,
    }
}

abi! {
    /// The parameters of `fill` (`FillParams` in `kernels/elementwise.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct FillParams {
        /// Elements.
        pub n: u64,
        /// The value's bits in the element type, in the low bytes (the rest zero).
        pub bits: u64,
    }
}

/// Elementwise ops on f32, f16 or bf16 storage with f32 math: [`add`] (`z = α·a + β·b`),
/// [`add_in_place`] (`z = α·z + β·b`, its own descriptor since a written operand may overlap no
/// other), [`scale`] (`x = α·x` in place) and [`fill`] (every element = a value, f64 included).
/// Each product is rounded, then the sum, then the result to storage — the same single
/// roundings in the CPU twin and in CUDA (`kernels/elementwise.cu`), so the two agree bit for
/// bit.
///
/// The global norm of gradients that live outside chunks needs no op here:
/// [`grad_stats`](crate::ops::grad_stats()) sums the squares of any f32/f16/bf16 buffer (in f64)
/// and flags infinite or NaN elements.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::ops::{add, fill, scale, Axpby};
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// let a = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 2.0]))?;
/// let b = dev.alloc(8)?;
/// fill(&dev, &s, &b, 0.5, DType::F32)?;
/// let z = dev.alloc(8)?;
/// add(&dev, &s, Axpby { alpha: 2.0, beta: -1.0 }, &a, &b, &z, DType::F32)?;
/// scale(&dev, &s, 10.0, &z, DType::F32)?;
/// let z: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &z)?);
/// assert_eq!(z, [15.0, 35.0]);
/// # Ok(()) }
/// ```
///
/// The two scales of [`add`] and [`add_in_place`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Axpby {
    /// Scale of the first operand.
    pub alpha: f32,
    /// Scale of the second operand.
    pub beta: f32,
}

const FLOATS: &[DType] = &DType::FLOATS;
const FILLABLE: &[DType] = &[DType::F32, DType::F16, DType::BF16, DType::F64];

abi! {
    /// `z = α·a + β·b`: `a`, `b` read, `z` written, one element type.
    static ADD: KernelDesc = KernelDesc {
        name: "add",
        operands: &[
            OperandSpec::read("a", FLOATS),
            OperandSpec::read("b", FLOATS),
            OperandSpec::write("z", FLOATS),
        ],
        params: param_layout!(AddParams, "elementwise.cuh", [n, alpha, beta]),
        check: Some(check_add),
        twin: add_twin,
        cuda: CudaSide::Nvrtc {
            source: "elementwise.cu",
            plan: |info| plan(info, "add", 2),
        },
    };
}

abi! {
    /// `z = α·z + β·b`: `b` read, `z` read and written, one element type.
    static ADD_IN_PLACE: KernelDesc = KernelDesc {
        name: "add_in_place",
        operands: &[
            OperandSpec::read("b", FLOATS),
            OperandSpec::read_write("z", FLOATS),
        ],
        params: param_layout!(AddParams, "elementwise.cuh", [n, alpha, beta]),
        check: Some(check_add),
        twin: add_in_place_twin,
        cuda: CudaSide::Nvrtc {
            source: "elementwise.cu",
            plan: |info| plan(info, "add_in_place", 1),
        },
    };
}

abi! {
    /// `x = α·x`: `x` read and written.
    static SCALE: KernelDesc = KernelDesc {
        name: "scale",
        operands: &[OperandSpec::read_write("x", FLOATS)],
        params: param_layout!(ScaleParams, "elementwise.cuh", [n, alpha, pad]),
        check: Some(check_scale),
        twin: scale_twin,
        cuda: CudaSide::Nvrtc {
            source: "elementwise.cu",
            plan: |info| plan(info, "scale", 0),
        },
    };
}

abi! {
    /// Every element of `x` (f32, f16, bf16 or f64) set to one bit pattern.
    static FILL: KernelDesc = KernelDesc {
        name: "fill",
        operands: &[OperandSpec::write("x", FILLABLE)],
        params: param_layout!(FillParams, "elementwise.cuh", [n, bits]),
        check: Some(check_fill),
        twin: fill_twin,
        cuda: CudaSide::Nvrtc {
            source: "elementwise.cu",
            plan: plan_fill,
        },
    };
}

fn check_add(info: &LaunchInfo<'_>) -> Result<()> {
    let p: AddParams = info.params()?;
    expect_elementwise(info, p.n)
}

fn check_scale(info: &LaunchInfo<'_>) -> Result<()> {
    let p: ScaleParams = info.params()?;
    expect_elementwise(info, p.n)
}

fn check_fill(info: &LaunchInfo<'_>) -> Result<()> {
    let p: FillParams = info.params()?;
    expect_elementwise(info, p.n)?;
    let size = info.dtype(0).map_or(8, |d| d.size());
    if size < 8 && p.bits >> (8 * size) != 0 {
        return Err(info.desc.error(format!(
            "bits {:#x} do not fit an element of {size} bytes",
            p.bits
        )));
    }
    Ok(())
}

/// One grid-stride launch of `<entry>_<type of operand i>`.
fn plan(info: &LaunchInfo<'_>, entry: &str, i: usize) -> Result<Vec<Grid>> {
    let t = info.dtype(i).map_or("?", |d| d.name());
    Ok(grid_stride(format!("{entry}_{t}"), info.len(i)))
}

fn plan_fill(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let bits = 8 * info.dtype(0).map_or(4, |d| d.size());
    Ok(grid_stride(format!("fill_{bits}"), info.len(0)))
}

/// Elements a twin converts at a time (in stack buffers).
const BLOCK: usize = 512;

/// `out = α·x + β·y` over one block.
#[inline(always)]
fn axpby(out: &mut [f32], alpha: f32, x: &[f32], beta: f32, y: &[f32]) {
    for ((o, &x), &y) in out.iter_mut().zip(x).zip(y) {
        *o = alpha * x + beta * y;
    }
}

fn add_typed<T: Float>(mut o: Operands<'_>, p: &AddParams) -> Result<()> {
    let (a, b) = (o.read::<T>(0)?, o.read::<T>(1)?);
    let z = o.write::<T>(2)?;
    simd(
        #[inline(always)]
        || {
            let (mut ba, mut bb, mut out) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
            for ((z, a), b) in z
                .chunks_mut(BLOCK)
                .zip(a.chunks(BLOCK))
                .zip(b.chunks(BLOCK))
            {
                let out = &mut out[..z.len()];
                axpby(
                    out,
                    p.alpha,
                    T::widen(a, &mut ba),
                    p.beta,
                    T::widen(b, &mut bb),
                );
                T::narrow(out, z);
            }
        },
    );
    Ok(())
}

fn add_in_place_typed<T: Float>(mut o: Operands<'_>, p: &AddParams) -> Result<()> {
    let b = o.read::<T>(0)?;
    let z = o.write::<T>(1)?;
    simd(
        #[inline(always)]
        || {
            let (mut bz, mut bb, mut out) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
            for (z, b) in z.chunks_mut(BLOCK).zip(b.chunks(BLOCK)) {
                let out = &mut out[..z.len()];
                axpby(
                    out,
                    p.alpha,
                    T::widen(z, &mut bz),
                    p.beta,
                    T::widen(b, &mut bb),
                );
                T::narrow(out, z);
            }
        },
    );
    Ok(())
}

fn scale_typed<T: Float>(mut o: Operands<'_>, p: &ScaleParams) -> Result<()> {
    let x = o.write::<T>(0)?;
    simd(
        #[inline(always)]
        || {
            let (mut bx, mut out) = ([0f32; BLOCK], [0f32; BLOCK]);
            for x in x.chunks_mut(BLOCK) {
                let out = &mut out[..x.len()];
                for (o, &v) in out.iter_mut().zip(T::widen(x, &mut bx)) {
                    *o = p.alpha * v;
                }
                T::narrow(out, x);
            }
        },
    );
    Ok(())
}

fn add_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: AddParams = a.params()?;
    let o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    with_float!(o.dtype(0).unwrap_or(DType::F32), T => add_typed::<T>(o, &p))
}

fn add_in_place_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: AddParams = a.params()?;
    let o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    with_float!(o.dtype(0).unwrap_or(DType::F32), T => add_in_place_typed::<T>(o, &p))
}

fn scale_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: ScaleParams = a.params()?;
    let o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    with_float!(o.dtype(0).unwrap_or(DType::F32), T => scale_typed::<T>(o, &p))
}

fn fill_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: FillParams = a.params()?;
    let mut o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    match o.dtype(0).map_or(4, |d| d.size()) {
        2 => o.write::<u16>(0)?.fill(p.bits as u16),
        8 => o.write::<u64>(0)?.fill(p.bits),
        _ => o.write::<u32>(0)?.fill(p.bits as u32),
    }
    Ok(())
}

fn elements(v: &Input<'_>, dtype: DType) -> u64 {
    (v.len() / dtype.size()) as u64
}

/// `z = α·a + β·b` elementwise on `stream`: `a`, `b` and `z` hold the same number of `dtype`
/// elements and `z` overlaps neither input (for `a` += …, see [`add_in_place`]).
pub fn add<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    s: Axpby,
    a: impl Into<Input<'a>>,
    b: impl Into<Input<'b>>,
    z: impl Into<DeviceView<'c>>,
    dtype: DType,
) -> Result<()> {
    let (a, b, z) = (a.into(), b.into(), z.into());
    let p = AddParams {
        n: elements(&a, dtype),
        alpha: s.alpha,
        beta: s.beta,
    };
    let ops = [
        Some(Operand::input(a, dtype)),
        Some(Operand::input(b, dtype)),
        Some(Operand::new(z, dtype)),
    ];
    dev.launch(stream, &ADD, &ops, bytemuck::bytes_of(&p))
}

/// `z = α·z + β·b` elementwise on `stream`: `z` and `b` hold the same number of `dtype`
/// elements and do not overlap.
pub fn add_in_place<'b, 'c>(
    dev: &Device,
    stream: &Stream,
    s: Axpby,
    z: impl Into<DeviceView<'c>>,
    b: impl Into<Input<'b>>,
    dtype: DType,
) -> Result<()> {
    let (z, b) = (z.into(), b.into());
    let p = AddParams {
        n: elements(&b, dtype),
        alpha: s.alpha,
        beta: s.beta,
    };
    let ops = [Some(Operand::input(b, dtype)), Some(Operand::new(z, dtype))];
    dev.launch(stream, &ADD_IN_PLACE, &ops, bytemuck::bytes_of(&p))
}

/// `x = α·x` elementwise on `stream`, `x` holding elements of `dtype`.
pub fn scale<'a>(
    dev: &Device,
    stream: &Stream,
    alpha: f32,
    x: impl Into<DeviceView<'a>>,
    dtype: DType,
) -> Result<()> {
    let x = x.into();
    let p = ScaleParams {
        n: (x.len() / dtype.size()) as u64,
        alpha,
        pad: 0,
    };
    dev.launch(
        stream,
        &SCALE,
        &[Some(Operand::new(x, dtype))],
        bytemuck::bytes_of(&p),
    )
}

/// The bits of `value` rounded once (to nearest even) to `dtype` (f32, f16, bf16 or f64).
pub fn fill_bits(value: f64, dtype: DType) -> Result<u64> {
    Ok(match dtype {
        DType::F64 => value.to_bits(),
        DType::F32 => (value as f32).to_bits() as u64,
        DType::F16 => f16::from_f64(value).to_bits() as u64,
        DType::BF16 => bf16::from_f64(value).to_bits() as u64,
        other => {
            return Err(Error::WrongDType {
                what: "a fill's tensor".into(),
                dtype: other,
                expected: "a float type (F32, F16, BF16 or F64)",
            })
        }
    })
}

/// Every element of `x` (of `dtype`: f32, f16, bf16 or f64) set to `value`, rounded once to
/// `dtype`, on `stream`.
pub fn fill<'a>(
    dev: &Device,
    stream: &Stream,
    x: impl Into<DeviceView<'a>>,
    value: f64,
    dtype: DType,
) -> Result<()> {
    let x = x.into();
    let p = FillParams {
        n: (x.len() / dtype.size()) as u64,
        bits: fill_bits(value, dtype)?,
    };
    dev.launch(
        stream,
        &FILL,
        &[Some(Operand::new(x, dtype))],
        bytemuck::bytes_of(&p),
    )
}
