//! The process grid: data × pipeline × tensor parallelism over one [`Communicator`], every
//! group built once by [`Communicator::split`].

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};

/// How a tensor-parallel group splits its layers, and its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorMode {
    /// No tensor parallelism: tensor groups of one rank.
    None,
    /// Megatron's 1D split over `size` ranks.
    OneD {
        /// Ranks in the tensor group.
        size: usize,
    },
    /// SUMMA's 2D split over a `q`×`q` grid.
    TwoD {
        /// Side of the grid.
        q: usize,
    },
    /// Tesseract's 2.5D split: `depth` layers of a `q`×`q` grid.
    TwoHalfD {
        /// Side of each layer's grid.
        q: usize,
        /// Number of layers.
        depth: usize,
    },
    /// The 3D split over a `q`×`q`×`q` cube.
    ThreeD {
        /// Side of the cube.
        q: usize,
    },
}

impl TensorMode {
    /// Ranks in one tensor group: 1, `size`, q², q²·depth or q³ (saturating at `usize::MAX`).
    pub fn size(&self) -> usize {
        self.checked_size().unwrap_or(usize::MAX)
    }

    fn checked_size(&self) -> Option<usize> {
        match *self {
            TensorMode::None => Some(1),
            TensorMode::OneD { size } => Some(size),
            TensorMode::TwoD { q } => q.checked_mul(q),
            TensorMode::TwoHalfD { q, depth } => q.checked_mul(q)?.checked_mul(depth),
            TensorMode::ThreeD { q } => q.checked_mul(q)?.checked_mul(q),
        }
    }

    /// The scheme's name: `none`, `1D`, `2D`, `2.5D` or `3D`.
    fn scheme(&self) -> &'static str {
        match self {
            TensorMode::None => "none",
            TensorMode::OneD { .. } => "1D",
            TensorMode::TwoD { .. } => "2D",
            TensorMode::TwoHalfD { .. } => "2.5D",
            TensorMode::ThreeD { .. } => "3D",
        }
    }

    /// How the group size follows from the mode, for error messages.
    fn size_formula(&self) -> &'static str {
        match self {
            TensorMode::None => "1",
            TensorMode::OneD { .. } => "size",
            TensorMode::TwoD { .. } => "q²",
            TensorMode::TwoHalfD { .. } => "q²·d",
            TensorMode::ThreeD { .. } => "q³",
        }
    }

    fn has_zero(&self) -> bool {
        match *self {
            TensorMode::None => false,
            TensorMode::OneD { size } => size == 0,
            TensorMode::TwoD { q } | TensorMode::ThreeD { q } => q == 0,
            TensorMode::TwoHalfD { q, depth } => q == 0 || depth == 0,
        }
    }

    /// `[tag, a, b]`, the same on ranks with the same mode.
    fn code(&self) -> [i64; 3] {
        let i = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        match *self {
            TensorMode::None => [0, 0, 0],
            TensorMode::OneD { size } => [1, i(size), 0],
            TensorMode::TwoD { q } => [2, i(q), 0],
            TensorMode::TwoHalfD { q, depth } => [3, i(q), i(depth)],
            TensorMode::ThreeD { q } => [4, i(q), 0],
        }
    }
}

/// `none`, `1d:N`, `2d:Q`, `2.5d:QxD` or `3d:Q`: the form [`FromStr`] reads.
impl fmt::Display for TensorMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TensorMode::None => write!(f, "none"),
            TensorMode::OneD { size } => write!(f, "1d:{size}"),
            TensorMode::TwoD { q } => write!(f, "2d:{q}"),
            TensorMode::TwoHalfD { q, depth } => write!(f, "2.5d:{q}x{depth}"),
            TensorMode::ThreeD { q } => write!(f, "3d:{q}"),
        }
    }
}

/// Reads `none`, `1d:N`, `2d:Q`, `2.5d:QxD` or `3d:Q` (sizes at least 1); anything else is
/// [`Error::Parse`] quoting the input.
impl FromStr for TensorMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<TensorMode> {
        let bad = |why: &str| Error::Parse {
            what: "tensor mode",
            input: s.to_string(),
            expected: format!("none, 1d:N, 2d:Q, 2.5d:QxD or 3d:Q ({why})"),
        };
        let num = |t: &str| -> Result<usize> {
            match t.parse::<usize>() {
                Ok(0) => Err(bad("sizes must be at least 1")),
                Ok(v) if t.bytes().all(|b| b.is_ascii_digit()) => Ok(v),
                _ => Err(bad(&format!("{t:?} is not a size"))),
            }
        };
        if s == "none" {
            return Ok(TensorMode::None);
        }
        let Some((scheme, arg)) = s.split_once(':') else {
            return Err(bad("no scheme:size"));
        };
        match scheme {
            "1d" => Ok(TensorMode::OneD { size: num(arg)? }),
            "2d" => Ok(TensorMode::TwoD { q: num(arg)? }),
            "3d" => Ok(TensorMode::ThreeD { q: num(arg)? }),
            "2.5d" => {
                let (q, d) = arg.split_once('x').ok_or_else(|| bad("2.5d needs QxD"))?;
                Ok(TensorMode::TwoHalfD {
                    q: num(q)?,
                    depth: num(d)?,
                })
            }
            other => Err(bad(&format!("unknown scheme {other:?}"))),
        }
    }
}

/// The shape of a process grid: `data` × `pipeline` × `sequence` × tensor group ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GridSpec {
    /// Data-parallel replicas.
    pub data: usize,
    /// Pipeline stages.
    pub pipeline: usize,
    /// Sequence-parallel ranks (the positions of every sequence split over them; 1: none).
    pub sequence: usize,
    /// The tensor-parallel scheme and shape.
    pub tensor: TensorMode,
}

impl GridSpec {
    /// Ranks the grid needs: `data · pipeline · sequence · tensor.size()` (saturating at
    /// `usize::MAX`).
    pub fn world(&self) -> usize {
        self.checked_world().unwrap_or(usize::MAX)
    }

    fn checked_world(&self) -> Option<usize> {
        self.data
            .checked_mul(self.pipeline)?
            .checked_mul(self.sequence)?
            .checked_mul(self.tensor.checked_size()?)
    }

    /// Everything that can be wrong with the spec on a communicator of `world` ranks; every
    /// rank knows both, so every rank decides the same way without communicating.
    fn check(&self, world: usize) -> Result<()> {
        if self.data == 0 || self.pipeline == 0 || self.sequence == 0 || self.tensor.has_zero() {
            return Err(Error::TooFew {
                what: format!(
                    "the smallest grid size of data {} × pipeline {} × sequence {} × {}",
                    self.data, self.pipeline, self.sequence, self.tensor
                ),
                got: 0,
                need: 1,
            });
        }
        let need = self.checked_world().ok_or_else(|| Error::Overflow {
            what: format!("the ranks (usize) of grid {self}"),
        })?;
        if need != world {
            let seq = if self.sequence == 1 {
                String::new()
            } else {
                format!(" × sequence {}", self.sequence)
            };
            return Err(Error::Length {
                what: format!(
                    "ranks of the communicator: {} needs {} = {} rank{} per tensor group × data \
                     {} × pipeline {}{seq} = {need}",
                    self.tensor,
                    self.tensor.size_formula(),
                    self.tensor.size(),
                    if self.tensor.size() == 1 { "" } else { "s" },
                    self.data,
                    self.pipeline,
                ),
                got: world,
                expected: need,
            });
        }
        if u32::try_from(world).map_or(true, |w| w == u32::MAX) {
            return Err(Error::TooLarge {
                what: format!("ranks of grid {self} (the split colors are u32)"),
                requested: world as u128,
                limit: u64::from(u32::MAX) - 1,
            });
        }
        Ok(())
    }
}

/// `data D × pipeline P × MODE`, with `× sequence S` before the mode when `S > 1`.
impl fmt::Display for GridSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "data {} × pipeline {}", self.data, self.pipeline)?;
        if self.sequence != 1 {
            write!(f, " × sequence {}", self.sequence)?;
        }
        write!(f, " × {}", self.tensor)
    }
}

/// The scheme's own groups and this rank's coordinates in them: `None` where the scheme has
/// no such group or coordinate.
#[derive(Default)]
struct Scheme {
    q: Option<usize>,
    depth: Option<usize>,
    row_index: Option<usize>,
    col_index: Option<usize>,
    dep_index: Option<usize>,
    ijk: Option<[usize; 3]>,
    row: Option<Communicator>,
    col: Option<Communicator>,
    dep: Option<Communicator>,
    xz: Option<Communicator>,
    input: Option<Communicator>,
    weight: Option<Communicator>,
    output: Option<Communicator>,
    plane: Option<Communicator>,
}

/// One rank's place in a data × pipeline × tensor grid, with a communicator for each of its
/// groups.
///
/// Global ranks are laid out tensor index innermost, then sequence:
/// `rank = dp·(P·S·T) + pp·(S·T) + sp·T + t` for data rank `dp`, pipeline rank `pp`,
/// sequence rank `sp`, tensor rank `t`, `P` pipeline stages, `S` sequence ranks and
/// `T = tensor.size()` ranks per tensor group. Each group's ranks are
/// ordered as each accessor states. Groups the grid's scheme does not have (say
/// [`row`](Self::row) on a 1D grid) and their coordinates are [`Error::Conflict`]
/// naming the scheme, so a layer's constructor can `?` them.
///
/// ```
/// use tidemem::comm::Communicator;
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::parallel::{GridSpec, ProcessGrid, TensorMode};
/// # fn main() -> tidemem::Result<()> {
/// let devices = (0..4)
///     .map(|_| Device::sim(SimConfig::with_capacity(1 << 20)))
///     .collect::<tidemem::Result<Vec<_>>>()?;
/// let comms = Communicator::local(devices)?;
/// let spec = GridSpec { data: 1, pipeline: 1, sequence: 1, tensor: "2d:2".parse::<TensorMode>()? };
/// let places = std::thread::scope(|s| {
///     let handles: Vec<_> = comms
///         .iter()
///         .map(|c| {
///             s.spawn(move || -> tidemem::Result<(usize, usize, usize)> {
///                 let grid = ProcessGrid::new(c, spec)?;
///                 // the row group holds this rank's row, ranked by column
///                 assert_eq!(grid.row()?.rank(), grid.col_index()?);
///                 Ok((grid.tensor_rank(), grid.row_index()?, grid.col_index()?))
///             })
///         })
///         .collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
/// });
/// for p in places {
///     let (t, row, col) = p?;
///     println!("rank {t}: row {row}, col {col}");
///     assert_eq!(t, row * 2 + col);
/// }
/// # Ok(()) }
/// ```
///
/// A grid is a shared handle: cloning it is cheap and the clones run on the same groups (the
/// layouts of [`parallel`](crate::parallel) hold one).
#[derive(Clone)]
pub struct ProcessGrid {
    inner: Arc<Groups>,
}

/// A grid's place and groups.
struct Groups {
    spec: GridSpec,
    data_rank: usize,
    pipeline_rank: usize,
    sequence_rank: usize,
    tensor_rank: usize,
    data: Communicator,
    pipeline: Communicator,
    sequence: Communicator,
    replicas: Communicator,
    tensor: Arc<Communicator>,
    scheme: Scheme,
}

impl fmt::Debug for ProcessGrid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGrid")
            .field("spec", &self.inner.spec)
            .field("data_rank", &self.inner.data_rank)
            .field("pipeline_rank", &self.inner.pipeline_rank)
            .field("sequence_rank", &self.inner.sequence_rank)
            .field("tensor_rank", &self.inner.tensor_rank)
            .finish()
    }
}

/// `comm.split` into the group of `color` ranked by `key`, checked to have `size` ranks with
/// this rank at `key`.
fn group(comm: &Communicator, color: usize, key: usize, size: usize) -> Result<Communicator> {
    let u = |v: usize| {
        u32::try_from(v).map_err(|_| Error::TooLarge {
            what: "a split color or key of a grid group".into(),
            requested: v as u128,
            limit: u64::from(u32::MAX),
        })
    };
    let g = comm
        .split(Some(u(color)?), u(key)?)?
        .ok_or_else(|| Error::Internal {
            what: "a grid's split left a member without a group".into(),
        })?;
    if g.world() != size || g.rank() != key {
        return Err(Error::Internal {
            what: format!(
                "grid group of color {color}: rank {} of {}, expected rank {key} of {size}",
                g.rank(),
                g.world()
            ),
        });
    }
    Ok(g)
}

impl ProcessGrid {
    /// This rank's grid over `comm`; every rank of `comm` must call it with the same `spec`.
    ///
    /// A spec with a zero size, or whose [`GridSpec::world`] is not `comm.world()`, is
    /// an error on every rank before any communication (every rank knows
    /// both). Then the ranks check that they passed the same spec (one small all-reduce: an
    /// error on every rank if not) and build every group with [`Communicator::split`], each
    /// rank splitting the same number of times in the same order: data, pipeline, sequence,
    /// replicas, tensor, then the scheme's groups (split from the tensor group).
    pub fn new(comm: &Communicator, spec: GridSpec) -> Result<ProcessGrid> {
        spec.check(comm.world())?;
        agree_on_spec(comm, &spec)?;
        let t_size = spec.tensor.size();
        let (p_size, s_size, d_size) = (spec.pipeline, spec.sequence, spec.data);
        let rank = comm.rank();
        let t = rank % t_size;
        let sp = rank / t_size % s_size;
        let pp = rank / (t_size * s_size) % p_size;
        let dp = rank / (t_size * s_size * p_size);
        let data = group(comm, (pp * s_size + sp) * t_size + t, dp, d_size)?;
        let pipeline = group(comm, (dp * s_size + sp) * t_size + t, pp, p_size)?;
        let sequence = group(comm, (dp * p_size + pp) * t_size + t, sp, s_size)?;
        let replicas = group(comm, pp * t_size + t, dp * s_size + sp, d_size * s_size)?;
        let tensor = group(comm, (dp * p_size + pp) * s_size + sp, t, t_size)?;
        let scheme = Self::scheme_groups(&tensor, spec.tensor, t)?;
        let tensor = Arc::new(tensor);
        Ok(ProcessGrid {
            inner: Arc::new(Groups {
                spec,
                data_rank: dp,
                pipeline_rank: pp,
                sequence_rank: sp,
                tensor_rank: t,
                data,
                pipeline,
                sequence,
                replicas,
                tensor,
                scheme,
            }),
        })
    }

    /// The scheme's groups, split from the tensor group `tc` where this rank is `t`.
    fn scheme_groups(tc: &Communicator, mode: TensorMode, t: usize) -> Result<Scheme> {
        Ok(match mode {
            TensorMode::None | TensorMode::OneD { .. } => Scheme::default(),
            TensorMode::TwoD { q } => {
                let (row, col) = (t / q, t % q);
                Scheme {
                    q: Some(q),
                    row_index: Some(row),
                    col_index: Some(col),
                    row: Some(group(tc, row, col, q)?),
                    col: Some(group(tc, col, row, q)?),
                    ..Scheme::default()
                }
            }
            TensorMode::TwoHalfD { q, depth } => {
                let (col, row, dep) = (t % q, t / q % q, t / (q * q));
                Scheme {
                    q: Some(q),
                    depth: Some(depth),
                    row_index: Some(row),
                    col_index: Some(col),
                    dep_index: Some(dep),
                    row: Some(group(tc, dep * q + row, col, q)?),
                    col: Some(group(tc, dep * q + col, row, q)?),
                    dep: Some(group(tc, row * q + col, dep, depth)?),
                    xz: Some(group(tc, col, row + q * dep, q * depth)?),
                    ..Scheme::default()
                }
            }
            TensorMode::ThreeD { q } => {
                let (i, j, k) = (t % q, t / q % q, t / (q * q));
                Scheme {
                    q: Some(q),
                    ijk: Some([i, j, k]),
                    input: Some(group(tc, i + q * k, j, q)?),
                    weight: Some(group(tc, j + q * k, i, q)?),
                    output: Some(group(tc, i + q * j, k, q)?),
                    plane: Some(group(tc, j, i + q * k, q * q)?),
                    ..Scheme::default()
                }
            }
        })
    }

    /// The spec the grid was built from.
    pub fn spec(&self) -> GridSpec {
        self.inner.spec
    }

    /// This rank's index in its data-parallel group (`dp`).
    pub fn data_rank(&self) -> usize {
        self.inner.data_rank
    }

    /// This rank's index in its pipeline group (`pp`, its stage).
    pub fn pipeline_rank(&self) -> usize {
        self.inner.pipeline_rank
    }

    /// This rank's index in its tensor group (`t`).
    pub fn tensor_rank(&self) -> usize {
        self.inner.tensor_rank
    }

    /// This rank's index in its sequence group (`sp`: it holds block `sp` of every
    /// sequence's positions).
    pub fn sequence_rank(&self) -> usize {
        self.inner.sequence_rank
    }

    /// The ranks with this rank's data, pipeline and tensor ranks, ranked by sequence rank
    /// `sp` (`spec.sequence` ranks): the ring of sequence parallelism.
    pub fn sequence(&self) -> &Communicator {
        &self.inner.sequence
    }

    /// A communicator of its own over [`ProcessGrid::replicas`]' members, in its order, split
    /// from `comm` (the communicator the grid was built on; every rank of it must call this):
    /// for a store that takes its group by value, as a
    /// [`ZeroManager`](crate::zero::ZeroManager) does.
    pub fn split_replicas(&self, comm: &Communicator) -> Result<Communicator> {
        let (t, s) = (self.inner.spec.tensor.size(), self.inner.spec.sequence);
        let color = self.inner.pipeline_rank * t + self.inner.tensor_rank;
        let key = self.inner.data_rank * s + self.inner.sequence_rank;
        group(comm, color, key, self.inner.spec.data * s)
    }

    /// The ranks that hold the same parameter shards as this one (this rank's pipeline and
    /// tensor ranks), ranked by `dp·S + sp` (`spec.data · spec.sequence` ranks): each sees
    /// other samples or other positions, so their gradients are summed over this group (the
    /// group a [`ZeroManager`](crate::zero::ZeroManager) spans).
    pub fn replicas(&self) -> &Communicator {
        &self.inner.replicas
    }

    /// The ranks with this rank's pipeline, sequence and tensor ranks, ranked by data rank
    /// `dp` (`spec.data` ranks).
    pub fn data(&self) -> &Communicator {
        &self.inner.data
    }

    /// The ranks with this rank's data, sequence and tensor ranks, ranked by stage `pp`
    /// (`spec.pipeline` ranks).
    pub fn pipeline(&self) -> &Communicator {
        &self.inner.pipeline
    }

    /// The ranks with this rank's data, pipeline and sequence ranks, ranked by tensor rank `t`
    /// (`tensor.size()` consecutive global ranks; one rank for [`TensorMode::None`]). The
    /// 1D scheme's group.
    pub fn tensor(&self) -> &Arc<Communicator> {
        &self.inner.tensor
    }

    /// `v`, or the error saying `what` belongs to other `schemes`.
    fn need<T>(&self, v: Option<T>, what: &str, schemes: &str) -> Result<T> {
        v.ok_or_else(|| Error::Conflict {
            what: format!(
                "a grid's {what} (it belongs to the {schemes} scheme{})",
                if schemes.contains(' ') { "s" } else { "" }
            ),
            with: format!(
                "this grid's tensor mode {} ({})",
                self.inner.spec.tensor,
                self.inner.spec.tensor.scheme()
            ),
        })
    }

    /// Side `q` of the 2D grid, of each 2.5D layer, or of the 3D cube.
    pub fn q(&self) -> Result<usize> {
        self.need(self.inner.scheme.q, "q", "2D, 2.5D and 3D")
    }

    /// 2D and 2.5D: this rank's row (`t = row·q + col`, plus `q²·dep` in 2.5D).
    pub fn row_index(&self) -> Result<usize> {
        self.need(self.inner.scheme.row_index, "row_index", "2D and 2.5D")
    }

    /// 2D and 2.5D: this rank's column.
    pub fn col_index(&self) -> Result<usize> {
        self.need(self.inner.scheme.col_index, "col_index", "2D and 2.5D")
    }

    /// 2D and 2.5D: the `q` ranks of this rank's row (and depth layer), ranked by column:
    /// tensor ranks `row·q + c` (`+ q²·dep`) for `c` in `0..q`.
    pub fn row(&self) -> Result<&Communicator> {
        self.need(self.inner.scheme.row.as_ref(), "row", "2D and 2.5D")
    }

    /// 2D and 2.5D: the `q` ranks of this rank's column (and depth layer), ranked by row:
    /// tensor ranks `r·q + col` (`+ q²·dep`) for `r` in `0..q`.
    pub fn col(&self) -> Result<&Communicator> {
        self.need(self.inner.scheme.col.as_ref(), "col", "2D and 2.5D")
    }

    /// 2.5D: this rank's depth layer (`t = col + q·row + q²·dep`).
    pub fn dep_index(&self) -> Result<usize> {
        self.need(self.inner.scheme.dep_index, "dep_index", "2.5D")
    }

    /// 2.5D: the number of depth layers `d`.
    pub fn depth(&self) -> Result<usize> {
        self.need(self.inner.scheme.depth, "depth", "2.5D")
    }

    /// 2.5D: the `d` ranks at this rank's row and column, ranked by depth: tensor ranks
    /// `col + q·row + q²·k` for `k` in `0..d`.
    pub fn dep(&self) -> Result<&Communicator> {
        self.need(self.inner.scheme.dep.as_ref(), "dep", "2.5D")
    }

    /// 2.5D: the `q·d` ranks of this rank's column over all depth layers, ranked by
    /// `row + q·dep` (which is each rank's block of the batch): tensor ranks
    /// `col + q·r + q²·k` at local rank `r + q·k`.
    pub fn xz(&self) -> Result<&Communicator> {
        self.need(self.inner.scheme.xz.as_ref(), "xz", "2.5D")
    }

    /// 3D: this rank's `i` (`t = i + q·j + q²·k`).
    pub fn i(&self) -> Result<usize> {
        self.need(self.inner.scheme.ijk.map(|c| c[0]), "i", "3D")
    }

    /// 3D: this rank's `j`.
    pub fn j(&self) -> Result<usize> {
        self.need(self.inner.scheme.ijk.map(|c| c[1]), "j", "3D")
    }

    /// 3D: this rank's `k`.
    pub fn k(&self) -> Result<usize> {
        self.need(self.inner.scheme.ijk.map(|c| c[2]), "k", "3D")
    }

    /// 3D: the `q` ranks with this rank's `i` and `k`, ranked by `j`: tensor ranks
    /// `i + q·j' + q²·k` for `j'` in `0..q`.
    pub fn input(&self) -> Result<&Communicator> {
        self.need(self.inner.scheme.input.as_ref(), "input", "3D")
    }

    /// 3D: the `q` ranks with this rank's `j` and `k`, ranked by `i`: tensor ranks
    /// `i' + q·j + q²·k` for `i'` in `0..q`.
    pub fn weight(&self) -> Result<&Communicator> {
        self.need(self.inner.scheme.weight.as_ref(), "weight", "3D")
    }

    /// 3D: the `q` ranks with this rank's `i` and `j`, ranked by `k`: tensor ranks
    /// `i + q·j + q²·k'` for `k'` in `0..q`.
    pub fn output(&self) -> Result<&Communicator> {
        self.need(self.inner.scheme.output.as_ref(), "output", "3D")
    }

    /// 3D: the output × weight plane, the `q²` ranks with this rank's `j`, ranked by
    /// `i + q·k`: tensor ranks `i' + q·j + q²·k'` at local rank `i' + q·k'`.
    pub fn plane(&self) -> Result<&Communicator> {
        self.need(self.inner.scheme.plane.as_ref(), "plane", "3D")
    }
}

/// One all-reduce of the spec's fields and their negations (MAX gives each field's maximum and
/// minimum): every rank learns whether all passed the same spec.
fn agree_on_spec(comm: &Communicator, spec: &GridSpec) -> Result<()> {
    let i = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
    let [tag, a, b] = spec.tensor.code();
    let fields = [i(spec.data), i(spec.pipeline), i(spec.sequence), tag, a, b];
    const N: usize = 6;
    let mut both = [0i64; 2 * N];
    for (n, f) in fields.iter().enumerate() {
        both[n] = *f;
        both[n + N] = -*f;
    }
    comm.all_reduce_host(&mut both, ReduceOp::Max)?;
    if (0..N).any(|n| both[n] != -both[n + N]) {
        return Err(Error::Conflict {
            what: format!("this rank's grid spec {spec}"),
            with: "the other ranks' (every rank must pass the same spec)".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_saturate_and_codes_differ() {
        assert_eq!(TensorMode::ThreeD { q: usize::MAX }.size(), usize::MAX);
        let (a, b) = (TensorMode::OneD { size: 4 }, TensorMode::TwoD { q: 2 });
        assert_eq!(a.size(), b.size());
        assert_ne!(a.code(), b.code());
    }

    #[test]
    fn spec_checks_sizes_and_world() {
        let spec = GridSpec {
            data: 1,
            pipeline: 1,
            sequence: 1,
            tensor: TensorMode::TwoHalfD { q: 2, depth: 2 },
        };
        assert_eq!(spec.world(), 8);
        assert!(spec.check(8).is_ok());
        let e = spec.check(6).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Length {
                    got: 6,
                    expected: 8,
                    ..
                }
            ),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(
            e.contains(
                "2.5d:2x2 needs q²·d = 8 ranks per tensor group × data 1 × pipeline 1 = 8: 6 \
                 given, 8 expected"
            ),
            "{e}"
        );
        let zero = GridSpec { data: 0, ..spec };
        assert!(matches!(
            zero.check(0),
            Err(Error::TooFew {
                got: 0,
                need: 1,
                ..
            })
        ));
        let huge = GridSpec {
            data: usize::MAX,
            pipeline: 2,
            sequence: 1,
            tensor: TensorMode::None,
        };
        let e = huge.check(usize::MAX).unwrap_err();
        assert!(matches!(e, Error::Overflow { .. }), "{e:?}");
        assert!(e.to_string().contains("overflows"));
        let big = GridSpec {
            data: u32::MAX as usize,
            ..huge
        };
        assert!(matches!(
            GridSpec { pipeline: 1, ..big }.check(u32::MAX as usize),
            Err(Error::TooLarge { .. })
        ));
    }
}
