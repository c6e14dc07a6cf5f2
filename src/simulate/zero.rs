//! ZeRO over data-parallel ranks in the simulator: what one rank of `ranks` holds, and what its
//! step moves between ranks.
//!
//! Each rank owns a `1/ranks` share of every parameter tensor (its chunks: parameters, fp32
//! masters and Adam moments) and trains on its own micro-batch, so it computes the whole
//! model's FLOPs. Before an op runs, the op's parameters are gathered whole from every rank
//! into a gather buffer (non-model device memory, the op's parameters at full size, held while
//! the op runs); in backward they are gathered again, and the gradients written into the same
//! buffer are reduce-scattered to their owners. [`shard`] is that rank's model;
//! [`timeline`](super::timeline) charges the collectives on a bus resource at
//! [`Rates::bus`](super::Rates::bus): `(ranks − 1) × shard` bytes each way per gather and per
//! reduce-scatter (a ring's volume). The ranks share one host: its memory
//! ([`SimOptions::host_mem`](super::SimOptions::host_mem)), its CPU optimizer and its file
//! tier are divided among them.

use super::{BackwardOp, ModelSpec, OpSpec};
use crate::error::{Error, Result};

/// One rank's model out of `ranks` (see the module docs): every tensor's share (rounded up),
/// and the op's gathered parameters (`param_bytes` an element) as non-model memory at its
/// forward and backward moments.
pub fn shard(spec: &ModelSpec, ranks: usize, param_bytes: u64) -> Result<ModelSpec> {
    if ranks == 0 {
        return Err(Error::TooFew {
            what: "ranks".into(),
            got: 0,
            need: 1,
        });
    }
    if ranks == 1 {
        return Ok(spec.clone());
    }
    let gathered = |op: &OpSpec| -> u64 {
        op.tensors
            .iter()
            .filter_map(|&t| spec.tensors.get(t))
            .map(|t| t.1 as u64 * param_bytes)
            .sum()
    };
    let ops: Vec<OpSpec> = spec
        .ops
        .iter()
        .map(|op| OpSpec {
            fwd_non_model: op.fwd_non_model + gathered(op),
            bwd_non_model: op.bwd_non_model + gathered(op),
            ..op.clone()
        })
        .collect();
    let backward = spec.backward.as_ref().map(|b| {
        b.iter()
            .map(|x| BackwardOp {
                non_model: x.non_model + spec.ops.get(x.op).map_or(0, gathered),
                ..*x
            })
            .collect()
    });
    Ok(ModelSpec {
        name: format!("{} (1 of {ranks} ZeRO ranks)", spec.name),
        tensors: spec
            .tensors
            .iter()
            .map(|(n, e)| (n.clone(), e.div_ceil(ranks)))
            .collect(),
        ops,
        backward,
    })
}
