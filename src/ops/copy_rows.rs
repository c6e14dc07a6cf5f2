use crate::device::kernel::{grid_stride_blocks, param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceBuffer, DeviceView, Input, KernelDesc, LaunchInfo, Operand,
    OperandSpec, Stream, TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};

abi! {
    /// The parameters of `kernels/copy_rows.cu` (`copy_rows.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct CopyRowsParams {
        /// Rows copied.
        pub n: u64,
        /// Elements per row copied.
        pub width: u64,
        /// Elements between source rows.
        pub src_stride: u64,
        /// Elements between destination rows.
        pub dst_stride: u64,
        /// Rows the source holds (an index at or past it is skipped).
        pub src_rows: u64,
        /// Rows the destination holds (an index at or past it is skipped).
        pub dst_rows: u64,
    }
}

const F32: &[DType] = &[DType::F32];
const U32: &[DType] = &[DType::U32];

abi! {
    /// Row copy: `src` and the optional `src_index` read, `dst` (rows not named kept) written, the
    /// optional `dst_index` read. Indices out of range are skipped on both backends; destination
    /// indices must be distinct.
    static COPY_ROWS: KernelDesc = KernelDesc {
        name: "copy_rows",
        operands: &[
            OperandSpec::read("src", F32),
            OperandSpec::read("src_index", U32).optional(),
            OperandSpec::read_write("dst", F32),
            OperandSpec::read("dst_index", U32).optional(),
        ],
        params: param_layout!(
            CopyRowsParams,
            "copy_rows.cuh",
            [n, width, src_stride, dst_stride, src_rows, dst_rows]
        ),
        check: Some(check),
        twin,
        cuda: CudaSide::Nvrtc {
            source: "copy_rows.cu",
            plan,
        },
    };
}

/// Elements `rows` rows of `width` elements, `stride` apart, span (0 for no rows).
fn extent(rows: u64, stride: u64, width: u64) -> Option<u64> {
    match rows {
        0 => Some(0),
        r => (r - 1).checked_mul(stride)?.checked_add(width),
    }
}

/// Rows of `width` elements, `stride` apart, that `len` elements hold (`width ≤ stride`).
fn rows_in(len: usize, stride: usize, width: usize) -> usize {
    let len = len as u64;
    if width == 0 {
        // a row of nothing: any row fits; bounded by the elements' count for a finite answer
        return if stride == 0 {
            usize::MAX
        } else {
            (len / stride as u64) as usize + 1
        };
    }
    if len < width as u64 {
        0
    } else {
        ((len - width as u64) / stride as u64 + 1) as usize
    }
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: CopyRowsParams = info.params()?;
    let side = |name: &str, op: usize, index: usize, stride: u64, rows: u64| -> Result<()> {
        if p.width > stride {
            return Err(info.desc.error(format!(
                "rows of {} elements do not fit the {name} stride {stride}",
                p.width
            )));
        }
        let need = extent(rows, stride, p.width)
            .ok_or_else(|| info.desc.error(format!("{name}: {rows} rows overflow")))?;
        if (info.len(op) as u64) < need {
            return Err(info.desc.error(format!(
                "operand `{name}` holds {} elements; {rows} rows of {} at stride {stride} need {need}",
                info.len(op),
                p.width
            )));
        }
        if info.present(index) {
            if info.len(index) as u64 != p.n {
                return Err(info.desc.error(format!(
                    "operand `{name}_index` holds {} indices for {} rows",
                    info.len(index),
                    p.n
                )));
            }
        } else if p.n > rows {
            return Err(info.desc.error(format!(
                "{} rows copied without a {name} index from {rows} {name} rows",
                p.n
            )));
        }
        Ok(())
    };
    side("src", 0, 1, p.src_stride, p.src_rows)?;
    side("dst", 2, 3, p.dst_stride, p.dst_rows)
}

fn twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: CopyRowsParams = a.params()?;
    let src = a.read_as::<u32>(0)?;
    let si = if a.present(1) {
        Some(a.read_as::<u32>(1)?)
    } else {
        None
    };
    let di = if a.present(3) {
        Some(a.read_as::<u32>(3)?)
    } else {
        None
    };
    let dst = a.take_as::<u32>(2)?;
    let (w, ss, ds) = (
        p.width as usize,
        p.src_stride as usize,
        p.dst_stride as usize,
    );
    for i in 0..p.n as usize {
        let s = si.map_or(i as u64, |v| u64::from(v[i]));
        let d = di.map_or(i as u64, |v| u64::from(v[i]));
        if s >= p.src_rows || d >= p.dst_rows {
            continue;
        }
        let (s, d) = (s as usize * ss, d as usize * ds);
        dst[d..d + w].copy_from_slice(&src[s..s + w]);
    }
    Ok(())
}

fn plan(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let p: CopyRowsParams = info.params()?;
    if p.n == 0 || p.width == 0 {
        return Ok(vec![]);
    }
    // one block per row (grid-stride), whole warps over the row's words
    let threads = (p.width.div_ceil(32) * 32).clamp(32, 256) as u32;
    let blocks = grid_stride_blocks(p.n as usize, 1);
    Ok(vec![Grid::linear("copy_rows", blocks, threads)])
}

/// Row indices on the device (u32), with their largest value and whether they are distinct,
/// known from the upload, so that [`copy_rows`] checks them without reading them back.
#[derive(Debug)]
pub struct RowIndex {
    buf: DeviceBuffer,
    len: usize,
    max: Option<u32>,
    distinct: bool,
}

impl RowIndex {
    /// Uploads `index` on `stream`.
    pub fn upload(dev: &Device, stream: &Stream, index: &[u32]) -> Result<Self> {
        let mut sorted = index.to_vec();
        sorted.sort_unstable();
        let distinct = sorted.windows(2).all(|w| w[0] != w[1]);
        let buf = if index.is_empty() {
            dev.alloc(0)?
        } else {
            dev.upload(stream, bytemuck::cast_slice(index))?
        };
        Ok(Self {
            buf,
            len: index.len(),
            max: sorted.last().copied(),
            distinct,
        })
    }

    /// Number of indices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The largest index (`None` when empty).
    pub(crate) fn max(&self) -> Option<u32> {
        self.max
    }

    /// Whether no index repeats.
    pub(crate) fn is_distinct(&self) -> bool {
        self.distinct
    }

    /// The indices on the device.
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buf
    }
}

/// A row copy's shape (see [`copy_rows`]): `n` rows of `width` f32, source rows
/// `src_stride` elements apart and destination rows `dst_stride` apart, with optional index
/// arrays (`None`: row `i`).
#[derive(Clone, Copy, Debug)]
pub struct CopyRows<'i> {
    /// Rows copied.
    pub n: usize,
    /// Elements per row copied (at most either stride).
    pub width: usize,
    /// Elements between source rows.
    pub src_stride: usize,
    /// Elements between destination rows.
    pub dst_stride: usize,
    /// The source row of each copy (`n` of them), or `None` for row `i`.
    pub src_index: Option<&'i RowIndex>,
    /// The destination row of each copy (`n` distinct ones), or `None` for row `i`.
    pub dst_index: Option<&'i RowIndex>,
}

/// Strided, indexed row copy ([`copy_rows`]): for `i < n`, row `dst_index[i]` of `dst` ← row
/// `src_index[i]` of `src`, `width` f32 of rows `src_stride` and `dst_stride` elements apart
/// (an index left out is the identity, row `i`). It packs and unpacks blocks of rows and
/// columns on the device without a host round trip: the sharded embedding's all-to-all puts
/// each peer's block into the columns or rows of its output with it. The values are moved as
/// 32-bit words, so CUDA (`kernels/copy_rows.cu`) and the CPU twin agree bit for bit (NaN
/// payloads and −0 included).
///
/// The indices live on the device as a [`RowIndex`], whose largest value and distinctness are
/// known from its upload: an index out of either side's rows, repeated destination indices,
/// a width past a stride or a view too small are typed errors before anything is enqueued.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::ops::{copy_rows, CopyRows, RowIndex};
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// // src: 3 rows of 2; dst: 3 rows of 4, rows 2, 0 get src rows 0, 1 in their columns 1..3
/// let src = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]))?;
/// let dst = dev.upload(&s, bytemuck::cast_slice(&[0.0f32; 12]))?;
/// let to = RowIndex::upload(&dev, &s, &[2, 0])?;
/// let plan = CopyRows { n: 2, width: 2, src_stride: 2, dst_stride: 4, src_index: None, dst_index: Some(&to) };
/// copy_rows(&dev, &s, &src, dst.view(4, 44)?, &plan)?;
/// let got: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &dst)?);
/// assert_eq!(got, [0.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0]);
/// # Ok(()) }
/// ```
///
/// Copies rows on `stream` as `plan` says (see [`copy_rows`]); `src` and `dst` hold f32
/// and do not overlap, and the rows `dst` holds (from the view's start, `dst_stride` apart)
/// that no copy names are kept. A width past a stride ([`Error::TooFew`]), an index array of
/// other than `n` entries ([`Error::Length`]), an index at or past the rows its view holds
/// ([`Error::IndexOutOfRange`]; without an index, `n` more rows than it holds is
/// [`Error::TooFew`]), or repeated destination indices ([`Error::Conflict`]) are errors, and
/// nothing is written.
pub fn copy_rows<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    src: impl Into<Input<'a>>,
    dst: impl Into<DeviceView<'b>>,
    plan: &CopyRows<'_>,
) -> Result<()> {
    let (src, dst) = (src.into(), dst.into());
    let p = plan;
    if p.width > p.src_stride || p.width > p.dst_stride {
        return Err(Error::TooFew {
            what: format!("copy_rows: the strides' elements for rows of {}", p.width),
            got: p.src_stride.min(p.dst_stride),
            need: p.width,
        });
    }
    for (what, len) in [
        ("copy_rows: bytes of the src view", src.len()),
        ("copy_rows: bytes of the dst view", dst.len()),
    ] {
        if len % 4 != 0 {
            return Err(Error::NotMultiple {
                what,
                value: len,
                of: "the size of an f32",
                divisor: 4,
            });
        }
    }
    let src_rows = rows_in(src.len() / 4, p.src_stride, p.width);
    let dst_rows = rows_in(dst.len() / 4, p.dst_stride, p.width);
    for (name, index, rows) in [
        ("src", p.src_index, src_rows),
        ("dst", p.dst_index, dst_rows),
    ] {
        match index {
            Some(ix) if ix.len() != p.n => {
                return Err(Error::Length {
                    what: format!("copy_rows: {name} indices for the rows copied"),
                    got: ix.len(),
                    expected: p.n,
                });
            }
            Some(ix) if ix.max().is_some_and(|m| m as usize >= rows) => {
                return Err(Error::IndexOutOfRange {
                    what: format!("copy_rows: {name} row"),
                    index: ix.max().map_or(0, |m| m as usize),
                    len: rows,
                });
            }
            None if p.n > rows => {
                return Err(Error::TooFew {
                    what: format!("copy_rows: rows the {name} view holds for the rows copied"),
                    got: rows,
                    need: p.n,
                });
            }
            _ => {}
        }
    }
    if p.dst_index.is_some_and(|ix| !ix.is_distinct()) {
        return Err(Error::Conflict {
            what: "copy_rows: repeated destination indices".into(),
            with: "a parallel copy (two writes of one row would race)".into(),
        });
    }
    // the rows the kernel may address: those the indices reach (every view byte is then in use)
    let cap = |rows: usize, ix: Option<&RowIndex>| -> u64 {
        match ix {
            Some(ix) => ix.max().map_or(0, |m| u64::from(m) + 1),
            None => p.n as u64,
        }
        .min(rows as u64)
    };
    let params = CopyRowsParams {
        n: p.n as u64,
        width: p.width as u64,
        src_stride: p.src_stride as u64,
        dst_stride: p.dst_stride as u64,
        src_rows: cap(src_rows, p.src_index),
        dst_rows: cap(dst_rows, p.dst_index),
    };
    fn index<'i>(ix: Option<&'i RowIndex>) -> Option<Operand<'i>> {
        ix.map(|ix| Operand::input(ix.buffer(), DType::U32))
    }
    let ops = [
        Some(Operand::input(src, DType::F32)),
        index(p.src_index),
        Some(Operand::new(dst, DType::F32)),
        index(p.dst_index),
    ];
    dev.launch(stream, &COPY_ROWS, &ops, bytemuck::bytes_of(&params))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_and_rows_agree() {
        assert_eq!(extent(0, 5, 3), Some(0));
        assert_eq!(extent(4, 5, 3), Some(18));
        for (len, stride, width) in [(18usize, 5usize, 3usize), (17, 5, 3), (2, 5, 3), (0, 1, 1)] {
            let r = rows_in(len, stride, width);
            assert!(extent(r as u64, stride as u64, width as u64).unwrap() <= len as u64);
            assert!(extent(r as u64 + 1, stride as u64, width as u64).unwrap() > len as u64);
        }
    }
}
