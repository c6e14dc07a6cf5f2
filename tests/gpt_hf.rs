//! Hugging Face GPT-2 checkpoints: round trips through `write_hf`/`read_hf`, files assembled as
//! `transformers` writes them (prefix, fp16, mask buffers, tied head), and every refusal naming
//! the tensor at fault.

use std::collections::HashMap;
use std::path::Path;

use half::f16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use tidemem::models::gpt::{read_hf, write_hf, GptConfig, HfWeights};
use tidemem::rng::{Rng, Xoshiro256};
use tidemem::Error;

fn tiny() -> GptConfig {
    GptConfig {
        layers: 2,
        channels: 64,
        heads: 4,
        vocab: 50,
        max_seq: 16,
        eps: 1e-5,
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Seeded values for every parameter of `cfg`, in the crate's orientation.
fn random_params(cfg: &GptConfig, seed: u64) -> HashMap<String, Vec<f32>> {
    let mut rng = Xoshiro256::new(seed);
    cfg.param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let v = (0..numel(&shape))
                .map(|_| rng.uniform_f32(-1.0, 1.0))
                .collect();
            (name, v)
        })
        .collect()
}

fn is_conv1d(name: &str) -> bool {
    [
        "c_attn.weight",
        "attn.c_proj.weight",
        "c_fc.weight",
        "mlp.c_proj.weight",
    ]
    .iter()
    .any(|s| name.ends_with(s))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn write_read_is_bit_exact_and_rewrites_the_same_bytes() {
    let cfg = tiny();
    let params = random_params(&cfg, 7);
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.safetensors");
    let mut asked = Vec::new();
    write_hf(&a, &cfg, |name| {
        asked.push(name.to_string());
        Ok(params[name].clone())
    })
    .unwrap();
    let order: Vec<String> = cfg.param_shapes().into_iter().map(|(n, _)| n).collect();
    assert_eq!(asked, order, "asked once each, in registration order");

    let w = read_hf(&a, Some(4), Some(&cfg)).unwrap();
    assert_eq!(w.config(), &cfg);
    assert_eq!(w.len(), order.len());
    assert!(!w.is_empty());
    assert_eq!(w.names().collect::<Vec<_>>(), order);
    for name in &order {
        assert_eq!(bits(w.get(name).unwrap()), bits(&params[name]), "{name}");
        let init = w.init(name).unwrap();
        assert_eq!(init.value(5).to_bits(), params[name][5].to_bits());
    }
    assert!(w.get("lm_head.weight").is_none() && w.init("h.2.ln_1.weight").is_none());

    // The file as transformers sees it: no prefix, Conv1D weights [in, out], no head.
    let bytes = std::fs::read(&a).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), order.len());
    assert_eq!(
        st.tensor("h.1.attn.c_attn.weight").unwrap().shape(),
        [64, 192]
    );
    assert_eq!(
        st.tensor("h.1.mlp.c_proj.weight").unwrap().shape(),
        [256, 64]
    );
    assert_eq!(
        st.tensor("h.1.attn.c_attn.weight").unwrap().dtype(),
        Dtype::F32
    );
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    assert_eq!(meta.get("format").map(String::as_str), Some("pt"));

    // Read, write again: the same bytes; and heads default to 64 channels each.
    let b = dir.path().join("b.safetensors");
    write_hf(&b, &cfg, |name| Ok(w.get(name).unwrap().to_vec())).unwrap();
    assert_eq!(std::fs::read(&b).unwrap(), bytes);
    let again = read_hf(&b, None, None).unwrap();
    assert_eq!(
        again.config(),
        &GptConfig {
            heads: 1,
            ..cfg.clone()
        }
    );
    let c = dir.path().join("c.safetensors");
    write_hf(&c, again.config(), |name| {
        Ok(again.get(name).unwrap().to_vec())
    })
    .unwrap();
    assert_eq!(std::fs::read(&c).unwrap(), bytes);
}

#[test]
fn a_wrong_length_is_refused_and_the_earlier_file_stays() {
    let cfg = tiny();
    let params = random_params(&cfg, 8);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.safetensors");
    write_hf(&p, &cfg, |name| Ok(params[name].clone())).unwrap();
    let before = std::fs::read(&p).unwrap();
    let err = write_hf(&p, &cfg, |name| {
        let mut v = params[name].clone();
        if name == "h.1.mlp.c_fc.bias" {
            v.pop();
        }
        Ok(v)
    })
    .unwrap_err();
    assert!(
        matches!(&err, Error::Checkpoint { what, .. } if what.contains("'h.1.mlp.c_fc.bias'")),
        "{err}"
    );
    let failing = write_hf(&p, &cfg, |name| match name {
        "ln_f.bias" => Err(Error::InvalidArgument("no values".into())),
        _ => Ok(params[name].clone()),
    });
    assert!(matches!(failing, Err(Error::InvalidArgument(m)) if m == "no values"));
    assert_eq!(std::fs::read(&p).unwrap(), before);
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no partial file"
    );
    let bad = GptConfig { heads: 5, ..cfg };
    assert!(write_hf(dir.path().join("x"), &bad, |_| Ok(Vec::new())).is_err());
}

/// One tensor of an assembled file.
struct T {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect()
}

/// The tensors of a `transformers` GPT-2 checkpoint of `cfg` in fp16, as the file orients
/// them, with the causal-mask buffers and the tied head; the names carry `prefix`.
fn hf_file(cfg: &GptConfig, prefix: &str, seed: u64) -> Vec<T> {
    let mut rng = Xoshiro256::new(seed);
    let mut out = Vec::new();
    for (name, shape) in cfg.param_shapes() {
        let shape: Vec<usize> = if is_conv1d(&name) {
            shape.iter().rev().copied().collect()
        } else {
            shape
        };
        let v: Vec<f32> = (0..numel(&shape))
            .map(|_| rng.uniform_f32(-2.0, 2.0))
            .collect();
        out.push(T {
            name: format!("{prefix}{name}"),
            dtype: Dtype::F16,
            shape,
            data: f16_bytes(&v),
        });
    }
    let t = cfg.max_seq;
    for i in 0..cfg.layers {
        out.push(T {
            name: format!("{prefix}h.{i}.attn.bias"),
            dtype: Dtype::BOOL,
            shape: vec![1, 1, t, t],
            data: (0..t * t).map(|k| u8::from(k % t <= k / t)).collect(),
        });
        out.push(T {
            name: format!("{prefix}h.{i}.attn.masked_bias"),
            dtype: Dtype::F32,
            shape: vec![],
            data: (-1e4f32).to_le_bytes().to_vec(),
        });
    }
    let wte = out.iter().find(|t| t.name.ends_with("wte.weight")).unwrap();
    out.push(T {
        name: "lm_head.weight".into(),
        dtype: wte.dtype,
        shape: wte.shape.clone(),
        data: wte.data.clone(),
    });
    out
}

fn save(path: &Path, tensors: &[T]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let v = TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap();
            (t.name.clone(), v)
        })
        .collect();
    let meta = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    std::fs::write(path, safetensors::serialize(views, &meta).unwrap()).unwrap();
}

fn widen(t: &T) -> Vec<f32> {
    t.data
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

#[test]
fn imports_transformers_files_with_or_without_the_prefix() {
    let cfg = tiny();
    let dir = tempfile::tempdir().unwrap();
    for prefix in ["transformer.", ""] {
        let tensors = hf_file(&cfg, prefix, 11);
        let p = dir.path().join("hf.safetensors");
        save(&p, &tensors);
        let w: HfWeights = read_hf(&p, None, None).unwrap();
        assert_eq!(
            w.config(),
            &GptConfig {
                heads: 1,
                ..cfg.clone()
            }
        );
        let w = read_hf(&p, Some(4), None).unwrap();
        assert_eq!(w.config(), &cfg);
        let file = |name: &str| {
            let t = tensors
                .iter()
                .find(|t| t.name == format!("{prefix}{name}"))
                .unwrap();
            (widen(t), t.shape.clone())
        };
        // One Conv1D element explicitly: crate weight[o][i] == file[i][o].
        let (f, shape) = file("h.1.attn.c_attn.weight");
        assert_eq!(shape, [64, 192]);
        let crate_w = w.get("h.1.attn.c_attn.weight").unwrap();
        let (o, i) = (150, 17);
        assert_eq!(crate_w[o * 64 + i].to_bits(), f[i * 192 + o].to_bits());
        // Every element of every parameter, f16 widened exactly.
        for (name, cshape) in cfg.param_shapes() {
            let (f, fshape) = file(&name);
            let got = w.get(&name).unwrap();
            if is_conv1d(&name) {
                let (rows, cols) = (fshape[0], fshape[1]);
                assert_eq!(cshape, [cols, rows]);
                for r in 0..rows {
                    for c in 0..cols {
                        assert_eq!(got[c * rows + r].to_bits(), f[r * cols + c].to_bits());
                    }
                }
            } else {
                assert_eq!(bits(got), bits(&f), "{name}");
            }
        }
        // bf16 and f32 are read too.
        let mut mixed = hf_file(&cfg, prefix, 12);
        for t in mixed.iter_mut().filter(|t| t.name.ends_with("ln_f.weight")) {
            let v = widen(t);
            t.dtype = Dtype::BF16;
            t.data = v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect();
        }
        for t in mixed
            .iter_mut()
            .filter(|t| t.name.ends_with("h.0.ln_2.bias"))
        {
            t.dtype = Dtype::F32;
            t.data = widen(t).iter().flat_map(|x| x.to_le_bytes()).collect();
        }
        save(&p, &mixed);
        let w = read_hf(&p, Some(4), Some(&cfg)).unwrap();
        let ln_f = mixed
            .iter()
            .find(|t| t.name.ends_with("ln_f.weight"))
            .unwrap();
        let want: Vec<f32> = ln_f
            .data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        assert_eq!(bits(w.get("ln_f.weight").unwrap()), bits(&want));
    }
}

/// Reads `tensors` and expects an `Error::Checkpoint` whose message holds every one of `needles`.
fn refused(tensors: &[T], heads: Option<usize>, expect: Option<&GptConfig>, needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.safetensors");
    save(&p, tensors);
    match read_hf(&p, heads, expect) {
        Err(Error::Checkpoint { what: m, .. }) => {
            for n in needles {
                assert!(m.contains(n), "{m:?} does not name {n:?}");
            }
        }
        other => panic!("expected Error::Checkpoint naming {needles:?}, got {other:?}"),
    }
}

fn find<'a>(tensors: &'a mut [T], name: &str) -> &'a mut T {
    tensors.iter_mut().find(|t| t.name == name).unwrap()
}

#[test]
fn refusals_name_the_tensor() {
    let cfg = tiny();
    for prefix in ["transformer.", ""] {
        let good = || hf_file(&cfg, prefix, 21);
        let q = |n: &str| format!("'{prefix}{n}'");

        // A Conv1D weight in the crate's orientation.
        let mut t = good();
        let w = find(&mut t, &format!("{prefix}h.1.mlp.c_fc.weight"));
        w.shape = vec![256, 64];
        let name = q("h.1.mlp.c_fc.weight");
        refused(
            &t,
            Some(4),
            None,
            &[&name, "[256, 64]", "expected [64, 256]"],
        );

        // A missing tensor.
        let mut t = good();
        t.retain(|t| t.name != format!("{prefix}h.1.ln_2.bias"));
        refused(&t, Some(4), Some(&cfg), &[&q("h.1.ln_2.bias"), "missing"]);

        // A missing block.
        let mut t = good();
        t.retain(|t| !t.name.starts_with(&format!("{prefix}h.0.")));
        refused(&t, Some(4), None, &[&format!("'{prefix}h.0.*'"), "missing"]);

        // An untied head.
        let mut t = good();
        find(&mut t, "lm_head.weight").data[6] ^= 1;
        refused(&t, Some(4), None, &["'lm_head.weight'", "untied"]);

        // A head of another shape.
        let mut t = good();
        find(&mut t, "lm_head.weight").shape = vec![64, 50];
        refused(&t, Some(4), None, &["'lm_head.weight'", "[64, 50]"]);

        // An unknown tensor, and a block beyond the others' parameters.
        let mut t = good();
        t.push(T {
            name: format!("{prefix}h.0.attn.rotary"),
            dtype: Dtype::F32,
            shape: vec![1],
            data: vec![0; 4],
        });
        refused(
            &t,
            Some(4),
            None,
            &[&q("h.0.attn.rotary"), "not a GPT-2 parameter"],
        );

        // Another element type.
        let mut t = good();
        let w = find(&mut t, &format!("{prefix}h.0.ln_1.weight"));
        w.dtype = Dtype::F64;
        w.data = vec![0; 64 * 8];
        refused(&t, Some(4), None, &[&q("h.0.ln_1.weight"), "F64"]);

        // Mixed prefixes: one tensor written the other way.
        let mut t = good();
        let w = find(&mut t, &format!("{prefix}h.1.ln_1.bias"));
        let other = if prefix.is_empty() {
            "transformer.h.1.ln_1.bias".to_string()
        } else {
            "h.1.ln_1.bias".to_string()
        };
        w.name = other.clone();
        refused(&t, Some(4), None, &[&format!("'{other}'"), "prefix"]);

        // A shape other than the expected one.
        let three = GptConfig {
            layers: 3,
            ..cfg.clone()
        };
        refused(&good(), None, Some(&three), &["layers 2 (expected 3)"]);
        refused(&good(), Some(8), Some(&cfg), &["heads"]);
        refused(
            &good(),
            Some(5),
            None,
            &["not a multiple of attention heads 5"],
        );
    }
    // Heads that cannot be inferred.
    let odd = GptConfig {
        channels: 40,
        ..cfg.clone()
    };
    refused(&hf_file(&odd, "", 1), None, None, &["40 channels", "heads"]);
    assert!(read_hf(hf_path_of(&hf_file(&odd, "", 1)).1, Some(4), None).is_ok());
}

/// Saves `tensors` to a fresh directory (kept alive by the returned guard).
fn hf_path_of(tensors: &[T]) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.safetensors");
    save(&p, tensors);
    (dir, p)
}

#[test]
fn garbage_truncated_and_missing_files_are_typed_errors() {
    let cfg = tiny();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g.safetensors");
    assert!(matches!(read_hf(&p, None, None), Err(Error::FileIo { .. })));
    let mut rng = Xoshiro256::new(3);
    for len in [0, 1, 7, 8, 100, 10_000] {
        std::fs::write(&p, rng.bytes(len)).unwrap();
        let r = read_hf(&p, None, None);
        assert!(matches!(r, Err(Error::Checkpoint { .. })), "{len}: {r:?}");
    }
    let params = random_params(&cfg, 4);
    write_hf(&p, &cfg, |name| Ok(params[name].clone())).unwrap();
    let whole = std::fs::read(&p).unwrap();
    for cut in [9, 100, whole.len() / 2, whole.len() - 1] {
        std::fs::write(&p, &whole[..cut]).unwrap();
        let r = read_hf(&p, None, None);
        assert!(matches!(r, Err(Error::Checkpoint { .. })), "{cut}: {r:?}");
    }
    // A header that claims an enormous tensor.
    let header =
        br#"{"wte.weight":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    std::fs::write(&p, bytes).unwrap();
    assert!(matches!(
        read_hf(&p, None, None),
        Err(Error::Checkpoint { .. })
    ));
}
