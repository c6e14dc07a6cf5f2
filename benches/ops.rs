//! Memory-bound ops on the CPU against a copy of the same bytes.
//!
//! Each op's CPU twin (what the simulated device runs) is timed on host buffers of GPT-2-small
//! activation size (B·T = 4096 rows of C = 768 by default), against `copy_from_slice` moving
//! the same number of bytes (half read, half written) in the same run. Printed per op as
//! `fraction = op bytes/s ÷ copy bytes/s` (target ≥ 0.7), where an op's bytes are what it must
//! read and write at least once. Figures are medians of interleaved repetitions (each
//! repetition runs the copy and the op once), so drift of a shared machine hits both alike.
//!
//! `TIDEMEM_BENCH_OPS_ROWS` / `TIDEMEM_BENCH_OPS_COLS` override the shape,
//! `TIDEMEM_BENCH_OPS_REPS` the repetitions, `TIDEMEM_BENCH_OPS` filters ops by substring.

use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use tidemem::device::{HostOperand, KernelDesc, TwinArgs};
use tidemem::DType;

/// One op to time: its name, the bytes it reads and writes at least once, and a run.
struct Entry {
    name: String,
    bytes: usize,
    run: Box<dyn FnMut()>,
}

/// Runs `desc`'s twin on host buffers: `inputs` read, `outputs` written (in signature order,
/// inputs first unless `order` says otherwise is not needed: every op here lists its reads
/// before its writes).
fn twin(
    desc: &'static KernelDesc,
    params: Vec<u8>,
    inputs: Vec<(Vec<u8>, DType)>,
    outputs: Vec<(Vec<u8>, DType)>,
) -> Box<dyn FnMut()> {
    let mut outputs = outputs;
    Box::new(move || {
        let mut ops: Vec<HostOperand<'_>> = inputs
            .iter()
            .map(|(b, d)| HostOperand::Read(b, *d))
            .collect();
        ops.extend(outputs.iter_mut().map(|(b, d)| HostOperand::Write(b, *d)));
        let mut args = TwinArgs::new(desc, ops, &params).expect("operands fit the signature");
        (desc.twin)(&mut args).expect("the twin runs");
    })
}

fn floats(n: usize, seed: u32) -> Vec<u8> {
    let v: Vec<f32> = (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 * 4.0 - 2.0
        })
        .collect();
    bytemuck::cast_slice(&v).to_vec()
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn gelu_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::gelu::{GeluParams, GELU_BACKWARD, GELU_FORWARD};
    let n = rows * cols;
    let p = bytemuck::bytes_of(&GeluParams { n: n as u64 }).to_vec();
    v.push(Entry {
        name: "gelu_forward f32".into(),
        bytes: 8 * n,
        run: twin(
            &GELU_FORWARD,
            p.clone(),
            vec![(floats(n, 1), DType::F32)],
            vec![(vec![0; 4 * n], DType::F32)],
        ),
    });
    v.push(Entry {
        name: "gelu_backward f32".into(),
        bytes: 12 * n,
        run: twin(
            &GELU_BACKWARD,
            p,
            vec![(floats(n, 1), DType::F32), (floats(n, 2), DType::F32)],
            vec![(vec![0; 4 * n], DType::F32)],
        ),
    });
}

/// Runs `desc`'s twin on host buffers given in signature order, each `(bytes, type, written)`.
fn twin_in_order(
    desc: &'static KernelDesc,
    params: Vec<u8>,
    operands: Vec<(Vec<u8>, DType, bool)>,
) -> Box<dyn FnMut()> {
    let mut operands = operands;
    Box::new(move || {
        let ops: Vec<HostOperand<'_>> = operands
            .iter_mut()
            .map(|(b, d, w)| {
                if *w {
                    HostOperand::Write(b, *d)
                } else {
                    HostOperand::Read(b, *d)
                }
            })
            .collect();
        let mut args = TwinArgs::new(desc, ops, &params).expect("operands fit the signature");
        (desc.twin)(&mut args).expect("the twin runs");
    })
}

/// `floats(n, seed)` stored as `d`.
fn floats_as(n: usize, seed: u32, d: DType) -> Vec<u8> {
    let v: Vec<f32> = bytemuck::pod_collect_to_vec(&floats(n, seed));
    tidemem::dtype::encode_f32(&v, d)
}

/// Token ids in `0..v` (a multiplicative hash of the position).
fn token_ids(n: usize, v: usize) -> Vec<i32> {
    (0..n)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) % v as u64) as i32)
        .collect()
}

/// Causal softmax over GPT-2's context (T = 1024), as many matrices as `rows × cols` elements
/// fill (at least one). Bytes: the lower triangle read (once per input), the whole matrix
/// written.
fn softmax_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::softmax::{SoftmaxParams, SOFTMAX_BACKWARD, SOFTMAX_FORWARD};
    let t = 1024usize;
    let bh = (rows * cols / (t * t)).max(1);
    let n = bh * t * t;
    let tri = bh * t * (t + 1) / 2;
    let p = bytemuck::bytes_of(&SoftmaxParams {
        bh: bh as u64,
        t: t as u64,
        scale: 0.125,
        pad: 0,
    })
    .to_vec();
    for d in [DType::F32, DType::BF16] {
        let s = d.size();
        v.push(Entry {
            name: format!("softmax_forward {d} [{bh},{t},{t}]"),
            bytes: (tri + n) * s,
            run: twin(
                &SOFTMAX_FORWARD,
                p.clone(),
                vec![(floats_as(n, 1, d), d)],
                vec![(vec![0; n * s], d)],
            ),
        });
        v.push(Entry {
            name: format!("softmax_backward {d} [{bh},{t},{t}]"),
            bytes: (2 * tri + n) * s,
            run: twin(
                &SOFTMAX_BACKWARD,
                p.clone(),
                vec![(floats_as(n, 1, d), d), (floats_as(n, 2, d), d)],
                vec![(vec![0; n * s], d)],
            ),
        });
    }
}

/// Fused cross-entropy on GPT-2's vocabulary (V = 50 257 padded to 50 304; 64 rows) and on a
/// small one (`rows` rows of V = `cols`). Bytes: the logits read (and written over, fused),
/// targets and losses.
fn cross_entropy_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::cross_entropy::{
        CrossEntropyParams, CROSS_ENTROPY_FORWARD, CROSS_ENTROPY_FORWARD_BACKWARD,
    };
    let cases = [
        (64usize, 50_257usize, 50_304usize, DType::BF16, true),
        (64, 50_257, 50_304, DType::F32, true),
        (64, 50_257, 50_304, DType::BF16, false),
        (rows, cols, cols, DType::F32, true),
    ];
    for (n, vocab, vp, d, fused) in cases {
        let p = bytemuck::bytes_of(&CrossEntropyParams {
            n: n as u64,
            v: vocab as u64,
            vp: vp as u64,
            ignore_index: -100,
            grad_scale: 1.0 / n as f32,
        })
        .to_vec();
        let targets: Vec<u8> = bytemuck::cast_slice(&token_ids(n, vocab)).to_vec();
        let (desc, name, logit_bytes) = if fused {
            let desc = &CROSS_ENTROPY_FORWARD_BACKWARD;
            (
                desc,
                "cross_entropy_forward_backward",
                2 * n * vp * d.size(),
            )
        } else {
            (
                &CROSS_ENTROPY_FORWARD,
                "cross_entropy_forward",
                n * vocab * d.size(),
            )
        };
        v.push(Entry {
            name: format!("{name} {d} [{n},{vocab}/{vp}]"),
            bytes: logit_bytes + 8 * n,
            run: twin_in_order(
                desc,
                p,
                vec![
                    (floats_as(n * vp, 3, d), d, fused),
                    (targets, DType::I32, false),
                    (vec![0; 4 * n], DType::F32, true),
                ],
            ),
        });
    }
}

/// The encoder on `rows` positions (sequences of T = 1024, or fewer) of C = `cols` channels,
/// V = 50 257. Bytes: forward, tokens and the gathered wte rows read, wpe's T rows read, out
/// written; backward, dout and the plan read, the touched dwte rows and dwpe's T rows read
/// and written; the plan, tokens read and plan words written.
fn encoder_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::encoder::{
        EncoderBackwardParams, EncoderParams, ENCODER_BACKWARD, ENCODER_FORWARD,
    };
    use tidemem::ops::EncoderPlan;
    let (vocab, c) = (50_257usize, cols);
    let t = rows.min(1024);
    let n = rows / t * t;
    let tokens = token_ids(n, vocab);
    let tok_bytes: Vec<u8> = bytemuck::cast_slice(&tokens).to_vec();
    let plan = EncoderPlan::new(&tokens, vocab).expect("tokens in range");
    let words: Vec<u8> = bytemuck::cast_slice(&plan.to_words()).to_vec();
    let tok = tokens.clone();
    v.push(Entry {
        name: format!("encoder_plan [{n}] of {vocab}"),
        bytes: 4 * n + 4 * plan.words(),
        run: Box::new(move || {
            std::hint::black_box(EncoderPlan::new(&tok, vocab).expect("tokens in range"));
        }),
    });
    for d in [DType::F32, DType::BF16] {
        let s = d.size();
        let fp = EncoderParams {
            n: n as u64,
            t: t as u64,
            c: c as u64,
            v: vocab as u64,
            max_t: t as u64,
        };
        v.push(Entry {
            name: format!("encoder_forward {d} [{n},{c}]"),
            bytes: 4 * n + (2 * n + t) * c * s,
            run: twin(
                &ENCODER_FORWARD,
                bytemuck::bytes_of(&fp).to_vec(),
                vec![
                    (tok_bytes.clone(), DType::I32),
                    (floats_as(vocab * c, 4, d), d),
                    (floats_as(t * c, 5, d), d),
                ],
                vec![(vec![0; n * c * s], d)],
            ),
        });
        let bp = EncoderBackwardParams {
            n: n as u64,
            t: t as u64,
            c: c as u64,
            v: vocab as u64,
            max_t: t as u64,
            distinct: plan.distinct() as u64,
        };
        v.push(Entry {
            name: format!("encoder_backward {d} [{n},{c}] {} rows", plan.distinct()),
            bytes: words.len() + (n + 2 * plan.distinct() + 2 * t) * c * s,
            run: twin(
                &ENCODER_BACKWARD,
                bytemuck::bytes_of(&bp).to_vec(),
                vec![(floats_as(n * c, 6, d), d), (words.clone(), DType::U32)],
                vec![(vec![0; vocab * c * s], d), (vec![0; t * c * s], d)],
            ),
        });
    }
}

/// DLRM's dot interaction at Criteo-like shapes (batch 2048, 26 features, dim 64 and 128),
/// whatever the rows and columns: it reads the dense and embedding rows and writes the output
/// row once (forward), and reads those and the output gradient and writes both input gradients
/// once (backward). At ~5 multiply-adds per byte it is bound by arithmetic, not memory.
fn interaction_entries(v: &mut Vec<Entry>) {
    use tidemem::ops::interaction::{InteractionShape, INTERACTION_BACKWARD, INTERACTION_FORWARD};
    for dim in [64, 128] {
        let s = InteractionShape {
            batch: 2048,
            features: 26,
            dim,
        };
        let p = bytemuck::bytes_of(&s.params()).to_vec();
        let (x, e, o) = (
            s.batch * dim,
            s.batch * s.features * dim,
            s.batch * s.out_width(),
        );
        v.push(Entry {
            name: format!("interaction_forward f32 d{dim}"),
            bytes: 4 * (x + e + o),
            run: twin(
                &INTERACTION_FORWARD,
                p.clone(),
                vec![(floats(x, 1), DType::F32), (floats(e, 2), DType::F32)],
                vec![(vec![0; 4 * o], DType::F32)],
            ),
        });
        v.push(Entry {
            name: format!("interaction_backward f32 d{dim}"),
            bytes: 4 * (2 * (x + e) + o),
            run: twin(
                &INTERACTION_BACKWARD,
                p,
                vec![
                    (floats(x, 1), DType::F32),
                    (floats(e, 2), DType::F32),
                    (floats(o, 3), DType::F32),
                ],
                vec![(vec![0; 4 * x], DType::F32), (vec![0; 4 * e], DType::F32)],
            ),
        });
    }
}

/// Sigmoid + binary cross-entropy on 2^20 logits with every output (loss, gradient,
/// probabilities): 4 bytes read and 4 written per element and operand.
fn bce_entries(v: &mut Vec<Entry>) {
    use tidemem::ops::bce::{BceParams, BCE_WITH_LOGITS};
    let n = 1 << 20;
    let p = BceParams {
        n: n as u64,
        scale: 1.0 / n as f32,
        pad: 0,
    };
    let labels: Vec<f32> = (0..n).map(|i| ((i * 7) % 3 == 0) as u8 as f32).collect();
    v.push(Entry {
        name: "bce_with_logits f32".into(),
        bytes: 20 * n,
        run: twin(
            &BCE_WITH_LOGITS,
            bytemuck::bytes_of(&p).to_vec(),
            vec![
                (floats(n, 4), DType::F32),
                (bytemuck::cast_slice(&labels).to_vec(), DType::F32),
            ],
            vec![
                (vec![0; 4 * n], DType::F32),
                (vec![0; 4 * n], DType::F32),
                (vec![0; 4 * n], DType::F32),
            ],
        ),
    });
}

/// One operand of [`twin_ops`]: read, written (or read and written), or left out.
enum Arg {
    R(Vec<u8>, DType),
    W(Vec<u8>, DType),
    Absent,
}

/// Runs `desc`'s twin on host buffers given in signature order.
fn twin_ops(desc: &'static KernelDesc, params: Vec<u8>, args: Vec<Arg>) -> Box<dyn FnMut()> {
    let mut args = args;
    Box::new(move || {
        let ops: Vec<HostOperand<'_>> = args
            .iter_mut()
            .map(|a| match a {
                Arg::R(b, d) => HostOperand::Read(b, *d),
                Arg::W(b, d) => HostOperand::Write(b, *d),
                Arg::Absent => HostOperand::Absent,
            })
            .collect();
        let mut args = TwinArgs::new(desc, ops, &params).expect("operands fit the signature");
        (desc.twin)(&mut args).expect("the twin runs");
    })
}

fn layernorm_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::layernorm::{
        layernorm_backward_scratch_bytes, LayerNormBackwardParams, LayerNormParams,
        LAYERNORM_BACKWARD, LAYERNORM_FORWARD,
    };
    let n = rows * cols;
    let fp = bytemuck::bytes_of(&LayerNormParams {
        rows: rows as u64,
        cols: cols as u64,
        eps: 1e-5,
        pad: 0,
    })
    .to_vec();
    let stats = 8 * rows;
    for d in [DType::F32, DType::BF16] {
        let es = d.size();
        for residual in [false, true] {
            let res = |b: Vec<u8>| if residual { Arg::W(b, d) } else { Arg::Absent };
            let r = if residual {
                Arg::R(floats_as(n, 2, d), d)
            } else {
                Arg::Absent
            };
            v.push(Entry {
                name: format!(
                    "layernorm_forward {d}{}",
                    if residual { " +residual" } else { "" }
                ),
                bytes: es * n * if residual { 4 } else { 2 } + stats,
                run: twin_ops(
                    &LAYERNORM_FORWARD,
                    fp.clone(),
                    vec![
                        Arg::R(floats_as(n, 1, d), d),
                        r,
                        Arg::R(floats_as(cols, 3, d), d),
                        Arg::R(floats_as(cols, 4, d), d),
                        res(vec![0; es * n]),
                        Arg::W(vec![0; es * n], d),
                        Arg::W(vec![0; 4 * rows], DType::F32),
                        Arg::W(vec![0; 4 * rows], DType::F32),
                    ],
                ),
            });
        }
        for acc in [false, true] {
            let rstd: Vec<f32> = vec![1.25; rows];
            v.push(Entry {
                name: format!("layernorm_backward {d}{}", if acc { " dx+=" } else { "" }),
                bytes: es * n * if acc { 4 } else { 3 } + stats,
                run: twin_ops(
                    &LAYERNORM_BACKWARD,
                    bytemuck::bytes_of(&LayerNormBackwardParams::new(rows, cols, acc)).to_vec(),
                    vec![
                        Arg::R(floats_as(n, 5, d), d),
                        Arg::R(floats_as(n, 6, d), d),
                        Arg::R(floats(rows, 7), DType::F32),
                        Arg::R(bytemuck::cast_slice(&rstd).to_vec(), DType::F32),
                        Arg::R(floats_as(cols, 8, d), d),
                        Arg::W(floats_as(n, 9, d), d),
                        Arg::W(vec![0; 4 * cols], DType::F32),
                        Arg::W(vec![0; 4 * cols], DType::F32),
                        Arg::W(
                            vec![0; layernorm_backward_scratch_bytes(rows, cols)],
                            DType::F32,
                        ),
                    ],
                ),
            });
        }
    }
}

fn bias_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::bias::{
        bias_grad_scratch_bytes, BiasGradParams, BiasParams, BIAS_GRAD, BIAS_ROWS,
    };
    let n = rows * cols;
    for d in [DType::F32, DType::BF16] {
        let es = d.size();
        v.push(Entry {
            name: format!("bias_grad {d}"),
            bytes: es * n,
            run: twin_ops(
                &BIAS_GRAD,
                bytemuck::bytes_of(&BiasGradParams::new(rows, cols, true)).to_vec(),
                vec![
                    Arg::R(floats_as(n, 1, d), d),
                    Arg::W(vec![0; 4 * cols], DType::F32),
                    Arg::W(vec![0; bias_grad_scratch_bytes(rows, cols)], DType::F32),
                ],
            ),
        });
        let p = |acc: u32| {
            bytemuck::bytes_of(&BiasParams {
                rows: rows as u64,
                cols: cols as u64,
                accumulate: acc,
                pad: 0,
            })
            .to_vec()
        };
        v.push(Entry {
            name: format!("bias_rows {d}"),
            bytes: es * n,
            run: twin_ops(
                &BIAS_ROWS,
                p(0),
                vec![Arg::R(floats_as(cols, 2, d), d), Arg::W(vec![0; es * n], d)],
            ),
        });
    }
}

fn elementwise_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::elementwise::{AddParams, ScaleParams, ADD, ADD_IN_PLACE, SCALE};
    use tidemem::ops::relu::{ReluParams, RELU_BACKWARD, RELU_FORWARD};
    let n = rows * cols;
    let ap = bytemuck::bytes_of(&AddParams {
        n: n as u64,
        alpha: 0.5,
        beta: -1.5,
    })
    .to_vec();
    for d in [DType::F32, DType::F16, DType::BF16] {
        let es = d.size();
        v.push(Entry {
            name: format!("add {d}"),
            bytes: 3 * es * n,
            run: twin_ops(
                &ADD,
                ap.clone(),
                vec![
                    Arg::R(floats_as(n, 1, d), d),
                    Arg::R(floats_as(n, 2, d), d),
                    Arg::W(vec![0; es * n], d),
                ],
            ),
        });
    }
    let f32 = DType::F32;
    v.push(Entry {
        name: "add_in_place f32".into(),
        bytes: 12 * n,
        run: twin_ops(
            &ADD_IN_PLACE,
            ap,
            vec![Arg::R(floats(n, 1), f32), Arg::W(floats(n, 2), f32)],
        ),
    });
    v.push(Entry {
        name: "scale f32".into(),
        bytes: 8 * n,
        run: twin_ops(
            &SCALE,
            bytemuck::bytes_of(&ScaleParams {
                n: n as u64,
                alpha: 1.0,
                pad: 0,
            })
            .to_vec(),
            vec![Arg::W(floats(n, 3), f32)],
        ),
    });
    let rp = bytemuck::bytes_of(&ReluParams { n: n as u64 }).to_vec();
    v.push(Entry {
        name: "relu_forward f32".into(),
        bytes: 8 * n,
        run: twin_ops(
            &RELU_FORWARD,
            rp.clone(),
            vec![Arg::R(floats(n, 4), f32), Arg::W(vec![0; 4 * n], f32)],
        ),
    });
    v.push(Entry {
        name: "relu_backward bf16".into(),
        bytes: 6 * n,
        run: twin_ops(
            &RELU_BACKWARD,
            rp,
            vec![
                Arg::R(floats_as(n, 5, DType::BF16), DType::BF16),
                Arg::R(floats_as(n, 6, DType::BF16), DType::BF16),
                Arg::W(vec![0; 2 * n], DType::BF16),
            ],
        ),
    });
}

/// The LayerNorm, bias, ReLU and elementwise families.
fn norm_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    layernorm_entries(rows, cols, v);
    bias_entries(rows, cols, v);
    elementwise_entries(rows, cols, v);
}

/// Every op of the bench.
fn entries(rows: usize, cols: usize) -> Vec<Entry> {
    let mut v = Vec::new();
    gelu_entries(rows, cols, &mut v);
    softmax_entries(rows, cols, &mut v);
    cross_entropy_entries(rows, cols, &mut v);
    encoder_entries(rows, cols, &mut v);
    interaction_entries(&mut v);
    bce_entries(&mut v);
    norm_entries(rows, cols, &mut v);
    v
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn bench(c: &mut Criterion) {
    let rows = env_usize("TIDEMEM_BENCH_OPS_ROWS", 4096);
    let cols = env_usize("TIDEMEM_BENCH_OPS_COLS", 768);
    let reps = env_usize("TIDEMEM_BENCH_OPS_REPS", 15).max(1);
    let filter = std::env::var("TIDEMEM_BENCH_OPS").unwrap_or_default();
    let mut group = c.benchmark_group("ops");
    group.sample_size(10);
    println!("ops on the CPU, [{rows}, {cols}], against copy_from_slice of the same bytes (target >= 0.7)");
    for mut e in entries(rows, cols)
        .into_iter()
        .filter(|e| e.name.contains(&filter))
    {
        let half = e.bytes / 2;
        let src = vec![1u8; half];
        let mut dst = vec![0u8; half];
        (e.run)();
        dst.copy_from_slice(&src);
        let (mut tc, mut to) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
        for _ in 0..reps {
            let t0 = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            tc.push(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            (e.run)();
            to.push(t0.elapsed().as_secs_f64());
        }
        let (copy, op) = (median(tc), median(to));
        let gbs = |t: f64| e.bytes as f64 / t / 1e9;
        println!(
            "{:<32} {:>9} B  op {:>6.2} GB/s  copy {:>6.2} GB/s  fraction = {:.3}",
            e.name,
            e.bytes,
            gbs(op),
            gbs(copy),
            copy / op
        );
        group.bench_function(e.name.clone(), |b| b.iter(|| (e.run)()));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
