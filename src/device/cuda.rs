//! The CUDA backend, through cudarc with the driver loaded at run time.
//!
//! Creating it never panics on a machine without CUDA: it checks that the driver library loads
//! (`is_culib_present`) and that a device exists before touching the driver, and returns
//! [`Error::BackendUnavailable`] otherwise. Device buffers are cudarc slices (whose stream-ordered
//! free waits for work still using them); pinned host memory is allocated without the
//! write-combined flag, because the CPU optimizer reads it.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    result as cu, sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream,
    DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use parking_lot::Mutex;

use super::{
    Backend, BackendKind, DeviceId, HostBuffer, MemInfo, Op, RawBuffer, RawEvent, RawStream,
    GRAD_STATS_PARTIALS,
};
use crate::error::{Error, Result};
use crate::kernels;
use crate::ops::embedding::{BagMode, EmbeddingKernel, RowOptimizer};

struct CudaMem {
    /// `None` for zero-length buffers (nothing allocated).
    slice: Mutex<Option<CudaSlice<u8>>>,
    /// An event after the latest use on each stream that touched the buffer. cudarc tracks one
    /// read event per slice, but two streams may read a buffer concurrently; the free must wait
    /// for both.
    uses: Mutex<Vec<(Arc<CudaStream>, CudaEvent)>>,
}

impl CudaMem {
    fn new(slice: Option<CudaSlice<u8>>) -> Self {
        CudaMem {
            slice: Mutex::new(slice),
            uses: Mutex::new(Vec::new()),
        }
    }

    /// Records that work just enqueued on `s` uses this buffer.
    fn used_on(&self, s: &Arc<CudaStream>) -> Result<()> {
        let mut uses = self.uses.lock();
        let rec = |e: &CudaEvent| {
            e.record(s)
                .map_err(|e| Error::cuda("recording a buffer use", e))
        };
        if let Some((_, e)) = uses.iter().find(|(st, _)| Arc::ptr_eq(st, s)) {
            return rec(e);
        }
        let e = s
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| Error::cuda("creating an event", e))?;
        rec(&e)?;
        uses.push((s.clone(), e));
        Ok(())
    }
}

impl Drop for CudaMem {
    fn drop(&mut self) {
        if let Some(slice) = self.slice.get_mut().take() {
            // The stream-ordered free runs on the slice's stream: make it wait for every use.
            for (_, e) in self.uses.get_mut().iter() {
                let _ = slice.stream().wait(e);
            }
            drop(slice);
        }
    }
}

/// A CUDA GPU. See the [module docs](self).
pub struct CudaBackend {
    id: DeviceId,
    ctx: Arc<CudaContext>,
    arch: (i32, i32),
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("id", &self.id)
            .field("arch", &self.arch)
            .finish()
    }
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::BackendUnavailable {
        kind: BackendKind::Cuda,
        reason: reason.into(),
    }
}

/// Whether a CUDA driver library can be loaded on this machine (no driver call is made).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library.
    unsafe { sys::is_culib_present() }
}

/// Number of CUDA devices, or 0 when there is no driver or the driver fails to initialise.
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    if cu::init().is_err() {
        return 0;
    }
    cu::device::get_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}

impl CudaBackend {
    /// Opens CUDA device `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !driver_present() {
            return Err(unavailable(
                "the CUDA driver library (libcuda) is not installed",
            ));
        }
        cu::init().map_err(|e| unavailable(format!("cuInit failed: {e}")))?;
        let count = cu::device::get_count()
            .map_err(|e| unavailable(format!("cuDeviceGetCount failed: {e}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(unavailable(format!(
                "device {ordinal} requested, {count} CUDA device(s) present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::cuda("creating a context", e))?;
        let arch = ctx
            .compute_capability()
            .map_err(|e| Error::cuda("reading the compute capability", e))?;
        Ok(CudaBackend {
            id: DeviceId::new(BackendKind::Cuda, ordinal),
            ctx,
            arch,
            modules: Mutex::new(HashMap::new()),
        })
    }

    /// The cudarc context (for code that launches its own kernels).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.arch
    }

    /// Loads (compiling on first use, then cached per device) the module of kernel source
    /// `name` and returns function `func` from it.
    pub fn function(&self, name: &'static str, func: &str) -> Result<CudaFunction> {
        let module = {
            let mut modules = self.modules.lock();
            match modules.get(name) {
                Some(m) => m.clone(),
                None => {
                    let src = kernels::source(name)?;
                    let arch = format!("sm_{}{}", self.arch.0, self.arch.1);
                    let image = kernels::compile(src, kernels::Target::Cubin(arch))?;
                    let m = self
                        .ctx
                        .load_module(cudarc::nvrtc::Ptx::from_binary(image.to_vec()))
                        .map_err(|e| Error::cuda("loading a kernel module", e))?;
                    modules.insert(name, m.clone());
                    m
                }
            }
        };
        module
            .load_function(func)
            .map_err(|e| Error::cuda("loading a kernel function", e))
    }
}

fn mem(raw: &RawBuffer) -> Result<&CudaMem> {
    raw.downcast_ref::<CudaMem>()
        .ok_or_else(|| Error::InvalidArgument("buffer was not allocated by a CUDA device".into()))
}

fn stream(raw: &RawStream) -> Result<&Arc<CudaStream>> {
    raw.downcast_ref::<Arc<CudaStream>>()
        .ok_or_else(|| Error::InvalidArgument("stream was not created by a CUDA device".into()))
}

fn event(raw: &RawEvent) -> Result<&CudaEvent> {
    raw.downcast_ref::<CudaEvent>()
        .ok_or_else(|| Error::InvalidArgument("event was not created by a CUDA device".into()))
}

const BLOCK: u32 = 256;

impl Backend for CudaBackend {
    fn id(&self) -> DeviceId {
        self.id
    }

    fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "CUDA device".into())
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| Error::cuda("querying memory", e))?;
        Ok(MemInfo { free, total })
    }

    fn alloc(&self, bytes: usize) -> Result<RawBuffer> {
        if bytes == 0 {
            return Ok(Box::new(CudaMem::new(None)));
        }
        let s = self.ctx.default_stream();
        // SAFETY: the memory is uninitialised device memory; it is only read through copies the
        // user enqueues, never exposed to Rust as a typed value.
        match unsafe { s.alloc::<u8>(bytes) } {
            Ok(mut slice) => {
                // The allocation is ordered on the default stream (its memory may be a block
                // freed there while other streams' work on it was still pending): record that
                // point as the slice's last write, so cudarc makes every other stream wait for
                // it before its first use.
                drop(slice.device_ptr_mut(&s));
                self.ctx
                    .check_err()
                    .map_err(err("ordering a new allocation"))?;
                Ok(Box::new(CudaMem::new(Some(slice))))
            }
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let info = self.mem_info().unwrap_or(MemInfo { free: 0, total: 0 });
                Err(Error::OutOfMemory {
                    device: self.id,
                    requested: bytes,
                    free: info.free,
                    capacity: info.total,
                })
            }
            Err(e) => Err(Error::cuda("allocating device memory", e)),
        }
    }

    fn alloc_host(&self, bytes: usize) -> Result<HostBuffer> {
        HostBuffer::pinned(&self.ctx, bytes)
    }

    fn new_stream(&self) -> Result<RawStream> {
        let s = self
            .ctx
            .new_stream()
            .map_err(|e| Error::cuda("creating a stream", e))?;
        Ok(Box::new(s))
    }

    fn new_event(&self) -> Result<RawEvent> {
        let e = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| Error::cuda("creating an event", e))?;
        Ok(Box::new(e))
    }

    fn bind_to_thread(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("binding the context", e))
    }

    unsafe fn enqueue(&self, s: &RawStream, op: Op<'_>) -> Result<()> {
        let s = stream(s)?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("binding the context", e))?;
        let cs = s.cu_stream();
        let touched: Vec<&CudaMem> = match &op {
            Op::HostToDevice { dst, .. } | Op::Fill { dst, .. } => vec![mem(dst)?],
            Op::DeviceToHost { src, .. } => vec![mem(src)?],
            Op::DeviceToDevice { src, dst, .. } | Op::Cast { src, dst, .. } => {
                vec![mem(src)?, mem(dst)?]
            }
            Op::GradStats { src, out, .. } => vec![mem(src)?, mem(out)?],
            Op::Adam {
                params,
                momentum,
                variance,
                grad,
                copy,
                ..
            } => {
                let mut v = vec![
                    mem(params.0)?,
                    mem(momentum.0)?,
                    mem(variance.0)?,
                    mem(grad.0)?,
                ];
                if let Some(c) = copy {
                    v.push(mem(c.0)?);
                }
                v
            }
            Op::Foreign { operands, .. } => operands
                .iter()
                .map(|(b, _, _)| mem(b))
                .collect::<Result<_>>()?,
            Op::Embedding { reads, write, .. } => reads
                .iter()
                .map(|(b, _, _)| mem(b))
                .chain(std::iter::once(mem(write.0)))
                .collect::<Result<_>>()?,
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { self.enqueue_op(s, cs, op)? };
        for m in touched {
            m.used_on(s)?;
        }
        // cudarc records errors of its own event bookkeeping in the context: surface them.
        self.ctx
            .check_err()
            .map_err(err("stream-ordering bookkeeping"))
    }

    fn record(&self, s: &RawStream, e: &RawEvent) -> Result<()> {
        event(e)?
            .record(stream(s)?)
            .map_err(|e| Error::cuda("recording an event", e))
    }

    fn wait(&self, s: &RawStream, e: &RawEvent) -> Result<()> {
        stream(s)?
            .wait(event(e)?)
            .map_err(|e| Error::cuda("making a stream wait", e))
    }

    fn sync_event(&self, e: &RawEvent) -> Result<()> {
        event(e)?
            .synchronize()
            .map_err(|e| Error::cuda("synchronising an event", e))
    }

    fn query_event(&self, e: &RawEvent) -> Result<bool> {
        event(e)?
            .try_is_complete()
            .map_err(|e| Error::cuda("querying an event", e))
    }

    fn sync_stream(&self, s: &RawStream) -> Result<()> {
        stream(s)?
            .synchronize()
            .map_err(|e| Error::cuda("synchronising a stream", e))
    }
}

impl CudaBackend {
    /// Issues one validated op on `s` (the context is bound).
    ///
    /// # Safety
    /// As [`Backend::enqueue`].
    unsafe fn enqueue_op(&self, s: &Arc<CudaStream>, cs: sys::CUstream, op: Op<'_>) -> Result<()> {
        match op {
            Op::Embedding {
                kernel,
                reads,
                write,
            } => self.embedding(s, kernel, reads, write)?,
            Op::Foreign { operands, run } => {
                let ops: Vec<(&CudaMem, usize, bool)> = operands
                    .iter()
                    .map(|&(b, off, w)| mem(b).map(|m| (m, off, w)))
                    .collect::<Result<_>>()?;
                with_ptrs(s, &ops, |ptrs| (run.0)(ptrs, cs.cast()))?;
            }
            Op::HostToDevice {
                src,
                dst,
                dst_offset,
                len,
            } => {
                let mut d = mem(dst)?.slice.lock();
                if let (Some(d), true) = (d.as_mut(), len > 0) {
                    let (ptr, _rec) = d.device_ptr_mut(s);
                    // SAFETY: bounds checked by `Device`; `src` valid for `len` bytes until the
                    // event recorded after this op completes (enqueue contract).
                    let host = std::slice::from_raw_parts(src, len);
                    cu::memcpy_htod_async(ptr + dst_offset as u64, host, cs)
                        .map_err(err("a host-to-device copy"))?;
                }
            }
            Op::DeviceToHost {
                src,
                src_offset,
                dst,
                len,
            } => {
                let sl = mem(src)?.slice.lock();
                if let (Some(sl), true) = (sl.as_ref(), len > 0) {
                    let (ptr, _rec) = sl.device_ptr(s);
                    // SAFETY: as above; `dst` is exclusively owned by the pending copy.
                    let host = std::slice::from_raw_parts_mut(dst, len);
                    cu::memcpy_dtoh_async(host, ptr + src_offset as u64, cs)
                        .map_err(err("a device-to-host copy"))?;
                }
            }
            Op::DeviceToDevice {
                src,
                src_offset,
                dst,
                dst_offset,
                len,
            } => {
                if len == 0 {
                    return Ok(());
                }
                let (sm, dm) = (mem(src)?, mem(dst)?);
                if std::ptr::eq(sm, dm) {
                    let mut g = dm.slice.lock();
                    let sl = g
                        .as_mut()
                        .ok_or_else(|| Error::InvalidArgument("empty buffer".into()))?;
                    let (ptr, _rec) = sl.device_ptr_mut(s);
                    cu::memcpy_dtod_async(
                        ptr + dst_offset as u64,
                        ptr + src_offset as u64,
                        len,
                        cs,
                    )
                    .map_err(err("a device-to-device copy"))?;
                } else {
                    let sg = sm.slice.lock();
                    let mut dg = dm.slice.lock();
                    if let (Some(a), Some(b)) = (sg.as_ref(), dg.as_mut()) {
                        let (sp, _r1) = a.device_ptr(s);
                        let (dp, _r2) = b.device_ptr_mut(s);
                        cu::memcpy_dtod_async(
                            dp + dst_offset as u64,
                            sp + src_offset as u64,
                            len,
                            cs,
                        )
                        .map_err(err("a device-to-device copy"))?;
                    }
                }
            }
            Op::Fill {
                dst,
                offset,
                len,
                value,
            } => {
                let mut d = mem(dst)?.slice.lock();
                if let (Some(d), true) = (d.as_mut(), len > 0) {
                    let (ptr, _rec) = d.device_ptr_mut(s);
                    cu::memset_d8_async(ptr + offset as u64, value, len, cs)
                        .map_err(err("a memset"))?;
                }
            }
            Op::Cast {
                src,
                src_offset,
                from,
                dst,
                dst_offset,
                to,
                count,
            } => {
                if count == 0 {
                    return Ok(());
                }
                crate::ops::cast::check_supported(from, to)?;
                let f =
                    self.function("convert.cu", &format!("cast_{}_{}", from.name(), to.name()))?;
                let (sm, dm) = (mem(src)?, mem(dst)?);
                let n = count as u64;
                let launch = |sp: u64, dp: u64| -> Result<()> {
                    let mut b = s.launch_builder(&f);
                    b.arg(&sp).arg(&dp).arg(&n);
                    // SAFETY: the kernel reads `count` elements at `sp` and writes `count` at
                    // `dp`, both inside their buffers and disjoint (checked by `Device::cast`).
                    unsafe { b.launch(cfg(grid_for(count))) }
                        .map(|_| ())
                        .map_err(err("launching a cast kernel"))
                };
                let empty = || Error::InvalidArgument("cast on an empty buffer".into());
                if std::ptr::eq(sm, dm) {
                    let mut g = dm.slice.lock();
                    let (p, _rec) = g.as_mut().ok_or_else(empty)?.device_ptr_mut(s);
                    launch(p + src_offset as u64, p + dst_offset as u64)?;
                } else {
                    let sg = sm.slice.lock();
                    let mut dg = dm.slice.lock();
                    let (sp, _r1) = sg.as_ref().ok_or_else(empty)?.device_ptr(s);
                    let (dp, _r2) = dg.as_mut().ok_or_else(empty)?.device_ptr_mut(s);
                    launch(sp + src_offset as u64, dp + dst_offset as u64)?;
                }
            }
            Op::Adam {
                params,
                momentum,
                variance,
                grad,
                copy,
                count,
                scalars: sc,
            } => {
                if count == 0 {
                    return Ok(());
                }
                let name = format!(
                    "adam_g{}_c{}",
                    grad.2.name(),
                    copy.map_or("none", |c| c.2.name())
                );
                let f = self.function("adam.cu", &name)?;
                let mut operands = vec![
                    (mem(params.0)?, params.1, true),
                    (mem(momentum.0)?, momentum.1, true),
                    (mem(variance.0)?, variance.1, true),
                    (mem(grad.0)?, grad.1, false),
                ];
                if let Some(c) = copy {
                    operands.push((mem(c.0)?, c.1, true));
                }
                let n = count as u64;
                let scalars = [
                    sc.grad_scale,
                    sc.l2,
                    sc.beta1,
                    sc.one_minus_beta1,
                    sc.beta2,
                    sc.one_minus_beta2,
                    sc.inv_sqrt_bc2,
                    sc.eps,
                    sc.decoupled,
                    sc.step_size,
                ];
                with_ptrs(s, &operands, |ptrs| {
                    let mut b = s.launch_builder(&f);
                    for p in ptrs {
                        b.arg(p);
                    }
                    b.arg(&n);
                    for x in &scalars {
                        b.arg(x);
                    }
                    // SAFETY: the kernel reads and writes `count` elements at each pointer, each
                    // range inside its buffer, aligned to its element type, and disjoint from the
                    // others except a copy that is exactly the gradient range, which the kernel
                    // allows (checked by `Device::adam`). The arguments match the kernel's
                    // parameters: four or five pointers, the count, then the ten scalars.
                    unsafe { b.launch(cfg(grid_for(count))) }
                        .map(|_| ())
                        .map_err(err("launching an Adam kernel"))
                })?;
            }
            Op::GradStats {
                src,
                src_offset,
                dtype,
                count,
                out,
                out_offset,
            } => {
                let operands = [
                    (mem(src)?, src_offset, false),
                    (mem(out)?, out_offset, true),
                ];
                if count == 0 {
                    // The sum of no squares, no nonfinite element: two f64 zeros.
                    return with_ptrs(s, &operands[1..], |ptrs| {
                        cu::memset_d8_async(ptrs[0], 0, 16, cs).map_err(err("a memset"))
                    });
                }
                let partial =
                    self.function("adam.cu", &format!("grad_stats_partial_{}", dtype.name()))?;
                let finish = self.function("adam.cu", "grad_stats_final")?;
                let n = count as u64;
                with_ptrs(s, &operands, |ptrs| {
                    let (sp, op) = (ptrs[0], ptrs[1]);
                    let mut b = s.launch_builder(&partial);
                    b.arg(&sp).arg(&n).arg(&op);
                    // SAFETY: the kernel reads `count` elements at `sp` and writes
                    // 2 * GRAD_STATS_PARTIALS f64 after the first 16 bytes at `op`, all inside
                    // `GRAD_STATS_BYTES` (checked by `Device::grad_stats`), which do not overlap
                    // the source. The grid is fixed: one partial per block.
                    unsafe {
                        b.launch(LaunchConfig {
                            grid_dim: (GRAD_STATS_PARTIALS as u32, 1, 1),
                            block_dim: (GRAD_STATS_THREADS, 1, 1),
                            shared_mem_bytes: 0,
                        })
                    }
                    .map_err(err("launching a gradient statistics kernel"))?;
                    let mut b = s.launch_builder(&finish);
                    b.arg(&op);
                    // SAFETY: one block of GRAD_STATS_PARTIALS threads reads the partials the
                    // kernel above wrote (same stream, so after it) and writes the first 16 bytes
                    // at `op`, all inside the output range.
                    unsafe {
                        b.launch(LaunchConfig {
                            grid_dim: (1, 1, 1),
                            block_dim: (GRAD_STATS_PARTIALS as u32, 1, 1),
                            shared_mem_bytes: 0,
                        })
                    }
                    .map(|_| ())
                    .map_err(err("launching a gradient statistics kernel"))
                })?;
            }
        }
        Ok(())
    }
}

impl CudaBackend {
    /// Launches one embedding kernel of `kernels/embedding.cu` (operands validated by
    /// `Device`: in bounds, 4-byte aligned, the written range disjoint from the read ones).
    fn embedding(
        &self,
        s: &Arc<CudaStream>,
        kernel: EmbeddingKernel,
        reads: &[(&RawBuffer, usize, usize)],
        write: (&RawBuffer, usize, usize),
    ) -> Result<()> {
        let mut operands: Vec<(&CudaMem, usize, bool)> = reads
            .iter()
            .map(|&(b, off, _)| mem(b).map(|m| (m, off, false)))
            .collect::<Result<_>>()?;
        operands.push((mem(write.0)?, write.1, true));
        let len = |i: usize| if i < reads.len() { reads[i].2 } else { write.2 } as u64;
        let (name, blocks) = match kernel {
            EmbeddingKernel::Bag { .. } => ("emb_bag", (len(2) / 4).saturating_sub(1)),
            EmbeddingKernel::Backward { .. } => ("emb_backward", (len(1) / 4).saturating_sub(1)),
            EmbeddingKernel::Step { .. } => ("emb_step", len(0) / 4),
            EmbeddingKernel::Gather { .. } => ("emb_gather", len(1) / 4),
            EmbeddingKernel::Scatter { .. } => ("emb_scatter", len(1) / 4),
        };
        if blocks == 0 {
            return Ok(());
        }
        let f = self.function("embedding.cu", name)?;
        // Threads loop over a row's columns (or 32-bit words): narrow rows take fewer warps.
        let width = match kernel {
            EmbeddingKernel::Bag { dim, .. }
            | EmbeddingKernel::Backward { dim }
            | EmbeddingKernel::Step { dim, .. } => dim,
            EmbeddingKernel::Gather { row_bytes } | EmbeddingKernel::Scatter { row_bytes } => {
                row_bytes / 4
            }
        };
        let config = LaunchConfig {
            grid_dim: (blocks.min(65_535) as u32, 1, 1),
            block_dim: (embedding_threads(width), 1, 1),
            shared_mem_bytes: 0,
        };
        let launch = |ptrs: &[u64]| -> Result<()> {
            // Scalars live until the launch below.
            let (mut us, mut fs, mut is): (Vec<u64>, Vec<f32>, Vec<i32>) = (vec![], vec![], vec![]);
            let null = 0u64;
            let mut b = s.launch_builder(&f);
            match kernel {
                EmbeddingKernel::Bag {
                    stride,
                    dim,
                    mode,
                    weighted,
                } => {
                    let rows = len(0) / 4 / stride as u64;
                    us.extend([rows, stride as u64, dim as u64, len(1) / 4, blocks]);
                    is.push((mode == BagMode::Mean) as i32);
                    b.arg(&ptrs[0]).arg(&ptrs[1]).arg(&ptrs[2]);
                    if weighted {
                        b.arg(&ptrs[3]).arg(&ptrs[4]);
                    } else {
                        b.arg(&null).arg(&ptrs[3]);
                    }
                    for u in &us {
                        b.arg(u);
                    }
                    b.arg(&is[0]);
                }
                EmbeddingKernel::Backward { dim } => {
                    us.extend([blocks, dim as u64, len(0) / 4 / dim as u64, len(2) / 4]);
                    for p in &ptrs[..5] {
                        b.arg(p);
                    }
                    for u in &us {
                        b.arg(u);
                    }
                }
                EmbeddingKernel::Step { stride, dim, opt } => {
                    let rows = len(2) / 4 / stride as u64;
                    us.extend([rows, stride as u64, dim as u64, blocks]);
                    let (kind, lr, eps, b1, b2, c1, c2) = match opt {
                        RowOptimizer::Sgd { lr } => (0, lr, 0.0, 0.0, 0.0, 1.0, 1.0),
                        RowOptimizer::RowwiseAdagrad { lr, eps } => {
                            (1, lr, eps, 0.0, 0.0, 1.0, 1.0)
                        }
                        RowOptimizer::Adam {
                            lr,
                            beta1,
                            beta2,
                            eps,
                            bias1,
                            bias2,
                        } => (2, lr, eps, beta1, beta2, bias1, bias2),
                    };
                    is.push(kind);
                    fs.extend([lr, eps, b1, b2, c1, c2]);
                    // table (the written operand), rows, grads.
                    b.arg(&ptrs[2]).arg(&ptrs[0]).arg(&ptrs[1]);
                    for u in &us {
                        b.arg(u);
                    }
                    b.arg(&is[0]);
                    for x in &fs {
                        b.arg(x);
                    }
                }
                EmbeddingKernel::Gather { row_bytes } | EmbeddingKernel::Scatter { row_bytes } => {
                    let table = if matches!(kernel, EmbeddingKernel::Gather { .. }) {
                        len(0)
                    } else {
                        len(2)
                    };
                    let words = row_bytes as u64 / 4;
                    us.extend([table / row_bytes as u64, words, blocks]);
                    b.arg(&ptrs[0]).arg(&ptrs[1]).arg(&ptrs[2]);
                    for u in &us {
                        b.arg(u);
                    }
                }
            }
            // SAFETY: the arguments match the kernel's parameters (pointers, then the u64
            // sizes, then the int and float scalars, in the order of `kernels/embedding.cu`);
            // every size is derived from the validated operand lengths, and the kernels clamp
            // offsets and skip index values out of range, so no access leaves its operand.
            unsafe { b.launch(config) }
                .map(|_| ())
                .map_err(err("launching an embedding kernel"))
        };
        with_ptrs(s, &operands, launch)
    }
}

/// Threads per block of the embedding kernels.
const EMBEDDING_THREADS: u32 = 128;

/// Threads per block of an embedding kernel over rows of `width` columns: whole warps, at most
/// [`EMBEDDING_THREADS`]. The result bits do not depend on it (each column is summed by one
/// thread in a fixed order).
fn embedding_threads(width: usize) -> u32 {
    (width.div_ceil(32) * 32).clamp(32, EMBEDDING_THREADS as usize) as u32
}

/// Threads per block of `grad_stats_partial_*` (`GS_THREADS` in `kernels/adam.cu`).
const GRAD_STATS_THREADS: u32 = 1024;

/// Calls `f` with the device address of each operand (`(buffer, byte offset, written)`), then
/// records the uses. Operands may share a buffer: each distinct buffer is locked once (its mutex
/// is not reentrant) and its base pointer taken once, for writing when any operand writes it.
fn with_ptrs<R>(
    s: &Arc<CudaStream>,
    operands: &[(&CudaMem, usize, bool)],
    f: impl FnOnce(&[u64]) -> Result<R>,
) -> Result<R> {
    let mut distinct: Vec<(&CudaMem, bool)> = Vec::with_capacity(operands.len());
    let mut which = Vec::with_capacity(operands.len());
    for &(m, _, write) in operands {
        match distinct.iter().position(|(d, _)| std::ptr::eq(*d, m)) {
            Some(k) => {
                distinct[k].1 |= write;
                which.push(k);
            }
            None => {
                which.push(distinct.len());
                distinct.push((m, write));
            }
        }
    }
    let mut guards: Vec<_> = distinct.iter().map(|(m, _)| m.slice.lock()).collect();
    let mut bases = Vec::with_capacity(guards.len());
    let mut records = Vec::with_capacity(guards.len());
    for (g, &(_, write)) in guards.iter_mut().zip(&distinct) {
        // An empty buffer has no device memory; its views are empty, and no kernel or NCCL
        // call reads an operand of zero length, so its address is 0.
        let Some(sl) = g.as_mut() else {
            bases.push(0);
            continue;
        };
        let (p, rec) = if write {
            sl.device_ptr_mut(s)
        } else {
            sl.device_ptr(s)
        };
        bases.push(p);
        records.push(rec);
    }
    let ptrs: Vec<u64> = operands
        .iter()
        .zip(&which)
        .map(|(&(_, off, _), &k)| bases[k] + off as u64)
        .collect();
    let r = f(&ptrs);
    drop(records);
    r
}

fn err(during: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::cuda(during, e)
}

fn grid_for(count: usize) -> u32 {
    // Grid-stride kernels: cap the grid, every thread loops.
    (count.div_ceil(BLOCK as usize)).clamp(1, 65_535) as u32
}

fn cfg(grid: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::embedding_threads;

    #[test]
    fn embedding_blocks_are_whole_warps_up_to_the_cap() {
        assert_eq!(embedding_threads(1), 32);
        assert_eq!(embedding_threads(16), 32);
        assert_eq!(embedding_threads(33), 64);
        assert_eq!(embedding_threads(128), 128);
        assert_eq!(embedding_threads(131), 128);
        assert_eq!(embedding_threads(0), 32);
    }
}
