//! DLRM training steps ([`tidemem::models::dlrm::train_step`]) with the embedding tables in a
//! cache of 1.5% of their rows against the same model with every row on the device (the same
//! code path, capacity = all rows), measured in the same run.
//!
//! * **CPU** (the simulated device; also when CUDA device 0 is the CPU emulator): the Kaggle
//!   model (`d = 16`, [`DlrmConfig::kaggle`]) over the 26 Criteo-Kaggle tables at cardinalities
//!   × 0.05 (1.69 M rows), batch 2,048.
//! * **CUDA** (a real GPU): `d = 128` ([`DlrmConfig::torchrec`]'s MLPs) over the Kaggle tables
//!   at full size (33.8 M rows), batch 16,384.
//!
//! Synthetic Zipf 1.0 data ([`Synthetic`]); both collections are built as in
//! `examples/dlrm_train`: ids counted over the first 20 batches, tables reordered by
//! frequency, 70% of the cache warmed up with the hottest rows, SGD on the rows, Adam on the
//! MLPs; the cached capacity is 1.5% of the rows, raised to twice the largest counted batch's
//! distinct rows if that is more. Each step trains on a fresh batch (generated outside the
//! timed region).
//!
//! A third trainer keeps every table on the device as one plain table indexed by id, with no
//! cache at all (the same bag kernels, backward plan and row SGD, driven through
//! [`dlrm::DeviceEmbeddings`]): the full-table run against it shows what the cache's index,
//! slot remapping and bookkeeping cost even when nothing moves.
//!
//! Prints the train steps per second of each, `ratio = cached it/s / full-table it/s`, each
//! collection's device bytes ([`CachedEmbeddingBag::device_bytes`]) and the full table's
//! bytes, and the host's share of a step: a few steps run with their phases timed apart
//! (the train step's own device-path calls, each phase's device work waited for before the
//! next, with the cache's index decision and row moves made by a
//! `prefetch` + `settle` of the batch just before its forward, so the forward finds every row
//! resident). Counted as host work: concatenating the batch's ids over the tables, the index
//! decision with its evictions and transfers (device → host write-backs, host → device
//! admissions), and the backward plan (`plan_backward`, timed on the same slots apart from the
//! step and moved out of the forward's time). Not counted: the forward's hit-only index pass
//! and small uploads, the kernels, the MLPs and their optimizer.
//!
//! ```sh
//! cargo bench --bench dlrm
//! ```

#[path = "common/mean.rs"]
mod mean;

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use mean::Mean;
use tidemem::data::criteo::{Dataset, Synthetic, SyntheticConfig};
use tidemem::device::{DeviceBuffer, DeviceView, Stream};
use tidemem::embedding::{bincount, CachedEmbeddingCollection};
use tidemem::models::dlrm::{self, Dlrm, DlrmConfig};
use tidemem::ops::embedding::EmbeddingOptimizer;
use tidemem::ops::embedding::{plan_backward, BagMode};
use tidemem::prelude::*;
use tidemem::rng::{Rng, SplitMix64};

const RATIO: f64 = 0.015;
const COUNT_BATCHES: u64 = 20;
const WARMUP: f64 = 0.7;
const PHASE_STEPS: u64 = 12;

/// The device and the sizes to run at.
struct Setup {
    dev: Device,
    cfg: DlrmConfig,
    scale: f64,
    batch: usize,
    label: &'static str,
}

fn setup() -> Setup {
    let cpu = |dev: Device, label| Setup {
        dev,
        cfg: DlrmConfig::kaggle(),
        scale: 0.05,
        batch: 2048,
        label,
    };
    match Device::cuda(0) {
        Ok(dev) if dev.name().contains("CUDA emulator") => {
            println!("dlrm: CUDA emulator; the CPU sizes (checks the GPU path, not a GPU's speed)");
            cpu(dev, "CUDA emulator")
        }
        Ok(dev) => Setup {
            dev,
            cfg: DlrmConfig::torchrec(),
            scale: 1.0,
            batch: 16_384,
            label: "CUDA",
        },
        Err(e) => {
            println!("dlrm: no GPU ({e}); the simulated device (CPU times)");
            let dev = Device::sim(SimConfig::with_capacity(8 << 30)).expect("sim device");
            cpu(dev, "simulated")
        }
    }
}

/// One model with its store, optimizer and embedding collection.
struct Trainer {
    store: ChunkManager,
    model: Dlrm,
    adam: HybridAdam,
    emb: CachedEmbeddingCollection,
    capacity: usize,
    next: u64,
}

/// Ids counted over the first batches: `(counts, largest batch's distinct rows)`.
fn count(gen: &Synthetic, batch: usize) -> (Vec<u64>, usize) {
    let total = *gen.table_offsets().last().expect("offsets") as usize;
    let mut counted = Vec::new();
    let mut largest = 0;
    for i in 0..COUNT_BATCHES {
        let mut ids = gen.concat_ids(&gen.batch(i, batch)).expect("32-bit ids");
        counted.extend_from_slice(&ids);
        ids.sort_unstable();
        ids.dedup();
        largest = largest.max(ids.len());
    }
    (
        bincount(total, [counted.as_slice()]).expect("counts"),
        largest,
    )
}

fn trainer(s: &Setup, gen: &Synthetic, counts: &[u64], largest: usize, full: bool) -> Trainer {
    let rows: Vec<usize> = gen.cardinalities().iter().map(|&n| n as usize).collect();
    let total: usize = rows.iter().sum();
    let capacity = if full {
        total
    } else {
        ((RATIO * total as f64).ceil() as usize)
            .max(2 * largest)
            .min(total)
    };
    let mut mc = ManagerConfig::new(1 << 20, Policy::Tide);
    mc.param_dtype = DType::F32;
    let mut store = ChunkManager::new(s.dev.clone(), mc).expect("manager");
    let model = Dlrm::register(&mut store, &s.cfg, 0).expect("model");
    let bound = (1.0 / rows.iter().copied().max().unwrap_or(1) as f64).sqrt();
    let mut emb = CachedEmbeddingCollection::new(
        s.dev.clone(),
        &rows,
        s.cfg.dim,
        capacity,
        BagMode::Sum,
        EmbeddingOptimizer::Sgd { lr: 0.5 },
        |c| c,
        |t, id, row| {
            let mut r = SplitMix64::new((t as u64) << 32 | u64::from(id));
            for v in row {
                *v = ((2.0 * r.next_f64() - 1.0) * bound) as f32;
            }
        },
    )
    .expect("collection");
    let cache = emb.bag_mut().cache_mut();
    cache.reorder(counts).expect("reorder");
    cache.warm_up(WARMUP).expect("warm-up");
    let adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-3))).expect("adam");
    Trainer {
        store,
        model,
        adam,
        emb,
        capacity,
        next: COUNT_BATCHES,
    }
}

impl Trainer {
    /// `n` train steps on fresh batches; returns the time of the steps alone.
    fn steps(&mut self, gen: &Synthetic, batch: usize, n: u64) -> Duration {
        let mut total = Duration::ZERO;
        for _ in 0..n {
            let b = gen.batch(self.next, batch);
            self.next += 1;
            let t = Instant::now();
            dlrm::train_step(
                &self.model,
                &mut self.store,
                &mut self.adam,
                &mut self.emb,
                &b,
                Default::default(),
            )
            .expect("train step");
            total += t.elapsed();
        }
        total
    }

    /// `n` steps with their phases timed apart (see the module docs): the train step's own
    /// calls, each phase's device work waited for before the next starts.
    fn phases(&mut self, gen: &Synthetic, batch: usize, n: u64) -> Phases {
        let mut p = Phases::default();
        for _ in 0..n {
            let b = gen.batch(self.next, batch);
            self.next += 1;
            let offsets = dlrm::bag_offsets(b.size).expect("offsets");
            let tables = dlrm::table_batches(&b, &offsets).expect("tables");
            let t = Instant::now();
            let ids = self.emb.global_ids(&tables).expect("ids");
            self.emb.bag_mut().prefetch(&[&ids]).expect("prefetch");
            self.emb.bag_mut().settle().expect("settle");
            let t_host = t.elapsed();
            let t = Instant::now();
            self.emb
                .forward_device_interleaved(&tables)
                .expect("forward");
            self.sync();
            let t_fwd = t.elapsed();
            // the slots the forward planned its backward over (every row resident now)
            let ix = self.emb.bag().cache().index();
            let slots: Vec<u32> = ids
                .iter()
                .map(|&id| {
                    ix.row_of(id)
                        .and_then(|r| ix.slot_of_row(r))
                        .expect("resident")
                })
                .collect();
            let all: Vec<u32> = (0..=ids.len() as u32).collect();
            let t = Instant::now();
            std::hint::black_box(plan_backward(&slots, &all, None, BagMode::Sum).expect("plan"));
            let t_plan = t.elapsed();
            let t = Instant::now();
            let scale = self.adam.loss_scale();
            self.model
                .forward_backward_device(
                    &mut self.store,
                    &mut self.emb,
                    &b.dense,
                    &b.labels,
                    b.size,
                    scale,
                )
                .expect("mlp");
            self.sync();
            let t_mlp = t.elapsed();
            let t = Instant::now();
            let report = self.store.step(&mut self.adam).expect("adam");
            self.sync();
            let t_opt = t.elapsed();
            let t = Instant::now();
            if report.outcome != StepOutcome::Skipped {
                self.emb.step().expect("row step");
            }
            self.sync();
            let t_bwd = t.elapsed();
            p.host += t_host + t_plan;
            p.forward += t_fwd.saturating_sub(t_plan);
            p.mlp += t_mlp;
            p.optimizer += t_opt;
            p.backward += t_bwd;
            p.steps += 1;
        }
        p
    }

    /// Waits for the MLPs' and the embedding's device work.
    fn sync(&self) {
        let dev = self.store.device();
        dev.sync_stream(self.store.compute_stream()).expect("sync");
        dev.sync_stream(self.emb.stream()).expect("sync");
    }

    fn device_bytes(&self) -> usize {
        self.emb.bag().device_bytes()
    }
}

/// A device buffer of at least `bytes` in `slot`, reused across batches.
fn reserve<'a>(dev: &Device, slot: &'a mut Option<DeviceBuffer>, bytes: usize) -> &'a DeviceBuffer {
    if slot.as_ref().is_none_or(|b| b.len() < bytes) {
        *slot = Some(dev.alloc(bytes.max(4).next_power_of_two()).expect("alloc"));
    }
    slot.as_ref().expect("reserved")
}

/// Copies `data` into `slot` (grown as needed) on `s` without waiting; returns its view.
fn put<'a>(
    dev: &Device,
    s: &Stream,
    slot: &'a mut Option<DeviceBuffer>,
    data: &[u8],
) -> DeviceView<'a> {
    let b = reserve(dev, slot, data.len());
    let v = b.view(0, data.len()).expect("view");
    dev.upload_to(s, data, v).expect("upload");
    b.view(0, data.len()).expect("view")
}

/// Every table resident on the device as one plain table indexed by global id, no cache: the
/// same kernels as the cached collection (sum bags, the host-built backward plan, SGD on the
/// rows), without its index, moves or slot remapping. What is left when the cache's fixed
/// costs are taken away.
struct Plain {
    dev: Device,
    stream: Stream,
    table: DeviceBuffer,
    dim: usize,
    out: Option<DeviceBuffer>,
    /// indices, offsets, row starts, entries, scales, rows, gradients
    bufs: [Option<DeviceBuffer>; 7],
    /// The last batch's distinct rows, their gradients computed by `backward`.
    rows: usize,
    bags: usize,
}

impl Plain {
    fn new(dev: &Device, total: usize, dim: usize) -> Plain {
        let stream = dev.new_stream().expect("stream");
        let table = dev.alloc(total * dim * 4).expect("plain table");
        dev.memset(&stream, table.view(0, table.len()).expect("view"), 0)
            .expect("memset");
        Plain {
            dev: dev.clone(),
            stream,
            table,
            dim,
            out: None,
            bufs: Default::default(),
            rows: 0,
            bags: 0,
        }
    }

    /// The sample-major bags of a batch (bag `b·tables + t` holds sample `b`'s id of table
    /// `t`, shifted by the rows of the tables before it), summed into the output.
    fn forward(&mut self, b: &tidemem::data::criteo::Batch, table_offsets: &[u64]) -> Vec<u32> {
        let mut ids = Vec::with_capacity(b.size * b.ids.len());
        for s in 0..b.size {
            for (table, &first) in b.ids.iter().zip(table_offsets) {
                ids.push((first + u64::from(table[s])) as u32);
            }
        }
        let offsets: Vec<u32> = (0..=ids.len() as u32).collect();
        let (dev, s, dim) = (&self.dev, &self.stream, self.dim);
        let [idx, offs, ..] = &mut self.bufs;
        let iv = put(dev, s, idx, bytemuck::cast_slice(&ids));
        let ov = put(dev, s, offs, bytemuck::cast_slice(&offsets));
        let out = reserve(dev, &mut self.out, ids.len() * dim * 4);
        tidemem::ops::embedding::device::embedding_bag(
            dev,
            s,
            self.table.view(0, self.table.len()).expect("view"),
            dim,
            dim,
            iv,
            ov,
            None,
            BagMode::Sum,
            out.view(0, ids.len() * dim * 4).expect("view"),
        )
        .expect("forward");
        self.bags = ids.len();
        ids
    }

    /// The backward plan of the last forward's ids (built on the host, as the cached bag's is),
    /// uploaded for [`dlrm::DeviceEmbeddings::backward`].
    fn plan(&mut self, ids: &[u32]) {
        let offsets: Vec<u32> = (0..=ids.len() as u32).collect();
        let p = plan_backward(ids, &offsets, None, BagMode::Sum).expect("plan");
        let (dev, s) = (&self.dev, &self.stream);
        let [_, _, row_ptr, entries, scale, rows, _] = &mut self.bufs;
        put(dev, s, row_ptr, bytemuck::cast_slice(&p.row_ptr));
        put(dev, s, entries, bytemuck::cast_slice(&p.entries));
        put(dev, s, scale, bytemuck::cast_slice(&p.scale));
        put(dev, s, rows, bytemuck::cast_slice(&p.rows));
        self.rows = p.rows.len();
    }

    /// SGD on the rows `backward` computed gradients for.
    fn step(&mut self, lr: f32) {
        let (dev, s, dim) = (&self.dev, &self.stream, self.dim);
        let [.., rows, grads] = &self.bufs;
        let (rows, grads) = (rows.as_ref().expect("rows"), grads.as_ref().expect("grads"));
        tidemem::ops::embedding::device::embedding_step(
            dev,
            s,
            self.table.view(0, self.table.len()).expect("view"),
            dim,
            dim,
            rows.view(0, self.rows * 4).expect("view"),
            grads.view(0, self.rows * dim * 4).expect("view"),
            &tidemem::ops::embedding::EmbeddingOptimizer::Sgd { lr },
            1,
        )
        .expect("row step");
    }
}

impl dlrm::DeviceEmbeddings for Plain {
    fn stream(&self) -> &Stream {
        &self.stream
    }

    fn vectors(&self) -> tidemem::Result<DeviceView<'_>> {
        self.out
            .as_ref()
            .expect("a forward ran")
            .view(0, self.bags * self.dim * 4)
    }

    fn backward(&mut self, grad: DeviceView<'_>) -> tidemem::Result<usize> {
        let (dev, s, dim) = (&self.dev, &self.stream, self.dim);
        let [_, _, row_ptr, entries, scale, _, grads] = &mut self.bufs;
        fn v(b: &Option<DeviceBuffer>) -> &DeviceBuffer {
            b.as_ref().expect("planned")
        }
        let g = reserve(dev, grads, self.rows * dim * 4);
        tidemem::ops::embedding::device::embedding_backward(
            dev,
            s,
            grad,
            dim,
            v(row_ptr).view(0, (self.rows + 1) * 4)?,
            v(entries).view(0, self.bags * 4)?,
            v(scale).view(0, self.bags * 4)?,
            g.view(0, self.rows * dim * 4)?,
        )?;
        Ok(self.rows)
    }
}

/// The DLRM over the [`Plain`] tables: the same MLPs, optimizer and step order as the cached
/// trainer.
struct PlainTrainer {
    store: ChunkManager,
    model: Dlrm,
    adam: HybridAdam,
    emb: Plain,
    table_offsets: Vec<u64>,
    next: u64,
}

impl PlainTrainer {
    fn new(s: &Setup, gen: &Synthetic) -> PlainTrainer {
        let total = *gen.table_offsets().last().expect("offsets") as usize;
        let mut mc = ManagerConfig::new(1 << 20, Policy::Tide);
        mc.param_dtype = DType::F32;
        let mut store = ChunkManager::new(s.dev.clone(), mc).expect("manager");
        let model = Dlrm::register(&mut store, &s.cfg, 0).expect("model");
        PlainTrainer {
            store,
            model,
            adam: HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-3))).expect("adam"),
            emb: Plain::new(&s.dev, total, s.cfg.dim),
            table_offsets: gen.table_offsets().to_vec(),
            next: COUNT_BATCHES,
        }
    }

    /// `n` train steps on fresh batches; returns the time of the steps alone.
    fn steps(&mut self, gen: &Synthetic, batch: usize, n: u64) -> Duration {
        let mut total = Duration::ZERO;
        for _ in 0..n {
            let b = gen.batch(self.next, batch);
            self.next += 1;
            let t = Instant::now();
            let ids = self.emb.forward(&b, &self.table_offsets);
            self.emb.plan(&ids);
            let scale = self.adam.loss_scale();
            self.model
                .forward_backward_device(
                    &mut self.store,
                    &mut self.emb,
                    &b.dense,
                    &b.labels,
                    b.size,
                    scale,
                )
                .expect("mlp");
            let report = self.store.step(&mut self.adam).expect("adam");
            if report.outcome != StepOutcome::Skipped {
                self.emb.step(0.5);
            }
            total += t.elapsed();
        }
        total
    }
}

/// Seconds in each phase over `steps` steps.
#[derive(Default)]
struct Phases {
    host: Duration,
    forward: Duration,
    mlp: Duration,
    optimizer: Duration,
    backward: Duration,
    steps: u64,
}

impl Phases {
    fn total(&self) -> Duration {
        self.host + self.forward + self.mlp + self.optimizer + self.backward
    }

    fn print(&self, name: &str) {
        let t = self.total().as_secs_f64();
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / self.steps.max(1) as f64;
        println!(
            "  {name}: host share {:.3} of a phase-timed step ({:.1} it/s): host {:.2} ms, \
             rest of the embedding forward {:.2} ms, MLP forward + backward with the \
             embedding's backward {:.2} ms, MLP Adam {:.2} ms, embedding row step {:.2} ms",
            self.host.as_secs_f64() / t,
            self.steps as f64 / t,
            ms(self.host),
            ms(self.forward),
            ms(self.mlp),
            ms(self.optimizer),
            ms(self.backward)
        );
    }
}

fn bench(c: &mut Criterion) {
    let s = setup();
    let gen = Synthetic::new(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(s.scale))
        .expect("synthetic data");
    let (counts, largest) = count(&gen, s.batch);
    let mut cached = trainer(&s, &gen, &counts, largest, false);
    let mut full = trainer(&s, &gen, &counts, largest, true);
    let mut plain = PlainTrainer::new(&s, &gen);
    cached.steps(&gen, s.batch, 3);
    full.steps(&gen, s.batch, 3);
    plain.steps(&gen, s.batch, 3);

    let (mut ours, mut base, mut bare) = (Mean::default(), Mean::default(), Mean::default());
    let mut g = c.benchmark_group("dlrm");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(4));
    g.bench_function("cached_1.5pct", |b| {
        b.iter_custom(|iters| ours.add(cached.steps(&gen, s.batch, iters), iters))
    });
    g.bench_function("full_table_baseline", |b| {
        b.iter_custom(|iters| base.add(full.steps(&gen, s.batch, iters), iters))
    });
    g.bench_function("plain_resident_table", |b| {
        b.iter_custom(|iters| bare.add(plain.steps(&gen, s.batch, iters), iters))
    });
    g.finish();

    let total = *gen.table_offsets().last().expect("offsets") as usize;
    let stride = cached.emb.bag().cache().stride();
    let full_table_bytes = total * stride * 4;
    println!(
        "\ndlrm ({}): {} tables, {} rows (criteo-kaggle × {}), d = {}, batch {}; cache {} rows \
         ({:.2}%), hit rate {:.4}",
        s.label,
        gen.num_tables(),
        total,
        s.scale,
        s.cfg.dim,
        s.batch,
        cached.capacity,
        100.0 * cached.capacity as f64 / total as f64,
        cached.emb.bag().cache().stats().hit_rate()
    );
    println!(
        "  cached {:.2} it/s, full table {:.2} it/s, plain resident table {:.2} it/s; ratio = \
         cached it/s / full-table it/s {:.3}, full-table it/s / plain it/s {:.3} (the cache's \
         fixed costs)",
        1.0 / ours.per_iter(),
        1.0 / base.per_iter(),
        1.0 / bare.per_iter(),
        1.0 / ours.ratio(&base),
        1.0 / base.ratio(&bare)
    );
    println!(
        "  embedding device bytes: cached {:.1} MiB, full table {:.1} MiB (the table's rows \
         alone: {:.1} MiB)",
        cached.device_bytes() as f64 / (1 << 20) as f64,
        full.device_bytes() as f64 / (1 << 20) as f64,
        full_table_bytes as f64 / (1 << 20) as f64
    );
    cached.phases(&gen, s.batch, PHASE_STEPS).print("cached");
    full.phases(&gen, s.batch, PHASE_STEPS).print("full table");
}

criterion_group!(benches, bench);
criterion_main!(benches);
