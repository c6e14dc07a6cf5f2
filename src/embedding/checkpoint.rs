//! Checkpoints of embedding tables in the safetensors format, in the user's id order whatever
//! the cache's internal row permutation.
//!
//! The writer streams rows straight from the host table (a table may be larger than RAM), so it
//! writes the format's header itself; the reader validates the file with the `safetensors`
//! crate over a memory map.

use std::io::{BufWriter, Write};
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};

fn io(during: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { during, source }
}

fn bad(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("checkpoint {}: {what}", path.display()))
}

/// Writes `weight` (`rows × dim`) and, when `stride > dim`, `state` (`rows × (stride - dim)`)
/// in id order: id `i` is host row `perm[i]` of `host` (rows of `stride` floats).
pub(crate) fn save(
    path: &Path,
    host: &[f32],
    perm: &[u32],
    dim: usize,
    stride: usize,
) -> Result<()> {
    let rows = perm.len();
    let state = stride - dim;
    let wbytes = rows * dim * 4;
    let sbytes = rows * state * 4;
    let mut header = serde_json::json!({
        "__metadata__": { "format": "tidemem-embedding", "rows": rows.to_string() },
        "weight": { "dtype": "F32", "shape": [rows, dim], "data_offsets": [0, wbytes] },
    });
    if state > 0 {
        header["state"] = serde_json::json!({
            "dtype": "F32", "shape": [rows, state], "data_offsets": [wbytes, wbytes + sbytes]
        });
    }
    let mut header = serde_json::to_vec(&header).map_err(|e| bad(path, e))?;
    // Pad the header with spaces so the data starts 8-byte aligned.
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let file = std::fs::File::create(path).map_err(io("creating a checkpoint"))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let w = io("writing a checkpoint");
    out.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io("writing a checkpoint"))?;
    out.write_all(&header).map_err(io("writing a checkpoint"))?;
    for range in [0..dim, dim..stride] {
        for &row in perm {
            let r = &host[row as usize * stride..(row as usize + 1) * stride];
            out.write_all(bytemuck::cast_slice(&r[range.clone()]))
                .map_err(io("writing a checkpoint"))?;
        }
    }
    out.flush().map_err(w)?;
    Ok(())
}

/// Reads a checkpoint written by [`save`] for a table of `rows × dim` with `state` floats of
/// optimizer state per row: the weights and the state in id order.
pub(crate) fn load(
    path: &Path,
    rows: usize,
    dim: usize,
    state: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let file = std::fs::File::open(path).map_err(io("opening a checkpoint"))?;
    // SAFETY: the map is read-only and dropped before returning; like every reader of a file,
    // this assumes no other process truncates the checkpoint while it is being loaded.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io("mapping a checkpoint"))?;
    let st = SafeTensors::deserialize(&map).map_err(|e| bad(path, e))?;
    let read = |name: &str, cols: usize| -> Result<Vec<f32>> {
        let t = st.tensor(name).map_err(|e| bad(path, e))?;
        if t.dtype() != Dtype::F32 || t.shape() != [rows, cols] {
            return Err(bad(
                path,
                format!(
                    "tensor {name} is {:?} {:?}, expected F32 [{rows}, {cols}]",
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        Ok(t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect())
    };
    let w = read("weight", dim)?;
    let s = if state > 0 {
        read("state", state)?
    } else {
        if st.names().iter().any(|n| *n == "state") {
            return Err(bad(path, "it holds optimizer state but the table has none"));
        }
        Vec::new()
    };
    Ok((w, s))
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
        save(&p, &host, &perm, 2, 3).unwrap();
        let (w, s) = load(&p, 3, 2, 1).unwrap();
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
