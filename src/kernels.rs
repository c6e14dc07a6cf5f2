//! CUDA kernels: the sources in `kernels/*.cu`, embedded in the crate and compiled at run time
//! with NVRTC, cached per source and target (and, by the CUDA backend, per device).
//!
//! NVRTC and the headers it needs (`cuda_fp16.h`, `cuda_bf16.h`) need not come from a CUDA
//! toolkit: the PyPI wheels `nvidia-cuda-nvrtc` and `nvidia-cuda-runtime` provide them, and NVRTC
//! loads on a machine with no GPU. The library is found through the dynamic loader
//! (`LD_LIBRARY_PATH`); headers through [`include_dirs`].

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// One embedded kernel source file.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/`.
    pub name: &'static str,
    /// The CUDA C++ source.
    pub code: &'static str,
}

/// One embedded file of `kernels/`.
macro_rules! kernel_file {
    ($name:literal) => {
        KernelSource {
            name: $name,
            code: include_str!(concat!("../kernels/", $name)),
        }
    };
}

/// Every kernel source of the crate.
pub const SOURCES: &[KernelSource] = &[
    kernel_file!("cast.cu"),
    kernel_file!("adam.cu"),
    kernel_file!("adam8.cu"),
    kernel_file!("grad_stats.cu"),
    kernel_file!("embedding.cu"),
    kernel_file!("gelu.cu"),
    kernel_file!("accumulate.cu"),
    kernel_file!("heads.cu"),
    kernel_file!("interaction.cu"),
    kernel_file!("bce.cu"),
    kernel_file!("softmax.cu"),
    kernel_file!("cross_entropy.cu"),
    kernel_file!("encoder.cu"),
    kernel_file!("layernorm.cu"),
    kernel_file!("relu.cu"),
    kernel_file!("bias.cu"),
    kernel_file!("elementwise.cu"),
    kernel_file!("vocab_parallel.cu"),
    kernel_file!("copy_rows.cu"),
];

/// Every header of the kernel sources (`#include "name.cuh"`): the shared helpers
/// (`common.cuh`) and the parameter structs the Rust side mirrors. NVRTC gets them from
/// memory, the host compiler from `kernels/`.
pub const HEADERS: &[KernelSource] = &[
    kernel_file!("common.cuh"),
    kernel_file!("cast.cuh"),
    kernel_file!("adam.cuh"),
    kernel_file!("quant8.cuh"),
    kernel_file!("quant8_code.cuh"),
    kernel_file!("grad_stats.cuh"),
    kernel_file!("embedding.cuh"),
    kernel_file!("gelu.cuh"),
    kernel_file!("accumulate.cuh"),
    kernel_file!("math.cuh"),
    kernel_file!("heads.cuh"),
    kernel_file!("gemm.cuh"),
    kernel_file!("interaction.cuh"),
    kernel_file!("bce.cuh"),
    kernel_file!("lanes.cuh"),
    kernel_file!("softmax.cuh"),
    kernel_file!("cross_entropy.cuh"),
    kernel_file!("encoder.cuh"),
    kernel_file!("layernorm.cuh"),
    kernel_file!("relu.cuh"),
    kernel_file!("bias.cuh"),
    kernel_file!("elementwise.cuh"),
    kernel_file!("vocab_parallel.cuh"),
    kernel_file!("copy_rows.cuh"),
];

/// The source named `name`.
pub fn source(name: &str) -> Result<&'static KernelSource> {
    SOURCES
        .iter()
        .find(|s| s.name == name)
        .ok_or_else(|| Error::Compile {
            kernel: name.into(),
            message: "no such kernel source".into(),
        })
}

/// What to compile to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CompileTarget {
    /// PTX for a virtual architecture, e.g. `compute_90`.
    Ptx(String),
    /// A cubin for a real architecture, e.g. `sm_90`.
    Cubin(String),
}

/// Whether the NVRTC library can be loaded.
pub fn nvrtc_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the library.
    *PRESENT.get_or_init(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
}

/// Directories searched for CUDA headers, in order: the entries of `TIDEMEM_CUDA_INCLUDE`
/// (a `:`-separated list), then `$CUDA_HOME/include`, `$CUDA_PATH/include` and
/// `/usr/local/cuda/include` where they exist.
pub fn include_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("TIDEMEM_CUDA_INCLUDE")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.push(PathBuf::from(v).join("include"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/include"));
    dirs.retain(|d| d.is_dir());
    dirs
}

type Cache = Mutex<HashMap<(&'static str, CompileTarget), Arc<Vec<u8>>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Compiles `src` for `target` (once per source and target; later calls return the cached
/// image). PTX images end with a NUL byte, as `cuModuleLoadData` expects.
pub fn compile(src: &'static KernelSource, target: CompileTarget) -> Result<Arc<Vec<u8>>> {
    let key = (src.name, target);
    if let Some(img) = cache().lock().get(&key) {
        return Ok(img.clone());
    }
    let img = Arc::new(compile_uncached(src, &key.1)?);
    cache().lock().insert(key, img.clone());
    Ok(img)
}

fn compile_uncached(src: &KernelSource, target: &CompileTarget) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result as rtc, sys};
    let fail = |message: String| Error::Compile {
        kernel: src.name.into(),
        message,
    };
    if !nvrtc_available() {
        return Err(fail(
            "NVRTC (libnvrtc) is not installed; install the nvidia-cuda-nvrtc wheel and add its lib \
             directory to LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let arch = match target {
        CompileTarget::Ptx(a) | CompileTarget::Cubin(a) => a,
    };
    // No contraction of a * b + c into a fused multiply-add: the kernels' results must be the
    // CPU twins' bits, and a fused operation rounds once where the twin rounds twice.
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--fmad=false".to_string(),
    ];
    for d in include_dirs() {
        opts.push(format!("--include-path={}", d.display()));
    }
    let prog = create_program(src).map_err(fail)?;
    struct Prog(sys::nvrtcProgram);
    impl Drop for Prog {
        fn drop(&mut self) {
            // SAFETY: created above and destroyed once.
            let _ = unsafe { cudarc::nvrtc::result::destroy_program(self.0) };
        }
    }
    let prog = Prog(prog);
    // SAFETY: `prog` is a live program; the options are valid C strings.
    if let Err(e) = unsafe { rtc::compile_program(prog.0, &opts) } {
        // SAFETY: as above.
        let log = unsafe { rtc::get_program_log(prog.0) }
            .map(|l| {
                // SAFETY: NVRTC returns a NUL-terminated log.
                unsafe { CStr::from_ptr(l.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        return Err(fail(format!("{e:?} with options {opts:?}:\n{log}")));
    }
    match target {
        CompileTarget::Ptx(_) => {
            // SAFETY: compiled program.
            let ptx = unsafe { rtc::get_ptx(prog.0) }.map_err(|e| fail(format!("{e:?}")))?;
            Ok(ptx.into_iter().map(|c| c as u8).collect())
        }
        CompileTarget::Cubin(_) => {
            let mut size = 0usize;
            // SAFETY: compiled program; `size` receives the cubin size.
            unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| fail(format!("nvrtcGetCUBINSize: {e:?}")))?;
            if size == 0 {
                return Err(fail(format!(
                    "no cubin produced for {arch} (a virtual architecture?)"
                )));
            }
            let mut buf = vec![0u8; size];
            // SAFETY: `buf` has room for `size` bytes.
            unsafe { sys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr() as *mut _) }
                .result()
                .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))?;
            Ok(buf)
        }
    }
}

/// An NVRTC program of `src` with every header of [`HEADERS`] given in memory.
fn create_program(
    src: &KernelSource,
) -> std::result::Result<cudarc::nvrtc::sys::nvrtcProgram, String> {
    use cudarc::nvrtc::sys;
    let cstr =
        |s: &str, what: &str| CString::new(s).map_err(|_| format!("{what} contains a NUL byte"));
    let code = cstr(src.code, "the source")?;
    let name = cstr(src.name, "the name")?;
    let header_code: Vec<CString> = HEADERS
        .iter()
        .map(|h| cstr(h.code, h.name))
        .collect::<std::result::Result<_, _>>()?;
    let header_names: Vec<CString> = HEADERS
        .iter()
        .map(|h| cstr(h.name, "a header name"))
        .collect::<std::result::Result<_, _>>()?;
    let code_ptrs: Vec<*const std::ffi::c_char> = header_code.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const std::ffi::c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let mut prog = std::mem::MaybeUninit::uninit();
    // SAFETY: every pointer is a live NUL-terminated string for the call, and the two header
    // arrays have `HEADERS.len()` entries; NVRTC copies them.
    unsafe {
        sys::nvrtcCreateProgram(
            prog.as_mut_ptr(),
            code.as_ptr(),
            name.as_ptr(),
            HEADERS.len() as i32,
            code_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    }
    .result()
    .map_err(|e| format!("{e:?}"))?;
    // SAFETY: initialised by the successful call above.
    Ok(unsafe { prog.assume_init() })
}
