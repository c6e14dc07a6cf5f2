//! What a parallel layer's collectives cost: one record for every layer and layout, [`Cost`]
//! (a forward and a backward [`PassCost`], each by group), added up layer by layer.

use std::iter::Sum;
use std::ops::{Add, AddAssign};

use serde::Serialize;

use crate::comm::CommStats;

/// The collectives of one pass of a layer on each group of the grid it uses, as
/// [`Communicator::stats`](crate::comm::Communicator::stats) counts them (an all-gather's
/// gathered buffer, a reduce-scatter's input, an all-reduce's, broadcast's or reduce's buffer,
/// a message sent or received); groups a layout does not have stay empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PassCost {
    /// A 2D or 2.5D grid's ROW group ([`ProcessGrid::row`](super::ProcessGrid::row)).
    pub row: CommStats,
    /// Its COL group.
    pub col: CommStats,
    /// A 2.5D grid's DEP group (with `d > 1`).
    pub dep: CommStats,
    /// A 3D cube's [`ProcessGrid::input`](super::ProcessGrid::input) group.
    pub input: CommStats,
    /// Its weight group.
    pub weight: CommStats,
    /// Its output group.
    pub output: CommStats,
    /// The whole tensor group ([`ProcessGrid::tensor`](super::ProcessGrid::tensor)): a 1D
    /// layer's all-reduces, a split end's exchanges and loss.
    pub tensor: CommStats,
    /// The sequence ring's messages.
    pub sequence: CommStats,
}

/// The collectives of one forward and one backward of a layer (or of several, summed with
/// `+`), by group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Cost {
    /// The forward pass.
    pub forward: PassCost,
    /// The backward pass.
    pub backward: PassCost,
}

impl Add for PassCost {
    type Output = PassCost;

    fn add(self, o: PassCost) -> PassCost {
        PassCost {
            row: self.row + o.row,
            col: self.col + o.col,
            dep: self.dep + o.dep,
            input: self.input + o.input,
            weight: self.weight + o.weight,
            output: self.output + o.output,
            tensor: self.tensor + o.tensor,
            sequence: self.sequence + o.sequence,
        }
    }
}

impl Add for Cost {
    type Output = Cost;

    fn add(self, o: Cost) -> Cost {
        Cost {
            forward: self.forward + o.forward,
            backward: self.backward + o.backward,
        }
    }
}

impl AddAssign for Cost {
    fn add_assign(&mut self, o: Cost) {
        *self = *self + o;
    }
}

impl Sum for Cost {
    fn sum<I: Iterator<Item = Cost>>(iter: I) -> Cost {
        iter.fold(Cost::default(), Add::add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_add_by_pass_and_group() {
        let mut a = Cost::default();
        a.forward.row.broadcast.calls = 2;
        a.backward.input.all_gather.bytes = 64;
        let mut b = Cost::default();
        b.forward.row.broadcast.calls = 1;
        b.forward.tensor.all_reduce.bytes = 8;
        let c: Cost = [a, b].into_iter().sum();
        assert_eq!(c.forward.row.broadcast.calls, 3);
        assert_eq!(c.forward.tensor.all_reduce.bytes, 8);
        assert_eq!(c.backward.input.all_gather.bytes, 64);
        assert_eq!(c.backward.row, CommStats::default());
        let mut d = a;
        d += b;
        assert_eq!(d, c);
    }
}
