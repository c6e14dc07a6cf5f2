//! DLRM's ops: the dot interaction and sigmoid + binary cross-entropy, at fixed shapes.

use tidemem::DType;

use crate::entry::{pod, Arg, Entry};

/// DLRM's dot interaction at Criteo-like shapes (batch 2048, 26 features, dim 64 and 128),
/// whatever the rows and columns: it reads the dense and embedding rows and writes the output
/// row once (forward), and reads those and the output gradient and writes both input gradients
/// once (backward). At ~5 multiply-adds per byte it is bound by arithmetic, not memory.
pub fn interaction_entries(v: &mut Vec<Entry>) {
    use tidemem::ops::{abi::INTERACTION_BACKWARD, abi::INTERACTION_FORWARD, InteractionShape};
    let f32 = DType::F32;
    for dim in [64, 128] {
        let s = InteractionShape {
            batch: 2048,
            features: 26,
            dim,
        };
        let p = pod(&s.params());
        let (x, e, o) = (
            s.batch * dim,
            s.batch * s.features * dim,
            s.batch * s.out_width(),
        );
        v.push(Entry::kernel(
            format!("interaction_forward f32 d{dim}"),
            4 * (x + e + o),
            &INTERACTION_FORWARD,
            p.clone(),
            vec![
                Arg::floats(x, 1, f32),
                Arg::floats(e, 2, f32),
                Arg::zeros(o, f32),
            ],
        ));
        v.push(Entry::kernel(
            format!("interaction_backward f32 d{dim}"),
            4 * (2 * (x + e) + o),
            &INTERACTION_BACKWARD,
            p,
            vec![
                Arg::floats(x, 1, f32),
                Arg::floats(e, 2, f32),
                Arg::floats(o, 3, f32),
                Arg::zeros(x, f32),
                Arg::zeros(e, f32),
            ],
        ));
    }
}

/// Sigmoid + binary cross-entropy on 2^20 logits with every output (loss, gradient,
/// probabilities): 4 bytes read and 4 written per element and operand.
pub fn bce_entries(v: &mut Vec<Entry>) {
    use tidemem::ops::{abi::BceParams, abi::BCE_WITH_LOGITS};
    let n = 1 << 20;
    let p = BceParams {
        n: n as u64,
        scale: 1.0 / n as f32,
        pad: 0,
    };
    let labels: Vec<f32> = (0..n).map(|i| ((i * 7) % 3 == 0) as u8 as f32).collect();
    let f32 = DType::F32;
    v.push(Entry::kernel(
        "bce_with_logits f32",
        20 * n,
        &BCE_WITH_LOGITS,
        pod(&p),
        vec![
            Arg::floats(n, 4, f32),
            Arg::Read(bytemuck::cast_slice(&labels).to_vec(), f32),
            Arg::zeros(n, f32),
            Arg::zeros(n, f32),
            Arg::zeros(n, f32),
        ],
    ));
}

/// The sharded embedding's all-to-all placement: `copy_rows` of a rank's received block of
/// 2048 samples × 13 tables × 128 columns into every other table's rows of the `[2048 × 26,
/// 128]` output (a destination index, the table-wise case): each row read and written once,
/// the index read once.
pub fn copy_rows_entries(v: &mut Vec<Entry>) {
    use tidemem::ops::{abi::CopyRowsParams, abi::COPY_ROWS};
    let (samples, tables, mine, width) = (2048usize, 26usize, 13usize, 128usize);
    let n = samples * mine;
    let dst_index: Vec<u32> = (0..samples)
        .flat_map(|s| (0..mine).map(move |k| (s * tables + 2 * k) as u32))
        .collect();
    let p = CopyRowsParams {
        n: n as u64,
        width: width as u64,
        src_stride: width as u64,
        dst_stride: width as u64,
        src_rows: n as u64,
        dst_rows: (samples * tables) as u64,
    };
    v.push(Entry::kernel(
        "copy_rows f32 (a2a placement)",
        2 * 4 * n * width + 4 * n,
        &COPY_ROWS,
        pod(&p),
        vec![
            Arg::floats(n * width, 5, DType::F32),
            Arg::Absent,
            Arg::zeros(samples * tables * width, DType::F32),
            Arg::Read(bytemuck::cast_slice(&dst_index).to_vec(), DType::U32),
        ],
    ));
}
