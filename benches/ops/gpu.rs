//! The GPU mode: every kernel entry launched on CUDA device 0 through `Device::launch`, against
//! `Device::copy_d2d` of the same bytes (half read, half written). Skipped, with a message,
//! without a CUDA device and on the CPU emulator (`cuda-emu`), whose timings mean nothing.

use std::time::Instant;

use tidemem::device::{Device, DeviceBuffer, Operand, Stream};
use tidemem::{DType, Result};

use crate::entry::{median, Arg, Kernel, Work};
use crate::Config;

/// Whether `dev` is the CPU stand-in for the CUDA driver (`cuda-emu`); the same test as
/// `tests/common`'s `is_emulated`.
fn is_emulated(dev: &Device) -> bool {
    dev.name().contains("CUDA emulator")
}

/// CUDA device 0 when it is a real GPU, or `None` after printing why the GPU mode is skipped.
fn real_gpu() -> Option<Device> {
    match Device::cuda(0) {
        Ok(dev) if is_emulated(&dev) => {
            println!(
                "ops gpu: skipped: the CUDA device is the CPU emulator ({}), not a GPU",
                dev.name()
            );
            None
        }
        Ok(dev) => Some(dev),
        Err(e) => {
            println!("ops gpu: skipped: no CUDA GPU ({e})");
            None
        }
    }
}

/// A kernel's operands on the device: buffer, element type, and whether the kernel writes it.
type Uploaded = Vec<Option<(DeviceBuffer, DType, bool)>>;

fn upload(dev: &Device, s: &Stream, k: &Kernel) -> Result<Uploaded> {
    k.args
        .iter()
        .map(|a| match a {
            Arg::Read(b, d) => Ok(Some((dev.upload(s, b)?, *d, false))),
            Arg::Write(b, d) => Ok(Some((dev.upload(s, b)?, *d, true))),
            Arg::Absent => Ok(None),
        })
        .collect()
}

/// Medians of `reps` interleaved repetitions, each a `copy_d2d` of `bytes / 2` bytes then one
/// launch of `k`, each followed by a synchronisation of the stream: (op, copy) seconds.
fn time(dev: &Device, s: &Stream, k: &Kernel, bytes: usize, reps: usize) -> Result<(f64, f64)> {
    let bufs = upload(dev, s, k)?;
    let operands: Vec<Option<Operand<'_>>> = bufs
        .iter()
        .map(|o| {
            o.as_ref().map(|(b, d, written)| {
                if *written {
                    Operand::new(b, *d)
                } else {
                    Operand::input(b, *d)
                }
            })
        })
        .collect();
    let half = bytes / 2;
    let src = dev.upload(s, &vec![1u8; half])?;
    let dst = dev.alloc(half)?;
    let launch = || -> Result<()> {
        dev.launch(s, k.desc, &operands, &k.params)?;
        dev.sync_stream(s)
    };
    let copy = || -> Result<()> {
        dev.copy_d2d(s, &src, &dst)?;
        dev.sync_stream(s)
    };
    // The first launch compiles the kernel (NVRTC); neither first run is timed.
    launch()?;
    copy()?;
    let (mut tc, mut to) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for _ in 0..reps {
        let t0 = Instant::now();
        copy()?;
        tc.push(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        launch()?;
        to.push(t0.elapsed().as_secs_f64());
    }
    Ok((median(to), median(tc)))
}

/// Every kernel entry at `[cfg.gpu_rows, cfg.cols]`, printed as GB/s and
/// `GPU fraction = op bytes/s ÷ d2d bytes/s` (target ≥ 0.8).
pub fn bench(cfg: &Config) {
    let Some(dev) = real_gpu() else {
        return;
    };
    let s = match dev.new_stream() {
        Ok(s) => s,
        Err(e) => {
            println!("ops gpu: skipped: no stream ({e})");
            return;
        }
    };
    let (rows, cols, reps) = (cfg.gpu_rows, cfg.cols, cfg.reps);
    println!(
        "\nops on the GPU ({}), [{rows}, {cols}] ({}), against copy_d2d of the same bytes \
         (half read, half written; target >= 0.8); medians of {reps} interleaved repetitions, \
         each op and copy synchronised with the stream",
        dev.name(),
        if rows == 4 * cfg.rows {
            "rows x 4: the CPU shape is too small to time on a GPU"
        } else {
            "rows from TIDEMEM_BENCH_OPS_GPU_ROWS"
        }
    );
    for e in crate::entries(rows, cols)
        .into_iter()
        .filter(|e| e.name.contains(&cfg.filter))
    {
        let Work::Kernel(k) = &e.work else {
            println!("{:<32} host code, no kernel: CPU only", e.name);
            continue;
        };
        match time(&dev, &s, k, e.bytes, reps) {
            Ok((op, copy)) => {
                let gbs = |t: f64| e.bytes as f64 / t / 1e9;
                println!(
                    "{:<32} {:>10} B  op {:>7.1} GB/s  d2d {:>7.1} GB/s  GPU fraction = {:.3}",
                    e.name,
                    e.bytes,
                    gbs(op),
                    gbs(copy),
                    copy / op
                );
            }
            Err(err) => println!("{:<32} failed: {err}", e.name),
        }
    }
}
