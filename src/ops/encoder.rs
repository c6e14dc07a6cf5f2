use crate::device::kernel::{grid_stride, param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::embedding::device::embedding_threads;
use crate::ops::embedding::{plan_backward, BagMode};
use crate::ops::float::{simd, with_float, Float};
use crate::ops::rows::{expect, expect_with};

abi! {
    /// The parameters of `encoder_forward` (`encoder.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct EncoderParams {
        /// Positions (`B·T`).
        pub n: u64,
        /// Sequence length `T`.
        pub t: u64,
        /// Channels `C`.
        pub c: u64,
        /// Vocabulary `V` (rows of `wte`).
        pub v: u64,
        /// Rows of `wpe` (`maxT ≥ T`).
        pub max_t: u64,
    }
}

abi! {
    /// The parameters of `encoder_backward` (`encoder.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct EncoderBackwardParams {
        /// Positions (`B·T`).
        pub n: u64,
        /// Sequence length `T`.
        pub t: u64,
        /// Channels `C`.
        pub c: u64,
        /// Vocabulary `V` (rows of `dwte`).
        pub v: u64,
        /// Rows of `dwpe`.
        pub max_t: u64,
        /// Distinct tokens of the plan (`U`).
        pub distinct: u64,
    }
}

/// The shape of an encoder launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncoderShape {
    /// `B`: sequences.
    pub batch: usize,
    /// `T ≥ 1`: positions per sequence.
    pub seq: usize,
    /// `C ≥ 1`: channels.
    pub channels: usize,
    /// `V`: rows of `wte`.
    pub vocab: usize,
    /// `maxT ≥ T`: rows of `wpe`.
    pub max_seq: usize,
}

const FLOATS: &[DType] = &DType::FLOATS;
const INDEX: &[DType] = &[DType::U32];

abi! {
    /// Encoder forward: tokens, `wte`, `wpe` read; `out` written.
    static ENCODER_FORWARD: KernelDesc = KernelDesc {
        name: "encoder_forward",
        operands: &[
            OperandSpec::read("tokens", &[DType::I32]),
            OperandSpec::read("wte", FLOATS),
            OperandSpec::read("wpe", FLOATS),
            OperandSpec::write("out", FLOATS),
        ],
        params: param_layout!(EncoderParams, "encoder.cuh", [n, t, c, v, max_t]),
        check: Some(check_forward),
        twin: |a| with_float!(a.dtype(1).unwrap_or(DType::F32), T => forward_typed::<T>(a)),
        cuda: CudaSide::Nvrtc {
            source: "encoder.cu",
            plan: plan_forward,
        },
    };
}

abi! {
    /// Encoder backward: `dout` and the plan (u32 words, see [`EncoderPlan::to_words`]) read;
    /// `dwte` and `dwpe` read and written (accumulated into).
    static ENCODER_BACKWARD: KernelDesc = KernelDesc {
        name: "encoder_backward",
        operands: &[
            OperandSpec::read("dout", FLOATS),
            OperandSpec::read("plan", INDEX),
            OperandSpec::read_write("dwte", FLOATS),
            OperandSpec::read_write("dwpe", FLOATS),
        ],
        params: param_layout!(
            EncoderBackwardParams,
            "encoder.cuh",
            [n, t, c, v, max_t, distinct]
        ),
        check: Some(check_backward),
        twin: |a| with_float!(a.dtype(0).unwrap_or(DType::F32), T => backward_typed::<T>(a)),
        cuda: CudaSide::Nvrtc {
            source: "encoder.cu",
            plan: plan_backward_grids,
        },
    };
}

/// `a·b` as a length, or `usize::MAX` on overflow (never an operand's length).
fn mul(a: u64, b: u64) -> usize {
    usize::try_from(a.saturating_mul(b)).unwrap_or(usize::MAX)
}

/// The shape rules both ops share: `T ≥ 1`, `C ≥ 1`, `T ≤ maxT`, `B·T` positions.
fn check_shape(info: &LaunchInfo<'_>, n: u64, t: u64, c: u64, max_t: u64) -> Result<()> {
    if t == 0 || c == 0 || t > max_t || !n.is_multiple_of(t) {
        return Err(info.desc.error(format!(
            "the shape needs T ≥ 1, C ≥ 1, T ≤ maxT and B·T positions, got {n} positions, T = \
             {t}, C = {c}, maxT = {max_t}"
        )));
    }
    Ok(())
}

/// Operand `i` holds `want` elements of `d`, the op's one float type.
fn expect_float(info: &LaunchInfo<'_>, i: usize, shape: &str, want: usize, d: DType) -> Result<()> {
    expect_with(info, i, want, d, || {
        format!("it must hold {shape} = {want} {d} elements (one float type)")
    })
}

fn check_forward(info: &LaunchInfo<'_>) -> Result<()> {
    let p: EncoderParams = info.params()?;
    check_shape(info, p.n, p.t, p.c, p.max_t)?;
    let d = info.dtype(1).unwrap_or(DType::F32);
    expect(info, 0, "[B·T]", mul(p.n, 1), DType::I32)?;
    expect_float(info, 1, "[V, C]", mul(p.v, p.c), d)?;
    expect_float(info, 2, "[maxT, C]", mul(p.max_t, p.c), d)?;
    expect_float(info, 3, "[B·T, C]", mul(p.n, p.c), d)
}

fn check_backward(info: &LaunchInfo<'_>) -> Result<()> {
    let p: EncoderBackwardParams = info.params()?;
    check_shape(info, p.n, p.t, p.c, p.max_t)?;
    let d = info.dtype(0).unwrap_or(DType::F32);
    let words = mul(p.distinct, 2)
        .saturating_add(1)
        .saturating_add(mul(p.n, 1));
    expect_float(info, 0, "[B·T, C]", mul(p.n, p.c), d)?;
    expect(
        info,
        1,
        "2·distinct + 1 + B·T plan words",
        words,
        DType::U32,
    )?;
    expect_float(info, 2, "[V, C]", mul(p.v, p.c), d)?;
    expect_float(info, 3, "[maxT, C]", mul(p.max_t, p.c), d)
}

fn rows_grid(entry: String, rows: u64, c: u64) -> Vec<Grid> {
    if rows == 0 {
        return vec![];
    }
    let threads = embedding_threads(c as usize);
    vec![Grid::linear(entry, rows.min(65_535) as u32, threads)]
}

fn plan_forward(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let p: EncoderParams = info.params()?;
    let t = info.dtype(1).map_or("?", |d| d.name());
    Ok(rows_grid(format!("encoder_forward_{t}"), p.n, p.c))
}

fn plan_backward_grids(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let p: EncoderBackwardParams = info.params()?;
    let t = info.dtype(0).map_or("?", |d| d.name());
    let mut v = rows_grid(format!("encoder_backward_wte_{t}"), p.distinct, p.c);
    if p.n > 0 {
        let wpe = (p.t * p.c) as usize;
        v.extend(grid_stride(format!("encoder_backward_wpe_{t}"), wpe));
    }
    Ok(v)
}

/// The first position whose token is outside `0..vocab`.
fn bad_token(tokens: &[i32], vocab: usize) -> Option<usize> {
    tokens.iter().position(|&t| t < 0 || t as usize >= vocab)
}

fn token_error(tokens: &[i32], pos: usize, vocab: usize) -> String {
    format!(
        "token {} at position {pos} is outside 0..{vocab}",
        tokens[pos]
    )
}

fn forward_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: EncoderParams = a.params()?;
    let (n, t, c) = (p.n as usize, p.t as usize, p.c as usize);
    let tokens = a.read_as::<i32>(0)?;
    if let Some(pos) = bad_token(tokens, p.v as usize) {
        return Err(a.desc().error(token_error(tokens, pos, p.v as usize)));
    }
    let (wte, wpe) = (a.read_as::<T>(1)?, a.read_as::<T>(2)?);
    let out = a.take_as::<T>(3)?;
    let fit = tokens.len() == n
        && wte.len() as u64 == p.v * p.c
        && wpe.len() >= t * c
        && out.len() == n * c;
    if !fit || t == 0 || c == 0 {
        return Err(a.desc().error(format!("operands do not fit {p:?}")));
    }
    simd(
        #[inline(always)]
        || {
            for (pos, (o, &tok)) in out.chunks_exact_mut(c).zip(tokens).enumerate() {
                let e = &wte[tok as usize * c..][..c];
                let w = &wpe[(pos % t) * c..][..c];
                for ((o, &e), &w) in o.iter_mut().zip(e).zip(w) {
                    *o = T::put(e.get() + w.get());
                }
            }
        },
    );
    Ok(())
}

/// A plan's rows, row starts and entries.
type PlanParts<'a> = (&'a [u32], &'a [u32], &'a [u32]);

/// The plan's three arrays, checked: rows in `0..v` and distinct, row starts non-decreasing
/// and within the entries, entries in `0..n`. `Err` holds why not. (Also the layout of the
/// vocab-parallel embedding's plan, whose entries are fewer than the positions.)
pub(crate) fn split_plan(
    words: &[u32],
    distinct: usize,
    v: usize,
    n: usize,
) -> std::result::Result<PlanParts<'_>, String> {
    let (rows, rest) = words.split_at(distinct);
    let (row_ptr, entries) = rest.split_at(distinct + 1);
    let mut seen = vec![false; v];
    for (u, &r) in rows.iter().enumerate() {
        match seen.get_mut(r as usize) {
            None => return Err(format!("plan row {u} names token {r}, outside 0..{v}")),
            Some(true) => return Err(format!("plan row {u} repeats token {r}")),
            Some(s) => *s = true,
        }
    }
    let m = entries.len();
    if row_ptr.windows(2).any(|w| w[1] < w[0]) || row_ptr[distinct] as usize > m {
        return Err(format!(
            "plan row starts must not decrease and end at most at the {m} entries"
        ));
    }
    if let Some(e) = entries.iter().position(|&e| e as usize >= n) {
        return Err(format!(
            "plan entry {e} names position {}, outside 0..{n}",
            entries[e]
        ));
    }
    Ok((rows, row_ptr, entries))
}

fn backward_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: EncoderBackwardParams = a.params()?;
    let (n, t, c) = (p.n as usize, p.t as usize, p.c as usize);
    let words = a.read_as::<u32>(1)?;
    if words.len() as u64 != 2 * p.distinct + 1 + p.n {
        return Err(a.desc().error(format!("operands do not fit {p:?}")));
    }
    let (rows, row_ptr, entries) = split_plan(words, p.distinct as usize, p.v as usize, n)
        .map_err(|why| a.desc().error(why))?;
    let dout = a.read_as::<T>(0)?;
    let dwte = a.take_as::<T>(2)?;
    let dwpe = a.take_as::<T>(3)?;
    let fit = dout.len() == n * c && dwte.len() as u64 == p.v * p.c && dwpe.len() >= t * c;
    if !fit || t == 0 || c == 0 || !n.is_multiple_of(t) {
        return Err(a.desc().error(format!("operands do not fit {p:?}")));
    }
    let mut acc = vec![0f32; c];
    simd(
        #[inline(always)]
        || {
            for (u, &r) in rows.iter().enumerate() {
                acc.fill(0.0);
                for &pos in &entries[row_ptr[u] as usize..row_ptr[u + 1] as usize] {
                    add_row(&mut acc, &dout[pos as usize * c..][..c]);
                }
                store_sum(&mut dwte[r as usize * c..][..c], &acc);
            }
            for (tt, g) in dwpe.chunks_exact_mut(c).take(t).enumerate() {
                acc.fill(0.0);
                for b in 0..n / t {
                    add_row(&mut acc, &dout[(b * t + tt) * c..][..c]);
                }
                store_sum(g, &acc);
            }
        },
    );
    Ok(())
}

/// `acc += row` in f32.
#[inline(always)]
fn add_row<T: Float>(acc: &mut [f32], row: &[T]) {
    for (a, &x) in acc.iter_mut().zip(row) {
        *a += x.get();
    }
}

/// `g = g + acc`, rounded once to the storage type.
#[inline(always)]
fn store_sum<T: Float>(g: &mut [T], acc: &[f32]) {
    for (g, &a) in g.iter_mut().zip(acc) {
        *g = T::put(g.get() + a);
    }
}

/// The host side of the encoder backward: the positions of a batch grouped by token, from the
/// embedding bags' [`plan_backward`] (each position a bag of one). Its [words](Self::to_words)
/// go to the device; [`encoder_backward`] reads them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EncoderPlan {
    rows: Vec<u32>,
    row_ptr: Vec<u32>,
    entries: Vec<u32>,
}

impl EncoderPlan {
    /// The plan of `tokens` (`[B, T]`, row-major) over a vocabulary of `vocab`: a token
    /// outside `0..vocab` is an [`Error::TokenOutOfRange`].
    pub fn new(tokens: &[i32], vocab: usize) -> Result<Self> {
        if let Some(pos) = bad_token(tokens, vocab) {
            return Err(Error::TokenOutOfRange {
                token: tokens[pos].into(),
                position: pos,
                vocab,
            });
        }
        if tokens.len() >= u32::MAX as usize {
            return Err(Error::TooLarge {
                what: "positions of an encoder plan (u32 entries)".into(),
                requested: tokens.len() as u128,
                limit: u32::MAX as u64 - 1,
            });
        }
        let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
        let offsets: Vec<u32> = (0..=ids.len() as u32).collect();
        let plan = plan_backward(&ids, &offsets, None, BagMode::Sum)?;
        Ok(EncoderPlan {
            rows: plan.rows,
            row_ptr: plan.row_ptr,
            entries: plan.entries,
        })
    }

    /// Distinct tokens (`U`).
    pub fn distinct(&self) -> usize {
        self.rows.len()
    }

    /// Positions planned (`B·T`).
    pub(crate) fn positions(&self) -> usize {
        self.entries.len()
    }

    /// The distinct tokens, in first-occurrence order.
    pub fn rows(&self) -> &[u32] {
        &self.rows
    }

    /// `U + 1` starts into [`entries`](Self::entries): token `rows[u]` is at positions
    /// `entries[row_ptr[u]..row_ptr[u + 1]]`.
    pub fn row_ptr(&self) -> &[u32] {
        &self.row_ptr
    }

    /// The positions, grouped by token, in order within each group.
    pub fn entries(&self) -> &[u32] {
        &self.entries
    }

    /// Words of the device copy: `2·U + 1 + B·T`.
    pub fn words(&self) -> usize {
        self.rows.len() + self.row_ptr.len() + self.entries.len()
    }

    /// The device copy: rows, then row starts, then entries, as u32 words.
    pub fn to_words(&self) -> Vec<u32> {
        let mut w = Vec::with_capacity(self.words());
        w.extend_from_slice(&self.rows);
        w.extend_from_slice(&self.row_ptr);
        w.extend_from_slice(&self.entries);
        w
    }
}

fn checked_shape(desc: &KernelDesc, s: &EncoderShape) -> Result<(u64, u64)> {
    let n = s.batch.checked_mul(s.seq);
    let bound = |x: usize| {
        s.channels
            .checked_mul(x)
            .is_some_and(|e| e <= isize::MAX as usize)
    };
    match n {
        Some(n) if bound(n) && bound(s.vocab) && bound(s.max_seq) => Ok((n as u64, s.seq as u64)),
        _ => Err(desc.error(format!("{s:?} overflows"))),
    }
}

/// The GPT encoder: token plus position embedding. Forward ([`encoder_forward`]):
/// `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]` for tokens `[B, T]` (i32), `wte [V, C]`,
/// `wpe [maxT, C]`. Backward ([`encoder_backward`]): `dwte[v, :] += Σ dout[b, t, :]` over the
/// positions whose token is `v`, and `dwpe[t, :] += Σ_b dout[b, t, :]`, accumulated into the
/// gradients already there.
///
/// Storage f32, f16 or bf16, math in f32. The backward is **deterministic**: no atomics. The
/// token ids come from the data loader on the host, so the host sorts the positions by token
/// before upload — an [`EncoderPlan`], built by the embedding bags' plan
/// ([`plan_backward`], each position a bag of one): the
/// distinct tokens in first-occurrence order, and for each the positions that hold it, in
/// order. CUDA (`kernels/encoder.cu`) gives each distinct token one block, whose threads sum its
/// positions' rows column by column in plan order and add the sum to `dwte` once; `dwpe` is
/// summed over the batch in order, one thread per element. The CPU twins keep the same order, so
/// both agree bit for bit.
///
/// **Ids out of range.** A token outside `0..V` is a typed error of [`EncoderPlan::new`] and of
/// the simulated device (reported at the next synchronisation, nothing written). CUDA cannot
/// report it: the forward writes NaN over that position's row; a plan naming a row or position
/// out of range (not one [`EncoderPlan::new`] built) has those entries skipped. Nothing outside
/// the operands is ever read or written.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::ops::{EncoderPlan, EncoderShape};
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// // B = 1, T = 2, C = 1, V = 3, maxT = 2.
/// let shape = EncoderShape { batch: 1, seq: 2, channels: 1, vocab: 3, max_seq: 2 };
/// let tokens = [2i32, 2];
/// let tok = dev.upload(&s, bytemuck::cast_slice(&tokens))?;
/// let wte = dev.upload(&s, bytemuck::cast_slice(&[10.0f32, 20.0, 30.0]))?;
/// let wpe = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 2.0]))?;
/// let out = dev.alloc(8)?;
/// tidemem::ops::encoder_forward(&dev, &s, &tok, &wte, &wpe, &out, &shape, DType::F32)?;
/// let y: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &out)?);
/// assert_eq!(y, [31.0, 32.0]);
///
/// // Backward: the plan is built on the host from the same tokens.
/// let plan = EncoderPlan::new(&tokens, 3)?;
/// let plan_dev = dev.upload(&s, bytemuck::cast_slice(&plan.to_words()))?;
/// let dout = dev.upload(&s, bytemuck::cast_slice(&[0.5f32, 0.25]))?;
/// let dwte = dev.upload(&s, bytemuck::cast_slice(&[0.0f32; 3]))?;
/// let dwpe = dev.upload(&s, bytemuck::cast_slice(&[0.0f32; 2]))?;
/// tidemem::ops::encoder_backward(&dev, &s, &dout, &plan, &plan_dev, &dwte, &dwpe, &shape, DType::F32)?;
/// let g: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &dwte)?);
/// assert_eq!(g, [0.0, 0.0, 0.75]);
/// # Ok(()) }
/// ```
///
/// Encoder forward on `stream`: `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]` with
/// `tokens` `[B, T]` i32, `wte` `[V, C]`, `wpe` `[maxT, C]` and `out` `[B, T, C]`, the three
/// of `dtype`. See [`encoder_forward`] for tokens out of range.
#[allow(clippy::too_many_arguments)]
pub fn encoder_forward<'a, 'b, 'c, 'd>(
    dev: &Device,
    stream: &Stream,
    tokens: impl Into<Input<'a>>,
    wte: impl Into<Input<'b>>,
    wpe: impl Into<Input<'c>>,
    out: impl Into<DeviceView<'d>>,
    shape: &EncoderShape,
    dtype: DType,
) -> Result<()> {
    let (n, t) = checked_shape(&ENCODER_FORWARD, shape)?;
    let p = EncoderParams {
        n,
        t,
        c: shape.channels as u64,
        v: shape.vocab as u64,
        max_t: shape.max_seq as u64,
    };
    let ops = [
        Some(Operand::input(tokens, DType::I32)),
        Some(Operand::input(wte, dtype)),
        Some(Operand::input(wpe, dtype)),
        Some(Operand::new(out, dtype)),
    ];
    dev.launch(stream, &ENCODER_FORWARD, &ops, bytemuck::bytes_of(&p))
}

/// Encoder backward on `stream`: `dwte[v, :] += Σ dout[b, t, :]` over the positions holding
/// token `v`, `dwpe[t, :] += Σ_b dout[b, t, :]` (`dout` `[B, T, C]`, `dwte` `[V, C]`, `dwpe`
/// `[maxT, C]`, all `dtype`). `plan` is the batch's [`EncoderPlan`] and `plan_words` its
/// [`to_words`](EncoderPlan::to_words) on the device (u32). The result is deterministic.
#[allow(clippy::too_many_arguments)]
pub fn encoder_backward<'a, 'b, 'c, 'd>(
    dev: &Device,
    stream: &Stream,
    dout: impl Into<Input<'a>>,
    plan: &EncoderPlan,
    plan_words: impl Into<Input<'b>>,
    dwte: impl Into<DeviceView<'c>>,
    dwpe: impl Into<DeviceView<'d>>,
    shape: &EncoderShape,
    dtype: DType,
) -> Result<()> {
    let desc = &ENCODER_BACKWARD;
    let (n, t) = checked_shape(desc, shape)?;
    if plan.positions() as u64 != n {
        return Err(desc.error(format!(
            "the plan covers {} positions, the shape {n} (B = {}, T = {t})",
            plan.positions(),
            shape.batch
        )));
    }
    let p = EncoderBackwardParams {
        n,
        t,
        c: shape.channels as u64,
        v: shape.vocab as u64,
        max_t: shape.max_seq as u64,
        distinct: plan.distinct() as u64,
    };
    let ops = [
        Some(Operand::input(dout, dtype)),
        Some(Operand::input(plan_words, DType::U32)),
        Some(Operand::new(dwte, dtype)),
        Some(Operand::new(dwpe, dtype)),
    ];
    dev.launch(stream, desc, &ops, bytemuck::bytes_of(&p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_groups_positions_by_token_in_order() {
        let p = EncoderPlan::new(&[5, 1, 5, 5, 0], 6).unwrap();
        assert_eq!(p.rows(), [5, 1, 0]);
        assert_eq!(p.row_ptr(), [0, 3, 4, 5]);
        assert_eq!(p.entries(), [0, 2, 3, 1, 4]);
        assert_eq!(p.words(), 12);
        assert_eq!(p.to_words().len(), 12);
        assert!(EncoderPlan::new(&[6], 6).is_err());
        assert!(EncoderPlan::new(&[-1], 6).is_err());
        assert_eq!(EncoderPlan::new(&[], 6).unwrap().words(), 1);
    }

    #[test]
    fn plans_are_checked_before_anything_is_written() {
        let p = EncoderPlan::new(&[2, 0, 2], 3).unwrap();
        let w = p.to_words();
        assert!(split_plan(&w, 2, 3, 3).is_ok());
        assert!(
            split_plan(&w, 2, 2, 3).is_err(),
            "row 2 outside a vocabulary of 2"
        );
        assert!(
            split_plan(&w, 2, 3, 2).is_err(),
            "entries past the positions"
        );
        let mut rep = w.clone();
        rep[1] = 2;
        assert!(split_plan(&rep, 2, 3, 3).is_err(), "a repeated row");
    }
}
