//! The vector paths: one generic body over [`Lanes`], instantiated for AVX2 and AVX-512
//! inside `#[target_feature]` functions.
use std::arch::x86_64::*;

use super::{AdamScalars, RawKind, RawStep};

/// The vector operations the body needs. Every method is `unsafe` because it requires its
/// target features (guaranteed by the caller of the `#[target_feature]` entry points) and,
/// for loads and stores, valid pointers for `N` elements.
pub(super) trait Lanes: Copy {
    const N: usize;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    unsafe fn load_f16(p: *const u16) -> Self;
    unsafe fn store_f16(self, p: *mut u16);
    unsafe fn load_bf16(p: *const u16) -> Self;
    unsafe fn store_bf16(self, p: *mut u16);
    unsafe fn sub(self, o: Self) -> Self;
    unsafe fn mul(self, o: Self) -> Self;
    unsafe fn div(self, o: Self) -> Self;
    unsafe fn sqrt(self) -> Self;
    /// `self · b + c`, rounded once.
    unsafe fn fma(self, b: Self, c: Self) -> Self;
}

#[derive(Clone, Copy)]
pub(super) struct V8(__m256);
#[derive(Clone, Copy)]
pub(super) struct V16(__m512);

impl Lanes for V8 {
    const N: usize = 8;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn splat(x: f32) -> Self {
        V8(_mm256_set1_ps(x))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: caller contract (8 valid elements).
        V8(unsafe { _mm256_loadu_ps(p) })
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: caller contract.
        unsafe { _mm256_storeu_ps(p, self.0) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f16(p: *const u16) -> Self {
        // SAFETY: caller contract.
        V8(_mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) }))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store_f16(self, p: *mut u16) {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.0);
        // SAFETY: caller contract.
        unsafe { _mm_storeu_si128(p.cast(), h) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_bf16(p: *const u16) -> Self {
        // SAFETY: caller contract.
        let h = unsafe { _mm_loadu_si128(p.cast()) };
        V8(_mm256_castsi256_ps(_mm256_slli_epi32::<16>(
            _mm256_cvtepu16_epi32(h),
        )))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store_bf16(self, p: *mut u16) {
        let x = _mm256_castps_si256(self.0);
        // round to nearest even: add 0x7fff plus the lowest kept bit, keep the top half
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
            _mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)),
            lsb,
        ));
        // NaN: keep the top half and set the quiet bit
        let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(0x40));
        let abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff));
        let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
        let r = _mm256_blendv_epi8(rounded, quiet, nan);
        // values fit 16 bits: pack without saturation effects, then gather the two lanes
        let packed = _mm256_packus_epi32(r, r);
        let ordered = _mm256_permute4x64_epi64::<0b1000>(packed);
        // SAFETY: caller contract.
        unsafe { _mm_storeu_si128(p.cast(), _mm256_castsi256_si128(ordered)) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sub(self, o: Self) -> Self {
        V8(_mm256_sub_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mul(self, o: Self) -> Self {
        V8(_mm256_mul_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn div(self, o: Self) -> Self {
        V8(_mm256_div_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sqrt(self) -> Self {
        V8(_mm256_sqrt_ps(self.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fma(self, b: Self, c: Self) -> Self {
        V8(_mm256_fmadd_ps(self.0, b.0, c.0))
    }
}

impl Lanes for V16 {
    const N: usize = 16;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn splat(x: f32) -> Self {
        V16(_mm512_set1_ps(x))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: caller contract (16 valid elements).
        V16(unsafe { _mm512_loadu_ps(p) })
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: caller contract.
        unsafe { _mm512_storeu_ps(p, self.0) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load_f16(p: *const u16) -> Self {
        // SAFETY: caller contract.
        V16(_mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) }))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn store_f16(self, p: *mut u16) {
        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self.0);
        // SAFETY: caller contract.
        unsafe { _mm256_storeu_si256(p.cast(), h) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load_bf16(p: *const u16) -> Self {
        // SAFETY: caller contract.
        let h = unsafe { _mm256_loadu_si256(p.cast()) };
        V16(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(
            _mm512_cvtepu16_epi32(h),
        )))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn store_bf16(self, p: *mut u16) {
        let x = _mm512_castps_si512(self.0);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
            _mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)),
            lsb,
        ));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(0x40));
        let abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff));
        let nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
        let r = _mm512_mask_blend_epi32(nan, rounded, quiet);
        // SAFETY: caller contract.
        unsafe { _mm256_storeu_si256(p.cast(), _mm512_cvtepi32_epi16(r)) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn sub(self, o: Self) -> Self {
        V16(_mm512_sub_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn mul(self, o: Self) -> Self {
        V16(_mm512_mul_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn div(self, o: Self) -> Self {
        V16(_mm512_div_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn sqrt(self) -> Self {
        V16(_mm512_sqrt_ps(self.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn fma(self, b: Self, c: Self) -> Self {
        V16(_mm512_fmadd_ps(self.0, b.0, c.0))
    }
}

/// The scalars, broadcast once per call.
#[derive(Clone, Copy)]
struct Consts<V> {
    gs: V,
    l2: V,
    b1: V,
    omb1: V,
    b2: V,
    omb2: V,
    ibc2: V,
    eps: V,
    decay: V,
    step: V,
}

/// One vector of elements at `i`.
///
/// # Safety
/// `N` elements from `i` are valid at every pointer of `raw`; target features present.
#[inline(always)]
unsafe fn block<V: Lanes, const G: u8, const C: u8>(c: &Consts<V>, raw: &RawStep, i: usize) {
    // SAFETY: caller contract; the gradient is loaded before the copy is stored.
    unsafe {
        let g = match G {
            0 => V::load(raw.grad.1.cast::<f32>().add(i)),
            1 => V::load_f16(raw.grad.1.cast::<u16>().add(i)),
            _ => V::load_bf16(raw.grad.1.cast::<u16>().add(i)),
        };
        let p = V::load(raw.p.add(i));
        let m = V::load(raw.m.add(i));
        let v = V::load(raw.v.add(i));
        let g = c.l2.fma(p, g.mul(c.gs));
        let m = c.b1.fma(m, c.omb1.mul(g));
        let v = c.b2.fma(v, c.omb2.mul(g.mul(g)));
        let d = v.sqrt().fma(c.ibc2, c.eps);
        let p = p.sub(c.decay.fma(p, c.step.mul(m.div(d))));
        p.store(raw.p.add(i));
        m.store(raw.m.add(i));
        v.store(raw.v.add(i));
        if let Some((_, cp)) = raw.copy {
            match C {
                1 => p.store_f16(cp.cast::<u16>().add(i)),
                2 => p.store_bf16(cp.cast::<u16>().add(i)),
                _ => {}
            }
        }
    }
}

/// The generic body: full vectors, then the tail through a padded stack copy so the tail
/// runs the very same operations.
///
/// # Safety
/// As `CpuAdam::run`; target features present.
#[inline(always)]
unsafe fn body<V: Lanes, const G: u8, const C: u8>(s: &AdamScalars, raw: RawStep) {
    // SAFETY: target features are present (caller contract).
    let c = unsafe {
        Consts {
            gs: V::splat(s.grad_scale),
            l2: V::splat(s.l2),
            b1: V::splat(s.beta1),
            omb1: V::splat(s.one_minus_beta1),
            b2: V::splat(s.beta2),
            omb2: V::splat(s.one_minus_beta2),
            ibc2: V::splat(s.inv_sqrt_bc2),
            eps: V::splat(s.eps),
            decay: V::splat(s.decoupled),
            step: V::splat(s.step_size),
        }
    };
    let full = raw.n / V::N * V::N;
    let mut i = 0;
    while i < full {
        // SAFETY: `i + N <= n`.
        unsafe { block::<V, G, C>(&c, &raw, i) };
        i += V::N;
    }
    let rest = raw.n - full;
    if rest == 0 {
        return;
    }
    let (mut p, mut m, mut v, mut g) = ([0f32; 16], [0f32; 16], [0f32; 16], [0f32; 16]);
    let mut cp = [0u16; 16];
    // SAFETY: `full + rest == n`; the stack arrays hold 16 >= N elements.
    unsafe {
        std::ptr::copy_nonoverlapping(raw.p.add(full), p.as_mut_ptr(), rest);
        std::ptr::copy_nonoverlapping(raw.m.add(full), m.as_mut_ptr(), rest);
        std::ptr::copy_nonoverlapping(raw.v.add(full), v.as_mut_ptr(), rest);
        let gb = if G == 0 { 4 } else { 2 };
        std::ptr::copy_nonoverlapping(
            raw.grad.1.add(full * gb),
            g.as_mut_ptr().cast::<u8>(),
            rest * gb,
        );
        let tail = RawStep {
            n: V::N,
            p: p.as_mut_ptr(),
            m: m.as_mut_ptr(),
            v: v.as_mut_ptr(),
            grad: (raw.grad.0, g.as_ptr().cast()),
            copy: raw.copy.map(|(k, _)| (k, cp.as_mut_ptr().cast::<u8>())),
        };
        block::<V, G, C>(&c, &tail, 0);
        std::ptr::copy_nonoverlapping(p.as_ptr(), raw.p.add(full), rest);
        std::ptr::copy_nonoverlapping(m.as_ptr(), raw.m.add(full), rest);
        std::ptr::copy_nonoverlapping(v.as_ptr(), raw.v.add(full), rest);
        if let Some((_, dst)) = raw.copy {
            std::ptr::copy_nonoverlapping(cp.as_ptr(), dst.cast::<u16>().add(full), rest);
        }
    }
}

/// Picks the body for the operand types.
#[inline(always)]
unsafe fn dispatch<V: Lanes>(s: &AdamScalars, raw: RawStep) {
    let c = match raw.copy {
        None => 0,
        Some((RawKind::Bf16, _)) => 2,
        Some(_) => 1,
    };
    // SAFETY: forwarded contract.
    unsafe {
        match (raw.grad.0, c) {
            (RawKind::F32, 0) => body::<V, 0, 0>(s, raw),
            (RawKind::F32, 1) => body::<V, 0, 1>(s, raw),
            (RawKind::F32, _) => body::<V, 0, 2>(s, raw),
            (RawKind::F16, 0) => body::<V, 1, 0>(s, raw),
            (RawKind::F16, 1) => body::<V, 1, 1>(s, raw),
            (RawKind::F16, _) => body::<V, 1, 2>(s, raw),
            (RawKind::Bf16, 0) => body::<V, 2, 0>(s, raw),
            (RawKind::Bf16, 1) => body::<V, 2, 1>(s, raw),
            (RawKind::Bf16, _) => body::<V, 2, 2>(s, raw),
        }
    }
}

/// # Safety
/// As `CpuAdam::run`; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn adam_avx2(s: &AdamScalars, raw: RawStep) {
    // SAFETY: forwarded contract; features enabled on this function.
    unsafe { dispatch::<V8>(s, raw) }
}

/// # Safety
/// As `CpuAdam::run`; the CPU has AVX-512F and AVX-512BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn adam_avx512(s: &AdamScalars, raw: RawStep) {
    // SAFETY: forwarded contract; features enabled on this function.
    unsafe { dispatch::<V16>(s, raw) }
}
