use std::collections::HashMap;
use std::sync::Arc;

use std::ffi::c_void;

use cudarc::driver::{
    result as cu, sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream,
    DevicePtr, DevicePtrMut,
};
use parking_lot::Mutex;

pub use super::cuda_stream::CudaRawStream;
use super::kernel::{CudaSide, Grid, KernelDesc, LaunchInfo, LibraryCall};
use super::{
    operand_infos, Backend, BackendKind, DeviceId, HostBuffer, MemInfo, Op, RawBuffer, RawEvent,
    RawOperand, RawStream,
};
use crate::error::{Error, Result};
use crate::kernels;

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

/// The CUDA backend, through cudarc with the driver loaded at run time.
///
/// Creating it never panics on a machine without CUDA: it checks that the driver library loads
/// (`is_culib_present`) and that a device exists before touching the driver, and returns
/// [`Error::BackendUnavailable`] otherwise. Device buffers are cudarc slices (whose stream-ordered
/// free waits for work still using them); pinned host memory is allocated without the
/// write-combined flag, because the CPU optimizer reads it. A stream (`CudaRawStream`) owns
/// the state the libraries ops call keep on it (a cuBLAS handle), and frees it with the stream.
///
/// A CUDA GPU. See [`CudaBackend`].
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
    pub(crate) fn function(&self, name: &'static str, func: &str) -> Result<CudaFunction> {
        let module = {
            let mut modules = self.modules.lock();
            match modules.get(name) {
                Some(m) => m.clone(),
                None => {
                    let src = kernels::source(name)?;
                    let arch = format!("sm_{}{}", self.arch.0, self.arch.1);
                    let image = kernels::compile(src, kernels::CompileTarget::Cubin(arch))?;
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
        .ok_or_else(|| Error::Internal {
            what: "buffer was not allocated by a CUDA device".into(),
        })
}

fn raw_stream(raw: &RawStream) -> Result<&CudaRawStream> {
    raw.downcast_ref::<CudaRawStream>()
        .ok_or_else(|| Error::Internal {
            what: "stream was not created by a CUDA device".into(),
        })
}

fn stream(raw: &RawStream) -> Result<&Arc<CudaStream>> {
    raw_stream(raw).map(CudaRawStream::cuda_stream)
}

fn event(raw: &RawEvent) -> Result<&CudaEvent> {
    raw.downcast_ref::<CudaEvent>()
        .ok_or_else(|| Error::Internal {
            what: "event was not created by a CUDA device".into(),
        })
}

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
        Ok(Box::new(CudaRawStream::new(s)))
    }

    fn new_event(&self) -> Result<RawEvent> {
        let e = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| Error::cuda("creating an event", e))?;
        Ok(Box::new(e))
    }

    fn new_timing_event(&self) -> Result<RawEvent> {
        let e = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| Error::cuda("creating a timing event", e))?;
        Ok(Box::new(e))
    }

    fn elapsed(&self, start: &RawEvent, end: &RawEvent) -> Result<Option<f64>> {
        // cudarc calls cuEventElapsedTime_v2 (CUDA 12.8 on): an older driver lacks it
        let mut v: std::ffi::c_int = 0;
        // SAFETY: an out-parameter for one int.
        let r = unsafe { sys::cuDriverGetVersion(&mut v) };
        if r != sys::CUresult::CUDA_SUCCESS || v < 12080 {
            return Ok(None);
        }
        let ms = event(start)?
            .elapsed_ms(event(end)?)
            .map_err(|e| Error::cuda("reading the time between events", e))?;
        Ok(Some(f64::from(ms) / 1e3))
    }

    fn bind_to_thread(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("binding the context", e))
    }

    unsafe fn enqueue(&self, s: &RawStream, op: Op<'_>) -> Result<()> {
        let rs = raw_stream(s)?;
        let s = rs.cuda_stream();
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("binding the context", e))?;
        let cs = s.cu_stream();
        let touched: Vec<&CudaMem> = match &op {
            Op::HostToDevice { dst, .. } | Op::Fill { dst, .. } => vec![mem(dst)?],
            Op::DeviceToHost { src, .. } => vec![mem(src)?],
            Op::DeviceToDevice { src, dst, .. } => vec![mem(src)?, mem(dst)?],
            Op::Launch { operands, .. } => operands
                .iter()
                .flatten()
                .map(|o| mem(o.buf))
                .collect::<Result<_>>()?,
            Op::Foreign { operands, .. } => operands
                .iter()
                .map(|(b, _, _)| mem(b))
                .collect::<Result<_>>()?,
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { self.enqueue_op(rs, cs, op)? };
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
    unsafe fn enqueue_op(&self, rs: &CudaRawStream, cs: sys::CUstream, op: Op<'_>) -> Result<()> {
        let s = rs.cuda_stream();
        match op {
            Op::Launch {
                desc,
                operands,
                params,
            } => self.launch(rs, cs, desc, operands, params)?,
            Op::Foreign { operands, run } => {
                let ops: Vec<(&CudaMem, usize, bool)> = operands
                    .iter()
                    .map(|&(b, off, w)| mem(b).map(|m| (m, off, w)))
                    .collect::<Result<_>>()?;
                with_ptrs(s, &ops, |ptrs| (run.0)(ptrs, cs.cast()))?;
            }
            // SAFETY: forwarded from this function's contract.
            copy => unsafe { copy_op(s, cs, copy)? },
        }
        Ok(())
    }
}

/// Issues one copy or fill on `s` (the context is bound).
///
/// # Safety
/// As [`Backend::enqueue`].
unsafe fn copy_op(s: &Arc<CudaStream>, cs: sys::CUstream, op: Op<'_>) -> Result<()> {
    match op {
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
                unsafe {
                    let host = std::slice::from_raw_parts(src, len);
                    cu::memcpy_htod_async(ptr + dst_offset as u64, host, cs)
                }
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
                unsafe {
                    let host = std::slice::from_raw_parts_mut(dst, len);
                    cu::memcpy_dtoh_async(host, ptr + src_offset as u64, cs)
                }
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
                let sl = g.as_mut().ok_or_else(|| Error::Internal {
                    what: "a copy within an empty buffer".into(),
                })?;
                let (ptr, _rec) = sl.device_ptr_mut(s);
                // SAFETY: both ranges lie in this allocation (checked by `Device`); the
                // driver's copy handles overlap within one buffer.
                unsafe {
                    cu::memcpy_dtod_async(ptr + dst_offset as u64, ptr + src_offset as u64, len, cs)
                }
                .map_err(err("a device-to-device copy"))?;
            } else {
                let sg = sm.slice.lock();
                let mut dg = dm.slice.lock();
                if let (Some(a), Some(b)) = (sg.as_ref(), dg.as_mut()) {
                    let (sp, _r1) = a.device_ptr(s);
                    let (dp, _r2) = b.device_ptr_mut(s);
                    // SAFETY: each range lies in its allocation (checked by `Device`).
                    unsafe {
                        cu::memcpy_dtod_async(
                            dp + dst_offset as u64,
                            sp + src_offset as u64,
                            len,
                            cs,
                        )
                    }
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
                // SAFETY: the range lies in this allocation (checked by `Device`).
                unsafe { cu::memset_d8_async(ptr + offset as u64, value, len, cs) }
                    .map_err(err("a memset"))?;
            }
        }
        Op::Launch { .. } | Op::Foreign { .. } => {
            return Err(Error::Internal {
                what: "a launch or foreign op run as a copy".into(),
            });
        }
    }
    Ok(())
}

impl CudaBackend {
    /// Runs one op (operands validated by `Device::launch`): its NVRTC plan's launches in
    /// order, each with the operands' addresses in signature order (0 for an absent one) and
    /// the parameter struct by value; or its library call.
    fn launch(
        &self,
        rs: &CudaRawStream,
        cs: sys::CUstream,
        desc: &'static KernelDesc,
        operands: &[Option<RawOperand<'_>>],
        params: &[u8],
    ) -> Result<()> {
        let s = rs.cuda_stream();
        let infos = operand_infos(operands);
        let info = LaunchInfo {
            desc,
            operands: &infos,
            params,
        };
        // Present operands, and where each sits among them.
        let mut present: Vec<(&CudaMem, usize, bool)> = Vec::new();
        let mut slot = Vec::with_capacity(operands.len());
        for (spec, o) in desc.operands.iter().zip(operands) {
            match o {
                Some(o) => {
                    slot.push(Some(present.len()));
                    present.push((mem(o.buf)?, o.offset, spec.mode.writes()));
                }
                None => slot.push(None),
            }
        }
        let addresses =
            |ptrs: &[u64]| -> Vec<u64> { slot.iter().map(|k| k.map_or(0, |k| ptrs[k])).collect() };
        match desc.cuda {
            CudaSide::Library(call) => with_ptrs(s, &present, |ptrs| {
                call(&LibraryCall {
                    info: &info,
                    ptrs: &addresses(ptrs),
                    stream: cs.cast(),
                    state: &rs.libraries,
                })
            }),
            CudaSide::Nvrtc { source, plan } => {
                let grids = plan(&info)?;
                if grids.is_empty() {
                    return Ok(());
                }
                let functions: Vec<(CudaFunction, &Grid)> = grids
                    .iter()
                    .map(|g| self.function(source, &g.entry).map(|f| (f, g)))
                    .collect::<Result<_>>()?;
                // The parameter struct, in 8-byte aligned storage for the driver to copy.
                let mut block = vec![0u64; params.len().div_ceil(8)];
                bytemuck::cast_slice_mut::<u64, u8>(&mut block)[..params.len()]
                    .copy_from_slice(params);
                with_ptrs(s, &present, |ptrs| {
                    let mut addrs = addresses(ptrs);
                    for (f, g) in &functions {
                        let mut args: Vec<*mut c_void> = addrs
                            .iter_mut()
                            .map(|a| (a as *mut u64).cast::<c_void>())
                            .collect();
                        if !params.is_empty() {
                            args.push(block.as_mut_ptr().cast());
                        }
                        // SAFETY: the entry takes the op's operands as pointers in signature
                        // order, then its parameter struct by value (the `.cu` and `.cuh`
                        // mirror the descriptor; a test compares the struct layouts). Every
                        // address points into a live allocation, in bounds, aligned and with the
                        // overlap rules of the signature (checked by `Device::launch`); the plan
                        // sizes the grid from the validated lengths. The argument storage lives
                        // until the call returns (the driver copies it).
                        unsafe {
                            cu::launch_kernel(
                                f.cu_function(),
                                (g.grid[0], g.grid[1], g.grid[2]),
                                (g.block[0], g.block[1], g.block[2]),
                                g.shared_bytes,
                                cs,
                                &mut args,
                            )
                        }
                        .map_err(|e| Error::cuda("launching a kernel", e))?;
                    }
                    Ok(())
                })
            }
        }
    }
}

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
