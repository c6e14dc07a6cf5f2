//! What the ops bench times: each entry as data (name, bytes moved, the op's descriptor, its
//! parameter bytes and its operands in signature order), run by the CPU twin on host buffers or
//! by `Device::launch` on a GPU.

use tidemem::device::{HostOperand, KernelDesc, TwinArgs};
use tidemem::DType;

/// One operand of a kernel, in its signature's order, with its host bytes.
pub enum Arg {
    /// Read by the op.
    Read(Vec<u8>, DType),
    /// Written (or read and written) by the op.
    Write(Vec<u8>, DType),
    /// An optional operand left out.
    Absent,
}

impl Arg {
    /// `elems` zero elements of `d`, written.
    pub fn zeros(elems: usize, d: DType) -> Arg {
        Arg::Write(vec![0; elems * d.size()], d)
    }

    /// `floats_as(elems, seed, d)`, read.
    pub fn floats(elems: usize, seed: u32, d: DType) -> Arg {
        Arg::Read(floats_as(elems, seed, d), d)
    }
}

/// One launch of an op: its descriptor, parameter struct bytes and operands.
pub struct Kernel {
    pub desc: &'static KernelDesc,
    pub params: Vec<u8>,
    pub args: Vec<Arg>,
}

impl Kernel {
    /// Runs the op's CPU twin on the host buffers.
    pub fn run_twin(&mut self) {
        let Kernel { desc, params, args } = self;
        let ops: Vec<HostOperand<'_>> = args
            .iter_mut()
            .map(|a| match a {
                Arg::Read(b, d) => HostOperand::Read(b, *d),
                Arg::Write(b, d) => HostOperand::Write(b, *d),
                Arg::Absent => HostOperand::Absent,
            })
            .collect();
        let mut args = TwinArgs::new(desc, ops, params).expect("operands fit the signature");
        (desc.twin)(&mut args).expect("the twin runs");
    }
}

/// What an entry runs.
pub enum Work {
    /// An op's kernel (its CPU twin on the host, `Device::launch` on a GPU).
    Kernel(Kernel),
    /// Host code with no kernel, timed on the CPU only.
    Host(Box<dyn FnMut()>),
}

/// One op to time: its name, the bytes it reads and writes at least once, and what it runs.
pub struct Entry {
    pub name: String,
    pub bytes: usize,
    pub work: Work,
}

impl Entry {
    /// An op's kernel: `args` in `desc`'s signature order.
    pub fn kernel(
        name: impl Into<String>,
        bytes: usize,
        desc: &'static KernelDesc,
        params: Vec<u8>,
        args: Vec<Arg>,
    ) -> Entry {
        Entry {
            name: name.into(),
            bytes,
            work: Work::Kernel(Kernel { desc, params, args }),
        }
    }

    /// Host code with no kernel.
    pub fn host(name: impl Into<String>, bytes: usize, run: impl FnMut() + 'static) -> Entry {
        Entry {
            name: name.into(),
            bytes,
            work: Work::Host(Box::new(run)),
        }
    }

    /// Runs the entry on the CPU (a kernel's twin on host buffers).
    pub fn run_host(&mut self) {
        match &mut self.work {
            Work::Kernel(k) => k.run_twin(),
            Work::Host(run) => run(),
        }
    }
}

/// `n` f32 in [-2, 2) from a multiplicative hash of the position and `seed`, as bytes.
pub fn floats(n: usize, seed: u32) -> Vec<u8> {
    let v: Vec<f32> = (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 * 4.0 - 2.0
        })
        .collect();
    bytemuck::cast_slice(&v).to_vec()
}

/// `floats(n, seed)` stored as `d`.
pub fn floats_as(n: usize, seed: u32, d: DType) -> Vec<u8> {
    let v: Vec<f32> = bytemuck::pod_collect_to_vec(&floats(n, seed));
    tidemem::encode_f32(&v, d)
}

/// Token ids in `0..v` (a multiplicative hash of the position).
pub fn token_ids(n: usize, v: usize) -> Vec<i32> {
    (0..n)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) % v as u64) as i32)
        .collect()
}

/// The parameter struct's bytes.
pub fn pod<P: bytemuck::Pod>(p: &P) -> Vec<u8> {
    bytemuck::bytes_of(p).to_vec()
}

/// The median (the upper one of an even count).
pub fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}
