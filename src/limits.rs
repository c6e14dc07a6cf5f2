//! Bounds on the sizes a caller asks for, checked before anything is allocated.
//!
//! A batch builder, a data generator or a trainer that takes its sizes from a user multiplies
//! them into bytes with [`host_bytes`]: a product that overflows, or that is more than the
//! machine holds ([`host_limit`]), is [`Error::TooLarge`] with the numbers, where an
//! allocation would panic ("capacity overflow"), abort the process or wake the OOM killer.
//!
//! ```
//! use tidemem::limits::{host_bytes, host_limit};
//! use tidemem::Error;
//! # fn main() -> tidemem::Result<()> {
//! assert_eq!(host_bytes(|| "bytes of a small batch".into(), &[8, 1024, 4])?, 32 << 10);
//! let huge = host_bytes(|| "bytes of a huge batch".into(), &[usize::MAX, 4]);
//! assert!(matches!(huge, Err(Error::TooLarge { limit, .. }) if limit == host_limit()));
//! # Ok(()) }
//! ```

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// Memory this process may use, in bytes: the smallest of `MemTotal` of `/proc/meminfo`, the
/// process's cgroup (v2) limit `/sys/fs/cgroup/memory.max` and its address-space limit
/// (`RLIMIT_AS`, `ulimit -v`: "Max address space" of `/proc/self/limits`); read once. `None`
/// where none can be read (a system without `/proc`).
pub fn host_memory() -> Option<u64> {
    static MEMORY: OnceLock<Option<u64>> = OnceLock::new();
    *MEMORY.get_or_init(|| {
        let total = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| meminfo_total(&s));
        let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        let address_space = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|s| address_space_limit(&s));
        [total, cgroup, address_space].into_iter().flatten().min()
    })
}

/// The soft "Max address space" limit of a `/proc/self/limits` text, in bytes (`None` when
/// unlimited or absent).
fn address_space_limit(limits: &str) -> Option<u64> {
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    line["Max address space".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn meminfo_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// The most bytes one host allocation (or the buffers of one batch together) may take:
/// [`host_memory`], or `isize::MAX` (what an allocation can address) where that is unknown.
pub fn host_limit() -> u64 {
    host_memory().map_or(isize::MAX as u64, |m| m.min(isize::MAX as u64))
}

/// The product of `factors` (element counts and an element size), as bytes that fit in host
/// memory. Refused with [`Error::TooLarge`] when the product overflows `usize` or exceeds
/// [`host_limit`]; `what` (called only then) names what the bytes are for, with the inputs
/// they come from.
pub fn host_bytes(what: impl FnOnce() -> String, factors: &[usize]) -> Result<usize> {
    let limit = host_limit();
    let product = factors
        .iter()
        .try_fold(1u128, |acc, &f| acc.checked_mul(f as u128));
    match product {
        Some(p) if p <= u128::from(limit) => Ok(p as usize),
        _ => Err(Error::TooLarge {
            what: what(),
            requested: product.unwrap_or(u128::MAX),
            limit,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_space_limit_is_read_from_proc_limits() {
        let head = "Limit                     Soft Limit           Hard Limit           Units\n";
        let limited = format!(
            "{head}Max stack size            8388608              unlimited            bytes\n\
             Max address space         1073741824           unlimited            bytes\n"
        );
        assert_eq!(address_space_limit(&limited), Some(1 << 30));
        let unlimited = format!(
            "{head}Max address space         unlimited            unlimited            bytes\n"
        );
        assert_eq!(address_space_limit(&unlimited), None);
        assert_eq!(address_space_limit(head), None);
    }

    #[test]
    fn meminfo_is_read_in_bytes() {
        let text = "MemTotal:       24576000 kB\nMemFree:          100 kB\n";
        assert_eq!(meminfo_total(text), Some(24_576_000 * 1024));
        assert_eq!(meminfo_total("MemFree: 1 kB\n"), None);
        assert_eq!(meminfo_total("MemTotal: lots kB\n"), None);
        if cfg!(target_os = "linux") {
            assert!(host_memory().is_some_and(|m| m > 1 << 20));
        }
    }

    #[test]
    fn products_past_the_limit_are_refused_with_the_numbers() {
        assert_eq!(host_bytes(|| unreachable!(), &[]).unwrap(), 1);
        assert_eq!(host_bytes(|| unreachable!(), &[3, 0, 7]).unwrap(), 0);
        let limit = host_limit();
        match host_bytes(|| "bytes of x".into(), &[usize::MAX, usize::MAX, 8]) {
            Err(Error::TooLarge {
                what,
                requested,
                limit: l,
            }) => {
                assert_eq!(
                    (what.as_str(), requested, l),
                    ("bytes of x", u128::MAX, limit)
                );
            }
            other => panic!("{other:?}"),
        }
        let over = limit as usize / 2 + 1;
        match host_bytes(|| "bytes of y".into(), &[over, 2]) {
            Err(Error::TooLarge { requested, .. }) => {
                assert_eq!(requested, over as u128 * 2)
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            host_bytes(|| unreachable!(), &[limit as usize]).unwrap(),
            limit as usize
        );
    }
}
