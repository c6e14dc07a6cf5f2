//! The CPU's fused multiply-add peak, measured: 16 independent accumulator chains per thread
//! in registers (AVX-512 when the CPU has it, else AVX2 + FMA), one thread per core asked for.
//!
//! ```
//! if let Some((_, lanes)) = tidemem::profile::fma_isa() {
//!     let gflops = tidemem::profile::fma_peak(lanes, 1, 0.01);
//!     assert!(gflops > 0.0);
//! }
//! ```

use std::time::Instant;

/// Independent FMA accumulator chains per thread: more than latency × FMA ports (4 × 2 on
/// current x86 cores) keeps every port busy.
const CHAINS: usize = 16;

/// The FMA loops: 16 independent accumulator chains per thread, in registers.
#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    use super::CHAINS;

    /// `iters` rounds of 16 AVX-512 FMAs (16 lanes each); returns a sum so nothing is elided.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512(iters: u64) -> f32 {
        let (m, a) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, m, a);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }

    /// `iters` rounds of 16 AVX2 FMAs (8 lanes each).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn avx2(iters: u64) -> f32 {
        let (m, a) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, m, a);
            }
        }
        let mut lanes = [0.0f32; 8];
        let mut sum = 0.0;
        for x in acc {
            // SAFETY: `lanes` holds 8 f32s, what one unaligned 256-bit store writes.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), x) };
            sum += lanes.iter().sum::<f32>();
        }
        sum
    }
}

/// The widest FMA this CPU runs: (name, f32 lanes), or `None`.
pub fn fma_isa() -> Option<(&'static str, usize)> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some(("AVX-512", 16));
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Some(("AVX2+FMA", 8));
        }
    }
    None
}

/// One thread's FMA loop of `iters` rounds.
fn fma_loop(lanes: usize, iters: u64) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `lanes` comes from `fma_isa`, which detected the instructions at run time.
        unsafe {
            if lanes == 16 {
                fma::avx512(iters)
            } else {
                fma::avx2(iters)
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (lanes, iters);
        0.0
    }
}

/// Rounds [`fma_peak`] takes the best of.
const ROUNDS: u32 = 5;

/// The FMA peak in GFLOP/s over `threads` threads of `lanes`-wide FMAs (from [`fma_isa`]),
/// from register-only loops of about `secs` seconds in all: the hardware limit the GEMM and
/// the GPT benches measure their fraction against, in the same run.
///
/// The best of five rounds after a warm-up round: a round that shares its cores with other
/// work (a thread pool still spinning after its last task, another process) or runs before
/// the cores reach their wide-vector clocks reads low, and a peak that reads low makes every
/// fraction against it read high. No round can read above what the cores do.
pub fn fma_peak(lanes: usize, threads: usize, secs: f64) -> f64 {
    let chains = CHAINS as f64;
    let threads = threads.max(1);
    // Calibrate on one thread (which also brings the core to its wide-vector clock).
    let t = Instant::now();
    std::hint::black_box(fma_loop(lanes, 1 << 20));
    let per_iter = t.elapsed().as_secs_f64().max(1e-9) / (1 << 20) as f64;
    let round = secs.max(0.0) / f64::from(ROUNDS + 1);
    let iters = ((round / per_iter) as u64).max(1 << 16);
    let mut best = 0.0f64;
    for r in 0..=ROUNDS {
        let t = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| std::hint::black_box(fma_loop(lanes, iters)));
            }
        });
        let flops = threads as f64 * iters as f64 * chains * lanes as f64 * 2.0;
        // round 0 warms every thread's core up and is not counted
        if r > 0 {
            best = best.max(flops / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    best
}
