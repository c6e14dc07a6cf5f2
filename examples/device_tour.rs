//! A tour of the device layer on the default backend (CUDA when a GPU is present, else the
//! simulated device): stream chunks of fp32 "master parameters" through two device slots,
//! overlapping the upload of chunk i+1 (copy stream) with the fp32→fp16 cast of chunk i
//! (compute stream), ordered by events; check every result against the CPU twin; then show the
//! non-model allocator's peaks and a round trip through the file-backed tier.
//!
//! ```text
//! cargo run --release --example device_tour -- [--chunks N] [--chunk-mib M] [--pcie]
//! ```
//! `--pcie` gives the simulated device a PCIe 5.0-like link model.

use std::time::Instant;

use clap::Parser;
use tidemem::device::{CachingAllocator, Device, FileStore, LinkModel, SimConfig};
use tidemem::units::fmt_bytes;
use tidemem::{DType, Result};

/// A tour of the device layer: chunks streamed through two device slots, the copy of one
/// overlapping the cast of the other, checked against the CPU; the non-model pool's peaks;
/// a round trip through the file tier.
#[derive(Parser)]
struct Args {
    /// Chunks of fp32 master parameters to stream (at least 2)
    #[arg(long, default_value_t = 12)]
    chunks: usize,
    /// MiB of fp32 a chunk (at least 1)
    #[arg(long, default_value_t = 16)]
    chunk_mib: usize,
    /// Give the simulated device a PCIe 5.0-like link model
    #[arg(long)]
    pcie: bool,
    /// The file tier's directory (default: a new temporary directory, removed at the end)
    #[arg(long)]
    file_dir: Option<std::path::PathBuf>,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("device_tour: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.chunks < 2 {
        return Err(tidemem::Error::TooFew {
            what: "--chunks: chunks streamed through two device slots".into(),
            got: args.chunks,
            need: 2,
        });
    }
    if args.chunk_mib == 0 {
        return Err(tidemem::Error::TooFew {
            what: "--chunk-mib: MiB of fp32 a chunk".into(),
            got: 0,
            need: 1,
        });
    }
    let chunks = args.chunks;
    // MiB of fp32, within what the host holds
    let chunk_elems = args.chunk_mib << 18;
    tidemem::limits::host_bytes(
        || format!("--chunks {chunks} --chunk-mib {}", args.chunk_mib),
        &[chunks, chunk_elems, 4],
    )?;
    let dev = if args.pcie {
        Device::sim(SimConfig::with_capacity(1 << 30).link(LinkModel::pcie5()))?
    } else {
        Device::default_device()?
    };
    let info = dev.mem_info()?;
    println!("device   {} — {}", dev.id(), dev.name());
    println!(
        "memory   {} free of {}",
        fmt_bytes(info.free as u64),
        fmt_bytes(info.total as u64)
    );

    // Model data on the host: `chunks` chunks of fp32, pinned where the backend can pin.
    let mut host = Vec::with_capacity(chunks);
    for c in 0..chunks {
        let mut h = dev.alloc_host(chunk_elems * 4)?;
        for (i, x) in h.typed_mut::<f32>()?.iter_mut().enumerate() {
            *x = ((c * chunk_elems + i) as f32 * 1e-3).sin();
        }
        host.push(Some(h));
    }

    // Two device slots for fp32 chunks, one fp16 output per slot.
    let copy = dev.new_stream()?;
    let compute = dev.new_stream()?;
    let slots = [dev.alloc(chunk_elems * 4)?, dev.alloc(chunk_elems * 4)?];
    let outs = [dev.alloc(chunk_elems * 2)?, dev.alloc(chunk_elems * 2)?];
    let uploaded = [dev.new_event()?, dev.new_event()?];
    let consumed = [dev.new_event()?, dev.new_event()?];
    let mut uploads = Vec::new();
    let mut downloads = Vec::new();

    let t0 = Instant::now();
    for (c, chunk) in host.iter_mut().enumerate() {
        let k = c % 2;
        // The copy stream may overwrite slot k only after the cast of chunk c-2 read it.
        dev.wait_event(&copy, &consumed[k])?;
        let h = chunk.take().expect("each chunk uploaded once");
        uploads.push((c, dev.copy_h2d(&copy, h, &slots[k])?));
        dev.record(&copy, &uploaded[k])?;
        // The compute stream casts chunk c once its upload is done…
        dev.wait_event(&compute, &uploaded[k])?;
        tidemem::ops::cast(&dev, &compute, &slots[k], DType::F32, &outs[k], DType::F16)?;
        dev.record(&compute, &consumed[k])?;
        // …and sends the fp16 copy back.
        downloads.push((
            c,
            dev.copy_d2h(&compute, &outs[k], dev.alloc_host(chunk_elems * 2)?)?,
        ));
    }
    for (c, p) in uploads {
        host[c] = Some(p.wait()?);
    }
    let mut checked = 0usize;
    for (c, p) in downloads {
        let got = p.wait()?;
        let src = host[c].as_ref().expect("returned above");
        let mut want = vec![0u8; chunk_elems * 2];
        tidemem::ops::cast_bytes(src, DType::F32, &mut want, DType::F16)?;
        assert_eq!(&got[..], &want[..], "chunk {c} differs from the CPU twin");
        checked += 1;
    }
    let secs = t0.elapsed().as_secs_f64();
    let st = dev.stats();
    println!(
        "pipeline {checked} chunks of {} checked against the CPU twin in {:.1} ms",
        fmt_bytes((chunk_elems * 4) as u64),
        secs * 1e3
    );
    println!(
        "moved    h2d {} ({:.2} GB/s) · d2h {} · {} + {} copies",
        fmt_bytes(st.h2d_bytes),
        st.h2d_bytes as f64 / secs / 1e9,
        fmt_bytes(st.d2h_bytes),
        st.h2d_copies,
        st.d2h_copies
    );

    // Non-model data: activations come and go; the tide tracer reads the peak per moment.
    let pool = CachingAllocator::new(dev.clone());
    for moment in 0..4 {
        let acts: Vec<_> = (0..=moment)
            .map(|_| pool.alloc(3 << 20))
            .collect::<Result<_>>()?;
        let s = pool.stats();
        println!(
            "moment {moment}  non-model peak {} (reserved {}, cache hits {})",
            fmt_bytes(s.peak_allocated as u64),
            fmt_bytes(s.reserved as u64),
            s.cache_hits
        );
        drop(acts);
        pool.reset_peak();
    }

    // The file-backed tier: spill a chunk to an unlinked mapped file and bring it back.
    let scratch = tempfile::tempdir().map_err(|source| tidemem::Error::Io {
        during: "making a temporary directory",
        source,
    })?;
    let dir = args
        .file_dir
        .unwrap_or_else(|| scratch.path().to_path_buf());
    let store = FileStore::new(&dir)?;
    let mut spilled = store.alloc(chunk_elems * 4)?;
    let back = dev.copy_d2h(&copy, &slots[0], spilled)?;
    spilled = back.wait()?;
    let again = dev.upload(&copy, &spilled)?;
    assert_eq!(
        dev.download(&copy, &again)?,
        dev.download(&copy, &slots[0])?
    );
    println!(
        "file tier round trip of {} through {}",
        fmt_bytes(spilled.len() as u64),
        dir.display()
    );
    Ok(())
}
