mod twin;

use crate::device::kernel::{param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
};
use crate::dtype::DType;
use crate::error::{Error, Result};

abi! {
    /// The parameters of `kernels/interaction.cu` (`interaction.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct InteractionParams {
        /// Samples.
        pub batch: u64,
        /// Sparse features: each sample stacks `features + 1` rows.
        pub features: u64,
        /// Values per row.
        pub dim: u64,
    }
}

/// The most rows (`features + 1`) an interaction takes.
pub const MAX_INTERACTION_ROWS: usize = 1024;
/// The largest `dim` an interaction takes.
pub const MAX_INTERACTION_DIM: usize = 1 << 16;

/// The shape of a dot interaction: `dense` is `[batch, dim]`, `emb` `[batch, features, dim]`,
/// the output `[batch, out_width()]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct InteractionShape {
    /// Samples.
    pub batch: usize,
    /// Sparse features (pooled embeddings per sample).
    pub features: usize,
    /// Values per vector.
    pub dim: usize,
}

impl InteractionShape {
    /// Rows of `T`: `features + 1`.
    pub const fn rows(&self) -> usize {
        self.features + 1
    }
    /// Interactions kept per sample: `n(n−1)/2` for `n` rows.
    pub const fn pairs(&self) -> usize {
        self.rows() * self.features / 2
    }
    /// Output values per sample: `dim + pairs()`.
    pub const fn out_width(&self) -> usize {
        self.dim + self.pairs()
    }
    abi! {
        /// The kernel parameters.
        fn params(&self) -> InteractionParams {
            InteractionParams {
                batch: self.batch as u64,
                features: self.features as u64,
                dim: self.dim as u64,
            }
        }
    }

    /// The shape of `p`, if within the limits ([`MAX_INTERACTION_ROWS`],
    /// [`MAX_INTERACTION_DIM`]) and every operand's length fits a `usize`.
    fn of(desc: &KernelDesc, p: &InteractionParams) -> Result<Self> {
        let big = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let s = InteractionShape {
            batch: big(p.batch),
            features: big(p.features),
            dim: big(p.dim),
        };
        if s.features >= MAX_INTERACTION_ROWS || s.dim > MAX_INTERACTION_DIM {
            return Err(desc.error(format!(
                "[batch, features, dim] = [{}, {}, {}]: at most {} features and dim {}",
                p.batch,
                p.features,
                p.dim,
                MAX_INTERACTION_ROWS - 1,
                MAX_INTERACTION_DIM
            )));
        }
        if s.lens(true).is_none() {
            return Err(desc.error(format!(
                "[batch, features, dim] = [{}, {}, {}] overflows",
                p.batch, p.features, p.dim
            )));
        }
        Ok(s)
    }

    /// Elements of each operand, in signature order (forward: dense, emb, out; backward: dense,
    /// emb, dout, d_dense, d_emb); `None` on overflow.
    fn lens(&self, backward: bool) -> Option<Vec<usize>> {
        let dense = self.batch.checked_mul(self.dim)?;
        let emb = dense.checked_mul(self.features)?;
        let out = self.batch.checked_mul(self.out_width())?;
        Some(if backward {
            vec![dense, emb, out, dense, emb]
        } else {
            vec![dense, emb, out]
        })
    }

    /// Each operand's shape, as error messages name it.
    fn dims(&self, i: usize) -> String {
        let (b, f, d, w) = (self.batch, self.features, self.dim, self.out_width());
        match i {
            0 | 3 => format!("[{b}, {d}]"),
            1 | 4 => format!("[{b}, {f}, {d}]"),
            _ => format!("[{b}, {w}]"),
        }
    }
}

const FLOATS: &[DType] = &DType::FLOATS;

abi! {
    /// Dot interaction forward: `dense` `[B, D]` and `emb` `[B, F, D]` read, `out`
    /// `[B, D + (F+1)F/2]` written; one element type.
    static INTERACTION_FORWARD: KernelDesc = KernelDesc {
        name: "interaction_forward",
        operands: &[
            OperandSpec::read("dense", FLOATS),
            OperandSpec::read("emb", FLOATS),
            OperandSpec::write("out", FLOATS),
        ],
        params: param_layout!(InteractionParams, "interaction.cuh", [batch, features, dim]),
        check: Some(check),
        twin: twin::forward_twin,
        cuda: CudaSide::Nvrtc {
            source: "interaction.cu",
            plan: |info| plan(info, false),
        },
    };
}

abi! {
    /// Dot interaction backward: `dense`, `emb` and `dout` read, `d_dense` and `d_emb` written; one
    /// element type.
    static INTERACTION_BACKWARD: KernelDesc = KernelDesc {
        name: "interaction_backward",
        operands: &[
            OperandSpec::read("dense", FLOATS),
            OperandSpec::read("emb", FLOATS),
            OperandSpec::read("dout", FLOATS),
            OperandSpec::write("d_dense", FLOATS),
            OperandSpec::write("d_emb", FLOATS),
        ],
        params: param_layout!(InteractionParams, "interaction.cuh", [batch, features, dim]),
        check: Some(check),
        twin: twin::backward_twin,
        cuda: CudaSide::Nvrtc {
            source: "interaction.cu",
            plan: |info| plan(info, true),
        },
    };
}

/// The shape check, on what a launch or a twin run knows: each operand's element type and
/// length. Every operand must be of one type and hold exactly its shape.
fn check_operands(
    desc: &'static KernelDesc,
    p: &InteractionParams,
    operand: impl Fn(usize) -> (Option<DType>, usize),
) -> Result<InteractionShape> {
    let s = InteractionShape::of(desc, p)?;
    let backward = desc.operands.len() == 5;
    let lens = s.lens(backward).unwrap_or_default();
    let d0 = operand(0).0;
    for (i, (spec, want)) in desc.operands.iter().zip(lens).enumerate() {
        let (d, len) = operand(i);
        let name = |d: Option<DType>| d.map_or("?", |d| d.name());
        if d != d0 {
            return Err(desc.error(format!(
                "operand `{}` is {}, `{}` is {}: every operand holds one element type",
                spec.name,
                name(d),
                desc.operands[0].name,
                name(d0)
            )));
        }
        if len != want {
            return Err(desc.error(format!(
                "operand `{}` holds {len} {} elements; shape {} ([batch, features, dim] = \
                 [{}, {}, {}]) needs {want}",
                spec.name,
                name(d),
                s.dims(i),
                s.batch,
                s.features,
                s.dim
            )));
        }
    }
    Ok(s)
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: InteractionParams = info.params()?;
    check_operands(info.desc, &p, |i| (info.dtype(i), info.len(i))).map(|_| ())
}

/// Dynamic shared memory a block may use (the default limit of every CUDA device).
const SHARED_LIMIT: usize = 48 * 1024;
/// Threads per block.
const THREADS: u32 = 256;

fn plan(info: &LaunchInfo<'_>, backward: bool) -> Result<Vec<Grid>> {
    let p: InteractionParams = info.params()?;
    let s = InteractionShape::of(info.desc, &p)?;
    let (n, d) = (s.rows(), s.dim);
    let written = if backward {
        s.batch * n * d
    } else {
        s.batch * s.out_width()
    };
    if written == 0 {
        return Ok(vec![]);
    }
    let staged = 4 * if backward { n * n + n * d } else { n * (d + 1) };
    let (place, shared) = if staged <= SHARED_LIMIT {
        ("shared", staged as u32)
    } else {
        ("global", 0)
    };
    let t = info.dtype(0).map_or("?", |d| d.name());
    let dir = if backward { "backward" } else { "forward" };
    let blocks = s.batch.min(65_535) as u32;
    Ok(vec![Grid::linear(
        format!("interaction_{dir}_{t}_{place}"),
        blocks,
        THREADS,
    )
    .shared(shared)])
}

/// A shape whose byte sizes overflow, refused before the launch computes with it.
fn shape_error(desc: &KernelDesc, shape: InteractionShape) -> Error {
    desc.error(format!(
        "[batch, features, dim] = [{}, {}, {}] overflows",
        shape.batch, shape.features, shape.dim
    ))
}

/// DLRM's dot interaction, forward ([`interaction_forward`]) and backward
/// ([`interaction_backward`]), on f32, f16 or bf16 storage with f32 math.
///
/// Per sample: the dense vector `x` (`dense[s]`, the bottom MLP's output, `dim` values) and the
/// `features` pooled embeddings (`emb[s]`, each `dim` values) stack into `T`, `n = features + 1`
/// rows with `x` first; `Z = T·Tᵀ`; the output row is `x` followed by the strict lower triangle
/// of `Z` in row-major order, `Z[1][0], Z[2][0], Z[2][1], Z[3][0], …` (`Z[i][j]` at position
/// `dim + i(i−1)/2 + j`): the order of facebookresearch/dlrm's `interact_features` with
/// `arch_interaction_op = "dot"` and `arch_interaction_itself = False`, so a layer trained there
/// reads the same columns. [`InteractionShape::out_width`] is `dim + n(n−1)/2` (367 for Criteo's
/// 26 features at `dim` 16).
///
/// Backward: with `dZ` the strict lower triangle of `dout` and `G = dZ + dZᵀ` (zero diagonal),
/// `dT = G·T`; `d_dense = dout[..dim] + dT[0]` and `d_emb[f] = dT[1 + f]`.
///
/// Numerics: every `Z[i][j]` is one chain of fused multiply-adds in f32 over `d = 0, 1, …` from
/// 0, every `dT[k][c]` one chain over `m = 0, 1, …, n−1` (the diagonal included, as a
/// multiplication by `G[k][k] = 0`) from `dout[c]` for `k = 0` and from 0 otherwise. The CUDA
/// kernels (`kernels/interaction.cu`, one block per sample) and the CPU twin run exactly these
/// chains (an fma is correctly rounded on both), so they agree bit for bit. As in a batched
/// matrix product's backward (PyTorch's `bmm`), an infinite or NaN value in row `k` of `T`
/// makes `dT[k]` NaN through that zero.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::ops::{interaction_forward, InteractionShape};
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// // One sample, two features, dim 2: T = [[1, 2], [3, 4], [5, 6]].
/// let shape = InteractionShape { batch: 1, features: 2, dim: 2 };
/// let dense = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 2.0]))?;
/// let emb = dev.upload(&s, bytemuck::cast_slice(&[3.0f32, 4.0, 5.0, 6.0]))?;
/// let out = dev.alloc(shape.out_width() * 4)?;
/// interaction_forward(&dev, &s, &dense, &emb, &out, shape, DType::F32)?;
/// let out: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &out)?);
/// // x, then Z[1][0], Z[2][0], Z[2][1].
/// assert_eq!(out, [1.0, 2.0, 11.0, 17.0, 39.0]);
/// # Ok(()) }
/// ```
///
/// DLRM's dot interaction on `stream` (see [`interaction_forward`]): `out[s] = dense[s]` followed by
/// the strict lower triangle of `T·Tᵀ`, `T` stacking `dense[s]` and `emb[s]`. `dense` is
/// `[batch, dim]`, `emb` `[batch, features, dim]`, `out` `[batch, shape.out_width()]`, all of
/// `dtype` (f32, f16 or bf16; f32 math). A wrong length, type or an overlap of `out` with an
/// input is an error, and nothing is written.
pub fn interaction_forward<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    dense: impl Into<Input<'a>>,
    emb: impl Into<Input<'b>>,
    out: impl Into<DeviceView<'c>>,
    shape: InteractionShape,
    dtype: DType,
) -> Result<()> {
    shape
        .lens(false)
        .ok_or_else(|| shape_error(&INTERACTION_FORWARD, shape))?;
    let ops = [
        Some(Operand::input(dense, dtype)),
        Some(Operand::input(emb, dtype)),
        Some(Operand::new(out, dtype)),
    ];
    let p = shape.params();
    dev.launch(stream, &INTERACTION_FORWARD, &ops, bytemuck::bytes_of(&p))
}

/// The gradients of [`interaction_forward`] on `stream`: from `dout` (`[batch,
/// shape.out_width()]`) and the forward's inputs, `d_dense` (`[batch, dim]`: the pass-through
/// part of `dout` plus the interactions' share) and `d_emb` (`[batch, features, dim]`), all of
/// `dtype`. Both are overwritten (not accumulated into); neither may overlap another operand.
/// A wrong length, type or overlap is an error, and nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn interaction_backward<'a, 'b, 'c, 'd, 'e>(
    dev: &Device,
    stream: &Stream,
    dense: impl Into<Input<'a>>,
    emb: impl Into<Input<'b>>,
    dout: impl Into<Input<'c>>,
    d_dense: impl Into<DeviceView<'d>>,
    d_emb: impl Into<DeviceView<'e>>,
    shape: InteractionShape,
    dtype: DType,
) -> Result<()> {
    shape
        .lens(true)
        .ok_or_else(|| shape_error(&INTERACTION_BACKWARD, shape))?;
    let ops = [
        Some(Operand::input(dense, dtype)),
        Some(Operand::input(emb, dtype)),
        Some(Operand::input(dout, dtype)),
        Some(Operand::new(d_dense, dtype)),
        Some(Operand::new(d_emb, dtype)),
    ];
    let p = shape.params();
    dev.launch(stream, &INTERACTION_BACKWARD, &ops, bytemuck::bytes_of(&p))
}
