//! Chunk addressing: the schedulable chunks of a layout, numbered `group * 4 + kind`, and the
//! accesses the manager (and the simulator, which replays the manager's accesses) makes of them.

use serde::Serialize;

use super::layout::ChunkLayout;
use crate::error::{Error, Result};
use crate::ops::QUANT8_BLOCK;
use crate::tensor::ChunkKind;
use crate::tide::{Access, ChunkDesc, ChunkNo, Target};

/// How Adam's momentum and variance chunks hold their values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum MomentStorage {
    /// fp32: 4 bytes an element.
    #[default]
    F32,
    /// 8-bit block-wise ([`crate::ops::Quant8Map`]): a byte an element and an f32 scale a
    /// [`QUANT8_BLOCK`] elements, 1.016 bytes an element; tensors start on a block's first
    /// element, so every block is stepped whole.
    Int8,
}

impl MomentStorage {
    /// Bytes of one moment of `elems` elements.
    pub fn bytes(self, elems: usize) -> u64 {
        match self {
            MomentStorage::F32 => 4 * elems as u64,
            MomentStorage::Int8 => {
                (elems.next_multiple_of(4) + 4 * elems.div_ceil(QUANT8_BLOCK)) as u64
            }
        }
    }
}

/// How the chunks of a model are laid out.
#[derive(Clone, Debug, Serialize)]
pub struct ChunkPlan {
    /// The packing.
    pub layout: ChunkLayout,
    /// Schedulable chunks, `group * 4 + kind`.
    pub chunks: Vec<ChunkDesc>,
    /// Bytes of one parameter element (2 for fp16/bf16, 4 for fp32).
    pub param_bytes: u64,
    /// How the moments are held.
    pub moments: MomentStorage,
}

impl ChunkPlan {
    /// Packs tensors of `numels` elements (in registration order) with chunks of `chunk_elems`
    /// elements and parameters of `param_bytes` bytes.
    pub fn new(numels: &[usize], chunk_elems: usize, param_bytes: u64) -> Result<ChunkPlan> {
        ChunkPlan::with_moments(numels, chunk_elems, param_bytes, MomentStorage::F32)
    }

    /// [`ChunkPlan::new`] with the moments held as `moments` says.
    pub(crate) fn with_moments(
        numels: &[usize],
        chunk_elems: usize,
        param_bytes: u64,
        moments: MomentStorage,
    ) -> Result<ChunkPlan> {
        if !(1..=8).contains(&param_bytes) {
            return Err(Error::BadValue {
                what: "bytes per parameter element".into(),
                value: param_bytes as f64,
                want: "1 to 8",
            });
        }
        let layout = ChunkLayout::pack(chunk_elems, numels)?;
        let chunks = plan_chunks(&layout, param_bytes, moments);
        Ok(ChunkPlan {
            layout,
            chunks,
            param_bytes,
            moments,
        })
    }

    /// Schedulable number of chunk `kind` of `group`.
    pub fn chunk_no(group: u32, kind: ChunkKind) -> ChunkNo {
        group * 4 + kind.index() as u32
    }

    /// The group of schedulable chunk `chunk`.
    pub(crate) fn group_of(chunk: ChunkNo) -> u32 {
        chunk / 4
    }

    /// Bytes of all chunks of one kind.
    pub(crate) fn kind_bytes(&self, kind: ChunkKind) -> u64 {
        self.chunks
            .iter()
            .filter(|c| c.kind == kind)
            .map(|c| c.bytes)
            .sum()
    }

    /// Bytes of all chunks (model data with padding).
    pub(crate) fn total_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.bytes).sum()
    }
}

/// The schedulable chunks of a layout: for every group, its param, master, momentum and variance
/// chunks (numbered `group * 4 + kind`), the moments held as `moments` says.
pub(crate) fn plan_chunks(
    layout: &ChunkLayout,
    param_bytes: u64,
    moments: MomentStorage,
) -> Vec<ChunkDesc> {
    let mut chunks = Vec::with_capacity(layout.groups() * 4);
    for (g, &elems) in layout.group_elems.iter().enumerate() {
        for kind in ChunkKind::ALL {
            let bytes = match kind {
                ChunkKind::Param => elems as u64 * param_bytes,
                ChunkKind::Master => 4 * elems as u64,
                ChunkKind::Momentum | ChunkKind::Variance => moments.bytes(elems),
            };
            chunks.push(ChunkDesc {
                bytes,
                kind,
                group: g as u32,
            });
        }
    }
    chunks
}

/// The accesses of the host optimizer step of chunk group `group`: all four chunks on the host,
/// written.
pub fn optimizer_accesses(group: u32) -> Vec<Access> {
    ChunkKind::ALL
        .iter()
        .map(|&k| Access {
            chunk: ChunkPlan::chunk_no(group, k),
            target: Target::Host,
            write: true,
        })
        .collect()
}

/// Adds an access, merging with one to the same chunk.
pub(crate) fn push_access(acc: &mut Vec<Access>, chunk: ChunkNo, target: Target, write: bool) {
    match acc.iter_mut().find(|a| a.chunk == chunk) {
        Some(a) => a.write |= write,
        None => acc.push(Access {
            chunk,
            target,
            write,
        }),
    }
}
