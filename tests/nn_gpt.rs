//! A tiny GPT-2 on a chunk manager: the embedding (`wte`, `wpe`) → one transformer block →
//! the final LayerNorm → the LM head tied to `wte` with the mean cross-entropy. The loss and
//! every parameter gradient (`wte`'s the sum of the embedding's and the head's shares) against
//! an f64 reference written here, on the simulated device and on CUDA when present (the
//! emulator in CI, with `TIDEMEM_REQUIRE_CUDA=1`).

mod common;
mod nn_ref;

use tidemem::nn::{Block, BlockOn, Embedding, LayerNorm, LmHead};
use tidemem::prelude::*;

use nn_ref::*;

/// Batch, sequence, channels, heads (head size `C/H`), vocabulary, positions.
const B: usize = 2;
const T: usize = 4;
const C: usize = 8;
const NH: usize = 2;
const V: usize = 11;
const MAX_T: usize = 6;
const N: usize = B * T;
const EPS: f32 = 1e-5;
const IGNORE: i32 = -100;

// Tolerances, as `close` measures them (relative to the element plus the tensor's largest
// magnitude). f32: 1e-5 (measured 6.8e-7 on the simulated device). f16 (2⁻¹¹ per rounding):
// every activation, the logits and their gradient rounded at each stage, 5e-3 (measured
// 1.4e-3). bf16 (2⁻⁸ per rounding): 3e-2 (measured 8.4e-3).
const TOL_F32: f64 = 1e-5;
const TOL_F16: f64 = 5e-3;
const TOL_BF16: f64 = 3e-2;

const CASES: [(DType, f64); 3] = [
    (DType::F32, TOL_F32),
    (DType::F16, TOL_F16),
    (DType::BF16, TOL_BF16),
];

/// The model's f64 reference from its parameters (`[wte, wpe, block's 12…, γ_f, β_f]`):
/// `(loss, grads)` in the same order.
fn gpt_ref(p: &[Vec<f64>], tokens: &[i32], targets: &[i32]) -> (f64, Vec<Vec<f64>>) {
    let (wte, wpe, pb, gf, bf) = (&p[0], &p[1], &p[2..14], &p[14], &p[15]);
    let x = embed_ref(wte, wpe, tokens);
    let (out, _, _) = block_ref(pb, &x, &vec![0.0; N * C]);
    let (hf, nf, rf) = ln(&out, gf, bf);
    let head = lm_head_ref(&hf, wte, targets, V);
    let [dout, dgf, dbf] = ln_bwd(&head.dh, &nf, &rf, gf);
    let (_, dx, gb) = block_ref(pb, &x, &dout);
    let mut dwte = head.dwte;
    let dwpe = embed_bwd(&dx, tokens, &mut dwte, MAX_T);
    let mut grads = vec![dwte, dwpe];
    grads.extend(gb);
    grads.extend([dgf, dbf]);
    (head.loss, grads)
}

struct Gpt {
    emb: Embedding,
    blk: Block,
    ln_f: LayerNorm,
    head: LmHead,
}

impl Gpt {
    fn new(m: &mut ChunkManager) -> Gpt {
        let emb = Embedding::register(m, V, MAX_T, C, None).unwrap();
        let blk = block_layer(m, "h.0");
        let ln_f = lnorm(m, "ln_f", 24);
        let head = LmHead::tied(m, emb.wte, IGNORE).unwrap();
        Gpt {
            emb,
            blk,
            ln_f,
            head,
        }
    }

    fn params(&self) -> Vec<TensorId> {
        let mut v = self.emb.params();
        v.extend(self.blk.params());
        v.extend([self.ln_f.gamma, self.ln_f.beta]);
        v
    }

    /// One forward and backward: the loss.
    fn step(&self, m: &mut ChunkManager, tokens: &[i32], targets: &[i32]) -> Result<f32> {
        let fwd = m.forward()?;
        let (x, emb_saved) = self.emb.forward(&fwd, tokens, B, T)?;
        let (out, blk_saved) = self.blk.forward(&fwd, &x, [B, T], None)?;
        let (hf, ln_saved) = self.ln_f.forward(&fwd, &out, None)?;
        let (loss, head_saved) = self.head.forward(&fwd, &hf, targets)?;
        fwd.finish()?;
        let mut bwd = m.backward()?;
        let dhf = self.head.backward(&bwd, &head_saved)?;
        let dout = self.ln_f.backward(&bwd, &ln_saved, &dhf, None)?;
        let dx = self.blk.backward(&mut bwd, &blk_saved, &dout, None)?;
        self.emb.backward(&bwd, &emb_saved, &dx)?;
        bwd.finish()?;
        Ok(loss)
    }
}

const TOKENS: [i32; N] = [3, 7, 3, 0, 10, 7, 7, 2];
const TARGETS: [i32; N] = [7, 3, 0, IGNORE, 7, 7, 2, 10];

#[test]
fn gpt_loss_and_gradients_match_an_f64_reference() {
    for dev in common::devices("nn_gpt::gpt") {
        for (d, tol) in CASES {
            let mut m = manager(dev.clone(), d);
            let gpt = Gpt::new(&mut m);
            let ids = gpt.params();
            assert_eq!(ids.len(), 16);
            let p = read_all(&mut m, &ids);
            let (want_loss, want) = gpt_ref(&p, &TOKENS, &TARGETS);
            let loss = gpt.step(&mut m, &TOKENS, &TARGETS).unwrap();
            let name = format!("gpt {} {d}", dev.name());
            let mut worst = close(&format!("{name}: loss"), &[loss], &[want_loss], tol);
            for (k, (id, w)) in ids.iter().zip(&want).enumerate() {
                let g = m.read(*id).unwrap();
                worst = worst.max(close(
                    &format!("{name}: grad {k} (tensor {id})"),
                    &g,
                    w,
                    tol,
                ));
            }
            eprintln!("{name}: loss {loss}, worst error {worst:.2e} (bound {tol:.0e})");
        }
    }
}

/// Bad tokens, sequences and targets are typed errors before anything runs.
#[test]
fn bad_input_is_refused() {
    let dev = Device::sim(SimConfig::with_capacity(1 << 22)).unwrap();
    let mut m = manager(dev, DType::F32);
    let gpt = Gpt::new(&mut m);
    let fwd = m.forward().unwrap();
    let bad_tok = [0, 1, 2, V as i32];
    assert!(matches!(
        gpt.emb.forward(&fwd, &bad_tok, 1, 4),
        Err(Error::TokenOutOfRange {
            token,
            position: 3,
            vocab: V
        }) if token == V as i64
    ));
    assert!(gpt.emb.forward(&fwd, &[0, 1, 2, -1], 1, 4).is_err());
    assert!(
        matches!(
            gpt.emb.forward(&fwd, &[0; 7], 1, 7),
            Err(Error::SeqTooLong { seq: 7, max: MAX_T })
        ),
        "seq > max_seq"
    );
    assert!(
        matches!(
            gpt.emb.forward(&fwd, &[0; 3], 1, 4),
            Err(Error::Length {
                got: 3,
                expected: 4,
                ..
            })
        ),
        "length"
    );
    let (x, _) = gpt.emb.forward(&fwd, &[0, 1, 2, 3], 1, 4).unwrap();
    assert!(gpt.head.forward(&fwd, &x, &[0, 1, 2, V as i32]).is_err());
    assert!(gpt.head.forward(&fwd, &x, &[0, 1, 2]).is_err());
    let (loss, _) = gpt.head.forward(&fwd, &x, &[0, IGNORE, 2, 3]).unwrap();
    assert!(loss.is_finite());
    fwd.finish().unwrap();
}

#[test]
fn embedding_registers_gpt2_names() {
    let dev = Device::sim(SimConfig::with_capacity(1 << 22)).unwrap();
    let mut m = manager(dev, DType::F32);
    let emb = Embedding::register(&mut m, V, MAX_T, C, None).unwrap();
    assert_eq!(m.tensor_shape(emb.wte).unwrap(), [V, C]);
    assert_eq!(m.tensor_shape(emb.wpe).unwrap(), [MAX_T, C]);
    assert!(Embedding::register(&mut m, 0, MAX_T, C, None).is_err());
    let head = LmHead::tied(&m, emb.wte, IGNORE).unwrap();
    assert_eq!(head.vocab(), V);
}
