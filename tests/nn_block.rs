//! GPT-2's transformer block on a chunk manager: causal self-attention alone, the MLP alone,
//! then the whole pre-LayerNorm block, each one forward and backward against an f64 reference
//! written here (the output, the input's gradient and every parameter gradient, read from its
//! slot). On the simulated device and on CUDA when present (the emulator in CI, with
//! `TIDEMEM_REQUIRE_CUDA=1`).

mod common;
mod nn_ref;

use tidemem::nn::{Act, Block, BlockOn, CausalSelfAttention, Serial};
use tidemem::prelude::*;
use tidemem::{decode_f32, encode_f32};

use nn_ref::*;
use tidemem::rng::{Rng, SplitMix64};
use tidemem::store::{BackwardPass, ForwardPass};

/// Batch, sequence, channels, heads (head size `C/H`).
const B: usize = 2;
const T: usize = 5;
const C: usize = 8;
const NH: usize = 2;
const N: usize = B * T;
const EPS: f32 = 1e-5;

// Tolerances, as `close` measures them (relative to the element plus the tensor's largest
// magnitude). f32: storage and math in f32 against f64, 1e-5 (measured 2.3e-7 for the block on
// the simulated device). f16 (2⁻¹¹ per rounding): every activation, the attention's q, k, v,
// probabilities and their gradients are rounded at each stage, 5e-3 (measured 6.3e-4). bf16
// (2⁻⁸ per rounding): 3e-2 (measured 5.9e-3).
const TOL_F32: f64 = 1e-5;
const TOL_F16: f64 = 5e-3;
const TOL_BF16: f64 = 3e-2;

const CASES: [(DType, f64); 3] = [
    (DType::F32, TOL_F32),
    (DType::F16, TOL_F16),
    (DType::BF16, TOL_BF16),
];

/// Values of `dtype` (uniform in ±`scale`), as f32.
fn data(len: usize, seed: u64, scale: f32, dtype: DType) -> Vec<f32> {
    let mut r = SplitMix64::new(seed);
    let v: Vec<f32> = (0..len).map(|_| r.uniform_f32(-scale, scale)).collect();
    decode_f32(&encode_f32(&v, dtype), dtype)
}

/// Reference output, input gradient and parameter gradients.
type Expect = (Vec<f64>, Vec<f64>, Vec<Vec<f64>>);

/// One forward and backward of a layer on `x` and `dy`: `(y, dx)` as f32.
type Layer<'a> = &'a dyn Fn(&ForwardPass<'_>, &Act) -> Result<(Act, Box<dyn std::any::Any>)>;
type LayerBack<'a> = &'a dyn Fn(&mut BackwardPass<'_>, &dyn std::any::Any, &Act) -> Result<Act>;

fn run(
    m: &mut ChunkManager,
    fwd_fn: Layer,
    bwd_fn: LayerBack,
    x: &[f32],
    dy: &[f32],
) -> Result<[Vec<f32>; 2]> {
    let d = m.param_dtype();
    let fwd = m.forward()?;
    let xa = Act::upload(fwd.pool(), fwd.stream(), N, C, d, x)?;
    let (y, saved) = fwd_fn(&fwd, &xa)?;
    let y = y.to_f32(fwd.stream())?;
    fwd.finish()?;
    let mut bwd = m.backward()?;
    let dya = Act::upload(bwd.pool(), bwd.stream(), N, C, d, dy)?;
    let dx = bwd_fn(&mut bwd, saved.as_ref(), &dya)?;
    assert!(!dx.same_memory(&dya), "dy is left as it was");
    let dx = dx.to_f32(bwd.stream())?;
    assert_eq!(dya.to_f32(bwd.stream())?, dy, "dy is left as it was");
    bwd.finish()?;
    Ok([y, dx])
}

/// Checks `(y, dx)` and the gradients of `ids` against `want` at `tol`.
fn compare(
    name: &str,
    m: &mut ChunkManager,
    ids: &[TensorId],
    got: [Vec<f32>; 2],
    want: Expect,
    tol: f64,
) {
    let (want_y, want_dx, want_g) = want;
    let mut worst = close(&format!("{name}: y"), &got[0], &want_y, tol);
    worst = worst.max(close(&format!("{name}: dx"), &got[1], &want_dx, tol));
    for (k, (id, w)) in ids.iter().zip(&want_g).enumerate() {
        let g = m.read(*id).unwrap();
        worst = worst.max(close(
            &format!("{name}: grad {k} (tensor {id})"),
            &g,
            w,
            tol,
        ));
    }
    eprintln!("{name}: worst error {worst:.2e} (bound {tol:.0e})");
}

fn inputs(d: DType) -> (Vec<f32>, Vec<f32>) {
    (data(N * C, 10, 1.5, d), data(N * C, 11, 1.0, d))
}

#[test]
fn attention_matches_an_f64_reference() {
    for dev in common::devices("nn_block::attention") {
        for (d, tol) in CASES {
            let mut m = manager(dev.clone(), d);
            let a = attn_layer(&mut m, "attn");
            let ids = a.params();
            let p = read_all(&mut m, &ids);
            let (x, dy) = inputs(d);
            let want = attn_ref(&p, &f64s(&x), &f64s(&dy));
            let got = run(
                &mut m,
                &|f, x| a.forward(f, x, B, T).map(|(y, s)| (y, Box::new(s) as _)),
                &|b, s, dy| a.backward(b, s.downcast_ref().unwrap(), dy),
                &x,
                &dy,
            )
            .unwrap();
            compare(
                &format!("attention {} {d}", dev.name()),
                &mut m,
                &ids,
                got,
                want,
                tol,
            );
        }
    }
}

#[test]
fn mlp_matches_an_f64_reference() {
    for dev in common::devices("nn_block::mlp") {
        for (d, tol) in CASES {
            let mut m = manager(dev.clone(), d);
            let l = mlp_layer(&mut m, "mlp");
            let ids = l.params();
            let p = read_all(&mut m, &ids);
            let (x, dy) = inputs(d);
            let want = mlp_ref(&p, &f64s(&x), &f64s(&dy));
            let got = run(
                &mut m,
                &|f, x| l.forward(f, x).map(|(y, s)| (y, Box::new(s) as _)),
                &|b, s, dy| l.backward(b, s.downcast_ref().unwrap(), dy),
                &x,
                &dy,
            )
            .unwrap();
            compare(
                &format!("mlp {} {d}", dev.name()),
                &mut m,
                &ids,
                got,
                want,
                tol,
            );
        }
    }
}

#[test]
fn block_matches_an_f64_reference() {
    for dev in common::devices("nn_block::block") {
        for (d, tol) in CASES {
            let mut m = manager(dev.clone(), d);
            let blk = block_layer(&mut m, "h.0");
            let ids = blk.params();
            assert_eq!(ids.len(), 12);
            let p = read_all(&mut m, &ids);
            let (x, dy) = inputs(d);
            let want = block_ref(&p, &f64s(&x), &f64s(&dy));
            let got = run(
                &mut m,
                &|f, x| {
                    let (y, s) = blk.forward(f, x, [B, T], None)?;
                    Ok((y, Box::new(s) as _))
                },
                &|b, s, dy| blk.backward(b, s.downcast_ref().unwrap(), dy, None),
                &x,
                &dy,
            )
            .unwrap();
            compare(
                &format!("block {} {d}", dev.name()),
                &mut m,
                &ids,
                got,
                want,
                tol,
            );
        }
    }
}

/// `Block::register` gives GPT-2's parameter names and shapes; bad shapes are typed errors.
#[test]
fn block_registers_gpt2_names() {
    let mut m = manager(common::sim(1 << 20), DType::F32);
    let init = |name: &str| Block::default_init(name, C);
    let blk = Block::register(&mut m, Serial, "h.3", [C, NH], EPS, &init).unwrap();
    let names = [
        ("h.3.ln_1.weight", vec![C]),
        ("h.3.ln_1.bias", vec![C]),
        ("h.3.attn.c_attn.weight", vec![3 * C, C]),
        ("h.3.attn.c_attn.bias", vec![3 * C]),
        ("h.3.attn.c_proj.weight", vec![C, C]),
        ("h.3.attn.c_proj.bias", vec![C]),
        ("h.3.ln_2.weight", vec![C]),
        ("h.3.ln_2.bias", vec![C]),
        ("h.3.mlp.c_fc.weight", vec![4 * C, C]),
        ("h.3.mlp.c_fc.bias", vec![4 * C]),
        ("h.3.mlp.c_proj.weight", vec![C, 4 * C]),
        ("h.3.mlp.c_proj.bias", vec![C]),
    ];
    for (id, (_name, shape)) in blk.params().into_iter().zip(names.clone()) {
        assert_eq!(m.tensor_shape(id).unwrap(), shape.as_slice());
    }
    let named: Vec<String> = blk.named_params("h.3").into_iter().map(|n| n.0).collect();
    assert_eq!(named, names.map(|n| n.0.to_string()));
    assert!(CausalSelfAttention::register(&mut m, "bad", C, 3, None).is_err());
    assert!(CausalSelfAttention::register(&mut m, "bad0", C, 0, None).is_err());

    // a row count that is not batch × sequence is refused before anything runs
    let fwd = m.forward().unwrap();
    let x = Act::upload(
        fwd.pool(),
        fwd.stream(),
        N,
        C,
        DType::F32,
        &data(N * C, 5, 1.0, DType::F32),
    )
    .unwrap();
    let attn = CausalSelfAttention {
        c_attn: blk.c_attn,
        c_proj: blk.attn_proj,
        heads: NH,
    };
    assert!(matches!(
        attn.forward(&fwd, &x, B, T + 1),
        Err(Error::Length { got: N, expected, .. }) if expected == B * (T + 1)
    ));
    assert!(matches!(
        blk.forward(&fwd, &x, [3, T], None),
        Err(Error::Length { got: N, expected, .. }) if expected == 3 * T
    ));
    let (_, saved) = blk.forward(&fwd, &x, [B, T], None).unwrap();
    assert_eq!(saved.h1().shape(), [N, C]);
    fwd.finish().unwrap();

    // a gradient of the wrong shape or type is refused; the pass goes on
    let mut bwd = m.backward().unwrap();
    let up = |bwd: &BackwardPass<'_>, rows, cols, d| {
        let v = data(rows * cols, 6, 1.0, d);
        Act::upload(bwd.pool(), bwd.stream(), rows, cols, d, &v).unwrap()
    };
    let bad_shapes = [
        (N - 1, C, DType::F32),
        (N, C + 1, DType::F32),
        (N, C, DType::F16),
    ];
    for (rows, cols, d) in bad_shapes {
        let bad = up(&bwd, rows, cols, d);
        let err = blk.backward(&mut bwd, &saved, &bad, None).unwrap_err();
        assert!(matches!(err, Error::ActivationShape { .. }), "{err}");
    }
    let good = up(&bwd, N, C, DType::F32);
    let dx = blk.backward(&mut bwd, &saved, &good, None).unwrap();
    assert_eq!(dx.shape(), [N, C]);
    bwd.finish().unwrap();
}
