//! [`Device::launch`]: every kernel launch validated the same way and ordered like a copy.

use super::kernel::{check_type, CudaSide, KernelDesc, LaunchInfo};
use super::order::Access;
use super::{operand_infos, Device, DeviceBuffer, Op, Operand, RawOperand, Stream};
use crate::error::{Error, Result};

impl Device {
    /// Launches an op's kernel on `stream` (see [`KernelDesc`]): `operands` follow the descriptor's
    /// signature (`None` for an optional operand left out) and `params` are the bytes of its
    /// parameter struct. Every launch is validated here the same way — one device, each operand
    /// of an accepted element type, aligned to it and whole elements long, no written operand
    /// overlapping another operand, the parameter block's size, then the op's shape check — and
    /// ordered like a copy. Ops wrap this in a typed function (see `tidemem::ops`).
    pub fn launch(
        &self,
        stream: &Stream,
        desc: &'static KernelDesc,
        operands: &[Option<Operand<'_>>],
        params: &[u8],
    ) -> Result<()> {
        self.validate_launch(desc, operands, params)?;
        let raw: Vec<Option<RawOperand<'_>>> = operands
            .iter()
            .map(|o| {
                o.as_ref().map(|o| RawOperand {
                    buf: &o.view.buf.raw,
                    offset: o.view.offset,
                    len: o.view.len,
                    dtype: o.dtype,
                })
            })
            .collect();
        if let Some(check) = desc.check {
            let infos = operand_infos(&raw);
            check(&LaunchInfo {
                desc,
                operands: &infos,
                params,
            })?;
        }
        let accesses: Vec<(&DeviceBuffer, Access)> = desc
            .operands
            .iter()
            .zip(operands)
            .filter_map(|(spec, o)| {
                let a = if spec.mode.writes() {
                    Access::Write
                } else {
                    Access::Read
                };
                o.as_ref().map(|o| (o.view.buf, a))
            })
            .collect();
        let op = Op::Launch {
            desc,
            operands: &raw,
            params,
        };
        self.submit(stream, &accesses, op)?;
        let c = &self.inner.counters;
        super::Counters::add(match desc.cuda {
            CudaSide::Library(_) => &c.library_calls,
            CudaSide::Nvrtc { .. } => &c.launches,
        });
        Ok(())
    }

    /// The generic checks of [`Device::launch`].
    fn validate_launch(
        &self,
        desc: &'static KernelDesc,
        operands: &[Option<Operand<'_>>],
        params: &[u8],
    ) -> Result<()> {
        if operands.len() != desc.operands.len() {
            return Err(desc.signature_error(format!(
                "{} operands for a signature of {}",
                operands.len(),
                desc.operands.len()
            )));
        }
        if params.len() != desc.params.size {
            return Err(desc.signature_error(format!(
                "parameters of {} bytes, the struct {} has {}",
                params.len(),
                desc.params.c_name,
                desc.params.size
            )));
        }
        for (i, (spec, op)) in desc.operands.iter().zip(operands).enumerate() {
            let Some(op) = op else {
                if spec.optional {
                    continue;
                }
                return Err(desc.signature_error(format!("operand `{}` is required", spec.name)));
            };
            self.check("buffer", op.view.buf.device)?;
            check_type(desc, spec, op.dtype)?;
            let es = op.dtype.size();
            for value in [op.view.offset, op.view.len] {
                if !value.is_multiple_of(es) {
                    return Err(Error::Misaligned {
                        what: spec.name,
                        value,
                        align: es,
                    });
                }
            }
            if !spec.mode.writes() {
                continue;
            }
            if op.read_only {
                return Err(desc.signature_error(format!(
                    "operand `{}` is written by the kernel but was given read-only",
                    spec.name
                )));
            }
            let clash = desc
                .operands
                .iter()
                .zip(operands)
                .enumerate()
                .find(|(j, (_, o))| *j != i && o.is_some_and(|o| o.view.overlaps(&op.view)));
            if let Some((_, (other, _))) = clash {
                return Err(desc.error(format!(
                    "written operand `{}` overlaps operand `{}`",
                    spec.name, other.name
                )));
            }
        }
        Ok(())
    }
}
