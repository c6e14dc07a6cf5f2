//! The 4-read-3-write STREAM kernel the CPU Adam is measured against (a bench helper in
//! `benches/common/stream.rs`): its own tests, run here.

#[allow(dead_code)]
#[path = "../benches/common/stream.rs"]
mod stream;
