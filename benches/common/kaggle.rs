//! Criteo-Kaggle-like id traces for the embedding benches (included with `#[path]`).

use tidemem::data::criteo::{Dataset, Synthetic, SyntheticConfig};

/// `batches` batches of `batch` samples of the 26 Kaggle tables at cardinalities × `scale`
/// (Zipf 1.0), each as ids over the concatenated tables; and the total rows.
pub fn trace(scale: f64, batch: usize, batches: u64) -> (usize, Vec<Vec<u32>>) {
    let gen = Synthetic::new(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(scale))
        .expect("synthetic data");
    let rows = *gen.table_offsets().last().expect("offsets") as usize;
    let trace = (0..batches)
        .map(|i| gen.concat_ids(&gen.batch(i, batch)).expect("32-bit ids"))
        .collect();
    (rows, trace)
}
