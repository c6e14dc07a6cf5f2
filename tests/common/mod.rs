//! Devices the shared suites run on: always a simulated device, plus CUDA device 0 when present.
#![allow(dead_code)]

use tidemem::device::{Device, LinkModel, SimConfig};

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub fn sim(capacity: usize) -> Device {
    Device::sim(SimConfig::with_capacity(capacity)).expect("sim device")
}

/// A simulated device whose copies are slow enough that a missing wait would read stale data.
pub fn slow_sim(capacity: usize) -> Device {
    let link = LinkModel {
        h2d_gbps: 0.5,
        d2h_gbps: 0.5,
        d2d_gbps: 0.5,
        latency: std::time::Duration::from_millis(2),
    };
    Device::sim(SimConfig::with_capacity(capacity).link(link)).expect("sim device")
}

/// CUDA device 0, or `None` after printing why the GPU half of a test is skipped.
pub fn cuda(test: &str) -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("{test}: skipping the CUDA backend: {e}");
            None
        }
    }
}

/// Every backend available here, with a capacity-limited Sim first.
pub fn devices(test: &str) -> Vec<Device> {
    let mut v = vec![sim(256 << 20)];
    v.extend(cuda(test));
    v
}
