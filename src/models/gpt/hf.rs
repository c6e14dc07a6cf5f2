//! Hugging Face GPT-2 checkpoints in and out: the `model.safetensors` files that
//! `transformers` reads and writes, with the crate's parameter names ([`GptConfig::param_shapes`]).
//!
//! The files name the tensors as the crate does (`wte.weight`, `h.{i}.attn.c_attn.weight`, ...),
//! some with a `transformer.` prefix, but store the four `Conv1D` weights of each block
//! (`attn.c_attn`, `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`) as `[inputs, outputs]`, the transpose
//! of the crate's `[outputs, inputs]`: [`read_hf`] and [`write_hf`] transpose them. [`read_hf`]
//! widens F32, F16 and BF16 files to f32 exactly, skips the causal-mask buffers older files carry
//! (`h.{i}.attn.bias`, `h.{i}.attn.masked_bias`) and accepts an `lm_head.weight` only when it is
//! the token embedding (GPT-2's head is tied to `wte`). [`write_hf`] writes f32, without the
//! prefix and without the tied head, so that a file read and written again is the same bytes.
//!
//! ```
//! use tidemem::models::gpt::{read_hf, write_hf, GptConfig};
//!
//! # fn main() -> tidemem::Result<()> {
//! let cfg = GptConfig { layers: 1, channels: 8, heads: 2, vocab: 10, max_seq: 4, eps: 1e-5 };
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("model.safetensors");
//! // Each parameter's values in the crate's orientation: here element i of any tensor is i / 8.
//! let shapes = cfg.param_shapes();
//! write_hf(&path, &cfg, |name| {
//!     let shape = &shapes.iter().find(|(n, _)| n == name).unwrap().1;
//!     Ok((0..shape.iter().product::<usize>()).map(|i| i as f32 / 8.0).collect())
//! })?;
//!
//! // Heads cannot be inferred from 8 channels (GPT-2 has 64 per head): name them.
//! let weights = read_hf(&path, Some(2), Some(&cfg))?;
//! assert_eq!(weights.config(), &cfg);
//! assert_eq!(weights.len(), shapes.len());
//! assert_eq!(weights.get("h.0.mlp.c_fc.weight").unwrap()[9], 9.0 / 8.0);
//! // An initializer for the parameter store: element index → value.
//! let init = weights.init("wte.weight").unwrap();
//! assert_eq!(init.value(3), 3.0 / 8.0);
//! # Ok(())
//! # }
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use safetensors::Dtype;

use super::GptConfig;
use crate::checkpoint::{bad, from_st_dtype, io, write_unpersisted, Entry, Info, Reader};
use crate::dtype::decode_f32;
use crate::error::{Error, Result};
use crate::tensor::Init;

/// The prefix some files (those saved from `GPT2LMHeadModel`) put before every name.
const PREFIX: &str = "transformer.";
/// The LM head, tied to `wte.weight` in GPT-2; never prefixed.
const HEAD: &str = "lm_head.weight";
/// The channels per head of every released GPT-2, used when the heads are not given.
const HEAD_DIM: usize = 64;

/// A GPT-2 checkpoint read by [`read_hf`]: the shape it was read with and every parameter's
/// values, in the crate's orientation (linear weights `[outputs, inputs]`).
#[derive(Clone)]
pub struct HfWeights {
    config: GptConfig,
    /// `(name, values)` in [`GptConfig::param_shapes`] order.
    params: Vec<(String, Arc<Vec<f32>>)>,
    index: HashMap<String, usize>,
}

impl HfWeights {
    /// The model's shape: inferred from the file, or the `expect` given to [`read_hf`].
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// The values of the parameter the crate names `name` (e.g. `h.0.attn.c_attn.weight`, as
    /// `[3C, C]`), row-major; `None` for a name the model does not have.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.index.get(name).map(|&i| self.params[i].1.as_slice())
    }

    /// An initializer giving element `i` of parameter `name` (sharing the values, not copying
    /// them), for registering the parameter in a store; indices past the end give NaN. `None` for
    /// a name the model does not have.
    pub fn init(&self, name: &str) -> Option<Init> {
        let values = Arc::clone(self.index.get(name).map(|&i| &self.params[i].1)?);
        Some(Init::Fn(Arc::new(move |i| {
            values.get(i).copied().unwrap_or(f32::NAN)
        })))
    }

    /// The number of parameters (tensors).
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether there are no parameters (never, for a checkpoint [`read_hf`] returned).
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// The parameters' names in registration order ([`GptConfig::param_shapes`]).
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.params.iter().map(|(n, _)| n.as_str())
    }
}

impl fmt::Debug for HfWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HfWeights")
            .field("config", &self.config)
            .field("tensors", &self.params.len())
            .finish()
    }
}

/// Whether the crate parameter `name` is a `Conv1D` weight, stored transposed in the files.
fn is_conv1d(name: &str) -> bool {
    [
        ".attn.c_attn.weight",
        ".attn.c_proj.weight",
        ".mlp.c_fc.weight",
        ".mlp.c_proj.weight",
    ]
    .iter()
    .any(|s| name.ends_with(s))
}

/// The shape of parameter `name` in a file, given its crate shape.
fn file_shape(name: &str, shape: &[usize]) -> Vec<usize> {
    if is_conv1d(name) {
        shape.iter().rev().copied().collect()
    } else {
        shape.to_vec()
    }
}

/// `src` (`rows × cols`, row-major) transposed to `cols × rows`, in tiles that stay in cache.
fn transpose(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const TILE: usize = 32;
    let mut dst = vec![0.0; src.len()];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    dst[c * rows + r] = src[r * cols + c];
                }
            }
        }
    }
    dst
}

/// The block index and the rest of a name `h.{i}.{rest}` (the index written without leading
/// zeros, as the files do).
fn block(name: &str) -> Option<(usize, &str)> {
    let (i, rest) = name.strip_prefix("h.")?.split_once('.')?;
    let canonical =
        !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()) && (i == "0" || !i.starts_with('0'));
    canonical.then(|| i.parse().ok().map(|i| (i, rest)))?
}

/// The tensors of a file under the crate's names (the prefix removed), each with the name the
/// file gives it.
struct Named<'a> {
    prefix: &'static str,
    tensors: BTreeMap<String, (String, &'a Info)>,
}

impl Named<'_> {
    /// The file's name for crate parameter `name`.
    fn file_name(&self, name: &str) -> String {
        match self.tensors.get(name) {
            Some((file, _)) => file.clone(),
            None => format!("{}{name}", self.prefix),
        }
    }

    /// Tensor `name` (a crate name) or an error naming it as the file would.
    fn get(&self, path: &Path, name: &str, why: &str) -> Result<&Info> {
        match self.tensors.get(name) {
            Some((_, info)) => Ok(info),
            None => Err(bad(
                path,
                format!("tensor '{}' is missing{why}", self.file_name(name)),
            )),
        }
    }
}

/// Sorts the file's tensors under the crate's names: all prefixed with `transformer.` or none
/// (the tied `lm_head.weight` is never prefixed).
fn strip_prefix<'a>(path: &Path, file: &'a Reader) -> Result<Named<'a>> {
    let names: Vec<&str> = file.names().collect();
    let body = names.iter().copied().filter(|&n| n != HEAD);
    let prefixed = body.clone().find(|n| n.starts_with(PREFIX));
    let plain = body.clone().find(|n| !n.starts_with(PREFIX));
    if let (Some(a), Some(b)) = (prefixed, plain) {
        return Err(bad(
            path,
            format!("tensor '{a}' has the '{PREFIX}' prefix but tensor '{b}' does not: a file uses it for every tensor or for none"),
        ));
    }
    let prefix = if prefixed.is_some() { PREFIX } else { "" };
    let mut tensors = BTreeMap::new();
    for name in names {
        let view = file
            .info(name)
            .ok_or_else(|| bad(path, format!("it has no tensor '{name}'")))?;
        let key = name.strip_prefix(prefix).unwrap_or(name);
        if let Some((other, _)) = tensors.insert(key.to_string(), (name.to_string(), view)) {
            return Err(bad(
                path,
                format!("tensors '{other}' and '{name}' are the same parameter"),
            ));
        }
    }
    Ok(Named { prefix, tensors })
}

/// Checks a tensor's shape and widens its values to f32 (exactly: F32, F16, BF16 only).
fn widen(file: &Reader, name: &str, view: &Info, want: &[usize]) -> Result<Vec<f32>> {
    let path = file.path();
    if view.shape() != want {
        let note = if is_conv1d(name) {
            " (Conv1D weights are stored [inputs, outputs])"
        } else {
            ""
        };
        return Err(bad(
            path,
            format!(
                "tensor '{name}' has shape {:?}, expected {want:?}{note}",
                view.shape()
            ),
        ));
    }
    let dtype = from_st_dtype(view.dtype()).ok_or_else(|| {
        bad(
            path,
            format!(
                "tensor '{name}' is {:?}: only F32, F16 and BF16 tensors are read",
                view.dtype()
            ),
        )
    })?;
    Ok(decode_f32(&file.read(name)?, dtype))
}

/// The model's shape: vocabulary and channels from `wte`, positions from `wpe`, blocks from the
/// `h.{i}` names, heads from `heads` or 64 channels each, checked against `expect`.
fn infer_config(
    path: &Path,
    named: &Named<'_>,
    heads: Option<usize>,
    expect: Option<&GptConfig>,
) -> Result<GptConfig> {
    let wte = named.get(
        path,
        "wte.weight",
        " (it gives the vocabulary and the channels)",
    )?;
    let &[vocab, channels] = wte.shape() else {
        return Err(bad(
            path,
            format!(
                "tensor '{}' has shape {:?}, expected [vocab, channels]",
                named.file_name("wte.weight"),
                wte.shape()
            ),
        ));
    };
    let wpe = named.get(path, "wpe.weight", " (it gives the positions)")?;
    let max_seq = match *wpe.shape() {
        [t, c] if c == channels => t,
        _ => {
            return Err(bad(
                path,
                format!(
                    "tensor '{}' has shape {:?}, expected [positions, {channels}]",
                    named.file_name("wpe.weight"),
                    wpe.shape()
                ),
            ))
        }
    };
    let blocks: BTreeSet<usize> = named
        .tensors
        .keys()
        .filter_map(|n| block(n))
        .map(|b| b.0)
        .collect();
    let layers = blocks.len();
    if let Some(gap) = (0..layers).find(|i| !blocks.contains(i)) {
        return Err(bad(
            path,
            format!(
                "tensors '{}h.{gap}.*' are missing: the file has blocks {blocks:?}, not 0..{}",
                named.prefix,
                blocks.last().map_or(0, |l| l + 1)
            ),
        ));
    }
    if layers == 0 {
        return Err(bad(
            path,
            format!("no blocks: no tensor is named '{}h.0.*'", named.prefix),
        ));
    }
    let found = GptConfig {
        layers,
        channels,
        heads: 0,
        vocab,
        max_seq,
        eps: 1e-5,
    };
    let cfg = match expect {
        Some(want) => {
            let diff: Vec<String> = [
                ("layers", found.layers, want.layers),
                ("channels", found.channels, want.channels),
                ("vocab", found.vocab, want.vocab),
                ("max_seq", found.max_seq, want.max_seq),
            ]
            .iter()
            .filter(|(_, f, w)| f != w)
            .map(|(what, f, w)| format!("{what} {f} (expected {w})"))
            .collect();
            if !diff.is_empty() {
                return Err(bad(
                    path,
                    format!(
                        "the file's model differs from the expected one: {}",
                        diff.join(", ")
                    ),
                ));
            }
            if let Some(h) = heads.filter(|&h| h != want.heads) {
                return Err(bad(
                    path,
                    format!(
                        "{h} heads asked for, but the expected model has {}",
                        want.heads
                    ),
                ));
            }
            want.clone()
        }
        None => {
            let heads = match heads {
                Some(h) => h,
                None if channels.is_multiple_of(HEAD_DIM) => channels / HEAD_DIM,
                None => {
                    return Err(bad(
                        path,
                        format!(
                        "{channels} channels do not divide by {HEAD_DIM}: give the number of heads"
                    ),
                    ))
                }
            };
            GptConfig { heads, ..found }
        }
    };
    cfg.validate().map_err(|e| bad(path, e))?;
    Ok(cfg)
}

/// Reads a Hugging Face GPT-2 safetensors file (`model.safetensors`) into the crate's
/// orientation.
///
/// The names may carry the `transformer.` prefix (all of them or none). The shape is inferred:
/// vocabulary and channels from `wte.weight` `[V, C]`, positions from `wpe.weight`, blocks from
/// the `h.{i}` names (`0..L`, none missing), `heads` (or `C / 64` when it is `None`, as in every
/// released GPT-2), LayerNorm ε 1e-5. With `expect`, the inferred shape must be its shape, and
/// its heads and ε are used (a `heads` given too must agree).
///
/// Every parameter must be present with the Hugging Face shape (`Conv1D` weights as
/// `[inputs, outputs]`: `attn.c_attn.weight` `[C, 3C]`, `attn.c_proj.weight` `[C, C]`,
/// `mlp.c_fc.weight` `[C, 4C]`, `mlp.c_proj.weight` `[4C, C]`; they are transposed) as F32,
/// F16 or BF16 (widened to f32 exactly). The causal-mask buffers `h.{i}.attn.bias` and
/// `h.{i}.attn.masked_bias` are skipped, and `lm_head.weight` is accepted only when it equals
/// `wte.weight` bit for bit. Every value must be finite. A file this crate wrote
/// ([`write_hf`]) carries a checksum of every tensor, verified first; a file from elsewhere has
/// none, and needs none.
///
/// # Errors
/// [`Error::FileIo`] when the file cannot be opened; [`Error::NotAFile`] for a directory;
/// [`Error::NonFinite`], naming the tensor (as the file names it) and its first NaN or infinite
/// element (counted in the file's orientation); [`Error::ChecksumMismatch`] for a file of this
/// crate damaged since; [`Error::Checkpoint`], naming the tensor, for a file that is not
/// safetensors, a missing tensor, a wrong shape (expected and found), another element type, an
/// unknown tensor, an untied `lm_head.weight`, mixed prefixes, or a shape that differs from
/// `expect`. Nothing is returned unless the whole file is valid.
pub fn read_hf(
    path: impl AsRef<Path>,
    heads: Option<usize>,
    expect: Option<&GptConfig>,
) -> Result<HfWeights> {
    let path = path.as_ref();
    let file = Reader::open_foreign(path)?;
    file.verify()?;
    let named = strip_prefix(path, &file)?;
    let cfg = infer_config(path, &named, heads, expect)?;
    let shapes = cfg.param_shapes();
    let index: HashMap<String, usize> = shapes
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.clone(), i))
        .collect();
    // Unknown names first: they are cheap to find and likely the reason for any other error.
    for (name, (file_name, _)) in &named.tensors {
        let mask =
            block(name).is_some_and(|(_, rest)| rest == "attn.bias" || rest == "attn.masked_bias");
        if !(index.contains_key(name) || mask || name == HEAD) {
            return Err(bad(
                path,
                format!(
                    "tensor '{file_name}' is not a GPT-2 parameter (of {} blocks)",
                    cfg.layers
                ),
            ));
        }
    }
    let mut params = Vec::with_capacity(shapes.len());
    for (name, shape) in shapes {
        let view = named.get(path, &name, "")?;
        let want = file_shape(&name, &shape);
        let file_name = named.file_name(&name);
        let values = widen(&file, &file_name, view, &want)?;
        if let Some(i) = values.iter().position(|x| !x.is_finite()) {
            return Err(Error::NonFinite {
                path: path.to_path_buf(),
                tensor: file_name,
                index: i as u64,
                saving: false,
            });
        }
        let values = if is_conv1d(&name) {
            transpose(&values, want[0], want[1])
        } else {
            values
        };
        params.push((name, Arc::new(values)));
    }
    if let Some((head_name, view)) = named.tensors.get(HEAD) {
        let wte = &params[index["wte.weight"]].1;
        let head = widen(&file, head_name, view, &[cfg.vocab, cfg.channels])?;
        if !head
            .iter()
            .zip(wte.iter())
            .all(|(a, b)| a.to_bits() == b.to_bits())
        {
            return Err(bad(
                path,
                format!(
                    "tensor '{head_name}' differs from '{}': untied LM heads are not supported (GPT-2 ties the head to the token embedding)",
                    named.file_name("wte.weight")
                ),
            ));
        }
    }
    Ok(HfWeights {
        config: cfg,
        params,
        index,
    })
}

/// Writes a Hugging Face GPT-2 safetensors file that `transformers` loads
/// (`GPT2LMHeadModel.from_pretrained` on its directory, beside a `config.json`): f32 tensors under
/// the names without prefix, `Conv1D` weights transposed back to `[inputs, outputs]`, no
/// `lm_head.weight` (tied to `wte.weight`), metadata `{"format": "pt"}`.
///
/// `get(name)` gives each parameter's values in the crate's orientation, called once per name of
/// [`GptConfig::param_shapes`] in that order. The file is written beside `path` and renamed over
/// it once complete, so a failed write leaves an earlier file as it was; a symbolic link at
/// `path` is written through. The metadata also holds a CRC-32 of every tensor
/// (`crc32/<name>`), which [`read_hf`] verifies. A file read by [`read_hf`] and written again
/// is the same bytes.
///
/// # Errors
/// The errors of [`GptConfig::validate`] for a shape that does not validate;
/// [`Error::Checkpoint`] for values of the wrong length (naming the parameter);
/// [`Error::NonFinite`] for a NaN or an infinity, naming the tensor (before anything replaces
/// an earlier file); [`Error::NotAFile`] when `path` is a directory, a device or a fifo; any
/// error of `get`, as it returned it; [`Error::FileIo`] when the file cannot be written.
pub fn write_hf(
    path: impl AsRef<Path>,
    cfg: &GptConfig,
    mut get: impl FnMut(&str) -> Result<Vec<f32>>,
) -> Result<()> {
    let path = path.as_ref();
    cfg.validate()?;
    let shapes = cfg.param_shapes();
    let entries: Vec<Entry> = shapes
        .iter()
        .map(|(name, shape)| Entry {
            name: name.clone(),
            dtype: Dtype::F32,
            shape: file_shape(name, shape),
        })
        .collect();
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    write_unpersisted(path, &meta, &entries, |out| {
        let mut bytes = Vec::new();
        for (name, shape) in &shapes {
            let values = get(name)?;
            let n: usize = shape.iter().product();
            if values.len() != n {
                return Err(bad(
                    path,
                    format!(
                        "parameter '{name}' has {} values, expected {n} (shape {shape:?})",
                        values.len()
                    ),
                ));
            }
            let values = if is_conv1d(name) {
                transpose(&values, shape[0], shape[1])
            } else {
                values
            };
            for part in values.chunks(1 << 16) {
                bytes.clear();
                bytes.extend(part.iter().flat_map(|x| x.to_le_bytes()));
                out.write_all(&bytes).map_err(io("writing a checkpoint"))?;
            }
        }
        Ok(())
    })?
    .persist()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposes_and_names_blocks() {
        let src: Vec<f32> = (0..35).map(|i| i as f32).collect();
        let t = transpose(&src, 5, 7);
        assert_eq!(t[3 * 5 + 4], src[4 * 7 + 3]);
        assert_eq!(transpose(&t, 7, 5), src);
        assert_eq!(block("h.12.ln_1.weight"), Some((12, "ln_1.weight")));
        assert_eq!(block("h.0.attn.bias"), Some((0, "attn.bias")));
        assert_eq!(block("h.01.ln_1.weight"), None);
        assert_eq!(block("h.x.ln_1.weight"), None);
        assert_eq!(block("h.99999999999999999999999.a"), None);
        assert_eq!(block("wte.weight"), None);
        assert!(is_conv1d("h.3.mlp.c_proj.weight") && !is_conv1d("h.3.mlp.c_proj.bias"));
    }
}
