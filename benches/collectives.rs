//! All-gather and reduce-scatter of chunk-sized fp16 buffers.
//!
//! * In-process backend, 2 ranks on simulated devices: time per collective against a plain
//!   `copy_from_slice` of the gathered bytes on one thread, measured in the same run
//!   (`ratio = copy time / collective time`). The in-process backend is a test vehicle that
//!   stages through host memory; the ratio says what it costs.
//! * NCCL at world size 1 on CUDA device 0 (when a GPU and NCCL are present): algorithm
//!   bandwidth of all-gather and reduce-scatter against a device-to-device copy of the same
//!   bytes (the gathered or reduced bytes over the time, nccl-tests' convention). With one GPU
//!   the bus bandwidth of a ring is zero, so only algorithm bandwidth is printed; for N ranks
//!   bus = alg · (N−1)/N, the factor `CommStats::bus_bytes` applies.
//!
//! `TIDEMEM_BENCH_SIZES_MIB` overrides the sizes (default `4,32`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tidemem::comm::{nccl_unique_id, Communicator, Elem, ReduceOp, DEFAULT_TIMEOUT};
use tidemem::device::{Device, SimConfig};

fn sizes() -> Vec<usize> {
    std::env::var("TIDEMEM_BENCH_SIZES_MIB")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![4, 32])
        .into_iter()
        .map(|m: usize| m << 20)
        .collect()
}

/// Seconds for `iters` collectives of `kind` on every rank of a fresh in-process group.
fn local_run(world: usize, bytes: usize, iters: u64, gather: bool) -> Duration {
    let devs = (0..world)
        .map(|_| Device::sim(SimConfig::with_capacity(4 * bytes * world)).unwrap())
        .collect();
    let comms = Communicator::local(devs).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let d = c.device();
                    let st = d.new_stream().unwrap();
                    let shard = bytes / world;
                    let full = d.alloc(bytes).unwrap();
                    d.memset(&st, &full, 1).unwrap();
                    let r = c.rank();
                    c.barrier(&st).unwrap();
                    let t = Instant::now();
                    for _ in 0..iters {
                        let mine = full.view(r * shard, shard).unwrap();
                        if gather {
                            c.all_gather(&st, mine, (&full).into(), Elem::F16).unwrap();
                        } else {
                            c.reduce_scatter(&st, (&full).into(), mine, Elem::F16, ReduceOp::Avg)
                                .unwrap();
                        }
                    }
                    d.sync_stream(&st).unwrap();
                    t.elapsed()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).max().unwrap()
    })
}

fn copy_time(bytes: usize, iters: u64) -> Duration {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let t = Instant::now();
    for _ in 0..iters {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
    }
    t.elapsed()
}

fn bench_local(c: &mut Criterion) {
    let mut g = c.benchmark_group("collectives/local-2");
    g.sample_size(10).measurement_time(Duration::from_secs(2));
    let mut rows = Vec::new();
    for bytes in sizes() {
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_with_input(
            BenchmarkId::new("all_gather", bytes >> 20),
            &bytes,
            |b, &n| b.iter_custom(|it| local_run(2, n, it, true)),
        );
        g.bench_with_input(
            BenchmarkId::new("reduce_scatter", bytes >> 20),
            &bytes,
            |b, &n| b.iter_custom(|it| local_run(2, n, it, false)),
        );
        g.bench_with_input(BenchmarkId::new("copy", bytes >> 20), &bytes, |b, &n| {
            b.iter_custom(|it| copy_time(n, it))
        });
        let it = 8;
        let base = copy_time(bytes, it).as_secs_f64();
        let ag = local_run(2, bytes, it, true).as_secs_f64();
        let rs = local_run(2, bytes, it, false).as_secs_f64();
        rows.push((bytes, base, ag, rs));
    }
    g.finish();
    println!("\nin-process backend, 2 ranks, fp16 (ratio = memcpy time / collective time)");
    for (bytes, base, ag, rs) in rows {
        println!(
            "  {:>4} MiB  all_gather ratio {:.3} | reduce_scatter ratio {:.3}",
            bytes >> 20,
            base / ag,
            base / rs
        );
    }
}

fn bench_nccl(c: &mut Criterion) {
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("collectives/nccl: skipping, no CUDA device: {e}");
            return;
        }
    };
    let id = match nccl_unique_id() {
        Ok(id) => id,
        Err(e) => {
            println!("collectives/nccl: skipping, no NCCL: {e}");
            return;
        }
    };
    let comm = Communicator::nccl_with_id(dev.clone(), &id, 0, 1, DEFAULT_TIMEOUT).unwrap();
    let st = dev.new_stream().unwrap();
    let mut g = c.benchmark_group("collectives/nccl-1");
    g.sample_size(20);
    let mut rows = Vec::new();
    for bytes in sizes() {
        let a = dev.alloc(bytes).unwrap();
        let b = dev.alloc(bytes).unwrap();
        dev.memset(&st, &a, 1).unwrap();
        let time = |f: &mut dyn FnMut()| {
            f();
            dev.sync_stream(&st).unwrap();
            let t = Instant::now();
            for _ in 0..20 {
                f();
            }
            dev.sync_stream(&st).unwrap();
            t.elapsed().as_secs_f64() / 20.0
        };
        let ag = time(&mut || {
            comm.all_gather(&st, (&a).into(), (&b).into(), Elem::F16)
                .unwrap()
        });
        let rs = time(&mut || {
            comm.reduce_scatter(&st, (&a).into(), (&b).into(), Elem::F16, ReduceOp::Sum)
                .unwrap()
        });
        let cp = time(&mut || dev.copy_d2d(&st, &a, &b).unwrap());
        rows.push((bytes, cp, ag, rs));
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_with_input(
            BenchmarkId::new("all_gather", bytes >> 20),
            &bytes,
            |bn, _| {
                bn.iter(|| {
                    comm.all_gather(&st, (&a).into(), (&b).into(), Elem::F16)
                        .unwrap();
                    dev.sync_stream(&st).unwrap();
                })
            },
        );
    }
    g.finish();
    println!(
        "\nNCCL, world 1, fp16 (algorithm bandwidth; ratio = d2d copy time / collective time)"
    );
    for (bytes, cp, ag, rs) in rows {
        let gbs = |t: f64| bytes as f64 / t / 1e9;
        println!(
            "  {:>4} MiB  all_gather {:7.1} GB/s ratio {:.3} | reduce_scatter {:7.1} GB/s ratio {:.3} | copy {:7.1} GB/s",
            bytes >> 20,
            gbs(ag),
            cp / ag,
            gbs(rs),
            cp / rs,
            gbs(cp)
        );
    }
}

criterion_group!(benches, bench_local, bench_nccl);
criterion_main!(benches);
