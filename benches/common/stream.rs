//! A STREAM-like kernel shaped like Adam (read 4 arrays, write 3): the memory-bandwidth ceiling
//! the CPU Adam is measured against.
//!
//! An fp32 Adam step reads the parameter, gradient, momentum and variance of every element and
//! writes the parameter, momentum and variance back: 16 bytes read and 12 written. The kernel
//! here moves the same bytes in the same pattern with almost no arithmetic,
//!
//! ```text
//! a += b;  c += b;  d += b
//! ```
//!
//! and uses what the Adam kernel uses: the same vector widths (16 lanes with AVX-512, 8 with AVX2,
//! one element at a time on the scalar path), ordinary unaligned loads and stores (no
//! non-temporal stores, no prefetching), and the same thread split (contiguous parts aligned to
//! 64 elements, the first on the calling thread). Its throughput is what a memory-bound Adam can
//! reach on the machine; `Adam GB/s / stream GB/s` says how close the optimizer comes to it.
//!
//! Every path computes the same single rounded addition per output, so all paths and every
//! thread count give bitwise identical results.
//!
//! A bench helper, not part of the crate: the benches, `examples/adam_bench.rs` and
//! `tests/stream.rs` (its tests) include it by path.
//!
//! ```text
//! use tidemem::ops::Isa;
//! # fn main() -> tidemem::Result<()> {
//! let (mut a, b) = (vec![1.0f32; 1000], vec![0.5f32; 1000]);
//! let (mut c, mut d) = (vec![2.0f32; 1000], vec![3.0f32; 1000]);
//! stream_4r3w(Isa::detect(), 2, &mut a, &b, &mut c, &mut d)?;
//! assert_eq!((a[999], c[0], d[500]), (1.5, 2.5, 3.5));
//! assert_eq!(BYTES_PER_ELEM, 28);
//! # Ok(()) }
//! ```

use tidemem::ops::Isa;
use tidemem::{Error, Result};

/// Bytes one element moves, in this kernel and in an fp32 Adam step without a copy: four 4-byte
/// reads and three 4-byte writes.
pub const BYTES_PER_ELEM: usize = 28;

/// Slices shorter than this per thread run on one thread (the CPU Adam's threshold).
const MIN_PER_THREAD: usize = 1 << 16;

/// The operands as raw pointers: `n` elements at each.
#[derive(Clone, Copy, Debug)]
struct Ptrs {
    n: usize,
    a: *mut f32,
    b: *const f32,
    c: *mut f32,
    d: *mut f32,
}

// SAFETY: `Ptrs` is only built from slices the caller holds exclusively (`a`, `c`, `d`) or shared
// (`b`) for the whole call; the threads it is split over touch disjoint ranges of the mutable
// ones and only read `b`.
unsafe impl Send for Ptrs {}

impl Ptrs {
    /// The sub-range `lo..hi` (`lo <= hi <= n`).
    fn range(self, lo: usize, hi: usize) -> Ptrs {
        Ptrs {
            n: hi - lo,
            a: self.a.wrapping_add(lo),
            b: self.b.wrapping_add(lo),
            c: self.c.wrapping_add(lo),
            d: self.d.wrapping_add(lo),
        }
    }
}

/// One pass of `a += b; c += b; d += b` over equally long slices on the `isa` path, split over up
/// to `threads` threads exactly as [`super::CpuAdam`] splits a step.
///
/// Errors ([`Error::InvalidArgument`]) when the lengths differ or this CPU cannot run `isa`.
pub fn stream_4r3w(
    isa: Isa,
    threads: usize,
    a: &mut [f32],
    b: &[f32],
    c: &mut [f32],
    d: &mut [f32],
) -> Result<()> {
    let n = a.len();
    if b.len() != n || c.len() != n || d.len() != n {
        return Err(Error::InvalidArgument(format!(
            "stream operands differ in length: {n}, {}, {}, {}",
            b.len(),
            c.len(),
            d.len()
        )));
    }
    if !isa.is_supported() {
        return Err(Error::InvalidArgument(format!(
            "this CPU cannot run the {} path",
            isa.name()
        )));
    }
    let ptrs = Ptrs {
        n,
        a: a.as_mut_ptr(),
        b: b.as_ptr(),
        c: c.as_mut_ptr(),
        d: d.as_mut_ptr(),
    };
    // SAFETY: every pointer covers `n` elements; `a`, `c`, `d` are distinct `&mut` slices, so
    // they alias nothing, and `b` is shared and cannot overlap them; `isa` was checked above.
    unsafe { run(isa, threads, ptrs) };
    Ok(())
}

/// Splits `p` as `CpuAdam::run` does: `threads` contiguous parts (fewer when a part would hold
/// under [`MIN_PER_THREAD`] elements) of a multiple of 64 elements, the first on this thread.
///
/// # Safety
/// Every pointer of `p` is valid for `p.n` elements and not accessed by anything else during the
/// call (`b` may be read); `a`, `c`, `d` do not overlap each other or `b`; the CPU supports `isa`.
unsafe fn run(isa: Isa, threads: usize, p: Ptrs) {
    let parts = threads.min(p.n / MIN_PER_THREAD).max(1);
    if parts == 1 {
        // SAFETY: forwarded contract.
        unsafe { run_on(isa, p) };
        return;
    }
    let per = p.n.div_ceil(parts).div_ceil(64) * 64;
    std::thread::scope(|scope| {
        let mut lo = per.min(p.n);
        while lo < p.n {
            let hi = (lo + per).min(p.n);
            let part = p.range(lo, hi);
            // SAFETY: disjoint sub-ranges of the caller's operands.
            scope.spawn(move || unsafe { run_on(isa, part) });
            lo = hi;
        }
        // SAFETY: the first sub-range, on this thread.
        unsafe { run_on(isa, p.range(0, per.min(p.n))) };
    });
}

/// Runs one path over `p` on this thread.
///
/// # Safety
/// As [`run`].
unsafe fn run_on(isa: Isa, p: Ptrs) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports the path (checked by `stream_4r3w`); forwarded contract.
        Isa::Avx512 => unsafe { x86::stream_avx512(p) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::stream_avx2(p) },
        // SAFETY: forwarded contract.
        _ => unsafe { stream_scalar(p) },
    }
}

/// The scalar path (also the tail of the vector paths).
///
/// # Safety
/// As [`run`].
unsafe fn stream_scalar(p: Ptrs) {
    for i in 0..p.n {
        // SAFETY: `i < n` and every pointer covers `n` elements; the operands do not overlap.
        unsafe {
            let b = *p.b.add(i);
            *p.a.add(i) += b;
            *p.c.add(i) += b;
            *p.d.add(i) += b;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The vector paths, with the target features of the matching Adam paths.
    use std::arch::x86_64::*;

    use super::{stream_scalar, Ptrs};

    /// # Safety
    /// As `run`; the CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn stream_avx2(p: Ptrs) {
        let full = p.n / 8 * 8;
        let mut i = 0;
        while i < full {
            // SAFETY: `i + 8 <= n` elements are valid at every pointer; features enabled on this
            // function; every operand is loaded before any store.
            unsafe {
                let a = _mm256_loadu_ps(p.a.add(i));
                let b = _mm256_loadu_ps(p.b.add(i));
                let c = _mm256_loadu_ps(p.c.add(i));
                let d = _mm256_loadu_ps(p.d.add(i));
                _mm256_storeu_ps(p.a.add(i), _mm256_add_ps(a, b));
                _mm256_storeu_ps(p.c.add(i), _mm256_add_ps(c, b));
                _mm256_storeu_ps(p.d.add(i), _mm256_add_ps(d, b));
            }
            i += 8;
        }
        // SAFETY: the remaining `n - full` elements, same contract.
        unsafe { stream_scalar(p.range(full, p.n)) }
    }

    /// # Safety
    /// As `run`; the CPU has AVX-512F and AVX-512BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn stream_avx512(p: Ptrs) {
        let full = p.n / 16 * 16;
        let mut i = 0;
        while i < full {
            // SAFETY: `i + 16 <= n` elements are valid at every pointer; features enabled on this
            // function; every operand is loaded before any store.
            unsafe {
                let a = _mm512_loadu_ps(p.a.add(i));
                let b = _mm512_loadu_ps(p.b.add(i));
                let c = _mm512_loadu_ps(p.c.add(i));
                let d = _mm512_loadu_ps(p.d.add(i));
                _mm512_storeu_ps(p.a.add(i), _mm512_add_ps(a, b));
                _mm512_storeu_ps(p.c.add(i), _mm512_add_ps(c, b));
                _mm512_storeu_ps(p.d.add(i), _mm512_add_ps(d, b));
            }
            i += 16;
        }
        // SAFETY: the remaining `n - full` elements, same contract.
        unsafe { stream_scalar(p.range(full, p.n)) }
    }
}

#[cfg(test)]
#[allow(dead_code)] // compiled into the benches too, whose harness runs no #[test]
mod tests {
    use super::*;

    fn supported() -> Vec<Isa> {
        Isa::ALL
            .into_iter()
            .filter(|i| {
                let ok = i.is_supported();
                if !ok {
                    eprintln!("skipping the {} path: not supported by this CPU", i.name());
                }
                ok
            })
            .collect()
    }

    /// Distinct, exactly representable values per array and element.
    fn init(n: usize, k: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (k * 1000 + (i % 997) as u32) as f32 * 0.25)
            .collect()
    }

    #[test]
    fn every_path_and_thread_count_computes_the_sums_at_odd_lengths() {
        let big = 3 * MIN_PER_THREAD + 37;
        for isa in supported() {
            for n in [0usize, 1, 7, 8, 15, 17, 31, 33, 1001, big] {
                for threads in [1, 2, 3] {
                    // offset by one element: unaligned starts
                    let (mut a, b, mut c, mut d) = (
                        init(n + 1, 1),
                        init(n + 1, 2),
                        init(n + 1, 3),
                        init(n + 1, 4),
                    );
                    stream_4r3w(isa, threads, &mut a[1..], &b[1..], &mut c[1..], &mut d[1..])
                        .unwrap();
                    let (a0, c0, d0) = (init(n + 1, 1), init(n + 1, 3), init(n + 1, 4));
                    assert_eq!(a[0], a0[0], "element before the slice changed");
                    for i in 1..=n {
                        let what = format!("{} n={n} threads={threads} i={i}", isa.name());
                        assert_eq!(a[i], a0[i] + b[i], "a: {what}");
                        assert_eq!(c[i], c0[i] + b[i], "c: {what}");
                        assert_eq!(d[i], d0[i] + b[i], "d: {what}");
                    }
                }
            }
        }
    }

    #[test]
    fn mismatched_lengths_and_unsupported_paths_are_errors() {
        let (mut a, b, mut c, mut d) = (vec![0f32; 4], vec![0f32; 4], vec![0f32; 4], vec![0f32; 4]);
        for (na, nb, nc, nd) in [(3, 4, 4, 4), (4, 3, 4, 4), (4, 4, 3, 4), (4, 4, 4, 0)] {
            let r = stream_4r3w(
                Isa::Scalar,
                1,
                &mut a[..na],
                &b[..nb],
                &mut c[..nc],
                &mut d[..nd],
            );
            assert!(
                matches!(r, Err(Error::InvalidArgument(_))),
                "{na} {nb} {nc} {nd}"
            );
        }
        let long = vec![0f32; 5];
        assert!(matches!(
            stream_4r3w(Isa::Scalar, 1, &mut a, &long, &mut c, &mut d),
            Err(Error::InvalidArgument(_))
        ));
        for isa in Isa::ALL {
            assert_eq!(
                stream_4r3w(isa, 1, &mut a, &b, &mut c, &mut d).is_ok(),
                isa.is_supported(),
                "{}",
                isa.name()
            );
        }
        assert_eq!(BYTES_PER_ELEM, 28);
    }
}
