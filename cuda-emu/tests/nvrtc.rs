//! The emulator's test kernels (tests/kernels/*.cu) are CUDA that NVRTC compiles for sm_90, so
//! what the shims accept is what a GPU build accepts; and the PTX NVRTC makes loads in the
//! emulator and runs there.
//!
//! NVRTC (libnvrtc.so.13, from the `nvidia-cuda-nvrtc` wheel or a CUDA toolkit) is found through
//! the dynamic loader; without it the test is skipped, unless `TIDEMEM_REQUIRE_NVRTC=1`.
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::ptr::null_mut;

use libloading::Library;

mod common;
use common::*;
use tidemem_cuda_emu::*;

type Prog = *mut c_void;

struct Nvrtc {
    lib: Library,
}

impl Nvrtc {
    fn load() -> Option<Self> {
        ["libnvrtc.so.13", "libnvrtc.so"].iter().find_map(|name| {
            // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
            unsafe { Library::new(*name) }.ok().map(|lib| Nvrtc { lib })
        })
    }

    /// Compiles `src` for `arch` (`compute_90`: PTX; `sm_90`: a cubin), or returns the log.
    fn compile(&self, src: &str, name: &str, arch: &str) -> Result<Vec<u8>, String> {
        type Create = unsafe extern "C" fn(
            *mut Prog,
            *const c_char,
            *const c_char,
            c_int,
            *const *const c_char,
            *const *const c_char,
        ) -> c_int;
        type Compile = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int;
        type Size = unsafe extern "C" fn(Prog, *mut usize) -> c_int;
        type Get = unsafe extern "C" fn(Prog, *mut c_char) -> c_int;
        type Destroy = unsafe extern "C" fn(*mut Prog) -> c_int;
        // SAFETY: the symbols have NVRTC's documented signatures, as typed above.
        unsafe {
            let create = self.lib.get::<Create>(b"nvrtcCreateProgram").unwrap();
            let compile = self.lib.get::<Compile>(b"nvrtcCompileProgram").unwrap();
            let log_size = self.lib.get::<Size>(b"nvrtcGetProgramLogSize").unwrap();
            let log = self.lib.get::<Get>(b"nvrtcGetProgramLog").unwrap();
            let cubin = arch.starts_with("sm_");
            let (size, get) = if cubin {
                (&b"nvrtcGetCUBINSize"[..], &b"nvrtcGetCUBIN"[..])
            } else {
                (&b"nvrtcGetPTXSize"[..], &b"nvrtcGetPTX"[..])
            };
            let size = self.lib.get::<Size>(size).unwrap();
            let get = self.lib.get::<Get>(get).unwrap();
            let destroy = self.lib.get::<Destroy>(b"nvrtcDestroyProgram").unwrap();

            let (src, name) = (CString::new(src).unwrap(), CString::new(name).unwrap());
            let mut prog: Prog = null_mut();
            let r = create(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                null_mut(),
                null_mut(),
            );
            assert_eq!(r, 0, "nvrtcCreateProgram");
            let opts: Vec<CString> = [
                format!("--gpu-architecture={arch}"),
                "--std=c++17".into(),
                "--fmad=false".into(),
            ]
            .into_iter()
            .map(|o| CString::new(o).unwrap())
            .collect();
            let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
            let r = compile(prog, ptrs.len() as c_int, ptrs.as_ptr());
            let result = if r == 0 {
                let mut n = 0usize;
                assert_eq!(size(prog, &mut n), 0);
                let mut buf = vec![0u8; n];
                assert_eq!(get(prog, buf.as_mut_ptr() as *mut c_char), 0);
                Ok(buf)
            } else {
                let mut n = 0usize;
                assert_eq!(log_size(prog, &mut n), 0);
                let mut buf = vec![0u8; n.max(1)];
                assert_eq!(log(prog, buf.as_mut_ptr() as *mut c_char), 0);
                Err(CStr::from_bytes_until_nul(&buf)
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default())
            };
            destroy(&mut prog);
            result
        }
    }
}

fn test_kernels() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/kernels");
    let mut v: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    v.sort();
    v
}

fn nvrtc_or_skip() -> Option<Nvrtc> {
    let n = Nvrtc::load();
    if n.is_none() {
        assert!(
            std::env::var("TIDEMEM_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "TIDEMEM_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded"
        );
        eprintln!("skipping: libnvrtc cannot be loaded");
    }
    n
}

#[test]
fn nvrtc_compiles_the_test_kernels_and_the_emulator_runs_its_ptx() {
    let Some(nvrtc) = nvrtc_or_skip() else {
        return;
    };
    let _g = serial();
    let c = setup();
    for (file, src) in test_kernels() {
        nvrtc
            .compile(&src, &file, "sm_90")
            .unwrap_or_else(|log| panic!("{file} for sm_90:\n{log}"));
        let mut ptx = nvrtc
            .compile(&src, &file, "compute_90")
            .unwrap_or_else(|log| panic!("{file} for compute_90:\n{log}"));
        if ptx.last() != Some(&0) {
            ptx.push(0);
        }
        // Every kernel of the file is in the PTX, and the emulator finds it there.
        let mut m = null_mut();
        unsafe { ok(cuModuleLoadData(&mut m, ptx.as_ptr() as *const c_void)) };
        let names: Vec<&str> = src
            .split("extern \"C\" __global__ void ")
            .skip(1)
            .map(|s| s.split('(').next().unwrap())
            .collect();
        assert!(!names.is_empty(), "{file}");
        for name in names {
            assert!(kernel_names().contains(&name), "{name}");
            let mut f = std::ptr::null();
            let cname = CString::new(name).unwrap();
            unsafe { ok(cuModuleGetFunction(&mut f, m, cname.as_ptr())) };
        }
        if file == "warp.cu" {
            // Run one from NVRTC's module: the block sum of 0..1000 over one block of 64.
            let mut f = std::ptr::null();
            unsafe {
                ok(cuModuleGetFunction(
                    &mut f,
                    m,
                    c"emu_test_block_sum".as_ptr(),
                ))
            };
            let x: Vec<f64> = (0..1000).map(f64::from).collect();
            let (dx, dout) = (upload(&x, c.stream), upload(&[0f64], c.stream));
            let (mut a, mut b, mut n) = (dx, dout, 1000u64);
            ok(launch(
                f,
                1,
                [64, 1, 1],
                16,
                c.stream,
                &mut [arg(&mut a), arg(&mut b), arg(&mut n)],
            ));
            assert_eq!(download::<f64>(dout, 1, c.stream), vec![499_500.0]);
            ok(cuMemFreeAsync(dx, c.stream));
            ok(cuMemFreeAsync(dout, c.stream));
        }
        ok(cuModuleUnload(m));
    }
    ok(cuStreamSynchronize(c.stream));
}
