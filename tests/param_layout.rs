//! Every op's `#[repr(C)]` parameter struct has the layout of its C++ mirror in `kernels/*.cuh`:
//! the same size, and every field at the same offset. The host C++ compiler (the one the
//! emulator builds the kernels with) checks sizes and offsets with `static_assert`s; NVRTC, which
//! has no `offsetof`, checks the sizes. CUDA lays out a by-value kernel parameter as the host
//! compiler does (it must, for launches from host code), so the offsets agree on both.

mod common;

use std::fmt::Write as _;

use tidemem::kernels::{self, CompileTarget, KernelSource};
use tidemem::ops;

/// A translation unit that includes every header and asserts each registered layout.
fn asserts(offsets: bool) -> String {
    let mut src = String::from("#include <cstddef>\n");
    let mut headers: Vec<&str> = ops::registry().iter().map(|d| d.params.header).collect();
    headers.sort_unstable();
    headers.dedup();
    for h in headers {
        writeln!(src, "#include \"{h}\"").unwrap();
    }
    for d in ops::registry() {
        let p = &d.params;
        writeln!(
            src,
            "static_assert(sizeof({}) == {}, \"{}: size of {}\");",
            p.c_name, p.size, d.name, p.c_name
        )
        .unwrap();
        for (field, offset) in p.fields.iter().filter(|_| offsets) {
            writeln!(
                src,
                "static_assert(offsetof({c}, {field}) == {offset}, \"{n}: {c}::{field}\");",
                c = p.c_name,
                n = d.name
            )
            .unwrap();
        }
    }
    src
}

#[test]
fn every_struct_lists_every_byte() {
    // The Rust side's field list covers the struct: fields are in order, and the last one ends
    // within the size (padding only at the end, where `repr(C)` puts it).
    for d in ops::registry() {
        let p = &d.params;
        assert!(!p.fields.is_empty(), "{}: no fields", d.name);
        assert!(
            p.fields.windows(2).all(|w| w[0].1 < w[1].1),
            "{}: fields out of order",
            d.name
        );
        assert!(
            kernels::HEADERS.iter().any(|h| h.name == p.header),
            "{}: header {} is not embedded",
            d.name,
            p.header
        );
        assert!(
            kernels::HEADERS
                .iter()
                .find(|h| h.name == p.header)
                .is_some_and(|h| h.code.contains(&format!("struct {} {{", p.c_name))),
            "{}: {} does not define struct {}",
            d.name,
            p.header,
            p.c_name
        );
    }
}

#[test]
fn sizes_match_the_cuda_headers_under_nvrtc() {
    if !kernels::nvrtc_available() {
        assert!(
            std::env::var("TIDEMEM_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "TIDEMEM_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded"
        );
        eprintln!("skipping: NVRTC is not installed");
        return;
    }
    let code = format!(
        "{}\nextern \"C\" __global__ void layout_probe() {{}}\n",
        asserts(false).replace("#include <cstddef>\n", "")
    );
    let src: &'static KernelSource = Box::leak(Box::new(KernelSource {
        name: "param_layout_probe.cu",
        code: Box::leak(code.into_boxed_str()),
    }));
    kernels::compile(src, CompileTarget::Ptx("compute_90".into()))
        .unwrap_or_else(|e| panic!("a parameter struct differs from its header: {e}"));
}

#[test]
fn layouts_match_the_headers_under_the_host_compiler() {
    let test = "layouts_match_the_headers_under_the_host_compiler";
    let Some(cxx) = common::cxx_or_skip(test, &["c++", "g++", "clang++"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("probe.cpp");
    std::fs::write(&file, asserts(true)).unwrap();
    let kernels_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let out = std::process::Command::new(cxx)
        .arg("-std=c++17")
        .arg("-fsyntax-only")
        .arg("-I")
        .arg(&kernels_dir)
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "a parameter struct differs from its header:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_probe_fails_on_a_wrong_offset() {
    // The check can fail: a layout with a wrong offset is refused by the host compiler.
    let test = "the_probe_fails_on_a_wrong_offset";
    let Some(cxx) = common::cxx_or_skip(test, &["c++", "g++"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.cpp");
    let kernels_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    std::fs::write(
        &file,
        "#include <cstddef>\n#include \"adam.cuh\"\n\
         static_assert(offsetof(AdamParams, s.grad_scale) == 4, \"wrong\");\n",
    )
    .unwrap();
    let out = std::process::Command::new(cxx)
        .args(["-std=c++17", "-fsyntax-only", "-I"])
        .arg(&kernels_dir)
        .arg(&file)
        .output()
        .unwrap();
    assert!(!out.status.success());
}
