//! Checkpoints of a [`ChunkManager`]: every tensor's parameter, fp32 master and Adam moments in
//! one safetensors file, by tensor name, whatever the chunk size, tier or placement.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use super::manager::ChunkManager;
use super::{decode, encode, ChunkKind, ChunkPlan};
use crate::checkpoint::{from_st_dtype, io, st_dtype, Entry, Reader, Written};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The metadata key prefix of a model's description ([`ParamStore::describe_model`](crate::store::ParamStore::describe_model)).
const MODEL_KEY: &str = "model.";

/// The metadata key naming the format, and its value.
const FORMAT: (&str, &str) = ("format", "tidemem-chunks");

/// The name of `tensor`'s entry in list `kind`.
fn entry_name(kind: ChunkKind, tensor: &str) -> String {
    format!("{}/{tensor}", kind.name())
}

/// Whether a checkpoint entry must hold no negative value: the variances.
fn non_negative(entry: &str) -> bool {
    entry.starts_with("variance/")
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
    ) -> Result<Vec<[(String, DType); 4]>> {
        if meta.get(FORMAT.0).map(String::as_str) != Some(FORMAT.1) {
            return Err(file.bad(format!(
                "not a chunk checkpoint (its metadata lacks {}={})",
                FORMAT.0, FORMAT.1
            )));
        }
        self.check_model(file, meta)?;
        let names = self.checkpoint_names()?;
        let mut entries: Vec<[(String, DType); 4]> = Vec::with_capacity(names.len());
        let mut known = HashSet::new();
        for (t, name) in names.iter().enumerate() {
            let (_, shape, _) = self.tensor_info(crate::tensor::TensorId(t as u32))?;
            let mut four = Vec::with_capacity(4);
            for kind in ChunkKind::ALL {
                let key = entry_name(kind, name);
                let v = file
                    .info(&key)
                    .ok_or_else(|| file.bad(format!("it has no tensor '{key}'")))?;
                let dtype = match kind {
                    ChunkKind::Param => from_st_dtype(v.dtype()),
                    _ => (v.dtype() == safetensors::Dtype::F32).then_some(DType::F32),
                };
                let Some(dtype) = dtype.filter(|_| v.shape() == shape) else {
                    return Err(file.bad(format!(
                        "'{key}' is {:?} {:?}, expected {} {shape:?}",
                        v.dtype(),
                        v.shape(),
                        self.list_dtype(kind).name()
                    )));
                };
                known.insert(key.clone());
                four.push((key, dtype));
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
    /// and `variance/w` (f32), each of the tensor's shape; the metadata also holds
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
                for &t in ts {
                    let (_, shape, _) = self.tensor_info(crate::tensor::TensorId(t))?;
                    entries.push(Entry {
                        name: entry_name(kind, &names[t as usize]),
                        dtype: st_dtype(self.list_dtype(kind)),
                        shape: shape.to_vec(),
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
                    self.read_chunk_host(c, |bytes| {
                        for &(off, n) in spans {
                            out.write_all(&bytes[off * es..(off + n) * es])
                                .map_err(io("writing a checkpoint"))?;
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
                self.write_chunk_host(c, |h| {
                    for &t in group {
                        let slot = layout.slots[t as usize];
                        let dst = &mut h[slot.offset * es..(slot.offset + slot.numel) * es];
                        let (key, stored) = &entries[t as usize][kind.index()];
                        let read = if *stored != pdt && kind == ChunkKind::Param {
                            file.read(key).map(|b| {
                                dst.copy_from_slice(&encode(&decode(&b, *stored), pdt));
                            })
                        } else {
                            file.read_into(key, dst)
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
