//! The LayerNorm, bias, ReLU and elementwise families.

use tidemem::DType;

use crate::entry::{floats_as, pod, Arg, Entry};

pub fn norm_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    layernorm_entries(rows, cols, v);
    bias_entries(rows, cols, v);
    elementwise_entries(rows, cols, v);
}

fn layernorm_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::{
        abi::LayerNormBackwardParams, abi::LayerNormParams, abi::LAYERNORM_BACKWARD,
        abi::LAYERNORM_FORWARD, layernorm_backward_scratch_bytes,
    };
    let n = rows * cols;
    let fp = pod(&LayerNormParams {
        rows: rows as u64,
        cols: cols as u64,
        eps: 1e-5,
        pad: 0,
    });
    let stats = 8 * rows;
    let f32 = DType::F32;
    for d in [DType::F32, DType::BF16] {
        let es = d.size();
        for residual in [false, true] {
            // With a residual: `r` read, `h = x + r` written as well as `y`.
            let (r, sum) = if residual {
                (Arg::floats(n, 2, d), Arg::zeros(n, d))
            } else {
                (Arg::Absent, Arg::Absent)
            };
            v.push(Entry::kernel(
                format!(
                    "layernorm_forward {d}{}",
                    if residual { " +residual" } else { "" }
                ),
                es * n * if residual { 4 } else { 2 } + stats,
                &LAYERNORM_FORWARD,
                fp.clone(),
                vec![
                    Arg::floats(n, 1, d),
                    r,
                    Arg::floats(cols, 3, d),
                    Arg::floats(cols, 4, d),
                    sum,
                    Arg::zeros(n, d),
                    Arg::zeros(rows, f32),
                    Arg::zeros(rows, f32),
                ],
            ));
        }
        for acc in [false, true] {
            let rstd: Vec<f32> = vec![1.25; rows];
            v.push(Entry::kernel(
                format!("layernorm_backward {d}{}", if acc { " dx+=" } else { "" }),
                es * n * if acc { 4 } else { 3 } + stats,
                &LAYERNORM_BACKWARD,
                pod(&LayerNormBackwardParams::new(rows, cols, acc)),
                vec![
                    Arg::floats(n, 5, d),
                    Arg::floats(n, 6, d),
                    Arg::floats(rows, 7, f32),
                    Arg::Read(bytemuck::cast_slice(&rstd).to_vec(), f32),
                    Arg::floats(cols, 8, d),
                    Arg::Write(floats_as(n, 9, d), d),
                    Arg::zeros(cols, f32),
                    Arg::zeros(cols, f32),
                    Arg::Write(vec![0; layernorm_backward_scratch_bytes(rows, cols)], f32),
                ],
            ));
        }
    }
}

fn bias_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::{
        abi::BiasGradParams, abi::BiasParams, abi::BIAS_GRAD, abi::BIAS_ROWS,
        bias_grad_scratch_bytes,
    };
    let n = rows * cols;
    let f32 = DType::F32;
    for d in [DType::F32, DType::BF16] {
        let es = d.size();
        v.push(Entry::kernel(
            format!("bias_grad {d}"),
            es * n,
            &BIAS_GRAD,
            pod(&BiasGradParams::new(rows, cols, true)),
            vec![
                Arg::floats(n, 1, d),
                Arg::zeros(cols, f32),
                Arg::Write(vec![0; bias_grad_scratch_bytes(rows, cols)], f32),
            ],
        ));
        v.push(Entry::kernel(
            format!("bias_rows {d}"),
            es * n,
            &BIAS_ROWS,
            pod(&BiasParams {
                rows: rows as u64,
                cols: cols as u64,
                accumulate: 0,
                pad: 0,
            }),
            vec![Arg::floats(cols, 2, d), Arg::zeros(n, d)],
        ));
    }
}

fn elementwise_entries(rows: usize, cols: usize, v: &mut Vec<Entry>) {
    use tidemem::ops::{abi::AddParams, abi::ScaleParams, abi::ADD, abi::ADD_IN_PLACE, abi::SCALE};
    use tidemem::ops::{abi::ReluParams, abi::RELU_BACKWARD, abi::RELU_FORWARD};
    let n = rows * cols;
    let ap = pod(&AddParams {
        n: n as u64,
        alpha: 0.5,
        beta: -1.5,
    });
    for d in [DType::F32, DType::F16, DType::BF16] {
        v.push(Entry::kernel(
            format!("add {d}"),
            3 * d.size() * n,
            &ADD,
            ap.clone(),
            vec![Arg::floats(n, 1, d), Arg::floats(n, 2, d), Arg::zeros(n, d)],
        ));
    }
    let (f32, bf16) = (DType::F32, DType::BF16);
    v.push(Entry::kernel(
        "add_in_place f32",
        12 * n,
        &ADD_IN_PLACE,
        ap,
        vec![
            Arg::floats(n, 1, f32),
            Arg::Write(floats_as(n, 2, f32), f32),
        ],
    ));
    v.push(Entry::kernel(
        "scale f32",
        8 * n,
        &SCALE,
        pod(&ScaleParams {
            n: n as u64,
            alpha: 1.0,
            pad: 0,
        }),
        vec![Arg::Write(floats_as(n, 3, f32), f32)],
    ));
    let rp = pod(&ReluParams { n: n as u64 });
    v.push(Entry::kernel(
        "relu_forward f32",
        8 * n,
        &RELU_FORWARD,
        rp.clone(),
        vec![Arg::floats(n, 4, f32), Arg::zeros(n, f32)],
    ));
    v.push(Entry::kernel(
        "relu_backward bf16",
        6 * n,
        &RELU_BACKWARD,
        rp,
        vec![
            Arg::floats(n, 5, bf16),
            Arg::floats(n, 6, bf16),
            Arg::zeros(n, bf16),
        ],
    ));
}
