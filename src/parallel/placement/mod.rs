//! [`Placement`]: the layout types a model is placed on from its process grid, the one place
//! a grid's tensor mode meets a layout type.

mod cube;
mod one_d;
mod summa;

pub use cube::Cube;
pub use one_d::{Linear1D, OneD};
pub use summa::Summa;

use super::{Layout3D, ProcessGrid, TensorMode};
use crate::error::{Error, Result};
use crate::nn::{Layout, Serial};

/// A [`Layout`] a model is placed on from this rank's process grid. A model is generic over
/// its placement, so a model registered on one cannot run on another: a trainer picks the
/// type once, from the grid's [`TensorMode`].
///
/// | tensor mode | placement |
/// |---|---|
/// | none (or no grid) | [`Serial`] |
/// | 1D | [`OneD`] |
/// | 2D, 2.5D | [`Summa`] |
/// | 3D | [`Cube`] (tiles [`Layout3D::RowsJColsK`]) |
pub trait Placement: Layout {
    /// This rank's layout on `grid` (`None`: one rank holding whole tensors);
    /// [`Error::WrongPlace`] when the grid's tensor mode is another placement's.
    fn of_grid(grid: Option<&ProcessGrid>) -> Result<Self>;
}

/// The tensor mode of `grid` (none without one).
fn mode(grid: Option<&ProcessGrid>) -> TensorMode {
    grid.map_or(TensorMode::None, |g| g.spec().tensor)
}

/// A grid of `mode` asked for placement `what`.
fn elsewhere(what: &'static str, mode: TensorMode) -> Error {
    Error::WrongPlace {
        what,
        registered: "for its own tensor mode".into(),
        run: format!("on a grid of tensor mode {mode}"),
    }
}

impl Placement for Serial {
    fn of_grid(grid: Option<&ProcessGrid>) -> Result<Serial> {
        match mode(grid) {
            TensorMode::None => Ok(Serial),
            m => Err(elsewhere("a model on whole tensors (Serial)", m)),
        }
    }
}

impl Placement for OneD {
    fn of_grid(grid: Option<&ProcessGrid>) -> Result<OneD> {
        match (grid, mode(grid)) {
            (Some(g), TensorMode::OneD { .. }) => Ok(OneD::of(g.tensor())),
            (_, m) => Err(elsewhere("a model split 1D (OneD)", m)),
        }
    }
}

impl Placement for Summa {
    fn of_grid(grid: Option<&ProcessGrid>) -> Result<Summa> {
        match (grid, mode(grid)) {
            (Some(g), TensorMode::TwoD { .. } | TensorMode::TwoHalfD { .. }) => Summa::of(g),
            (_, m) => Err(elsewhere("a model split 2D or 2.5D (Summa)", m)),
        }
    }
}

impl Placement for Cube {
    fn of_grid(grid: Option<&ProcessGrid>) -> Result<Cube> {
        match (grid, mode(grid)) {
            (Some(g), TensorMode::ThreeD { .. }) => Cube::of(g, Layout3D::RowsJColsK),
            (_, m) => Err(elsewhere("a model split 3D (Cube)", m)),
        }
    }
}

/// Runs `$body` with `$P` the [`Placement`] type of `$mode` (a [`TensorMode`]): the one place
/// a tensor mode chosen at run time (a command line's `--tp`) becomes a type, so that what
/// follows is written once, generic over the placement.
///
/// ```
/// use tidemem::models::gpt::{Gpt, GptConfig, Plan};
/// use tidemem::parallel::{Placement, TensorMode};
/// use tidemem::prelude::*;
///
/// fn heads<P: Placement>(gpt: &Gpt<P>) -> usize {
///     gpt.config.heads
/// }
///
/// # fn main() -> tidemem::Result<()> {
/// let cfg = GptConfig::preset("gpt2-tiny").unwrap();
/// let dev = Device::sim(SimConfig::with_capacity(64 << 20))?;
/// let mut m = ChunkManager::new(dev, ManagerConfig::new(1 << 16, Policy::Tide))?;
/// let n = tidemem::with_placement!(TensorMode::None, |P| {
///     let gpt: Gpt<P> = Gpt::register_on(&mut m, &Plan::default(), &cfg, |_, _| {
///         Ok(Init::Zeros)
///     })?;
///     heads(&gpt)
/// });
/// assert_eq!(n, cfg.heads);
/// # Ok(()) }
/// ```
#[macro_export]
macro_rules! with_placement {
    ($mode:expr, |$p:ident| $body:expr) => {
        match $mode {
            $crate::parallel::TensorMode::None => {
                type $p = $crate::nn::Serial;
                $body
            }
            $crate::parallel::TensorMode::OneD { .. } => {
                type $p = $crate::parallel::OneD;
                $body
            }
            $crate::parallel::TensorMode::TwoD { .. }
            | $crate::parallel::TensorMode::TwoHalfD { .. } => {
                type $p = $crate::parallel::Summa;
                $body
            }
            $crate::parallel::TensorMode::ThreeD { .. } => {
                type $p = $crate::parallel::Cube;
                $body
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Communicator;
    use crate::device::{Device, SimConfig};
    use crate::parallel::GridSpec;

    /// A one-rank grid of tensor mode `tensor`.
    fn grid(tensor: TensorMode) -> ProcessGrid {
        let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
        let comm = Communicator::local(vec![dev]).unwrap().remove(0);
        let spec = GridSpec {
            data: 1,
            pipeline: 1,
            sequence: 1,
            tensor,
        };
        ProcessGrid::new(&comm, spec).unwrap()
    }

    /// Each placement is built from its own tensor modes only; another mode is a typed error
    /// naming it.
    #[test]
    fn a_placement_is_built_from_its_own_tensor_mode_only() {
        let modes = [
            TensorMode::None,
            TensorMode::OneD { size: 1 },
            TensorMode::TwoD { q: 1 },
            TensorMode::TwoHalfD { q: 1, depth: 1 },
            TensorMode::ThreeD { q: 1 },
        ];
        for (k, mode) in modes.into_iter().enumerate() {
            let g = grid(mode);
            let ok = [
                Serial::of_grid(Some(&g)).is_ok(),
                OneD::of_grid(Some(&g)).is_ok(),
                Summa::of_grid(Some(&g)).is_ok(),
                Cube::of_grid(Some(&g)).is_ok(),
            ];
            let want = match k {
                0 => [true, false, false, false],
                1 => [false, true, false, false],
                2 | 3 => [false, false, true, false],
                _ => [false, false, false, true],
            };
            assert_eq!(ok, want, "{mode}");
            if k > 0 {
                let e = Serial::of_grid(Some(&g)).unwrap_err();
                assert!(matches!(e, Error::WrongPlace { .. }), "{e}");
                assert!(e.to_string().contains(&mode.to_string()), "{e}");
            }
        }
        assert!(Serial::of_grid(None).is_ok());
        assert!(OneD::of_grid(None).is_err() && Cube::of_grid(None).is_err());
    }

    /// `with_placement!` names the placement of every tensor mode.
    #[test]
    fn with_placement_maps_each_mode_to_its_type() {
        let name = |mode: TensorMode| {
            with_placement!(mode, |P| std::any::type_name::<P>().rsplit("::").next())
        };
        assert_eq!(name(TensorMode::None), Some("Serial"));
        assert_eq!(name(TensorMode::OneD { size: 2 }), Some("OneD"));
        assert_eq!(name(TensorMode::TwoD { q: 2 }), Some("Summa"));
        assert_eq!(name(TensorMode::TwoHalfD { q: 2, depth: 2 }), Some("Summa"));
        assert_eq!(name(TensorMode::ThreeD { q: 2 }), Some("Cube"));
    }
}
