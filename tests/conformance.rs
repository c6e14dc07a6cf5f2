//! Every registered op: its CPU twin (the simulated device) against CUDA (a GPU, or the
//! emulator in CI) on random operands of many shapes, empty and odd sizes included; bitwise
//! where the op promises it, within a stated tolerance where it does not. An op without cases
//! here fails the test, so a new op cannot skip conformance.

mod common;

#[path = "conformance/copy_rows.rs"]
mod copy_rows_cases;
#[path = "conformance/core.rs"]
mod core_cases;
#[path = "conformance/embedding.rs"]
mod embedding_cases;
#[path = "conformance/llm.rs"]
mod llm_cases;
#[path = "conformance/norm.rs"]
mod norm_cases;
#[path = "conformance/recsys.rs"]
mod recsys_cases;
#[path = "conformance/vocab_parallel.rs"]
mod vocab_parallel_cases;

use copy_rows_cases::*;
use core_cases::*;
use embedding_cases::*;
use llm_cases::*;
use norm_cases::*;
use recsys_cases::*;
use vocab_parallel_cases::*;

use half::{bf16, f16};
use tidemem::device::{Device, DeviceBuffer, KernelDesc, Operand};
use tidemem::ops::embedding::device::{
    EmbBackwardParams, EmbBagParams, EmbRowsParams, EmbStepParams,
};
use tidemem::ops::{self, abi::AdamParams};
use tidemem::optim::AdamConfig;
use tidemem::DType;

/// How two results of a written operand must agree.
#[derive(Clone, Copy, Debug)]
enum Agree {
    /// Bit for bit.
    Exact,
    /// As floats of the operand's type: |a − b| ≤ abs + rel·|b|.
    Close { abs: f64, rel: f64 },
}

/// One launch: operands (type and initial bytes; `None` = left out), parameters, and how each
/// written operand must agree.
struct Case {
    label: String,
    operands: Vec<Option<(DType, Vec<u8>)>>,
    params: Vec<u8>,
    agree: Agree,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    fn floats(&mut self, n: usize, scale: f32, d: DType) -> Vec<u8> {
        let v: Vec<f32> = (0..n).map(|_| self.unit() * scale).collect();
        encode(&v, d)
    }
    fn garbage(&mut self, bytes: usize) -> Vec<u8> {
        (0..bytes).map(|_| self.next() as u8).collect()
    }
}

fn encode(v: &[f32], d: DType) -> Vec<u8> {
    tidemem::encode_f32(v, d)
}

fn u32s(v: &[u32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

const SIZES: [usize; 6] = [0, 1, 7, 64, 257, 3001];
const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The cases of op `name`, or `None` for an op this test does not know (a failure).
fn cases(name: &str, r: &mut Rng) -> Option<Vec<Case>> {
    Some(match name {
        "cast" => cast_cases(r),
        "accumulate" => accumulate_cases(r),
        "adam" => adam_cases(r, false, false),
        "adam_in_place" => adam_cases(r, true, false),
        "adam8" => adam_cases(r, false, true),
        "adam8_in_place" => adam_cases(r, true, true),
        "grad_stats" => grad_stats_cases(r),
        "embedding_bag" => bag_cases(r),
        "embedding_backward" => backward_cases(r),
        "embedding_step" => step_cases(r),
        "gather_rows" => rows_cases(r, false),
        "scatter_rows" => rows_cases(r, true),
        "gelu_forward" => gelu_cases(r, false),
        "gelu_backward" => gelu_cases(r, true),
        "qkv_split" => heads_cases(r, 1, true, false),
        "qkv_merge" => heads_cases(r, 3, false, true),
        "heads_merge" | "heads_split" => heads_cases(r, 1, false, false),
        "gemm" => gemm_cases(r),
        "interaction_forward" => interaction_cases(r, false),
        "interaction_backward" => interaction_cases(r, true),
        "bce_with_logits" => bce_cases(r),
        "softmax_forward" => softmax_cases(r, false),
        "softmax_backward" => softmax_cases(r, true),
        "cross_entropy_forward" => cross_entropy_cases(r),
        "cross_entropy_forward_backward" => cross_entropy_cases(r),
        "encoder_forward" => encoder_cases(r, false),
        "encoder_backward" => encoder_cases(r, true),
        "layernorm_forward" => layernorm_forward_cases(r),
        "layernorm_backward" => layernorm_backward_cases(r),
        "relu_forward" => relu_cases(r, false),
        "relu_backward" => relu_cases(r, true),
        "bias_rows" => bias_rows_cases(r),
        "bias_grad" => bias_grad_cases(r),
        "add" => add_cases(r, false),
        "add_in_place" => add_cases(r, true),
        "scale" => scale_cases(r),
        "fill" => fill_cases(r),
        "vocab_embedding_forward" => vocab_embedding_cases(r, false),
        "vocab_embedding_backward" => vocab_embedding_cases(r, true),
        "vocab_ce_max" => vocab_ce_cases(r, CeStep::Max),
        "vocab_ce_sums" => vocab_ce_cases(r, CeStep::Sums),
        "vocab_ce_grad" => vocab_ce_cases(r, CeStep::Grad),
        "copy_rows" => copy_rows_cases(r),
        _ => return None,
    })
}

/// Runs one case on `dev`; returns the written operands' bytes, in signature order.
fn run(dev: &Device, desc: &'static KernelDesc, case: &Case) -> Vec<Vec<u8>> {
    let s = dev.new_stream().unwrap();
    let bufs: Vec<Option<(DType, DeviceBuffer)>> = case
        .operands
        .iter()
        .map(|o| {
            o.as_ref().map(|(d, bytes)| {
                let b = dev.alloc(bytes.len()).unwrap();
                if !bytes.is_empty() {
                    dev.copy_h2d(
                        &s,
                        tidemem::device::HostBuffer::from_slice(bytes).unwrap(),
                        &b,
                    )
                    .unwrap()
                    .wait()
                    .unwrap();
                }
                (*d, b)
            })
        })
        .collect();
    let ops: Vec<Option<Operand<'_>>> = bufs
        .iter()
        .map(|b| b.as_ref().map(|(d, b)| Operand::new(b, *d)))
        .collect();
    dev.launch(&s, desc, &ops, &case.params)
        .unwrap_or_else(|e| panic!("{} {}: {e}", desc.name, case.label));
    let mut out = vec![];
    for (spec, b) in desc.operands.iter().zip(&bufs) {
        if let (true, Some((_, b))) = (spec.mode.writes(), b) {
            out.push(if b.is_empty() {
                vec![]
            } else {
                dev.download(&s, b).unwrap()
            });
        }
    }
    dev.sync_stream(&s)
        .unwrap_or_else(|e| panic!("{} {}: {e}", desc.name, case.label));
    out
}

fn as_f64(bytes: &[u8], d: DType) -> Vec<f64> {
    match d {
        DType::F64 => bytemuck::pod_collect_to_vec::<u8, f64>(bytes),
        DType::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(bytes)
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::F16 => bytemuck::pod_collect_to_vec::<u8, f16>(bytes)
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::BF16 => bytemuck::pod_collect_to_vec::<u8, bf16>(bytes)
            .into_iter()
            .map(f64::from)
            .collect(),
        other => panic!("no float comparison for {other}"),
    }
}

fn compare(desc: &KernelDesc, case: &Case, twin: &[Vec<u8>], cuda: &[Vec<u8>]) {
    let written: Vec<DType> = desc
        .operands
        .iter()
        .zip(&case.operands)
        .filter(|(s, o)| s.mode.writes() && o.is_some())
        .map(|(_, o)| o.as_ref().unwrap().0)
        .collect();
    for ((t, c), d) in twin.iter().zip(cuda).zip(written) {
        let what = format!("{} {}", desc.name, case.label);
        match case.agree {
            Agree::Exact => assert!(t == c, "{what}: twin and CUDA differ"),
            Agree::Close { abs, rel } => {
                // grad_stats: only the two results, not the scratch.
                let n = if desc.name == "grad_stats" {
                    16
                } else {
                    t.len()
                };
                let (a, b) = (as_f64(&t[..n], d), as_f64(&c[..n], d));
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        (x - y).abs() <= abs + rel * y.abs() || (x.is_nan() && y.is_nan()),
                        "{what}: element {i}: twin {x} vs CUDA {y}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_op_has_cases_and_its_twin_runs_them() {
    let sim = common::sim(64 << 20);
    let mut r = Rng(7);
    for desc in ops::registry() {
        let cases = cases(desc.name, &mut r)
            .unwrap_or_else(|| panic!("op {} has no conformance cases", desc.name));
        assert!(!cases.is_empty());
        for case in &cases {
            run(&sim, desc, case);
        }
    }
}

#[test]
fn every_op_twin_agrees_with_cuda() {
    let Some(gpu) = common::cuda("conformance") else {
        return;
    };
    let sim = common::sim(64 << 20);
    let mut r = Rng(11);
    let mut ran = 0;
    for desc in ops::registry() {
        for case in cases(desc.name, &mut r).unwrap() {
            let (t, c) = (run(&sim, desc, &case), run(&gpu, desc, &case));
            compare(desc, &case, &t, &c);
            ran += 1;
        }
    }
    eprintln!("{ran} cases agree");
}

#[test]
fn names_are_unique_and_signatures_sane() {
    let mut names: Vec<&str> = ops::registry().iter().map(|d| d.name).collect();
    names.sort_unstable();
    let n = names.len();
    names.dedup();
    assert_eq!(names.len(), n, "two ops share a name");
    for d in ops::registry() {
        assert!(
            d.operands.iter().any(|o| o.mode.writes()),
            "{} writes nothing",
            d.name
        );
        assert!(
            d.operands.iter().all(|o| !o.dtypes.is_empty()),
            "{}",
            d.name
        );
        assert!(d.params.size > 0 && d.params.fields.iter().all(|f| f.1 < d.params.size));
    }
}
