//! Compute on the CPU: the twins of the CUDA kernels in `kernels/`, used by the simulated device
//! and by tests that compare the two.

pub mod cast;
pub mod embedding;
