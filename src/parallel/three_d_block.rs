//! The 3D layout's LayerNorm ([`LayerNorm3D`]); the layout itself is
//! [`Cube`](crate::parallel::Cube).

mod layernorm;

pub use layernorm::{LayerNorm3D, LayerNorm3DSaved};
