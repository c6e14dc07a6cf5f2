//! Compute on the device: every op is one file here (its descriptor for
//! [`Device::launch`](crate::device::Device::launch), a typed safe wrapper, and the CPU twin the
//! simulated device runs) and one `.cu` (+ `.cuh` for its parameter struct) in `kernels/`.
//! [`registry`] lists every descriptor, for the conformance tests that run each twin against
//! CUDA.

pub mod accumulate;
pub mod adam;
pub mod attention;
pub mod bce;
pub mod bias;
pub mod cast;
pub mod copy_rows;
pub mod cross_entropy;
pub mod elementwise;
pub mod embedding;
pub mod encoder;
pub mod float;
pub mod gelu;
pub mod gemm;
pub mod grad_stats;
pub mod heads;
pub mod interaction;
mod lanes;
pub mod layernorm;
pub mod linear;
pub mod math;
pub mod relu;
pub mod rows;
pub mod softmax;
pub mod vocab_parallel;

pub use accumulate::accumulate;
pub use adam::{adam, AdamOperands};
pub use bce::{bce_with_logits, BceOutputs};
pub use bias::{add_bias_rows, bias_grad, bias_grad_scratch_bytes, bias_rows, BiasGrad};
pub use cast::cast;
pub use copy_rows::{copy_rows, CopyRows, RowIndex};
pub use cross_entropy::{
    check_targets, cross_entropy_forward, cross_entropy_forward_backward, CrossEntropy,
};
pub use elementwise::{add, add_in_place, fill, scale, Axpby};
pub use encoder::{encoder_backward, encoder_forward, EncoderPlan, EncoderShape};
pub use gelu::{gelu_backward, gelu_forward};
pub use gemm::{gemm, gemm_host, Gemm};
pub use grad_stats::{grad_stats, read_grad_stats, GradStats, GRAD_STATS_BYTES};
pub use interaction::{interaction_backward, interaction_forward, InteractionShape};
pub use layernorm::{
    layernorm_backward, layernorm_backward_scratch_bytes, layernorm_forward, LayerNormBackward,
    LayerNormForward,
};
pub use relu::{relu_backward, relu_forward};
pub use softmax::{
    softmax_backward, softmax_block_backward, softmax_block_forward, softmax_forward, SoftmaxBlock,
};
pub use vocab_parallel::{
    vocab_ce_grad, vocab_ce_max, vocab_ce_sums, vocab_embedding_backward, vocab_embedding_forward,
    VocabCeGrad, VocabCeSums, VocabCrossEntropy, VocabPlan, VocabShard,
};

use crate::device::KernelDesc;

/// Every op's descriptor.
pub fn registry() -> &'static [&'static KernelDesc] {
    static ALL: &[&KernelDesc] = &[
        &cast::CAST,
        &accumulate::ACCUMULATE,
        &adam::ADAM,
        &adam::ADAM_IN_PLACE,
        &grad_stats::GRAD_STATS,
        &embedding::device::EMBEDDING_BAG,
        &embedding::device::EMBEDDING_BACKWARD,
        &embedding::device::EMBEDDING_STEP,
        &embedding::device::GATHER_ROWS,
        &embedding::device::SCATTER_ROWS,
        &gelu::GELU_FORWARD,
        &gelu::GELU_BACKWARD,
        &heads::QKV_SPLIT,
        &heads::QKV_MERGE,
        &heads::HEADS_MERGE,
        &heads::HEADS_SPLIT,
        &gemm::GEMM,
        &interaction::INTERACTION_FORWARD,
        &interaction::INTERACTION_BACKWARD,
        &bce::BCE_WITH_LOGITS,
        &softmax::SOFTMAX_FORWARD,
        &softmax::SOFTMAX_BACKWARD,
        &cross_entropy::CROSS_ENTROPY_FORWARD,
        &cross_entropy::CROSS_ENTROPY_FORWARD_BACKWARD,
        &encoder::ENCODER_FORWARD,
        &encoder::ENCODER_BACKWARD,
        &layernorm::LAYERNORM_FORWARD,
        &layernorm::LAYERNORM_BACKWARD,
        &relu::RELU_FORWARD,
        &relu::RELU_BACKWARD,
        &bias::BIAS_ROWS,
        &bias::BIAS_GRAD,
        &elementwise::ADD,
        &elementwise::ADD_IN_PLACE,
        &elementwise::SCALE,
        &elementwise::FILL,
        &vocab_parallel::VOCAB_EMBEDDING_FORWARD,
        &vocab_parallel::VOCAB_EMBEDDING_BACKWARD,
        &vocab_parallel::VOCAB_CE_MAX,
        &vocab_parallel::VOCAB_CE_SUMS,
        &vocab_parallel::VOCAB_CE_GRAD,
        &copy_rows::COPY_ROWS,
    ];
    ALL
}
