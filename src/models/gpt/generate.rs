//! Sampling text from a trained GPT.

use super::Gpt;
use crate::error::{Error, Result};
use crate::rng::{Rng, SplitMix64};
use crate::store::ParamStore;

impl Gpt {
    /// Continues `prompt` by `n` tokens, each drawn from the softmax of the last position's
    /// logits at `temperature` (0: the most likely token), from a generator seeded by `seed`;
    /// the context is the last `max_seq` tokens. Every token is one forward pass over the
    /// context ([`Gpt::logits`]; no key/value cache), so this is for short samples.
    ///
    /// Fails on an empty prompt, a token out of range, or a negative or non-finite
    /// temperature.
    pub fn generate<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        prompt: &[i32],
        n: usize,
        temperature: f32,
        seed: u64,
    ) -> Result<Vec<i32>> {
        if prompt.is_empty() {
            return Err(Error::Empty {
                what: "the prompt of a generation".into(),
            });
        }
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(Error::BadValue {
                what: "the sampling temperature".into(),
                value: f64::from(temperature),
                want: "finite and at least 0",
            });
        }
        let (v, max) = (self.config.vocab, self.config.max_seq);
        let mut rng = SplitMix64::new(seed);
        let mut seq = prompt.to_vec();
        // the prompt and the tokens drawn, as ids (before any work: a count no host holds is
        // an error, not an abort)
        crate::limits::host_bytes(
            || {
                format!(
                    "a generation of {n} tokens after a prompt of {}",
                    prompt.len()
                )
            },
            &[n.saturating_add(prompt.len()), 8],
        )?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let ctx = &seq[seq.len().saturating_sub(max)..];
            let logits = self.logits(store, ctx, 1, ctx.len())?;
            let last = &logits[(ctx.len() - 1) * v..ctx.len() * v];
            let next = pick(last, temperature, rng.next_f64());
            seq.push(next);
            out.push(next);
        }
        Ok(out)
    }
}

/// The token `u ∈ [0, 1)` falls on in the softmax of `logits / temperature` (the arg max at
/// temperature 0).
fn pick(logits: &[f32], temperature: f32, u: f64) -> i32 {
    let argmax = logits
        .iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &l)| if l > b.1 { (i, l) } else { b },
        )
        .0;
    if temperature == 0.0 {
        return argmax as i32;
    }
    let m = f64::from(logits[argmax]);
    let w: Vec<f64> = logits
        .iter()
        .map(|&l| ((f64::from(l) - m) / f64::from(temperature)).exp())
        .collect();
    let mut left = u * w.iter().sum::<f64>();
    for (i, &x) in w.iter().enumerate() {
        left -= x;
        if left < 0.0 {
            return i as i32;
        }
    }
    argmax as i32
}

#[cfg(test)]
mod tests {
    use super::pick;

    #[test]
    fn picks_follow_the_softmax() {
        let l = [0.0f32, 3.0, 1.0];
        assert_eq!(pick(&l, 0.0, 0.9), 1);
        // at temperature 1 the weights are e^-3 : 1 : e^-2 of their sum
        let w = [(-3f64).exp(), 1.0, (-2f64).exp()];
        let total: f64 = w.iter().sum();
        assert_eq!(pick(&l, 1.0, 0.0), 0);
        assert_eq!(pick(&l, 1.0, (w[0] + 0.5) / total), 1);
        assert_eq!(pick(&l, 1.0, 0.999_999), 2);
    }
}
