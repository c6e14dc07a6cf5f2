use half::{bf16, f16};

use crate::device::kernel::{grid_stride, param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::Result;

abi! {
    /// The parameters of `kernels/accumulate.cu` (`accumulate.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct AccumulateParams {
        /// Elements.
        pub n: u64,
    }
}

abi! {
    /// `acc += x`: `x` read (a model float), `acc` (f32) read and written.
    static ACCUMULATE: KernelDesc = KernelDesc {
        name: "accumulate",
        operands: &[
            OperandSpec::read("x", &DType::FLOATS),
            OperandSpec::read_write("acc", &[DType::F32]),
        ],
        params: param_layout!(AccumulateParams, "accumulate.cuh", [n]),
        check: Some(check),
        twin,
        cuda: CudaSide::Nvrtc {
            source: "accumulate.cu",
            plan,
        },
    };
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: AccumulateParams = info.params()?;
    if info.len(0) as u64 != p.n || info.len(1) as u64 != p.n {
        return Err(info.desc.error(format!(
            "{} addends and {} accumulators for n = {}",
            info.len(0),
            info.len(1),
            p.n
        )));
    }
    Ok(())
}

fn plan(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let t = info.dtype(0).map_or("?", |d| d.name());
    Ok(grid_stride(format!("accumulate_{t}"), info.len(0)))
}

fn add<T: bytemuck::Pod>(a: &mut TwinArgs<'_>, widen: fn(T) -> f32) -> Result<()> {
    let x = a.read_as::<T>(0)?;
    for (acc, &x) in a.take_as::<f32>(1)?.iter_mut().zip(x) {
        *acc += widen(x);
    }
    Ok(())
}

fn twin(a: &mut TwinArgs<'_>) -> Result<()> {
    match a.dtype(0) {
        Some(DType::F16) => add::<f16>(a, f16::to_f32),
        Some(DType::BF16) => add::<bf16>(a, bf16::to_f32),
        _ => add::<f32>(a, |x| x),
    }
}

/// `acc += x` elementwise into an fp32 accumulator, `x` of f32, f16 or bf16 (widened exactly):
/// what a parameter used several times (tied weights) sums its gradient shares with, and what
/// gradient accumulation over micro-batches needs. One rounded f32 add per element, so CUDA
/// (`kernels/accumulate.cu`) and the CPU twin agree bit for bit.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// let acc = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 2.0]))?;
/// let x = dev.upload(&s, bytemuck::cast_slice(&[half::f16::from_f32(0.5); 2]))?;
/// tidemem::ops::accumulate(&dev, &s, &x, DType::F16, &acc)?;
/// let sum: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &acc)?);
/// assert_eq!(sum, [1.5, 2.5]);
/// # Ok(()) }
/// ```
///
/// `acc += x` elementwise on `stream`: `x` holds elements of `dtype` (a model float), `acc` as
/// many f32; the two do not overlap.
pub fn accumulate<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    x: impl Into<Input<'a>>,
    dtype: DType,
    acc: impl Into<DeviceView<'b>>,
) -> Result<()> {
    let (x, acc) = (x.into(), acc.into());
    let p = AccumulateParams {
        n: (x.len() / dtype.size()) as u64,
    };
    let ops = [
        Some(Operand::input(x, dtype)),
        Some(Operand::new(acc, DType::F32)),
    ];
    dev.launch(stream, &ACCUMULATE, &ops, bytemuck::bytes_of(&p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimConfig;

    #[test]
    fn sums_in_f32_and_checks_lengths() {
        let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
        let s = dev.new_stream().unwrap();
        let acc = dev
            .upload(&s, bytemuck::cast_slice(&[1.0f32, -2.0, 1e8]))
            .unwrap();
        let x = dev
            .upload(&s, bytemuck::cast_slice(&[bf16::from_f32(0.25); 3]))
            .unwrap();
        accumulate(&dev, &s, &x, DType::BF16, &acc).unwrap();
        let got: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &acc).unwrap());
        // f32 rounding: 1e8 + 0.25 is 1e8.
        assert_eq!(got, [1.25, -1.75, 1e8]);
        let short = dev.alloc(8).unwrap();
        assert!(accumulate(&dev, &s, &x, DType::BF16, &short).is_err());
        assert!(accumulate(&dev, &s, &acc, DType::F32, &acc).is_err());
    }
}
