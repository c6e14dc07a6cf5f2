//! What the row-wise ops share: the fixed row chunks of deterministic column sums (bias and
//! LayerNorm parameter gradients, [`column_chunks`]); and for their CPU twins, the shape check
//! run on a twin's own operands, with the operands handed out typed. The lane sums and warp
//! reductions they mirror are in `ops::lanes`, the model floats in
//! [`float`](super::float).
//!
//! Column sums over `rows` rows run in two steps on every backend: the rows are cut into
//! [`column_chunks`] chunks of consecutive rows; each chunk's column sums are accumulated in f32
//! over its rows in order and written to a scratch operand; a second step adds the chunks'
//! partial sums in chunk order. The order of every addition is fixed by the shape alone, so
//! the result is the same bits from run to run and on the CPU twin as on CUDA.

use crate::device::kernel::{grid_stride, Grid};
use crate::device::{DeviceView, KernelDesc, LaunchInfo, OperandInfo, TwinArgs};
use crate::dtype::DType;
use crate::error::{Error, Result};

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

/// Checks that operand `i`, when present, holds `want` elements of `dtype`; `rule` says what
/// it must hold, for the error.
pub(crate) fn expect_with(
    info: &LaunchInfo<'_>,
    i: usize,
    want: usize,
    dtype: DType,
    rule: impl FnOnce() -> String,
) -> Result<()> {
    let Some(d) = info.dtype(i) else {
        return Ok(());
    };
    let len = info.len(i);
    if len != want || d != dtype {
        let name = info.desc.operands.get(i).map_or("?", |s| s.name);
        return Err(info.desc.error(format!(
            "operand `{name}` holds {len} {d} elements; {}",
            rule()
        )));
    }
    Ok(())
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
    expect_with(info, i, want, dtype, || {
        format!("it must hold {shape} = {want} elements of {dtype}")
    })
}

/// Checks that every present operand holds `want` elements of operand 0's type; `shape` names
/// the expected shape for the error (`"[BH, T, T] = [2, 5, 5]"`).
pub(crate) fn expect_all(info: &LaunchInfo<'_>, shape: &str, want: usize) -> Result<()> {
    let t = info.dtype(0).unwrap_or(DType::F32);
    for i in 0..info.operands.len() {
        expect_with(info, i, want, t, || {
            format!("every operand must hold {shape} = {want} elements of one type ({t})")
        })?;
    }
    Ok(())
}

/// The plan of an elementwise op: one grid-stride launch of `{entry}_{type}` (operand 0's
/// type) over operand 0's elements.
pub(crate) fn elementwise_plan(info: &LaunchInfo<'_>, entry: &str) -> Result<Vec<Grid>> {
    let t = info.dtype(0).map_or("?", |d| d.name());
    Ok(grid_stride(format!("{entry}_{t}"), info.len(0)))
}

/// Checks that every present operand holds `n` elements of operand 0's type (the shape check
/// of an elementwise op).
pub(crate) fn expect_elementwise(info: &LaunchInfo<'_>, n: u64) -> Result<()> {
    let n = usize::try_from(n).map_err(|_| info.desc.error(format!("n = {n} elements")))?;
    expect_all(info, "n", n)
}

/// The first `need` bytes of `scratch` (the scratch operand of a column sum over
/// `[rows, cols]`, sized by the function `sizer`), or the op's error when it is shorter.
pub(crate) fn scratch<'a>(
    desc: &KernelDesc,
    scratch: DeviceView<'a>,
    need: usize,
    (rows, cols): (usize, usize),
    sizer: &str,
) -> Result<DeviceView<'a>> {
    if scratch.len() < need {
        return Err(desc.error(format!(
            "operand `scratch` holds {} bytes; [{rows}, {cols}] needs {need} ({sizer})",
            scratch.len()
        )));
    }
    scratch.slice(0, need)
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
    desc: &'static KernelDesc,
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
}
