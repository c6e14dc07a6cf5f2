//! The crate's modules point one way.
//!
//! Every `src/**/*.rs` is read for paths into other top-level modules: `crate::<module>`
//! (`$crate::` in macros too, and `use crate::{a, b}` groups), and `super::` paths that climb
//! out of their top-level module. Comments (doc comments and intra-doc links included), string
//! and character literals are not code and are skipped. A module may import from its own layer
//! or a lower one ([`LAYERS`]); an import from a higher layer fails the test, naming the file,
//! the import and both layers. So does any cycle between top-level modules, whatever their
//! layers, any cycle between the files of one module (siblings: `models/gpt/model.rs` using
//! `super::plan` while `plan.rs` uses `super::model`), and a top-level module missing from the
//! table.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first: a module may import only from its own layer or a lower one, and
/// never in a cycle. Pure vocabulary at the bottom, the device and what runs on it next, then
/// the chunk memory system, what trains on it, and the models on top.
const LAYERS: &[(&str, &[&str])] = &[
    // pure vocabulary: units, element types, device ids, errors, the bounds on sizes, the one
    // PRNG, tensor ids and the tensor state machine
    (
        "vocabulary",
        &[
            "units",
            "dtype",
            "device_id",
            "error",
            "limits",
            "rng",
            "tensor",
        ],
    ),
    // where bytes live and how they move, and the kernels the devices compile
    ("device", &["device", "kernels"]),
    // one op = one file: descriptors, typed wrappers, CPU twins
    ("ops", &["ops"]),
    // the chunk memory system, the pure scheduler it runs, files, profiles, input data and the
    // metrics scored on it
    (
        "memory",
        &["chunk", "tide", "checkpoint", "profile", "data", "metrics"],
    ),
    // what trains on chunks: the optimizer, collectives, the placement simulator
    ("training", &["optim", "comm", "simulate"]),
    // sharded and distributed training, embeddings, the trainer API over both stores, layers
    (
        "distributed",
        &["zero", "embedding", "store", "nn", "parallel"],
    ),
    // models and trainers, and the prelude that gathers what a trainer imports
    ("models", &["demo", "models", "prelude"]),
];

#[test]
fn modules_import_only_from_their_layer_or_below_and_never_in_a_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    collect(&root.join("src"), &mut files);
    files.sort();
    let sources: Vec<(String, String)> = files
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(root).expect("under the crate root");
            let rel = rel.to_string_lossy().replace('\\', "/");
            (rel, std::fs::read_to_string(p).expect("readable source"))
        })
        .collect();
    assert!(
        sources.len() > 20,
        "found only {} source files",
        sources.len()
    );
    let (problems, edges) = analyse(&sources);
    // the dependency table, for `cargo test --test layering -- --nocapture`
    let mut table: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in edges.keys() {
        table.entry(a).or_default().push(b);
    }
    for (l, (name, modules)) in LAYERS.iter().enumerate() {
        for m in *modules {
            if let Some(deps) = table.get(m) {
                println!("L{l} {name:<12} {m:<10} -> {}", deps.join(", "));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} layering problem(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

// The checker on made-up sources: it must find what it is for, and nothing else.

/// A crate root declaring the modules of the made-up sources.
const LIB: (&str, &str) = (
    "src/lib.rs",
    "pub mod chunk;\npub mod tide;\npub mod tensor;\npub mod zero;\npub mod device;\n\
     pub mod error;\npub use error::{Error, Result};",
);

fn sources(files: &[(&str, &str)]) -> Vec<(String, String)> {
    std::iter::once(&LIB)
        .chain(files)
        .map(|(p, s)| (p.to_string(), s.to_string()))
        .collect()
}

/// Downward imports, paths inside a module, comments, strings and inline test modules.
fn clean() -> Vec<(String, String)> {
    sources(&[
        (
            "src/chunk/mod.rs",
            "//! see [`crate::zero::ZeroManager`]\n\
             use crate::tide::Scheduler;\nuse crate::{error::Error, tensor::TensorId};\n\
             use super::tensor::Stage; /* crate::zero */\n\
             const S: &str = \"crate::zero::X\"; const C: char = '\"';\n\
             fn f<'a>(x: &'a str) -> crate::Result<()> { let _ = x; Ok(()) }\n\
             mod tests { use super::*; use super::super::tensor::X; }",
        ),
        (
            "src/chunk/manager/moves.rs",
            "use super::super::plan::ChunkPlan;",
        ),
        ("src/tide.rs", "use crate::tensor::ChunkKind;"),
        ("src/zero/mod.rs", "use crate::chunk::ChunkManager;"),
    ])
}

/// One upward import, on line 3.
fn upward() -> Vec<(String, String)> {
    sources(&[("src/tensor.rs", "\n\nuse crate::chunk::Slot;")])
}

#[test]
fn the_checker_passes_downward_imports_and_skips_comments_and_literals() {
    let p = check(&clean());
    assert!(p.is_empty(), "{p:#?}");
}

#[test]
fn the_checker_names_the_file_the_import_and_both_layers() {
    let p = check(&upward());
    assert_eq!(p.len(), 1, "{p:#?}");
    for part in [
        "src/tensor.rs:3",
        "crate::chunk",
        "tensor (layer 0, vocabulary)",
        "chunk (layer 3, memory)",
    ] {
        assert!(p[0].contains(part), "{:?} lacks {part:?}", p[0]);
    }
}

#[test]
fn the_checker_reads_use_groups_root_reexports_and_dollar_crate() {
    let p = check(&sources(&[
        ("src/error.rs", "use crate::{Result, zero::{A, B}};"),
        (
            "src/device/mod.rs",
            "macro_rules! m { () => { $crate::chunk::X } }",
        ),
    ]));
    assert_eq!(p.len(), 2, "{p:#?}");
    assert!(p[0].contains("src/error.rs:1") && p[0].contains("zero (layer 5"));
    assert!(p[0].contains("`crate::zero`"), "{}", p[0]);
    assert!(p[1].contains("src/device/mod.rs:1") && p[1].contains("chunk (layer 3"));
}

#[test]
fn the_checker_follows_super_out_of_a_top_level_module() {
    let p = check(&sources(&[
        (
            "src/chunk/manager/moves.rs",
            "use super::super::super::zero::Z;",
        ),
        ("src/tensor.rs", "mod inner { }\nuse super::chunk::C;"),
    ]));
    assert_eq!(p.len(), 2, "{p:#?}");
    assert!(p[0].contains("src/chunk/manager/moves.rs:1"), "{}", p[0]);
    assert!(p[0].contains("super::super::super::zero"), "{}", p[0]);
    assert!(p[1].contains("src/tensor.rs:2") && p[1].contains("super::chunk"));
}

#[test]
fn the_checker_finds_a_cycle_within_one_layer() {
    let p = check(&sources(&[
        ("src/chunk/mod.rs", "use crate::tide::Scheduler;"),
        ("src/tide/trace.rs", "use crate::chunk::ChunkKind;"),
    ]));
    assert_eq!(p.len(), 1, "{p:#?}");
    assert!(p[0].contains("cycle") && p[0].contains("chunk") && p[0].contains("tide"));
    assert!(p[0].contains("src/tide/trace.rs"), "{}", p[0]);
}

#[test]
fn the_checker_finds_a_cycle_between_the_files_of_a_module() {
    let files = [
        (
            "src/zero/mod.rs",
            "mod a;\nmod b;\nmod c;\npub use c::Thing;",
        ),
        ("src/zero/a.rs", "use super::b::B;\nuse super::Thing;"),
        ("src/zero/b.rs", "use crate::zero::{a::A, c::C};"),
        (
            "src/zero/c.rs",
            "use super::super::tensor::X;\nmod tests { use super::super::a::A; }",
        ),
    ];
    let p = check(&sources(&files));
    assert_eq!(p.len(), 1, "{p:#?}");
    assert!(p[0].contains("module zero {a, b}"), "{}", p[0]);
    assert!(p[0].contains("a -> b at src/zero/a.rs:1"), "{}", p[0]);
    assert!(p[0].contains("b -> a at src/zero/b.rs:1"), "{}", p[0]);
    // c is reached from both (through the re-export from a) and reaches neither: no cycle
    let mut files = files;
    files[2] = ("src/zero/b.rs", "use super::c::C;");
    assert!(check(&sources(&files)).is_empty());
}

#[test]
fn the_checker_wants_every_module_in_the_table() {
    let p = check(&[
        ("src/lib.rs".into(), "pub mod gizmo;".into()),
        ("src/gizmo.rs".into(), String::new()),
    ]);
    assert_eq!(p.len(), 1, "{p:#?}");
    assert!(p[0].contains("gizmo") && p[0].contains("layer table"));
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("readable source directory") {
        let p = e.expect("directory entry").path();
        if p.is_dir() {
            collect(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The layer of a top-level module.
fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, ms)| ms.contains(&module))
}

fn describe(module: &str) -> String {
    match layer_of(module) {
        Some(l) => format!("{module} (layer {l}, {})", LAYERS[l].0),
        None => format!("{module} (no layer)"),
    }
}

/// One path into another top-level module.
struct Import {
    file: String,
    line: usize,
    from: String,
    to: String,
    text: String,
}

/// Imports between top-level modules: (importer, imported) to the `file:line`s of the imports.
type Edges = BTreeMap<(String, String), Vec<String>>;

/// Every layering problem of `sources` (`(path from the crate root, text)`; `src/lib.rs`
/// declares the top-level modules and the root re-exports), as messages.
fn check(sources: &[(String, String)]) -> Vec<String> {
    analyse(sources).0
}

/// The problems of [`check`], and the imports between top-level modules.
fn analyse(sources: &[(String, String)]) -> (Vec<String>, Edges) {
    let mut problems = Vec::new();
    let lib = sources
        .iter()
        .find(|(p, _)| p == "src/lib.rs")
        .map(|(_, s)| strip(s))
        .unwrap_or_default();
    let (modules, reexports) = crate_root(&lib);
    for m in &modules {
        if layer_of(m).is_none() {
            problems.push(format!(
                "top-level module `{m}` is not in the layer table of tests/layering.rs"
            ));
        }
    }
    let mut imports = Vec::new();
    for (file, text) in sources {
        if let Some(path) = module_path(file) {
            imports.extend(imports_of(file, &path, &strip(text), &reexports));
        }
    }
    let mut edges = Edges::new();
    for i in &imports {
        let (Some(a), Some(b)) = (layer_of(&i.from), layer_of(&i.to)) else {
            if layer_of(&i.to).is_none() && !modules.contains(&i.to) {
                problems.push(format!(
                    "{}:{}: `{}` names `{}`, which is not a top-level module",
                    i.file, i.line, i.text, i.to
                ));
            }
            continue;
        };
        if b > a {
            problems.push(format!(
                "{}:{}: `{}`: {} imports from {}, a higher layer",
                i.file,
                i.line,
                i.text,
                describe(&i.from),
                describe(&i.to)
            ));
        }
        let at = format!("{}:{}", i.file, i.line);
        let e = edges.entry((i.from.clone(), i.to.clone())).or_default();
        if !e.contains(&at) {
            e.push(at);
        }
    }
    for cycle in cycles(&edges) {
        let via: Vec<String> = edges
            .iter()
            .filter(|((a, b), _)| cycle.contains(a) && cycle.contains(b))
            .map(|((a, b), at)| format!("{a} -> {b} at {}", at.join(", ")))
            .collect();
        problems.push(format!(
            "cycle between top-level modules {{{}}}: {}",
            cycle.join(", "),
            via.join("; ")
        ));
    }
    problems.extend(sibling_cycles(sources));
    (problems, edges)
}

/// Cycles between the files of one module: for every module with children, the imports
/// among its children (`super::b` from `a`, `crate::m::b` from `m::a`, through the module's
/// own `pub use b::Name` re-exports), and the cycles among them, as messages.
fn sibling_cycles(sources: &[(String, String)]) -> Vec<String> {
    let files: Vec<(Vec<String>, String, String)> = sources
        .iter()
        .filter_map(|(f, t)| Some((module_path(f)?, f.clone(), strip(t))))
        .collect();
    let known: BTreeSet<Vec<String>> = files.iter().map(|f| f.0.clone()).collect();
    // a module's `use child::Name` re-exports: (module, Name) -> child
    let mut reexports: BTreeMap<(Vec<String>, String), String> = BTreeMap::new();
    for (path, _, text) in &files {
        let t = tokens(text);
        for k in 0..t.len() {
            let child = t.get(k + 1).map(|x| x.1.clone()).unwrap_or_default();
            let mut sub = path.clone();
            sub.push(child.clone());
            if t[k].1 != "use" || !known.contains(&sub) || t.get(k + 2).is_none_or(|x| x.1 != "::")
            {
                continue;
            }
            let mut j = k + 3;
            while j < t.len() && t[j].1 != ";" {
                if is_ident(&t[j].1) && t.get(j + 1).is_none_or(|n| n.1 != "::") {
                    reexports.insert((path.clone(), t[j].1.clone()), child.clone());
                }
                j += 1;
            }
        }
    }
    // (parent, from, to) -> file:line of the imports
    let mut edges: BTreeMap<(Vec<String>, String), Edges> = BTreeMap::new();
    for (path, file, text) in &files {
        for SrcPath {
            line,
            segments: target,
            ..
        } in absolute_paths(path, text, true)
        {
            let common = path.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common == 0 || common >= path.len() || common >= target.len() {
                continue;
            }
            let parent = path[..common].to_vec();
            let mut child = parent.clone();
            child.push(target[common].clone());
            let to = if known.contains(&child) {
                target[common].clone()
            } else if let Some(c) = reexports.get(&(parent.clone(), target[common].clone())) {
                c.clone()
            } else {
                continue;
            };
            if to == path[common] {
                continue;
            }
            let at = format!("{file}:{line}");
            let e = edges.entry((parent, String::new())).or_default();
            let e = e.entry((path[common].clone(), to)).or_default();
            if !e.contains(&at) {
                e.push(at);
            }
        }
    }
    let mut out = Vec::new();
    for ((parent, _), e) in &edges {
        for cycle in cycles(e) {
            let via: Vec<String> = e
                .iter()
                .filter(|((a, b), _)| cycle.contains(a) && cycle.contains(b))
                .map(|((a, b), at)| format!("{a} -> {b} at {}", at.join(", ")))
                .collect();
            out.push(format!(
                "cycle between the files of module {} {{{}}}: {}",
                parent.join("::"),
                cycle.join(", "),
                via.join("; ")
            ));
        }
    }
    out
}

/// Every `crate::` and `super::` path of a file (module `path`, text stripped of comments and
/// literals) as the absolute path it names, with its line and how it starts (`crate::`,
/// `super::super::`): `super::{a::X, b}` in `m::c` gives `[m, a, X]` and `[m, b]`. Paths in
/// unit-test modules are left out when `skip_tests` says so.
fn absolute_paths(path: &[String], text: &str, skip_tests: bool) -> Vec<SrcPath> {
    let t = tokens(text);
    let mut out = Vec::new();
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    for k in 0..t.len() {
        let tok = t[k].1.as_str();
        match tok {
            "{" => depth += 1,
            "}" => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|m| m.1 > depth) {
                    inline.pop();
                }
            }
            "mod" if t.get(k + 2).is_some_and(|x| x.1 == "{") => {
                inline.push((t[k + 1].1.clone(), depth + 1));
            }
            _ => {}
        }
        let prev_is_path = k > 0 && t[k - 1].1 == "::";
        let starts = (tok == "crate" || tok == "$crate" || tok == "super") && !prev_is_path;
        let in_tests = skip_tests && inline.iter().any(|m| m.0 == "tests");
        if !starts || in_tests || t.get(k + 1).is_none_or(|x| x.1 != "::") {
            continue;
        }
        let (mut here, mut start) = (Vec::new(), String::new());
        let mut j = k;
        if tok == "super" {
            here = path.to_vec();
            here.extend(inline.iter().map(|m| m.0.clone()));
            while t.get(j).is_some_and(|x| x.1 == "super")
                && t.get(j + 1).is_some_and(|x| x.1 == "::")
            {
                here.pop();
                start.push_str("super::");
                j += 2;
            }
        } else {
            start.push_str("crate::");
            j = k + 2;
        }
        // the named segments, then a group's first segments
        let climbed = here.len();
        while t.get(j).is_some_and(|x| is_ident(&x.1)) && t.get(j + 1).is_some_and(|x| x.1 == "::")
        {
            here.push(t[j].1.clone());
            j += 2;
        }
        let (firsts, _) = first_segments(&t, j);
        for f in firsts {
            let mut p = here.clone();
            p.push(f);
            out.push(SrcPath {
                line: t[k].0,
                start: start.clone(),
                climbed,
                segments: p,
            });
        }
    }
    out
}

/// One path of a file, as [`absolute_paths`] reads it.
struct SrcPath {
    line: usize,
    /// How the text starts: `crate::` or `super::` as often as it climbs.
    start: String,
    /// Segments of `segments` the path climbed to (0 from the crate root).
    climbed: usize,
    /// The absolute path.
    segments: Vec<String>,
}

/// The top-level modules `lib.rs` declares, and its `pub use module::Name` re-exports.
fn crate_root(lib: &str) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let t = tokens(lib);
    let (mut modules, mut reexports) = (BTreeSet::new(), BTreeMap::new());
    for k in 0..t.len() {
        if t[k].1 == "mod" && k + 2 < t.len() && t[k + 2].1 == ";" {
            modules.insert(t[k + 1].1.clone());
        }
        if t[k].1 == "use" && k + 2 < t.len() && t[k + 2].1 == "::" {
            let module = t[k + 1].1.clone();
            let mut j = k + 3;
            while j < t.len() && t[j].1 != ";" {
                if is_ident(&t[j].1) && t.get(j + 1).is_none_or(|n| n.1 != "::") {
                    reexports.insert(t[j].1.clone(), module.clone());
                }
                j += 1;
            }
        }
    }
    (modules, reexports)
}

/// The module path of a file under `src/`: `src/chunk/manager/moves.rs` is
/// `[chunk, manager, moves]`, `src/chunk/mod.rs` is `[chunk]`. `None` for the crate root.
fn module_path(file: &str) -> Option<Vec<String>> {
    let rel = file.strip_prefix("src/")?.strip_suffix(".rs")?;
    let mut parts: Vec<String> = rel.split('/').map(str::to_string).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    match parts.as_slice() {
        [] => None,
        [one] if one == "lib" || one == "main" => None,
        _ => Some(parts),
    }
}

/// The paths of one file (stripped of comments and literals) into other top-level modules.
fn imports_of(
    file: &str,
    path: &[String],
    text: &str,
    reexports: &BTreeMap<String, String>,
) -> Vec<Import> {
    let mut out = Vec::new();
    for p in absolute_paths(path, text, false) {
        // still inside its own top-level module
        if p.climbed > 0 {
            continue;
        }
        let name = &p.segments[0];
        let to = reexports.get(name).cloned().unwrap_or(name.clone());
        if to == path[0] || name == "self" || name == "crate" {
            continue;
        }
        out.push(Import {
            file: file.to_string(),
            line: p.line,
            from: path[0].clone(),
            to,
            text: format!("{}{name}", p.start),
        });
    }
    out
}

/// The first segment of the path at token `j` (`chunk` of `chunk::X`), or of every entry of a
/// use group there (`chunk` and `tide` of `{chunk::X, tide::{Y, Z}}`), and the token after it.
fn first_segments(t: &[(usize, String)], mut j: usize) -> (Vec<String>, usize) {
    if t.get(j).is_none_or(|x| x.1 != "{") {
        let first = t.get(j).filter(|x| is_ident(&x.1)).map(|x| x.1.clone());
        return (first.into_iter().collect(), j);
    }
    let (mut firsts, mut d, mut expect) = (Vec::new(), 0, true);
    while j < t.len() {
        match t[j].1.as_str() {
            "{" => {
                d += 1;
                if d == 1 {
                    expect = true;
                }
            }
            "}" => {
                d -= 1;
                if d == 0 {
                    break;
                }
            }
            "," if d == 1 => expect = true,
            s if d == 1 && expect && is_ident(s) => {
                firsts.push(s.to_string());
                expect = false;
            }
            _ if d == 1 => expect = false,
            _ => {}
        }
        j += 1;
    }
    (firsts, j + 1)
}

fn is_ident(s: &str) -> bool {
    s.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
        && s.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// Tokens with their line numbers: identifiers (`$crate` as one), `::`, and single punctuation.
fn tokens(text: &str) -> Vec<(usize, String)> {
    let c: Vec<char> = text.chars().collect();
    let (mut out, mut line, mut i) = (Vec::new(), 1, 0);
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch.is_alphanumeric() || ch == '_' || ch == '$' {
            let s = i;
            i += 1;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push((line, c[s..i].iter().collect()));
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push((line, "::".into()));
            i += 2;
        } else {
            out.push((line, ch.to_string()));
            i += 1;
        }
    }
    out
}

/// `text` with comments, string literals and character literals blanked (newlines kept, so
/// lines still count).
fn strip(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, s: &[char]| {
        out.extend(s.iter().map(|&x| if x == '\n' { '\n' } else { ' ' }));
    };
    let mut i = 0;
    while i < c.len() {
        let rest = &c[i..];
        let prev_ident = i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_');
        let end = if rest.starts_with(&['/', '/']) {
            rest.iter().position(|&x| x == '\n').unwrap_or(rest.len())
        } else if rest.starts_with(&['/', '*']) {
            // nested block comments
            let (mut d, mut j) = (0, 0);
            loop {
                if j + 1 >= rest.len() {
                    break rest.len();
                }
                if rest[j] == '/' && rest[j + 1] == '*' {
                    d += 1;
                    j += 2;
                } else if rest[j] == '*' && rest[j + 1] == '/' {
                    d -= 1;
                    j += 2;
                    if d == 0 {
                        break j;
                    }
                } else {
                    j += 1;
                }
            }
        } else if !prev_ident && raw_string_start(rest).is_some() {
            let (open, hashes) = raw_string_start(rest).expect("checked");
            let mut j = open;
            loop {
                if j >= rest.len() {
                    break rest.len();
                }
                if rest[j] == '"'
                    && rest[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == '#')
                        .count()
                        == hashes
                {
                    break j + 1 + hashes;
                }
                j += 1;
            }
        } else if rest[0] == '"' || (!prev_ident && rest.starts_with(&['b', '"'])) {
            let mut j = if rest[0] == 'b' { 2 } else { 1 };
            while j < rest.len() && rest[j] != '"' {
                j += if rest[j] == '\\' { 2 } else { 1 };
            }
            (j + 1).min(rest.len())
        } else if rest[0] == '\'' || (!prev_ident && rest.starts_with(&['b', '\''])) {
            let q = if rest[0] == 'b' { 1 } else { 0 };
            // a character literal, or a lifetime (left alone)
            if rest.get(q + 1) == Some(&'\\') {
                let mut j = q + 2;
                while j < rest.len() && rest[j] != '\'' {
                    j += 1;
                }
                (j + 1).min(rest.len())
            } else if rest.get(q + 2) == Some(&'\'') {
                q + 3
            } else {
                0
            }
        } else {
            0
        };
        if end == 0 {
            out.push(c[i]);
            i += 1;
        } else {
            blank(&mut out, &rest[..end]);
            i += end;
        }
    }
    out
}

/// For `r"`, `r#"`, `br##"`...: the index just past the opening quote, and the `#` count.
fn raw_string_start(s: &[char]) -> Option<(usize, usize)> {
    let mut j = match s {
        ['b', 'r', ..] => 2,
        ['r', ..] => 1,
        _ => return None,
    };
    let mut hashes = 0;
    while s.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    (s.get(j) == Some(&'"')).then_some((j + 1, hashes))
}

/// The strongly connected components with more than one module, each sorted, in order.
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.keys().flat_map(|(a, b)| [a, b]).collect();
    let reach = |from: &String| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(n) = stack.pop() {
            for (a, b) in edges.keys() {
                if *a == n && seen.insert(b.clone()) {
                    stack.push(b.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> =
        nodes.iter().map(|&n| (n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for &n in &nodes {
        if done.contains(n) || !reached[n].contains(n) {
            continue;
        }
        let comp: Vec<String> = nodes
            .iter()
            .filter(|&&m| reached[n].contains(m) && reached[m].contains(n))
            .map(|&m| m.clone())
            .collect();
        done.extend(comp.iter().cloned());
        if comp.len() > 1 {
            out.push(comp);
        }
    }
    out
}
