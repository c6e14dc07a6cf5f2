//! Hybrid parallel over in-process ranks, one thread each: the tables placed over the ranks
//! ([`ShardedEmbedding`], table-wise or column-wise, with its all-to-all), the MLPs data
//! parallel (a [`ZeroManager`] over the ranks reduces their gradients). The main thread reads
//! the data and hands every rank the same global batch.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel::{unbounded, Receiver, Sender};
use tidemem::data::criteo::Batch;
use tidemem::embedding::{batch_slice, bincount, table_owners, ShardedEmbedding, Sharding};
use tidemem::models::dlrm::{self, Dlrm, DlrmConfig};
use tidemem::ops::embedding::BagMode;
use tidemem::prelude::*;

use crate::data::counted_ids;
use crate::trainer::{capacity, init_row, Stats};
use crate::{bad, Args};

/// What the main thread asks of every rank.
enum Cmd {
    Step(Arc<Batch>),
    Predict(Arc<Vec<Batch>>),
    Stats,
}

/// A rank's answer.
enum Reply {
    Loss(f32),
    /// This rank's samples of every batch, batch after batch.
    Probs(Vec<f32>),
    /// The rank's figures and its cache's hits and misses.
    Stats(Stats, u64, u64),
}

/// The ranks' threads and their channels.
pub struct Ranks {
    cmds: Vec<Sender<Cmd>>,
    replies: Receiver<(usize, Result<Reply>)>,
    threads: Vec<JoinHandle<()>>,
}

/// One rank's model.
struct Rank {
    model: Dlrm,
    store: ZeroManager,
    adam: HybridAdam,
    emb: ShardedEmbedding,
    capacity: usize,
}

impl Ranks {
    /// `a.ranks` ranks on devices of `a.backend` (device `r` on CUDA), the caches sized and
    /// warmed from the batches `counted`.
    pub fn new(a: &Args, cfg: &DlrmConfig, cards: &[u64], counted: &[Batch]) -> Result<Ranks> {
        let sharding = match a.sharding.as_str() {
            "table" => Sharding::TableWise,
            "column" => Sharding::ColumnWise,
            s => return Err(bad(format!("--sharding {s}: table or column"))),
        };
        let devices = (0..a.ranks)
            .map(|r| a.device(r))
            .collect::<Result<Vec<_>>>()?;
        let timeout = Duration::from_secs(120);
        let emb_comms = Communicator::local_with_timeout(devices.clone(), timeout)?;
        let mlp_comms = Communicator::local_with_timeout(devices, timeout)?;
        let (reply_tx, replies) = unbounded();
        let mut cmds = Vec::new();
        let mut threads = Vec::new();
        let counted = Arc::new(counted.to_vec());
        for (r, (ec, mc)) in emb_comms.into_iter().zip(mlp_comms).enumerate() {
            let (tx, rx) = unbounded();
            cmds.push(tx);
            let setup = Setup {
                cfg: cfg.clone(),
                cards: cards.to_vec(),
                counted: counted.clone(),
                sharding,
                seed: a.seed,
                lr: a.lr,
                warmup: a.warmup,
                emb_opt: a.emb_optimizer()?,
                policy: a.policy()?,
                ratio: (a.full_table, a.cache_ratio),
            };
            let reply_tx = reply_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("rank {r}"))
                .spawn(move || serve(r, setup, ec, mc, rx, reply_tx))
                .map_err(|e| bad(format!("--ranks {}: rank {r}'s thread: {e}", a.ranks)))?;
            threads.push(thread);
        }
        let mut ranks = Ranks {
            cmds,
            replies,
            threads,
        };
        // every rank reports once it is set up (or why it could not be)
        ranks.gather()?;
        Ok(ranks)
    }

    /// Every rank's answer to the last command, in rank order; the first rank's error if any.
    fn gather(&mut self) -> Result<Vec<Reply>> {
        let mut got: Vec<Option<Result<Reply>>> = (0..self.cmds.len()).map(|_| None).collect();
        for _ in 0..self.cmds.len() {
            let (r, reply) = self
                .replies
                .recv()
                .map_err(|_| bad("a rank's thread ended".into()))?;
            got[r] = Some(reply);
        }
        got.into_iter()
            .map(|g| g.expect("one reply per rank"))
            .collect()
    }

    fn send(&mut self, cmd: impl Fn() -> Cmd) -> Result<Vec<Reply>> {
        for tx in &self.cmds {
            tx.send(cmd())
                .map_err(|_| bad("a rank's thread ended".into()))?;
        }
        self.gather()
    }

    /// One step on the global batch `b`; returns the global mean loss.
    pub fn step(&mut self, b: &Batch) -> Result<f32> {
        let b = Arc::new(b.clone());
        match self.send(|| Cmd::Step(b.clone()))?.first() {
            Some(Reply::Loss(l)) => Ok(*l),
            _ => Err(bad("a rank answered a step with something else".into())),
        }
    }

    /// The click probabilities of every sample of `batches`, in order, from the ranks' slices.
    pub fn predict(&mut self, batches: &[Batch]) -> Result<Vec<f32>> {
        let b = Arc::new(batches.to_vec());
        let world = self.cmds.len();
        let parts = self.send(|| Cmd::Predict(b.clone()))?;
        let mut taken = vec![0usize; world];
        let mut out = Vec::new();
        for batch in batches {
            for (r, part) in parts.iter().enumerate() {
                let Reply::Probs(p) = part else {
                    return Err(bad(
                        "a rank answered a prediction with something else".into()
                    ));
                };
                let (s0, s1) = batch_slice(batch.size, world, r);
                out.extend_from_slice(&p[taken[r]..taken[r] + (s1 - s0)]);
                taken[r] += s1 - s0;
            }
        }
        Ok(out)
    }

    /// The ranks' figures summed (the hit rate over all ranks' lookups).
    pub fn stats(&mut self) -> Result<Stats> {
        let mut sum = Stats::default();
        let (mut hits, mut misses) = (0u64, 0u64);
        for reply in self.send(|| Cmd::Stats)? {
            let Reply::Stats(s, h, m) = reply else {
                return Err(bad(
                    "a rank answered for its figures with something else".into()
                ));
            };
            sum.capacity += s.capacity;
            sum.h2d_bytes += s.h2d_bytes;
            sum.d2h_bytes += s.d2h_bytes;
            sum.device_bytes += s.device_bytes;
            sum.full_table_bytes += s.full_table_bytes;
            sum.rows = s.rows;
            hits += h;
            misses += m;
        }
        sum.hit_rate = hits as f64 / (hits + misses).max(1) as f64;
        Ok(sum)
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.cmds.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// What a rank needs to build its part.
struct Setup {
    cfg: DlrmConfig,
    cards: Vec<u64>,
    counted: Arc<Vec<Batch>>,
    sharding: Sharding,
    seed: u64,
    lr: f32,
    warmup: f64,
    emb_opt: tidemem::ops::embedding::EmbeddingOptimizer,
    policy: tidemem::embedding::CachePolicy,
    ratio: (bool, f64),
}

/// A rank's thread: builds its part, reports, then answers commands until the channel closes.
fn serve(
    r: usize,
    setup: Setup,
    ec: Communicator,
    mc: Communicator,
    rx: Receiver<Cmd>,
    tx: Sender<(usize, Result<Reply>)>,
) {
    let mut rank = match Rank::new(setup, ec, mc) {
        Ok(rank) => {
            let _ = tx.send((r, Ok(Reply::Loss(f32::NAN))));
            rank
        }
        Err(e) => {
            let _ = tx.send((r, Err(e)));
            return;
        }
    };
    for cmd in rx {
        let reply = match cmd {
            Cmd::Step(b) => dlrm::train_step(
                &rank.model,
                &mut rank.store,
                &mut rank.adam,
                &mut rank.emb,
                &b,
                Default::default(),
            )
            .map(|s| Reply::Loss(s.loss)),
            Cmd::Predict(bs) => bs
                .iter()
                .map(|b| dlrm::predict_hybrid(&rank.model, &mut rank.store, &mut rank.emb, b))
                .collect::<Result<Vec<_>>>()
                .map(|p| Reply::Probs(p.concat())),
            Cmd::Stats => Ok(rank.stats()),
        };
        if tx.send((r, reply)).is_err() {
            return;
        }
    }
}

impl Rank {
    fn new(s: Setup, ec: Communicator, mc: Communicator) -> Result<Rank> {
        // chunks small enough that the MLPs' chunk groups spread over every rank
        let chunk = (s.cfg.mlp_params() / (16 * mc.world())).clamp(32, 1 << 20);
        let mut cfgm = ManagerConfig::new(chunk, tidemem::tide::Policy::Tide);
        cfgm.param_dtype = DType::F32;
        let mut store = ZeroManager::new(mc, cfgm)?;
        let model = Dlrm::register(&mut store, &s.cfg, s.seed)?;
        let rows: Vec<usize> = s.cards.iter().map(|&n| n as usize).collect();
        let bound = (1.0 / rows.iter().copied().max().unwrap_or(1) as f64).sqrt();
        // this rank's tables (all of them column-wise): the placement the embedding makes
        let owners = table_owners(&rows, ec.world());
        let local: Vec<usize> = (0..rows.len())
            .filter(|&t| s.sharding == Sharding::ColumnWise || owners[t] == ec.rank())
            .collect();
        // ids of the local tables in the local collection's id space, for the counts
        let local_rows: usize = local.iter().map(|&t| rows[t]).sum();
        let (ids, largest) = counted_ids(&s.counted, &local, &rows)?;
        let (full, ratio) = s.ratio;
        let cap = capacity(full, ratio, local_rows, largest).max(1);
        let policy = s.policy;
        let mut emb = ShardedEmbedding::new_configured(
            ec,
            s.sharding,
            &rows,
            s.cfg.dim,
            cap,
            BagMode::Sum,
            s.emb_opt,
            |c| c.policy(policy),
            init_row(s.seed, bound),
        )?;
        if let Some(l) = emb.local_mut() {
            let cache = l.bag_mut().cache_mut();
            cache.reorder(&bincount(local_rows, [ids.as_slice()])?)?;
            cache.warm_up(s.warmup)?;
        }
        let adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(s.lr)))?;
        Ok(Rank {
            model,
            store,
            adam,
            emb,
            capacity: cap,
        })
    }

    fn stats(&self) -> Reply {
        let rows = self.emb.rows().iter().sum();
        match self.emb.local() {
            Some(l) => {
                let cache = l.bag().cache();
                let moved = cache.moved();
                let st = cache.stats();
                Reply::Stats(
                    Stats {
                        rows,
                        capacity: self.capacity,
                        hit_rate: st.hit_rate(),
                        h2d_bytes: moved.h2d_bytes,
                        d2h_bytes: moved.d2h_bytes,
                        device_bytes: l.bag().device_bytes(),
                        full_table_bytes: cache.rows() * cache.stride() * 4,
                    },
                    st.hits,
                    st.misses,
                )
            }
            None => Reply::Stats(Stats::default(), 0, 0),
        }
    }
}
