//! Hybrid parallel over in-process ranks.

use tidemem::data::criteo::Batch;
use tidemem::models::dlrm::DlrmConfig;
use tidemem::prelude::*;

use crate::trainer::Stats;
use crate::{bad, Args};

/// The ranks' threads.
pub struct Ranks;

impl Ranks {
    pub fn new(_a: &Args, _cfg: &DlrmConfig, _cards: &[u64], _counted: &[Batch]) -> Result<Ranks> {
        Err(bad("--ranks: not yet".into()))
    }
    pub fn step(&mut self, _b: &Batch) -> Result<f32> {
        unreachable!()
    }
    pub fn predict(&mut self, _b: &[Batch]) -> Result<Vec<f32>> {
        unreachable!()
    }
    pub fn stats(&mut self) -> Result<Stats> {
        unreachable!()
    }
}
