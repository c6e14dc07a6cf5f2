//! Deterministic pseudo-random numbers: the crate's one SplitMix64, and xoshiro256** for long
//! streams.
//!
//! - [`mix64`] is the SplitMix64 finalizer, a bijective 64-bit hash; [`splitmix64`] is the
//!   counter-based form (value `i` of a stream needs no state from value `i - 1`), and
//!   [`derive_seed`] keys independent sub-seeds off one seed.
//! - [`SplitMix64`] is the sequential generator (Steele, Lea & Flood, 2014): one `u64` of state,
//!   fast, and good enough for test data, patterns and seeding.
//! - [`Xoshiro256`] is xoshiro256** (Blackman & Vigna, 2018), seeded through SplitMix64, for the
//!   long streams of the synthetic data sets.
//!
//! Both generators implement [`Rng`], which turns 64-bit outputs into floats, bounded integers
//! and bytes.
//!
//! ```
//! use tidemem::rng::{Rng, SplitMix64};
//! let mut a = SplitMix64::new(7);
//! let mut b = SplitMix64::new(7);
//! assert_eq!(a.next_u64(), b.next_u64()); // deterministic
//! let x = a.next_f64();
//! assert!((0.0..1.0).contains(&x));
//! assert!(a.below(10) < 10);
//! assert_eq!(a.bytes(5).len(), 5);
//! ```

/// The SplitMix64 increment: 2^64 divided by the golden ratio, rounded to odd.
pub const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The SplitMix64 finalizer: a bijective, well-mixing 64-bit hash.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64 as a counter-based generator: the value after state `x`, i.e.
/// `mix64(x + GOLDEN_GAMMA)`. Hashing `seed ^ i` gives element `i` of a stream without the
/// elements before it.
///
/// ```
/// use tidemem::rng::{splitmix64, Rng, SplitMix64};
/// assert_eq!(splitmix64(42), SplitMix64::new(42).next_u64());
/// ```
pub fn splitmix64(x: u64) -> u64 {
    mix64(x.wrapping_add(GOLDEN_GAMMA))
}

/// A value derived from `seed` for `(domain, index)`: different domains or indices give
/// independent-looking values, so one seed can key many streams.
pub fn derive_seed(seed: u64, domain: u64, index: u64) -> u64 {
    mix64(mix64(seed ^ domain).wrapping_add(index.wrapping_mul(GOLDEN_GAMMA)))
}

/// A uniform value in `[0, 1)` from the top 53 bits of `x`.
pub(crate) fn unit_f64(x: u64) -> f64 {
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A uniform value in `[0, 1)` from the top 24 bits of `x`.
pub(crate) fn unit_f32(x: u64) -> f32 {
    (x >> 40) as f32 / (1u64 << 24) as f32
}

/// A source of 64-bit pseudo-random values, and what can be made of them.
pub trait Rng {
    /// The next 64 random bits.
    fn next_u64(&mut self) -> u64;

    /// The next 32 random bits (the high half of [`next_u64`](Self::next_u64)).
    fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in `[0, 1)`, 53 bits.
    fn next_f64(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }

    /// Uniform in `[0, 1)`, 24 bits.
    fn next_f32(&mut self) -> f32 {
        unit_f32(self.next_u64())
    }

    /// Uniform in `[lo, hi)` (for `lo < hi`), 24 bits.
    fn uniform_f32(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.next_f32()
    }

    /// Uniform in `0..n` by multiply-shift (bias below `n / 2^64`); 0 when `n` is 0.
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// `len` random bytes.
    fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

/// The SplitMix64 generator: each output is [`mix64`] of a state that advances by
/// [`GOLDEN_GAMMA`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed` (any value, 0 included).
    pub const fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }
}

impl Rng for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }
}

/// The xoshiro256** generator, 256 bits of state seeded by four [`SplitMix64`] outputs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    /// A generator seeded with `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Self {
        // Four consecutive SplitMix64 outputs: mix64 is a bijection, so at most one is zero and
        // the state is never all zero.
        let mut sm = SplitMix64::new(seed);
        Xoshiro256 {
            s: [sm.next_u64(), sm.next_u64(), sm.next_u64(), sm.next_u64()],
        }
    }
}

impl Rng for Xoshiro256 {
    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_outputs() {
        // The first outputs of the reference implementation seeded with 1234567.
        let mut r = SplitMix64::new(1234567);
        let want = [
            6457827717110365317,
            3203168211198807973,
            9817491932198370423,
            4593380528125082431,
            16408922859458223821,
        ];
        for w in want {
            assert_eq!(r.next_u64(), w);
        }
        assert_eq!(splitmix64(1234567), want[0]);
    }

    #[test]
    fn xoshiro_is_seeded_through_splitmix() {
        let mut sm = SplitMix64::new(9);
        let s = [sm.next_u64(), sm.next_u64(), sm.next_u64(), sm.next_u64()];
        let mut x = Xoshiro256::new(9);
        let expected = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        assert_eq!(x.next_u64(), expected);
        assert_ne!(Xoshiro256::new(0).next_u64(), 0);
    }

    #[test]
    fn derived_values_and_ranges() {
        let mut r = SplitMix64::new(3);
        for _ in 0..1000 {
            let x = r.next_f64();
            assert!((0.0..1.0).contains(&x));
            let y = r.uniform_f32(-1.0, 1.0);
            assert!((-1.0..1.0).contains(&y));
            assert!(r.below(7) < 7);
        }
        assert_eq!(r.below(0), 0);
        assert_eq!(unit_f64(u64::MAX), 1.0 - 1.0 / (1u64 << 53) as f64);
        assert_eq!(unit_f32(u64::MAX), 1.0 - 1.0 / (1u64 << 24) as f32);
        let b = SplitMix64::new(5).bytes(13);
        assert_eq!(b.len(), 13);
        assert_eq!(&b[..8], &SplitMix64::new(5).next_u64().to_le_bytes());
        assert_ne!(derive_seed(1, 2, 3), derive_seed(1, 2, 4));
        assert_ne!(derive_seed(1, 2, 3), derive_seed(1, 3, 3));
    }
}
