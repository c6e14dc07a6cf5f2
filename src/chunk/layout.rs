//! Packing tensors into chunks, and the chunk-size search.

use serde::Serialize;

use crate::error::{Error, Result};

/// Where a tensor lives inside its chunk group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Slot {
    /// Chunk group index (chunk `group` of every list).
    pub group: u32,
    /// Offset in elements from the start of the chunk.
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
}

/// The packing of tensors into chunk groups.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChunkLayout {
    /// Element capacity of an ordinary chunk.
    pub chunk_elems: usize,
    /// Element capacity of every group (a tensor larger than `chunk_elems` gets a group of its own,
    /// exactly its size).
    pub group_elems: Vec<usize>,
    /// Elements used in every group.
    pub(crate) group_used: Vec<usize>,
    /// Tensors of every group, in packing order.
    pub(crate) group_tensors: Vec<Vec<u32>>,
    /// Slot of every tensor, indexed by tensor number.
    pub slots: Vec<Slot>,
    open: Option<u32>,
    /// Every tensor starts at a multiple of this many elements of its chunk (0 or 1: packed).
    #[serde(skip)]
    align: usize,
}

impl ChunkLayout {
    /// An empty layout with chunks of `chunk_elems` elements.
    pub fn new(chunk_elems: usize) -> Result<Self> {
        if chunk_elems == 0 {
            return Err(Error::TooFew {
                what: "elements of a chunk".into(),
                got: chunk_elems,
                need: 1,
            });
        }
        // a chunk's fp32 lists are addressed in bytes: past what an allocation can address,
        // every size computed from it would wrap
        let limit = isize::MAX as u64 / 4;
        if chunk_elems as u64 > limit {
            return Err(Error::TooLarge {
                what: "elements of a chunk (its fp32 lists must be addressable in bytes)".into(),
                requested: chunk_elems as u128,
                limit,
            });
        }
        Ok(ChunkLayout {
            chunk_elems,
            ..Default::default()
        })
    }

    /// Starts every tensor pushed from here at a multiple of `elems` elements of its chunk
    /// (the 8-bit moments' block, so that no block holds two tensors' ends).
    pub(crate) fn align_tensors(&mut self, elems: usize) {
        self.align = elems;
    }

    /// Where the next tensor of group `g` would start.
    fn next_offset(&self, g: usize) -> usize {
        self.group_used[g].next_multiple_of(self.align.max(1))
    }

    /// Packs the next tensor (registration order) and returns its slot. Tensors never span
    /// chunks: one that does not fit in the open chunk opens a new one; one larger than a chunk
    /// gets a group of its own and leaves the open chunk open for the tensors after it.
    pub fn push(&mut self, numel: usize) -> Result<Slot> {
        if numel == 0 {
            return Err(Error::TooFew {
                what: "elements of a tensor to pack".into(),
                got: numel,
                need: 1,
            });
        }
        let tensor = self.slots.len() as u32;
        let group = if numel > self.chunk_elems {
            self.new_group(numel)
        } else {
            match self.open {
                Some(g) if self.next_offset(g as usize) + numel <= self.chunk_elems => g,
                _ => {
                    let g = self.new_group(self.chunk_elems);
                    self.open = Some(g);
                    g
                }
            }
        };
        let g = group as usize;
        let slot = Slot {
            group,
            offset: self.next_offset(g),
            numel,
        };
        self.group_used[g] = slot.offset + numel;
        self.group_tensors[g].push(tensor);
        self.slots.push(slot);
        Ok(slot)
    }

    fn new_group(&mut self, elems: usize) -> u32 {
        self.group_elems.push(elems);
        self.group_used.push(0);
        self.group_tensors.push(Vec::new());
        (self.group_elems.len() - 1) as u32
    }

    /// Closes the open chunk: the next tensor starts a new group.
    pub(crate) fn seal(&mut self) {
        self.open = None;
    }

    /// Closes the open chunk and adds empty groups (of an ordinary chunk's capacity, holding no
    /// tensor) until the number of groups is a multiple of `multiple`: the next tensor starts a
    /// group whose index is a multiple of it.
    pub(crate) fn pad_groups(&mut self, multiple: usize) {
        self.seal();
        while multiple > 0 && !self.groups().is_multiple_of(multiple) {
            self.new_group(self.chunk_elems);
        }
    }

    /// Number of chunk groups.
    pub fn groups(&self) -> usize {
        self.group_elems.len()
    }

    /// Total element capacity over all groups.
    pub(crate) fn capacity_elems(&self) -> usize {
        self.group_elems.iter().sum()
    }

    /// Elements of padding (capacity not used by any tensor).
    pub fn waste_elems(&self) -> usize {
        self.capacity_elems() - self.group_used.iter().sum::<usize>()
    }

    /// Packs `numels` in order with chunks of `chunk_elems`.
    pub(crate) fn pack(chunk_elems: usize, numels: &[usize]) -> Result<Self> {
        let mut l = ChunkLayout::new(chunk_elems)?;
        for &n in numels {
            l.push(n)?;
        }
        Ok(l)
    }
}

/// Parameters of the chunk-size search.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct SizeSearch {
    /// Smallest size tried, in elements.
    pub start: usize,
    /// Sizes tried span `start ..= start + range`.
    pub range: usize,
    /// Step between sizes tried (e.g. the hidden size).
    pub interval: usize,
    /// The chosen size is rounded up to a multiple of this (the data-parallel size).
    pub multiple_of: usize,
}

/// Result of [`search_chunk_size`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SizeChoice {
    /// Chosen chunk size in elements.
    pub chunk_elems: usize,
    /// Padding elements with that size (over the tensors that count, see [`search_chunk_size`]).
    pub waste_elems: usize,
    /// `waste_elems` / capacity.
    pub(crate) waste_fraction: f64,
}

/// Chooses the chunk size with the least padding waste over `start ..= start + range` in steps of
/// `interval`. Outlier tensors (more than mean + 3σ elements, e.g. a vocabulary embedding) are left
/// out of the statistics: they get chunks of their own whatever the size. The smallest size wins a
/// tie. The result is rounded up to a multiple of `multiple_of`.
///
/// ```
/// use tidemem::chunk::{search_chunk_size, SizeSearch};
/// // 12 tensors of 300 elements: 900 (3 per chunk) wastes nothing, 1000 wastes 100 per chunk.
/// let numels = vec![300; 12];
/// let s = SizeSearch { start: 800, range: 400, interval: 100, multiple_of: 1 };
/// let c = search_chunk_size(&numels, s).unwrap();
/// assert_eq!(c.chunk_elems, 900);
/// assert_eq!(c.waste_elems, 0);
/// ```
pub fn search_chunk_size(numels: &[usize], s: SizeSearch) -> Result<SizeChoice> {
    if s.start == 0 || s.interval == 0 || s.multiple_of == 0 {
        let what = if s.start == 0 {
            "start of a chunk-size search"
        } else if s.interval == 0 {
            "interval of a chunk-size search"
        } else {
            "multiple of a chunk-size search"
        };
        return Err(Error::TooFew {
            what: what.into(),
            got: 0,
            need: 1,
        });
    }
    if numels.is_empty() {
        return Err(Error::Empty {
            what: "the tensors of a chunk-size search".into(),
        });
    }
    let end = s.start.checked_add(s.range);
    if end.is_none_or(|e| e.checked_next_multiple_of(s.multiple_of).is_none())
        || s.range / s.interval > 1_000_000
    {
        return Err(if s.range / s.interval > 1_000_000 {
            Error::TooLarge {
                what: format!(
                    "sizes to try in a chunk-size search over {} by {}",
                    s.range, s.interval
                ),
                requested: (s.range / s.interval) as u128,
                limit: 1_000_000,
            }
        } else {
            Error::Overflow {
                what: format!(
                    "the end of a chunk-size search from {} over {} (multiples of {})",
                    s.start, s.range, s.multiple_of
                ),
            }
        });
    }
    let n = numels.len() as f64;
    let mean = numels.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = numels
        .iter()
        .map(|&x| (x as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    let cut = mean + 3.0 * var.sqrt();
    let kept: Vec<usize> = numels
        .iter()
        .copied()
        .filter(|&x| x as f64 <= cut)
        .collect();
    let mut best: Option<SizeChoice> = None;
    let mut size = s.start;
    while size <= s.start + s.range {
        let size_r = size.div_ceil(s.multiple_of) * s.multiple_of;
        // Tensors larger than the size get their own chunks: count only the rest.
        let fits: Vec<usize> = kept.iter().copied().filter(|&x| x <= size_r).collect();
        let l = ChunkLayout::pack(size_r, &fits)?;
        let cap = l.capacity_elems().max(1);
        let c = SizeChoice {
            chunk_elems: size_r,
            waste_elems: l.waste_elems(),
            waste_fraction: l.waste_elems() as f64 / cap as f64,
        };
        if best.is_none_or(|b| c.waste_elems < b.waste_elems) {
            best = Some(c);
        }
        size = match size.checked_add(s.interval) {
            Some(next) => next,
            None => break,
        };
    }
    // the loop tries `start` at least
    best.ok_or_else(|| Error::Internal {
        what: "a chunk-size search tried no size".into(),
    })
}

/// Result of [`search_layer_chunk_size`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LayerSizeChoice {
    /// Chosen chunk size in elements.
    pub chunk_elems: usize,
    /// Layers whose tensors land in more than one chunk with that size (a fetch of such a layer
    /// needs two chunks at once), not counting layers larger than a chunk.
    pub split_layers: usize,
    /// Padding elements with that size over every tensor.
    pub waste_elems: usize,
}

/// Chooses the chunk size over `start ..= start + range` (in steps of `interval`, rounded up
/// to multiples of `multiple_of`) that keeps each layer's tensors (`layers[l]`: the elements of
/// layer `l`'s tensors, in registration order) in one chunk where it can: the fewest layers
/// split across chunks, then the least padding, then the smallest size. A layer fetched whole
/// then needs one chunk, not two: the device it trains on can be smaller.
///
/// ```
/// use tidemem::chunk::{search_layer_chunk_size, SizeSearch};
/// // a weight that fills a chunk of 1024 pushes its bias into the next: 1040 keeps them together
/// let layers = vec![vec![1024, 16], vec![1024, 16]];
/// let s = SizeSearch { start: 1024, range: 64, interval: 16, multiple_of: 1 };
/// let c = search_layer_chunk_size(&layers, s).unwrap();
/// assert_eq!((c.chunk_elems, c.split_layers), (1040, 0));
/// ```
pub fn search_layer_chunk_size(layers: &[Vec<usize>], s: SizeSearch) -> Result<LayerSizeChoice> {
    let numels: Vec<usize> = layers.iter().flatten().copied().collect();
    // the same checks of the search and the tensors
    search_chunk_size(&numels, s)?;
    let mut best: Option<LayerSizeChoice> = None;
    let mut size = s.start;
    while size <= s.start + s.range {
        let size_r = size.div_ceil(s.multiple_of) * s.multiple_of;
        let l = ChunkLayout::pack(size_r, &numels)?;
        let mut split = 0;
        let mut t = 0;
        for layer in layers {
            let groups = &l.slots[t..t + layer.len()];
            t += layer.len();
            let whole: usize = layer.iter().sum();
            if whole <= size_r && groups.iter().any(|g| g.group != groups[0].group) {
                split += 1;
            }
        }
        let c = LayerSizeChoice {
            chunk_elems: size_r,
            split_layers: split,
            waste_elems: l.waste_elems(),
        };
        let key = |c: &LayerSizeChoice| (c.split_layers, c.waste_elems);
        if best.is_none_or(|b| key(&c) < key(&b)) {
            best = Some(c);
        }
        size = match size.checked_add(s.interval) {
            Some(next) => next,
            None => break,
        };
    }
    best.ok_or_else(|| Error::Internal {
        what: "a chunk-size search tried no size".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layer_search_keeps_layers_whole_then_wastes_least() {
        let s = |start, range| SizeSearch {
            start,
            range,
            interval: 8,
            multiple_of: 1,
        };
        // three layers of 100 + 4: 104 holds one whole, 208 two; 100 splits every layer
        let layers = vec![vec![100, 4]; 3];
        let c = search_layer_chunk_size(&layers, s(100, 0)).unwrap();
        assert_eq!((c.chunk_elems, c.split_layers), (100, 0)); // larger than a chunk: not counted
        let c = search_layer_chunk_size(&layers, s(96, 16)).unwrap();
        assert_eq!((c.chunk_elems, c.split_layers), (104, 0));
        // two layers a chunk: none split
        let c = search_layer_chunk_size(&layers, s(200, 16)).unwrap();
        assert_eq!(c.split_layers, 0, "{c:?}");
        assert!(search_layer_chunk_size(&[], s(8, 0)).is_err());
    }

    #[test]
    fn padding_starts_the_next_tensor_on_a_multiple_and_repacks_alike() {
        let sizes = [3, 5, 12, 2, 4];
        let mut l = ChunkLayout::new(8).unwrap();
        for &n in &sizes {
            l.push(n).unwrap();
        }
        let first = l.groups();
        l.pad_groups(4);
        assert_eq!(l.groups() % 4, 0);
        assert!(l.groups() >= first && l.groups() < first + 4);
        let pad = l.groups();
        assert!(l.group_tensors[first..].iter().all(Vec::is_empty));
        // the same tensors again pack as the first time, every group shifted by `pad`
        for (t, &n) in sizes.iter().enumerate() {
            let s = l.push(n).unwrap();
            let o = l.slots[t];
            assert_eq!((s.group, s.offset), (o.group + pad as u32, o.offset));
        }
        // already a multiple: only the open chunk closes
        let mut m = ChunkLayout::pack(8, &[3]).unwrap();
        m.pad_groups(1);
        assert_eq!(m.groups(), 1);
        assert_eq!(m.push(2).unwrap().group, 1);
    }

    #[test]
    fn packing_never_spans_and_oversized_gets_own_group() {
        let l = ChunkLayout::pack(10, &[4, 4, 4, 25, 2, 10]).unwrap();
        // [4,4] [4,2] [25] [10]
        assert_eq!(l.group_elems, vec![10, 10, 25, 10]);
        assert_eq!(
            l.slots[2],
            Slot {
                group: 1,
                offset: 0,
                numel: 4
            }
        );
        assert_eq!(
            l.slots[3],
            Slot {
                group: 2,
                offset: 0,
                numel: 25
            }
        );
        assert_eq!(
            l.slots[4],
            Slot {
                group: 1,
                offset: 4,
                numel: 2
            }
        );
        assert_eq!(l.waste_elems(), 2 + 4);
        for s in &l.slots {
            assert!(s.offset + s.numel <= l.group_elems[s.group as usize]);
        }
        assert!(ChunkLayout::pack(0, &[1]).is_err());
        assert!(ChunkLayout::pack(4, &[0]).is_err());
    }

    #[test]
    fn search_ignores_outliers_and_rounds() {
        let mut numels = vec![300; 40];
        numels.push(1_000_000);
        let s = SizeSearch {
            start: 500,
            range: 600,
            interval: 100,
            multiple_of: 4,
        };
        let c = search_chunk_size(&numels, s).unwrap();
        // 600 holds two tensors exactly; the outlier is not counted.
        assert_eq!((c.chunk_elems, c.waste_elems), (600, 0));
        let c = search_chunk_size(
            &numels,
            SizeSearch {
                multiple_of: 7,
                ..s
            },
        )
        .unwrap();
        assert_eq!((c.chunk_elems, c.waste_elems), (602, 40));
        assert!(search_chunk_size(&[], s).is_err());
    }
}
