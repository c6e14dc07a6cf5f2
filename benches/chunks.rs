//! Chunk manager and scheduler overheads.
//!
//! * `chunks/fetch_release`: forward-stage fetch + release of one tensor at a time on a Sim
//!   device large enough that every chunk stays resident, so no move happens in the timed
//!   region. Reported in ns per tensor; target: well under 1 µs per tensor. A plain
//!   `HashMap<u32, u32>` lookup + insert loop over as many keys, measured in the same run, is
//!   printed next to it as a reference floor (not a target).
//! * `chunks/policy_decision`: decision time of the pure `Scheduler` (tick + fetch + prefetch +
//!   release for every moment of one steady iteration) on a synthetic GPT-like trace with a
//!   device budget of about a quarter of the parameter chunk bytes, for Tide, PatrickStar and
//!   LRU. Reported in µs per moment for every chunk count.
//!
//! Summary figures are medians of repetitions run after criterion's measurement, interleaved
//! with the reference where there is one, so drift of a shared machine hits both sides alike.
//! `TIDEMEM_BENCH_TENSORS` overrides the tensor count (default `1000`);
//! `TIDEMEM_BENCH_CHUNKS` the chunk counts (comma list, default `256,1024,4096`).

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use tidemem::chunk::{optimizer_accesses, ChunkManager, ChunkPlan, ManagerConfig};
use tidemem::device::{Device, SimConfig};
use tidemem::tensor::ChunkKind;
use tidemem::tensor::{Init, Stage, TensorId};
use tidemem::tide::{
    Access, ChunkDesc, ChunkNo, MoveStats, Policy, Scheduler, SchedulerConfig, Target, Tracer,
};

/// Elements per tensor in `fetch_release`.
const TENSOR_ELEMS: usize = 64;
/// Tensors per chunk in `fetch_release`.
const PER_CHUNK: usize = 16;

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(name)
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| default.to_vec())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|x, y| x.partial_cmp(y).unwrap());
    v[v.len() / 2]
}

/// Moves of any kind counted in `s`.
fn move_count(s: &MoveStats) -> u64 {
    s.loads + s.write_backs + s.clean_drops + s.materialized
}

// ---------------------------------------------------------------------------------------------
// fetch_release

/// A manager whose parameter chunks are all resident after warm-up.
struct Resident {
    m: ChunkManager,
    ids: Vec<TensorId>,
    /// Moves ordered inside timed forward passes (expected 0).
    timed_moves: u64,
}

impl Resident {
    fn new(n: usize) -> Self {
        let chunk_elems = TENSOR_ELEMS * PER_CHUNK;
        let param_bytes = n.div_ceil(PER_CHUNK) * chunk_elems * 2;
        let dev = Device::sim(SimConfig::with_capacity(4 * param_bytes + (16 << 20))).unwrap();
        let mut cfg = ManagerConfig::new(chunk_elems, Policy::Tide);
        cfg.scheduler.overall_fraction = 1.0;
        cfg.scheduler.warmup_chunk_fraction = 1.0;
        let mut m = ChunkManager::new(dev, cfg).unwrap();
        let ids = (0..n)
            .map(|i| {
                m.register(&format!("t{i}"), &[TENSOR_ELEMS], Init::Zeros)
                    .unwrap()
            })
            .collect();
        let mut r = Resident {
            m,
            ids,
            timed_moves: 0,
        };
        // Warm-up iteration: records and installs the trace.
        r.forward();
        r.m.end_forward().unwrap();
        r.backward();
        r.m.end_backward().unwrap();
        r.m.step_host(|_| Ok(())).unwrap();
        r.m.end_step().unwrap();
        assert!(r.m.is_steady(), "trace installed after warm-up");
        // The optimizer step writes the parameter chunks on the host, which drops their device
        // copies; this forward pass loads them again, and the iterations that follow skip the
        // step, so they stay resident from here on.
        r.forward();
        r.finish();
        r
    }

    fn forward(&mut self) {
        for &id in &self.ids {
            let views = self.m.fetch(&[id], Stage::Forward).unwrap();
            black_box(&views);
            drop(views);
            self.m.release(&[id], Stage::Forward).unwrap();
        }
    }

    fn backward(&mut self) {
        for i in (0..self.ids.len()).rev() {
            let id = self.ids[i];
            drop(black_box(self.m.fetch(&[id], Stage::Backward).unwrap()));
            self.m.release(&[id], Stage::Backward).unwrap();
        }
    }

    /// The untimed rest of an iteration: backward pass and a skipped step.
    fn finish(&mut self) {
        self.m.end_forward().unwrap();
        self.backward();
        self.m.end_backward().unwrap();
        self.m.skip_step().unwrap();
    }

    /// Time of one forward pass (fetch + release of every tensor); the rest of the iteration
    /// runs untimed.
    fn timed_pass(&mut self) -> Duration {
        let before = self.m.stats();
        let t = Instant::now();
        self.forward();
        let d = t.elapsed();
        self.timed_moves += move_count(&self.m.stats().since(&before));
        self.finish();
        d
    }
}

/// The reference loop: a lookup and an insert per key.
fn hashmap_pass(map: &mut HashMap<u32, u32>, n: u32) {
    for k in 0..n {
        let k = black_box(k);
        let v = map.get(&k).copied().unwrap_or(0);
        map.insert(k, v.wrapping_add(1));
    }
}

fn fetch_release(c: &mut Criterion) {
    let n = env_list("TIDEMEM_BENCH_TENSORS", &[1000])[0].max(1);
    let mut rig = Resident::new(n);
    let mut map: HashMap<u32, u32> = (0..n as u32).map(|k| (k, 0)).collect();
    let mut g = c.benchmark_group("chunks/fetch_release");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Elements(n as u64));
    g.bench_function(BenchmarkId::new("manager", n), |b| {
        b.iter_custom(|iters| (0..iters).map(|_| rig.timed_pass()).sum())
    });
    g.bench_function(BenchmarkId::new("hashmap_reference", n), |b| {
        b.iter(|| hashmap_pass(&mut map, n as u32))
    });
    g.finish();

    let reps = 30;
    let (mut tm, mut th) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for _ in 0..reps {
        tm.push(rig.timed_pass().as_secs_f64());
        let t = Instant::now();
        hashmap_pass(&mut map, n as u32);
        th.push(t.elapsed().as_secs_f64());
    }
    let per = |t: f64| t / n as f64 * 1e9;
    let (man, href) = (per(median(&mut tm)), per(median(&mut th)));
    let groups = rig.m.layout().groups();
    println!(
        "\nchunks/fetch_release: {n} tensors of {TENSOR_ELEMS} elements, {groups} chunks resident, \
         {} moves in timed passes",
        rig.timed_moves
    );
    println!("  manager:   {man:8.1} ns/tensor (forward fetch + release)  target: well under 1 µs per tensor");
    println!(
        "  reference: {href:8.1} ns/key (HashMap<u32, u32> lookup + insert; a floor, not a target)  \
         manager / reference = {:.1}",
        man / href
    );
}

// ---------------------------------------------------------------------------------------------
// policy_decision

/// A synthetic GPT-like workload for the pure scheduler.
struct Synthetic {
    chunks: Vec<ChunkDesc>,
    /// Per moment: stage, accesses, non-model bytes, and the chunks to release.
    moments: Vec<(Stage, Vec<Access>, u64, Vec<ChunkNo>)>,
    cfg: SchedulerConfig,
}

/// `total` chunks (rounded to whole groups of four, at least 8 groups): a forward moment per
/// parameter chunk, a tied head that reads chunk group 0 again, backward in reverse writing the
/// gradients, then an optimizer moment per group with its four chunks on the host. Non-model
/// memory rises through forward and falls through backward to a peak of 1/8 of the parameter
/// chunk bytes; the device holds that peak plus 1/4 of the parameter chunk bytes.
fn synthetic(total: usize) -> Synthetic {
    let groups = (total / 4).max(8) as u32;
    let elems: u64 = 1 << 20;
    let chunks: Vec<ChunkDesc> = (0..groups)
        .flat_map(|g| {
            ChunkKind::ALL.into_iter().map(move |kind| ChunkDesc {
                bytes: elems * if kind == ChunkKind::Param { 2 } else { 4 },
                kind,
                group: g,
            })
        })
        .collect();
    let param_bytes = groups as u64 * elems * 2;
    let peak = param_bytes / 8;
    let nm = |step: u32| peak * step as u64 / (groups as u64 + 1);
    let dev = |g: u32, write: bool| Access {
        chunk: ChunkPlan::chunk_no(g, ChunkKind::Param),
        target: Target::Device,
        write,
    };
    let mut moments = Vec::new();
    for g in 0..groups {
        moments.push((Stage::Forward, vec![dev(g, false)], nm(g + 1)));
    }
    moments.push((Stage::Forward, vec![dev(0, false)], nm(groups + 1)));
    moments.push((Stage::Backward, vec![dev(0, false)], nm(groups + 1)));
    for g in (0..groups).rev() {
        moments.push((Stage::Backward, vec![dev(g, true)], nm(g + 1)));
    }
    for g in 0..groups {
        moments.push((Stage::Optimizer, optimizer_accesses(g), 0));
    }
    let mut cfg = SchedulerConfig::new(param_bytes / 4 + peak);
    cfg.overall_fraction = 1.0;
    cfg.warmup_chunk_fraction = 1.0;
    Synthetic {
        chunks,
        moments: moments
            .into_iter()
            .map(|(s, a, n)| {
                let c = a.iter().map(|a| a.chunk).collect();
                (s, a, n, c)
            })
            .collect(),
        cfg,
    }
}

impl Synthetic {
    /// A scheduler after the warm-up iteration (trace installed) and one steady iteration.
    fn scheduler(&self, policy: Policy) -> Scheduler {
        let mut s = Scheduler::new(policy, self.cfg, self.chunks.clone()).unwrap();
        let mut tracer = Tracer::new();
        s.start_iteration();
        for (stage, acc, nm, chunks) in &self.moments {
            s.tick();
            tracer.tick(*stage, acc.clone(), *nm);
            s.fetch(acc).unwrap();
            s.prefetch();
            s.release(chunks).unwrap();
        }
        s.install_trace(tracer.finish().expect("complete iteration"));
        self.iteration(&mut s);
        s
    }

    /// One steady iteration; returns the number of moves ordered.
    fn iteration(&self, s: &mut Scheduler) -> usize {
        s.start_iteration();
        let mut n = 0;
        for (_, acc, _, chunks) in &self.moments {
            s.tick();
            n += s.fetch(acc).unwrap().len();
            n += s.prefetch().len();
            n += s.release(chunks).unwrap().len();
        }
        n
    }

    fn timed(&self, s: &mut Scheduler) -> Duration {
        let t = Instant::now();
        black_box(self.iteration(s));
        t.elapsed()
    }
}

fn policy_decision(c: &mut Criterion) {
    let policies = [Policy::Tide, Policy::PatrickStar, Policy::Lru];
    let mut g = c.benchmark_group("chunks/policy_decision");
    // an iteration takes up to tens of milliseconds at 4096 chunks
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let mut rows = Vec::new();
    for total in env_list("TIDEMEM_BENCH_CHUNKS", &[256, 1024, 4096]) {
        let w = synthetic(total);
        let moments = w.moments.len();
        g.throughput(Throughput::Elements(moments as u64));
        for policy in policies {
            let mut s = w.scheduler(policy);
            let label = w.chunks.len();
            g.bench_function(BenchmarkId::new(policy.name(), label), |b| {
                b.iter_custom(|iters| (0..iters).map(|_| w.timed(&mut s)).sum())
            });
            let before = s.stats();
            let first = w.timed(&mut s).as_secs_f64();
            let steady = s.stats().since(&before);
            let reps = ((0.3 / first) as usize).clamp(5, 100);
            let mut t: Vec<f64> = (0..reps).map(|_| w.timed(&mut s).as_secs_f64()).collect();
            let it = median(&mut t);
            rows.push((label, moments, policy.name(), it, steady));
        }
    }
    g.finish();
    println!(
        "\nchunks/policy_decision: one steady iteration of tick + fetch + prefetch + release, \
         device budget ~1/4 of parameter chunk bytes (+ non-model tide); \
         chunks = all four lists, param = parameter chunks"
    );
    println!(
        "  {:>6} {:>6} {:>7}  {:<12} {:>10} {:>9} {:>10} {:>11}",
        "chunks", "param", "moments", "policy", "µs/moment", "ms/iter", "loads/iter", "write-backs"
    );
    for (chunks, moments, policy, it, st) in rows {
        println!(
            "  {chunks:>6} {:>6} {moments:>7}  {policy:<12} {:>10.3} {:>9.3} {:>10} {:>11}",
            chunks / 4,
            it / moments as f64 * 1e6,
            it * 1e3,
            st.loads,
            st.write_backs
        );
    }
}

criterion_group!(benches, fetch_release, policy_decision);
criterion_main!(benches);
