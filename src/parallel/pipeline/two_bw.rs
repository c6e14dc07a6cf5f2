//! PipeDream-2BW's update rule, run serially on the host: the reference a pipelined 2BW
//! trainer must match.

use super::schedule::{two_bw, PipeOp};
use crate::{Error, Result};

/// Which weights a batch's gradient is computed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDelay {
    /// PipeDream-2BW: batch `t` on `W(t − 1)` (`W(−1) = W(0)`), so
    /// `W(t+1) = W(t) − ν·∇f(W(t−1))`.
    TwoBW,
    /// PipeDream-Flush (and GPipe): batch `t` on `W(t)`, plain SGD with the gradient
    /// accumulated over the batch.
    Flush,
}

/// SGD under PipeDream-2BW's weight versions (or with the flush), over batches of `every`
/// micro-batches: `W(t+1) = W(t) − lr · Σ_{j in batch t} g(W_used, j)`.
///
/// With [`WeightDelay::TwoBW`] the weights each micro-batch's gradient is computed on are the
/// version its ops carry in [`two_bw`]'s schedule (of stage 0, whose versions every stage
/// shares).
///
/// ```
/// use tidemem::parallel::pipeline::{TwoBwSgd, WeightDelay};
///
/// // f(w) = w²/2 per micro-batch: g = w
/// let sgd = TwoBwSgd { lr: 0.5, every: 2, stages: 2, delay: WeightDelay::Flush };
/// let w = sgd.run(&[1.0], 4, |w, _| w.to_vec()).unwrap();
/// assert_eq!(w, [vec![1.0], vec![0.0], vec![0.0]]); // 1 − 0.5·(1 + 1)
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TwoBwSgd {
    /// The learning rate `ν`.
    pub lr: f64,
    /// Micro-batches per batch (per weight version), `≥ stages`.
    pub every: usize,
    /// Pipeline stages the schedule is laid out for.
    pub stages: usize,
    /// Which weights the gradients are computed on.
    pub delay: WeightDelay,
}

impl TwoBwSgd {
    /// Runs `micro` micro-batches (whole batches) from `w0`, the gradient of micro-batch `j` at
    /// weights `w` being `grad(w, j)`; returns every version `W(0) … W(micro / every)`.
    ///
    /// Fails with [`TwoBwSgd::stages`]' and [`TwoBwSgd::every`]'s schedule errors
    /// ([`two_bw`]), [`Error::NotMultiple`] when `micro` is not a multiple of `every`, and
    /// [`Error::Length`] for a gradient of another length.
    pub fn run(
        &self,
        w0: &[f64],
        micro: usize,
        mut grad: impl FnMut(&[f64], usize) -> Vec<f64>,
    ) -> Result<Vec<Vec<f64>>> {
        let ops = two_bw(self.stages, 0, micro, self.every)?;
        if !micro.is_multiple_of(self.every) {
            return Err(Error::NotMultiple {
                what: "micro-batches",
                value: micro,
                of: "micro-batches per weight version",
                divisor: self.every,
            });
        }
        let mut versions = vec![w0.to_vec()];
        let mut acc = vec![0.0; w0.len()];
        let mut in_batch = 0;
        for v in ops {
            let PipeOp::Backward(j) = v.op else { continue };
            let batch = j / self.every;
            let on = match self.delay {
                WeightDelay::TwoBW => v.version,
                WeightDelay::Flush => batch,
            };
            let g = grad(&versions[on], j);
            if g.len() != w0.len() {
                return Err(Error::Length {
                    what: format!("gradient elements of micro-batch {j} for the weights"),
                    got: g.len(),
                    expected: w0.len(),
                });
            }
            for (a, x) in acc.iter_mut().zip(&g) {
                *a += x;
            }
            in_batch += 1;
            if in_batch == self.every {
                let last = versions.last().expect("W(0) is there");
                let next = last
                    .iter()
                    .zip(&acc)
                    .map(|(w, a)| w - self.lr * a)
                    .collect();
                versions.push(next);
                acc.iter_mut().for_each(|a| *a = 0.0);
                in_batch = 0;
            }
        }
        Ok(versions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f_j(w) = ½ Σ_i a_i (w_i − c_{j,i})²: g_j(w) = a ⊙ (w − c_j).
    fn quad(w: &[f64], j: usize) -> Vec<f64> {
        let a = [1.0, 0.5];
        (0..2)
            .map(|i| a[i] * (w[i] - (j as f64 * 0.25 + i as f64)))
            .collect()
    }

    fn batch_grad(w: &[f64], t: usize, every: usize) -> Vec<f64> {
        let mut g = vec![0.0; 2];
        for j in t * every..(t + 1) * every {
            for (a, x) in g.iter_mut().zip(quad(w, j)) {
                *a += x;
            }
        }
        g
    }

    #[test]
    fn two_bw_is_the_delayed_update() {
        let (lr, every, stages) = (0.1, 3, 3);
        let sgd = TwoBwSgd {
            lr,
            every,
            stages,
            delay: WeightDelay::TwoBW,
        };
        let w0 = [2.0, -1.0];
        let got = sgd.run(&w0, 5 * every, quad).unwrap();
        assert_eq!(got.len(), 6);
        // by hand: W(1) = W(0) − ν g_0(W(0)); W(t+1) = W(t) − ν g_t(W(t−1))
        let mut w: Vec<Vec<f64>> = vec![w0.to_vec()];
        for t in 0..5 {
            let on = &w[t.max(1) - 1];
            let g = batch_grad(on, t, every);
            let next = w[t].iter().zip(&g).map(|(x, y)| x - lr * y).collect();
            w.push(next);
        }
        assert_eq!(got, w);
        // the delay matters: W(2) is not SGD's
        let flush = TwoBwSgd {
            delay: WeightDelay::Flush,
            ..sgd
        };
        assert_ne!(flush.run(&w0, 5 * every, quad).unwrap()[2], got[2]);
    }

    #[test]
    fn flush_is_sgd_with_accumulation() {
        let (lr, every) = (0.05, 4);
        let sgd = TwoBwSgd {
            lr,
            every,
            stages: 2,
            delay: WeightDelay::Flush,
        };
        let w0 = [0.5, 3.0];
        let got = sgd.run(&w0, 4 * every, quad).unwrap();
        let mut w = w0.to_vec();
        for (t, v) in got.iter().enumerate().skip(1) {
            let g = batch_grad(&w, t - 1, every);
            w = w.iter().zip(&g).map(|(x, y)| x - lr * y).collect();
            assert_eq!(v, &w);
        }
    }

    #[test]
    fn typed_errors() {
        let sgd = TwoBwSgd {
            lr: 0.1,
            every: 2,
            stages: 3,
            delay: WeightDelay::TwoBW,
        };
        assert!(matches!(
            sgd.run(&[0.0], 4, |w, _| w.to_vec()),
            Err(Error::TooFew {
                got: 2,
                need: 3,
                ..
            })
        ));
        let sgd = TwoBwSgd { stages: 2, ..sgd };
        assert!(matches!(
            sgd.run(&[0.0], 3, |w, _| w.to_vec()),
            Err(Error::NotMultiple {
                value: 3,
                divisor: 2,
                ..
            })
        ));
        assert!(matches!(
            sgd.run(&[0.0], 4, |_, _| vec![1.0, 2.0]),
            Err(Error::Length {
                got: 2,
                expected: 1,
                ..
            })
        ));
    }
}
