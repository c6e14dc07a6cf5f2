//! A keyed pseudo-random permutation of `0..n` in O(1) memory: a Feistel network over the next
//! power of two, with cycle-walking.

use super::rng::derive_seed;

const FEISTEL_ROUNDS: usize = 4;

/// A keyed pseudo-random permutation of `0..n` in O(1) memory.
///
/// The domain is `0..2^bits` with `2^bits` the smallest power of two `>= max(n, 4)` (so less than
/// `2n` for `n >= 3`). Each round splits `x` into its high `bits / 2` bits `L` and low
/// `bits - bits / 2` bits `R` and outputs `R · 2^(bits/2) + (L ⊕ F_k(R))`, which is invertible
/// whatever `F`. The round function is a keyed multiply-shift hash (Dietzfelbinger et al.),
/// `F_k(R)` = the top `bits / 2` bits of `(R ⊕ a_k) · m_k mod 2^64` with random `a_k` and odd
/// `m_k`: one multiplication per round, so a permutation costs a few nanoseconds. Values that
/// land outside `0..n` are walked through the permutation again until they land inside
/// (cycle-walking), which restricts a permutation of the power-of-two domain to one of `0..n`;
/// since the domain is less than twice `n`, that takes fewer than two passes on average.
#[derive(Clone, Debug)]
pub(crate) struct Permutation {
    n: u64,
    /// Width of the low part `R`.
    lo_bits: u32,
    /// Width of the high part `L`.
    hi_bits: u32,
    /// Per round: the xor key `a_k` and the odd multiplier `m_k`.
    keys: [(u64, u64); FEISTEL_ROUNDS],
}

impl Permutation {
    /// The permutation of `0..n` keyed by `key`.
    pub(crate) fn new(n: u64, key: u64) -> Self {
        let bits = n.max(4).next_power_of_two().trailing_zeros();
        let hi_bits = bits / 2;
        let mut keys = [(0, 0); FEISTEL_ROUNDS];
        for (i, k) in keys.iter_mut().enumerate() {
            let i = 2 * i as u64;
            *k = (
                derive_seed(key, 0x6665_6973_7465_6c21, i),
                derive_seed(key, 0x6665_6973_7465_6c21, i + 1) | 1,
            );
        }
        Self {
            n,
            lo_bits: bits - hi_bits,
            hi_bits,
            keys,
        }
    }

    /// One pass of the Feistel network over `0..2^bits`.
    fn round_trip(&self, mut x: u64) -> u64 {
        let lo_mask = (1u64 << self.lo_bits) - 1;
        // hi_bits >= 1, so the shift is below 64.
        let f_shift = 64 - self.hi_bits;
        for &(a, m) in &self.keys {
            let hi = x >> self.lo_bits;
            let lo = x & lo_mask;
            x = (lo << self.hi_bits) | (hi ^ ((lo ^ a).wrapping_mul(m) >> f_shift));
        }
        x
    }

    /// The image of `x < n`.
    pub(crate) fn apply(&self, x: u64) -> u64 {
        debug_assert!(x < self.n.max(1));
        if self.n <= 1 {
            return x;
        }
        let mut y = self.round_trip(x);
        while y >= self.n {
            y = self.round_trip(y);
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_bijection() {
        for n in [1u64, 2, 3, 4, 5, 7, 8, 9, 17, 1000, 1023, 1024, 1025, 4099] {
            for key in [0, 1, 0xdead_beef] {
                let p = Permutation::new(n, key);
                let mut seen = vec![false; n as usize];
                for x in 0..n {
                    let y = p.apply(x);
                    assert!(y < n, "n={n} key={key}: {x} -> {y}");
                    assert!(!seen[y as usize], "n={n} key={key}: {y} hit twice");
                    seen[y as usize] = true;
                }
            }
        }
        // It scrambles: few fixed points, and the image of 0..10 is not 0..10.
        let p = Permutation::new(1000, 42);
        assert!((0..1000).filter(|&x| p.apply(x) == x).count() < 10);
        assert!((0..10).map(|x| p.apply(x)).any(|y| y >= 10));
        // Different keys, different permutations.
        let q = Permutation::new(1000, 43);
        assert!((0..1000).filter(|&x| p.apply(x) == q.apply(x)).count() < 10);
    }
}
