//! Adam's moment chunks held in 8 bits ([`MomentStorage::Int8`]): a chunk of `n` elements
//! holds its `n` codes, zero bytes up to a multiple of four, then one f32 scale a
//! [`QUANT8_BLOCK`] elements ([`ops::Quant8Map`](crate::ops::Quant8Map): the signed map for
//! the momentum, the unsigned one for the variance). Every tensor starts on a block, so a
//! tensor's moments are its codes and the scales of its own blocks, and they move (a state
//! copy, a checkpoint) as such, exactly.

use std::ops::Range;

use super::plan::MomentStorage;
use crate::error::{Error, Result};
use crate::ops::{Quant8Map, QUANT8_BLOCK};
use crate::tensor::ChunkKind;

/// The map list `kind`'s chunks are held in under `storage` (`None`: as f32 or the parameter
/// type, one value an element).
pub(crate) fn map_of(storage: MomentStorage, kind: ChunkKind) -> Option<Quant8Map> {
    match (storage, kind) {
        (MomentStorage::Int8, ChunkKind::Momentum) => Some(Quant8Map::Signed),
        (MomentStorage::Int8, ChunkKind::Variance) => Some(Quant8Map::Unsigned),
        _ => None,
    }
}

/// The byte where an 8-bit chunk of `elems` elements holds its scales.
pub(crate) fn scales_at(elems: usize) -> usize {
    elems.next_multiple_of(4)
}

/// The bytes of an 8-bit chunk of `chunk_elems` elements that hold the codes and the scales
/// of the tensor at element `offset` (a block's first) of `numel` elements.
pub(crate) fn tensor_bytes8(
    chunk_elems: usize,
    offset: usize,
    numel: usize,
) -> Result<(Range<usize>, Range<usize>)> {
    if !offset.is_multiple_of(QUANT8_BLOCK) || offset + numel > chunk_elems {
        return Err(Error::Internal {
            what: format!(
                "a tensor at element {offset} ({numel} elements) of an 8-bit chunk of \
                 {chunk_elems}: not on a block, or past the chunk"
            ),
        });
    }
    let at = scales_at(chunk_elems);
    let blocks = offset / QUANT8_BLOCK..(offset + numel).div_ceil(QUANT8_BLOCK);
    Ok((
        offset..offset + numel,
        at + 4 * blocks.start..at + 4 * blocks.end,
    ))
}

/// An 8-bit chunk of `elems` elements as its codes and its scales.
pub(crate) fn split8(chunk: &mut [u8], elems: usize) -> Result<(&mut [u8], &mut [f32])> {
    let blocks = elems.div_ceil(QUANT8_BLOCK);
    let at = scales_at(elems);
    if chunk.len() < at + 4 * blocks {
        return Err(Error::Internal {
            what: format!(
                "an 8-bit moment chunk of {elems} elements holds {} bytes, not {}",
                chunk.len(),
                at + 4 * blocks
            ),
        });
    }
    let p = chunk.as_ptr() as usize;
    let (codes, rest) = chunk.split_at_mut(at);
    let scales =
        bytemuck::try_cast_slice_mut(&mut rest[..4 * blocks]).map_err(|_| Error::Misaligned {
            what: "an 8-bit moment chunk's scales",
            value: p + at,
            align: 4,
        })?;
    Ok((&mut codes[..elems], scales))
}

/// The initial bytes of an 8-bit chunk of `elems` elements in `map`: every value 0.
pub(crate) fn fill_zeros8(map: Quant8Map, chunk: &mut [u8], elems: usize) {
    chunk.fill(0);
    if map == Quant8Map::Signed {
        // (with the scales 0 any code is 0; code 127 is 0 under any scale)
        chunk[..elems].fill(127);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_owns_its_codes_and_the_scales_of_its_blocks() {
        let (codes, scales) = tensor_bytes8(1000, 512, 300).unwrap();
        assert_eq!((codes, scales), (512..812, 1000 + 8..1000 + 16));
        let (codes, scales) = tensor_bytes8(1001, 0, 1001).unwrap();
        assert_eq!((codes, scales), (0..1001, 1004..1020));
        assert!(tensor_bytes8(1000, 100, 10).is_err());
        assert!(tensor_bytes8(1000, 768, 300).is_err());
        let bytes = MomentStorage::Int8.bytes(1001) as usize;
        let mut z = vec![9u8; bytes];
        fill_zeros8(Quant8Map::Signed, &mut z, 1001);
        let (c, s) = split8(&mut z, 1001).unwrap();
        assert!(c.iter().all(|&b| b == 127) && s.iter().all(|&x| x == 0.0));
        assert!(split8(&mut z[..bytes - 1], 1001).is_err());
    }
}
