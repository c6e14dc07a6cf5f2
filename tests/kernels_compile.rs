//! Every `kernels/*.cu` compiles with NVRTC to PTX and to an sm_90 cubin.
//!
//! NVRTC loads without a GPU, so this runs wherever the `nvidia-cuda-nvrtc` wheel (or a CUDA
//! toolkit) is installed. Without NVRTC it skips with a printed reason, unless
//! `TIDEMEM_REQUIRE_NVRTC=1` (set by CI), where it fails.

use tidemem::kernels::{self, CompileTarget};

fn nvrtc_or_skip() -> bool {
    if kernels::nvrtc_available() {
        return true;
    }
    let required = std::env::var("TIDEMEM_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "TIDEMEM_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded: install nvidia-cuda-nvrtc==13.0.* \
         and add its lib directory to LD_LIBRARY_PATH"
    );
    eprintln!(
        "skipping: NVRTC is not installed (set TIDEMEM_REQUIRE_NVRTC=1 to make this an error)"
    );
    false
}

#[test]
fn every_kernel_file_is_embedded() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    if !dir.is_dir() && std::env::var_os("CARGO").is_none() {
        // a test binary run outside its source tree (a GPU machine without Rust)
        eprintln!("skipping: {} is not here", dir.display());
        return;
    }
    let mut on_disk: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cu"))
        .collect();
    on_disk.sort();
    let mut embedded: Vec<String> = kernels::SOURCES
        .iter()
        .map(|s| s.name.to_string())
        .collect();
    embedded.sort();
    assert_eq!(
        on_disk, embedded,
        "kernels/*.cu and kernels::SOURCES differ"
    );
}

#[test]
fn every_kernel_compiles_to_ptx_and_sm90_cubin() {
    if !nvrtc_or_skip() {
        return;
    }
    for src in kernels::SOURCES {
        let ptx = kernels::compile(src, CompileTarget::Ptx("compute_90".into()))
            .unwrap_or_else(|e| panic!("{e}"));
        let text = String::from_utf8_lossy(&ptx);
        assert!(
            text.contains(".target sm_90"),
            "{}: PTX targets {:?}",
            src.name,
            text.lines().find(|l| l.contains(".target"))
        );
        // Every extern "C" kernel in the source appears as an entry in the PTX.
        for line in src.code.lines().filter(|l| l.contains("__global__")) {
            let name = line
                .split("void")
                .nth(1)
                .and_then(|r| r.split('(').next())
                .map(str::trim)
                .unwrap();
            assert!(
                text.contains(&format!(".entry {name}(")),
                "{}: {name} missing from PTX",
                src.name
            );
        }
        let cubin = kernels::compile(src, CompileTarget::Cubin("sm_90".into()))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            &cubin[..4],
            b"\x7fELF",
            "{}: a cubin is an ELF image",
            src.name
        );
        // Cached: the second call returns the same image.
        let again = kernels::compile(src, CompileTarget::Cubin("sm_90".into())).unwrap();
        assert!(std::sync::Arc::ptr_eq(&cubin, &again));
    }
}

#[test]
fn a_broken_kernel_reports_the_compiler_log() {
    if !nvrtc_or_skip() {
        return;
    }
    static BAD: kernels::KernelSource = kernels::KernelSource {
        name: "broken.cu",
        code: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_symbol; }",
    };
    let err = kernels::compile(&BAD, CompileTarget::Ptx("compute_90".into())).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("broken.cu") && msg.contains("undefined_symbol"),
        "{msg}"
    );
}

#[test]
fn embedding_kernels_round_every_operation_like_the_cpu() {
    if !nvrtc_or_skip() {
        return;
    }
    // The CPU twins (src/ops/embedding.rs) round after every multiply, add, divide and square
    // root; the PTX must do the same: no fused multiply-add, no approximate division or root.
    let src = kernels::source("embedding.cu").unwrap();
    let ptx = kernels::compile(src, CompileTarget::Ptx("compute_90".into())).unwrap();
    let text = String::from_utf8_lossy(&ptx);
    for line in text.lines().map(str::trim) {
        let op = line.split_whitespace().next().unwrap_or("");
        assert!(
            !(op.starts_with("fma.") || (op.starts_with("mad.") && op.ends_with(".f32"))),
            "a fused multiply-add in embedding.cu: {line}"
        );
        assert!(
            !(op.contains(".approx") || op.starts_with("div.full")),
            "an approximate operation in embedding.cu: {line}"
        );
    }
    for needed in ["mul.rn.f32", "add.rn.f32", "div.rn.f32", "sqrt.rn.f32"] {
        assert!(
            text.contains(needed),
            "embedding.cu: no {needed} in the PTX"
        );
    }
}
