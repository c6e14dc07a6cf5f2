//! Compiles every `kernels/*.cu` of tidemem, and the emulator's own test kernels
//! (`tests/kernels/*.cu`), as host C++ (with the shims in `shim/`), and writes the table of their
//! kernels (`extern "C" __global__ void NAME(`) for the driver to look up.
use std::path::{Path, PathBuf};
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

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Whether `word` starts at `i` of `s` as a whole identifier.
fn word_at(s: &[u8], i: usize, word: &str) -> bool {
    s[i..].starts_with(word.as_bytes())
        && (i == 0 || !is_ident(s[i - 1]))
        && s.get(i + word.len()).is_none_or(|&b| !is_ident(b))
}

/// Rewrites each `extern __shared__ SPEC NAME[];` (dynamic shared memory, which host C++ cannot
/// declare with `__shared__` as a static) into `SPEC (&NAME)[] = EmuDynamicShared{};`, a
/// reference to the launch's buffer (shim/emu_rt.h), keeping the line count. Comments and
/// string literals are left alone. `None` when the source declares no dynamic shared memory.
fn rewrite_dynamic_shared(src: &str, file: &Path) -> Option<String> {
    let s = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let (mut i, mut copied, mut found) = (0usize, 0usize, false);
    while i < s.len() {
        if s[i..].starts_with(b"//") {
            i += s[i..]
                .iter()
                .position(|&b| b == b'\n')
                .unwrap_or(s.len() - i);
        } else if s[i..].starts_with(b"/*") {
            i += s[i + 2..]
                .windows(2)
                .position(|w| w == b"*/")
                .map_or(s.len() - i, |p| p + 4);
        } else if s[i] == b'"' || s[i] == b'\'' {
            let q = s[i];
            i += 1;
            while i < s.len() && s[i] != q {
                i += if s[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if word_at(s, i, "extern") {
            let mut j = i + "extern".len();
            while j < s.len() && s[j].is_ascii_whitespace() {
                j += 1;
            }
            if !word_at(s, j, "__shared__") {
                i = j;
                continue;
            }
            let start = j + "__shared__".len();
            let end = start
                + s[start..]
                    .iter()
                    .position(|&b| b == b';')
                    .unwrap_or_else(|| {
                        panic!("{}: unterminated extern __shared__", file.display())
                    });
            let decl = src[start..end].trim_end();
            let bad = || {
                panic!(
                    "{}: `extern __shared__{decl};` is not `extern __shared__ TYPE NAME[];`",
                    file.display()
                )
            };
            let Some(decl) = decl.strip_suffix(']') else {
                bad()
            };
            let Some(decl) = decl.trim_end().strip_suffix('[') else {
                bad()
            };
            let decl = decl.trim_end();
            let name_len = decl.bytes().rev().take_while(|&b| is_ident(b)).count();
            if name_len == 0 || decl.len() == name_len {
                bad();
            }
            let (spec, name) = decl.split_at(decl.len() - name_len);
            out.push_str(&src[copied..i]);
            let new = format!("{spec}(&{name})[] = EmuDynamicShared{{}};");
            let lines = src[i..=end].matches('\n').count() - new.matches('\n').count();
            out.push_str(&new);
            out.push_str(&"\n".repeat(lines));
            i = end + 1;
            copied = i;
            found = true;
        } else {
            i += 1;
        }
    }
    out.push_str(&src[copied..]);
    found.then_some(out)
}

fn cu_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    files
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
    let test_kernels = here.join("tests").join("kernels");
    let shim = here.join("shim");
    let cpp = here.join("cpp");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    for dir in [&kernels, &test_kernels, &shim, &cpp] {
        println!("cargo:rerun-if-changed={}", dir.display());
    }

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
        .file(cpp.join("runtime.cpp"))
        .file(cpp.join("warp.cpp"));
    // A rewritten source is compiled from OUT_DIR: its quoted includes are found here.
    for dir in [&kernels, &test_kernels] {
        build.flag("-iquote").flag(dir.to_str().unwrap());
    }

    let mut rs = String::from("extern \"C\" {\n");
    let mut tables = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let sources = cu_files(&kernels)
        .into_iter()
        .map(|f| (f, ""))
        .chain(cu_files(&test_kernels).into_iter().map(|f| (f, "test_")));
    for (f, prefix) in sources {
        let src = fs::read_to_string(&f).unwrap();
        let names = kernel_names(&src);
        for n in &names {
            assert!(seen.insert(n.clone()), "kernel {n} is defined twice");
        }
        let stem = format!(
            "{prefix}{}",
            f.file_stem().unwrap().to_str().unwrap().replace('-', "_")
        );
        let compiled = match rewrite_dynamic_shared(&src, &f) {
            Some(text) => {
                let copy = out.join(format!("src_{stem}.cu"));
                fs::write(&copy, format!("#line 1 \"{}\"\n{text}", f.display())).unwrap();
                copy
            }
            None => f.clone(),
        };
        let entries: Vec<String> = names
            .iter()
            .map(|n| format!("    EMU_KERNEL({n}),"))
            .collect();
        let cpp = format!(
            "#include \"{}\"\nextern \"C\" const EmuKernel emu_kernels_{stem}[] = {{\n{}\n}};\n",
            compiled.display(),
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
