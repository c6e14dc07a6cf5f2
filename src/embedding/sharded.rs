//! Tables placed over the ranks of a [`Communicator`].
//!
//! [`ShardedEmbedding`] places tables over the ranks:
//! - [`Sharding::TableWise`]: each table lives on one rank (tables assigned greedily by rows,
//!   largest first, to the least loaded rank: [`table_owners`]);
//! - [`Sharding::ColumnWise`]: every rank holds every table's columns `[c_r, c_{r+1})` of the
//!   embedding width, so all ranks see the same ids and make identical cache decisions. The
//!   optimizer must then be element-wise (SGD, Adam): row-wise Adagrad needs the whole row.
//!
//! Every rank is given the global batch (model-parallel input); the forward all-to-all returns
//! to each rank the outputs of its slice of the samples ([`batch_slice`], data-parallel output),
//! and the backward sends gradients the other way.

#[path = "sharded_device.rs"]
mod device;

use std::collections::BTreeMap;
use std::path::Path;

use super::cache::CacheConfig;
use super::tables::{CachedEmbeddingCollection, TableBatch};
use crate::comm::{Communicator, Elem, ReduceOp};
use crate::error::{Error, Result};
use crate::ops::embedding::BagMode;
use crate::ops::embedding::EmbeddingOptimizer;

/// How [`ShardedEmbedding`] splits tables over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharding {
    /// Whole tables per rank.
    TableWise,
    /// A slice of every table's columns per rank.
    ColumnWise,
}

/// The rank holding each table when tables of `rows[t]` rows are placed whole over `world`
/// ranks ([`Sharding::TableWise`]): largest table first, each to the rank with the fewest
/// rows so far (the lowest rank on a tie). Every rank computes the same placement.
///
/// ```
/// use tidemem::embedding::table_owners;
/// assert_eq!(table_owners(&[10, 40, 30, 20], 2), [0, 0, 1, 1]);
/// ```
pub fn table_owners(rows: &[usize], world: usize) -> Vec<usize> {
    let world = world.max(1);
    let mut owner = vec![0usize; rows.len()];
    let mut load = vec![0usize; world];
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| rows[b].cmp(&rows[a]).then(a.cmp(&b)));
    for t in order {
        let r = (0..world).min_by_key(|&r| (load[r], r)).expect("world ≥ 1");
        owner[t] = r;
        load[r] += rows[t];
    }
    owner
}

/// Samples `[start, end)` of rank `r` when `bags` samples are split over `world` ranks (empty
/// for a rank beyond the world, or a world of none).
pub fn batch_slice(bags: usize, world: usize, r: usize) -> (usize, usize) {
    if world == 0 {
        return (0, 0);
    }
    let at = |k: usize| (bags as u128 * k.min(world) as u128 / world as u128) as usize;
    (at(r), at(r.saturating_add(1)))
}

/// Tables placed over the ranks of a communicator (see the [module docs](crate::embedding) and [`Sharding`]).
#[derive(Debug)]
pub struct ShardedEmbedding {
    comm: Communicator,
    sharding: Sharding,
    dim: usize,
    /// Owner of each table (table-wise).
    owner: Vec<usize>,
    /// Column range of each rank (column-wise).
    cols: Vec<(usize, usize)>,
    /// This rank's tables, in global table order.
    local_tables: Vec<usize>,
    local: Option<CachedEmbeddingCollection>,
    bags: usize,
    /// Rows of every table.
    rows: Vec<usize>,
    /// Which forward ran last (the backward follows its layout).
    last: device::Last,
    /// The device all-to-all's stream and buffers.
    device: device::DeviceState,
}

impl ShardedEmbedding {
    /// This rank's part of tables of `rows[t]` rows of `dim` floats, with `capacity_per_rank`
    /// cached rows on this rank's device. `init(table, id, row)` gets the full `dim` floats of
    /// a row; column-wise ranks keep their columns. Every rank must make the same call.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        comm: Communicator,
        sharding: Sharding,
        rows: &[usize],
        dim: usize,
        capacity_per_rank: usize,
        mode: BagMode,
        optimizer: EmbeddingOptimizer,
        init: impl FnMut(usize, u32, &mut [f32]),
    ) -> Result<Self> {
        Self::new_configured(
            comm,
            sharding,
            rows,
            dim,
            capacity_per_rank,
            mode,
            optimizer,
            |c| c,
            init,
        )
    }

    /// [`ShardedEmbedding::new`] with this rank's cache configured by `configure` (its
    /// eviction policy, host tier, staging rows), as [`CachedEmbeddingCollection::new`] takes it.
    #[allow(clippy::too_many_arguments)]
    pub fn new_configured(
        comm: Communicator,
        sharding: Sharding,
        rows: &[usize],
        dim: usize,
        capacity_per_rank: usize,
        mode: BagMode,
        optimizer: EmbeddingOptimizer,
        configure: impl FnOnce(CacheConfig) -> CacheConfig,
        mut init: impl FnMut(usize, u32, &mut [f32]),
    ) -> Result<Self> {
        let world = comm.world();
        let rank = comm.rank();
        if rows.is_empty() || rows.contains(&0) {
            return Err(match rows.iter().position(|&r| r == 0) {
                None => Error::Empty {
                    what: "the tables of a sharded embedding".into(),
                },
                Some(t) => Error::TooFew {
                    what: format!("rows of table {t} of a sharded embedding"),
                    got: 0,
                    need: 1,
                },
            });
        }
        let row_wide = match optimizer {
            EmbeddingOptimizer::RowwiseAdagrad { .. } => Some("row-wise Adagrad"),
            EmbeddingOptimizer::Adam8 { .. } => Some("Adam on 8-bit moments"),
            _ => None,
        };
        if let (Sharding::ColumnWise, Some(what)) = (sharding, row_wide) {
            return Err(Error::Conflict {
                what: what.into(),
                with: "column-wise sharding (its accumulator or its moments' scales span a \
                       row's full width, which a column-wise shard does not see: shard \
                       table-wise, or use SGD or Adam)"
                    .into(),
            });
        }
        if sharding == Sharding::ColumnWise && dim < world {
            return Err(Error::TooFew {
                what: format!("columns for column-wise sharding over {world} ranks (one a rank)"),
                got: dim,
                need: world,
            });
        }
        let owner = table_owners(rows, world);
        let cols: Vec<(usize, usize)> = (0..world).map(|r| batch_slice(dim, world, r)).collect();
        let (local_tables, local_dim, col0): (Vec<usize>, usize, usize) = match sharding {
            Sharding::TableWise => (
                (0..rows.len()).filter(|&t| owner[t] == rank).collect(),
                dim,
                0,
            ),
            Sharding::ColumnWise => (
                (0..rows.len()).collect(),
                cols[rank].1 - cols[rank].0,
                cols[rank].0,
            ),
        };
        let local = if local_tables.is_empty() {
            None
        } else {
            let local_rows: Vec<usize> = local_tables.iter().map(|&t| rows[t]).collect();
            let lt = local_tables.clone();
            let mut full = vec![0f32; dim];
            Some(CachedEmbeddingCollection::new(
                comm.device().clone(),
                &local_rows,
                local_dim,
                capacity_per_rank,
                mode,
                optimizer,
                configure,
                |t, id, row| {
                    init(lt[t], id, &mut full);
                    row.copy_from_slice(&full[col0..col0 + local_dim]);
                },
            )?)
        };
        let device = device::DeviceState::new(comm.device())?;
        Ok(Self {
            comm,
            sharding,
            dim,
            owner,
            cols,
            local_tables,
            local,
            bags: 0,
            rows: rows.to_vec(),
            last: device::Last::None,
            device,
        })
    }

    /// The tables this rank holds (all of them, column-wise).
    pub fn local_tables(&self) -> &[usize] {
        &self.local_tables
    }

    /// The rank holding each table (table-wise placement).
    pub fn owners(&self) -> &[usize] {
        &self.owner
    }

    /// The communicator the tables are placed over.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// The rows of every table, in global table order.
    pub fn rows(&self) -> &[usize] {
        &self.rows
    }

    /// The full embedding width (a column-wise rank holds only its columns of it).
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// This rank's collection, if it holds any table.
    pub fn local(&self) -> Option<&CachedEmbeddingCollection> {
        self.local.as_ref()
    }

    /// This rank's collection, mutably.
    pub fn local_mut(&mut self) -> Option<&mut CachedEmbeddingCollection> {
        self.local.as_mut()
    }

    /// What this rank's checkpoint says about the placement, checked on load.
    fn placement_meta(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("sharded.rank".to_string(), self.comm.rank().to_string()),
            ("sharded.world".to_string(), self.comm.world().to_string()),
            (
                "sharded.sharding".to_string(),
                format!("{:?}", self.sharding),
            ),
            (
                "sharded.tables".to_string(),
                format!("{:?}", self.local_tables),
            ),
            ("sharded.rows".to_string(), format!("{:?}", self.rows)),
            ("sharded.dim".to_string(), self.dim.to_string()),
        ])
    }

    /// Saves this rank's part (its tables or columns, with their optimizer state and step
    /// count, as [`CachedEmbeddingBag::save`](super::CachedEmbeddingBag::save) does) to `path`, with the rank, world size and
    /// placement in the metadata; a rank that holds no table writes nothing. Every rank must
    /// call it: each writes its file beside its target, the ranks agree that all did, and only
    /// then does any file replace an earlier one; otherwise every rank fails and the earlier
    /// files stay. Between steps only.
    pub fn save(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let meta = self.placement_meta();
        let mine = match self.local.as_mut() {
            Some(l) => l.bag_mut().save_unpersisted(path.as_ref(), &meta).map(Some),
            None => Ok(None),
        };
        // every rank leaves here alike (an error everywhere unless all wrote), and otherwise
        // reaches the second agreement
        self.comm.agree(mine.is_ok())?;
        let done = mine?.map_or(Ok(()), |w| w.persist());
        // a rename that failed on one rank after the agreement is reported on every rank
        self.comm.agree(done.is_ok())?;
        done
    }

    /// Loads this rank's part from a file [`ShardedEmbedding::save`] wrote on the same rank of
    /// the same placement (ranks, sharding, tables and their sizes). Every rank must call it:
    /// each reads and checks its file, the ranks agree that all fit and were saved at the same
    /// step, and only then does any rank load; otherwise every rank fails and none changes.
    /// Between steps only.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let want = self.placement_meta();
        let placed = |meta: &BTreeMap<String, String>| match want
            .iter()
            .find(|(k, v)| meta.get(*k) != Some(*v))
        {
            Some((k, v)) => Err(Error::Checkpoint {
                path: path.to_path_buf(),
                what: format!(
                    "it has {k} = {:?}, this rank has {v:?}",
                    meta.get(k).map_or("nothing", String::as_str)
                ),
            }),
            None => Ok(()),
        };
        let mine = match self.local.as_mut() {
            None => Ok(None),
            // ready to load (so that putting it in place cannot fail), the placement (the
            // clearest message for another rank's file), then the whole file, whose placement
            // is checked again
            Some(l) => l
                .bag_mut()
                .ready_to_load()
                .and_then(|()| crate::checkpoint::Reader::open(path))
                .and_then(|f| f.metadata())
                .and_then(|m| placed(&m))
                .and_then(|()| l.bag().read_checkpoint(path))
                .and_then(|c| placed(&c.meta).map(|()| Some(c))),
        };
        self.comm.agree(mine.is_ok())?;
        let mine = mine?;
        // ranks without tables do not take part in the comparison of steps
        let steps = mine.as_ref().map(|c| c.steps() as f64);
        let mut lo = [steps.unwrap_or(f64::INFINITY)];
        let mut hi = [steps.unwrap_or(f64::NEG_INFINITY)];
        self.comm.all_reduce_host(&mut lo, ReduceOp::Min)?;
        self.comm.all_reduce_host(&mut hi, ReduceOp::Max)?;
        if lo[0].is_finite() && lo != hi {
            return Err(Error::Checkpoint {
                path: path.to_path_buf(),
                what: format!(
                    "the ranks' checkpoints were saved at different steps ({} to {}): no rank \
                     loads",
                    lo[0], hi[0]
                ),
            });
        }
        let done = match (self.local.as_mut(), mine) {
            (Some(l), Some(c)) => l.bag_mut().apply_checkpoint(c),
            _ => Ok(()),
        };
        self.comm.agree(done.is_ok())?;
        done
    }

    /// Forward of the global batch (every table, the same number of bags in each; every rank
    /// passes the same batch). Returns this rank's samples ([`batch_slice`]) of every table:
    /// `[tables, my_bags, dim]`. A rank whose own tables' forward fails makes every rank fail
    /// (the ranks agree before the exchange).
    pub fn forward(&mut self, batch: &[TableBatch<'_>]) -> Result<Vec<f32>> {
        let bags = self.check_global_batch(batch)?;
        let out = match self.local.as_mut() {
            Some(local) => {
                let mine: Vec<TableBatch<'_>> =
                    self.local_tables.iter().map(|&t| batch[t]).collect();
                local.forward(&mine)
            }
            None => Ok(Vec::new()),
        };
        // a rank whose part failed (an id out of its table's range, a cache too small for the
        // batch) fails every rank here, before the exchange the others would wait in
        self.comm.agree(out.is_ok())?;
        let out = out?;
        self.bags = bags;
        self.last = device::Last::Host;
        // Local output: [local tables, bags, local dim]. Send each rank its samples.
        let sends = (0..self.comm.world())
            .map(|q| self.pick(&out, q))
            .collect::<Vec<_>>();
        let recvs = self.exchange(sends, |me, p| me.part_len(p, me.comm.rank()))?;
        Ok(self.assemble(&recvs))
    }

    /// Backward from the gradient of this rank's samples (the layout [`ShardedEmbedding::forward`]
    /// returned): the gradients travel back to the ranks holding the rows, which compute their
    /// sparse gradients. Every rank must call it.
    pub fn backward(&mut self, grad: &[f32]) -> Result<()> {
        let world = self.comm.world();
        let me = self.comm.rank();
        if self.last == device::Last::Device {
            return Err(Error::OutOfOrder {
                call: "backward",
                needs: "a host forward (forward_device's layout differs: use backward_device)",
            });
        }
        let (s0, s1) = batch_slice(self.bags, world, me);
        let want = self.owner.len() * (s1 - s0) * self.dim;
        if grad.len() != want {
            return Err(Error::Length {
                what: format!(
                    "gradients for {} tables × {} samples × {}",
                    self.owner.len(),
                    s1 - s0,
                    self.dim
                ),
                got: grad.len(),
                expected: want,
            });
        }
        // Split this rank's gradient by the rank that computed each part.
        let sends: Vec<Vec<f32>> = (0..world).map(|p| self.split(grad, p)).collect();
        let recvs = self.exchange(sends, |me, p| me.part_len(me.comm.rank(), p))?;
        if let Some(local) = self.local.as_mut() {
            // Reassemble [local tables, bags, local dim] from every rank's samples.
            let (lt, ld) = (self.local_tables.len(), local.bag().cache().dim());
            let mut full = vec![0f32; lt * self.bags * ld];
            for (p, part) in recvs.iter().enumerate() {
                let (a, b) = batch_slice(self.bags, world, p);
                let n = b - a;
                for t in 0..lt {
                    let dst = (t * self.bags + a) * ld;
                    full[dst..dst + n * ld].copy_from_slice(&part[t * n * ld..(t + 1) * n * ld]);
                }
            }
            local.backward(&full)?;
        }
        Ok(())
    }

    /// Applies the optimizer on every rank holding rows of the last backward.
    pub fn step(&mut self) -> Result<()> {
        match self.local.as_mut() {
            Some(l) => l.step(),
            None => Ok(()),
        }
    }

    /// Floats rank `from` sends rank `to` in the forward: `from`'s local tables × `to`'s
    /// samples × `from`'s local width.
    fn part_len(&self, from: usize, to: usize) -> usize {
        let (a, b) = batch_slice(self.bags, self.comm.world(), to);
        let (tables, width) = match self.sharding {
            Sharding::TableWise => (self.owner.iter().filter(|&&o| o == from).count(), self.dim),
            Sharding::ColumnWise => (self.owner.len(), self.cols[from].1 - self.cols[from].0),
        };
        tables * (b - a) * width
    }

    /// The samples of rank `q` from the local output `[local tables, bags, local dim]`.
    fn pick(&self, out: &[f32], q: usize) -> Vec<f32> {
        let (a, b) = batch_slice(self.bags, self.comm.world(), q);
        let lt = self.local_tables.len();
        if lt == 0 {
            return Vec::new();
        }
        let ld = out.len() / (lt * self.bags.max(1));
        let mut v = Vec::with_capacity(lt * (b - a) * ld);
        for t in 0..lt {
            v.extend_from_slice(&out[(t * self.bags + a) * ld..(t * self.bags + b) * ld]);
        }
        v
    }

    /// This rank's `[tables, my_bags, dim]` from every rank's part.
    fn assemble(&self, recvs: &[Vec<f32>]) -> Vec<f32> {
        let world = self.comm.world();
        let (a, b) = batch_slice(self.bags, world, self.comm.rank());
        let n = b - a;
        let tables = self.owner.len();
        let mut out = vec![0f32; tables * n * self.dim];
        for (p, part) in recvs.iter().enumerate() {
            match self.sharding {
                Sharding::TableWise => {
                    let mine = (0..tables).filter(|&t| self.owner[t] == p);
                    for (i, t) in mine.enumerate() {
                        let src = &part[i * n * self.dim..(i + 1) * n * self.dim];
                        out[t * n * self.dim..(t + 1) * n * self.dim].copy_from_slice(src);
                    }
                }
                Sharding::ColumnWise => {
                    let (c0, c1) = self.cols[p];
                    let w = c1 - c0;
                    for t in 0..tables {
                        for s in 0..n {
                            let src = &part[(t * n + s) * w..(t * n + s + 1) * w];
                            let dst = (t * n + s) * self.dim + c0;
                            out[dst..dst + w].copy_from_slice(src);
                        }
                    }
                }
            }
        }
        out
    }

    /// The part of this rank's gradient `[tables, my_bags, dim]` that rank `p` computed.
    fn split(&self, grad: &[f32], p: usize) -> Vec<f32> {
        let (a, b) = batch_slice(self.bags, self.comm.world(), self.comm.rank());
        let n = b - a;
        let tables = self.owner.len();
        let mut v = Vec::new();
        match self.sharding {
            Sharding::TableWise => {
                for t in (0..tables).filter(|&t| self.owner[t] == p) {
                    v.extend_from_slice(&grad[t * n * self.dim..(t + 1) * n * self.dim]);
                }
            }
            Sharding::ColumnWise => {
                let (c0, c1) = self.cols[p];
                for t in 0..tables {
                    for s in 0..n {
                        let o = (t * n + s) * self.dim;
                        v.extend_from_slice(&grad[o + c0..o + c1]);
                    }
                }
            }
        }
        v
    }

    /// All-to-all of host vectors: `sends[q]` goes to rank `q`; the result's entry `p` came
    /// from rank `p`, of `len(self, p)` floats. Pairs exchange in rank order (the lower rank
    /// sends first), so blocking point-to-point backends cannot deadlock.
    fn exchange(
        &self,
        mut sends: Vec<Vec<f32>>,
        len: impl Fn(&Self, usize) -> usize,
    ) -> Result<Vec<Vec<f32>>> {
        let me = self.comm.rank();
        let dev = self.comm.device().clone();
        let stream = dev.new_stream()?;
        let mut recvs = vec![Vec::new(); self.comm.world()];
        recvs[me] = std::mem::take(&mut sends[me]);
        for p in (0..self.comm.world()).filter(|&p| p != me) {
            let n = len(self, p);
            let send = |v: &[f32]| -> Result<()> {
                if v.is_empty() {
                    return Ok(());
                }
                let b = dev.upload(&stream, bytemuck::cast_slice(v))?;
                self.comm.send(&stream, b.view(0, b.len())?, Elem::F32, p)?;
                dev.sync_stream(&stream)
            };
            let recv = || -> Result<Vec<f32>> {
                if n == 0 {
                    return Ok(Vec::new());
                }
                let b = dev.alloc(n * 4)?;
                self.comm.recv(&stream, b.view(0, b.len())?, Elem::F32, p)?;
                Ok(bytemuck::pod_collect_to_vec(&dev.download(&stream, &b)?))
            };
            if me < p {
                send(&sends[p])?;
                recvs[p] = recv()?;
            } else {
                recvs[p] = recv()?;
                send(&sends[p])?;
            }
        }
        Ok(recvs)
    }
}
