//! Checkpoints of a [`ChunkManager`]: every tensor's parameter, fp32 master and Adam moments in
//! one safetensors file, by tensor name, whatever the chunk size, tier or placement.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use super::manager::ChunkManager;
use super::moments;
use super::{decode, encode, ChunkKind, ChunkPlan};
use crate::checkpoint::{from_st_dtype, io, st_dtype, Entry, Reader, Written};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::adam::{dequantize8, quantize8};
use crate::ops::QUANT8_BLOCK;

/// The metadata key prefix of a model's description ([`ParamStore::describe_model`](crate::store::ParamStore::describe_model)).
const MODEL_KEY: &str = "model.";

/// The metadata key naming the format, and its value.
const FORMAT: (&str, &str) = ("format", "tidemem-chunks");

/// The name of `tensor`'s entry in list `kind`.
fn entry_name(kind: ChunkKind, tensor: &str) -> String {
    format!("{}/{tensor}", kind.name())
}

/// The name of the block scales of `tensor`'s 8-bit entry in list `kind`.
fn scales_name(kind: ChunkKind, tensor: &str) -> String {
    format!("{}_scales/{tensor}", kind.name())
}

/// Whether a checkpoint entry must hold no negative value: the variances and the scales.
fn non_negative(entry: &str) -> bool {
    ["variance/", "momentum_scales/", "variance_scales/"]
        .iter()
        .any(|p| entry.starts_with(p))
}

/// How a checkpoint holds one list of a tensor: its entry, the element type stored, and for
/// 8-bit moments (stored as `U8` codes) the entry of their block scales.
pub(crate) struct Stored {
    key: String,
    dtype: DType,
    scales: Option<String>,
}

impl ChunkManager {
    /// Tensor names, which must be unique for a checkpoint to name them.
    fn checkpoint_names(&self) -> Result<Vec<String>> {
        let names: Vec<String> = (0..self.num_tensors() as u32)
            .map(|t| {
                self.tensor_info(crate::tensor::TensorId(t))
                    .map(|i| i.0.to_string())
            })
            .collect::<Result<_>>()?;
        let mut seen = HashSet::new();
        if let Some(n) = names.iter().find(|n| !seen.insert(n.as_str())) {
            return Err(Error::Conflict {
                what: format!("a checkpoint of two tensors named '{n}'"),
                with: "one name for both (a checkpoint names tensors, so names must differ)".into(),
            });
        }
        Ok(names)
    }

    /// Records `key = value` of the model's description, saved as `model.<key>` and checked
    /// by every load (the public path: [`ParamStore::describe_model`](crate::store::ParamStore::describe_model)).
    pub(crate) fn describe_model(&mut self, key: &str, value: &str) -> Result<()> {
        let key = format!("{MODEL_KEY}{key}");
        match self.model.get(&key) {
            Some(v) if v != value => Err(Error::Conflict {
                what: format!("{key} = {value}"),
                with: format!("{key} = {v}, described before"),
            }),
            _ => {
                self.model.insert(key, value.to_string());
                Ok(())
            }
        }
    }

    /// The file's model description against this manager's: every key this manager
    /// describes, with the same value.
    fn check_model(&self, file: &Reader, meta: &BTreeMap<String, String>) -> Result<()> {
        for (key, want) in &self.model {
            match meta.get(key) {
                Some(got) if got == want => {}
                Some(got) => {
                    return Err(file.bad(format!(
                        "it holds another model: its {key} is {got}, this run's is {want}"
                    )))
                }
                None if crate::checkpoint::legacy_allowed() => {}
                None => {
                    return Err(file.bad(format!(
                        "it does not record {key} (this run's is {want}), so it may hold another \
                         model with the same tensors; set TIDEMEM_LEGACY_LOAD=1 to load it \
                         unchecked"
                    )))
                }
            }
        }
        Ok(())
    }

    /// Checks, changing nothing, that the checkpoint at `path` fits this manager as
    /// [`ChunkManager::load_checkpoint`] would (its data verified), and returns its metadata.
    pub(crate) fn check_checkpoint(&self, file: &Reader) -> Result<BTreeMap<String, String>> {
        self.check_idle("load_checkpoint", false)?;
        let meta = file.metadata()?;
        self.checked_entries(file, &meta)?;
        Ok(meta)
    }

    /// The four entries of every tensor, in tensor order (each with the element type it is
    /// stored in), after checking that the file is a chunk checkpoint of exactly this
    /// manager's tensors (names, shapes, dtypes) and of its model, and verifying its data
    /// (checksums; finite values; no negative variance).
    fn checked_entries(
        &self,
        file: &Reader,
        meta: &BTreeMap<String, String>,
    ) -> Result<Vec<[Stored; 4]>> {
        if meta.get(FORMAT.0).map(String::as_str) != Some(FORMAT.1) {
            return Err(file.bad(format!(
                "not a chunk checkpoint (its metadata lacks {}={})",
                FORMAT.0, FORMAT.1
            )));
        }
        self.check_model(file, meta)?;
        let names = self.checkpoint_names()?;
        let mut entries: Vec<[Stored; 4]> = Vec::with_capacity(names.len());
        let mut known = HashSet::new();
        for (t, name) in names.iter().enumerate() {
            let (_, shape, _) = self.tensor_info(crate::tensor::TensorId(t as u32))?;
            let mut four = Vec::with_capacity(4);
            for kind in ChunkKind::ALL {
                let key = entry_name(kind, name);
                let v = file
                    .info(&key)
                    .ok_or_else(|| file.bad(format!("it has no tensor '{key}'")))?;
                let moment = matches!(kind, ChunkKind::Momentum | ChunkKind::Variance);
                let dtype = match (kind, v.dtype()) {
                    (ChunkKind::Param, d) => from_st_dtype(d),
                    (_, safetensors::Dtype::F32) => Some(DType::F32),
                    (_, safetensors::Dtype::U8) if moment => Some(DType::U8),
                    _ => None,
                };
                let Some(dtype) = dtype.filter(|_| v.shape() == shape) else {
                    return Err(file.bad(format!(
                        "'{key}' is {:?} {:?}, expected {} {shape:?}",
                        v.dtype(),
                        v.shape(),
                        self.list_dtype(kind).name()
                    )));
                };
                let scales = match dtype {
                    DType::U8 => {
                        let sk = scales_name(kind, name);
                        let blocks = shape.iter().product::<usize>().div_ceil(QUANT8_BLOCK);
                        match file.info(&sk) {
                            Some(i)
                                if i.dtype() == safetensors::Dtype::F32
                                    && i.shape() == [blocks] => {}
                            _ => {
                                return Err(file.bad(format!(
                                    "'{key}' holds 8-bit codes, but '{sk}' is not their \
                                     {blocks} f32 block scales"
                                )))
                            }
                        }
                        known.insert(sk.clone());
                        Some(sk)
                    }
                    _ => None,
                };
                known.insert(key.clone());
                four.push(Stored { key, dtype, scales });
            }
            entries.push(
                four.try_into()
                    .unwrap_or_else(|_| unreachable!("four lists")),
            );
        }
        let mut extra: Vec<&str> = file.names().filter(|n| !known.contains(*n)).collect();
        if !extra.is_empty() {
            extra.truncate(5);
            return Err(file.bad(format!(
                "it holds tensors this model does not have: {}",
                extra.join(", ")
            )));
        }
        file.verify_with(non_negative)?;
        Ok(entries)
    }

    /// Writes every tensor's parameter, fp32 master and Adam moments to `path` in the
    /// safetensors format, with `metadata` added to the file's.
    ///
    /// A tensor `w` is stored as `param/w` (in the parameter dtype), `master/w`, `momentum/w`
    /// and `variance/w` (f32), each of the tensor's shape (8-bit moments as their `U8` codes,
    /// with their blocks' f32 scales in `momentum_scales/w` and `variance_scales/w`: a
    /// resumed run has the same bits; a load converts between the storages, 8-bit codes
    /// dequantized into a run of f32 moments and f32 moments quantized into an 8-bit one); the metadata also holds
    /// `format = tidemem-chunks`, `param_dtype` and a CRC-32 of every entry (`crc32/<entry>`,
    /// verified on load). The file is written chunk by chunk (a model on the file tier is never
    /// read into RAM whole) beside `path` and replaces an earlier one only once complete and
    /// synced, so a failed or killed save leaves the earlier file as it was. A NaN or an
    /// infinity in any list fails the save with [`Error::NonFinite`], naming the entry, before
    /// anything is replaced; an existing `path` that is a directory, a device or a fifo is
    /// refused ([`Error::NotAFile`]); a symbolic link is written through to its target. Runs
    /// between iterations only: before the first fetch (initial
    /// values) or after [`end_step`](ChunkManager::end_step), and is refused while a parameter
    /// chunk may hold gradients (a step skipped without restoring the parameters; HybridAdam
    /// restores them). Dirty device copies are written back to the host first; under a
    /// move-semantics policy (PatrickStar, Static) every device chunk moves to the host, to be
    /// loaded again when used. These moves count in the next iteration's
    /// [`last_iteration`](ChunkManager::last_iteration); no moment passes, so the tide is
    /// unchanged.
    ///
    /// ```
    /// use std::collections::BTreeMap;
    /// use tidemem::chunk::{ChunkManager, ManagerConfig};
    /// use tidemem::device::{Device, SimConfig};
    /// use tidemem::tensor::Init;
    /// use tidemem::tide::Policy;
    /// # fn main() -> tidemem::Result<()> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let path = dir.path().join("model.safetensors");
    /// let new = || -> tidemem::Result<_> {
    ///     let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
    ///     ChunkManager::new(dev, ManagerConfig::new(1024, Policy::Tide))
    /// };
    /// let mut a = new()?;
    /// let w = a.register("w", &[4, 4], Init::Constant(0.5))?;
    /// a.save_checkpoint(&path, &BTreeMap::new())?;
    /// let mut b = new()?;
    /// let v = b.register("w", &[4, 4], Init::Zeros)?;
    /// b.load_checkpoint(&path)?;
    /// assert_eq!(b.master(v)?, a.master(w)?);
    /// # Ok(()) }
    /// ```
    pub fn save_checkpoint(
        &mut self,
        path: impl AsRef<Path>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<()> {
        self.save_checkpoint_unpersisted(path.as_ref(), metadata)?
            .persist()
    }

    /// [`ChunkManager::save_checkpoint`], short of putting the file in place.
    pub(crate) fn save_checkpoint_unpersisted(
        &mut self,
        path: &Path,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Written> {
        self.check_idle("save_checkpoint", true)?;
        let names = self.checkpoint_names()?;
        let layout = self.layout().clone();
        let mut entries = Vec::new();
        // (offset, numel) of every tensor of every group, in file order
        let mut spans: Vec<Vec<(usize, usize)>> = Vec::new();
        for g in 0..layout.groups() {
            let ts = &layout.group_tensors[g];
            for kind in ChunkKind::ALL {
                let int8 = self.moment_map(kind).is_some();
                for &t in ts {
                    let (_, shape, _) = self.tensor_info(crate::tensor::TensorId(t))?;
                    entries.push(Entry {
                        name: entry_name(kind, &names[t as usize]),
                        dtype: st_dtype(if int8 {
                            DType::U8
                        } else {
                            self.list_dtype(kind)
                        }),
                        shape: shape.to_vec(),
                    });
                }
                // 8-bit moments: the codes, then their scales
                for &t in ts.iter().filter(|_| int8) {
                    let numel = layout.slots[t as usize].numel;
                    entries.push(Entry {
                        name: scales_name(kind, &names[t as usize]),
                        dtype: st_dtype(DType::F32),
                        shape: vec![numel.div_ceil(QUANT8_BLOCK)],
                    });
                }
            }
            spans.push(
                ts.iter()
                    .map(|&t| {
                        let s = layout.slots[t as usize];
                        (s.offset, s.numel)
                    })
                    .collect(),
            );
        }
        let mut meta = metadata.clone();
        meta.extend(self.model.iter().map(|(k, v)| (k.clone(), v.clone())));
        meta.insert(FORMAT.0.into(), FORMAT.1.into());
        meta.insert("param_dtype".into(), self.param_dtype().name().into());
        crate::checkpoint::write_unpersisted(path, &meta, &entries, |out| {
            for (g, spans) in spans.iter().enumerate() {
                for kind in ChunkKind::ALL {
                    let es = self.list_dtype(kind).size();
                    let c = ChunkPlan::chunk_no(g as u32, kind) as usize;
                    let int8 = self.moment_map(kind).is_some();
                    let elems = layout.group_elems[g];
                    self.read_chunk_host(c, |bytes| {
                        let mut write = |r: std::ops::Range<usize>| {
                            out.write_all(&bytes[r]).map_err(io("writing a checkpoint"))
                        };
                        if !int8 {
                            for &(off, n) in spans {
                                write(off * es..(off + n) * es)?;
                            }
                            return Ok(());
                        }
                        for pass in [0, 1] {
                            for &(off, n) in spans {
                                let (codes, scales) = moments::tensor_bytes8(elems, off, n)?;
                                write(if pass == 0 { codes } else { scales })?;
                            }
                        }
                        Ok(())
                    })?;
                }
            }
            Ok(())
        })
    }

    /// Reads a checkpoint written by [`ChunkManager::save_checkpoint`] for the same tensors
    /// (names and shapes; registration order and chunk size may differ) and returns the file's
    /// metadata. Every tensor of the manager must be in the file and every tensor of the file in
    /// the manager; a parameter saved in another float dtype is converted. The file is checked
    /// whole before anything changes, every entry's checksum included
    /// ([`Error::ChecksumMismatch`] names a damaged one; a file written before checksums, with
    /// none, loads unverified): on an error the manager is as it was. Errors about the file are
    /// [`Error::Checkpoint`] (what is wrong, in words), [`Error::NotAFile`] (a directory: the
    /// checkpoint of several ranks?) and [`Error::FileIo`]. Runs between
    /// iterations only; device copies are dropped (dirty ones written back first), so the next
    /// iteration loads the restored chunks. Every tensor is HOLD afterwards (it has a payload).
    pub fn load_checkpoint(&mut self, path: impl AsRef<Path>) -> Result<BTreeMap<String, String>> {
        self.check_idle("load_checkpoint", false)?;
        self.load_checkpoint_file(&Reader::open(path.as_ref())?, |_| Ok(()))
    }

    /// [`ChunkManager::load_checkpoint`] from an open file, with `check` of its metadata run
    /// after the file's own checks and before anything changes (one open file throughout, so a
    /// checkpoint replaced meanwhile cannot mix two files).
    pub(crate) fn load_checkpoint_file(
        &mut self,
        file: &Reader,
        check: impl FnOnce(&BTreeMap<String, String>) -> Result<()>,
    ) -> Result<BTreeMap<String, String>> {
        self.check_idle("load_checkpoint", false)?;
        let meta = file.metadata()?;
        let entries = self.checked_entries(file, &meta)?;
        check(&meta)?;
        let layout = self.layout().clone();
        let pdt = self.param_dtype();
        // every entry was verified: a read that fails now is of a file changed since (one
        // truncated meanwhile), and leaves the chunks read so far loaded
        let mut failed = None;
        for g in 0..layout.groups() {
            for kind in ChunkKind::ALL {
                let es = self.list_dtype(kind).size();
                let c = ChunkPlan::chunk_no(g as u32, kind) as usize;
                let entries = &entries;
                let group = &layout.group_tensors[g];
                let failed = &mut failed;
                let (map, elems) = (self.moment_map(kind), layout.group_elems[g]);
                self.write_chunk_host(c, |h| {
                    for &t in group {
                        let slot = layout.slots[t as usize];
                        let stored = &entries[t as usize][kind.index()];
                        let read = match map {
                            Some(map) => moments::tensor_bytes8(elems, slot.offset, slot.numel)
                                .and_then(|(codes, scales)| {
                                    let (h, rest) = h.split_at_mut(scales.start);
                                    let scales = &mut rest[..scales.len()];
                                    load8(file, stored, map, &mut h[codes], scales)
                                }),
                            None => {
                                let dst = &mut h[slot.offset * es..(slot.offset + slot.numel) * es];
                                load_values(file, stored, kind, pdt, dst)
                            }
                        };
                        if let Err(e) = read {
                            *failed = Some(e);
                            return;
                        }
                    }
                })?;
                if let Some(e) = failed.take() {
                    self.poison(format!("a checkpoint load failed midway: {e}"));
                    return Err(e);
                }
            }
        }
        self.hold_loaded();
        self.params_restored();
        Ok(meta)
    }
}

/// Reads a tensor's list held a value an element (`dst`, in `pdt` for the parameters, else
/// f32) from how the checkpoint stores it: converted from another float type (parameters),
/// dequantized from 8-bit codes (moments).
fn load_values(
    file: &Reader,
    stored: &Stored,
    kind: ChunkKind,
    pdt: DType,
    dst: &mut [u8],
) -> Result<()> {
    match (&stored.scales, stored.dtype) {
        (Some(scales), _) => {
            let map =
                moments::map_of(crate::chunk::MomentStorage::Int8, kind).ok_or_else(|| {
                    Error::Internal {
                        what: format!("8-bit codes of {} in a checkpoint", kind.name()),
                    }
                })?;
            let codes = file.read(&stored.key)?;
            let scales: Vec<f32> = bytemuck::pod_collect_to_vec(&file.read(scales)?);
            let mut v = vec![0f32; codes.len()];
            dequantize8(map, &codes, &scales, &mut v)?;
            dst.copy_from_slice(bytemuck::cast_slice(&v));
            Ok(())
        }
        (None, d) if d != pdt && kind == ChunkKind::Param => file.read(&stored.key).map(|b| {
            dst.copy_from_slice(&encode(&decode(&b, d), pdt));
        }),
        (None, _) => file.read_into(&stored.key, dst),
    }
}

/// Reads a tensor's 8-bit moment into its `codes` and the bytes of its blocks' `scales`: as
/// stored, or quantized from f32 values.
fn load8(
    file: &Reader,
    stored: &Stored,
    map: crate::ops::Quant8Map,
    codes: &mut [u8],
    scales: &mut [u8],
) -> Result<()> {
    match &stored.scales {
        Some(s) => {
            file.read_into(&stored.key, codes)?;
            file.read_into(s, scales)
        }
        None => {
            let v: Vec<f32> = bytemuck::pod_collect_to_vec(&file.read(&stored.key)?);
            let mut s = vec![0f32; scales.len() / 4];
            quantize8(map, &v, codes, &mut s)?;
            scales.copy_from_slice(bytemuck::cast_slice(&s));
            Ok(())
        }
    }
}
