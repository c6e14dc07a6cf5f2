mod classifier;
mod embedding;

pub use classifier::{Classifier3D, Classifier3DSaved};
pub use embedding::{Embedding3D, Embedding3DSaved, VocabEmbedding3D, VocabEmbedding3DSaved};

use super::grid::ProcessGrid;
use super::three_d::Place3D;
use crate::error::{Error, Result};

/// This rank's place on `grid`, which must be `registered` (where the layer was registered).
fn here(grid: &ProcessGrid, registered: Place3D) -> Result<Place3D> {
    let place = Place3D::of(grid)?;
    if place != registered {
        return Err(Error::WrongPlace {
            what: "a 3D layer",
            registered: format!("at {registered:?}"),
            run: format!("at {place:?}"),
        });
    }
    Ok(place)
}

/// The first id of `ids` outside `0..n`, as [`Error::TokenOutOfRange`].
fn check_ids(ids: &[i32], n: usize) -> Result<()> {
    match ids.iter().position(|&t| t < 0 || t as usize >= n) {
        None => Ok(()),
        Some(p) => Err(Error::TokenOutOfRange {
            token: ids[p].into(),
            position: p,
            vocab: n,
        }),
    }
}
