//! Modules, kernels and launches: the kernels compiled for the host (`build.rs`), module images
//! (cubins or PTX) that name them, function attributes, and `cuLaunchKernel`.
use super::*;

/// A kernel compiled for the host: its name, its caller and the sizes of its parameters.
#[repr(C)]
pub struct EmuKernel {
    name: *const c_char,
    invoke: unsafe extern "C" fn(*mut *mut c_void),
    nparams: usize,
    param_sizes: *const usize,
    param_is_ptr: *const u8,
}

// SAFETY: the tables are immutable C++ constants.
unsafe impl Sync for EmuKernel {}

impl EmuKernel {
    fn name(&self) -> &'static str {
        // SAFETY: a string literal of the generated table.
        unsafe { CStr::from_ptr(self.name) }.to_str().unwrap_or("")
    }
    fn sizes(&self) -> &'static [usize] {
        // SAFETY: `nparams` entries, from the generated table.
        unsafe { std::slice::from_raw_parts(self.param_sizes, self.nparams) }
    }
    fn is_ptr(&self) -> &'static [u8] {
        // SAFETY: `nparams` entries, from the generated table.
        unsafe { std::slice::from_raw_parts(self.param_is_ptr, self.nparams) }
    }
}

extern "C" {
    fn emu_launch(
        k: *const EmuKernel,
        grid: *const c_uint,
        block: *const c_uint,
        params: *mut *mut c_void,
        shared_bytes: c_uint,
    ) -> c_int;
    fn emu_fault_message() -> *const c_char;
}

/// Shared memory a block may use without opting in (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK`
/// and the default `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
pub(crate) const SHARED_PER_BLOCK: c_int = 48 * 1024;
/// The most a function may opt in to (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`,
/// sm_90's 227 KiB); the runtime's dynamic shared memory region has room for exactly this.
pub(crate) const SHARED_PER_BLOCK_OPTIN: c_int = 227 * 1024;
/// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR` of sm_90.
pub(crate) const SHARED_PER_SM: c_int = 228 * 1024;

const FUNC_MAX_THREADS_PER_BLOCK: c_int = 0;
const FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
const FUNC_PREFERRED_SHARED_MEMORY_CARVEOUT: c_int = 9;

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The names of every kernel this library can run.
pub fn kernel_names() -> Vec<&'static str> {
    kernel_tables()
        .into_iter()
        .flat_map(|t| t.iter().map(|k| k.name()))
        .collect()
}

fn find_kernel(name: &str) -> Option<&'static EmuKernel> {
    kernel_tables()
        .into_iter()
        .flat_map(|t| t.iter())
        .find(|k| k.name() == name)
}

/// The kernel a `CUfunction` handle stands for, if it is one of ours.
fn kernel_of(f: *const EmuKernel) -> Option<&'static EmuKernel> {
    kernel_tables()
        .into_iter()
        .flat_map(|t| t.iter())
        .find(|k| std::ptr::eq(*k, f))
}

/// Runs a launch enqueued by [`cuLaunchKernel`]: its parameters are `values`, parameter i at
/// byte `offsets[i]`.
pub(crate) fn run_launch(
    st: &mut State,
    kernel: &'static EmuKernel,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    mut values: Vec<u64>,
    offsets: &[usize],
) -> CUresult {
    let base = values.as_mut_ptr() as *mut u8;
    let mut ptrs: Vec<*mut c_void> = offsets
        .iter()
        // SAFETY: each offset is inside `values` (computed from the sizes).
        .map(|&o| unsafe { base.add(o) } as *mut c_void)
        .collect();
    // SAFETY: the kernel reads its parameters from `ptrs` (values of the sizes the kernel
    // declares, 8-byte aligned); its pointer parameters were checked to point into live
    // allocations at the launch; what it reads and writes beyond that is the program's
    // responsibility, as on a GPU.
    let r = unsafe {
        emu_launch(
            kernel,
            grid.as_ptr(),
            block.as_ptr(),
            ptrs.as_mut_ptr(),
            shared,
        )
    };
    let name = kernel.name();
    match r {
        0 => SUCCESS,
        2 => st.fault(format!(
            "kernel {name}: the threads of a block did not all reach the same __syncthreads()"
        )),
        3 => {
            // SAFETY: a NUL-terminated message in a static buffer of the runtime, written by
            // the launch that just ended.
            let msg = unsafe { CStr::from_ptr(emu_fault_message()) }.to_string_lossy();
            st.fault(format!("kernel {name}: {msg}"))
        }
        _ => st.fault(format!(
            "kernel {name} launched with grid {grid:?}, block {block:?} and {shared} bytes of \
             dynamic shared memory"
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Modules.

/// The bytes of a module image: an ELF cubin (its length from the ELF header) or PTX text.
unsafe fn image_bytes(p: *const u8) -> Option<Vec<u8>> {
    if p.is_null() {
        return None;
    }
    let head = std::slice::from_raw_parts(p, 4);
    if head == b"\x7fELF" {
        let h = std::slice::from_raw_parts(p, 64);
        if h[4] != 2 {
            return None; // 64-bit ELF only
        }
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap()) as usize;
        let u16_at = |o: usize| u16::from_le_bytes(h[o..o + 2].try_into().unwrap()) as usize;
        let (phoff, shoff) = (u64_at(32), u64_at(40));
        let (phsz, phn, shsz, shn) = (u16_at(54), u16_at(56), u16_at(58), u16_at(60));
        // Headers that cannot be a cubin's (entries too small, sizes that overflow or exceed
        // any image NVRTC makes) are refused rather than followed.
        const MAX: usize = 1 << 30;
        if shsz < 64 || (phn > 0 && phsz < 56) {
            return None;
        }
        let end = |off: usize, n: usize, sz: usize| n.checked_mul(sz)?.checked_add(off);
        let mut len = end(shoff, shn, shsz)?.max(end(phoff, phn, phsz)?).max(64);
        if len > MAX {
            return None;
        }
        // Section contents may follow the headers: take the furthest section end.
        let sh = std::slice::from_raw_parts(p.add(shoff), shsz * shn);
        for i in 0..shn {
            let e = &sh[i * shsz..(i + 1) * shsz];
            let ty = u32::from_le_bytes(e[4..8].try_into().unwrap());
            let off = u64::from_le_bytes(e[24..32].try_into().unwrap()) as usize;
            let size = u64::from_le_bytes(e[32..40].try_into().unwrap()) as usize;
            if ty != 8 {
                len = len.max(off.checked_add(size)?); // SHT_NOBITS occupies nothing
            }
        }
        if len > MAX {
            return None;
        }
        Some(std::slice::from_raw_parts(p, len).to_vec())
    } else {
        Some(CStr::from_ptr(p as *const c_char).to_bytes().to_vec())
    }
}

/// Whether a cubin (in its string table) or PTX (as an `.entry`) defines `name`.
fn image_defines(image: &[u8], name: &str) -> bool {
    if image.starts_with(b"\x7fELF") {
        let mut pat = vec![0u8];
        pat.extend_from_slice(name.as_bytes());
        pat.push(0);
        image.windows(pat.len()).any(|w| w == pat.as_slice())
    } else {
        let text = String::from_utf8_lossy(image);
        text.contains(&format!(".entry {name}("))
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(m: *mut *mut c_void, image: *const c_void) -> CUresult {
    with_ctx(|st| {
        if m.is_null() {
            return INVALID_VALUE;
        }
        let Some(bytes) = image_bytes(image as *const u8) else {
            return INVALID_IMAGE;
        };
        let elf = bytes.starts_with(b"\x7fELF");
        if !elf && !String::from_utf8_lossy(&bytes).contains(".entry") {
            return INVALID_IMAGE;
        }
        let id = st.id();
        st.modules.insert(id, bytes);
        *m = id as *mut c_void;
        SUCCESS
    })
}

#[no_mangle]
pub extern "C" fn cuModuleUnload(m: *mut c_void) -> CUresult {
    with(|st| match st.modules.remove(&(m as usize)) {
        Some(_) => SUCCESS,
        None => INVALID_HANDLE,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    f: *mut *const EmuKernel,
    m: *mut c_void,
    name: *const c_char,
) -> CUresult {
    with_ctx(|st| {
        if f.is_null() || name.is_null() {
            return INVALID_VALUE;
        }
        let Some(image) = st.modules.get(&(m as usize)) else {
            return INVALID_HANDLE;
        };
        let Ok(name) = CStr::from_ptr(name).to_str() else {
            return NOT_FOUND;
        };
        if !image_defines(image, name) {
            return NOT_FOUND;
        }
        match find_kernel(name) {
            Some(k) => {
                *f = k;
                SUCCESS
            }
            None => {
                eprintln!("tidemem-cuda-emu: kernel {name} is in the image but not in kernels/");
                NOT_FOUND
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(
    v: *mut c_int,
    attr: c_int,
    f: *const EmuKernel,
) -> CUresult {
    with(|st| {
        let Some(k) = kernel_of(f) else {
            return INVALID_HANDLE;
        };
        let value = match attr {
            FUNC_MAX_THREADS_PER_BLOCK => 1024,
            FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES => st.max_dynamic_shared(k),
            FUNC_PREFERRED_SHARED_MEMORY_CARVEOUT => -1,
            _ => 0, // static shared memory, registers, ...: none that the emulator knows of
        };
        put(v, value)
    })
}

/// Sets `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` (0 to 227 KiB: the emulator counts no
/// static shared memory against it) or accepts a carveout preference (-1 to 100, ignored);
/// every other attribute is read-only.
#[no_mangle]
pub extern "C" fn cuFuncSetAttribute(f: *const EmuKernel, attr: c_int, value: c_int) -> CUresult {
    with(|st| {
        let Some(k) = kernel_of(f) else {
            return INVALID_HANDLE;
        };
        match attr {
            FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES if (0..=SHARED_PER_BLOCK_OPTIN).contains(&value) => {
                st.dynamic_shared_cap
                    .insert(k as *const EmuKernel as usize, value);
                SUCCESS
            }
            FUNC_PREFERRED_SHARED_MEMORY_CARVEOUT if (-1..=100).contains(&value) => SUCCESS,
            _ => INVALID_VALUE,
        }
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *const EmuKernel,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    s: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    with_ctx(|st| {
        let Some(id) = st.stream_id(s) else {
            return INVALID_HANDLE;
        };
        let Some(kernel) = kernel_of(f) else {
            return INVALID_HANDLE;
        };
        let threads = bx as u64 * by as u64 * bz as u64;
        if [gx, gy, gz, bx, by, bz].contains(&0) || threads > 1024 || bz > 64 {
            return INVALID_VALUE;
        }
        // More dynamic shared memory than the function's cap (48 KiB unless raised with
        // cuFuncSetAttribute) is refused, as by CUDA.
        if shared as u64 > st.max_dynamic_shared(kernel) as u64 {
            eprintln!(
                "tidemem-cuda-emu: kernel {} launched with {shared} bytes of dynamic shared \
                 memory, over its cap of {} (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)",
                kernel.name(),
                st.max_dynamic_shared(kernel)
            );
            return INVALID_VALUE;
        }
        if !extra.is_null() {
            return NOT_SUPPORTED; // parameters through `extra` are not emulated
        }
        let sizes = kernel.sizes();
        if !sizes.is_empty() && params.is_null() {
            return INVALID_VALUE;
        }
        // Copy every parameter's value now, as the driver does: the caller's storage may be
        // gone by the time the kernel runs.
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut words = 0usize;
        for &sz in sizes {
            offsets.push(words * 8);
            words += sz.div_ceil(8).max(1);
        }
        let mut values = vec![0u64; words];
        let base = values.as_mut_ptr() as *mut u8;
        for (i, (&sz, &off)) in sizes.iter().zip(&offsets).enumerate() {
            let p = *params.add(i);
            if p.is_null() {
                return INVALID_VALUE;
            }
            std::ptr::copy_nonoverlapping(p as *const u8, base.add(off), sz);
        }
        // Every pointer parameter must point into a live allocation (null is allowed: the
        // kernels take null for an absent operand); the launch uses those allocations.
        let mut uses = Vec::new();
        for (i, (&off, &ptr)) in offsets.iter().zip(kernel.is_ptr()).enumerate() {
            if ptr == 0 {
                continue;
            }
            let v = values[off / 8] as usize;
            if v == 0 {
                continue;
            }
            match st.alloc_of(v, 0) {
                Some(a) => uses.push(a),
                None => {
                    let what = format!(
                        "kernel {} parameter {i} is {v:#x}, not inside a live device allocation",
                        kernel.name()
                    );
                    return st.fault(what);
                }
            }
        }
        uses.sort_unstable();
        uses.dedup();
        st.enqueue_using(
            id,
            Op::Launch {
                kernel,
                grid: [gx, gy, gz],
                block: [bx, by, bz],
                shared,
                values,
                offsets,
            },
            &uses,
        )
    })
}
