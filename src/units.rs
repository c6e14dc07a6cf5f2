//! Byte sizes written the way people write them (`8GiB`, `512 MiB`, `1.5G`, `4096`).

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
    let bad = || Error::InvalidArgument(format!("cannot parse {s:?} as a byte size"));
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
