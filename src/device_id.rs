//! The identity of a device instance: its backend kind, ordinal and a process-unique number.
//! Below the device layer, so errors can name devices.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// Which implementation runs a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The simulated accelerator ([`SimBackend`](crate::device::SimBackend)).
    Sim,
    /// A CUDA GPU ([`CudaBackend`](crate::device::CudaBackend)).
    Cuda,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Sim => "sim",
            BackendKind::Cuda => "cuda",
        })
    }
}

/// Identity of one device instance: its kind, ordinal, and a process-unique number, so handles of
/// two devices are never confused (even two simulated devices with the same ordinal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceId {
    /// Backend kind.
    pub kind: BackendKind,
    /// Device ordinal within its kind.
    pub(crate) ordinal: usize,
    /// Process-unique instance number.
    pub(crate) uid: u64,
}

impl DeviceId {
    /// A fresh id for a new device instance.
    pub fn new(kind: BackendKind, ordinal: usize) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        DeviceId {
            kind,
            ordinal,
            uid: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{} (#{})", self.kind, self.ordinal, self.uid)
    }
}
