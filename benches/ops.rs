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

/// `floats` as elements of `d`.
fn floats_as(n: usize, seed: u32, d: DType) -> Vec<u8> {
    let v: Vec<f32> = bytemuck::pod_collect_to_vec(&floats(n, seed));
    tidemem::dtype::encode_f32(&v, d)
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
