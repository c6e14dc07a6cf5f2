//! A loss on its way to the host (see [`Loss`]).

use crate::device::{HostBuffer, Pending};
use crate::error::Result;

/// A loss on its way to the host: the per-row losses a head wrote, copied back without the
/// host waiting, read (summed and averaged) when the trainer asks for it.
///
/// Reading a loss as soon as the head computes it is a blocking wait in the middle of the
/// step: the host stops feeding the device until the loss arrives. A [`Loss`] instead keeps
/// the copy in flight, so a trainer reads it after the optimizer step, whose own read of the
/// gradient statistics has already seen it arrive (then [`Loss::read`] does not block).
#[derive(Debug)]
pub struct Loss(Inner);

#[derive(Debug)]
enum Inner {
    Ready(f32),
    Copying {
        /// The per-row losses (f32), copied on the stream that computed them.
        losses: Pending<HostBuffer>,
        /// Rows counted in the mean.
        counted: usize,
    },
    SumOfSquares {
        /// Gradient statistics ([`crate::ops::grad_stats`]) of the differences.
        stats: Pending<HostBuffer>,
        /// Elements in the mean.
        count: usize,
    },
}

impl Loss {
    /// A loss already on the host.
    pub(crate) fn ready(loss: f32) -> Loss {
        Loss(Inner::Ready(loss))
    }

    /// The mean of per-row `losses` (f32) being copied to the host, over `counted` rows (at
    /// least 1 is used).
    pub(crate) fn copying(losses: Pending<HostBuffer>, counted: usize) -> Loss {
        Loss(Inner::Copying { losses, counted })
    }

    /// The mean of squares `sum_sq / count` from gradient statistics being copied to the host
    /// (a mean squared error).
    pub(crate) fn sum_of_squares(stats: Pending<HostBuffer>, count: usize) -> Loss {
        Loss(Inner::SumOfSquares { stats, count })
    }

    /// The mean loss, waiting for its copy if the host has not seen it finish.
    pub fn read(self) -> Result<f32> {
        match self.0 {
            Inner::Ready(l) => Ok(l),
            Inner::Copying { losses, counted } => {
                let bytes = losses.wait()?;
                let sum: f64 = bytemuck::pod_collect_to_vec::<u8, f32>(&bytes)
                    .iter()
                    .map(|&l| f64::from(l))
                    .sum();
                Ok((sum / counted.max(1) as f64) as f32)
            }
            Inner::SumOfSquares { stats, count } => {
                let s = crate::ops::read_grad_stats(&stats.wait()?)?;
                Ok((s.sum_sq / count.max(1) as f64) as f32)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loss_crosses_threads_and_reads_as_given() {
        fn both<T: Send + Sync>() {}
        both::<Loss>();
        assert_eq!(Loss::ready(0.25).read().unwrap(), 0.25);
    }
}
