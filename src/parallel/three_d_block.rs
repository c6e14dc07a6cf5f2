//! GPT-2's transformer block on the 3D layout (arXiv 2105.14450): [`LayerNorm3D`] and
//! [`Block3D`], over the [`Linear3D`] of [`three_d`](super::three_d) on a cube of `q³` ranks.
//!
//! # LayerNorm3D
//!
//! An activation `[R, C]` in a [`Layout3D`] gives each rank an `[n, C/q]` tile (`n = R/q²`):
//! the `C` columns of a row lie on the `q` ranks of the layout's column group (the grid's
//! `output()` for [`Layout3D::RowsJColsK`], whose column coordinate is `k`; `input()` for
//! [`Layout3D::RowsKColsJ`]). [`LayerNorm3D`] all-gathers the tile's `q` column blocks there
//! (then a `heads_merge` permute) into its full rows, runs the serial
//! [`ops::layernorm`](crate::ops::layernorm) on them with γ and β whole, and keeps its block.
//! Backward all-gathers the output gradient likewise, runs the full rows' backward, keeps its
//! block of `dx` and reduces its blocks of `dγ`, `dβ`.
//!
//! - γ and β: `{name}.weight` and `{name}.bias` `[C/q]`, the block `c·C/q ..` of the rank's
//!   column coordinate `c`, held alike by the `q²` ranks of that column block (norm share
//!   `1/q²`, as [`Linear3D`]'s bias). Forward all-gathers them in the column group. The full
//!   rows' `dγ`, `dβ` (f32, summed over the tile's rows) are the same on the `q` ranks of a
//!   column group (they hold the same rows); each keeps its block and sums it over the other
//!   `q²` row blocks with an all-reduce over the weight group (`i`) and one over the row
//!   group (`a`), `2·C/q` f32 each: the exact gradient, on every rank holding the block.
//! - Cost, per rank, against the paper's (which all-reduces the row sums `Σx`, `Σx²`, `2n`
//!   floats, in the column group, and `Σdy`, `Σdy·x̂` backward): forward moves the tile's full
//!   rows (`(q−1)/q · n·C` elements, all-gather) instead of `2n`, and every rank of a column
//!   group normalises the same `n` full rows (`q×` the arithmetic); backward the same for the
//!   gradient. At `C/q ≫ 2`, the statistics are the cheaper wire format; the gather is exact
//!   with no new kernel (the layer norm op, its f32 statistics and fixed-order sums are the
//!   serial ones) and is what this layer does.
//!
//! # Block3D
//!
//! [`Block3D`]: `h1 = x + attn(ln_1(x))`, `out = h1 + mlp(ln_2(h1))` on tiles, its input and
//! output in the same layout `L` (the block's), so blocks chain. The four linears are
//! [`Linear3D`]s and alternate the layout: `c_attn` (`C → 3C`) takes `L` and gives
//! `L.swapped()`; `attn.c_proj` (`C → C`) takes that and gives `L` back, where the first
//! residual add needs it; `c_fc` (`C → 4C`) and `mlp.c_proj` (`4C → C`) do the same around
//! the GELU. The LayerNorms and the residual adds run in `L`.
//!
//! The attention runs on each rank alone ([`ops::attention`](crate::ops::attention) over
//! its heads, as [`nn::CausalSelfAttention`](crate::nn::CausalSelfAttention)):
//!
//! - heads: `c_attn`'s output column block `a` (of `q`) must hold the queries, keys and values
//!   of the same heads. The master `[3C, C]` (GPT-2's q, k, v rows stacked) is registered as
//!   one [`Linear3D`] of `3C` outputs **reordered** so that output row `a·3C/q + p·C/q + s`
//!   is master row `p·C + a·C/q + s` (part `p` of q, k, v): block `a` is q, k, v of heads
//!   `a·H/q ..`, laid out `[3, H/q, D]` per row, which is the fused layout the attention op
//!   takes. The bias likewise. So `H` must split by `q`. `attn.c_proj` takes the heads'
//!   merged output, the columns `a·C/q ..` of the serial one, unchanged.
//! - rows: a tile's `n = R/q²` rows must be whole sequences: the batch must split by `q²`
//!   (each tile holds `B/q²` sequences of `T` tokens, rows batch-major).
//!
//! Every parameter is registered under GPT-2's name (`{name}.ln_1.weight`,
//! `{name}.attn.c_attn.weight`, …) with the rank's shard of its master, from `init(name)`
//! (linear weights `[outputs, inputs]`), so the parallel block computes the serial one.
//! Shapes that do not split are refused at registration (channels by `q²`, heads by `q`,
//! channels by heads), and a batch that does not split by `q²` at forward, before any
//! collective, naming the dimension.
//!
//! ```
//! use tidemem::chunk::{ChunkManager, ManagerConfig};
//! use tidemem::comm::Communicator;
//! use tidemem::device::{Device, SimConfig};
//! use tidemem::nn::Act;
//! use tidemem::parallel::{Block3D, GridSpec, Layout3D, ProcessGrid, TensorMode};
//! use tidemem::store::ParamStore;
//! use tidemem::tensor::Init;
//! use tidemem::tide::Policy;
//! use tidemem::DType;
//! # fn main() -> tidemem::Result<()> {
//! // a cube of one rank: the block is the serial one
//! let dev = Device::sim(SimConfig::with_capacity(1 << 22))?;
//! let comm = Communicator::local(vec![dev.clone()])?.remove(0);
//! let spec = GridSpec { data: 1, pipeline: 1, sequence: 1, tensor: TensorMode::ThreeD { q: 1 } };
//! let grid = ProcessGrid::new(&comm, spec)?;
//! let mut cfg = ManagerConfig::new(256, Policy::Tide);
//! cfg.param_dtype = DType::F32;
//! let mut m = ChunkManager::new(dev, cfg)?;
//! let init = |name: &str| match name.ends_with("weight") {
//!     true if name.contains("ln_") => Init::Constant(1.0),
//!     true => Init::Uniform { seed: name.len() as u64, lo: -0.3, hi: 0.3 },
//!     false => Init::Zeros,
//! };
//! let block = Block3D::register(&mut m, &grid, "h.0", 8, 2, 1e-5, Layout3D::RowsJColsK, &init)?;
//! assert_eq!(block.params().len(), 12);
//! let fwd = m.forward()?;
//! let x = Act::upload(fwd.pool(), fwd.stream(), 6, 8, DType::F32, &[0.5; 48])?;
//! let (out, saved) = block.forward(&fwd, &grid, &x, 2, 3)?;
//! assert_eq!(out.shape(), [6, 8]);
//! fwd.finish()?;
//! let bwd = m.backward()?;
//! let dout = Act::upload(bwd.pool(), bwd.stream(), 6, 8, DType::F32, &[1.0; 48])?;
//! let dx = block.backward(&bwd, &grid, &saved, &dout)?;
//! assert_eq!(dx.shape(), [6, 8]);
//! bwd.finish()?;
//! // the output bias's gradient: Σ_rows dout
//! assert_eq!(m.read(block.mlp_proj.bias.unwrap())?, vec![6.0; 8]);
//! # Ok(()) }
//! ```

mod layernorm;

use std::sync::Arc;

pub use layernorm::{LayerNorm3D, Ln3DSaved};

use layernorm::split;

use super::grid::ProcessGrid;
use super::three_d::{Collectives3D, GroupStats, Layout3D, Linear3D, Place3D, Saved3D};
use crate::comm::{CommStats, Tally};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{attend, attend_backward, Attended, HeadsCore, WeightUse};
use crate::nn::{gelu, gelu_backward, Act};
use crate::ops::attention::Attention;
use crate::ops::heads::Heads;
use crate::ops::{add, Axpby};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// GPT-2's pre-LayerNorm block on the 3D layout (see [the module](self)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Block3D {
    /// LayerNorm before the attention (on [`Block3D::layout`]).
    pub ln_1: LayerNorm3D,
    /// `attn.c_attn`, `C → 3C`, its outputs reordered by head block.
    pub c_attn: Linear3D,
    /// `attn.c_proj`, `C → C`.
    pub attn_proj: Linear3D,
    /// LayerNorm before the MLP, fused with the first residual add.
    pub ln_2: LayerNorm3D,
    /// `mlp.c_fc`, `C → 4C`.
    pub c_fc: Linear3D,
    /// `mlp.c_proj`, `4C → C`.
    pub mlp_proj: Linear3D,
    /// Heads `H` of the whole block (`H/q` a rank).
    pub heads: usize,
    /// The layout of the input and of the output.
    pub layout: Layout3D,
    /// How the linears write their weight gradients ([`WeightUse::Shared`] for a block run
    /// more than once an iteration, as a pipeline stage runs it once per micro-batch).
    pub uses: WeightUse,
}

/// What [`Block3D::forward`] keeps for the backward.
#[derive(Debug)]
pub struct Block3DSaved {
    ln_1: Ln3DSaved,
    c_attn: Saved3D,
    heads: Attended,
    attn_proj: Saved3D,
    ln_2: Ln3DSaved,
    c_fc: Saved3D,
    pre: Act,
    mlp_proj: Saved3D,
    op: Attention,
}

impl Block3DSaved {
    /// This rank's tile of `h1 = x + attn(ln_1(x))`, the residual stream between the halves.
    pub fn h1(&self) -> &Act {
        self.ln_2.h()
    }
}

/// The master of `attn.c_attn` with its outputs reordered by head block: element `e` of the
/// reordered `[3C, C]` (or `[3C]` for the bias, `inputs = 1`).
fn by_head_block(master: &Init, channels: usize, q: usize, inputs: usize) -> Init {
    let (m, cq) = (master.clone(), channels / q);
    Init::Fn(Arc::new(move |e| {
        let (row, col) = (e / inputs, e % inputs);
        let (a, rest) = (row / (3 * cq), row % (3 * cq));
        let (p, s) = (rest / cq, rest % cq);
        m.value((p * channels + a * cq + s) * inputs + col)
    }))
}

/// The input gradient of a [`Linear3D::backward`] that was asked for one.
fn asked(dx: Option<Act>) -> Result<Act> {
    dx.ok_or_else(|| Error::InvalidArgument("a 3D linear asked for dx gave none".into()))
}

fn sum_tally(a: Tally, b: Tally) -> Tally {
    Tally {
        calls: a.calls + b.calls,
        bytes: a.bytes + b.bytes,
    }
}

fn sum_stats(a: CommStats, b: CommStats) -> CommStats {
    CommStats {
        all_gather: sum_tally(a.all_gather, b.all_gather),
        reduce_scatter: sum_tally(a.reduce_scatter, b.reduce_scatter),
        all_reduce: sum_tally(a.all_reduce, b.all_reduce),
        broadcast: sum_tally(a.broadcast, b.broadcast),
        reduce: sum_tally(a.reduce, b.reduce),
        send: sum_tally(a.send, b.send),
        recv: sum_tally(a.recv, b.recv),
        barrier: sum_tally(a.barrier, b.barrier),
    }
}

fn sum_groups(a: GroupStats, b: GroupStats) -> GroupStats {
    GroupStats {
        input: sum_stats(a.input, b.input),
        weight: sum_stats(a.weight, b.weight),
        output: sum_stats(a.output, b.output),
    }
}

/// The collectives of two layers run one after the other.
fn sum_collectives(a: Collectives3D, b: Collectives3D) -> Collectives3D {
    Collectives3D {
        forward: sum_groups(a.forward, b.forward),
        backward: sum_groups(a.backward, b.backward),
    }
}

impl Block3D {
    /// Registers this rank's shards of block `name` of `channels` channels and `heads` heads
    /// taking its input in `layout`, under GPT-2's names (`{name}.ln_1.*`,
    /// `{name}.attn.c_attn.*`, …), each from its master: `init(param name)` gives the full
    /// tensor's initialiser (linear weights `[outputs, inputs]`). Fails before registering
    /// anything if the grid is not 3D, the channels do not split by `q²` or by the heads, the
    /// heads by `q`, or `eps` is not finite and ≥ 0.
    #[allow(clippy::too_many_arguments)]
    pub fn register<S: ParamStore>(
        store: &mut S,
        grid: &ProcessGrid,
        name: &str,
        channels: usize,
        heads: usize,
        eps: f32,
        layout: Layout3D,
        init: &dyn Fn(&str) -> Init,
    ) -> Result<Block3D> {
        let q = Place3D::of(grid)?.q;
        split(&format!("'{name}': the channels"), channels, q * q, "q²")?;
        split(&format!("'{name}': the heads"), heads, q, "q")?;
        if !channels.is_multiple_of(heads) {
            return Err(Error::InvalidArgument(format!(
                "'{name}': {channels} channels over {heads} heads (C a multiple of H)"
            )));
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "'{name}': layer norm eps {eps} (finite, ≥ 0)"
            )));
        }
        let c = channels;
        let p = |s: &str| format!("{name}.{s}");
        let ln = |store: &mut S, s: &str| {
            let (g, b) = (
                init(&p(&format!("{s}.weight"))),
                init(&p(&format!("{s}.bias"))),
            );
            LayerNorm3D::register(store, grid, &p(s), c, eps, layout, &g, &b)
        };
        let lin = |store: &mut S, s: &str, i: usize, o: usize, lay: Layout3D, reorder: bool| {
            let (mut w, mut b) = (
                init(&p(&format!("{s}.weight"))),
                init(&p(&format!("{s}.bias"))),
            );
            if reorder {
                (w, b) = (by_head_block(&w, c, q, i), by_head_block(&b, c, q, 1));
            }
            Linear3D::register(store, grid, &p(s), i, o, lay, &w, Some(&b))
        };
        let ln_1 = ln(store, "ln_1")?;
        let c_attn = lin(store, "attn.c_attn", c, 3 * c, layout, true)?;
        let attn_proj = lin(store, "attn.c_proj", c, c, c_attn.output_layout(), false)?;
        let ln_2 = ln(store, "ln_2")?;
        let c_fc = lin(store, "mlp.c_fc", c, 4 * c, layout, false)?;
        let mlp_proj = lin(store, "mlp.c_proj", 4 * c, c, c_fc.output_layout(), false)?;
        Ok(Block3D {
            ln_1,
            c_attn,
            attn_proj,
            ln_2,
            c_fc,
            mlp_proj,
            heads,
            layout,
            uses: WeightUse::Once,
        })
    }

    /// The parameters in registration order (as [`nn::Block::params`](crate::nn::Block)):
    /// `ln_1` (γ, β), `c_attn`, `attn.c_proj`, `ln_2`, `c_fc`, `mlp.c_proj` (weight, bias).
    pub fn params(&self) -> Vec<TensorId> {
        let mut v = self.ln_1.params();
        v.extend(self.c_attn.params());
        v.extend(self.attn_proj.params());
        v.extend(self.ln_2.params());
        v.extend(self.c_fc.params());
        v.extend(self.mlp_proj.params());
        v
    }

    /// The attention op on a tile of `rows` rows of a batch of `batch` sequences of `seq`
    /// tokens, or the error naming what does not split.
    fn op(&self, rows: usize, batch: usize, seq: usize) -> Result<Attention> {
        let q = self.ln_1.place.q;
        let whole = batch.checked_mul(seq);
        if batch == 0 || seq == 0 || whole != rows.checked_mul(q * q) {
            return Err(Error::InvalidArgument(format!(
                "a 3D block tile of {rows} rows of a batch of {batch} × sequence {seq} \
                 (rows · q² = batch · sequence, q = {q})"
            )));
        }
        let local = split(
            "the batch's sequences (a tile holds whole sequences)",
            batch,
            q * q,
            "q²",
        )?;
        let c = self.ln_1.cols;
        Ok(Attention::new(Heads::new(
            local,
            seq,
            self.heads / q,
            c / self.heads,
        )))
    }

    /// The block on this rank's tile `x` `[n, C/q]` (in [`Block3D::layout`]) of the batch of
    /// `batch` sequences of `seq` tokens (`n·q² = batch·seq` rows, batch-major): this rank's
    /// output tile (same layout) and what the backward needs. A wrong grid, shape or type, or
    /// a batch that does not split by `q²`, is an error before any collective.
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        batch: usize,
        seq: usize,
    ) -> Result<(Act, Block3DSaved)> {
        self.forward_core(pass, grid, x, [batch, seq], None)
    }

    /// [`Block3D::forward`] with the attention between the projections computed by `core`
    /// (over this rank's `H/q` heads; e.g. a sequence ring's), or locally with `None`.
    pub fn forward_core(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        [batch, seq]: [usize; 2],
        core: Option<&dyn HeadsCore>,
    ) -> Result<(Act, Block3DSaved)> {
        let d = pass.param_dtype();
        let cq = self.ln_1.cols / self.ln_1.place.q;
        x.expect("x", None, cq, d)?;
        let op = self.op(x.rows(), batch, seq)?;
        let here = Place3D::of(grid)?;
        if here != self.ln_1.place {
            return Err(Error::InvalidArgument(format!(
                "a 3D block registered at {:?} run at {here:?}",
                self.ln_1.place
            )));
        }
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let n = x.rows();
        let (y1, ln_1) = self.ln_1.forward(pass, grid, x, None)?;
        let (qkv, c_attn) = self.c_attn.forward(pass, grid, &y1)?;
        drop(y1);
        let (merged, heads) = attend(pass, &op, core, &qkv)?;
        drop(qkv);
        let (a, attn_proj) = self.attn_proj.forward(pass, grid, &merged)?;
        drop(merged);
        // h1 = x + a, and its normalisation
        let (y2, ln_2) = self.ln_2.forward(pass, grid, &a, Some(x))?;
        drop(a);
        let (pre, c_fc) = self.c_fc.forward(pass, grid, &y2)?;
        drop(y2);
        let act = gelu(pass, &pre)?;
        let (m, mlp_proj) = self.mlp_proj.forward(pass, grid, &act)?;
        drop(act);
        let out = Act::alloc(pool, n, cq, d)?;
        let one = Axpby {
            alpha: 1.0,
            beta: 1.0,
        };
        add(dev, s, one, ln_2.h().input(), m.input(), out.view(), d)?;
        let saved = Block3DSaved {
            ln_1,
            c_attn,
            heads,
            attn_proj,
            ln_2,
            c_fc,
            pre,
            mlp_proj,
            op,
        };
        Ok((out, saved))
    }

    /// The same block with its linears writing gradient shares ([`WeightUse::Shared`]).
    pub fn shared(self) -> Block3D {
        Block3D {
            uses: WeightUse::Shared,
            ..self
        }
    }

    /// The backward of [`Block3D::forward`] from this rank's output-gradient tile `dout`:
    /// writes every parameter shard's gradient and returns the input-gradient tile (a new
    /// activation; `dout` is not changed).
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Block3DSaved,
        dout: &Act,
    ) -> Result<Act> {
        self.backward_core(pass, grid, saved, dout, None)
    }

    /// [`Block3D::backward`] of a forward run with `core` (the same core).
    pub fn backward_core(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Block3DSaved,
        dout: &Act,
        core: Option<&dyn HeadsCore>,
    ) -> Result<Act> {
        let d = pass.param_dtype();
        let h1 = saved.h1();
        dout.expect("dout", Some(h1.rows()), h1.cols(), d)?;
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let (n, cq) = (h1.rows(), h1.cols());
        // the residual stream's gradient: dout, then + ln_2's dx, then + ln_1's dx
        let dres = Act::alloc(pool, n, cq, d)?;
        dev.copy_d2d(s, dout.input(), dres.view())?;
        let dact = asked(self.mlp_proj.backward_with(
            pass,
            grid,
            &saved.mlp_proj,
            dout,
            true,
            self.uses,
        )?)?;
        let dpre = gelu_backward(pass, &saved.pre, &dact)?;
        drop(dact);
        let dy2 =
            asked(
                self.c_fc
                    .backward_with(pass, grid, &saved.c_fc, &dpre, true, self.uses)?,
            )?;
        drop(dpre);
        self.ln_2
            .backward(pass, grid, &saved.ln_2, &dy2, Some(&dres))?;
        drop(dy2);
        let dmerged = asked(self.attn_proj.backward_with(
            pass,
            grid,
            &saved.attn_proj,
            &dres,
            true,
            self.uses,
        )?)?;
        let dqkv = attend_backward(pass, &saved.op, core, &saved.heads, &dmerged)?;
        drop(dmerged);
        let dy1 =
            asked(
                self.c_attn
                    .backward_with(pass, grid, &saved.c_attn, &dqkv, true, self.uses)?,
            )?;
        drop(dqkv);
        self.ln_1
            .backward(pass, grid, &saved.ln_1, &dy1, Some(&dres))?;
        Ok(dres)
    }

    /// The collectives of one forward and backward on tiles of `rows` rows (`n`) in `dtype`:
    /// the sum of its layers' ([`LayerNorm3D::collectives`], [`Linear3D::collectives`], every
    /// linear asked for its input gradient).
    pub fn collectives(&self, rows: usize, dtype: DType) -> Collectives3D {
        let lin = |l: &Linear3D| l.collectives(rows, dtype, true);
        [
            self.ln_1.collectives(rows, dtype),
            lin(&self.c_attn),
            lin(&self.attn_proj),
            self.ln_2.collectives(rows, dtype),
            lin(&self.c_fc),
            lin(&self.mlp_proj),
        ]
        .into_iter()
        .fold(Collectives3D::default(), sum_collectives)
    }
}
