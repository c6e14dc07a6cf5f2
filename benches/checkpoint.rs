//! Checkpoint save and load of the chunk manager against writing and reading the same bytes
//! as one plain file, in the same run.
//!
//! The model: 64 tensors of 256K elements in fp16 chunks of 1M elements (16M parameters,
//! 224 MiB of model data over the four lists), trained one step so that every list holds
//! values, on a simulated device that holds a quarter of the parameter chunks. `save` streams
//! every chunk from wherever it is into a synced temporary file that replaces the target;
//! `load` checks the file and overwrites every chunk's host copy. The baselines write (and
//! sync) one buffer of the file's size, and read the file into a buffer allocated beforehand
//! (the chunks' host copies exist before a load too); both sides read from the page cache. The
//! ratios say what the chunk-by-chunk streaming, the format and the checks cost over moving the
//! bytes to and from the file system.
//!
//! ```sh
//! cargo bench --bench checkpoint
//! ```

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

#[path = "common/mean.rs"]
mod mean;
use mean::Mean;
use tidemem::chunk::{ChunkManager, ManagerConfig};
use tidemem::device::{Device, SimConfig};
use tidemem::tensor::{Init, Stage, TensorId};
use tidemem::tide::Policy;

const TENSORS: usize = 64;
const ELEMS: usize = 256 << 10;
const CHUNK: usize = 1 << 20;

fn model() -> ChunkManager {
    let dev = Device::sim(SimConfig::with_capacity(
        TENSORS * ELEMS * 2 / 4 + (16 << 20),
    ))
    .expect("sim device");
    let mut cfg = ManagerConfig::new(CHUNK, Policy::Tide);
    cfg.scheduler.overall_fraction = 1.0;
    let mut m = ChunkManager::new(dev, cfg).expect("manager");
    let ids: Vec<TensorId> = (0..TENSORS)
        .map(|t| {
            m.register(
                &format!("t{t}"),
                &[ELEMS],
                Init::Uniform {
                    seed: t as u64,
                    lo: -1.0,
                    hi: 1.0,
                },
            )
            .expect("register")
        })
        .collect();
    // one step, so that masters and moments hold values and chunks are spread over the tiers
    for &id in &ids {
        m.fetch(&[id], Stage::Forward).expect("fetch");
        m.release(&[id], Stage::Forward).expect("release");
    }
    m.end_forward().expect("end forward");
    for &id in ids.iter().rev() {
        m.fetch(&[id], Stage::Backward).expect("fetch");
        m.write_grad(id, &vec![0.01; ELEMS]).expect("grad");
        m.release(&[id], Stage::Backward).expect("release");
    }
    m.end_backward().expect("end backward");
    m.step_host(|mut g| {
        let grad = g.param_f32();
        for (i, x) in g.master.iter_mut().enumerate() {
            *x -= 0.1 * grad[i];
            g.momentum[i] = 0.5 * grad[i];
            g.variance[i] = grad[i] * grad[i];
        }
        g.store_params();
        Ok(())
    })
    .expect("step");
    m.end_step().expect("end step");
    m
}

fn checkpoint(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("model.safetensors");
    let plain = dir.path().join("plain.bin");
    let mut m = model();
    m.save_checkpoint(&path, &BTreeMap::new()).expect("save");
    let bytes = std::fs::metadata(&path).expect("file").len();
    let buf = vec![7u8; bytes as usize];

    let mut g = c.benchmark_group("checkpoint");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(bytes));
    let (mut save, mut write) = (Mean::default(), Mean::default());
    g.bench_function("save", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                m.save_checkpoint(&path, &BTreeMap::new()).expect("save");
            }
            save.add(t.elapsed(), iters)
        })
    });
    g.bench_function("write_and_sync_baseline", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                let mut f = std::fs::File::create(&plain).expect("create");
                f.write_all(&buf).expect("write");
                f.sync_all().expect("sync");
            }
            write.add(t.elapsed(), iters)
        })
    });
    let (mut load, mut read) = (Mean::default(), Mean::default());
    g.bench_function("load", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                m.load_checkpoint(&path).expect("load");
            }
            load.add(t.elapsed(), iters)
        })
    });
    let mut into = vec![0u8; bytes as usize];
    g.bench_function("read_baseline", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                let mut f = std::fs::File::open(&plain).expect("open");
                std::io::Read::read_exact(&mut f, &mut into).expect("read");
                std::hint::black_box(&into);
            }
            read.add(t.elapsed(), iters)
        })
    });
    g.finish();
    let gbps = |m: &Mean| bytes as f64 / m.per_iter() / 1e9;
    println!(
        "checkpoint ({} MiB, {TENSORS} tensors): save {:.2} GB/s against {:.2} GB/s to write \
         and sync the same bytes (ratio of times {:.2}); load {:.2} GB/s against {:.2} GB/s to \
         read them (ratio {:.2})",
        bytes >> 20,
        gbps(&save),
        gbps(&write),
        save.ratio(&write),
        gbps(&load),
        gbps(&read),
        load.ratio(&read)
    );
}

criterion_group!(benches, checkpoint);
criterion_main!(benches);
