//! Byte sizes written the way people write them (`8GiB`, `512 MiB`, `1.5G`, `4096`): parsed by
//! [`parse_bytes`], printed by [`fmt_bytes`] (or in a chosen [`ByteUnit`]).

use crate::error::{Error, Result};

/// Parses a byte size. Binary units (`KiB`, `MiB`, `GiB`, `TiB`, and the short `K`, `M`, `G`,
/// `T`) are powers of 1024; decimal units (`KB`, `MB`, `GB`, `TB`) are powers of 1000. A bare
/// number is bytes.
///
/// ```
/// use tidemem::units::parse_bytes;
/// assert_eq!(parse_bytes("8GiB").unwrap(), 8 << 30);
/// assert_eq!(parse_bytes("1.5 M").unwrap(), 3 << 19);
/// assert_eq!(parse_bytes("2GB").unwrap(), 2_000_000_000);
/// assert!(parse_bytes("eight").is_err());
/// ```
pub fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || Error::Parse {
        what: "byte size",
        input: s.to_string(),
        expected: "a number and a unit: B, K or KiB, M or MiB, G or GiB, T or TiB, KB, MB, GB, TB"
            .into(),
    };
    let n: f64 = num.parse().map_err(|_| bad())?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad()),
    };
    let v = n * mult;
    if !v.is_finite() || v < 0.0 || v > usize::MAX as f64 {
        return Err(bad());
    }
    Ok(v.round() as usize)
}

/// A binary byte unit: `B`, `KiB`, `MiB`, `GiB` or `TiB`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteUnit {
    /// The unit's symbol, e.g. `"MiB"`.
    pub symbol: &'static str,
    /// Bytes in one of the unit.
    pub size: u64,
}

impl ByteUnit {
    /// Every binary unit, smallest first.
    pub const ALL: [ByteUnit; 5] = [
        ByteUnit::new("B", 1),
        ByteUnit::new("KiB", 1 << 10),
        ByteUnit::new("MiB", 1 << 20),
        ByteUnit::new("GiB", 1 << 30),
        ByteUnit::new("TiB", 1 << 40),
    ];

    const fn new(symbol: &'static str, size: u64) -> Self {
        ByteUnit { symbol, size }
    }

    /// The largest unit that `bytes` is at least one of (bytes for anything under 1 KiB, NaN
    /// included).
    ///
    /// ```
    /// use tidemem::units::ByteUnit;
    /// assert_eq!(ByteUnit::for_bytes(1536.0).symbol, "KiB");
    /// assert_eq!(ByteUnit::for_bytes(12.0).symbol, "B");
    /// ```
    pub fn for_bytes(bytes: f64) -> ByteUnit {
        Self::ALL
            .iter()
            .rev()
            .find(|u| bytes >= u.size as f64)
            .copied()
            .unwrap_or(Self::ALL[0])
    }

    /// `bytes` in this unit with `decimals` decimals (none when the unit is bytes), then the
    /// symbol: `1.5 KiB`, `512 B`.
    ///
    /// ```
    /// use tidemem::units::ByteUnit;
    /// let mib = ByteUnit::ALL[2];
    /// assert_eq!(mib.format(3.0 * 1048576.0, 1), "3.0 MiB");
    /// assert_eq!(mib.format(524288.0, 2), "0.50 MiB");
    /// assert_eq!(ByteUnit::ALL[0].format(512.0, 2), "512 B");
    /// ```
    pub fn format(self, bytes: f64, decimals: usize) -> String {
        if self.size == 1 {
            format!("{bytes:.0} {}", self.symbol)
        } else {
            format!("{:.decimals$} {}", bytes / self.size as f64, self.symbol)
        }
    }
}

/// Bytes in the largest binary unit they are at least one of, with two decimals (whole bytes
/// under 1 KiB): for messages, reports and examples.
///
/// ```
/// use tidemem::units::fmt_bytes;
/// assert_eq!(fmt_bytes(5), "5 B");
/// assert_eq!(fmt_bytes(3 << 20), "3.00 MiB");
/// assert_eq!(fmt_bytes(1536), "1.50 KiB");
/// ```
pub fn fmt_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    ByteUnit::for_bytes(b).format(b, 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fmt_bytes_picks_the_largest_whole_unit() {
        assert_eq!(fmt_bytes(0), "0 B");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(1024), "1.00 KiB");
        assert_eq!(fmt_bytes(8 << 30), "8.00 GiB");
        assert_eq!(fmt_bytes(3 << 40), "3.00 TiB");
        assert_eq!(fmt_bytes(5000 << 40), "5000.00 TiB");
        assert_eq!(fmt_bytes(u64::MAX), "16777216.00 TiB");
    }

    #[test]
    fn byte_unit_of_odd_values_is_bytes() {
        assert_eq!(ByteUnit::for_bytes(f64::NAN), ByteUnit::ALL[0]);
        assert_eq!(ByteUnit::for_bytes(-3.0), ByteUnit::ALL[0]);
        assert_eq!(ByteUnit::for_bytes(f64::INFINITY).symbol, "TiB");
    }
}
