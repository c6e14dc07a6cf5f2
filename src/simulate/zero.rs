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
        return Err(Error::InvalidArgument("ranks must be at least 1".into()));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::{gpt, simulate, GptConfig, SimOptions};
    use crate::tide::Policy;

    #[test]
    fn a_rank_holds_its_share_and_gathers_each_op() {
        let spec = gpt(&GptConfig::preset("gpt2-small").unwrap()).unwrap();
        let one = shard(&spec, 1, 2).unwrap();
        assert_eq!(one.params(), spec.params());
        let s = shard(&spec, 8, 2).unwrap();
        assert!(s.params() * 8 >= spec.params() && s.params() * 8 < spec.params() + 8 * 1000);
        for (a, b) in s.ops.iter().zip(&spec.ops) {
            let full: u64 = b
                .tensors
                .iter()
                .map(|&t| spec.tensors[t].1 as u64 * 2)
                .sum();
            assert_eq!(a.fwd_non_model, b.fwd_non_model + full);
            assert_eq!(a.flops, b.flops, "each rank computes its whole micro-batch");
        }
        assert!(shard(&spec, 0, 2).is_err());
        // one rank's model data is an eighth of the whole, the host's memory shared by eight
        let whole = simulate(&spec, Policy::Tide, &SimOptions::new(1 << 40, 1 << 40)).unwrap();
        let mut opts = SimOptions::new(1 << 40, 1 << 40);
        opts.ranks = 8;
        let rank = simulate(&spec, Policy::Tide, &opts).unwrap();
        let ratio = whole.model_data_bytes as f64 / rank.model_data_bytes as f64;
        assert!((7.0..=8.5).contains(&ratio), "{ratio}");
        assert!(rank.peak_non_model > whole.peak_non_model);
    }

    /// Over ranks the timeline charges a gather a stage and a reduce-scatter for each
    /// parameter chunk, on the bus; the step still lies between its slowest resource and the
    /// sum, and one rank has no collective.
    #[test]
    fn the_timeline_charges_the_collectives() {
        use crate::simulate::{timeline, Rates, Schedule};
        let spec = gpt(&GptConfig::preset("gpt2-small").unwrap()).unwrap();
        let rates = Rates::profile("h100-pcie5").unwrap();
        let mut opts = SimOptions::new(80 << 30, 1 << 40);
        let one = timeline(&spec, Policy::Tide, &opts, &rates, Schedule::Overlapped).unwrap();
        assert_eq!(one.collective, 0.0);
        opts.ranks = 4;
        let four = timeline(&spec, Policy::Tide, &opts, &rates, Schedule::Overlapped).unwrap();
        // each rank's shard of every parameter chunk, 3 shards each way, three times a step
        let report = simulate(&spec, Policy::Tide, &opts).unwrap();
        let want = 3.0 * 3.0 * report.param_chunk_bytes as f64 / rates.bus;
        assert!(
            (four.collective - want).abs() <= 1e-9 * want,
            "{} vs {want}",
            four.collective
        );
        let sum = four.compute + four.h2d + four.d2h + four.host_adam + four.file + four.collective;
        assert!(four.over_slowest() >= 1.0 - 1e-9 && four.step <= sum * (1.0 + 1e-9));
        // the host's optimizer shared by four ranks, each stepping a quarter of the elements
        // (and its chunks' padding: a quarter of the embedding pads more)
        let r = four.host_adam / one.host_adam;
        assert!((0.9..1.5).contains(&r), "{r}");
    }
}
