use super::{Cost, PassCost};
use crate::comm::{CommStats, Communicator, Tally};
use crate::device::{DeviceView, Input};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{Act, HeadsCore, HeadsCoreSaved};
use crate::ops::heads::{heads_merge, heads_split, qkv_merge, qkv_split, Heads};
use crate::ops::{gemm, softmax_block_backward, softmax_block_forward, Gemm, SoftmaxBlock};
use crate::store::{BackwardPass, ForwardPass, Pass, PassKind};

/// Sequence parallelism (arXiv 2105.13120): the tokens of every sequence split over a group of
/// `N` ranks, and causal self-attention computed exactly across them by passing key and value
/// blocks around a ring ([`RingAttention`]).
///
/// # Layout
///
/// Rank `r` holds positions `r·T/N ..` (`L = T/N` of them) of each of the `B` sequences: its
/// activations are `[B·L, C]`, rows ordered (sequence, position), as the serial model's rows
/// restricted to those positions. Its queries, keys and values are `[B·H, L, D]` (`C = H·D`)
/// and its scores are the full rows `[B·H, L, T]`: query `i` (global position `r·L + i`)
/// against every key, of which only keys `≤ r·L + i` count (the causal mask across blocks,
/// [`crate::ops::softmax_block_forward`] with offset `r·L`).
///
/// # Passes (every message a [`Communicator::send_recv`] to `r + 1` from `r − 1`)
///
/// - Forward, **RingQK**: for `s` in `0..N`, the rank holds the keys of block `src = r − s`;
///   `S[:, :, src] = Q·K_srcᵀ` where `src ≤ r` (blocks after `r` are masked whole, so never
///   computed), then passes the keys on (`N − 1` messages). `P = softmax(S/√D)` over the live
///   part of each row. **RingAV**: the values go round the same way and `Y = Σ_src
///   P[:, :, src]·V_src` (`N − 1` messages).
/// - Backward: the values go round again, each with a travelling accumulator of its block's
///   gradient: `dP[:, :, src] = dY·V_srcᵀ` and `dV_src += P[:, :, src]ᵀ·dY`; after the last
///   rank one more message brings each accumulator home (`N` messages). Then `dS` by the
///   softmax backward, and the keys go round with theirs: `dQ += dS[:, :, src]·K_src`,
///   `dK_src += dS[:, :, src]ᵀ·Q` (`N` messages). Every gradient is exact: no `1/N`, the
///   scale `1/√D` with `D` the head width.
///
/// With `N = 1` it is the serial [`Attention`](crate::ops::attention::Attention) (the same
/// products in the same order; no messages). `T` must divide by `N`: anything else is an
/// [`Error::NotSplit`] at construction, on every rank.
///
/// Causal self-attention over a sequence split across a ring of ranks (see
/// [`RingAttention`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingAttention {
    /// Sequences `B`.
    pub batch: usize,
    /// The whole sequence length `T`.
    pub seq: usize,
    /// Heads `H`.
    pub heads: usize,
    /// Head width `D`.
    pub(crate) head_dim: usize,
    /// Ranks in the ring `N`.
    pub ranks: usize,
    /// This rank `r`.
    pub rank: usize,
}

/// What [`RingAttention::forward`] keeps for the backward: this rank's `q`, `k`, `v`
/// (`[B·H, L, D]`) and probabilities (`[B·H, L, T]`).
#[derive(Debug)]
pub struct RingAttentionSaved {
    q: Act,
    k: Act,
    v: Act,
    att: Act,
}

impl RingAttention {
    /// The attention of `batch` sequences of `seq` positions, `heads` heads of `head_dim`,
    /// over `group` (this rank's place in the ring is its rank there). Fails when `seq` does
    /// not divide by the group's size or a size is 0.
    pub fn new(
        group: &Communicator,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
    ) -> Result<RingAttention> {
        let n = group.world();
        if batch == 0 || heads == 0 || head_dim == 0 || seq == 0 {
            return Err(Error::TooFew {
                what: format!(
                    "the smallest size of ring attention's {batch} sequences of {seq} positions, \
                     {heads} heads of {head_dim}"
                ),
                got: 0,
                need: 1,
            });
        }
        if !seq.is_multiple_of(n) {
            return Err(Error::NotSplit {
                layer: "ring attention".into(),
                what: "positions",
                value: seq,
                parts: n,
                by: "sequence-parallel ranks",
            });
        }
        let a = RingAttention {
            batch,
            seq,
            heads,
            head_dim,
            ranks: n,
            rank: group.rank(),
        };
        a.local().elems().ok_or_else(|| a.overflow())?;
        (batch * heads)
            .checked_mul(seq / n)
            .and_then(|x| x.checked_mul(seq))
            .ok_or_else(|| a.overflow())?;
        Ok(a)
    }

    fn overflow(&self) -> Error {
        Error::Overflow {
            what: format!("ring attention: the shape {self:?}"),
        }
    }

    /// Positions a rank holds, `L = T/N`.
    pub(crate) fn local_seq(&self) -> usize {
        self.seq / self.ranks
    }

    /// This rank's rows of an activation, `B·L`.
    pub fn rows(&self) -> usize {
        self.batch * self.local_seq()
    }

    /// The channels `C = H·D`.
    pub fn channels(&self) -> usize {
        self.heads * self.head_dim
    }

    /// The rank's heads layout `[B, L, H, D]`.
    fn local(&self) -> Heads {
        Heads::new(self.batch, self.local_seq(), self.heads, self.head_dim)
    }

    fn softmax(&self) -> SoftmaxBlock {
        SoftmaxBlock {
            bh: self.batch * self.heads,
            rows: self.local_seq(),
            cols: self.seq,
            offset: self.rank * self.local_seq(),
            scale: 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    fn check(&self, group: &Communicator, what: &str, a: &Act, cols: usize) -> Result<()> {
        if group.world() != self.ranks || group.rank() != self.rank {
            return Err(Error::WrongPlace {
                what: "ring attention",
                registered: format!("for rank {} of {}", self.rank, self.ranks),
                run: format!("on rank {} of {}", group.rank(), group.world()),
            });
        }
        a.expect(what, Some(self.rows()), cols, a.dtype())
    }

    /// The block `(m × n × k)` products of the passes, `bh` of them: `S[:, :, src]`-shaped
    /// operands (`L × L` inside `L × T` rows) are strided by `T`.
    fn product(&self, ta: bool, tb: bool, beta: f32, wide: [bool; 3]) -> Gemm {
        let (l, t, d) = (self.local_seq(), self.seq, self.head_dim);
        let bh = self.batch * self.heads;
        // (m, n, k): a scores product is L × L × D, any other L × D × L
        let (m, n, k) = if wide[2] { (l, l, d) } else { (l, d, l) };
        let ld = |w: bool, cols: usize| if w { t } else { cols };
        let stride = |w: bool| if w { l * t } else { l * d };
        let [wa, wb, wc] = wide;
        let cols_a = if ta { m } else { k };
        let cols_b = if tb { k } else { n };
        Gemm::new(m, n, k)
            .trans_a(ta)
            .trans_b(tb)
            .beta(beta)
            .batched(bh, stride(wa), stride(wb), stride(wc))
            .ld(ld(wa, cols_a), ld(wb, cols_b), ld(wc, n))
    }

    /// Column block `src` of a `[B·H, L, T]` buffer, from its first element on.
    fn block<'a>(&self, scores: &'a Act, src: usize) -> Result<DeviceView<'a>> {
        let at = src * self.local_seq() * scores.dtype().size();
        scores.view().slice(at, scores.len_bytes() - at)
    }

    /// Sends `send` to the next rank and receives the previous rank's into `recv`.
    fn pass_on(
        &self,
        group: &Communicator,
        s: &crate::device::Stream,
        send: DeviceView<'_>,
        recv: DeviceView<'_>,
        d: DType,
    ) -> Result<()> {
        let n = self.ranks;
        let (to, from) = ((self.rank + 1) % n, (self.rank + n - 1) % n);
        group.send_recv(s, send, to, recv, from, d)
    }

    /// The block of keys or values this rank holds at ring step `s`.
    fn source(&self, s: usize) -> usize {
        (self.rank + self.ranks - s) % self.ranks
    }

    /// The attention of this rank's `qkv` (`[B·L, 3C]`, queries, keys and values side by side,
    /// as [`CausalSelfAttention`](crate::nn::CausalSelfAttention)'s `c_attn` gives them): the merged heads
    /// `[B·L, C]` and what the backward needs. Every rank of `group` must call it.
    pub fn forward<K: PassKind>(
        &self,
        pass: &Pass<'_, K>,
        group: &Communicator,
        qkv: &Act,
    ) -> Result<(Act, RingAttentionSaved)> {
        let c = self.channels();
        self.check(group, "qkv", qkv, 3 * c)?;
        let (dev, s, pool, d) = (pass.device(), pass.stream(), pass.pool(), qkv.dtype());
        let rows = self.rows();
        let heads = || Act::alloc(pool, rows, c, d);
        let (q, k, v) = (heads()?, heads()?, heads()?);
        qkv_split(
            dev,
            s,
            self.local(),
            qkv.input(),
            q.view(),
            k.view(),
            v.view(),
            d,
        )?;
        let score_rows = self.batch * self.heads * self.local_seq();
        let scores = Act::alloc(pool, score_rows, self.seq, d)?;
        let att = Act::alloc(pool, score_rows, self.seq, d)?;
        // RingQK
        let ring = [heads()?, heads()?];
        let qk = self.product(false, true, 0.0, [false, false, true]);
        self.around(group, s, &k, &ring, d, |s_, held| {
            let src = self.source(s_);
            if src <= self.rank {
                gemm(dev, s, &qk, q.input(), held, self.block(&scores, src)?, d)?;
            }
            Ok(())
        })?;
        softmax_block_forward(dev, s, scores.input(), att.view(), &self.softmax(), d)?;
        drop(scores);
        // RingAV
        let y = heads()?;
        self.around(group, s, &v, &ring, d, |s_, held| {
            let src = self.source(s_);
            if src <= self.rank {
                let beta = if s_ == 0 { 0.0 } else { 1.0 };
                let av = self.product(false, false, beta, [true, false, false]);
                gemm(dev, s, &av, self.block_in(&att, src)?, held, y.view(), d)?;
            }
            Ok(())
        })?;
        drop(ring);
        let out = heads()?;
        heads_merge(dev, s, self.local(), y.input(), out.view(), d)?;
        Ok((out, RingAttentionSaved { q, k, v, att }))
    }

    fn block_in<'a>(&self, a: &'a Act, src: usize) -> Result<Input<'a>> {
        Ok(Input::from(self.block(a, src)?))
    }

    /// Runs `step(s, held)` for `s` in `0..N` with `held` the block of step `s` (this rank's
    /// `own` first), passing the block on between steps (`N − 1` messages) through the two
    /// `ring` buffers.
    fn around(
        &self,
        group: &Communicator,
        s: &crate::device::Stream,
        own: &Act,
        ring: &[Act; 2],
        d: DType,
        mut step: impl FnMut(usize, Input<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut held: &Act = own;
        for k in 0..self.ranks {
            step(k, held.input())?;
            if k + 1 < self.ranks {
                let next = &ring[k % 2];
                self.pass_on(group, s, held.view(), next.view(), d)?;
                held = next;
            }
        }
        Ok(())
    }

    /// `dqkv` (`[B·L, 3C]`) from the merged heads' gradient `dout` (`[B·L, C]`). Every rank
    /// of `group` must call it.
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        group: &Communicator,
        saved: &RingAttentionSaved,
        dout: &Act,
    ) -> Result<Act> {
        let c = self.channels();
        self.check(group, "dout", dout, c)?;
        let (dev, s, pool, d) = (pass.device(), pass.stream(), pass.pool(), dout.dtype());
        let rows = self.rows();
        let heads = || Act::alloc(pool, rows, c, d);
        let dy = heads()?;
        heads_split(dev, s, self.local(), dout.input(), dy.view(), d)?;
        let datt = Act::alloc(pool, saved.att.rows(), self.seq, d)?;
        // the values round with their gradients: dP = dY·Vᵀ, dV += Pᵀ·dY
        let dp = self.product(false, true, 0.0, [false, false, true]);
        let dv = self.around_with_grad(pass, group, &saved.v, |s_, v, acc| {
            let src = self.source(s_);
            if src <= self.rank {
                gemm(dev, s, &dp, dy.input(), v, self.block(&datt, src)?, d)?;
                let beta = if s_ == 0 { 0.0 } else { 1.0 };
                let pt = self.product(true, false, beta, [true, false, false]);
                gemm(
                    dev,
                    s,
                    &pt,
                    self.block_in(&saved.att, src)?,
                    dy.input(),
                    acc,
                    d,
                )?;
            }
            Ok(())
        })?;
        let dscores = Act::alloc(pool, saved.att.rows(), self.seq, d)?;
        let sm = self.softmax();
        softmax_block_backward(
            dev,
            s,
            saved.att.input(),
            datt.input(),
            dscores.view(),
            &sm,
            d,
        )?;
        drop(datt);
        // the keys round with theirs: dQ += dS·K, dK += dSᵀ·Q
        let dq = heads()?;
        let dk = self.around_with_grad(pass, group, &saved.k, |s_, k, acc| {
            let src = self.source(s_);
            if src <= self.rank {
                let beta = if s_ == 0 { 0.0 } else { 1.0 };
                let dsk = self.product(false, false, beta, [true, false, false]);
                gemm(dev, s, &dsk, self.block_in(&dscores, src)?, k, dq.view(), d)?;
                let dsq = self.product(true, false, beta, [true, false, false]);
                let q = saved.q.input();
                gemm(dev, s, &dsq, self.block_in(&dscores, src)?, q, acc, d)?;
            }
            Ok(())
        })?;
        drop(dscores);
        let dqkv = Act::alloc(pool, rows, 3 * c, d)?;
        let shape = self.local();
        qkv_merge(
            dev,
            s,
            shape,
            dq.input(),
            dk.input(),
            dv.input(),
            dqkv.view(),
            d,
        )?;
        Ok(dqkv)
    }

    /// [`RingAttention::around`] with a gradient accumulator travelling with each block:
    /// `step(s, block, acc)` adds to the accumulator of the block it holds (the block's owner
    /// starts it at `s = 0`, with β = 0); one more message after the last step brings every
    /// accumulator home, which is returned (`[B·H, L, D]`).
    fn around_with_grad(
        &self,
        pass: &BackwardPass<'_>,
        group: &Communicator,
        own: &Act,
        mut step: impl FnMut(usize, Input<'_>, DeviceView<'_>) -> Result<()>,
    ) -> Result<Act> {
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let (rows, c, d) = (own.rows(), own.cols(), own.dtype());
        let half = own.len_bytes();
        // [block | accumulator], two of them to pass between
        let pairs = [
            Act::alloc(pool, 2 * rows, c, d)?,
            Act::alloc(pool, 2 * rows, c, d)?,
        ];
        dev.copy_d2d(s, own.view(), pairs[0].view().slice(0, half)?)?;
        let mut cur = 0;
        for k in 0..self.ranks {
            let p = &pairs[cur];
            step(
                k,
                p.view().slice(0, half)?.into(),
                p.view().slice(half, half)?,
            )?;
            if k + 1 < self.ranks {
                self.pass_on(group, s, p.view(), pairs[1 - cur].view(), d)?;
                cur = 1 - cur;
            }
        }
        let home = Act::alloc(pool, rows, c, d)?;
        let acc = pairs[cur].view().slice(half, half)?;
        if self.ranks > 1 {
            self.pass_on(group, s, acc, home.view(), d)?;
        } else {
            dev.copy_d2d(s, acc, home.view())?;
        }
        Ok(home)
    }
}

/// A [`RingAttention`] on its ring, as a block's attention core
/// ([`BlockOn::forward`](crate::nn::BlockOn::forward)).
#[derive(Clone, Copy, Debug)]
pub struct RingCore<'a> {
    /// The attention.
    pub attn: RingAttention,
    /// The ring it runs over.
    pub group: &'a Communicator,
}

impl HeadsCore for RingCore<'_> {
    fn forward(&self, pass: &ForwardPass<'_>, qkv: &Act) -> Result<(Act, HeadsCoreSaved)> {
        let (merged, saved) = self.attn.forward(pass, self.group, qkv)?;
        Ok((merged, HeadsCoreSaved::new(saved)))
    }

    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: &HeadsCoreSaved,
        dmerged: &Act,
    ) -> Result<Act> {
        self.attn.backward(
            pass,
            self.group,
            saved.get::<RingAttentionSaved>()?,
            dmerged,
        )
    }
}

fn tally(calls: usize, bytes: usize) -> Tally {
    Tally {
        calls: calls as u64,
        bytes: (calls * bytes) as u64,
    }
}

impl RingAttention {
    /// The messages of one forward and one backward in `dtype`, per rank, on the ring
    /// ([`PassCost::sequence`]): forward `2(N − 1)`
    /// sends and receives of a `[B·H, L, D]` block; backward `2(N − 1)` of a block and its
    /// accumulator and 2 of an accumulator alone.
    pub fn collectives(&self, dtype: DType) -> Cost {
        let n = self.ranks;
        let blk = self.rows() * self.channels() * dtype.size();
        let mut f = CommStats::default();
        let mut b = CommStats::default();
        if n > 1 {
            f.send = tally(2 * (n - 1), blk);
            f.recv = f.send;
            let pairs = tally(2 * (n - 1), 2 * blk);
            let home = tally(2, blk);
            b.send = pairs + home;
            b.recv = b.send;
        }
        let on_ring = |sequence| PassCost {
            sequence,
            ..PassCost::default()
        };
        Cost {
            forward: on_ring(f),
            backward: on_ring(b),
        }
    }
}
