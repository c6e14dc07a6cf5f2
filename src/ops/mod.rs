//! Compute on the device: every op is one file here (its descriptor for
//! [`Device::launch`](crate::device::Device::launch), a typed safe wrapper, and the CPU twin the
//! simulated device runs) and one `.cu` (+ `.cuh` for its parameter struct) in `kernels/`.
//! [`registry`] lists every descriptor, for the conformance tests that run each twin against
//! CUDA.

pub(crate) mod accumulate;
pub(crate) mod adam;
pub mod attention;
pub(crate) mod bce;
pub(crate) mod bias;
pub(crate) mod cast;
pub(crate) mod copy_rows;
pub(crate) mod cross_entropy;
pub(crate) mod elementwise;
pub mod embedding;
pub(crate) mod encoder;
pub mod float;
pub(crate) mod gelu;
pub(crate) mod gemm;
pub(crate) mod grad_stats;
pub mod heads;
pub(crate) mod interaction;
mod lanes;
pub(crate) mod layernorm;
pub mod linear;
pub mod math;
pub(crate) mod relu;
pub mod rows;
pub(crate) mod softmax;
pub mod vocab_parallel;

pub use accumulate::accumulate;
pub use adam::{
    adam, adam8, Adam8Operands, AdamOperands, AdamScalars, CpuAdam, Grad, GradInPlace, Isa,
    Moments8, ParamCopy, Quant8Map, QUANT8_BLOCK,
};
pub use bce::{bce, bce_grad, bce_with_logits, BceOutputs};
pub use bias::{add_bias_rows, bias_grad, bias_grad_scratch_bytes, bias_rows, BiasGrad};
pub use cast::{cast, cast_bytes, check_supported};
pub use copy_rows::{copy_rows, CopyRows, RowIndex};
pub use cross_entropy::{
    check_targets, cross_entropy_forward, cross_entropy_forward_backward, CrossEntropy,
    CROSS_ENTROPY_THREADS, MAX_VOCAB,
};
pub use elementwise::{add, add_in_place, fill, fill_bits, scale, Axpby};
pub use encoder::{encoder_backward, encoder_forward, EncoderPlan, EncoderShape};
pub use gelu::{gelu, gelu_backward, gelu_forward, gelu_grad};
pub use gemm::{cublas_available, cublas_live_handles, gemm, gemm_host, Gemm, GemmElem};
pub use grad_stats::{
    grad_stats, grad_stats_host, grad_stats_of, read_grad_stats, GradStats, GRAD_STATS_BYTES,
    GRAD_STATS_PARTIALS, GRAD_STATS_THREADS,
};
pub use interaction::{
    interaction_backward, interaction_forward, InteractionShape, MAX_INTERACTION_DIM,
    MAX_INTERACTION_ROWS,
};
pub use layernorm::{
    layernorm_backward, layernorm_backward_scratch_bytes, layernorm_forward, LayerNormBackward,
    LayerNormForward, Residual,
};
pub use relu::{relu_backward, relu_forward};
pub use softmax::{
    softmax_backward, softmax_block_backward, softmax_block_forward, softmax_forward, SoftmaxBlock,
    SOFTMAX_THREADS,
};
pub(crate) use vocab_parallel::{
    vocab_ce_grad, vocab_ce_max, vocab_ce_sums, vocab_embedding_backward, vocab_embedding_forward,
    VocabCeGrad, VocabCeSums, VocabCrossEntropy, VocabPlan, VocabShard,
};

use crate::device::KernelDesc;

/// The kernel ABI (with the `kernel-abi` feature): the descriptor and parameter block of each op
/// whose module is private, as the kernels in `kernels/*.cu` read them (those of the public
/// `embedding` and `heads` modules are named there). Not part of the library's API.
#[cfg(feature = "kernel-abi")]
pub mod abi {
    pub use super::accumulate::{AccumulateParams, ACCUMULATE};
    pub use super::adam::{AdamParams, ADAM, ADAM8, ADAM8_IN_PLACE, ADAM_IN_PLACE};
    pub use super::bce::{BceParams, BCE_WITH_LOGITS};
    pub use super::bias::{BiasGradParams, BiasParams, BIAS_GRAD, BIAS_ROWS};
    pub use super::cast::{CastParams, CAST};
    pub use super::copy_rows::{CopyRowsParams, COPY_ROWS};
    pub use super::cross_entropy::{
        CrossEntropyParams, CROSS_ENTROPY_FORWARD, CROSS_ENTROPY_FORWARD_BACKWARD,
    };
    pub use super::elementwise::{
        AddParams, FillParams, ScaleParams, ADD, ADD_IN_PLACE, FILL, SCALE,
    };
    pub use super::encoder::{
        EncoderBackwardParams, EncoderParams, ENCODER_BACKWARD, ENCODER_FORWARD,
    };
    pub use super::gelu::{GeluParams, GELU_BACKWARD, GELU_FORWARD};
    pub use super::gemm::{GemmParams, GEMM};
    pub use super::grad_stats::{GradStatsParams, GRAD_STATS};
    pub use super::interaction::{InteractionParams, INTERACTION_BACKWARD, INTERACTION_FORWARD};
    pub use super::layernorm::{
        LayerNormBackwardParams, LayerNormParams, LAYERNORM_BACKWARD, LAYERNORM_FORWARD,
    };
    pub use super::relu::{ReluParams, RELU_BACKWARD, RELU_FORWARD};
    pub use super::softmax::{SoftmaxParams, SOFTMAX_BACKWARD, SOFTMAX_FORWARD};
    pub use super::vocab_parallel::cross_entropy::{
        VocabCeParams, VOCAB_CE_GRAD, VOCAB_CE_MAX, VOCAB_CE_SUMS,
    };
    pub use super::vocab_parallel::embedding::{
        VocabEmbeddingBackwardParams, VocabEmbeddingParams, VOCAB_EMBEDDING_BACKWARD,
        VOCAB_EMBEDDING_FORWARD,
    };
}

/// Every op's descriptor.
pub fn registry() -> &'static [&'static KernelDesc] {
    static ALL: &[&KernelDesc] = &[
        &cast::CAST,
        &accumulate::ACCUMULATE,
        &adam::ADAM,
        &adam::ADAM_IN_PLACE,
        &adam::ADAM8,
        &adam::ADAM8_IN_PLACE,
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
        &vocab_parallel::embedding::VOCAB_EMBEDDING_FORWARD,
        &vocab_parallel::embedding::VOCAB_EMBEDDING_BACKWARD,
        &vocab_parallel::cross_entropy::VOCAB_CE_MAX,
        &vocab_parallel::cross_entropy::VOCAB_CE_SUMS,
        &vocab_parallel::cross_entropy::VOCAB_CE_GRAD,
        &copy_rows::COPY_ROWS,
    ];
    ALL
}
