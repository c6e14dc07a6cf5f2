//! One suite, run on every backend present: the simulated device always, CUDA when a GPU is.

mod common;

use common::{devices, pattern, sim, slow_sim};
use tidemem::device::{BackendKind, HostBuffer, HostKind};
use tidemem::{DType, Error};

#[test]
fn byte_exact_round_trips_for_many_sizes() {
    for dev in devices("byte_exact_round_trips_for_many_sizes") {
        let s = dev.new_stream().unwrap();
        for (i, len) in [
            0usize,
            1,
            3,
            255,
            4096,
            4097,
            65_537,
            (1 << 20) + 13,
            16 << 20,
        ]
        .into_iter()
        .enumerate()
        {
            let data = pattern(len, i as u64);
            let buf = dev.upload(&s, &data).unwrap();
            assert_eq!(buf.len(), len);
            assert_eq!(
                dev.download(&s, &buf).unwrap(),
                data,
                "{} len {len}",
                dev.id()
            );
        }
    }
}

#[test]
fn round_trip_through_every_host_tier() {
    let dir = tempfile::tempdir().unwrap();
    let store = tidemem::device::FileStore::new(dir.path()).unwrap();
    for dev in devices("round_trip_through_every_host_tier") {
        let s = dev.new_stream().unwrap();
        let len = 3 << 20;
        let data = pattern(len, 9);
        let buf = dev.alloc(len).unwrap();
        let mut tiers = vec![HostBuffer::paged(len).unwrap(), store.alloc(len).unwrap()];
        tiers.push(dev.alloc_host(len).unwrap());
        for mut h in tiers {
            let kind = h.kind();
            h.copy_from_slice(&data);
            let h = dev.copy_h2d(&s, h, &buf).unwrap().wait().unwrap();
            let out = dev
                .copy_d2h(&s, &buf, store.alloc(len).unwrap())
                .unwrap()
                .wait()
                .unwrap();
            assert_eq!(&out[..], &data[..], "{kind:?}");
            assert_eq!(h.kind(), kind);
        }
        let expect = if dev.kind() == BackendKind::Cuda {
            HostKind::Pinned
        } else {
            HostKind::Paged
        };
        assert_eq!(dev.alloc_host(16).unwrap().kind(), expect);
    }
}

#[test]
fn multi_gib_round_trip_on_gpu() {
    let Some(dev) = common::cuda("multi_gib_round_trip_on_gpu") else {
        return;
    };
    if common::is_emulated(&dev) {
        // 3 GiB of device memory is 3 GiB of host memory there, and the staged copy another.
        eprintln!("multi_gib_round_trip_on_gpu: skipping on the CUDA emulator (host memory)");
        return;
    }
    let s = dev.new_stream().unwrap();
    let len = (3usize << 30) + 4099;
    let data = pattern(len, 77);
    let buf = dev.upload(&s, &data).unwrap();
    assert!(dev.download(&s, &buf).unwrap() == data);
}

#[test]
fn ranged_copies_and_memmove() {
    for dev in devices("ranged_copies_and_memmove") {
        let s = dev.new_stream().unwrap();
        let data = pattern(1000, 5);
        let buf = dev.upload(&s, &data).unwrap();
        // Overlapping move within one buffer: bytes 0..600 to 100..700.
        dev.copy_d2d(&s, buf.view(0, 600).unwrap(), buf.view(100, 600).unwrap())
            .unwrap();
        let mut expect = data.clone();
        expect.copy_within(0..600, 100);
        assert_eq!(dev.download(&s, &buf).unwrap(), expect);
        // A range of the device buffer into a host buffer of the same size.
        let part = dev.download(&s, buf.view(250, 17).unwrap()).unwrap();
        assert_eq!(part, &expect[250..267]);
        dev.memset(&s, buf.view(10, 5).unwrap(), 0xAB).unwrap();
        expect[10..15].fill(0xAB);
        assert_eq!(dev.download(&s, &buf).unwrap(), expect);
    }
}

#[test]
fn out_of_memory_names_requested_free_and_capacity() {
    let dev = sim(10 << 20);
    let _a = dev.alloc(4 << 20).unwrap();
    let err = dev.alloc(7 << 20).unwrap_err();
    match &err {
        Error::OutOfMemory {
            requested,
            free,
            capacity,
            ..
        } => assert_eq!((*requested, *free, *capacity), (7 << 20, 6 << 20, 10 << 20)),
        other => panic!("expected OutOfMemory, got {other}"),
    }
    let msg = err.to_string();
    for n in ["7340032", "6291456", "10485760"] {
        assert!(msg.contains(n), "{msg}");
    }
    if let Some(gpu) = common::cuda("out_of_memory_names_requested_free_and_capacity") {
        let total = gpu.mem_info().unwrap().total;
        match gpu.alloc(total * 2) {
            Err(Error::OutOfMemory {
                requested,
                capacity,
                ..
            }) => {
                assert_eq!(requested, total * 2);
                assert_eq!(capacity, total);
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
    }
}

#[test]
fn mismatched_sizes_ranges_and_devices_are_typed_errors() {
    for dev in devices("mismatched_sizes_ranges_and_devices_are_typed_errors") {
        let s = dev.new_stream().unwrap();
        let a = dev.alloc(64).unwrap();
        let b = dev.alloc(32).unwrap();
        assert!(matches!(
            dev.copy_h2d(&s, HostBuffer::paged(63).unwrap(), &a),
            Err(Error::SizeMismatch { src: 63, dst: 64 })
        ));
        assert!(matches!(
            dev.copy_d2h(&s, &a, HostBuffer::paged(65).unwrap()),
            Err(Error::SizeMismatch { .. })
        ));
        assert!(matches!(
            dev.copy_d2d(&s, &a, &b),
            Err(Error::SizeMismatch { .. })
        ));
        assert!(matches!(a.view(60, 5), Err(Error::OutOfBounds { .. })));
        assert!(matches!(
            a.view(usize::MAX, 2),
            Err(Error::OutOfBounds { .. })
        ));
        // Handles of another device.
        let other = sim(1 << 20);
        let os = other.new_stream().unwrap();
        let ob = other.alloc(64).unwrap();
        let oe = other.new_event().unwrap();
        assert!(matches!(
            dev.copy_d2d(&s, &ob, &a),
            Err(Error::WrongDevice { what: "buffer", .. })
        ));
        assert!(matches!(
            dev.memset(&os, &a, 0),
            Err(Error::WrongDevice { what: "stream", .. })
        ));
        assert!(matches!(
            dev.record(&s, &oe),
            Err(Error::WrongDevice { what: "event", .. })
        ));
        // Typed operation on misaligned ranges.
        assert!(matches!(
            tidemem::ops::cast(
                &dev,
                &s,
                a.view(2, 8).unwrap(),
                DType::F32,
                b.view(0, 4).unwrap(),
                DType::F16
            ),
            Err(Error::Misaligned { .. })
        ));
        assert!(matches!(
            tidemem::ops::cast(
                &dev,
                &s,
                a.view(0, 16).unwrap(),
                DType::F32,
                a.view(8, 8).unwrap(),
                DType::F16
            ),
            Err(Error::Operands { .. })
        ));
        // Nothing above touched the device: both buffers are still usable.
        dev.sync_stream(&s).unwrap();
        assert_eq!(dev.download(&s, &a).unwrap().len(), 64);
    }
}

#[test]
fn an_event_orders_a_copy_after_another_streams_write() {
    for dev in [slow_sim(64 << 20)]
        .into_iter()
        .chain(common::cuda("events"))
    {
        let (up, down) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
        let len = 1 << 20;
        let data = pattern(len, 3);
        let src = dev.alloc(len).unwrap();
        let dst = dev.alloc(len).unwrap();
        let mut h = dev.alloc_host(len).unwrap();
        h.copy_from_slice(&data);
        let pending = dev.copy_h2d(&up, h, &src).unwrap();
        // Without a wait, the other stream may not read what `up` is still writing.
        let err = dev.copy_d2d(&down, &src, &dst).unwrap_err();
        assert!(matches!(err, Error::UnorderedAccess { .. }), "{err}");
        let ev = dev.new_event().unwrap();
        dev.record(&up, &ev).unwrap();
        dev.wait_event(&down, &ev).unwrap();
        dev.copy_d2d(&down, &src, &dst).unwrap();
        let out = dev
            .copy_d2h(&down, &dst, dev.alloc_host(len).unwrap())
            .unwrap();
        assert_eq!(&out.wait().unwrap()[..], &data[..]);
        drop(pending);
        // The copy stream's writes are now visible to the host-ordered world.
        assert_eq!(dev.download(&down, &src).unwrap(), data);
    }
}

#[test]
fn events_report_completion() {
    for dev in [slow_sim(8 << 20)]
        .into_iter()
        .chain(common::cuda("events_report_completion"))
    {
        let s = dev.new_stream().unwrap();
        let ev = dev.new_event().unwrap();
        assert!(
            dev.event_done(&ev).unwrap(),
            "an unrecorded event is complete"
        );
        let buf = dev.alloc(4 << 20).unwrap();
        let p = dev
            .copy_h2d(&s, dev.alloc_host(4 << 20).unwrap(), &buf)
            .unwrap();
        dev.record(&s, &ev).unwrap();
        if dev.kind() == BackendKind::Sim {
            // 4 MiB at 0.5 GB/s takes ~8 ms: not done yet.
            assert!(!dev.event_done(&ev).unwrap());
            assert!(!p.is_ready().unwrap());
        }
        dev.sync_event(&ev).unwrap();
        assert!(dev.event_done(&ev).unwrap());
        assert!(p.is_ready().unwrap());
        p.wait().unwrap();
    }
}

#[test]
fn dropping_a_pending_copy_or_buffer_in_flight_is_safe() {
    let dev = slow_sim(16 << 20);
    let s = dev.new_stream().unwrap();
    let buf = dev.alloc(4 << 20).unwrap();
    let p = dev
        .copy_h2d(
            &s,
            HostBuffer::from_slice(&pattern(4 << 20, 1)).unwrap(),
            &buf,
        )
        .unwrap();
    drop(buf); // freed once the queued copy is done
    drop(p); // blocks until the copy completes, then frees the host buffer
    dev.sync_stream(&s).unwrap();
    assert_eq!(dev.mem_info().unwrap().free, 16 << 20);
}

#[test]
fn cast_matches_the_cpu_twin_for_every_pair() {
    let n = 10_007;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.37).sin() * 10f32.powi((i % 13) as i32 - 6))
        .collect();
    for dev in devices("cast_matches_the_cpu_twin_for_every_pair") {
        let s = dev.new_stream().unwrap();
        let src = dev.upload(&s, bytemuck::cast_slice(&x)).unwrap();
        for t in [DType::F16, DType::BF16] {
            let narrow = dev.alloc(n * 2).unwrap();
            tidemem::ops::cast(&dev, &s, &src, DType::F32, &narrow, t).unwrap();
            let got = dev.download(&s, &narrow).unwrap();
            let mut want = vec![0u8; n * 2];
            tidemem::ops::cast_bytes(bytemuck::cast_slice(&x), DType::F32, &mut want, t).unwrap();
            assert_eq!(got, want, "{} f32->{t}", dev.id());
            // and back up, and across
            let wide = dev.alloc(n * 4).unwrap();
            tidemem::ops::cast(&dev, &s, &narrow, t, &wide, DType::F32).unwrap();
            let mut want_wide = vec![0u8; n * 4];
            tidemem::ops::cast_bytes(&want, t, &mut want_wide, DType::F32).unwrap();
            assert_eq!(dev.download(&s, &wide).unwrap(), want_wide);
            let other = if t == DType::F16 {
                DType::BF16
            } else {
                DType::F16
            };
            let across = dev.alloc(n * 2).unwrap();
            tidemem::ops::cast(&dev, &s, &narrow, t, &across, other).unwrap();
            let mut want_across = vec![0u8; n * 2];
            tidemem::ops::cast_bytes(&want, t, &mut want_across, other).unwrap();
            assert_eq!(dev.download(&s, &across).unwrap(), want_across);
        }
    }
}

#[test]
fn transfer_stats_count_bytes() {
    for dev in devices("transfer_stats_count_bytes") {
        let s = dev.new_stream().unwrap();
        let before = dev.stats();
        let a = dev.upload(&s, &[1u8; 1000]).unwrap();
        let b = dev.alloc(1000).unwrap();
        dev.copy_d2d(&s, &a, &b).unwrap();
        let _ = dev.download(&s, &b).unwrap();
        let st = dev.stats();
        assert_eq!(st.h2d_bytes - before.h2d_bytes, 1000);
        assert_eq!(st.d2d_bytes - before.d2d_bytes, 1000);
        assert_eq!(st.d2h_bytes - before.d2h_bytes, 1000);
        assert_eq!(st.h2d_copies - before.h2d_copies, 1);
    }
}

/// Every operation counts once on every backend, and a wait counts as blocking only when it
/// waits for work the host has not seen finish: the counts a step is judged by.
#[test]
fn the_counters_count_each_operation_and_only_the_waits_that_block() {
    use tidemem::device::DeviceStats;
    use tidemem::ops::{self, Gemm};
    for dev in devices("the_counters_count_each_operation_and_only_the_waits_that_block") {
        let s = dev.new_stream().unwrap();
        let before = dev.stats();
        let a = dev.alloc(1024).unwrap();
        let p = dev
            .copy_h2d(&s, HostBuffer::from_slice(&[0u8; 1024]).unwrap(), &a)
            .unwrap();
        dev.memset(&s, &a, 0).unwrap();
        ops::scale(&dev, &s, 2.0, &a, DType::F32).unwrap();
        p.wait().unwrap(); // the copy: blocks
        dev.sync_stream(&s).unwrap(); // the fill and the scale after it: blocks
        dev.sync_stream(&s).unwrap(); // all seen: returns at once
        let e = dev.new_event().unwrap();
        dev.record(&s, &e).unwrap();
        dev.sync_event(&e).unwrap(); // nothing new on the stream: returns at once
        if ops::cublas_available() || dev.kind() == BackendKind::Sim {
            let g = Gemm::new(4, 4, 4);
            let v = |i: usize| a.view(i * 64, 64).unwrap();
            ops::gemm(&dev, &s, &g, v(0), v(1), v(2), DType::F32).unwrap();
        }
        dev.record(&s, &e).unwrap();
        dev.sync_event(&e).unwrap(); // the GEMM: blocks
        let back = dev.download(&s, &a).unwrap(); // a new copy: blocks
        assert_eq!(back.len(), 1024);
        let gemm = u64::from(ops::cublas_available() || dev.kind() == BackendKind::Sim);
        let got = dev.stats().since(&before);
        let want = DeviceStats {
            h2d_bytes: 1024,
            d2h_bytes: 1024,
            h2d_copies: 1,
            d2h_copies: 1,
            launches: 1,
            library_calls: gemm,
            fills: 1,
            device_allocs: 1,
            stream_syncs: 1,
            event_syncs: 1,
            pending_waits: 2,
            ..DeviceStats::default()
        };
        assert_eq!(got, want, "{}", dev.name());
        assert_eq!(got.blocking_waits(), 4);
        // a copy a query saw finish, and an event seen done, do not block their waits
        let p = dev
            .copy_h2d(
                &s,
                HostBuffer::from_slice(&[0u8; 64]).unwrap(),
                a.view(0, 64).unwrap(),
            )
            .unwrap();
        while !p.is_ready().unwrap() {
            std::thread::yield_now();
        }
        ops::scale(&dev, &s, 2.0, a.view(64, 64).unwrap(), DType::F32).unwrap();
        dev.record(&s, &e).unwrap();
        while !dev.event_done(&e).unwrap() {
            std::thread::yield_now();
        }
        let before = dev.stats();
        p.wait().unwrap();
        dev.sync_event(&e).unwrap();
        dev.sync_stream(&s).unwrap();
        assert_eq!(
            dev.stats().since(&before).blocking_waits(),
            0,
            "{}",
            dev.name()
        );
    }
}

/// Copies nobody waits for land (a later wait sees them), and a program that uploads without
/// ever waiting holds at most 256 of their host buffers: past that each upload waits for the
/// oldest.
#[test]
fn detached_uploads_land_and_stay_bounded() {
    for dev in devices("detached_uploads_land_and_stay_bounded") {
        let s = dev.new_stream().unwrap();
        let buf = dev.alloc(300 * 8).unwrap();
        let before = dev.stats();
        for i in 0..300u64 {
            let v = buf.view(i as usize * 8, 8).unwrap();
            dev.upload_to(&s, &i.to_le_bytes(), v).unwrap();
        }
        let st = dev.stats().since(&before);
        assert_eq!(
            (st.h2d_copies, st.event_syncs),
            (300, 300 - 256),
            "{}",
            dev.name()
        );
        let back = dev.download(&s, &buf).unwrap();
        let want: Vec<u8> = (0..300u64).flat_map(|i| i.to_le_bytes()).collect();
        assert_eq!(back, want, "{}", dev.name());
        assert!(dev
            .upload_to(&s, &[0u8; 4], buf.view(0, 8).unwrap())
            .is_err());
    }
}

#[test]
fn default_device_follows_the_environment() {
    // Only checks the variable parsing path that needs no GPU.
    std::env::set_var("TIDEMEM_BACKEND", "sim");
    std::env::set_var("TIDEMEM_SIM_CAPACITY", "3MiB");
    let dev = tidemem::device::Device::default_device().unwrap();
    assert_eq!(dev.kind(), BackendKind::Sim);
    assert_eq!(dev.mem_info().unwrap().total, 3 << 20);
    std::env::set_var("TIDEMEM_BACKEND", "tpu");
    assert!(matches!(
        tidemem::device::Device::default_device(),
        Err(Error::Parse {
            what: "TIDEMEM_BACKEND",
            ..
        })
    ));
    std::env::remove_var("TIDEMEM_BACKEND");
    std::env::remove_var("TIDEMEM_SIM_CAPACITY");
}

#[test]
fn cuda_absence_is_an_error_not_a_panic() {
    match tidemem::device::Device::cuda(0) {
        Ok(d) => eprintln!("CUDA present: {}", d.name()),
        Err(Error::BackendUnavailable { kind, reason }) => {
            assert_eq!(kind, BackendKind::Cuda);
            assert!(!reason.is_empty());
        }
        Err(e) => panic!("unexpected error kind: {e}"),
    }
    // An ordinal past the end is also an error on any machine.
    assert!(tidemem::device::Device::cuda(4096).is_err());
}
