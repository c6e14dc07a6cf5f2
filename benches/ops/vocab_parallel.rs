//! The vocab-parallel ops on rank 0 of 2 of GPT-2's vocabulary (V = 50 257: V_r = 25 128,
//! logits padded to 25 152): the masked embedding and its backward, the three cross-entropy
//! steps.

use tidemem::ops::{vocab_parallel::VocabPlan, vocab_parallel::VocabShard};
use tidemem::DType;

use crate::entry::{floats_as, pod, token_ids, Arg, Entry};

const VOCAB: usize = 50_257;

/// The embedding on `rows` positions of C = `cols` channels. Bytes: forward, tokens read, the
/// owned positions' table rows read, out written; backward, dout's owned rows and the plan
/// read, the touched rows read and written (accumulating) or the whole local gradient written
/// (writing).
pub fn vocab_parallel_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::{
        abi::VocabEmbeddingBackwardParams, abi::VocabEmbeddingParams,
        abi::VOCAB_EMBEDDING_BACKWARD, abi::VOCAB_EMBEDDING_FORWARD,
    };
    let (n, c) = (rows, cols);
    let shard = VocabShard::of_rank(VOCAB, 0, 2).expect("a valid shard");
    let tokens = token_ids(n, VOCAB);
    let plan = VocabPlan::new(&tokens, &shard).expect("tokens in range");
    let words: Vec<u8> = bytemuck::cast_slice(&plan.to_words()).to_vec();
    let (owned, distinct) = (plan.owned(), plan.distinct());
    for d in [DType::F32, DType::BF16] {
        let s = d.size();
        let fp = VocabEmbeddingParams {
            n: n as u64,
            c: c as u64,
            rows: shard.rows as u64,
            start: 0,
            vocab: VOCAB as u64,
        };
        v.push(Entry::kernel(
            format!("vocab_embedding_forward {d} [{n},{c}]"),
            4 * n + (owned + n) * c * s,
            &VOCAB_EMBEDDING_FORWARD,
            pod(&fp),
            vec![
                Arg::Read(bytemuck::cast_slice(&tokens).to_vec(), DType::I32),
                Arg::floats(shard.rows * c, 4, d),
                Arg::zeros(n * c, d),
            ],
        ));
        for accumulate in [true, false] {
            let bp = VocabEmbeddingBackwardParams {
                n: n as u64,
                c: c as u64,
                rows: shard.rows as u64,
                distinct: distinct as u64,
                owned: owned as u64,
                accumulate: accumulate as u32,
                pad: 0,
            };
            let (mode, grad) = if accumulate {
                ("accumulate", 2 * distinct)
            } else {
                ("write", shard.rows)
            };
            v.push(Entry::kernel(
                format!("vocab_embedding_backward {mode} {d} [{n},{c}] {distinct} rows"),
                words.len() + (owned + grad) * c * s,
                &VOCAB_EMBEDDING_BACKWARD,
                pod(&bp),
                vec![
                    Arg::floats(n * c, 6, d),
                    Arg::Read(words.clone(), DType::U32),
                    Arg::zeros(shard.rows * c, d),
                ],
            ));
        }
    }
    ce_entries(v, &shard);
}

/// The three cross-entropy steps on 128 rows of the shard's logits. Bytes: the logits read
/// (and, by the gradient, written over, padding included) and the `[N]` operands.
fn ce_entries(v: &mut Vec<Entry>, shard: &VocabShard) {
    use tidemem::ops::{
        abi::VocabCeParams, abi::VOCAB_CE_GRAD, abi::VOCAB_CE_MAX, abi::VOCAB_CE_SUMS,
    };
    let (n, vr, vp) = (128usize, shard.rows, shard.rows.next_multiple_of(64));
    let p = pod(&VocabCeParams {
        n: n as u64,
        rows: vr as u64,
        stride: vp as u64,
        start: 0,
        vocab: VOCAB as u64,
        ignore_index: -100,
        grad_scale: 1.0 / n as f32,
    });
    let targets = Arg::Read(
        bytemuck::cast_slice(&token_ids(n, VOCAB)).to_vec(),
        DType::I32,
    );
    let stat = |x: f32| Arg::Read(bytemuck::cast_slice(&vec![x; n]).to_vec(), DType::F32);
    let f32 = DType::F32;
    for d in [DType::BF16, DType::F32] {
        let s = d.size();
        let logits = floats_as(n * vp, 3, d);
        let name = |step: &str| format!("{step} {d} [{n},{vr}/{vp}]");
        v.push(Entry::kernel(
            name("vocab_ce_max"),
            n * vr * s + 4 * n,
            &VOCAB_CE_MAX,
            p.clone(),
            vec![Arg::Read(logits.clone(), d), Arg::zeros(n, f32)],
        ));
        v.push(Entry::kernel(
            name("vocab_ce_sums"),
            n * vr * s + 16 * n,
            &VOCAB_CE_SUMS,
            p.clone(),
            vec![
                Arg::Read(logits.clone(), d),
                clone_arg(&targets),
                stat(2.0),
                Arg::zeros(n, f32),
                Arg::zeros(n, f32),
            ],
        ));
        v.push(Entry::kernel(
            name("vocab_ce_grad"),
            n * (vr + vp) * s + 24 * n,
            &VOCAB_CE_GRAD,
            p.clone(),
            vec![
                Arg::Write(logits, d),
                clone_arg(&targets),
                stat(2.0),
                stat(3000.0),
                stat(-1.0),
                Arg::zeros(n, f32),
            ],
        ));
    }
}

fn clone_arg(a: &Arg) -> Arg {
    match a {
        Arg::Read(b, d) => Arg::Read(b.clone(), *d),
        Arg::Write(b, d) => Arg::Write(b.clone(), *d),
        Arg::Absent => Arg::Absent,
    }
}
