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

use tidemem::device::{CachingAllocator, Device, FileStore, LinkModel, SimConfig};
use tidemem::units::fmt_bytes;
use tidemem::{DType, Result};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<()> {
    let chunks = arg("--chunks", 12);
    let chunk_elems = arg("--chunk-mib", 16) << 18; // MiB of fp32
    let dev = if std::env::args().any(|a| a == "--pcie") {
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
    let dir = std::env::temp_dir().join("tidemem-device-tour");
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
