//! The model being trained: on one rank (a [`ChunkManager`] for the MLPs and one cached
//! collection), or over in-process ranks (see [`crate::ranks`]).

use std::path::Path;

use tidemem::data::criteo::Batch;
use tidemem::embedding::{bincount, CachedEmbeddingCollection};
use tidemem::models::dlrm::{self, Dlrm, DlrmConfig};
use tidemem::ops::embedding::BagMode;
use tidemem::prelude::*;
use tidemem::profile::write_tide_svg;
use tidemem::rng::{Rng, SplitMix64};

use crate::data::counted_ids;
use crate::{bad, Args};

/// What the embedding did so far.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub rows: usize,
    pub capacity: usize,
    pub hit_rate: f64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub device_bytes: usize,
    pub full_table_bytes: usize,
}

/// The initial value of row `id` of table `t`: uniform in ±1/√(largest table's rows).
pub fn init_row(seed: u64, bound: f64) -> impl Fn(usize, u32, &mut [f32]) + Clone {
    move |t, id, row| {
        let mut r = SplitMix64::new(seed ^ ((t as u64) << 32 | u64::from(id)));
        for v in row {
            *v = ((2.0 * r.next_f64() - 1.0) * bound) as f32;
        }
    }
}

/// The cache capacity for `rows` rows: the `ratio`'s share, at least twice the largest counted
/// batch's distinct rows `largest`, at most every row (every row when `full`).
pub fn capacity(full: bool, ratio: f64, rows: usize, largest: usize) -> usize {
    if full {
        rows
    } else {
        ((ratio * rows as f64).ceil() as usize)
            .max(2 * largest)
            .min(rows)
    }
}

/// One rank's model.
pub struct Local {
    model: Dlrm,
    store: ChunkManager,
    adam: HybridAdam,
    emb: CachedEmbeddingCollection,
    capacity: usize,
}

/// The model being trained.
pub enum Trainer {
    Local(Box<Local>),
    Ranks(crate::ranks::Ranks),
}

impl Trainer {
    /// The model of `cfg` over tables of `cards` rows, the cache sized and warmed from the
    /// batches `counted`.
    pub fn new(a: &Args, cfg: &DlrmConfig, cards: &[u64], counted: &[Batch]) -> Result<Trainer> {
        if a.ranks == 0 {
            return Err(bad("--ranks must be at least 1".into()));
        }
        if !matches!(a.sharding.as_str(), "table" | "column") {
            return Err(bad(format!("--sharding {}: table or column", a.sharding)));
        }
        if a.ranks > 1 {
            return Ok(Trainer::Ranks(crate::ranks::Ranks::new(
                a, cfg, cards, counted,
            )?));
        }
        let dev = a.device(0)?;
        let mut mc = ManagerConfig::new(1 << 20, tidemem::tide::Policy::Tide);
        mc.param_dtype = DType::F32;
        let mut store = ChunkManager::new(dev.clone(), mc)?;
        if a.trace.is_some() {
            store.enable_log();
        }
        let model = Dlrm::register(&mut store, cfg, a.seed)?;
        let rows: Vec<usize> = cards.iter().map(|&n| n as usize).collect();
        let total: usize = rows.iter().sum();
        let all: Vec<usize> = (0..rows.len()).collect();
        let (ids, largest) = counted_ids(counted, &all, &rows)?;
        let capacity = capacity(a.full_table, a.cache_ratio, total, largest);
        let bound = (1.0 / rows.iter().copied().max().unwrap_or(1) as f64).sqrt();
        let pol = a.policy()?;
        let mut emb = CachedEmbeddingCollection::new(
            dev,
            &rows,
            cfg.dim,
            capacity,
            BagMode::Sum,
            a.emb_optimizer()?,
            // a batch's moves fit the staging buffers: the host never waits to reuse them
            |c| c.policy(pol).staging_rows(largest.max(4096)),
            init_row(a.seed, bound),
        )?;
        let cache = emb.bag_mut().cache_mut();
        cache.reorder(&bincount(total, [ids.as_slice()])?)?;
        cache.warm_up(a.warmup)?;
        let adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(a.lr)))?;
        Ok(Trainer::Local(Box::new(Local {
            model,
            store,
            adam,
            emb,
            capacity,
        })))
    }

    /// One training step on the global batch `b`, the cache made ready for `next` (the
    /// following step's batch) while the device computes this one; returns its mean loss.
    pub fn step(&mut self, b: &Batch, next: Option<&Batch>) -> Result<f32> {
        match self {
            Trainer::Local(l) => {
                let (m, s, o, e) = (&l.model, &mut l.store, &mut l.adam, &mut l.emb);
                Ok(dlrm::train_step(
                    m,
                    s,
                    o,
                    e,
                    b,
                    dlrm::StepPlan {
                        next,
                        ..Default::default()
                    },
                )?
                .loss)
            }
            Trainer::Ranks(r) => r.step(b),
        }
    }

    /// The device of the (first) rank.
    pub fn device(&self) -> Option<&Device> {
        match self {
            Trainer::Local(l) => Some(l.store.device()),
            Trainer::Ranks(_) => None,
        }
    }

    /// What the device was asked to do so far (one rank's device; `None` over ranks).
    pub fn device_stats(&self) -> Option<tidemem::device::DeviceStats> {
        match self {
            Trainer::Local(l) => Some(l.store.device().stats()),
            Trainer::Ranks(_) => None,
        }
    }

    /// The click probabilities of every sample of `batches`, in order.
    pub fn predict(&mut self, batches: &[Batch]) -> Result<Vec<f32>> {
        match self {
            Trainer::Local(l) => {
                let mut p = Vec::new();
                for b in batches {
                    p.extend(dlrm::predict(&l.model, &mut l.store, &mut l.emb, b)?);
                }
                Ok(p)
            }
            Trainer::Ranks(r) => r.predict(batches),
        }
    }

    /// The embedding's figures (summed over ranks).
    pub fn stats(&mut self) -> Result<Stats> {
        match self {
            Trainer::Local(l) => {
                let cache = l.emb.bag().cache();
                let moved = cache.moved();
                Ok(Stats {
                    rows: cache.rows(),
                    capacity: l.capacity,
                    hit_rate: cache.stats().hit_rate(),
                    h2d_bytes: moved.h2d_bytes,
                    d2h_bytes: moved.d2h_bytes,
                    device_bytes: l.emb.bag().device_bytes(),
                    full_table_bytes: cache.rows() * cache.stride() * 4,
                })
            }
            Trainer::Ranks(r) => r.stats(),
        }
    }

    /// The MLP store's Chrome trace and tide plot (one rank; ranks write nothing more than
    /// `steps.csv`).
    pub fn write_trace(&mut self, dir: &Path) -> Result<()> {
        let Trainer::Local(l) = self else {
            return Ok(());
        };
        l.store.synchronize()?;
        l.store.chrome_trace().write(dir.join("dlrm_train.json"))?;
        let capacity = l.store.capacity();
        write_tide_svg(
            dir.join("tide.svg"),
            "tide: the DLRM's MLPs",
            &l.store.tide_points(),
            capacity,
        )
    }
}
