//! What the row-wise ops share: the fixed row chunks of deterministic column sums (bias and
//! LayerNorm parameter gradients, [`column_chunks`]); and for their CPU twins, conversions of
//! the model floats without branches (`half`'s per-element conversions test the CPU on every
//! call and keep loops scalar), the 32 lane sums and butterfly of a kernel that gives one warp
//! to a row, and the shape check run on a twin's own operands.
//!
//! Column sums over `rows` rows run in two steps on every backend: the rows are cut into
//! [`column_chunks`] chunks of consecutive rows; each chunk's column sums are accumulated in f32
//! over its rows in order and written to a scratch operand; a second step adds the chunks'
//! partial sums in chunk order. The order of every addition is fixed by the shape alone, so
//! the result is the same bits from run to run and on the CPU twin as on CUDA.

use half::{bf16, f16};

use crate::device::{LaunchInfo, OperandInfo, TwinArgs};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::float::Float;

/// The most chunks a column sum cuts its rows into (see [`column_chunks`]).
pub const MAX_COLUMN_CHUNKS: usize = 256;

/// How a column sum over `rows` rows cuts them: `(rows_per_chunk, chunks)`, with
/// `rows_per_chunk = max(1, ⌈rows / 256⌉)` and `chunks = ⌈rows / rows_per_chunk⌉` (at most
/// [`MAX_COLUMN_CHUNKS`]; 0 for no rows). The last chunk may be shorter.
pub fn column_chunks(rows: usize) -> (usize, usize) {
    let per = rows.div_ceil(MAX_COLUMN_CHUNKS).max(1);
    (per, rows.div_ceil(per))
}

/// `rows · cols` as a count of elements, or the op's error when it overflows.
pub(crate) fn elements(info: &LaunchInfo<'_>, rows: u64, cols: u64) -> Result<usize> {
    rows.checked_mul(cols)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| {
            info.desc
                .error(format!("[{rows}, {cols}] elements overflow"))
        })
}

/// Checks that operand `i`, when present, holds `want` elements of `dtype`; `shape` names the
/// expected shape for the error (`"[N, C] = [4, 8]"`).
pub(crate) fn expect(
    info: &LaunchInfo<'_>,
    i: usize,
    shape: &str,
    want: usize,
    dtype: DType,
) -> Result<()> {
    let Some(d) = info.dtype(i) else {
        return Ok(());
    };
    let len = info.len(i);
    if len != want || d != dtype {
        let name = info.desc.operands.get(i).map_or("?", |s| s.name);
        return Err(info.desc.error(format!(
            "operand `{name}` holds {len} {d} elements; it must hold {shape} = {want} elements \
             of {dtype}"
        )));
    }
    Ok(())
}

/// Checks that every present operand holds `n` elements of operand 0's type (the shape check
/// of an elementwise op).
pub(crate) fn expect_elementwise(info: &LaunchInfo<'_>, n: u64) -> Result<()> {
    let t = info.dtype(0).unwrap_or(DType::F32);
    let n = usize::try_from(n).map_err(|_| info.desc.error(format!("n = {n} elements")))?;
    for i in 0..info.operands.len() {
        expect(info, i, &format!("[n] = [{n}]"), n, t)?;
    }
    Ok(())
}

/// One operand of a twin run, as bytes.
enum Bytes<'a> {
    Absent,
    Read(&'a [u8]),
    Write(&'a mut [u8]),
}

/// The operands of a twin run, checked with the op's shape check before any is touched (a
/// twin may be run directly, without [`Device::launch`](crate::device::Device::launch)'s
/// checks), then handed out typed.
pub(crate) struct Operands<'a> {
    args: Vec<Bytes<'a>>,
    infos: Vec<Option<OperandInfo>>,
    desc: &'static crate::device::KernelDesc,
}

impl<'a> Operands<'a> {
    /// Takes every operand of `a` and runs the descriptor's check on them with `params`.
    pub(crate) fn checked(a: &mut TwinArgs<'a>, params: &[u8]) -> Result<Self> {
        let desc = a.desc();
        let mut args = Vec::with_capacity(desc.operands.len());
        let mut infos = Vec::with_capacity(desc.operands.len());
        for (i, spec) in desc.operands.iter().enumerate() {
            let Some(d) = a.dtype(i) else {
                args.push(Bytes::Absent);
                infos.push(None);
                continue;
            };
            let b = if spec.mode.writes() {
                Bytes::Write(a.take(i)?)
            } else {
                Bytes::Read(a.read(i)?)
            };
            let len = match &b {
                Bytes::Read(b) => b.len(),
                Bytes::Write(b) => b.len(),
                Bytes::Absent => 0,
            };
            args.push(b);
            infos.push(Some(OperandInfo {
                dtype: d,
                len: len / d.size(),
            }));
        }
        if let Some(check) = desc.check {
            check(&LaunchInfo {
                desc,
                operands: &infos,
                params,
            })?;
        }
        Ok(Operands { args, infos, desc })
    }

    /// Element type of operand `i`, if present.
    pub(crate) fn dtype(&self, i: usize) -> Option<DType> {
        self.infos.get(i).copied().flatten().map(|o| o.dtype)
    }

    fn misuse(&self, i: usize, what: &str) -> Error {
        let name = self.desc.operands.get(i).map_or("?", |s| s.name);
        self.desc
            .signature_error(format!("the twin's operand {i} (`{name}`) {what}"))
    }

    /// Read operand `i` as elements of `T`, `None` when absent.
    pub(crate) fn read_opt<T: bytemuck::Pod>(&self, i: usize) -> Result<Option<&'a [T]>> {
        match self.args.get(i) {
            Some(Bytes::Absent) => Ok(None),
            Some(Bytes::Read([])) => Ok(Some(&[])),
            Some(Bytes::Read(b)) => bytemuck::try_cast_slice(b)
                .map(Some)
                .map_err(|_| self.misuse(i, "has the wrong element size")),
            _ => Err(self.misuse(i, "is not a read operand")),
        }
    }

    /// Read operand `i` as elements of `T`.
    pub(crate) fn read<T: bytemuck::Pod>(&self, i: usize) -> Result<&'a [T]> {
        self.read_opt(i)?.ok_or_else(|| self.misuse(i, "is absent"))
    }

    /// Written operand `i` as elements of `T` (once), `None` when absent.
    pub(crate) fn write_opt<T: bytemuck::Pod>(&mut self, i: usize) -> Result<Option<&'a mut [T]>> {
        match self
            .args
            .get_mut(i)
            .map(|b| std::mem::replace(b, Bytes::Absent))
        {
            None | Some(Bytes::Absent) => Ok(None),
            Some(Bytes::Write([])) => Ok(Some(&mut [])),
            Some(Bytes::Write(b)) => bytemuck::try_cast_slice_mut(b)
                .map(Some)
                .map_err(|_| self.misuse(i, "has the wrong element size")),
            Some(Bytes::Read(_)) => Err(self.misuse(i, "is not a written operand")),
        }
    }

    /// Written operand `i` as elements of `T` (once).
    pub(crate) fn write<T: bytemuck::Pod>(&mut self, i: usize) -> Result<&'a mut [T]> {
        self.write_opt(i)?
            .ok_or_else(|| self.misuse(i, "is absent or was taken"))
    }
}

/// A model float as the row-wise twins convert it: one element at a time with the values of
/// [`Float::get`] and [`Float::put`], but without branches, so loops of them vectorise (the
/// per-element conversions of `half` do not: they test the CPU on every call).
pub(crate) trait Rows: Float {
    /// The value as f32 (exact).
    fn to32(self) -> f32;
    /// `x` rounded to this type (nearest even; NaN stays NaN).
    fn from32(x: f32) -> Self;
    /// Whether the value is greater than zero (false for NaN and both zeros), from its bits.
    fn positive(self) -> bool;
    /// Positive zero.
    const ZERO: Self;

    /// `src` widened to f32: `src` itself for f32, else converted into `buf`, which must be at
    /// least as long.
    #[inline(always)]
    fn widen<'a>(src: &'a [Self], buf: &'a mut [f32]) -> &'a [f32] {
        let buf = &mut buf[..src.len()];
        for (o, &x) in buf.iter_mut().zip(src) {
            *o = x.to32();
        }
        buf
    }
    /// `src` rounded into `dst` (the shorter length).
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        for (o, &x) in dst.iter_mut().zip(src) {
            *o = Self::from32(x);
        }
    }
}

impl Rows for f32 {
    #[inline(always)]
    fn to32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from32(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn positive(self) -> bool {
        self > 0.0
    }
    const ZERO: f32 = 0.0;
    #[inline(always)]
    fn widen<'a>(src: &'a [f32], _buf: &'a mut [f32]) -> &'a [f32] {
        src
    }
}

impl Rows for f16 {
    #[inline(always)]
    fn to32(self) -> f32 {
        f16_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from32(x: f32) -> f16 {
        f16::from_bits(f32_to_f16(x))
    }
    #[inline(always)]
    fn positive(self) -> bool {
        let b = self.to_bits();
        // Sign clear, not zero, not NaN.
        b & 0x8000 == 0 && b != 0 && b <= 0x7c00
    }
    const ZERO: f16 = f16::ZERO;
}

impl Rows for bf16 {
    #[inline(always)]
    fn to32(self) -> f32 {
        bf16_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from32(x: f32) -> bf16 {
        bf16::from_bits(f32_to_bf16(x))
    }
    #[inline(always)]
    fn positive(self) -> bool {
        let b = self.to_bits();
        b & 0x8000 == 0 && b != 0 && b <= 0x7f80
    }
    const ZERO: bf16 = bf16::ZERO;
}

/// `half::bf16::to_f32`: NaN gets its quiet bit.
#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    let nan = b & 0x7fff > 0x7f80;
    let b = if nan { b | 0x0040 } else { b };
    f32::from_bits((b as u32) << 16)
}

/// `half::bf16::from_f32`: round to nearest even (adding `0x7fff` plus the kept low bit
/// carries exactly when the dropped half rounds up); NaN keeps its high mantissa bits and gets
/// the quiet bit.
#[inline(always)]
fn f32_to_bf16(x: f32) -> u16 {
    let x = x.to_bits();
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let nan = ((x >> 16) | 0x0040) as u16;
    if x & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }
}

/// `half::f16::to_f32` (exact): normal and subnormal values shifted into place and scaled by
/// 2¹¹² (exact), infinities and NaN (quiet) rebuilt from the bits.
#[inline(always)]
fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let em = h & 0x7fff;
    let finite = (f32::from_bits(em << 13) * f32::from_bits(0x7780_0000)).to_bits();
    let quiet = if em > 0x7c00 { 0x0040_0000 } else { 0 };
    let special = (em << 13) | 0x7f80_0000 | quiet;
    let bits = if em >= 0x7c00 { special } else { finite };
    f32::from_bits(bits | (h & 0x8000) << 16)
}

/// `half::f16::from_f32`: round to nearest even (overflow to infinity); NaN keeps its high
/// mantissa bits and gets the quiet bit.
#[inline(always)]
fn f32_to_f16(x: f32) -> u16 {
    let f = x.to_bits();
    let a = f & 0x7fff_ffff;
    let nan = 0x7e00 | (a >> 13) & 0x3ff;
    // Normal: rebias the exponent, then add half an ulp less one, plus the kept low bit.
    let normal = a.wrapping_add(0xc800_0fff).wrapping_add((a >> 13) & 1) >> 13;
    // Subnormal or zero: adding 0.5 rounds to a multiple of 2⁻²⁴ (the ulp of 0.5), leaving the
    // f16 bits in the low bits of the sum.
    let sub = (f32::from_bits(a) + 0.5)
        .to_bits()
        .wrapping_sub(0x3f00_0000);
    let v = if a > 0x7f80_0000 {
        nan
    } else if a >= 0x4780_0000 {
        0x7c00
    } else if a >= 0x3880_0000 {
        normal
    } else {
        sub
    };
    (v | (f >> 16) & 0x8000) as u16
}

/// The 32 lane sums of `R` warps that own a row each: lane `l` of row `i` adds `f(i, x)` for
/// the row's elements `l`, `l + 32`, … in order, starting from 0. The rows' additions
/// interleave, so `R` chains of dependent additions run side by side, each in its row's order.
#[inline(always)]
pub(crate) fn lane_sums_rows<E: Copy, const R: usize>(
    rows: [&[E]; R],
    f: impl Fn(usize, E) -> f32,
) -> [[f32; 32]; R] {
    let mut p = [[0.0f32; 32]; R];
    let split: [(&[[E; 32]], &[E]); R] = rows.map(|r| r.as_chunks::<32>());
    let chunks = split.iter().map(|s| s.0.len()).min().unwrap_or(0);
    for k in 0..chunks {
        // Indexed, with a copy of each row's lanes: the form LLVM keeps in vector registers.
        #[allow(clippy::needless_range_loop)]
        for i in 0..R {
            let ch = &split[i].0[k];
            let mut a = p[i];
            for j in 0..32 {
                a[j] += f(i, ch[j]);
            }
            p[i] = a;
        }
    }
    for (i, (p, (_, rest))) in p.iter_mut().zip(&split).enumerate() {
        for (j, &x) in rest.iter().enumerate() {
            p[j] += f(i, x);
        }
    }
    p
}

/// The butterfly a warp reduces its lanes with (`v += __shfl_xor_sync(~0, v, o)` for o = 16,
/// 8, 4, 2, 1 — `warp_sum` in `kernels/rows.cuh`): every lane ends with this value.
#[inline(always)]
pub(crate) fn butterfly(mut p: [f32; 32]) -> f32 {
    for o in [16, 8, 4, 2, 1] {
        let q = p;
        for (l, v) in p.iter_mut().enumerate() {
            *v = q[l] + q[l ^ o];
        }
    }
    p[0]
}

/// Asks the cache for the lines of `v` ahead of their use (a hint: no effect on results).
#[inline(always)]
pub(crate) fn prefetch<T>(v: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(v);
        let p = v.as_ptr().cast::<i8>();
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults and reads nothing; `off` stays within `v`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// `acc[c] += xs[c]` for every column of a row (the per-row step of a column sum).
#[inline(always)]
pub(crate) fn add_columns(acc: &mut [f32], xs: &[f32]) {
    for (a, &x) in acc.iter_mut().zip(xs) {
        *a += x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_rows() {
        assert_eq!(column_chunks(0), (1, 0));
        assert_eq!(column_chunks(1), (1, 1));
        assert_eq!(column_chunks(256), (1, 256));
        assert_eq!(column_chunks(257), (2, 129));
        assert_eq!(column_chunks(4096), (16, 256));
        for rows in [3usize, 255, 511, 513, 100_000] {
            let (per, n) = column_chunks(rows);
            assert!(n <= MAX_COLUMN_CHUNKS && per * n >= rows && per * (n - 1) < rows);
        }
    }

    #[test]
    fn branch_free_bf16_matches_half() {
        let mut bits: Vec<u32> = (0..1 << 16).map(|i| (i as u32) << 16 | 0x8000).collect();
        bits.extend((0..1u32 << 16).map(|i| (i << 16) | (i & 0xffff).wrapping_mul(40_503)));
        bits.extend([
            0x7f7f_ffff,
            0x7f80_0001,
            0xffc0_0000,
            0x0000_8000,
            0x0001_8000,
        ]);
        for b in bits {
            let x = f32::from_bits(b);
            assert_eq!(f32_to_bf16(x), bf16::from_f32(x).to_bits(), "{b:#x}");
        }
        for b in 0..=u16::MAX {
            assert_eq!(
                bf16_to_f32(b).to_bits(),
                bf16::from_bits(b).to_f32().to_bits()
            );
        }
    }

    #[test]
    fn branch_free_f16_matches_half() {
        for b in 0..=u16::MAX {
            assert_eq!(
                f16_to_f32(b).to_bits(),
                f16::from_bits(b).to_f32().to_bits(),
                "{b:#x}"
            );
        }
        let mut bits: Vec<u32> = (0..u32::MAX / 1021).map(|i| i * 1021).collect();
        for e in [
            0x3300_0000u32,
            0x3380_0000,
            0x3880_0000,
            0x477f_e000,
            0x4780_0000,
        ] {
            for d in 0..4096 {
                bits.extend([e + d, e.wrapping_sub(d), (e + (d << 12)) | 0x8000_0000]);
            }
        }
        bits.extend([
            0x7f80_0000,
            0x7f80_0001,
            0x7fc0_0000,
            0xffff_ffff,
            0x0000_0001,
            0x477f_efff,
            0x477f_f000,
        ]);
        for b in bits {
            let x = f32::from_bits(b);
            assert_eq!(f32_to_f16(x), f16::from_f32(x).to_bits(), "{b:#x}");
        }
    }

    #[test]
    fn positive_is_greater_than_zero() {
        for b in 0..=u16::MAX {
            let (h, bf) = (f16::from_bits(b), bf16::from_bits(b));
            assert_eq!(h.positive(), h.to_f32() > 0.0, "{b:#x}");
            assert_eq!(bf.positive(), bf.to_f32() > 0.0, "{b:#x}");
        }
    }

    #[test]
    fn lanes_and_butterfly_follow_the_warp() {
        let xs: Vec<f32> = (0..77).map(|i| (i as f32).sin() * 1e3).collect();
        let [p] = lane_sums_rows([&xs[..]], |_, x| x);
        let mut want = [0.0f32; 32];
        for (i, &x) in xs.iter().enumerate() {
            want[i % 32] += x;
        }
        assert_eq!(p, want);
        // Every lane of the butterfly ends with lane 0's value.
        let mut q = p;
        for o in [16, 8, 4, 2, 1] {
            let r = q;
            for l in 0..32 {
                q[l] = r[l] + r[l ^ o];
            }
        }
        assert!(q.iter().all(|v| v.to_bits() == butterfly(p).to_bits()));
    }
}
