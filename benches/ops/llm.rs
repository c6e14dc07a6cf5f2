//! GPT-2's memory-bound ops: GELU, causal softmax, fused cross-entropy, the encoder.

use tidemem::DType;

use crate::entry::{pod, token_ids, Arg, Entry};

pub fn gelu_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::{abi::GeluParams, abi::GELU_BACKWARD, abi::GELU_FORWARD};
    let n = rows * cols;
    let p = pod(&GeluParams { n: n as u64 });
    let f32 = DType::F32;
    v.push(Entry::kernel(
        "gelu_forward f32",
        8 * n,
        &GELU_FORWARD,
        p.clone(),
        vec![Arg::floats(n, 1, f32), Arg::zeros(n, f32)],
    ));
    v.push(Entry::kernel(
        "gelu_backward f32",
        12 * n,
        &GELU_BACKWARD,
        p,
        vec![
            Arg::floats(n, 1, f32),
            Arg::floats(n, 2, f32),
            Arg::zeros(n, f32),
        ],
    ));
}

/// Causal softmax over GPT-2's context (T = 1024), as many matrices as `rows × cols` elements
/// fill (at least one). Bytes: the lower triangle read (once per input), the whole matrix
/// written.
pub fn softmax_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::{abi::SoftmaxParams, abi::SOFTMAX_BACKWARD, abi::SOFTMAX_FORWARD};
    let t = 1024usize;
    let bh = (rows * cols / (t * t)).max(1);
    let n = bh * t * t;
    let tri = bh * t * (t + 1) / 2;
    let p = pod(&SoftmaxParams {
        bh: bh as u64,
        rows: t as u64,
        cols: t as u64,
        offset: 0,
        scale: 0.125,
        pad: 0,
    });
    for d in [DType::F32, DType::BF16] {
        let s = d.size();
        v.push(Entry::kernel(
            format!("softmax_forward {d} [{bh},{t},{t}]"),
            (tri + n) * s,
            &SOFTMAX_FORWARD,
            p.clone(),
            vec![Arg::floats(n, 1, d), Arg::zeros(n, d)],
        ));
        v.push(Entry::kernel(
            format!("softmax_backward {d} [{bh},{t},{t}]"),
            (2 * tri + n) * s,
            &SOFTMAX_BACKWARD,
            p.clone(),
            vec![Arg::floats(n, 1, d), Arg::floats(n, 2, d), Arg::zeros(n, d)],
        ));
    }
}

/// The causal softmax on the last of 4 row blocks of GPT-2's context (ring self-attention: 256
/// rows at offset 768 against 1024 columns), as many matrices as `rows × cols` elements fill.
/// Bytes: the live elements read (once per input), the whole block written.
pub fn softmax_block_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::{abi::SoftmaxParams, abi::SOFTMAX_BACKWARD, abi::SOFTMAX_FORWARD};
    let (r, t, offset) = (256usize, 1024usize, 768usize);
    let bh = (rows * cols / (r * t)).max(1);
    let n = bh * r * t;
    let live = bh * (0..r).map(|i| (offset + i + 1).min(t)).sum::<usize>();
    let p = pod(&SoftmaxParams {
        bh: bh as u64,
        rows: r as u64,
        cols: t as u64,
        offset: offset as u64,
        scale: 0.125,
        pad: 0,
    });
    for d in [DType::F32, DType::BF16] {
        let s = d.size();
        v.push(Entry::kernel(
            format!("softmax_forward block {d} [{bh},{r},{t}] offset {offset}"),
            (live + n) * s,
            &SOFTMAX_FORWARD,
            p.clone(),
            vec![Arg::floats(n, 1, d), Arg::zeros(n, d)],
        ));
        v.push(Entry::kernel(
            format!("softmax_backward block {d} [{bh},{r},{t}] offset {offset}"),
            (2 * live + n) * s,
            &SOFTMAX_BACKWARD,
            p.clone(),
            vec![Arg::floats(n, 1, d), Arg::floats(n, 2, d), Arg::zeros(n, d)],
        ));
    }
}

/// Fused cross-entropy on GPT-2's vocabulary (V = 50 257 padded to 50 304; 64 rows) and on a
/// small one (`rows` rows of V = `cols`). Bytes: the logits read (and written over, fused),
/// targets and losses.
pub fn cross_entropy_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::{
        abi::CrossEntropyParams, abi::CROSS_ENTROPY_FORWARD, abi::CROSS_ENTROPY_FORWARD_BACKWARD,
    };
    let cases = [
        (64usize, 50_257usize, 50_304usize, DType::BF16, true),
        (64, 50_257, 50_304, DType::F32, true),
        (64, 50_257, 50_304, DType::BF16, false),
        (rows, cols, cols, DType::F32, true),
    ];
    for (n, vocab, vp, d, fused) in cases {
        let p = pod(&CrossEntropyParams {
            n: n as u64,
            v: vocab as u64,
            vp: vp as u64,
            ignore_index: -100,
            grad_scale: 1.0 / n as f32,
        });
        let targets = bytemuck::cast_slice(&token_ids(n, vocab)).to_vec();
        let logits = crate::entry::floats_as(n * vp, 3, d);
        let (desc, name, logit_bytes, logits) = if fused {
            (
                &CROSS_ENTROPY_FORWARD_BACKWARD,
                "cross_entropy_forward_backward",
                2 * n * vp * d.size(),
                Arg::Write(logits, d),
            )
        } else {
            (
                &CROSS_ENTROPY_FORWARD,
                "cross_entropy_forward",
                n * vocab * d.size(),
                Arg::Read(logits, d),
            )
        };
        v.push(Entry::kernel(
            format!("{name} {d} [{n},{vocab}/{vp}]"),
            logit_bytes + 8 * n,
            desc,
            p,
            vec![
                logits,
                Arg::Read(targets, DType::I32),
                Arg::zeros(n, DType::F32),
            ],
        ));
    }
}

/// The encoder on `rows` positions (sequences of T = 1024, or fewer) of C = `cols` channels,
/// V = 50 257. Bytes: forward, tokens and the gathered wte rows read, wpe's T rows read, out
/// written; backward, dout and the plan read, the touched dwte rows and dwpe's T rows read
/// and written; the plan (host code), tokens read and plan words written.
pub fn encoder_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::EncoderPlan;
    use tidemem::ops::{
        abi::EncoderBackwardParams, abi::EncoderParams, abi::ENCODER_BACKWARD, abi::ENCODER_FORWARD,
    };
    let (vocab, c) = (50_257usize, cols);
    let t = rows.min(1024);
    let n = rows / t * t;
    let tokens = token_ids(n, vocab);
    let tok_bytes: Vec<u8> = bytemuck::cast_slice(&tokens).to_vec();
    let plan = EncoderPlan::new(&tokens, vocab).expect("tokens in range");
    let words: Vec<u8> = bytemuck::cast_slice(&plan.to_words()).to_vec();
    v.push(Entry::host(
        format!("encoder_plan [{n}] of {vocab}"),
        4 * n + 4 * plan.words(),
        move || {
            std::hint::black_box(EncoderPlan::new(&tokens, vocab).expect("tokens in range"));
        },
    ));
    for d in [DType::F32, DType::BF16] {
        let s = d.size();
        let fp = EncoderParams {
            n: n as u64,
            t: t as u64,
            c: c as u64,
            v: vocab as u64,
            max_t: t as u64,
        };
        v.push(Entry::kernel(
            format!("encoder_forward {d} [{n},{c}]"),
            4 * n + (2 * n + t) * c * s,
            &ENCODER_FORWARD,
            pod(&fp),
            vec![
                Arg::Read(tok_bytes.clone(), DType::I32),
                Arg::floats(vocab * c, 4, d),
                Arg::floats(t * c, 5, d),
                Arg::zeros(n * c, d),
            ],
        ));
        let bp = EncoderBackwardParams {
            n: n as u64,
            t: t as u64,
            c: c as u64,
            v: vocab as u64,
            max_t: t as u64,
            distinct: plan.distinct() as u64,
        };
        v.push(Entry::kernel(
            format!("encoder_backward {d} [{n},{c}] {} rows", plan.distinct()),
            words.len() + (n + 2 * plan.distinct() + 2 * t) * c * s,
            &ENCODER_BACKWARD,
            pod(&bp),
            vec![
                Arg::floats(n * c, 6, d),
                Arg::Read(words.clone(), DType::U32),
                Arg::zeros(vocab * c, d),
                Arg::zeros(t * c, d),
            ],
        ));
    }
}
