//! Block-wise 8-bit dynamic quantization of Adam's moments.
//!
//! A block of [`QUANT8_BLOCK`] values is stored as one byte a value and one f32 scale, the
//! block's largest magnitude (absmax). A byte indexes a 256-entry **dynamic map** of values in
//! [−1, 1], and the value is the entry times the scale. The map spends its codes on
//! magnitudes in seven decades, `[10⁻⁷, 10⁻⁶)` up to `[0.1, 1]`, with more codes in the larger
//! decades. Each decade is cut into equal sub-intervals, and its entries are their midpoints.
//! So a magnitude 10⁻⁵ of the block's largest keeps a few percent of relative precision, where
//! a linear 8-bit map would round it to 0.
//!
//! * [`Quant8Map::Signed`] (the momentum): decade `i` (0 to 6) has `2^i` entries on each side
//!   (127 a side). With 0 and +1 that makes 256 codes: code 127 is 0 and code 255 is +1. There
//!   is no −1: the entry nearest it is −0.99296875.
//! * [`Quant8Map::Unsigned`] (the variance): decade `i` has `2^(i+1)` entries (254). With 0
//!   (code 0) and 1 (code 255) that makes 256.
//!
//! Entry `j` of decade `i` is `j·c1 + c0` rounded once to f32 (an fma). Here `p = 10^(i−6)`, `k` is the
//! decade's count, `c1 = 0.9·p/k` and `c0 = p·(0.1 + 0.45/k)`, each rounded to f32 from f64.
//! [`Quant8Map::table`] is the map; every path looks a code up in it.
//!
//! Quantizing picks the **nearest entry**, except that a positive value never takes the
//! unsigned map's 0 (below the smallest entry it takes that entry): a variance rounded to 0
//! would divide its element's step by ε alone, a step up to `lr·m/ε` where Adam takes `lr`. The magnitude is scaled by `1/absmax` (one f32
//! division a block, then one multiply a value). Its decade comes from comparisons with the
//! powers of ten. Its sub-interval within the decade is
//! `trunc((a·10^(6−i) − 0.1)·(k/0.9))`, clamped to the decade. Two more comparisons cover the
//! two places where the nearest entry lies across an edge: the top entry of the decade below,
//! and 1 at the top. Every step is an IEEE operation or a comparison, so the scalar and vector
//! paths give the same codes.
//!
//! The block is 256 values (bitsandbytes' later releases use the same), not 2,048:
//! * chunk sizes are multiples of 1,024 elements, so a block never straddles two chunks or two
//!   ZeRO shards;
//! * a smaller block keeps a large value from flattening the small ones beside it;
//! * the scales cost 4/256 bytes a value, 0.016.
//!
//! The two moments of a parameter cost 2.03 bytes where f32 moments cost 8.

/// Values a scale covers.
pub const QUANT8_BLOCK: usize = 256;

/// Decades of the dynamic maps.
const DECADES: usize = 7;

/// A dynamic map: which values the 256 codes stand for (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Quant8Map {
    /// Signed values (the momentum): code 127 is 0, 255 is +1.
    Signed,
    /// Values ≥ 0 (the variance): code 0 is 0, 255 is 1.
    Unsigned,
}

/// The constants of one map, per decade.
struct Consts {
    /// Entries in each decade.
    count: [u32; DECADES],
    /// The magnitude code of each decade's first entry (0 is the code of 0).
    base: [u32; DECADES],
    /// The magnitude code of 1.
    top: u32,
    /// `fma(j, c1, c0)` is entry `j` of the decade.
    c1: [f32; DECADES],
    c0: [f32; DECADES],
    /// `10^(6−i)`: the decade scaled to [0.1, 1].
    up: [f32; DECADES],
    /// `k / 0.9`: sub-intervals a unit.
    per: [f32; DECADES],
    /// The midpoint between the decade's first entry and the entry below it.
    low: [f32; DECADES],
    /// The midpoint between the last entry and 1.
    high: f32,
}

/// The lower edges of the decades, `10^(i−7)`.
const EDGES: [f32; DECADES] = [1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1];

const fn consts(signed: bool) -> Consts {
    let mut c = Consts {
        count: [0; DECADES],
        base: [0; DECADES],
        top: 0,
        c1: [0.0; DECADES],
        c0: [0.0; DECADES],
        up: [0.0; DECADES],
        per: [0.0; DECADES],
        low: [0.0; DECADES],
        high: 0.0,
    };
    let mut i = 0;
    let mut base = 1;
    let mut p = 1e-6f64;
    let mut up = 1e6f64;
    let mut below = 0.0f64;
    while i < DECADES {
        let k = if signed { 1u32 << i } else { 2u32 << i };
        let kf = k as f64;
        c.count[i] = k;
        c.base[i] = base;
        c.c1[i] = (0.9 * p / kf) as f32;
        c.c0[i] = (p * (0.1 + 0.45 / kf)) as f32;
        c.up[i] = up as f32;
        c.per[i] = (kf / 0.9) as f32;
        // the f32 entries, as `value` computes them (no fma in a const fn: j·c1 is exact for
        // the first entry, j = 0)
        let first = c.c0[i] as f64;
        c.low[i] = ((below + first) / 2.0) as f32;
        below = entry_f64(c.c1[i], c.c0[i], k - 1);
        base += k;
        p *= 10.0;
        up /= 10.0;
        i += 1;
    }
    c.top = base;
    c.high = ((below + 1.0) / 2.0) as f32;
    c
}

/// Entry `j` of a decade as f64: `j·c1 + c0` rounded once to f32, as [`f32::mul_add`] does.
const fn entry_f64(c1: f32, c0: f32, j: u32) -> f64 {
    // j·c1 + c0 is exact in f64 (24-bit mantissas, j < 2^8), so one rounding to f32 is the fma's
    ((j as f64) * (c1 as f64) + c0 as f64) as f32 as f64
}

static SIGNED: Consts = consts(true);
static UNSIGNED: Consts = consts(false);
static SIGNED_TABLE: [f32; 256] = table(&SIGNED, true);
static UNSIGNED_TABLE: [f32; 256] = table(&UNSIGNED, false);

/// Every code's value (see [`Quant8Map::value`]), computed as the fma would.
const fn table(c: &Consts, signed: bool) -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        let (mag, negative) = match signed {
            true if code >= 127 => (code as u32 - 127, false),
            true => (127 - code as u32, true),
            false => (code as u32, false),
        };
        let v = if mag == 0 {
            0.0
        } else if mag >= c.top {
            1.0
        } else {
            let mut i = DECADES - 1;
            while mag < c.base[i] {
                i -= 1;
            }
            entry_f64(c.c1[i], c.c0[i], mag - c.base[i]) as f32
        };
        t[code] = if negative { -v } else { v };
        code += 1;
    }
    t
}

impl Quant8Map {
    fn consts(self) -> &'static Consts {
        match self {
            Quant8Map::Signed => &SIGNED,
            Quant8Map::Unsigned => &UNSIGNED,
        }
    }

    /// The value code `code` stands for, in [−1, 1].
    #[inline(always)]
    pub(crate) fn value(self, code: u8) -> f32 {
        self.entries()[code as usize]
    }

    /// Every code's value, code 0 first: the map (increasing).
    pub fn table(self) -> [f32; 256] {
        *self.entries()
    }

    fn entries(self) -> &'static [f32; 256] {
        match self {
            Quant8Map::Signed => &SIGNED_TABLE,
            Quant8Map::Unsigned => &UNSIGNED_TABLE,
        }
    }

    /// The code of the entry nearest `x` (a value scaled to [−1, 1]; beyond it, the end
    /// entry; NaN gives 0's code; for [`Quant8Map::Unsigned`], below 0 gives 0).
    #[inline(always)]
    pub fn code(self, x: f32) -> u8 {
        let c = self.consts();
        let mag = magnitude_code(c, x.abs());
        match self {
            Quant8Map::Signed if x < 0.0 => (127 - mag.min(127)) as u8,
            Quant8Map::Signed => (127 + mag) as u8,
            // a positive variance never rounds to 0: the step would divide by ε alone
            Quant8Map::Unsigned if x > 0.0 => mag.max(1) as u8,
            Quant8Map::Unsigned => 0,
        }
    }
}

/// The magnitude code of the entry nearest `a` ≥ 0 (NaN: 0).
#[inline(always)]
fn magnitude_code(c: &Consts, a: f32) -> u32 {
    let (mut up, mut per, mut low, mut base, mut count) =
        (c.up[0], c.per[0], c.low[0], c.base[0], c.count[0]);
    for (i, &edge) in EDGES.iter().enumerate().skip(1) {
        if a >= edge {
            (up, per, low, base, count) = (c.up[i], c.per[i], c.low[i], c.base[i], c.count[i]);
        }
    }
    // the sub-interval, clamped to the decade (`max` and `min` give no NaN)
    let t = ((a * up - 0.1) * per).max(0.0).min((count - 1) as f32);
    // SAFETY: `t` is finite and in [0, 127] (clamped above), which an i32 holds.
    let j = unsafe { t.to_int_unchecked::<i32>() } as u32;
    let mut mag = base + j;
    // the entry below the decade's first, where it is nearer (a NaN is below: 0)
    let above = a >= low;
    if j == 0 && !above {
        mag -= 1;
    }
    if mag == c.top - 1 && a > c.high {
        mag = c.top;
    }
    mag
}

/// Quantizes one block of `values` into `codes`, returning its scale (the largest magnitude;
/// 0 for a block of zeros, whose codes are 0's). At most [`QUANT8_BLOCK`] values.
#[inline(always)]
pub(crate) fn quantize_block(map: Quant8Map, values: &[f32], codes: &mut [u8]) -> f32 {
    // the largest magnitude by the bits of |x| (an integer maximum, exact in any order)
    let bits = values
        .iter()
        .fold(0u32, |m, x| m.max(x.to_bits() & 0x7fff_ffff));
    let absmax = f32::from_bits(bits);
    let inv = if absmax > 0.0 { 1.0 / absmax } else { 0.0 };
    for (q, &x) in codes.iter_mut().zip(values) {
        *q = map.code(x * inv);
    }
    absmax
}

/// The values of one block of `codes` under `scale`, into `out`.
#[inline(always)]
pub(crate) fn dequantize_block(map: Quant8Map, codes: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &q) in out.iter_mut().zip(codes) {
        *o = map.value(q) * scale;
    }
}

/// Quantizes `values` into `codes` (one a value) and `scales` (one a [`QUANT8_BLOCK`] values,
/// the last block possibly shorter).
pub(crate) fn quantize8(
    map: Quant8Map,
    values: &[f32],
    codes: &mut [u8],
    scales: &mut [f32],
) -> crate::Result<()> {
    check_quant8(values.len(), codes.len(), scales.len())?;
    let blocks = values
        .chunks(QUANT8_BLOCK)
        .zip(codes.chunks_mut(QUANT8_BLOCK));
    for ((v, q), s) in blocks.zip(scales.iter_mut()) {
        *s = quantize_block(map, v, q);
    }
    Ok(())
}

/// The values of `codes` and `scales` (as [`quantize8`] wrote them) into `out`.
pub(crate) fn dequantize8(
    map: Quant8Map,
    codes: &[u8],
    scales: &[f32],
    out: &mut [f32],
) -> crate::Result<()> {
    check_quant8(out.len(), codes.len(), scales.len())?;
    let blocks = codes.chunks(QUANT8_BLOCK).zip(out.chunks_mut(QUANT8_BLOCK));
    for ((q, o), &s) in blocks.zip(scales) {
        dequantize_block(map, q, s, o);
    }
    Ok(())
}

/// `n` values need `n` codes and `ceil(n / QUANT8_BLOCK)` scales.
pub(crate) fn check_quant8(n: usize, codes: usize, scales: usize) -> crate::Result<()> {
    let blocks = n.div_ceil(QUANT8_BLOCK);
    for (what, got, expected) in [("8-bit codes", codes, n), ("block scales", scales, blocks)] {
        if got != expected {
            return Err(crate::Error::Length {
                what: format!("{what} for {n} values"),
                got,
                expected,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The code of the nearest entry, by looking at all 256.
    fn nearest(map: Quant8Map, x: f32) -> u8 {
        let t = map.table();
        let mut best = 0;
        for k in 0..256 {
            if (t[k] as f64 - x as f64).abs() < (t[best] as f64 - x as f64).abs() {
                best = k;
            }
        }
        best as u8
    }

    /// `x` as a C hexadecimal float literal (exact).
    fn hex(x: f32) -> String {
        if x == 0.0 {
            return "0.0f".into();
        }
        let b = x.to_bits();
        let sign = if b >> 31 == 1 { "-" } else { "" };
        let exp = ((b >> 23) & 0xff) as i32 - 127;
        assert!(exp > -127, "{x} is subnormal");
        format!("{sign}0x1.{:06x}p{exp}f", (b & 0x7f_ffff) << 1)
    }

    fn list<T: Copy>(xs: &[T], f: impl Fn(T) -> String) -> String {
        xs.iter().map(|&x| f(x)).collect::<Vec<_>>().join(", ")
    }

    /// `kernels/quant8.cuh`: the maps' constants as the CUDA kernels read them.
    fn cuda_header() -> String {
        let mut h = String::from(
            "// The 8-bit dynamic maps of src/ops/adam/quant8.rs, for kernels/adam8.cu. Generated:\n\
             // the test `the_cuda_header_holds_the_rust_maps` renders this file from the Rust\n\
             // constants and fails on any difference (TIDEMEM_BLESS=1 rewrites it).\n\
             #pragma once\n\n\
             #define QUANT8_BLOCK 256\n\
             #define QUANT8_DECADES 7\n\n\
             // One map's constants per decade (see quant8.rs for their meaning).\n\
             struct Quant8Consts {\n    unsigned count[QUANT8_DECADES];\n    \
             unsigned base[QUANT8_DECADES];\n    unsigned top;\n    \
             float c1[QUANT8_DECADES];\n    float c0[QUANT8_DECADES];\n    \
             float up[QUANT8_DECADES];\n    float per[QUANT8_DECADES];\n    \
             float low[QUANT8_DECADES];\n    float high;\n};\n\n",
        );
        h += &format!(
            "__constant__ float QUANT8_EDGES[QUANT8_DECADES] = {{{}}};\n\n",
            list(&EDGES, hex)
        );
        for (name, c) in [("SIGNED", &SIGNED), ("UNSIGNED", &UNSIGNED)] {
            h += &format!(
                "__constant__ Quant8Consts QUANT8_{name} = {{\n    {{{}}},\n    {{{}}},\n    {},\n",
                list(&c.count, |x| format!("{x}u")),
                list(&c.base, |x| format!("{x}u")),
                format_args!("{}u", c.top)
            );
            for xs in [&c.c1, &c.c0, &c.up, &c.per, &c.low] {
                h += &format!("    {{{}}},\n", list(xs, hex));
            }
            h += &format!("    {}}};\n\n", hex(c.high));
        }
        for (name, map) in [
            ("SIGNED", Quant8Map::Signed),
            ("UNSIGNED", Quant8Map::Unsigned),
        ] {
            h += &format!("__constant__ float QUANT8_{name}_TABLE[256] = {{\n");
            for row in map.table().chunks(4) {
                h += &format!("    {},\n", list(row, hex));
            }
            h += "};\n";
            if name == "SIGNED" {
                h += "\n";
            }
        }
        h
    }

    #[test]
    fn the_cuda_header_holds_the_rust_maps() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/quant8.cuh");
        let want = cuda_header();
        if std::env::var("TIDEMEM_BLESS").as_deref() == Ok("1") {
            std::fs::write(path, &want).unwrap();
        }
        let have = crate::kernels::HEADERS
            .iter()
            .find(|h| h.name == "quant8.cuh")
            .expect("quant8.cuh is embedded")
            .code;
        assert!(
            have == want,
            "kernels/quant8.cuh differs from the Rust maps: rerun with TIDEMEM_BLESS=1"
        );
        assert_eq!(hex(0.99296875), "0x1.fc6666p-1f");
        assert_eq!(hex(-1.5), "-0x1.800000p0f");
    }

    #[test]
    fn the_maps_are_pinned() {
        let s = Quant8Map::Signed.table();
        assert!(s.windows(2).all(|w| w[0] < w[1]), "increasing");
        assert_eq!(
            (s[127], s[255], s[254], s[0]),
            (0.0, 1.0, 0.99296875, -0.99296875)
        );
        assert_eq!((s[128], s[126]), (5.5e-7, -5.5e-7));
        for k in 0..127 {
            assert_eq!(s[k], -s[254 - k], "symmetric but for +1");
        }
        let u = Quant8Map::Unsigned.table();
        assert!(u.windows(2).all(|w| w[0] < w[1]), "increasing");
        // 1 − 0.9/256 = 0.996484375, one f32 step below by the fma's rounding
        assert_eq!(
            (u[0], u[1], u[254], u[255]),
            (0.0, 3.25e-7, 0.99648434, 1.0)
        );
        // the decades' counts: 2^i a side (signed), 2^(i+1) (unsigned)
        let in_decade = |t: &[f32; 256], i: i32| {
            let (lo, hi) = (10f32.powi(i - 7), 10f32.powi(i - 6));
            t.iter().filter(|&&v| v >= lo && v < hi).count()
        };
        for i in 0..7 {
            assert_eq!(in_decade(&s, i), 1 << i, "signed decade {i}");
            assert_eq!(in_decade(&u, i), 2 << i, "unsigned decade {i}");
        }
        // two entries, exactly: entry 5 of the [0.01, 0.1) decade, fma(5, c1, c0)
        let (p, k) = (1e-2f64, 16.0);
        let e = 5f32.mul_add((0.9 * p / k) as f32, (p * (0.1 + 0.45 / k)) as f32);
        assert_eq!(s[128 + 15 + 5], e);
        assert_eq!(
            u[1 + 30 + 5],
            5f32.mul_add((0.9 * p / 32.0) as f32, (p * (0.1 + 0.45 / 32.0)) as f32)
        );
    }

    #[test]
    fn codes_are_the_nearest_entry_not_a_truncation_or_a_linear_map() {
        for map in [Quant8Map::Signed, Quant8Map::Unsigned] {
            let t = map.table();
            // every entry, the midpoints between entries (either side), and a sweep
            let mut xs: Vec<f32> = t.to_vec();
            for w in t.windows(2) {
                let mid = (w[0] + w[1]) / 2.0;
                xs.extend([
                    mid,
                    f32::from_bits(mid.to_bits() - 4),
                    f32::from_bits(mid.to_bits() + 4),
                ]);
            }
            xs.extend((0..20000).map(|k| 10f32.powf(-8.0 + 8.0 * k as f32 / 20000.0)));
            xs.extend((0..20000).map(|k| -(10f32.powf(-8.0 + 8.0 * k as f32 / 20000.0))));
            for &x in &xs {
                let x = if map == Quant8Map::Unsigned {
                    x.abs()
                } else {
                    x
                };
                let (got, want) = (map.code(x), nearest(map, x));
                if map == Quant8Map::Unsigned && x > 0.0 && want == 0 {
                    // a positive variance takes the smallest entry, never 0
                    assert_eq!(got, 1, "{x:e}");
                    continue;
                }
                let (dg, dw) = ((t[got as usize] - x).abs(), (t[want as usize] - x).abs());
                // the nearest, up to the rounding of a sub-interval's edge (a few f32 steps)
                assert!(
                    dg <= dw + 2e-6 * x.abs(),
                    "{map:?} {x:e}: code {got} ({}) for {want} ({})",
                    t[got as usize],
                    t[want as usize]
                );
            }
            // each entry is its own code: values just below an entry round up to it (a
            // truncating quantizer would give the entry below)
            for (k, &e) in t.iter().enumerate().skip(1) {
                assert_eq!(map.code(e) as usize, k, "{map:?}");
                if e > 0.0 {
                    assert_eq!(
                        map.code(f32::from_bits(e.to_bits() - 1)) as usize,
                        k,
                        "{map:?}"
                    );
                }
            }
        }
        // a small value keeps its precision where a linear map would give 0
        let x = 3e-5f32;
        let back = Quant8Map::Signed.value(Quant8Map::Signed.code(x));
        assert!(back > 0.5 * x && back < 1.5 * x, "{back}");
    }

    #[test]
    fn each_block_has_its_own_scale() {
        let n = 2 * QUANT8_BLOCK + 17;
        let x: Vec<f32> = (0..n)
            .map(|i| {
                let big = if i / QUANT8_BLOCK == 1 { 1e3 } else { 1e-3 };
                big * ((i as f32 * 0.37).sin())
            })
            .collect();
        let (mut q, mut s, mut back) = (vec![0u8; n], vec![0f32; 3], vec![0f32; n]);
        quantize8(Quant8Map::Signed, &x, &mut q, &mut s).unwrap();
        dequantize8(Quant8Map::Signed, &q, &s, &mut back).unwrap();
        assert!(s[0] < 1.1e-3 && s[1] > 900.0 && s[2] < 1.1e-3, "{s:?}");
        for (a, b) in x.iter().zip(&back) {
            // a relative error within the map's spacing where a value is near its block's
            // largest; never a flattened block
            let scale = if a.abs() < 1.0 { 1e-3 } else { 1e3 };
            assert!((a - b).abs() <= 0.08 * a.abs() + 1e-4 * scale, "{a} {b}");
        }
        // zeros: scale 0, every code 0's
        let mut z = [9u8; 4];
        assert_eq!(quantize_block(Quant8Map::Signed, &[0.0; 4], &mut z), 0.0);
        assert_eq!(z, [127; 4]);
        assert!(quantize8(Quant8Map::Signed, &x, &mut q, &mut s[..2]).is_err());
    }
}
