//! Causal multi-head self-attention on the device, composed of the ops below it: the layouts
//! of [`heads`](crate::ops::heads), two strided batched [`gemm`](fn@crate::ops::gemm)s around the
//! causal [`softmax_forward`], as llm.c runs it without cuDNN:
//!
//! ```text
//! forward:  qkv [B,T,3C] ─qkv_split→ q,k,v [B,H,T,D]
//!           scores = q·kᵀ        (BH GEMMs of T×T×D)
//!           att = softmax_causal(scores / √D)
//!           y = att·v            (BH GEMMs of T×D×T)
//!           out [B,T,C] ←heads_merge─ y
//! backward: dy ←heads_split─ dout
//!           datt = dy·vᵀ,  dv = attᵀ·dy
//!           dscores = softmax_backward(att, datt)
//!           dq = dscores·k,  dk = dscoresᵀ·q
//!           dqkv ←qkv_merge─ dq, dk, dv
//! ```
//!
//! Every buffer is the caller's (a layer takes them from the non-model pool, so the tide sees
//! them); [`Attention`] gives their sizes. `q`, `k`, `v` and `att` are what backward needs
//! from forward; the rest is scratch. All of one element type (f32, f16, bf16), GEMMs and the
//! softmax statistics in f32. The scores are computed over the whole `T × T` square (the
//! softmax reads only the causal half): a fused kernel would skip the upper half; this path is
//! its reference.
//!
//! ```
//! use tidemem::device::{Device, SimConfig};
//! use tidemem::ops::attention::{Attention, AttentionForward};
//! use tidemem::ops::heads::Heads;
//! use tidemem::DType;
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let s = dev.new_stream()?;
//! let a = Attention::new(Heads::new(1, 2, 1, 2)); // B = 1, T = 2, H = 1, D = 2
//! let f = DType::F32;
//! // Token 0 attends only to itself: its output is its own value vector.
//! let qkv: [f32; 12] = [1.0, 0.0, 1.0, 0.0, 3.0, 4.0, 0.0, 1.0, 0.0, 1.0, 5.0, 6.0];
//! let qkv = dev.upload(&s, bytemuck::cast_slice(&qkv))?;
//! let [q, k, v, y] = [(); 4].map(|_| dev.alloc(a.head_bytes(f)).unwrap());
//! let [scores, att] = [(); 2].map(|_| dev.alloc(a.scores_bytes(f)).unwrap());
//! let out = dev.alloc(a.out_bytes(f))?;
//! let bufs = AttentionForward {
//!     qkv: (&qkv).into(),
//!     q: (&q).into(),
//!     k: (&k).into(),
//!     v: (&v).into(),
//!     scores: (&scores).into(),
//!     att: (&att).into(),
//!     y: (&y).into(),
//!     out: (&out).into(),
//! };
//! a.forward(&dev, &s, bufs, f)?;
//! let out: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &out)?);
//! assert_eq!(&out[..2], &[3.0, 4.0]);
//! # Ok(()) }
//! ```

use crate::device::{Device, DeviceView, Input, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::gemm::{gemm, Gemm};
use crate::ops::heads::{heads_merge, heads_split, qkv_merge, qkv_split, Heads};
use crate::ops::softmax::{softmax_backward, softmax_forward};

/// One causal self-attention of shape `[B, T, H, D]` (`C = H·D` channels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attention {
    /// The shape.
    pub shape: Heads,
}

/// The buffers of [`Attention::forward`], all of the op's element type.
#[derive(Clone, Copy, Debug)]
pub struct AttentionForward<'a> {
    /// `[B, T, 3C]`: queries, keys and values side by side (the fused projection's output).
    pub qkv: Input<'a>,
    /// `[B, H, T, D]`, kept for backward.
    pub q: DeviceView<'a>,
    /// `[B, H, T, D]`, kept for backward.
    pub k: DeviceView<'a>,
    /// `[B, H, T, D]`, kept for backward.
    pub v: DeviceView<'a>,
    /// `[B, H, T, T]` scratch: the scores before the softmax.
    pub scores: DeviceView<'a>,
    /// `[B, H, T, T]`, kept for backward: the attention probabilities.
    pub att: DeviceView<'a>,
    /// `[B, H, T, D]` scratch.
    pub y: DeviceView<'a>,
    /// `[B, T, C]`: the output.
    pub out: DeviceView<'a>,
}

/// The buffers of [`Attention::backward`], all of the op's element type.
#[derive(Clone, Copy, Debug)]
pub struct AttentionBackward<'a> {
    /// `[B, T, C]`: the output's gradient.
    pub dout: Input<'a>,
    /// `[B, H, T, D]` from forward.
    pub q: Input<'a>,
    /// `[B, H, T, D]` from forward.
    pub k: Input<'a>,
    /// `[B, H, T, D]` from forward.
    pub v: Input<'a>,
    /// `[B, H, T, T]` from forward.
    pub att: Input<'a>,
    /// `[B, H, T, D]` scratch.
    pub dy: DeviceView<'a>,
    /// `[B, H, T, T]` scratch.
    pub datt: DeviceView<'a>,
    /// `[B, H, T, T]` scratch.
    pub dscores: DeviceView<'a>,
    /// `[B, H, T, D]` scratch.
    pub dq: DeviceView<'a>,
    /// `[B, H, T, D]` scratch.
    pub dk: DeviceView<'a>,
    /// `[B, H, T, D]` scratch.
    pub dv: DeviceView<'a>,
    /// `[B, T, 3C]`: the gradient of `qkv` (written, not accumulated).
    pub dqkv: DeviceView<'a>,
}

impl Attention {
    /// The attention of shape `shape`.
    pub fn new(shape: Heads) -> Self {
        Attention { shape }
    }

    fn dims(&self) -> Result<(usize, usize, usize)> {
        let s = &self.shape;
        let bad = || Error::Overflow {
            what: format!("attention shape {s:?}"),
        };
        s.elems().ok_or_else(bad)?;
        let bh = usize::try_from(s.batch * s.heads).map_err(|_| bad())?;
        let t = usize::try_from(s.seq).map_err(|_| bad())?;
        let d = usize::try_from(s.head_dim).map_err(|_| bad())?;
        bh.checked_mul(t)
            .and_then(|x| x.checked_mul(t))
            .ok_or_else(bad)?;
        Ok((bh, t, d))
    }

    /// Bytes of one `[B, H, T, D]` buffer (`q`, `k`, `v`, `y` and their gradients).
    pub fn head_bytes(&self, dtype: DType) -> usize {
        self.shape.elems().unwrap_or(usize::MAX / 4) * dtype.size()
    }

    /// Bytes of one `[B, H, T, T]` buffer (`scores`, `att` and their gradients).
    pub fn scores_bytes(&self, dtype: DType) -> usize {
        self.dims()
            .map_or(usize::MAX / 4, |(bh, t, _)| bh * t * t * dtype.size())
    }

    /// Bytes of `out` (`[B, T, C]`); `qkv` holds three times as many.
    pub fn out_bytes(&self, dtype: DType) -> usize {
        self.head_bytes(dtype)
    }

    /// The softmax scale `1/√D`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.shape.head_dim.max(1) as f32).sqrt()
    }

    /// `scores[bh] = a[bh]·b[bh]ᵀ`-like batched products of this shape: `(m, n, k)` with
    /// `trans_a`/`trans_b` over the `BH` matrices, each packed.
    fn batched(&self, (m, n, k): (usize, usize, usize), ta: bool, tb: bool) -> Result<Gemm> {
        let (bh, _, _) = self.dims()?;
        Ok(Gemm::new(m, n, k)
            .trans_a(ta)
            .trans_b(tb)
            .batched(bh, m * k, k * n, m * n))
    }

    /// The forward pass on `stream`: `out` and the buffers kept for backward.
    pub fn forward(
        &self,
        dev: &Device,
        stream: &Stream,
        b: AttentionForward<'_>,
        dtype: DType,
    ) -> Result<()> {
        let (_, t, d) = self.dims()?;
        qkv_split(dev, stream, self.shape, b.qkv, b.q, b.k, b.v, dtype)?;
        let qk = self.batched((t, t, d), false, true)?;
        gemm(dev, stream, &qk, b.q, b.k, b.scores, dtype)?;
        let (bh, _, _) = self.dims()?;
        softmax_forward(dev, stream, b.scores, b.att, bh, t, self.scale(), dtype)?;
        let av = self.batched((t, d, t), false, false)?;
        gemm(dev, stream, &av, b.att, b.v, b.y, dtype)?;
        heads_merge(dev, stream, self.shape, b.y, b.out, dtype)
    }

    /// The backward pass on `stream`: `dqkv` from `dout` and what forward kept.
    pub fn backward(
        &self,
        dev: &Device,
        stream: &Stream,
        b: AttentionBackward<'_>,
        dtype: DType,
    ) -> Result<()> {
        let (bh, t, d) = self.dims()?;
        heads_split(dev, stream, self.shape, b.dout, b.dy, dtype)?;
        // datt = dy·vᵀ ; dv = attᵀ·dy
        gemm(
            dev,
            stream,
            &self.batched((t, t, d), false, true)?,
            b.dy,
            b.v,
            b.datt,
            dtype,
        )?;
        gemm(
            dev,
            stream,
            &self.batched((t, d, t), true, false)?,
            b.att,
            b.dy,
            b.dv,
            dtype,
        )?;
        softmax_backward(
            dev,
            stream,
            b.att,
            b.datt,
            b.dscores,
            bh,
            t,
            self.scale(),
            dtype,
        )?;
        // dq = dscores·k ; dk = dscoresᵀ·q
        let (ds, q, k) = (Input::from(b.dscores), b.q, b.k);
        gemm(
            dev,
            stream,
            &self.batched((t, d, t), false, false)?,
            ds,
            k,
            b.dq,
            dtype,
        )?;
        gemm(
            dev,
            stream,
            &self.batched((t, d, t), true, false)?,
            ds,
            q,
            b.dk,
            dtype,
        )?;
        qkv_merge(dev, stream, self.shape, b.dq, b.dk, b.dv, b.dqkv, dtype)
    }
}
