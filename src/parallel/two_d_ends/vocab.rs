//! The vocab-parallel token embedding on the 2D / 2.5D layout, tied to the head.

use super::cost::tally;
use super::{check_ids, check_param, groups, place_of, remap, split, tensor_rank, Groups};
use crate::comm::ReduceOp;
use crate::device::PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::ops::{vocab_embedding_backward, vocab_embedding_forward, VocabPlan, VocabShard};
use crate::parallel::Cost;
use crate::parallel::GridLookup;
use crate::parallel::{Place2D, ProcessGrid, TensorMode};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// The token embedding `wte` `[V, C]` with the vocabulary split over the grid's columns and
/// the channels over its rows, tied to a [`Classifier2D`](super::Classifier2D) head (see
/// [`Embedding2D`](crate::parallel::Embedding2D)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabEmbedding2D {
    /// This rank's block `[V/q, C/q]` = `wte[col·V/q .., row·C/q ..]` ([`Linear2D`]'s shard
    /// of the master `[outputs = V, inputs = C]`).
    ///
    /// [`Linear2D`]: crate::parallel::Linear2D
    pub weight: TensorId,
    /// `V`, the whole vocabulary (padded by the user to a multiple of `q`).
    pub vocab: usize,
    /// `C`.
    pub channels: usize,
    /// The grid's mode it was registered on.
    pub mode: TensorMode,
    /// This rank's place.
    pub place: Place2D,
}

/// What [`VocabEmbedding2D::forward`] keeps for the backward.
#[derive(Debug)]
pub struct VocabEmbedding2DSaved {
    plan: VocabPlan,
    words: PoolBlock,
}

impl VocabEmbedding2D {
    /// Registers this rank's block of `name` (`{name}.weight` `[vocab/q, channels/q]`, the
    /// values of the master `[vocab, channels]` that `init` gives element by element,
    /// row-major) on a 2D or 2.5D grid; in 2.5D with `d > 1` its norm share is `1/d`. Fails on
    /// another grid and when `vocab` or `channels` do not split by `q`, naming the dimension
    /// (pad the vocabulary: GPT-2's 50257 tokens to 50304).
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        vocab: usize,
        channels: usize,
        init: &Init,
    ) -> Result<VocabEmbedding2D> {
        let (mode, place) = place_of("VocabEmbedding2D", name, grid)?;
        let (q, i, j) = (place.q, place.row, place.col);
        let vl = split(name, "vocab", vocab, q, "q")?;
        let cl = split(name, "channels", channels, q, "q")?;
        VocabShard::new(vocab, j * vl, vl)?;
        let w = remap(init, move |k| {
            (j * vl + k / cl) * channels + i * cl + k % cl
        });
        let weight = store.register(&format!("{name}.weight"), &[vl, cl], w)?;
        if place.depth > 1 {
            store.set_norm_share(weight, 1.0 / place.depth as f64)?;
        }
        Ok(VocabEmbedding2D {
            weight,
            vocab,
            channels,
            mode,
            place,
        })
    }

    /// The tokens this rank's block holds: vocabulary block `col`.
    pub fn shard(&self) -> Result<VocabShard> {
        let vl = self.vocab / self.place.q;
        VocabShard::new(self.vocab, self.place.col * vl, vl)
    }

    /// `[V/q, C/q]`.
    fn local(&self) -> [usize; 2] {
        [self.vocab / self.place.q, self.channels / self.place.q]
    }

    /// The rank that holds the tile this rank computes, and the other way round: `(col, row)`
    /// in the same depth layer.
    fn peer(&self) -> usize {
        let p = self.place;
        tensor_rank(self.mode, p.q, [p.col, p.row, p.dep])
    }

    fn groups<'g>(&self, grid: &'g ProcessGrid) -> Result<Groups<'g>> {
        groups("VocabEmbedding2D", self.mode, self.place, grid)
    }

    /// The collectives of one forward and one backward over a batch of `n` tokens, elements
    /// of `dtype` (the store's parameter dtype), with `r = n/(d·q)` the tile's rows and `e`
    /// bytes an element: forward ROW one reduce-scatter of `q·r·C/q·e` bytes, tensor group one
    /// send and one receive of `r·C/q·e`; backward the same send and receive, ROW one
    /// all-gather of `q·r·C/q·e`, and for `d > 1` DEP one all-reduce of `V/q·C/q·e`. Fails
    /// when `n` does not split into the row blocks.
    pub fn collectives(&self, n: usize, dtype: DType) -> Result<Cost> {
        let p = self.place;
        let r = split("batch", "ids", n, p.q * p.depth, "row blocks")?;
        let ([vl, cl], e) = (self.local(), dtype.size());
        let tile = r * cl * e;
        let mut c = Cost::default();
        c.forward.row.reduce_scatter = tally(1, p.q * tile);
        for g in [&mut c.forward, &mut c.backward] {
            g.tensor.send = tally(1, tile);
            g.tensor.recv = tally(1, tile);
        }
        c.backward.row.all_gather = tally(1, p.q * tile);
        if p.depth > 1 {
            c.backward.dep.all_reduce = tally(1, vl * cl * e);
        }
        Ok(c)
    }
}

impl GridLookup for VocabEmbedding2D {
    type Saved = VocabEmbedding2DSaved;

    fn params(&self) -> Vec<TensorId> {
        vec![self.weight]
    }

    /// This rank's tile `[N/(d·q), C/q]` of the embedding of `ids` (the whole batch's `N`
    /// tokens, the same on every rank): the masked lookup of the depth layer's `N/d` ids, one
    /// reduce-scatter in ROW, one `send_recv` with rank `(col, row)`. The ids, their count and
    /// the grid are checked before any collective.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        ids: &[i32],
    ) -> Result<(Act, VocabEmbedding2DSaved)> {
        let gr = self.groups(grid)?;
        let p = self.place;
        let nl = split("batch", "ids", ids.len(), p.q * p.depth, "row blocks")?;
        check_ids(ids, self.vocab)?;
        let nd = nl * p.q;
        let layer = &ids[p.dep * nd..(p.dep + 1) * nd];
        let shard = self.shard()?;
        let plan = VocabPlan::new(layer, &shard)?;
        let (dev, s, pool, d) = (
            pass.device(),
            pass.stream(),
            pass.pool(),
            pass.param_dtype(),
        );
        let cl = self.local()[1];
        let tok = pass.upload(bytemuck::cast_slice(layer))?;
        let part = Act::alloc(pool, nd, cl, d)?;
        let g = pass.fetch(&[self.weight])?;
        check_param(&g, self.local(), d)?;
        let tv = tok.view(0, nd * 4)?;
        vocab_embedding_forward(dev, s, tv, g.param(0)?, part.view(), &shard, cl, d)?;
        drop(g);
        let theirs = Act::alloc(pool, nl, cl, d)?;
        gr.row
            .reduce_scatter(s, part.view(), theirs.view(), d, ReduceOp::Sum)?;
        drop(part);
        let tile = Act::alloc(pool, nl, cl, d)?;
        let peer = self.peer();
        gr.tensor
            .send_recv(s, theirs.view(), peer, tile.view(), peer, d)?;
        let words = pass.upload(bytemuck::cast_slice(&plan.to_words()))?;
        Ok((tile, VocabEmbedding2DSaved { plan, words }))
    }

    /// Adds this rank's share of its block's gradient from the tile's `dout`
    /// `[N/(d·q), C/q]` through [`Guard::accumulate_grad`] (the tied head adds the other
    /// share): one `send_recv` with rank `(col, row)`, one all-gather in ROW, one all-reduce
    /// over DEP for `d > 1`.
    ///
    /// [`Guard::accumulate_grad`]: crate::store::Guard::accumulate_grad
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &VocabEmbedding2DSaved,
        dout: &Act,
    ) -> Result<()> {
        let gr = self.groups(grid)?;
        let (dev, s, pool, d) = (
            pass.device(),
            pass.stream(),
            pass.pool(),
            pass.param_dtype(),
        );
        let [vl, cl] = self.local();
        let nd = saved.plan.positions();
        dout.expect("dout", Some(nd / self.place.q), cl, d)?;
        if saved.plan.shard() != &self.shard()? || !nd.is_multiple_of(self.place.q) {
            return Err(Error::SavedMismatch {
                layer: "VocabEmbedding2D".into(),
            });
        }
        let theirs = Act::alloc(pool, dout.rows(), cl, d)?;
        let peer = self.peer();
        gr.tensor
            .send_recv(s, dout.view(), peer, theirs.view(), peer, d)?;
        let rows = Act::alloc(pool, nd, cl, d)?;
        gr.row.all_gather(s, theirs.view(), rows.view(), d)?;
        drop(theirs);
        let g = pass.fetch(&[self.weight])?;
        check_param(&g, [vl, cl], d)?;
        let dw = Act::alloc(pool, vl, cl, d)?;
        let wv = saved.words.view(0, saved.plan.words() * 4)?;
        let plan = &saved.plan;
        vocab_embedding_backward(dev, s, rows.input(), plan, wv, dw.view(), cl, false, d)?;
        if let Some(dep) = gr.dep {
            dep.all_reduce(s, dw.view(), dw.view(), d, ReduceOp::Sum)?;
        }
        g.accumulate_grad(0, dw.view(), d)
    }
}
