//! Compiles every `kernels/*.cu` of tidemem as host C++ (with the shims in `shim/`), and writes
//! the table of its kernels (`extern "C" __global__ void NAME(`) for the driver to look up.
use std::path::PathBuf;
use std::{env, fs};

fn kernel_names(src: &str) -> Vec<String> {
    const MARK: &str = "extern \"C\" __global__ void ";
    let mut names = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find(MARK) {
        rest = &rest[i + MARK.len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        names.push(name);
    }
    names
}

fn main() {
    // The fibers switch with x86-64 System V assembly (cpp/runtime.cpp).
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    assert!(
        arch == "x86_64" && os == "linux",
        "tidemem-cuda-emu runs kernels on x86-64 Linux only (target: {arch}-{os})"
    );
    let here = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels = here.join("..").join("kernels");
    let shim = here.join("shim");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed={}", shim.display());
    println!("cargo:rerun-if-changed=cpp/runtime.cpp");

    let mut files: Vec<PathBuf> = fs::read_dir(&kernels)
        .expect("the kernels directory")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .include(&shim)
        .flag("-include")
        .flag(shim.join("emu_rt.h").to_str().unwrap())
        .flag("-ffp-contract=off")
        .flag("-fno-fast-math")
        .flag("-Wno-unknown-pragmas")
        .file(here.join("cpp").join("runtime.cpp"));

    let mut rs = String::from("extern \"C\" {\n");
    let mut tables = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for f in &files {
        let src = fs::read_to_string(f).unwrap();
        let names = kernel_names(&src);
        for n in &names {
            assert!(seen.insert(n.clone()), "kernel {n} is defined twice");
        }
        let stem = f.file_stem().unwrap().to_str().unwrap().replace('-', "_");
        let entries: Vec<String> = names
            .iter()
            .map(|n| format!("    EMU_KERNEL({n}),"))
            .collect();
        let cpp = format!(
            "#include \"{}\"\nextern \"C\" const EmuKernel emu_kernels_{stem}[] = {{\n{}\n}};\n",
            f.display(),
            entries.join("\n")
        );
        let gen = out.join(format!("gen_{stem}.cpp"));
        fs::write(&gen, cpp).unwrap();
        build.file(&gen);
        rs.push_str(&format!(
            "    static emu_kernels_{stem}: [EmuKernel; {}];\n",
            names.len()
        ));
        tables.push(format!("&emu_kernels_{stem}[..]"));
    }
    rs.push_str("}\n\n/// Every kernel table, one per kernel source.\nfn kernel_tables() -> Vec<&'static [EmuKernel]> {\n");
    rs.push_str(
        "    // SAFETY: the tables are constant arrays of the length declared, defined in C++.\n",
    );
    rs.push_str(&format!(
        "    unsafe {{ vec![{}] }}\n}}\n",
        tables.join(", ")
    ));
    fs::write(out.join("kernels.rs"), rs).unwrap();
    build.compile("tidemem_emu_kernels");
}
