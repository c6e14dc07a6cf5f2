//! Memory bandwidth of the CUDA Adam step (`kernels/adam.cu` through `Device::adam`) against a
//! device-to-device copy of the same number of bytes, measured in the same run.
//!
//! An element of a step reads and writes 28 bytes: fp32 gradients without a copy read the
//! parameter, momentum, variance and gradient (16 B) and write the first three (12 B); fp16
//! gradients replaced in place by the fp16 parameter read 14 B and write 14 B. The baseline
//! copies 14 bytes per element (read 14, write 14). Both are reported in GB/s of traffic, and
//! `ratio = Adam GB/s / copy GB/s` from interleaved repetitions (medians), so drift hits both
//! sides alike. `TIDEMEM_BENCH_ADAM_MELEMS` overrides the element counts in millions (default
//! `16,64`). Without a GPU the bench prints why it is skipped and exits successfully.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tidemem::device::{Device, DeviceBuffer, DeviceView, Stream};
use tidemem::ops::AdamOperands;
use tidemem::ops::AdamScalars;
use tidemem::optim::AdamConfig;
use tidemem::DType;

/// Bytes of traffic per element of an Adam step.
const ADAM_BYTES: usize = 28;
/// Steps (or copies) per timed repetition, then one stream synchronisation.
const BATCH: usize = 10;

fn sizes() -> Vec<usize> {
    std::env::var("TIDEMEM_BENCH_ADAM_MELEMS")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![16, 64])
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

/// The operands of one variant: fp32 state in one buffer, the gradient in another.
struct Rig {
    dev: Device,
    s: Stream,
    state: DeviceBuffer,
    grad: DeviceBuffer,
    grad_dtype: DType,
    in_place: bool,
    n: usize,
    scalars: AdamScalars,
    src: DeviceBuffer,
    dst: DeviceBuffer,
}

impl Rig {
    fn new(dev: &Device, n: usize, grad_dtype: DType, in_place: bool) -> Rig {
        let s = dev.new_stream().unwrap();
        let state = dev.alloc(12 * n).unwrap();
        let grad = dev.alloc(grad_dtype.size() * n).unwrap();
        let copy_bytes = ADAM_BYTES / 2 * n;
        let (src, dst) = (
            dev.alloc(copy_bytes).unwrap(),
            dev.alloc(copy_bytes).unwrap(),
        );
        // 0x3c bytes: small finite fp32 (0.0115) and fp16 (1.06) values
        for b in [&state, &grad, &src, &dst] {
            dev.memset(&s, b, 0x3c).unwrap();
        }
        dev.sync_stream(&s).unwrap();
        Rig {
            dev: dev.clone(),
            s,
            state,
            grad,
            grad_dtype,
            in_place,
            n,
            scalars: AdamConfig::adamw(1e-3, 0.01).scalars(1, 1.0).unwrap(),
            src,
            dst,
        }
    }

    fn adam(&self) {
        let n4 = 4 * self.n;
        for _ in 0..BATCH {
            let grad: DeviceView<'_> = (&self.grad).into();
            let ops = AdamOperands {
                params: self.state.view(0, n4).unwrap(),
                momentum: self.state.view(n4, n4).unwrap(),
                variance: self.state.view(2 * n4, n4).unwrap(),
                grad,
                grad_dtype: self.grad_dtype,
                copy: self.in_place.then_some((grad, self.grad_dtype)),
            };
            tidemem::ops::adam(&self.dev, &self.s, &self.scalars, ops).unwrap();
        }
        self.dev.sync_stream(&self.s).unwrap();
    }

    fn copy(&self) {
        for _ in 0..BATCH {
            self.dev.copy_d2d(&self.s, &self.src, &self.dst).unwrap();
        }
        self.dev.sync_stream(&self.s).unwrap();
    }
}

fn cuda_adam(c: &mut Criterion) {
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("cuda_adam: skipped: {e}");
            return;
        }
    };
    let mut g = c.benchmark_group("cuda_adam");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let mut rows = Vec::new();
    for n in sizes() {
        for (label, grad_dtype, in_place) in [
            ("f32 grad", DType::F32, false),
            ("f16 grad, in-place f16 copy", DType::F16, true),
        ] {
            let rig = Rig::new(&dev, n, grad_dtype, in_place);
            rig.adam();
            rig.copy();
            let id = format!("{}M/{}", n >> 20, grad_dtype.name());
            g.throughput(Throughput::Bytes((ADAM_BYTES * n * BATCH) as u64));
            g.bench_function(BenchmarkId::new("adam", &id), |b| b.iter(|| rig.adam()));
            g.bench_function(BenchmarkId::new("d2d_copy", &id), |b| b.iter(|| rig.copy()));
            let (t_adam, t_copy) = interleaved(20, || rig.adam(), || rig.copy());
            rows.push((n, label, t_adam, t_copy));
        }
    }
    g.finish();
    println!(
        "\ncuda_adam on {}: GB/s of traffic (28 B/element); ratio = Adam GB/s / d2d copy GB/s",
        dev.name()
    );
    for (n, label, t_adam, t_copy) in rows {
        let gbs = |t: f64| (ADAM_BYTES * n * BATCH) as f64 / t / 1e9;
        println!(
            "  {:>4}M elements  {label:<28} Adam {:7.1} GB/s  copy {:7.1} GB/s  ratio {:.3}",
            n >> 20,
            gbs(t_adam),
            gbs(t_copy),
            t_copy / t_adam
        );
    }
}

criterion_group!(benches, cuda_adam);
criterion_main!(benches);
