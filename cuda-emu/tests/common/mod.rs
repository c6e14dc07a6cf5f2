//! Helpers shared by the emulator's tests: a context with two streams, device buffers, kernels
//! looked up by name, and a way to check a fault (which poisons the driver for good) in a child
//! process.
#![allow(dead_code)]

use std::ffi::{c_void, CString};
use std::ptr::null_mut;

use tidemem_cuda_emu::*;

pub fn ok(r: i32) {
    assert_eq!(r, 0, "driver call failed with {r}");
}

/// Runs every test of the driver under one lock: they share the process's one device.
pub static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

pub struct Ctx {
    pub stream: *mut c_void,
    pub other: *mut c_void,
}

pub fn setup() -> Ctx {
    ok(cuInit(0));
    let mut ctx = null_mut();
    unsafe {
        ok(cuDevicePrimaryCtxRetain(&mut ctx, 0));
    }
    ok(cuCtxSetCurrent(ctx));
    let (mut s, mut o) = (null_mut(), null_mut());
    unsafe {
        ok(cuStreamCreate(&mut s, 1));
        ok(cuStreamCreate(&mut o, 1));
    }
    Ctx {
        stream: s,
        other: o,
    }
}

pub fn pinned(len: usize) -> *mut u8 {
    let mut p = null_mut();
    unsafe { ok(cuMemHostAlloc(&mut p, len, 0)) };
    p as *mut u8
}

/// Runs `f` in a child process (a fault poisons the driver for good), and checks that it
/// passed and that the driver reported a fault saying `message`.
pub fn faults_in_child(test: &str, message: &str, f: impl FnOnce()) {
    if std::env::var("EMU_FAULT_CHILD").as_deref() == Ok(test) {
        f();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args(["--exact", test, "--nocapture"])
        .env("EMU_FAULT_CHILD", test)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("fault") && err.contains(message), "{err}");
}

/// The kernel `name`, from a PTX image naming it (standing in for NVRTC's output).
pub fn kernel(name: &str) -> *const EmuKernel {
    let ptx = CString::new(format!(
        ".version 8.0\n.target sm_90\n.visible .entry {name}(\n)\n"
    ))
    .unwrap();
    let mut m = null_mut();
    let mut f = std::ptr::null();
    let name = CString::new(name).unwrap();
    unsafe {
        ok(cuModuleLoadData(&mut m, ptx.as_ptr() as *const c_void));
        ok(cuModuleGetFunction(&mut f, m, name.as_ptr()));
    }
    f
}

/// Device memory holding a copy of `data`.
pub fn upload<T: Copy>(data: &[T], stream: *mut c_void) -> u64 {
    let bytes = std::mem::size_of_val(data).max(1);
    let mut d = 0u64;
    unsafe {
        ok(cuMemAllocAsync(&mut d, bytes, stream));
        if !data.is_empty() {
            ok(cuMemcpyHtoDAsync_v2(
                d,
                data.as_ptr() as *const c_void,
                bytes,
                stream,
            ));
        }
    }
    d
}

/// `n` values of device memory at `d`, after everything enqueued on `stream` so far.
pub fn download<T: Copy + Default>(d: u64, n: usize, stream: *mut c_void) -> Vec<T> {
    let mut v = vec![T::default(); n];
    unsafe {
        ok(cuMemcpyDtoHAsync_v2(
            v.as_mut_ptr() as *mut c_void,
            d,
            std::mem::size_of_val(v.as_slice()),
            stream,
        ));
    }
    v
}

/// One kernel parameter: a pointer to its value, as cuLaunchKernel takes them.
pub fn arg<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}

/// Launches `f` on a `grid` of `block`s with `shared` bytes of dynamic shared memory.
pub fn launch(
    f: *const EmuKernel,
    grid: u32,
    block: [u32; 3],
    shared: u32,
    stream: *mut c_void,
    args: &mut [*mut c_void],
) -> i32 {
    unsafe {
        cuLaunchKernel(
            f,
            grid,
            1,
            1,
            block[0],
            block[1],
            block[2],
            shared,
            stream,
            args.as_mut_ptr(),
            null_mut(),
        )
    }
}
