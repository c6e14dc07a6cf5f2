//! Checkpoints of embedding tables in the safetensors format, in the user's id order whatever
//! the cache's internal row permutation.
//!
//! The writer streams rows straight from the host table (a table may be larger than RAM); see
//! [`crate::checkpoint`] for the file.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::Dtype;

use crate::checkpoint::{bad, io, Entry, Reader, Written};
use crate::error::Result;

/// Writes `weight` (`rows × dim`) and, when `stride > dim`, `state` (`rows × (stride - dim)`)
/// in id order: id `i` is host row `perm[i]` of `host` (rows of `stride` floats). With
/// `state_bits` the state is stored as `U32` words (8-bit moments' codes: bits, not floats).
pub(crate) fn save(
    path: &Path,
    host: &[f32],
    perm: &[u32],
    dim: usize,
    stride: usize,
    extra: &BTreeMap<String, String>,
    state_bits: bool,
) -> Result<Written> {
    let rows = perm.len();
    let state = stride - dim;
    let mut meta = extra.clone();
    meta.insert("format".to_string(), "tidemem-embedding".to_string());
    meta.insert("rows".to_string(), rows.to_string());
    let mut entries = vec![Entry {
        name: "weight".into(),
        dtype: Dtype::F32,
        shape: vec![rows, dim],
    }];
    if state > 0 {
        entries.push(Entry {
            name: "state".into(),
            dtype: if state_bits { Dtype::U32 } else { Dtype::F32 },
            shape: vec![rows, state],
        });
    }
    crate::checkpoint::write_unpersisted(path, &meta, &entries, |out| {
        for range in std::iter::once(0..dim).chain((state > 0).then_some(dim..stride)) {
            for &row in perm {
                let r = &host[row as usize * stride..(row as usize + 1) * stride];
                out.write_all(bytemuck::cast_slice(&r[range.clone()]))
                    .map_err(io("writing a checkpoint"))?;
            }
        }
        Ok(())
    })
}

/// A table read back: weights and state in id order, and the file's metadata.
pub(crate) type Loaded = (Vec<f32>, Vec<f32>, BTreeMap<String, String>);

/// Reads a checkpoint written by [`save`] for a table of `rows × dim` with `state` floats of
/// optimizer state per row (as `F32` or as `U32` bits): the weights and the state in id order,
/// and the file's metadata.
pub(crate) fn load(path: &Path, rows: usize, dim: usize, state: usize) -> Result<Loaded> {
    let file = Reader::open(path)?;
    let read = |name: &str, cols: usize| -> Result<Vec<f32>> {
        let t = file
            .info(name)
            .ok_or_else(|| file.bad(format!("it has no tensor '{name}'")))?;
        let bits = name == "state" && t.dtype() == Dtype::U32;
        if (t.dtype() != Dtype::F32 && !bits) || t.shape() != [rows, cols] {
            return Err(bad(
                path,
                format!(
                    "tensor {name} is {:?} {:?}, expected F32 [{rows}, {cols}]",
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        Ok(file
            .read(name)?
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect())
    };
    let w = read("weight", dim)?;
    let s = if state > 0 {
        read("state", state)?
    } else {
        if file.info("state").is_some() {
            return Err(bad(path, "it holds optimizer state but the table has none"));
        }
        Vec::new()
    };
    Ok((w, s, file.metadata()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_in_id_order() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.safetensors");
        // 3 rows of stride 3 (dim 2, state 1); id i is host row perm[i].
        let host = [10.0, 11.0, 12.0, 20.0, 21.0, 22.0, 30.0, 31.0, 32.0];
        let perm = [2, 0, 1];
        let extra = BTreeMap::from([("k".to_string(), "v".to_string())]);
        save(&p, &host, &perm, 2, 3, &extra, false)
            .unwrap()
            .persist()
            .unwrap();
        let (w, s, meta) = load(&p, 3, 2, 1).unwrap();
        assert_eq!(meta.get("k").map(String::as_str), Some("v"));
        assert_eq!(w, vec![30.0, 31.0, 10.0, 11.0, 20.0, 21.0]);
        assert_eq!(s, vec![32.0, 12.0, 22.0]);
        assert!(load(&p, 3, 3, 1).is_err());
        assert!(load(&p, 4, 2, 1).is_err());
        assert!(load(&p, 3, 2, 0).is_err());
        assert!(load(&dir.path().join("missing"), 3, 2, 1).is_err());
        std::fs::write(&p, b"not a checkpoint").unwrap();
        assert!(load(&p, 3, 2, 1).is_err());
    }
}
