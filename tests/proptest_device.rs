//! Property tests of the device layer against a shadow model.

mod common;

use proptest::prelude::*;
use tidemem::device::{Device, Event, HostBuffer, LinkModel, Pending, SimConfig, Stream};
use tidemem::Error;

const CAP: usize = 256 << 10;

#[derive(Clone, Debug)]
enum Step {
    Alloc(usize),
    Free(usize),
    Upload {
        buf: usize,
        stream: usize,
        seed: u64,
    },
    CopyWithin {
        src: usize,
        dst: usize,
        stream: usize,
    },
    Memset {
        buf: usize,
        stream: usize,
        value: u8,
    },
    Check(usize),
    WaitPending,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0usize..96 << 10).prop_map(Step::Alloc),
        1 => any::<usize>().prop_map(Step::Free),
        4 => (any::<usize>(), 0usize..3, any::<u64>()).prop_map(|(buf, stream, seed)| Step::Upload { buf, stream, seed }),
        2 => (any::<usize>(), any::<usize>(), 0usize..3).prop_map(|(src, dst, stream)| Step::CopyWithin { src, dst, stream }),
        1 => (any::<usize>(), 0usize..3, any::<u8>()).prop_map(|(buf, stream, value)| Step::Memset { buf, stream, value }),
        2 => any::<usize>().prop_map(Step::Check),
        1 => Just(Step::WaitPending),
    ]
}

struct Slot {
    buf: tidemem::device::DeviceBuffer,
    shadow: Vec<u8>,
    /// Stream of the last operation on this buffer, and an event recorded after it.
    last: Option<(usize, Event)>,
}

/// Orders an operation on `stream` after the buffer's last operation, the way a correct program
/// does: an event recorded there and waited on here.
fn order(dev: &Device, streams: &[Stream], slot: &Slot, stream: usize) {
    if let Some((s, ev)) = &slot.last {
        if *s != stream {
            dev.wait_event(&streams[stream], ev).unwrap();
        }
    }
}

fn mark(dev: &Device, streams: &[Stream], slot: &mut Slot, stream: usize) {
    let ev = dev.new_event().unwrap();
    dev.record(&streams[stream], &ev).unwrap();
    slot.last = Some((stream, ev));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Correctly ordered random programs: contents always match the shadow, device use never
    /// exceeds capacity, and allocation fails exactly when the shadow says it must.
    #[test]
    fn contents_and_capacity_follow_the_shadow(steps in prop::collection::vec(step(), 1..60)) {
        let dev = Device::sim(SimConfig::with_capacity(CAP)).unwrap();
        let streams: Vec<Stream> = (0..3).map(|_| dev.new_stream().unwrap()).collect();
        let mut slots: Vec<Slot> = Vec::new();
        let mut pending: Vec<Pending<HostBuffer>> = Vec::new();
        for st in steps {
            match st {
                Step::Alloc(n) => {
                    // Buffers freed while copies are queued stay allocated until those finish.
                    for s in &streams { dev.sync_stream(s).unwrap(); }
                    let used: usize = slots.iter().map(|s| s.shadow.len()).sum();
                    match dev.alloc(n) {
                        Ok(buf) => {
                            prop_assert!(used + n <= CAP);
                            // Fresh device memory is unspecified: the program clears it first.
                            let mut slot = Slot { buf, shadow: vec![0; n], last: None };
                            dev.memset(&streams[0], &slot.buf, 0).unwrap();
                            mark(&dev, &streams, &mut slot, 0);
                            slots.push(slot);
                        }
                        Err(Error::OutOfMemory { requested, free, capacity, .. }) => {
                            prop_assert!(used + n > CAP);
                            prop_assert_eq!((requested, free, capacity), (n, CAP - used, CAP));
                        }
                        Err(e) => prop_assert!(false, "unexpected {}", e),
                    }
                }
                Step::Free(i) if !slots.is_empty() => { slots.swap_remove(i % slots.len()); }
                Step::Upload { buf, stream, seed } if !slots.is_empty() => {
                    let i = buf % slots.len();
                    let data = common::pattern(slots[i].shadow.len(), seed);
                    order(&dev, &streams, &slots[i], stream);
                    let h = HostBuffer::from_slice(&data).unwrap();
                    pending.push(dev.copy_h2d(&streams[stream], h, &slots[i].buf).unwrap());
                    slots[i].shadow = data;
                    mark(&dev, &streams, &mut slots[i], stream);
                }
                Step::CopyWithin { src, dst, stream } if !slots.is_empty() => {
                    let (a, b) = (src % slots.len(), dst % slots.len());
                    let n = slots[a].shadow.len().min(slots[b].shadow.len());
                    order(&dev, &streams, &slots[a], stream);
                    order(&dev, &streams, &slots[b], stream);
                    dev.copy_d2d(&streams[stream], slots[a].buf.view(0, n).unwrap(), slots[b].buf.view(slots[b].shadow.len() - n, n).unwrap()).unwrap();
                    let part = slots[a].shadow[..n].to_vec();
                    let len_b = slots[b].shadow.len();
                    slots[b].shadow[len_b - n..].copy_from_slice(&part);
                    mark(&dev, &streams, &mut slots[b], stream);
                    if a != b { mark(&dev, &streams, &mut slots[a], stream); }
                }
                Step::Memset { buf, stream, value } if !slots.is_empty() => {
                    let i = buf % slots.len();
                    order(&dev, &streams, &slots[i], stream);
                    dev.memset(&streams[stream], &slots[i].buf, value).unwrap();
                    slots[i].shadow.fill(value);
                    mark(&dev, &streams, &mut slots[i], stream);
                }
                Step::Check(i) if !slots.is_empty() => {
                    let i = i % slots.len();
                    let s = slots[i].last.as_ref().map_or(0, |l| l.0);
                    let got = dev.download(&streams[s], &slots[i].buf).unwrap();
                    prop_assert!(got == slots[i].shadow, "buffer {} differs", i);
                }
                Step::WaitPending => { for p in pending.drain(..) { p.wait().unwrap(); } }
                _ => {}
            }
            let info = dev.mem_info().unwrap();
            prop_assert!(info.total - info.free <= CAP);
        }
        for slot in &slots {
            let s = slot.last.as_ref().map_or(0, |l| l.0);
            prop_assert!(dev.download(&streams[s], &slot.buf).unwrap() == slot.shadow);
        }
    }

    /// Random programs that forget to synchronise: every operation the device accepts is ordered,
    /// so on a slow simulated link the results still equal the shadow. The ones it refuses change
    /// nothing.
    #[test]
    fn unordered_accesses_are_refused_never_raced(
        ops in prop::collection::vec((0usize..4, 0usize..2, 0usize..2, any::<bool>(), any::<u64>()), 1..40)
    ) {
        let link = LinkModel { h2d_gbps: 2.0, d2h_gbps: 2.0, d2d_gbps: 2.0, latency: std::time::Duration::from_micros(300) };
        let dev = Device::sim(SimConfig::with_capacity(1 << 20).link(link)).unwrap();
        let streams: Vec<Stream> = (0..2).map(|_| dev.new_stream().unwrap()).collect();
        const N: usize = 16 << 10;
        let bufs: Vec<_> = (0..2).map(|_| dev.alloc(N).unwrap()).collect();
        // Fresh device memory is unspecified: cleared first, and finished before anything else.
        for b in &bufs {
            dev.memset(&streams[0], b, 0).unwrap();
        }
        dev.sync_stream(&streams[0]).unwrap();
        let mut shadow = vec![vec![0u8; N]; 2];
        let mut pending = Vec::new();
        // operations accepted, by kind (h2d, d2d, fill, d2h), and whether the first was
        let (mut accepted, mut first) = ([0u64; 4], None);
        let baseline = dev.stats();
        for (kind, b, s, sync, seed) in ops {
            if sync {
                // Sometimes the program does synchronise: the other stream waits on this one.
                let ev = dev.new_event().unwrap();
                dev.record(&streams[1 - s], &ev).unwrap();
                dev.wait_event(&streams[s], &ev).unwrap();
            }
            let r = match kind {
                0 => {
                    let data = common::pattern(N, seed);
                    dev.copy_h2d(&streams[s], HostBuffer::from_slice(&data).unwrap(), &bufs[b])
                        .map(|p| { pending.push(p); shadow[b] = data; })
                }
                1 => dev.copy_d2d(&streams[s], &bufs[1 - b], &bufs[b]).map(|_| shadow[b] = shadow[1 - b].clone()),
                2 => dev.memset(&streams[s], &bufs[b], seed as u8).map(|_| shadow[b].fill(seed as u8)),
                _ => dev.copy_d2h(&streams[s], &bufs[b], HostBuffer::paged(N).unwrap()).and_then(|p| {
                    let got = p.wait()?;
                    assert!(got[..] == shadow[b][..], "a read accepted by the device saw stale data");
                    Ok(())
                }),
            };
            match r {
                Ok(()) => accepted[kind] += 1,
                // Refused: nothing was enqueued and the shadow is unchanged.
                Err(Error::UnorderedAccess { .. }) => {}
                Err(e) => prop_assert!(false, "unexpected {}", e),
            }
            first.get_or_insert(accepted.iter().sum::<u64>() == 1);
        }
        drop(pending);
        // The first operation follows the host's synchronisation: always ordered. And the
        // device counted exactly the operations it accepted (a refusal enqueues nothing).
        prop_assert_eq!(first, Some(true), "the first operation was refused");
        let st = dev.stats().since(&baseline);
        prop_assert_eq!(
            [st.h2d_copies, st.d2d_copies, st.fills, st.d2h_copies],
            accepted
        );
        for s in &streams { dev.sync_stream(s).unwrap(); }
        for b in 0..2 {
            prop_assert!(dev.download(&streams[0], &bufs[b]).unwrap() == shadow[b]);
        }
    }
}
