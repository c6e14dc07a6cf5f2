//! GPT-2's pre-LayerNorm block on the 2D (SUMMA / Optimus) and 2.5D (Tesseract) layouts:
//! [`LayerNorm2D`] and [`Block2D`], with [`SummaLinear`] for the four linears.
//!
//! # Layouts
//!
//! Activations are the linears' (see [`two_d`](crate::parallel::two_d)): the rank at `(i, j)`
//! (depth `dep` in 2.5D) holds `X_ij` `[rows_l, C/q]`, row block `i` (2.5D: `i + q·dep` of
//! `d·q`) and column block `j` of the full `[rows, C]`. [`Block2D`] asks each row block to be
//! whole sequences (`rows_l` a multiple of the sequence length) and the heads `H` to split
//! over `q`: the rank's column block of the queries, keys and values is then heads
//! `j·H/q .. (j+1)·H/q`, and attention runs locally over those heads and sequences
//! ([`ops::attention`](crate::ops::attention)), with no collective.
//!
//! `c_attn`'s serial output is `[q | k | v]` (each `C` wide). So that column block `j` of its
//! output is `[q_j | k_j | v_j]` (the layout the attention op reads), the 2D layer registered
//! as `{name}.attn.c_attn` is the serial one with its **output features permuted**: output
//! `o' = j·3C/q + s·C/q + a` (`s` = 0 for q, 1 for k, 2 for v; `a < C/q`) is serial output
//! `s·C + j·C/q + a`. Its weight and bias shards are [`Linear2D`]'s blocks of that permuted
//! master (`M'[o', ·] = M[perm(o'), ·]`), built by [`Init::Fn`] over the serial master; every
//! other parameter is the plain 2D layout of its serial tensor, under GPT-2's names.
//!
//! [`LayerNorm2D::collectives`] and [`Block2D::collectives`] give the calls and bytes per
//! group (ROW, COL, DEP) of one forward and backward; they are exact. Shapes that do not
//! split are [`Error::InvalidArgument`] naming the dimension, at registration and before any
//! collective in the forward.
//!
//! ```
//! use tidemem::comm::Communicator;
//! use tidemem::nn::Act;
//! use tidemem::parallel::{split_batch_2d, Block2D, GridSpec, ProcessGrid, TensorMode};
//! use tidemem::prelude::*;
//! # fn main() -> tidemem::Result<()> {
//! let devices = (0..4)
//!     .map(|_| Device::sim(SimConfig::with_capacity(1 << 24)))
//!     .collect::<tidemem::Result<Vec<_>>>()?;
//! let comms = Communicator::local(devices)?;
//! let spec = GridSpec { data: 1, pipeline: 1, sequence: 1, tensor: TensorMode::TwoD { q: 2 } };
//! // 4 sequences of 3 tokens, 8 channels, 2 heads
//! let (rows, seq, c) = (12, 3, 8);
//! let x: Vec<f32> = (0..rows * c).map(|v| (v % 7) as f32 / 10.0).collect();
//! let init = |_: &str| Init::Uniform { seed: 1, lo: 0.1, hi: 0.5 };
//! std::thread::scope(|s| {
//!     let ranks: Vec<_> = comms
//!         .iter()
//!         .map(|comm| {
//!             let (x, init) = (&x, &init);
//!             s.spawn(move || -> tidemem::Result<()> {
//!                 let grid = ProcessGrid::new(comm, spec)?;
//!                 let mut m = ChunkManager::new(
//!                     comm.device().clone(),
//!                     ManagerConfig::new(1 << 12, Policy::Tide),
//!                 )?;
//!                 let block = Block2D::register(&mut m, &grid, "h.0", c, 2, 1e-5, init)?;
//!                 let fwd = m.forward()?;
//!                 let xb = split_batch_2d(&grid, x, rows, c)?; // X_ij: [6, 4]
//!                 let d = fwd.param_dtype();
//!                 let xa = Act::upload(fwd.pool(), fwd.stream(), 6, 4, d, &xb)?;
//!                 let (out, saved) = block.forward(&fwd, &grid, &xa, seq)?;
//!                 assert_eq!(out.shape(), [6, 4]);
//!                 drop((out, saved, xa));
//!                 fwd.finish()
//!             })
//!         })
//!         .collect();
//!     ranks.into_iter().try_for_each(|h| h.join().expect("rank panicked"))
//! })?;
//! # Ok(()) }
//! ```

mod cost;
mod layernorm;

pub use layernorm::{LayerNorm2D, Ln2DSaved, Place2D};

use layernorm::Groups;

use super::two_d::{remap, split};
use super::{Linear2D, Linear2p5D, ProcessGrid, TensorMode};
use crate::error::{Error, Result};
use crate::nn::{attend, attend_backward, Attended, HeadsCore, WeightUse};
use crate::nn::{gelu, gelu_backward, Act};
use crate::ops::attention::Attention;
use crate::ops::heads::Heads;
use crate::ops::{add, Axpby};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// A linear of the 2D or the 2.5D scheme, whichever the grid runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SummaLinear {
    /// On a 2D grid.
    TwoD(Linear2D),
    /// On a 2.5D grid.
    TwoHalfD(Linear2p5D),
}

impl SummaLinear {
    /// Registers layer `name` as [`Linear2D::register`] or [`Linear2p5D::register`], by the
    /// grid's mode.
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        [inputs, outputs]: [usize; 2],
        weight: &Init,
        bias: Option<&Init>,
    ) -> Result<SummaLinear> {
        Ok(match grid.spec().tensor {
            TensorMode::TwoHalfD { .. } => SummaLinear::TwoHalfD(Linear2p5D::register(
                store, grid, name, inputs, outputs, weight, bias,
            )?),
            _ => SummaLinear::TwoD(Linear2D::register(
                store, grid, name, inputs, outputs, weight, bias,
            )?),
        })
    }

    /// The layer of this rank's depth layer.
    pub fn slice(&self) -> &Linear2D {
        match self {
            SummaLinear::TwoD(l) => l,
            SummaLinear::TwoHalfD(l) => &l.slice,
        }
    }

    /// The parameters, in fetch order.
    pub fn params(&self) -> Vec<TensorId> {
        self.slice().params()
    }

    /// The layer's forward (see [`Linear2D::forward`]).
    pub fn forward(&self, pass: &ForwardPass<'_>, grid: &ProcessGrid, x: &Act) -> Result<Act> {
        match self {
            SummaLinear::TwoD(l) => l.forward(pass, grid, x),
            SummaLinear::TwoHalfD(l) => l.forward(pass, grid, x),
        }
    }

    /// The layer's backward, returning `dX` (see [`Linear2D::backward`]).
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        dy: &Act,
    ) -> Result<Act> {
        let dx = match self {
            SummaLinear::TwoD(l) => l.backward(pass, grid, x, dy, true),
            SummaLinear::TwoHalfD(l) => l.backward(pass, grid, x, dy, true),
        }?;
        dx.ok_or_else(|| Error::InvalidArgument("a linear's backward gave no dx".into()))
    }

    /// The backward of a linear whose weight is used more than once per iteration (a tied
    /// head), returning `dX`: [`Linear2D::backward_shared`] or
    /// [`Linear2p5D::backward_shared`].
    pub fn backward_shared(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        dy: &Act,
    ) -> Result<Act> {
        let dx = match self {
            SummaLinear::TwoD(l) => l.backward_shared(pass, grid, x, dy, true),
            SummaLinear::TwoHalfD(l) => l.backward_shared(pass, grid, x, dy, true),
        }?;
        dx.ok_or_else(|| Error::InvalidArgument("a linear's backward gave no dx".into()))
    }
}

/// GPT-2's pre-LayerNorm block on a 2D or 2.5D grid (see [the module](self)):
/// `h1 = x + attn(ln_1(x))`, `out = h1 + mlp(ln_2(h1))`, `ln_2` fused with the first residual
/// add.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Block2D {
    /// LayerNorm before the attention.
    pub ln_1: LayerNorm2D,
    /// The query/key/value projection `C → 3C`, outputs permuted (see [the module](self)).
    pub c_attn: SummaLinear,
    /// The attention's output projection `C → C`.
    pub attn_proj: SummaLinear,
    /// LayerNorm before the MLP.
    pub ln_2: LayerNorm2D,
    /// The MLP's `C → 4C`.
    pub c_fc: SummaLinear,
    /// The MLP's `4C → C`.
    pub mlp_proj: SummaLinear,
    /// Heads `H` of the full block.
    pub heads: usize,
    /// Channels `C`.
    pub channels: usize,
    /// How the linears write their weight gradients ([`WeightUse::Shared`] for a block run
    /// more than once an iteration, as a pipeline stage runs it once per micro-batch).
    pub uses: WeightUse,
}

/// What [`Block2D::forward`] keeps for the backward (all this rank's blocks).
#[derive(Debug)]
pub struct Block2DSaved {
    ln_1: Ln2DSaved,
    y1: Act,
    heads: Attended,
    merged: Act,
    ln_2: Ln2DSaved,
    y2: Act,
    pre: Act,
    act: Act,
    seq: usize,
}

impl Block2DSaved {
    /// This rank's block of `h1 = x + attn(ln_1(x))`.
    pub fn h1(&self) -> &Act {
        self.ln_2.h()
    }
}

impl Block2D {
    /// Registers this rank's shards of block `name` (`channels` channels, `heads` heads) under
    /// GPT-2's names (`{name}.ln_1.*`, `{name}.attn.c_attn.*`, `{name}.attn.c_proj.*`,
    /// `{name}.ln_2.*`, `{name}.mlp.c_fc.*`, `{name}.mlp.c_proj.*`), each with the values of
    /// its serial master: `init(param name)` gives the full tensor's initialiser (linear
    /// weights `[outputs, inputs]`). Fails on a grid that is neither 2D nor 2.5D, when the
    /// heads do not split by `q`, the channels by the heads or by `q²` (naming which).
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        channels: usize,
        heads: usize,
        eps: f32,
        init: &dyn Fn(&str) -> Init,
    ) -> Result<Block2D> {
        let place = Place2D::of(grid)?;
        let q = place.q;
        split(name, "heads", heads, q, "q")?;
        split(name, "channels", channels, heads, "heads")?;
        split(name, "channels", channels, q * q, "q²")?;
        let c = channels;
        let p = |s: &str| format!("{name}.{s}");
        let ln = |store: &mut _, s: &str| {
            let (g, b) = (
                init(&p(&format!("{s}.weight"))),
                init(&p(&format!("{s}.bias"))),
            );
            LayerNorm2D::register_at(store, place, &p(s), c, eps, [&g, &b])
        };
        let lin = |store: &mut _, s: &str, io: [usize; 2], perm: bool| {
            let (mut w, mut b) = (
                init(&p(&format!("{s}.weight"))),
                init(&p(&format!("{s}.bias"))),
            );
            if perm {
                // output o' of the permuted layer is serial output qkv_out(o')
                let cl = c / q;
                let of = move |o: usize| (o % (3 * cl)) / cl * c + o / (3 * cl) * cl + o % cl;
                w = remap(&w, move |k| of(k / c) * c + k % c);
                b = remap(&b, of);
            }
            SummaLinear::register(store, grid, &p(s), io, &w, Some(&b))
        };
        let ln_1 = ln(store, "ln_1")?;
        let c_attn = lin(store, "attn.c_attn", [c, 3 * c], true)?;
        let attn_proj = lin(store, "attn.c_proj", [c, c], false)?;
        let ln_2 = ln(store, "ln_2")?;
        let c_fc = lin(store, "mlp.c_fc", [c, 4 * c], false)?;
        let mlp_proj = lin(store, "mlp.c_proj", [4 * c, c], false)?;
        Ok(Block2D {
            ln_1,
            c_attn,
            attn_proj,
            ln_2,
            c_fc,
            mlp_proj,
            heads,
            channels,
            uses: WeightUse::Once,
        })
    }

    /// The parameters in registration order: `ln_1` (γ, β), `c_attn`, `attn.c_proj`, `ln_2`,
    /// `c_fc`, `mlp.c_proj` (weight, bias each).
    pub fn params(&self) -> Vec<TensorId> {
        let mut v = self.ln_1.params();
        v.extend(self.c_attn.params());
        v.extend(self.attn_proj.params());
        v.extend(self.ln_2.params());
        v.extend(self.c_fc.params());
        v.extend(self.mlp_proj.params());
        v
    }

    /// The local attention op for `rows` local rows of sequences of `seq` tokens, or
    /// [`Error::InvalidArgument`] when the rows are not whole sequences.
    fn op(&self, rows: usize, seq: usize) -> Result<Attention> {
        if seq == 0 || rows == 0 || !rows.is_multiple_of(seq) {
            return Err(Error::InvalidArgument(format!(
                "2D block: a row block of {rows} rows is not whole sequences of {seq} tokens \
                 (rows/(row blocks) must be a multiple of the sequence length)"
            )));
        }
        let q = self.ln_1.place.q;
        Ok(Attention::new(Heads::new(
            rows / seq,
            seq,
            self.heads / q,
            self.channels / self.heads,
        )))
    }

    fn groups<'g>(&self, grid: &'g ProcessGrid) -> Result<Groups<'g>> {
        self.ln_1.place.groups(grid)
    }

    /// The block on this rank's `X_ij` `[rows_l, C/q]` (its row block whole sequences of `seq`
    /// tokens, batch-major): returns `out_ij` and what the backward needs. Shapes and the
    /// grid place are checked before any collective.
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        seq: usize,
    ) -> Result<(Act, Block2DSaved)> {
        self.forward_core(pass, grid, x, seq, None)
    }

    /// [`Block2D::forward`] with the attention between the projections computed by `core`
    /// (over this rank's `H/q` heads; e.g. a sequence ring's), or locally with `None`.
    pub fn forward_core(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        seq: usize,
        core: Option<&dyn HeadsCore>,
    ) -> Result<(Act, Block2DSaved)> {
        let d = pass.param_dtype();
        let q = self.ln_1.place.q;
        let cl = self.channels / q;
        x.expect("x", None, cl, d)?;
        let op = self.op(x.rows(), seq)?;
        let gr = self.groups(grid)?;
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let rows = x.rows();
        let (y1, ln_1) = self.ln_1.forward_in(pass, &gr, x, None)?;
        let qkv = self.c_attn.forward(pass, grid, &y1)?;
        let (merged, heads) = attend(pass, &op, core, &qkv)?;
        drop(qkv);
        let a = self.attn_proj.forward(pass, grid, &merged)?;
        let (y2, ln_2) = self.ln_2.forward_in(pass, &gr, &a, Some(x))?;
        drop(a);
        let pre = self.c_fc.forward(pass, grid, &y2)?;
        let act = gelu(pass, &pre)?;
        let m = self.mlp_proj.forward(pass, grid, &act)?;
        let out = Act::alloc(pool, rows, cl, d)?;
        let one = Axpby {
            alpha: 1.0,
            beta: 1.0,
        };
        add(dev, s, one, ln_2.h().input(), m.input(), out.view(), d)?;
        let saved = Block2DSaved {
            ln_1,
            y1,
            heads,
            merged,
            ln_2,
            y2,
            pre,
            act,
            seq,
        };
        Ok((out, saved))
    }

    /// The same block with its linears writing gradient shares ([`WeightUse::Shared`]).
    pub fn shared(self) -> Block2D {
        Block2D {
            uses: WeightUse::Shared,
            ..self
        }
    }

    /// `dX` of one of the block's linears, its weight gradient written as [`Block2D::uses`]
    /// says.
    fn linear_backward(
        &self,
        l: &SummaLinear,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        dy: &Act,
    ) -> Result<Act> {
        match self.uses {
            WeightUse::Once => l.backward(pass, grid, x, dy),
            WeightUse::Shared => l.backward_shared(pass, grid, x, dy),
        }
    }

    /// The backward of [`Block2D::forward`] from `dout_ij`: adds this rank's shard gradients
    /// into their slots and returns `dX_ij` (a new activation).
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Block2DSaved,
        dout: &Act,
    ) -> Result<Act> {
        self.backward_core(pass, grid, saved, dout, None)
    }

    /// [`Block2D::backward`] of a forward run with `core` (the same core).
    pub fn backward_core(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Block2DSaved,
        dout: &Act,
        core: Option<&dyn HeadsCore>,
    ) -> Result<Act> {
        let d = pass.param_dtype();
        let q = self.ln_1.place.q;
        let cl = self.channels / q;
        let rows = saved.h1().rows();
        dout.expect("dout", Some(rows), cl, d)?;
        let op = self.op(rows, saved.seq)?;
        let gr = self.groups(grid)?;
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        // the residual stream's gradient: dout, + ln_2's dx, + ln_1's dx
        let dres = Act::alloc(pool, rows, cl, d)?;
        dev.copy_d2d(s, dout.input(), dres.view())?;
        let dact = self.linear_backward(&self.mlp_proj, pass, grid, &saved.act, dout)?;
        let dpre = gelu_backward(pass, &saved.pre, &dact)?;
        drop(dact);
        let dy2 = self.linear_backward(&self.c_fc, pass, grid, &saved.y2, &dpre)?;
        drop(dpre);
        self.ln_2
            .backward_in(pass, &gr, &saved.ln_2, &dy2, Some(&dres))?;
        drop(dy2);
        let dmerged = self.linear_backward(&self.attn_proj, pass, grid, &saved.merged, &dres)?;
        let dqkv = attend_backward(pass, &op, core, &saved.heads, &dmerged)?;
        drop(dmerged);
        let dy1 = self.linear_backward(&self.c_attn, pass, grid, &saved.y1, &dqkv)?;
        drop(dqkv);
        self.ln_1
            .backward_in(pass, &gr, &saved.ln_1, &dy1, Some(&dres))?;
        Ok(dres)
    }
}
