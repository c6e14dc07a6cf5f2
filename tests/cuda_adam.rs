//! `Device::adam` and `Device::grad_stats` against the CPU kernels they mirror.
//!
//! The simulated device runs the CPU kernel itself, so there every result must equal
//! `CpuAdam::new()` on the host bit for bit. The CUDA backend runs `kernels/adam.cu`: its
//! parameters must stay within 1e-6 (norm-wise, relative) of the host's after 20 steps, its
//! fp16/bf16 copies must be the rounding of its own parameters, and its gradient statistics must
//! be within 1e-9 of the host's and identical from run to run. The CUDA half skips with a printed
//! reason when there is no GPU (or no NVRTC to compile the kernels).

mod common;

use common::pattern;
use half::{bf16, f16};
use tidemem::device::{
    cuda_device_count, cuda_driver_present, Device, DeviceBuffer, SimConfig, Stream,
};
use tidemem::ops::{
    grad_stats_host as grad_stats, AdamScalars, CpuAdam, Grad, GradInPlace, GradStats, ParamCopy,
};
use tidemem::ops::{read_grad_stats, AdamOperands, GRAD_STATS_BYTES};
use tidemem::optim::AdamConfig;
use tidemem::rng::{Rng, SplitMix64};
use tidemem::DType;

const STEPS: u64 = 20;

fn sim() -> Device {
    Device::sim(SimConfig::with_capacity(512 << 20)).expect("sim device")
}

/// CUDA device 0, or `None` after printing why the test is skipped.
fn cuda(test: &str) -> Option<Device> {
    let required = std::env::var("TIDEMEM_REQUIRE_CUDA").as_deref() == Ok("1");
    assert!(
        !required || (cuda_driver_present() && cuda_device_count() > 0),
        "{test}: TIDEMEM_REQUIRE_CUDA=1 but there is no CUDA device"
    );
    if !cuda_driver_present() {
        eprintln!("{test}: skipping: no CUDA driver library on this machine");
        return None;
    }
    if cuda_device_count() == 0 {
        eprintln!("{test}: skipping: the CUDA driver reports no device");
        return None;
    }
    if !tidemem::kernels::nvrtc_available() {
        assert!(
            !required && !std::env::var("TIDEMEM_REQUIRE_NVRTC").is_ok_and(|v| v == "1"),
            "{test}: TIDEMEM_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded"
        );
        eprintln!("{test}: skipping: a GPU is present but NVRTC (libnvrtc) cannot be loaded");
        return None;
    }
    Some(Device::cuda(0).expect("CUDA device 0"))
}

/// Uniform in [-1, 1).
fn uniform(rng: &mut SplitMix64) -> f32 {
    rng.uniform_f32(-1.0, 1.0)
}

/// A gradient in its element type.
#[derive(Clone, Debug)]
enum GradVec {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl GradVec {
    fn from_f32(dtype: DType, x: &[f32]) -> Self {
        match dtype {
            DType::F32 => GradVec::F32(x.to_vec()),
            DType::F16 => GradVec::F16(x.iter().map(|&v| f16::from_f32(v)).collect()),
            DType::BF16 => GradVec::Bf16(x.iter().map(|&v| bf16::from_f32(v)).collect()),
            other => panic!("no gradients of {other}"),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            GradVec::F32(g) => bytemuck::cast_slice(g),
            GradVec::F16(g) => bytemuck::cast_slice(g),
            GradVec::Bf16(g) => bytemuck::cast_slice(g),
        }
    }

    fn grad(&self) -> Grad<'_> {
        match self {
            GradVec::F32(g) => Grad::F32(g),
            GradVec::F16(g) => Grad::F16(g),
            GradVec::Bf16(g) => Grad::Bf16(g),
        }
    }
}

/// Where the fp16/bf16 copy of the new parameters goes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum CopyMode {
    None,
    /// A range of its own.
    Separate(DType),
    /// The gradient's range (the gradient is replaced).
    InPlace,
}

/// How the operands are spread over device buffers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    /// Parameters, momentum and variance in one buffer, the gradient in a second, the copy in a
    /// third.
    Split,
    /// Every operand in one buffer.
    OneBuffer,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    cfg: AdamConfig,
    grad: DType,
    copy: CopyMode,
    n: usize,
    layout: Layout,
}

impl Case {
    /// fp16/bf16 gradients carry a loss scale of 256.
    fn grad_scale(&self) -> f32 {
        if self.grad == DType::F32 {
            0.5
        } else {
            1.0 / 256.0
        }
    }

    fn copy_dtype(&self) -> Option<DType> {
        match self.copy {
            CopyMode::None => None,
            CopyMode::Separate(d) => Some(d),
            CopyMode::InPlace => Some(self.grad),
        }
    }

    fn initial_state(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut rng = SplitMix64::new(self.n as u64 * 31 + 7);
        let p = (0..self.n).map(|_| uniform(&mut rng)).collect();
        let m = (0..self.n).map(|_| uniform(&mut rng) * 1e-2).collect();
        let v = (0..self.n)
            .map(|_| uniform(&mut rng).abs() * 1e-3)
            .collect();
        (p, m, v)
    }

    /// The gradient of `step` (unscaled values times the loss scale, then rounded to the type).
    fn gradient(&self, step: u64) -> GradVec {
        let mut rng = SplitMix64::new(step * 1_000_003 + self.n as u64);
        let g: Vec<f32> = (0..self.n)
            .map(|i| {
                let x = uniform(&mut rng) * 4.0 / self.grad_scale() * 0.5;
                if i % 17 == 5 {
                    0.0
                } else {
                    x
                }
            })
            .collect();
        GradVec::from_f32(self.grad, &g)
    }
}

/// The state after the last step; the copy as raw 16-bit patterns.
#[derive(Debug, PartialEq)]
struct State {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    copy: Option<Vec<u16>>,
}

fn scalars(c: &Case, step: u64) -> AdamScalars {
    c.cfg.scalars(step, c.grad_scale()).unwrap()
}

/// `STEPS` steps of the host CPU kernel (`CpuAdam::new()`, as the simulated device runs it).
fn host_run(c: &Case) -> State {
    let adam = CpuAdam::new();
    let (mut p, mut m, mut v) = c.initial_state();
    let mut copy = c.copy_dtype().map(|_| vec![0u16; c.n]);
    for step in 1..=STEPS {
        let s = scalars(c, step);
        let mut g = c.gradient(step);
        match (c.copy, &mut g) {
            (CopyMode::InPlace, GradVec::F16(g)) => {
                adam.step_in_place(&s, &mut p, &mut m, &mut v, GradInPlace::F16(g))
                    .unwrap();
                copy = Some(bytemuck::cast_slice(g).to_vec());
            }
            (CopyMode::InPlace, GradVec::Bf16(g)) => {
                adam.step_in_place(&s, &mut p, &mut m, &mut v, GradInPlace::Bf16(g))
                    .unwrap();
                copy = Some(bytemuck::cast_slice(g).to_vec());
            }
            (CopyMode::InPlace, GradVec::F32(_)) => unreachable!("no fp32 copies"),
            (mode, g) => {
                let out = match (mode, copy.as_mut()) {
                    (CopyMode::Separate(DType::F16), Some(c)) => {
                        ParamCopy::F16(bytemuck::cast_slice_mut(c))
                    }
                    (CopyMode::Separate(DType::BF16), Some(c)) => {
                        ParamCopy::Bf16(bytemuck::cast_slice_mut(c))
                    }
                    _ => ParamCopy::None,
                };
                adam.step(&s, &mut p, &mut m, &mut v, g.grad(), out)
                    .unwrap();
            }
        }
    }
    State { p, m, v, copy }
}

/// Byte ranges of the operands: (buffer, offset, length) for parameters, momentum, variance,
/// gradient and copy (length 0 when there is no separate copy), and each buffer's length.
/// Offsets are odd multiples of the element size where the element size allows, with gaps
/// between ranges, so misplaced reads and writes show.
fn place(c: &Case) -> ([(usize, usize, usize); 5], [usize; 3]) {
    let gs = c.grad.size();
    let copy_len = match c.copy {
        CopyMode::Separate(d) => d.size() * c.n,
        _ => 0,
    };
    let items = [
        (4, 4 * c.n),
        (4, 4 * c.n),
        (4, 4 * c.n),
        (gs, gs * c.n),
        (2, copy_len),
    ];
    let buffer = match c.layout {
        Layout::Split => [0, 0, 0, 1, 2],
        Layout::OneBuffer => [0, 0, 0, 0, 0],
    };
    let mut ends = [0usize; 3];
    let mut out = [(0, 0, 0); 5];
    for (k, &(es, len)) in items.iter().enumerate() {
        let b = buffer[k];
        let gap = 4 * (2 * k + 1) + if es == 2 { 2 } else { 0 };
        let off = (ends[b] + gap).div_ceil(es) * es;
        out[k] = (b, off, len);
        ends[b] = off + len;
    }
    (out, ends.map(|e| e + 12))
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// `STEPS` steps on `dev`, with every operand uploaded once and a fresh gradient uploaded before
/// each step. Checks that no byte outside the operands changed.
fn device_run(dev: &Device, c: &Case) -> State {
    let s = dev.new_stream().unwrap();
    let (ranges, lens) = place(c);
    let (p, m, v) = c.initial_state();
    let mut images: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| pattern(l, i as u64 + 1))
        .collect();
    let original = images.clone();
    for (k, x) in [&p, &m, &v].into_iter().enumerate() {
        let (b, off, len) = ranges[k];
        images[b][off..off + len].copy_from_slice(bytemuck::cast_slice(x));
    }
    let bufs: Vec<DeviceBuffer> = images
        .iter()
        .map(|im| dev.upload(&s, im).unwrap())
        .collect();
    let view = |k: usize| {
        let (b, off, len) = ranges[k];
        bufs[b].view(off, len).unwrap()
    };
    for step in 1..=STEPS {
        let g = c.gradient(step);
        let mut host = dev.alloc_host(g.bytes().len()).unwrap();
        host.copy_from_slice(g.bytes());
        dev.copy_h2d(&s, host, view(3)).unwrap().wait().unwrap();
        let copy = match c.copy {
            CopyMode::None => None,
            CopyMode::Separate(d) => Some((view(4), d)),
            CopyMode::InPlace => Some((view(3), c.grad)),
        };
        let ops = AdamOperands {
            params: view(0),
            momentum: view(1),
            variance: view(2),
            grad: view(3),
            grad_dtype: c.grad,
            copy,
        };
        tidemem::ops::adam(dev, &s, &scalars(c, step), ops).unwrap();
    }
    let after: Vec<Vec<u8>> = bufs.iter().map(|b| dev.download(&s, b).unwrap()).collect();
    // every byte outside the written ranges is as uploaded
    for (b, (now, was)) in after.iter().zip(&original).enumerate() {
        for (i, (x, y)) in now.iter().zip(was).enumerate() {
            let inside = ranges
                .iter()
                .any(|&(rb, off, len)| rb == b && (off..off + len).contains(&i));
            assert!(inside || x == y, "{c:?}: byte {i} of buffer {b} changed");
        }
    }
    let bytes = |k: usize| {
        let (b, off, len) = ranges[k];
        &after[b][off..off + len]
    };
    let copy = match c.copy {
        CopyMode::None => None,
        CopyMode::Separate(_) => Some(u16s(bytes(4))),
        CopyMode::InPlace => Some(u16s(bytes(3))),
    };
    State {
        p: f32s(bytes(0)),
        m: f32s(bytes(1)),
        v: f32s(bytes(2)),
        copy,
    }
}

fn cases() -> Vec<Case> {
    let adam = AdamConfig {
        weight_decay: 0.01,
        ..AdamConfig::adam(1e-3)
    };
    let adamw = AdamConfig::adamw(1e-3, 0.1);
    let mut v = Vec::new();
    for cfg in [adam, adamw] {
        for grad in [DType::F32, DType::F16, DType::BF16] {
            let mut copies = vec![
                CopyMode::None,
                CopyMode::Separate(DType::F16),
                CopyMode::Separate(DType::BF16),
            ];
            if grad != DType::F32 {
                copies.push(CopyMode::InPlace);
            }
            for copy in copies {
                for layout in [Layout::Split, Layout::OneBuffer] {
                    for n in [1usize, 31, 5003] {
                        v.push(Case {
                            cfg,
                            grad,
                            copy,
                            n,
                            layout,
                        });
                    }
                }
            }
        }
    }
    // Long enough for several threads on the host and a grid-stride loop on a GPU.
    for (grad, copy) in [
        (DType::F32, CopyMode::None),
        (DType::F16, CopyMode::InPlace),
        (DType::BF16, CopyMode::Separate(DType::F16)),
    ] {
        v.push(Case {
            cfg: adamw,
            grad,
            copy,
            n: (1 << 20) + 3,
            layout: Layout::OneBuffer,
        });
    }
    v
}

/// ‖a − b‖ / ‖b‖.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

fn differing_bits(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// The fp16/bf16 rounding of `p` (round to nearest even), as bits.
fn rounded(p: &[f32], dtype: DType) -> Vec<u16> {
    p.iter()
        .map(|&x| match dtype {
            DType::F16 => f16::from_f32(x).to_bits(),
            _ => bf16::from_f32(x).to_bits(),
        })
        .collect()
}

#[test]
fn sim_adam_equals_the_host_cpu_kernel_bitwise() {
    let dev = sim();
    for c in cases() {
        let want = host_run(&c);
        let got = device_run(&dev, &c);
        assert!(
            got == want,
            "{c:?}: the simulated device differs from CpuAdam::new() ({} of {} parameters)",
            differing_bits(&got.p, &want.p),
            c.n
        );
    }
}

#[test]
fn cuda_adam_matches_the_host_cpu_kernel() {
    let Some(dev) = cuda("cuda_adam_matches_the_host_cpu_kernel") else {
        return;
    };
    let isa = CpuAdam::new().isa();
    let (mut worst, mut bitwise, mut total) = (0f64, 0usize, 0usize);
    for c in cases() {
        let want = host_run(&c);
        let got = device_run(&dev, &c);
        for (what, a, b) in [
            ("parameters", &got.p, &want.p),
            ("momentum", &got.m, &want.m),
            ("variance", &got.v, &want.v),
        ] {
            let e = rel_err(a, b);
            assert!(
                e <= 1e-6,
                "{c:?}: {what} differ by {e:e} (relative, norm-wise)"
            );
            worst = worst.max(e);
        }
        if let (Some(copy), Some(d)) = (&got.copy, c.copy_dtype()) {
            assert_eq!(
                copy,
                &rounded(&got.p, d),
                "{c:?}: the copy is not the rounding of the parameters"
            );
        }
        let same = got == want;
        if !same {
            eprintln!(
                "{c:?}: not bitwise: {} of {} parameters differ",
                differing_bits(&got.p, &want.p),
                c.n
            );
        }
        bitwise += same as usize;
        total += 1;
    }
    eprintln!(
        "CUDA Adam vs CpuAdam ({}): {bitwise} of {total} cases bitwise equal; worst relative \
         error {worst:.2e}",
        isa.name()
    );
}

#[test]
fn empty_adam_steps_change_nothing() {
    let mut devs = vec![sim()];
    devs.extend(cuda("empty_adam_steps_change_nothing"));
    for dev in devs {
        let s = dev.new_stream().unwrap();
        let img = pattern(64, 3);
        let buf = dev.upload(&s, &img).unwrap();
        let sc = AdamConfig::adam(1e-3).scalars(1, 1.0).unwrap();
        let ops = AdamOperands {
            params: buf.view(4, 0).unwrap(),
            momentum: buf.view(8, 0).unwrap(),
            variance: buf.view(12, 0).unwrap(),
            grad: buf.view(16, 0).unwrap(),
            grad_dtype: DType::F16,
            copy: Some((buf.view(16, 0).unwrap(), DType::F16)),
        };
        tidemem::ops::adam(&dev, &s, &sc, ops).unwrap();
        assert_eq!(dev.download(&s, &buf).unwrap(), img, "{}", dev.id());
    }
}

/// Gradient values of `dtype` at `off` elements into a buffer, stats written at byte 8 of a
/// second buffer pre-filled with 0xff; returns the result and checks the bytes around the output
/// range are untouched.
fn device_stats(dev: &Device, s: &Stream, g: &GradVec, dtype: DType) -> (GradStats, [u8; 16]) {
    let off = 3 * dtype.size();
    let mut img = pattern(off + g.bytes().len() + 6, 5);
    img[off..off + g.bytes().len()].copy_from_slice(g.bytes());
    let src = dev.upload(s, &img).unwrap();
    let out = dev.upload(s, &vec![0xffu8; GRAD_STATS_BYTES + 32]).unwrap();
    tidemem::ops::grad_stats(
        dev,
        s,
        src.view(off, g.bytes().len()).unwrap(),
        dtype,
        out.view(8, GRAD_STATS_BYTES).unwrap(),
    )
    .unwrap();
    let back = dev.download(s, &out).unwrap();
    assert!(
        back[..8].iter().all(|&b| b == 0xff),
        "bytes before the output changed"
    );
    assert!(
        back[8 + GRAD_STATS_BYTES..].iter().all(|&b| b == 0xff),
        "bytes after the output changed"
    );
    assert_eq!(dev.download(s, &src).unwrap(), img, "the source changed");
    let raw: [u8; 16] = back[8..24].try_into().unwrap();
    (read_grad_stats(&raw).unwrap(), raw)
}

fn stat_inputs(dtype: DType) -> Vec<(String, GradVec)> {
    let mut v = Vec::new();
    for n in [0usize, 1, 255, 256, 257, 100_003, (1 << 22) + 5] {
        let mut rng = SplitMix64::new(n as u64 + 11);
        let x: Vec<f32> = (0..n).map(|_| uniform(&mut rng) * 1000.0).collect();
        v.push((format!("{dtype} n={n}"), GradVec::from_f32(dtype, &x)));
        if n >= 256 {
            let mut inf = x.clone();
            inf[n / 2] = f32::INFINITY;
            v.push((format!("{dtype} n={n} inf"), GradVec::from_f32(dtype, &inf)));
            let mut nan = x.clone();
            nan[n - 1] = f32::NAN;
            v.push((format!("{dtype} n={n} nan"), GradVec::from_f32(dtype, &nan)));
            let mut big = x;
            // finite, but its square overflows f32 (not f64)
            big[7] = match dtype {
                DType::F32 => f32::MAX,
                DType::F16 => 65504.0,
                DType::BF16 => bf16::MAX.to_f32(),
                other => panic!("no gradients of {other}"),
            };
            v.push((format!("{dtype} n={n} max"), GradVec::from_f32(dtype, &big)));
        }
    }
    v
}

#[test]
fn sim_grad_stats_equal_the_host() {
    let dev = sim();
    let s = dev.new_stream().unwrap();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (what, g) in stat_inputs(dtype) {
            let want = grad_stats(g.grad());
            let (got, _) = device_stats(&dev, &s, &g, dtype);
            assert_eq!(got.sum_sq.to_bits(), want.sum_sq.to_bits(), "{what}");
            assert_eq!(got.nonfinite, want.nonfinite, "{what}");
            assert_eq!(
                want.nonfinite,
                what.ends_with("inf") || what.ends_with("nan"),
                "{what}"
            );
        }
    }
}

#[test]
fn cuda_grad_stats_are_the_hosts_bits_and_repeat_exactly() {
    let Some(dev) = cuda("cuda_grad_stats_are_the_hosts_bits_and_repeat_exactly") else {
        return;
    };
    let s = dev.new_stream().unwrap();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (what, g) in stat_inputs(dtype) {
            let want = grad_stats(g.grad());
            let (got, raw) = device_stats(&dev, &s, &g, dtype);
            assert_eq!(got.nonfinite, want.nonfinite, "{what}");
            // the host sums in the kernel's order: the same bits (a NaN's payload aside)
            if !want.nonfinite {
                assert_eq!(
                    got.sum_sq.to_bits(),
                    want.sum_sq.to_bits(),
                    "{what}: sum of squares {} vs {}",
                    got.sum_sq,
                    want.sum_sq
                );
            }
            let (_, again) = device_stats(&dev, &s, &g, dtype);
            assert_eq!(raw, again, "{what}: a second run gave other bits");
        }
    }
}
