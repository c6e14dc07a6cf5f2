//! DLRM's ops: the dot interaction and sigmoid + binary cross-entropy, at fixed shapes.

use tidemem::DType;

use crate::entry::{pod, Arg, Entry};

/// DLRM's dot interaction at Criteo-like shapes (batch 2048, 26 features, dim 64 and 128),
/// whatever the rows and columns: it reads the dense and embedding rows and writes the output
/// row once (forward), and reads those and the output gradient and writes both input gradients
/// once (backward). At ~5 multiply-adds per byte it is bound by arithmetic, not memory.
pub fn interaction_entries(v: &mut Vec<Entry>) {
    use tidemem::ops::interaction::{InteractionShape, INTERACTION_BACKWARD, INTERACTION_FORWARD};
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
    use tidemem::ops::bce::{BceParams, BCE_WITH_LOGITS};
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
