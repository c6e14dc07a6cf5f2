//! The generic launch path: every launch is validated the same way against its op's signature,
//! and a CPU twin's failure is a sticky error of its stream, reported by the next
//! synchronisation or wait and carried by events to the streams that wait on them.

mod common;

use tidemem::device::{
    CudaSide, Device, Grid, KernelDesc, Operand, OperandSpec, ParamLayout, TwinArgs,
};
use tidemem::{DType, Error, Result};

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    /// 1: the twin fails; 0: it copies its input to its output.
    fail: u64,
}

const LAYOUT: ParamLayout = ParamLayout {
    c_name: "Params",
    header: "none.cuh",
    size: 8,
    fields: &[("fail", 0)],
};

fn twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: Params = a.params()?;
    if p.fail == 1 {
        return Err(Error::InvalidArgument("the twin was told to fail".into()));
    }
    let x = a.read(0)?;
    a.take(1)?.copy_from_slice(x);
    Ok(())
}

fn no_cuda(_: &tidemem::device::LaunchInfo<'_>) -> Result<Vec<Grid>> {
    Ok(vec![])
}

static COPY: KernelDesc = KernelDesc {
    name: "test_copy",
    operands: &[
        OperandSpec::read("x", &[DType::F32, DType::U32]),
        OperandSpec::write("y", &[DType::F32, DType::U32]),
        OperandSpec::read("extra", &[DType::F32]).optional(),
    ],
    params: LAYOUT,
    check: Some(|info| {
        if info.len(0) != info.len(1) {
            return Err(info.desc.error("x and y differ in length"));
        }
        Ok(())
    }),
    twin,
    cuda: CudaSide::Nvrtc {
        source: "none.cu",
        plan: no_cuda,
    },
};

fn ok() -> Vec<u8> {
    bytemuck::bytes_of(&Params { fail: 0 }).to_vec()
}

#[test]
fn launches_are_validated_against_the_signature() {
    let dev = common::sim(1 << 20);
    let s = dev.new_stream().unwrap();
    let a = dev.alloc(64).unwrap();
    let b = dev.alloc(64).unwrap();
    let f = |v, d| Some(Operand::new(v, d));
    let (x, y) = (a.view(0, 32).unwrap(), b.view(0, 32).unwrap());
    // A good launch runs.
    dev.launch(
        &s,
        &COPY,
        &[f(x, DType::F32), f(y, DType::F32), None],
        &ok(),
    )
    .unwrap();
    let launch = |ops: &[Option<Operand<'_>>], params: &[u8]| dev.launch(&s, &COPY, ops, params);
    // Wrong operand count, missing required operand, wrong element type, parameter size.
    assert!(matches!(
        launch(&[f(x, DType::F32), f(y, DType::F32)], &ok()),
        Err(Error::Launch {
            kernel: "test_copy",
            ..
        })
    ));
    assert!(matches!(
        launch(&[f(x, DType::F32), None, None], &ok()),
        Err(Error::Launch { .. })
    ));
    assert!(matches!(
        launch(&[f(x, DType::F16), f(y, DType::F32), None], &ok()),
        Err(Error::Launch { .. })
    ));
    assert!(matches!(
        launch(&[f(x, DType::F32), f(y, DType::F32), None], &[0u8; 4]),
        Err(Error::Launch { .. })
    ));
    // Alignment to the element type, by offset and by length.
    assert!(matches!(
        launch(
            &[f(a.view(2, 8).unwrap(), DType::F32), f(y, DType::F32), None],
            &ok()
        ),
        Err(Error::Misaligned { what: "x", .. })
    ));
    assert!(matches!(
        launch(
            &[f(a.view(0, 6).unwrap(), DType::F32), f(y, DType::F32), None],
            &ok()
        ),
        Err(Error::Misaligned { .. })
    ));
    // A written operand overlaps nothing, not even an optional read one.
    assert!(matches!(
        launch(
            &[
                f(x, DType::F32),
                f(a.view(16, 32).unwrap(), DType::F32),
                None
            ],
            &ok()
        ),
        Err(Error::Operands { reason, .. }) if reason.contains("overlaps")
    ));
    assert!(matches!(
        launch(
            &[
                f(x, DType::F32),
                f(y, DType::F32),
                f(b.view(28, 8).unwrap(), DType::F32)
            ],
            &ok()
        ),
        Err(Error::Operands { .. })
    ));
    // Reads may overlap each other; the op's own shape check runs last.
    dev.launch(
        &s,
        &COPY,
        &[
            f(x, DType::F32),
            f(y, DType::F32),
            f(a.view(0, 8).unwrap(), DType::F32),
        ],
        &ok(),
    )
    .unwrap();
    assert!(matches!(
        launch(
            &[f(x, DType::F32), f(b.view(0, 16).unwrap(), DType::F32), None],
            &ok()
        ),
        Err(Error::Operands { reason, .. }) if reason.contains("differ in length")
    ));
    // A read-only operand (a parameter's view, an `Input`) is refused where the kernel writes.
    assert!(matches!(
        launch(
            &[f(x, DType::F32), Some(Operand::input(y, DType::F32)), None],
            &ok()
        ),
        Err(Error::Launch { .. })
    ));
    dev.launch(
        &s,
        &COPY,
        &[Some(Operand::input(x, DType::F32)), f(y, DType::F32), None],
        &ok(),
    )
    .unwrap();
    // Another device's buffer.
    let other = common::sim(1 << 20);
    let c = other.alloc(32).unwrap();
    assert!(matches!(
        launch(&[f(x, DType::F32), f((&c).into(), DType::F32), None], &ok()),
        Err(Error::WrongDevice { .. })
    ));
    dev.sync_stream(&s).unwrap();
    assert_eq!(
        dev.download(&s, &b).unwrap()[..32],
        dev.download(&s, &a).unwrap()[..32]
    );
}

fn failing(dev: &Device, s: &tidemem::device::Stream, buf: &tidemem::device::DeviceBuffer) {
    let fail = bytemuck::bytes_of(&Params { fail: 1 }).to_vec();
    let ops = [
        Some(Operand::new(buf.view(0, 16).unwrap(), DType::U32)),
        Some(Operand::new(buf.view(16, 16).unwrap(), DType::U32)),
        None,
    ];
    // The launch itself is accepted: the twin fails when it runs.
    dev.launch(s, &COPY, &ops, &fail).unwrap();
}

#[test]
fn a_failing_twin_is_a_sticky_stream_error() {
    let dev = common::sim(1 << 20);
    let s = dev.new_stream().unwrap();
    let buf = dev.upload(&s, &[1u8; 32]).unwrap();
    failing(&dev, &s, &buf);
    let is_failure = |r: Result<()>| matches!(r, Err(Error::KernelFailed { ref kernel, ref message }) if kernel == "test_copy" && message.contains("told to fail"));
    assert!(is_failure(dev.sync_stream(&s)));
    // Sticky: reported again, and later work on the stream does not run.
    assert!(is_failure(dev.sync_stream(&s)));
    dev.memset(&s, &buf, 9).unwrap();
    assert!(is_failure(dev.sync_stream(&s)));
    let pending = dev
        .copy_d2h(&s, &buf, tidemem::device::HostBuffer::paged(32).unwrap())
        .unwrap();
    assert!(matches!(pending.wait(), Err(Error::KernelFailed { .. })));
    // An event recorded after the failure carries it.
    let e = dev.new_event().unwrap();
    dev.record(&s, &e).unwrap();
    assert!(matches!(
        dev.sync_event(&e),
        Err(Error::KernelFailed { .. })
    ));
    // A stream that waits on that event inherits the failure; waiting again on the failed
    // stream is refused at once.
    let t = dev.new_stream().unwrap();
    dev.wait_event(&t, &e).unwrap();
    assert!(matches!(
        dev.sync_stream(&t),
        Err(Error::KernelFailed { .. })
    ));
    assert!(matches!(
        dev.wait_event(&s, &e),
        Err(Error::KernelFailed { .. })
    ));
    // Other streams are untouched.
    let u = dev.new_stream().unwrap();
    let fresh = dev.upload(&u, &[3u8; 8]).unwrap();
    assert_eq!(dev.download(&u, &fresh).unwrap(), vec![3u8; 8]);
}

#[test]
fn an_event_recorded_before_the_failure_is_clean() {
    let dev = common::sim(1 << 20);
    let s = dev.new_stream().unwrap();
    let buf = dev.upload(&s, &[1u8; 32]).unwrap();
    let e = dev.new_event().unwrap();
    dev.record(&s, &e).unwrap();
    failing(&dev, &s, &buf);
    dev.sync_event(&e).unwrap();
    assert!(dev.sync_stream(&s).is_err());
}

/// An op whose CUDA side is a library call on the native stream (as cuBLAS will be): it fills
/// its output with a byte; the twin does the same on the simulated device.
static FILL: KernelDesc = KernelDesc {
    name: "test_library_fill",
    operands: &[
        OperandSpec::read("x", &[DType::U8]),
        OperandSpec::write("y", &[DType::U8]),
        OperandSpec::read("extra", &[DType::U8]).optional(),
    ],
    params: LAYOUT,
    check: None,
    twin: |a| {
        let v = a.params::<Params>()?.fail as u8;
        a.take(1)?.fill(v);
        Ok(())
    },
    cuda: CudaSide::Library(|call| {
        let v = bytemuck::pod_read_unaligned::<Params>(call.info.params).fail as u8;
        assert_eq!(call.ptrs[2], 0, "an absent operand has address 0");
        // SAFETY: `ptrs[1]` addresses the written operand's `len(1)` bytes, on `stream`.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                call.ptrs[1],
                v,
                call.info.len(1),
                call.stream.cast(),
            )
        }
        .map_err(|e| Error::InvalidArgument(format!("memset: {e:?}")))
    }),
};

#[test]
fn a_library_call_runs_on_the_native_stream_in_order() {
    let mut devs = vec![common::sim(1 << 20)];
    devs.extend(common::cuda("launch"));
    for dev in devs {
        let s = dev.new_stream().unwrap();
        let x = dev.upload(&s, &[1u8; 64]).unwrap();
        let y = dev.upload(&s, &[0u8; 64]).unwrap();
        // this op reads the parameter block's one field as its fill byte
        let p = bytemuck::bytes_of(&Params { fail: 0x5a }).to_vec();
        let ops = [
            Some(Operand::new(&x, DType::U8)),
            Some(Operand::new(y.view(8, 48).unwrap(), DType::U8)),
            None,
        ];
        dev.launch(&s, &FILL, &ops, &p).unwrap();
        let got = dev.download(&s, &y).unwrap();
        assert_eq!(&got[..8], &[0u8; 8], "{}", dev.name());
        assert_eq!(&got[8..56], &[0x5au8; 48][..], "{}", dev.name());
        assert_eq!(&got[56..], &[0u8; 8], "{}", dev.name());
    }
}

/// States made and dropped by [`COUNTED`]'s library call.
static STATES_MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static STATES_DROPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A library's per-stream state: how many calls the stream has made.
struct Calls(u8);

impl Drop for Calls {
    fn drop(&mut self) {
        STATES_DROPPED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A library call that keeps a count per stream and fills its output with it.
static COUNTED: KernelDesc = KernelDesc {
    name: "test_library_state",
    operands: &[
        OperandSpec::read("x", &[DType::U8]),
        OperandSpec::write("y", &[DType::U8]),
        OperandSpec::read("extra", &[DType::U8]).optional(),
    ],
    params: LAYOUT,
    check: None,
    twin: |a| {
        a.take(1)?.fill(0);
        Ok(())
    },
    cuda: CudaSide::Library(|call| {
        let init = || {
            STATES_MADE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(Calls(0))
        };
        let n = call.with_state(init, |c: &mut Calls| {
            c.0 += 1;
            Ok(c.0)
        })?;
        // SAFETY: `ptrs[1]` addresses the written operand's `len(1)` bytes, on `stream`.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                call.ptrs[1],
                n,
                call.info.len(1),
                call.stream.cast(),
            )
        }
        .map_err(|e| Error::InvalidArgument(format!("memset: {e:?}")))
    }),
};

#[test]
fn a_library_state_is_made_once_per_stream_and_dropped_with_it() {
    use std::sync::atomic::Ordering::SeqCst;
    let Some(dev) = common::cuda("launch") else {
        return;
    };
    let p = bytemuck::bytes_of(&Params { fail: 0 }).to_vec();
    let run = |s: &tidemem::device::Stream| {
        let x = dev.upload(s, &[0u8; 16]).unwrap();
        let y = dev.upload(s, &[0u8; 16]).unwrap();
        let ops = [
            Some(Operand::new(&x, DType::U8)),
            Some(Operand::new(&y, DType::U8)),
            None,
        ];
        dev.launch(s, &COUNTED, &ops, &p).unwrap();
        dev.download(s, &y).unwrap()[0]
    };
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    assert_eq!([run(&a), run(&a), run(&b), run(&a)], [1, 2, 1, 3]);
    assert_eq!(STATES_MADE.load(SeqCst), 2);
    assert_eq!(STATES_DROPPED.load(SeqCst), 0);
    drop(a);
    assert_eq!(STATES_DROPPED.load(SeqCst), 1);
    // dropped on a thread where no context is current: the stream binds its own
    std::thread::spawn(move || drop(b)).join().unwrap();
    assert_eq!(STATES_DROPPED.load(SeqCst), 2);
    let c = dev.new_stream().unwrap();
    assert_eq!(run(&c), 1, "a new stream starts with a new state");
    drop(dev);
    assert_eq!(
        STATES_DROPPED.load(SeqCst),
        2,
        "the stream outlives its device"
    );
    drop(c);
    assert_eq!(STATES_MADE.load(SeqCst), 3);
    assert_eq!(STATES_DROPPED.load(SeqCst), 3);
}
