//! Gradient statistics over the parameter chunks of a [`ChunkManager`], read where each chunk
//! is: the optimizer's norm and overflow check, built on the manager's in-place chunk access.

use std::ops::Range;

use crate::chunk::ChunkManager;
use crate::error::{Error, Result};
use crate::ops::grad_stats::{
    grad_stats_of, grad_stats_split, read_grad_stats, GradStats, GRAD_STATS_BYTES,
};

impl ChunkManager {
    /// Statistics (sum of squares, any infinite or NaN element) of every gradient written this
    /// iteration, computed where each parameter chunk is, without moving it: on the device with
    /// [`crate::ops::grad_stats()`], on the host with its twin, which sums in the kernel's
    /// order (the host groups stepped during backward: by the worker, before it steps). Ranges
    /// are combined in group order, so the result does not depend on placement.
    pub fn grad_stats(&mut self) -> Result<GradStats> {
        self.usable()?;
        // host groups stepped during backward send their statistics ahead of their steps;
        // folds, which take none, finish first (their parameters may go up into the device
        // copies meanwhile, which then no longer hold gradients)
        self.join_stateless_steps()?;
        let mut on_device: Vec<(usize, Range<usize>)> = Vec::new();
        let mut parts: Vec<Option<GradStats>> = Vec::new();
        let dt = self.param_dtype();
        let es = dt.size();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        // tensors counted in part: their full statistics again, scaled by (share - 1)
        let mut partial: Vec<f64> = Vec::new();
        for g in 0..self.groups() {
            let mut ranges = self.param_grad_ranges(g);
            for (r, share) in self.partial_shares(g, true) {
                ranges.push(r);
                partial.push(share - 1.0);
            }
            if let Some(stats) = self.early_grad_stats(g)? {
                // taken by the group's step in place, before it overwrote them
                if stats.len() != ranges.len() {
                    return Err(Error::Internal {
                        what: format!(
                            "group {g}'s step in place took the statistics of {} ranges, not {}",
                            stats.len(),
                            ranges.len()
                        ),
                    });
                }
                parts.extend(stats.into_iter().map(Some));
                continue;
            }
            for r in ranges {
                if self.param_on_device(g) {
                    on_device.push((g, r));
                    parts.push(None);
                } else {
                    let h = self.param_host(g)?;
                    let part = &h[r.start * es..r.end * es];
                    parts.push(Some(grad_stats_split(part, dt, threads)?));
                }
            }
        }
        if !on_device.is_empty() {
            let mut results = device_stats(self, &on_device)?.into_iter();
            for p in parts.iter_mut().filter(|p| p.is_none()) {
                *p = results.next();
            }
        }
        // the partial ranges come after their group's ranges: weight them in order
        let mut weights = partial.into_iter();
        let mut out = GradStats::default();
        let mut g_parts = parts.into_iter().flatten();
        for g in 0..self.groups() {
            let whole = self.param_grad_ranges(g).len();
            for st in g_parts.by_ref().take(whole) {
                out = out.merge(st);
            }
            for _ in self.partial_shares(g, true) {
                let st = g_parts.next().unwrap_or_default();
                let w = weights.next().unwrap_or(0.0);
                out = out.merge(GradStats {
                    sum_sq: st.sum_sq * w,
                    nonfinite: st.nonfinite,
                });
            }
        }
        Ok(out)
    }
}

/// Statistics of the ranges `(group, elements)` of parameter chunks on the device, in order:
/// one scratch range, reused, and the 16-byte results gathered on the device for one download;
/// without room for them, the gradients are read back and summed on the host by the same code.
fn device_stats(m: &mut ChunkManager, ranges: &[(usize, Range<usize>)]) -> Result<Vec<GradStats>> {
    let n = ranges.len();
    let dt = m.param_dtype();
    let es = dt.size();
    let scratch = match (m.alloc_scratch(GRAD_STATS_BYTES), m.alloc_scratch(16 * n)) {
        (Ok(s), Ok(r)) => Some((s, r)),
        (Err(Error::OutOfMemory { .. }), _) | (_, Err(Error::OutOfMemory { .. })) => None,
        (Err(e), _) | (_, Err(e)) => return Err(e),
    };
    let mut results = Vec::with_capacity(n);
    for (i, (g, r)) in ranges.iter().enumerate() {
        let buf = m.param_device(*g)?;
        let src = buf.view(r.start * es, r.len() * es)?;
        let (dev, stream) = (m.device(), m.compute_stream());
        match &scratch {
            Some((out, res)) => {
                crate::ops::grad_stats(dev, stream, src, dt, &**out)?;
                dev.copy_d2d(stream, out.view(0, 16)?, res.view(16 * i, 16)?)?;
            }
            None => {
                let bytes = dev.download(stream, src)?;
                results.push(grad_stats_of(&bytes, dt)?);
            }
        }
    }
    if let Some((_, res)) = &scratch {
        let bytes = m.device().download(m.compute_stream(), &**res)?;
        for i in 0..n {
            results.push(read_grad_stats(&bytes[16 * i..])?);
        }
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use crate::chunk::{ChunkManager, ManagerConfig};
    use crate::device::{Device, SimConfig};
    use crate::tensor::{Init, Stage};
    use crate::tide::Policy;

    /// A tensor counted in part adds its share of the squared norm; bad shares are refused.
    #[test]
    fn norm_shares_weight_the_statistics() {
        for (share, want) in [(1.0, 256.0 + 64.0 * 4.0), (0.25, 64.0 + 64.0 * 4.0)] {
            let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
            let mut cfg = ManagerConfig::new(1024, Policy::Tide);
            cfg.param_dtype = crate::DType::F32;
            let mut m = ChunkManager::new(dev, cfg).unwrap();
            let a = m.register("a", &[256], Init::Zeros).unwrap();
            let b = m.register("b", &[64], Init::Zeros).unwrap();
            assert!(m.set_norm_share(a, 0.0).is_err());
            assert!(m.set_norm_share(a, 1.5).is_err());
            assert!(m.set_norm_share(crate::tensor::TensorId(9), 0.5).is_err());
            m.set_norm_share(a, share).unwrap();
            m.fetch(&[a, b], Stage::Forward).unwrap();
            m.release(&[a, b], Stage::Forward).unwrap();
            m.end_forward().unwrap();
            m.fetch(&[a, b], Stage::Backward).unwrap();
            m.write_grad(a, &[1.0; 256]).unwrap();
            m.write_grad(b, &[2.0; 64]).unwrap();
            m.release(&[a, b], Stage::Backward).unwrap();
            m.end_backward().unwrap();
            let st = m.grad_stats().unwrap();
            assert_eq!(st.sum_sq, want, "share {share}");
        }
    }
}
