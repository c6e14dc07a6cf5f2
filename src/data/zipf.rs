//! Zipf-distributed ranks, `P(k) ∝ k^-s` over `1..=n`, in O(1) memory and expected O(1) time.

use super::rng::Rng;

// ---------------------------------------------------------------------------------------------
// Zipf sampling by rejection-inversion.
// ---------------------------------------------------------------------------------------------

/// Zipf law over `1..=n`, `P(k) ∝ k^-s`, sampled by rejection-inversion (W. Hörmann and
/// G. Derflinger, "Rejection-inversion to generate variates from monotone discrete
/// distributions", ACM TOMACS 6(3), 1996), in the formulation of Apache Commons RNG's
/// `RejectionInversionZipfSampler`. O(1) memory; expected O(1) time with a high acceptance
/// rate for every `s >= 0`.
#[derive(Clone, Debug)]
pub(crate) struct Zipf {
    n: u64,
    pub(crate) exponent: f64,
    /// `H(1.5) - 1`.
    h_integral_x1: f64,
    /// `H(n + 0.5)`.
    h_integral_n: f64,
    /// The squeeze: `k - x <= s` accepts without evaluating `H`.
    s: f64,
}

impl Zipf {
    /// The law over `1..=max(n, 1)` with exponent `s` (finite and `>= 0`: the caller checks).
    pub(crate) fn new(n: u64, exponent: f64) -> Self {
        let mut z = Self {
            n: n.max(1),
            exponent,
            h_integral_x1: 0.0,
            h_integral_n: 0.0,
            s: 0.0,
        };
        z.h_integral_x1 = z.h_integral(1.5) - 1.0;
        z.h_integral_n = z.h_integral(z.n as f64 + 0.5);
        z.s = 2.0 - z.h_integral_inverse(z.h_integral(2.5) - z.h(2.0));
        z
    }

    /// A rank in `1..=n`.
    pub(crate) fn sample(&self, rng: &mut impl Rng) -> u64 {
        if self.n == 1 {
            return 1;
        }
        if self.exponent == 0.0 {
            return 1 + rng.below(self.n);
        }
        loop {
            // u is uniform in (H(1.5) - 1, H(n + 0.5)].
            let u = self.h_integral_n + rng.next_f64() * (self.h_integral_x1 - self.h_integral_n);
            let x = self.h_integral_inverse(u);
            // `as` saturates (and maps NaN to 0); clamp into the support.
            let k = ((x + 0.5) as u64).clamp(1, self.n);
            let kf = k as f64;
            if kf - x <= self.s || u >= self.h_integral(kf + 0.5) - self.h(kf) {
                return k;
            }
        }
    }

    /// `h(x) = x^-s`.
    fn h(&self, x: f64) -> f64 {
        (-self.exponent * x.ln()).exp()
    }

    /// `H(x) = ∫_1^x t^-s dt = (x^(1-s) - 1) / (1 - s)`, or `ln x` for `s = 1`, computed stably.
    pub(crate) fn h_integral(&self, x: f64) -> f64 {
        let log_x = x.ln();
        helper2((1.0 - self.exponent) * log_x) * log_x
    }

    /// Inverse of [`h_integral`](Self::h_integral).
    fn h_integral_inverse(&self, x: f64) -> f64 {
        let t = (x * (1.0 - self.exponent)).max(-1.0);
        (helper1(t) * x).exp()
    }
}

/// `ln(1 + x) / x`, continuous at 0.
fn helper1(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

/// `(e^x - 1) / x`, continuous at 0.
fn helper2(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::rng::Xoshiro256;

    /// Generalized harmonic number `Σ_{r=1}^{n} r^-s`.
    fn harmonic(n: u64, s: f64) -> f64 {
        (1..=n).map(|r| (r as f64).powf(-s)).sum()
    }

    #[test]
    fn zipf_top_percent_share_matches_analytic() {
        let n = 1_000_000;
        let z = Zipf::new(n, 1.0);
        let mut rng = Xoshiro256::new(11);
        let samples = 1_000_000;
        let top = (0..samples)
            .filter(|_| z.sample(&mut rng) <= n / 100)
            .count();
        let share = top as f64 / samples as f64;
        let expected = harmonic(n / 100, 1.0) / harmonic(n, 1.0);
        assert!((expected - 0.68).abs() < 0.01, "{expected}");
        assert!(
            (share - expected).abs() < 0.02 * expected,
            "share {share}, expected {expected}"
        );
    }

    #[test]
    fn zipf_matches_exact_pmf_on_small_support() {
        let n = 10;
        for s in [0.0, 0.5, 1.0, 2.5] {
            let z = Zipf::new(n, s);
            let mut rng = Xoshiro256::new(5);
            let samples = 200_000;
            let mut counts = [0u64; 10];
            for _ in 0..samples {
                let k = z.sample(&mut rng);
                assert!((1..=n).contains(&k));
                counts[(k - 1) as usize] += 1;
            }
            let norm = harmonic(n, s);
            for (i, &c) in counts.iter().enumerate() {
                let p = ((i + 1) as f64).powf(-s) / norm;
                let sd = (samples as f64 * p * (1.0 - p)).sqrt();
                let dev = (c as f64 - samples as f64 * p).abs();
                assert!(
                    dev < 5.0 * sd + 1.0,
                    "s={s} rank {}: {c} vs {}",
                    i + 1,
                    samples as f64 * p
                );
            }
        }
    }

    #[test]
    fn zipf_zero_is_uniform_and_large_exponents_terminate() {
        let z = Zipf::new(100, 0.0);
        let mut rng = Xoshiro256::new(9);
        let mut counts = [0u64; 100];
        for _ in 0..100_000 {
            counts[(z.sample(&mut rng) - 1) as usize] += 1;
        }
        // Expected 1000 each, sd ~31.
        assert!(
            counts.iter().all(|&c| (850..=1150).contains(&c)),
            "{counts:?}"
        );
        for s in [20.0, 1e3, 1e12] {
            let z = Zipf::new(50_000_000, s);
            assert!((0..1000).all(|_| z.sample(&mut rng) == 1), "s={s}");
        }
        // Large tables at s = 1 reach deep ranks.
        let z = Zipf::new(50_000_000, 1.0);
        let max = (0..100_000).map(|_| z.sample(&mut rng)).max().unwrap();
        assert!(max > 10_000_000 && max <= 50_000_000, "{max}");
    }
}
