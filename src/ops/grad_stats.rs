use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use serde::Serialize;

use crate::device::kernel::{param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::adam::Grad;

/// Partial sums the CUDA kernel uses (one per block; `GS_PARTIALS` in `grad_stats.cuh`).
pub const GRAD_STATS_PARTIALS: usize = 256;
/// Threads per block of the partial kernel (`GS_THREADS` in `grad_stats.cuh`).
pub const GRAD_STATS_THREADS: u32 = 1024;
/// Bytes of the output range of [`grad_stats`]: the result (two f64) and room for
/// [`GRAD_STATS_PARTIALS`] partial results.
pub const GRAD_STATS_BYTES: usize = 16 * (1 + GRAD_STATS_PARTIALS);

/// Squared L2 norm and finiteness of a gradient slice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct GradStats {
    /// Sum of squares (of the values as stored, before any unscaling).
    pub sum_sq: f64,
    /// Whether an element is infinite or NaN.
    pub nonfinite: bool,
}

impl GradStats {
    /// Combines two partial results (in a fixed order, so combining is deterministic).
    pub fn merge(self, o: GradStats) -> GradStats {
        GradStats {
            sum_sq: self.sum_sq + o.sum_sq,
            nonfinite: self.nonfinite || o.nonfinite,
        }
    }
}

abi! {
    /// The parameters of `kernels/grad_stats.cu` (`grad_stats.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct GradStatsParams {
        /// Source elements.
        pub n: u64,
    }
}

abi! {
    /// The gradient statistics op: `src` (read) summarised into `out` (f64, written: the sum, the
    /// nonfinite flag, then scratch for the partial sums).
    static GRAD_STATS: KernelDesc = KernelDesc {
        name: "grad_stats",
        operands: &[
            OperandSpec::read("src", &DType::FLOATS),
            OperandSpec::write("out", &[DType::F64]),
        ],
        params: param_layout!(GradStatsParams, "grad_stats.cuh", [n]),
        check: Some(check),
        twin,
        cuda: CudaSide::Nvrtc {
            source: "grad_stats.cu",
            plan,
        },
    };
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: GradStatsParams = info.params()?;
    if info.len(0) as u64 != p.n || info.len(1) != GRAD_STATS_BYTES / 8 {
        return Err(info.desc.error(format!(
            "{} source elements for n = {}, {} output f64 (needs {})",
            info.len(0),
            p.n,
            info.len(1),
            GRAD_STATS_BYTES / 8
        )));
    }
    Ok(())
}

fn plan(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let t = info.dtype(0).map_or("?", |d| d.name());
    Ok(vec![
        Grid::linear(
            format!("grad_stats_partial_{t}"),
            GRAD_STATS_PARTIALS as u32,
            GRAD_STATS_THREADS,
        ),
        Grid::linear("grad_stats_final", 1, GRAD_STATS_PARTIALS as u32),
    ])
}

fn twin(args: &mut TwinArgs<'_>) -> Result<()> {
    let dtype = args
        .dtype(0)
        .ok_or_else(|| args.desc().error("no source"))?;
    let st = grad_stats_of(args.read(0)?, dtype)?;
    let out = args.take(1)?;
    out[..8].copy_from_slice(&st.sum_sq.to_le_bytes());
    out[8..16].copy_from_slice(&(st.nonfinite as u8 as f64).to_le_bytes());
    Ok(())
}

/// Gradient statistics: the sum of squares (accumulated in f64) and whether an element is
/// infinite or NaN, for gradient clipping and dynamic loss scaling. The op ([`grad_stats`], on a
/// device) writes them as two f64; its CPU twin and the host path share [`grad_stats_of`]. CUDA
/// runs `kernels/grad_stats.cu`.
///
/// It takes any f32, f16 or bf16 buffer, so it is also the global norm of gradients that live
/// outside chunks (say, parameters kept out of the chunk store): add the `sum_sq` of each buffer
/// ([`GradStats::merge`], in a fixed order) and take the square root; a buffer with an infinite
/// or NaN element sets `nonfinite`.
///
/// Gradient statistics of `src` (elements of `dtype`) on `stream`: the sum of squares and
/// whether an element is infinite or NaN, written as two f64 at the start of `out`, which must
/// hold [`GRAD_STATS_BYTES`] bytes (the rest is scratch; a longer range is used in its first
/// [`GRAD_STATS_BYTES`]) at an 8-byte aligned offset. Read them with [`Device::download`] and
/// [`read_grad_stats`].
pub fn grad_stats<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    src: impl Into<Input<'a>>,
    dtype: DType,
    out: impl Into<DeviceView<'b>>,
) -> Result<()> {
    let (src, out) = (src.into(), out.into());
    if out.len() < GRAD_STATS_BYTES {
        return Err(Error::TooFew {
            what: "output bytes of gradient statistics".into(),
            got: out.len(),
            need: GRAD_STATS_BYTES,
        });
    }
    let out = out.slice(0, GRAD_STATS_BYTES)?;
    let params = GradStatsParams {
        n: (src.len() / dtype.size()) as u64,
    };
    dev.launch(
        stream,
        &GRAD_STATS,
        &[
            Some(Operand::input(src, dtype)),
            Some(Operand::new(out, DType::F64)),
        ],
        bytemuck::bytes_of(&params),
    )
}

/// Decodes the result of [`grad_stats`] from the first 16 downloaded bytes.
pub fn read_grad_stats(bytes: &[u8]) -> Result<GradStats> {
    if bytes.len() < 16 {
        return Err(Error::TooFew {
            what: "bytes of gradient statistics".into(),
            got: bytes.len(),
            need: 16,
        });
    }
    let f = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i..i + 8]);
        f64::from_le_bytes(b)
    };
    Ok(GradStats {
        sum_sq: f(0),
        nonfinite: f(8) != 0.0,
    })
}

/// Elements widened to f32 at a time (a divisor of the kernel's thread count).
const DECODE: usize = 256;
/// The CUDA kernel's threads: [`GRAD_STATS_PARTIALS`] blocks of [`GRAD_STATS_THREADS`].
const LANES: usize = GRAD_STATS_PARTIALS * GRAD_STATS_THREADS as usize;

/// The statistics of `bytes`, little-endian elements of `dtype` (a model float), summed in the
/// CUDA kernel's order, so that the host and the device give the same bits: lane `j` of
/// [`GRAD_STATS_PARTIALS`] × [`GRAD_STATS_THREADS`] accumulates the squares of elements `j`,
/// `j + lanes`, … in order (in f64, each product and each sum rounded once), each block's
/// lanes are summed by a halving tree (`s[t] += s[t + stride]`, the stride from half the block
/// down to 1), and the blocks' sums by the same tree. Lanes past the slice hold 0, which adds
/// nothing, so a short slice costs about its length rounded up to a block.
pub fn grad_stats_of(bytes: &[u8], dtype: DType) -> Result<GradStats> {
    grad_stats_split(bytes, dtype, 1)
}

/// Fewest lanes worth a thread of their own.
const MIN_LANES_PER_THREAD: usize = 1 << 15;

/// [`grad_stats_of`] on up to `threads` threads, each summing a range of the lanes over every
/// row of elements (each lane's sum in the same order): the same bits.
pub(crate) fn grad_stats_split(bytes: &[u8], dtype: DType, threads: usize) -> Result<GradStats> {
    if !dtype.is_model_float() {
        return Err(Error::WrongDType {
            what: "a gradient whose statistics are taken".into(),
            dtype,
            expected: "a model float (F32, F16 or BF16)",
        });
    }
    if !bytes.len().is_multiple_of(dtype.size()) {
        return Err(Error::NotMultiple {
            what: "bytes of a gradient",
            value: bytes.len(),
            of: "its element size",
            divisor: dtype.size(),
        });
    }
    let n = bytes.len() / dtype.size();
    let mut lanes = vec![0.0f64; n.min(LANES)];
    let parts = threads.min(lanes.len() / MIN_LANES_PER_THREAD).max(1);
    let per = lanes.len().div_ceil(parts).div_ceil(DECODE) * DECODE;
    let nonfinite = std::thread::scope(|scope| {
        let mut chunks = lanes.chunks_mut(per.max(1)).enumerate();
        let first = chunks.next();
        let others: Vec<_> = chunks
            .map(|(i, acc)| scope.spawn(move || accumulate_lanes(bytes, dtype, acc, i * per)))
            .collect();
        let mut bad = first.is_some_and(|(_, acc)| accumulate_lanes(bytes, dtype, acc, 0));
        for h in others {
            bad |= h.join().map_err(|_| Error::Panicked {
                what: "a gradient statistics thread".into(),
                message: String::new(),
            })?;
        }
        Ok::<bool, Error>(bad)
    })?;
    let per = GRAD_STATS_THREADS as usize;
    let mut blocks = [0.0f64; GRAD_STATS_PARTIALS];
    let used = lanes.len().div_ceil(per);
    for (sum, part) in blocks.iter_mut().zip(lanes.chunks_mut(per)) {
        *sum = halving_sum(part, per);
    }
    Ok(GradStats {
        sum_sq: halving_sum(&mut blocks[..used], GRAD_STATS_PARTIALS),
        nonfinite,
    })
}

/// [`accumulate`] for the lanes `lo..lo + lanes.len()`, in the AVX2 build where the CPU has it.
fn accumulate_lanes(bytes: &[u8], dtype: DType, lanes: &mut [f64], lo: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has AVX2 and F16C (checked above); the body is safe code.
        return unsafe { accumulate_avx2(bytes, dtype, lanes, lo) };
    }
    accumulate(bytes, dtype, lanes, lo)
}

/// Adds the squares of `bytes`' elements of lanes `lo..lo + lanes.len()` to those lanes
/// (element `i` to lane `i % LANES`, row after row: in the elements' order) in f64, each
/// product and each sum rounded once; returns whether any is not finite. Every path runs this
/// body, so a wider vector gives the same bits.
#[inline(always)]
fn accumulate(bytes: &[u8], dtype: DType, lanes: &mut [f64], lo: usize) -> bool {
    let es = dtype.size();
    let n = bytes.len() / es;
    let mut nonfinite = false;
    let mut buf = [0.0f32; DECODE];
    let mut row = lo;
    while row < n {
        let end = (row + lanes.len()).min(n);
        let mut at = row;
        while at < end {
            let len = DECODE.min(end - at);
            decode_block(&bytes[at * es..(at + len) * es], dtype, &mut buf[..len]);
            let mut bad = false;
            let off = at - row;
            for (acc, &x) in lanes[off..off + len].iter_mut().zip(&buf[..len]) {
                bad |= !x.is_finite();
                let d = x as f64;
                *acc += d * d;
            }
            nonfinite |= bad;
            at += len;
        }
        row += LANES;
    }
    nonfinite
}

/// [`accumulate`] compiled for AVX2 (and F16C, the half conversions'), chosen at run time.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn accumulate_avx2(bytes: &[u8], dtype: DType, lanes: &mut [f64], lo: usize) -> bool {
    accumulate(bytes, dtype, lanes, lo)
}

/// The kernel's tree over `size` values (a power of two) of which `s` is the start and the
/// rest are 0: `v[t] += v[t + stride]` for `t < stride`, the stride halving from `size / 2` to
/// 1, the sum left in `v[0]`. Adding a 0 changes no sum of squares (never −0), so only the
/// entries of `s` are touched.
fn halving_sum(s: &mut [f64], size: usize) -> f64 {
    let mut m = s.len();
    let mut stride = size / 2;
    while stride > 0 {
        if m > stride {
            let (lo, hi) = s.split_at_mut(stride);
            for (a, &b) in lo.iter_mut().zip(&hi[..m - stride]) {
                *a += b;
            }
            m = stride;
        }
        stride /= 2;
    }
    s.first().copied().unwrap_or(0.0)
}

/// Widens one block to f32: through a typed slice when the bytes are aligned (the vector
/// conversions of `half`), element by element otherwise; both give the same values.
fn decode_block(block: &[u8], dtype: DType, out: &mut [f32]) {
    match dtype {
        DType::F32 => match bytemuck::try_cast_slice::<u8, f32>(block) {
            Ok(v) => out.copy_from_slice(v),
            Err(_) => {
                for (o, c) in out.iter_mut().zip(block.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        },
        DType::F16 => match bytemuck::try_cast_slice::<u8, f16>(block) {
            Ok(v) => v.convert_to_f32_slice(out),
            Err(_) => {
                for (o, c) in out.iter_mut().zip(block.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
        },
        _ => match bytemuck::try_cast_slice::<u8, bf16>(block) {
            Ok(v) => v.convert_to_f32_slice(out),
            Err(_) => {
                for (o, c) in out.iter_mut().zip(block.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
        },
    }
}

/// The statistics of a gradient slice (see [`GradStats`]).
pub fn grad_stats_host(grad: Grad<'_>) -> GradStats {
    let (bytes, dtype): (&[u8], DType) = match grad {
        Grad::F32(g) => (bytemuck::cast_slice(g), DType::F32),
        Grad::F16(g) => (bytemuck::cast_slice(g), DType::F16),
        Grad::Bf16(g) => (bytemuck::cast_slice(g), DType::BF16),
    };
    // A model float and whole elements: cannot fail.
    grad_stats_of(bytes, dtype).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's order written out the long way: every lane (zeros included), every
    /// block's full tree, the blocks' tree.
    fn kernel_order(x: &[f32]) -> f64 {
        let mut lanes = vec![0.0f64; LANES];
        for (i, &v) in x.iter().enumerate() {
            let d = v as f64;
            lanes[i % LANES] += d * d;
        }
        let tree = |v: &mut [f64]| {
            let mut stride = v.len() / 2;
            while stride > 0 {
                for t in 0..stride {
                    v[t] += v[t + stride];
                }
                stride /= 2;
            }
            v[0]
        };
        let per = GRAD_STATS_THREADS as usize;
        let mut blocks: Vec<f64> = lanes.chunks_mut(per).map(tree).collect();
        tree(&mut blocks)
    }

    /// The host sums in the kernel's order, not in element order: on values whose sum depends
    /// on the order, it gives the long way's bits, and element order gives others.
    #[test]
    fn the_sum_is_the_kernels_order() {
        let mut differs = 0;
        for n in [
            0usize,
            1,
            3,
            1000,
            1024,
            5000,
            LANES - 1,
            LANES + 17,
            3 * LANES + 5,
        ] {
            // magnitudes over many decades, so that rounding depends on the order
            let x: Vec<f32> = (0..n)
                .map(|i| {
                    let h = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                    (h % 1000) as f32 * 10f32.powi((h % 13) as i32 - 6)
                })
                .collect();
            let got = grad_stats_of(bytemuck::cast_slice(&x), DType::F32).unwrap();
            assert_eq!(got.sum_sq.to_bits(), kernel_order(&x).to_bits(), "n = {n}");
            let in_order: f64 = x.iter().fold(0.0, |a, &v| a + (v as f64) * (v as f64));
            differs += usize::from(in_order.to_bits() != got.sum_sq.to_bits());
        }
        assert!(
            differs > 0,
            "no input tells the kernel's order from element order"
        );
    }

    /// The AVX2 build of the accumulation gives the portable build's bits.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_build_gives_the_portable_bits() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
            return;
        }
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let n = LANES + 1234;
            let bytes: Vec<u8> = (0..n * dtype.size())
                .map(|i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 57) as u8 & 0x3f)
                .collect();
            let (mut a, mut b) = (vec![0.0; LANES], vec![0.0; LANES]);
            let fa = accumulate(&bytes, dtype, &mut a, 0);
            // SAFETY: the CPU has AVX2 and F16C (checked above).
            let fb = unsafe { accumulate_avx2(&bytes, dtype, &mut b, 0) };
            assert_eq!(fa, fb, "{dtype:?}");
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&a) == bits(&b), "{dtype:?}");
        }
    }

    /// Split over threads by lanes, the statistics keep their bits.
    #[test]
    fn threads_give_the_same_bits() {
        let n = 3 * LANES + 777;
        let x: Vec<f32> = (0..n)
            .map(|i| {
                let h = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                (h % 1000) as f32 * 10f32.powi((h % 13) as i32 - 6)
            })
            .collect();
        let one = grad_stats_of(bytemuck::cast_slice(&x), DType::F32).unwrap();
        for threads in [2, 3, 8] {
            let got = grad_stats_split(bytemuck::cast_slice(&x), DType::F32, threads).unwrap();
            assert_eq!(
                got.sum_sq.to_bits(),
                one.sum_sq.to_bits(),
                "{threads} threads"
            );
        }
    }

    #[test]
    fn aligned_and_unaligned_bytes_agree() {
        let v: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.37).collect();
        let mut bytes = vec![0u8; 1];
        bytes.extend_from_slice(bytemuck::cast_slice(&v));
        let a = grad_stats_of(bytemuck::cast_slice(&v), DType::F32).unwrap();
        let b = grad_stats_of(&bytes[1..], DType::F32).unwrap();
        assert_eq!(a, b);
        let exact: f64 = v.iter().map(|&x| (x as f64) * (x as f64)).sum();
        assert!((a.sum_sq - exact).abs() <= 1e-9 * exact);
        assert!(!a.nonfinite);
        let bad = [1.0f32, f32::NAN];
        assert!(
            grad_stats_of(bytemuck::cast_slice(&bad), DType::F32)
                .unwrap()
                .nonfinite
        );
        assert!(grad_stats_of(&[0u8; 3], DType::F16).is_err());
    }
}
