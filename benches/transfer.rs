//! Chunk-sized transfers.
//!
//! * Sim: host→device and device→host through the device layer against a plain
//!   `copy_from_slice` of the same bytes, measured in the same run. Target ratio ≥ 0.8.
//! * CUDA (when a GPU is present): host→device and device→host through the device layer against
//!   raw cudarc copies between pinned memory and the device. Target ratio ≥ 0.9, with GB/s.
//!
//! The ratio is printed as `ratio = baseline time / device-layer time` from interleaved
//! repetitions (medians), so drift of a shared machine hits both sides alike.
//! `TIDEMEM_BENCH_SIZES_MIB` overrides the sizes (default `4,64,256`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tidemem::device::{Device, HostBuffer, SimConfig, Stream};

fn sizes() -> Vec<usize> {
    std::env::var("TIDEMEM_BENCH_SIZES_MIB")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![4, 64, 256])
        .into_iter()
        .map(|m: usize| m << 20)
        .collect()
}

/// Median seconds of `a` and of `b` over `reps` interleaved runs.
fn interleaved(reps: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    let (mut ta, mut tb) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for _ in 0..reps {
        let t = Instant::now();
        a();
        ta.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        b();
        tb.push(t.elapsed().as_secs_f64());
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|x, y| x.partial_cmp(y).unwrap());
        v[v.len() / 2]
    };
    (med(&mut ta), med(&mut tb))
}

/// One row per size: (MiB, bytes, baseline s, h2d s, baseline s, d2h s).
type Row = (usize, usize, f64, f64, f64, f64);

fn print_summary(title: &str, rows: &[Row]) {
    println!("\n{title}");
    for &(mib, bytes, base, h2d, base2, d2h) in rows {
        let gbs = |t: f64| bytes as f64 / t / 1e9;
        println!(
            "  {mib:>4} MiB  h2d {:6.2} GB/s (baseline {:6.2}) ratio {:.3} | d2h {:6.2} GB/s (baseline {:6.2}) ratio {:.3}",
            gbs(h2d),
            gbs(base),
            base / h2d,
            gbs(d2h),
            gbs(base2),
            base2 / d2h
        );
    }
}

fn reps_for(bytes: usize) -> usize {
    ((2usize << 30) / bytes).clamp(5, 100)
}

struct Rig {
    dev: Device,
    s: Stream,
    buf: tidemem::device::DeviceBuffer,
    host: Option<HostBuffer>,
}

impl Rig {
    fn new(dev: Device, bytes: usize) -> Self {
        let s = dev.new_stream().unwrap();
        let buf = dev.alloc(bytes).unwrap();
        let mut host = dev.alloc_host(bytes).unwrap();
        host.fill(1);
        let mut r = Rig {
            dev,
            s,
            buf,
            host: Some(host),
        };
        r.h2d();
        r.d2h();
        r
    }
    fn h2d(&mut self) {
        let h = self.host.take().unwrap();
        self.host = Some(
            self.dev
                .copy_h2d(&self.s, h, &self.buf)
                .unwrap()
                .wait()
                .unwrap(),
        );
    }
    fn d2h(&mut self) {
        let h = self.host.take().unwrap();
        self.host = Some(
            self.dev
                .copy_d2h(&self.s, &self.buf, h)
                .unwrap()
                .wait()
                .unwrap(),
        );
    }
}

fn sim(c: &mut Criterion) {
    let mut g = c.benchmark_group("transfer/sim");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let mut summary = Vec::new();
    for bytes in sizes() {
        let dev = Device::sim(SimConfig::with_capacity(bytes + (1 << 20))).unwrap();
        let mut rig = Rig::new(dev, bytes);
        let src = vec![3u8; bytes];
        let mut dst = vec![0u8; bytes];
        dst.copy_from_slice(&src);
        let mib = bytes >> 20;
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(
            BenchmarkId::new("copy_from_slice", format!("{mib}MiB")),
            |b| b.iter(|| black_box(&mut dst).copy_from_slice(black_box(&src))),
        );
        g.bench_function(BenchmarkId::new("h2d", format!("{mib}MiB")), |b| {
            b.iter(|| rig.h2d())
        });
        g.bench_function(BenchmarkId::new("d2h", format!("{mib}MiB")), |b| {
            b.iter(|| rig.d2h())
        });
        let reps = reps_for(bytes);
        let (base, h2d) = interleaved(
            reps,
            || black_box(&mut dst).copy_from_slice(black_box(&src)),
            || rig.h2d(),
        );
        let (base2, d2h) = interleaved(
            reps,
            || black_box(&mut dst).copy_from_slice(black_box(&src)),
            || rig.d2h(),
        );
        summary.push((mib, bytes, base, h2d, base2, d2h));
    }
    g.finish();
    print_summary(
        "transfer/sim: ratio = copy_from_slice time / device-layer time (target >= 0.8)",
        &summary,
    );
}

fn cuda(c: &mut Criterion) {
    use cudarc::driver::{CudaContext, PinnedHostSlice};
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("transfer/cuda: skipped: {e}");
            return;
        }
    };
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let mut g = c.benchmark_group("transfer/cuda");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let mut summary = Vec::new();
    for bytes in sizes() {
        let mut rig = Rig::new(dev.clone(), bytes);
        // SAFETY: filled before use; flags 0 = plain pinned memory, as the device layer uses.
        let mut pinned: PinnedHostSlice<u8> =
            unsafe { ctx.alloc_pinned_with_flags(bytes, 0) }.unwrap();
        pinned.as_mut_slice().unwrap().fill(1);
        let mut raw = stream.alloc_zeros::<u8>(bytes).unwrap();
        let mut raw_h2d = || {
            stream.memcpy_htod(&pinned, &mut raw).unwrap();
            stream.synchronize().unwrap();
        };
        raw_h2d();
        let mib = bytes >> 20;
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(BenchmarkId::new("raw_h2d", format!("{mib}MiB")), |b| {
            b.iter(&mut raw_h2d)
        });
        g.bench_function(BenchmarkId::new("h2d", format!("{mib}MiB")), |b| {
            b.iter(|| rig.h2d())
        });
        let reps = reps_for(bytes);
        let (base, h2d) = interleaved(reps, &mut raw_h2d, || rig.h2d());
        let mut raw_d2h = || {
            stream.memcpy_dtoh(&raw, &mut pinned).unwrap();
            stream.synchronize().unwrap();
        };
        raw_d2h();
        g.bench_function(BenchmarkId::new("raw_d2h", format!("{mib}MiB")), |b| {
            b.iter(&mut raw_d2h)
        });
        g.bench_function(BenchmarkId::new("d2h", format!("{mib}MiB")), |b| {
            b.iter(|| rig.d2h())
        });
        let (base2, d2h) = interleaved(reps, &mut raw_d2h, || rig.d2h());
        summary.push((mib, bytes, base, h2d, base2, d2h));
    }
    g.finish();
    print_summary(
        "transfer/cuda: ratio = raw pinned cudarc time / device-layer time (target >= 0.9)",
        &summary,
    );
}

criterion_group!(benches, sim, cuda);
criterion_main!(benches);
