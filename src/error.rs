use std::path::PathBuf;

use crate::device_id::{BackendKind, DeviceId};
use crate::dtype::DType;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Typed errors for every fallible operation of the crate.
///
/// The public API never panics on bad input: it returns one of these variants, each of which
/// names the numbers a user needs to understand what went wrong.
///
/// Everything that can go wrong in `tidemem`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A device allocation did not fit.
    #[error(
        "out of device memory on {device}: requested {requested} bytes, {free} bytes free of {capacity}"
    )]
    OutOfMemory {
        /// The device that refused the allocation.
        device: DeviceId,
        /// Bytes asked for.
        requested: usize,
        /// Bytes free on the device when the request was made.
        free: usize,
        /// Total capacity of the device.
        capacity: usize,
    },

    /// A host allocation (pinned, paged or file-backed) failed.
    #[error("host allocation of {requested} bytes ({tier}) failed: {reason}")]
    HostAlloc {
        /// Bytes asked for.
        requested: usize,
        /// Which host tier was asked.
        tier: &'static str,
        /// What the allocator said.
        reason: String,
    },

    /// Source and destination of a copy have different lengths.
    #[error("copy size mismatch: source is {src} bytes, destination is {dst} bytes")]
    SizeMismatch {
        /// Source length in bytes.
        src: usize,
        /// Destination length in bytes.
        dst: usize,
    },

    /// A byte range does not lie inside its buffer.
    #[error("range {offset}..{offset}+{len} is out of bounds for a buffer of {buffer_len} bytes")]
    OutOfBounds {
        /// Start of the range in bytes.
        offset: usize,
        /// Length of the range in bytes.
        len: usize,
        /// Length of the buffer.
        buffer_len: usize,
    },

    /// A handle (buffer, stream, event) was used with a device that did not create it.
    #[error("{what} belongs to {found}, but the operation runs on {expected}")]
    WrongDevice {
        /// What kind of handle was wrong.
        what: &'static str,
        /// The device the operation runs on.
        expected: DeviceId,
        /// The device that owns the handle.
        found: DeviceId,
    },

    /// An access to a device buffer is not ordered after a conflicting access on another stream.
    ///
    /// On a GPU this is a data race that silently reads stale or half-written bytes; the device
    /// layer refuses to enqueue it. Order the accesses with [`crate::device::Device::record`] +
    /// [`crate::device::Device::wait_event`], or synchronize on the host first.
    #[error(
        "unordered access to device buffer #{buffer}: {access} on stream {stream} is not ordered after \
         the {earlier} enqueued on stream {other_stream}; make the stream wait on an event recorded after it"
    )]
    UnorderedAccess {
        /// Buffer id.
        buffer: u64,
        /// "read" or "write": the access being enqueued.
        access: &'static str,
        /// Stream of the access being enqueued.
        stream: usize,
        /// "read" or "write": the earlier conflicting access.
        earlier: &'static str,
        /// Stream of the earlier access.
        other_stream: usize,
    },

    /// Offsets or lengths that are not a multiple of the element size of a typed operation.
    #[error("misaligned {what}: {value} is not a multiple of {align}")]
    Misaligned {
        /// Which argument.
        what: &'static str,
        /// The offending value.
        value: usize,
        /// Required multiple.
        align: usize,
    },

    /// A conversion between element types that is not supported.
    #[error("unsupported conversion {from} -> {to}")]
    UnsupportedCast {
        /// Source element type.
        from: DType,
        /// Destination element type.
        to: DType,
    },

    /// The requested backend is not available on this machine.
    #[error("{kind} backend unavailable: {reason}")]
    BackendUnavailable {
        /// The backend that was asked for.
        kind: BackendKind,
        /// Why it cannot be used.
        reason: String,
    },

    /// An error reported by the CUDA driver.
    #[error("CUDA driver error during {during}: {message}")]
    Cuda {
        /// What the device layer was doing.
        during: &'static str,
        /// The driver's description.
        message: String,
    },

    /// A library called on a device stream (cuBLAS) answered an error status. Nothing was
    /// enqueued by the failed call.
    #[error("{library} error during {during}: {status}")]
    Library {
        /// The library.
        library: &'static str,
        /// What the op was doing.
        during: &'static str,
        /// The library's status code, by name.
        status: String,
    },

    /// NVRTC is missing or a kernel failed to compile.
    #[error("kernel compilation of {kernel} failed: {message}")]
    Compile {
        /// The kernel source name (e.g. `convert.cu`).
        kernel: String,
        /// Compiler log or reason.
        message: String,
    },

    /// A kernel launch was refused: an operand or the parameters do not fit the op's signature
    /// or shape check. Nothing was enqueued.
    #[error("launch of {kernel}: {reason}")]
    Launch {
        /// The op's name.
        kernel: &'static str,
        /// What does not fit.
        reason: String,
    },

    /// A kernel failed while running (on the simulated device: its CPU twin returned an error).
    /// Sticky: every later synchronisation with the stream, or with work ordered after the
    /// failure, reports it again, and the stream runs no further work.
    #[error("kernel {kernel} failed on the device: {message}")]
    KernelFailed {
        /// The op's name.
        kernel: String,
        /// What went wrong.
        message: String,
    },

    /// The simulated device's copy engine failed or shut down.
    #[error("simulated device: {0}")]
    Sim(String),

    /// A training event that the tensor state machine does not allow from the tensor's state.
    #[error("illegal transition of tensor '{tensor}' ({list}): {event} from state {state}")]
    IllegalTransition {
        /// Name of the tensor.
        tensor: String,
        /// Which chunk list (e.g. `param`, `master`).
        list: &'static str,
        /// Its state when the event arrived.
        state: crate::tensor::TensorState,
        /// The event that was refused.
        event: crate::tensor::TrainEvent,
    },

    /// The chunks needed at a moment cannot fit in the device budget, whatever is evicted.
    ///
    /// The budget is what the scheduler plans with: `overall_fraction × capacity` less the
    /// non-model bytes the moment needs, and during the warm-up iteration (no trace yet, the
    /// non-model peak unknown) `warmup_chunk_fraction × overall_fraction × capacity`
    /// ([`SchedulerConfig`](crate::tide::SchedulerConfig), 0.5 × 0.9 by default; a
    /// [`Sizing`](crate::tide::Sizing)'s `config_for` gives a device its measured numbers).
    #[error(
        "chunk budget exceeded at moment {moment}: {requested} bytes of chunks needed, budget {budget} \
         bytes (device {capacity} bytes, non-model peak {non_model_peak} bytes); {unevictable} bytes are \
         held by chunks in use{}",
        fetch_of(tensors, chunks)
    )]
    BudgetExceeded {
        /// Moment of the iteration.
        moment: usize,
        /// Bytes of chunks that must be on the device at once.
        requested: u64,
        /// Device bytes available for chunks at that moment.
        budget: u64,
        /// Device capacity assumed by the scheduler.
        capacity: u64,
        /// Peak non-model bytes the budget reserves room for.
        non_model_peak: u64,
        /// Bytes on the device that cannot be evicted (chunks in COMPUTE or pinned).
        unevictable: u64,
        /// The chunks the refused moment needs on the device.
        chunks: Vec<u32>,
        /// The tensors the refused fetch named (empty for an optimizer visit or a replay).
        tensors: Vec<String>,
    },

    /// Ranks of a communicator issued different collectives at the same point of their sequence
    /// (or a send and a receive that do not match). The communicator refuses every later call.
    #[error("collective mismatch at call #{seq}: {detail}")]
    CommMismatch {
        /// Sequence number of the collective on the communicator.
        seq: u64,
        /// What each side asked for.
        detail: String,
    },

    /// A collective or receive waited longer than the communicator's timeout for other ranks.
    #[error("{what} timed out after {waited_ms} ms{}", waiting_for(.missing))]
    CommTimeout {
        /// The call that waited (kind and sequence number).
        what: String,
        /// How long it waited.
        waited_ms: u64,
        /// Ranks that had not arrived (empty where the backend cannot tell, as with NCCL).
        missing: Vec<usize>,
    },

    /// An NCCL communicator was aborted after a timeout or an asynchronous error (a peer's
    /// failure); it refuses every later call.
    #[error("the communicator was aborted: {reason}")]
    CommAborted {
        /// The error that aborted it.
        reason: String,
    },

    /// An error reported by NCCL.
    #[error("NCCL error during {during}: {code_name} ({code}): {message}")]
    Nccl {
        /// What the communicator was doing.
        during: &'static str,
        /// NCCL's result code.
        code: i32,
        /// The code's name (`ncclUnhandledCudaError`, ...).
        code_name: String,
        /// NCCL's description (its last error message when it has one).
        message: String,
    },

    /// A batch uses more distinct embedding rows than the cache has slots.
    #[error(
        "a batch uses {unique} distinct rows but the embedding cache holds {capacity}: use a \
         larger cache or a smaller batch"
    )]
    CacheTooSmall {
        /// Distinct rows of the batch.
        unique: usize,
        /// Slots of the cache.
        capacity: usize,
    },

    /// Ranks could not meet: a bad launcher environment or an unreachable rank 0.
    #[error("rendezvous failed: {0}")]
    Rendezvous(String),

    /// An invalid argument that has no more specific variant.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A size that does not fit, refused before anything is allocated: its bytes overflow, or
    /// exceed what the machine holds ([`crate::limits::host_limit`]) or a documented cap (such
    /// as [`crate::comm::MAX_LOCAL_RANKS`]).
    #[error("{what}: {} requested, more than the limit of {limit}", amount(.requested))]
    TooLarge {
        /// What was asked for, with its unit and the inputs it came from (`bytes of a batch of
        /// 4 × 1024 tokens`, `in-process ranks`).
        what: String,
        /// How much was asked for (`u128::MAX` when even that overflows).
        requested: u128,
        /// The most that is allowed, in the same unit.
        limit: u64,
    },

    /// A size that must be a multiple of another is not (a hidden size and its attention
    /// heads, ...).
    #[error("{what} {value} is not a multiple of {of} {divisor}")]
    NotMultiple {
        /// What the value is.
        what: &'static str,
        /// The value.
        value: usize,
        /// What the divisor is.
        of: &'static str,
        /// The divisor.
        divisor: usize,
    },

    /// A layer's dimension does not split over the ranks (or the blocks) a layout cuts it into:
    /// the heads over a tensor-parallel group, the channels over `q²`, a tile's sequences.
    #[error("{layer}: {what} = {value} does not split into {parts} ({by}) equal parts")]
    NotSplit {
        /// The layer (or what holds the dimension).
        layer: String,
        /// The dimension.
        what: &'static str,
        /// Its size.
        value: usize,
        /// Into how many parts it must split.
        parts: usize,
        /// What the parts are (`q`, `q²`, `tensor-parallel ranks`, `heads`).
        by: &'static str,
    },

    /// A number outside the values a setting takes (a loss scale, a LayerNorm's ε).
    #[error("{what} = {value}: it must be {want}")]
    BadValue {
        /// The setting, and whose.
        what: String,
        /// Its value.
        value: f64,
        /// What it must be.
        want: &'static str,
    },

    /// An embedding id past its table's rows.
    #[error("{}id {id} at position {position} is out of range for a table of {rows} rows", table.map_or(String::new(), |t| format!("table {t}: ")))]
    IdOutOfRange {
        /// The table, in a collection of several.
        table: Option<usize>,
        /// The id.
        id: u64,
        /// Its position in the batch's indices.
        position: usize,
        /// The table's rows.
        rows: usize,
    },

    /// An op's operands that do not fit it or each other (a view too small for its shape,
    /// views that overlap where they must not), found before anything ran.
    #[error("{op}: {reason}")]
    Operands {
        /// The op (its kernel's name).
        op: &'static str,
        /// What does not fit.
        reason: String,
    },

    /// A token id (or a target) outside its vocabulary.
    #[error("token {token} at position {position} is outside 0..{vocab}")]
    TokenOutOfRange {
        /// The token.
        token: i64,
        /// Its position in the batch, row-major.
        position: usize,
        /// The vocabulary's size.
        vocab: usize,
    },

    /// A call made before the one it follows (a backward before its forward, a step before its
    /// backward).
    #[error("{call} needs {needs} first")]
    OutOfOrder {
        /// The call.
        call: &'static str,
        /// What must come before it.
        needs: &'static str,
    },

    /// A parameter tensor is not of the shape or type the layer it was handed to expects.
    #[error(
        "parameter #{tensor} is {shape:?} {dtype}; the layer expects {expected:?} {expected_dtype}"
    )]
    ParamShape {
        /// The tensor's id.
        tensor: u32,
        /// Its shape.
        shape: Vec<usize>,
        /// Its element type.
        dtype: DType,
        /// The shape the layer expects.
        expected: Vec<usize>,
        /// The element type it expects.
        expected_dtype: DType,
    },

    /// A batch whose rows are not `batch × seq`, or whose tokens and targets differ in number.
    #[error("a batch of {batch} × {seq} with {tokens} tokens and {targets} targets")]
    BatchShape {
        /// Sequences.
        batch: usize,
        /// Tokens a sequence.
        seq: usize,
        /// Tokens given.
        tokens: usize,
        /// Targets given.
        targets: usize,
    },

    /// Sequences longer than the model's positions.
    #[error("sequences of {seq} tokens; the model has {max} positions")]
    SeqTooLong {
        /// The sequences' length.
        seq: usize,
        /// The model's positions.
        max: usize,
    },

    /// A step given another number of micro-batches than its optimizer accumulates.
    #[error("{got} micro-batches for an optimizer that accumulates {accumulates}")]
    MicroBatches {
        /// Micro-batches given.
        got: usize,
        /// Micro-batches the optimizer accumulates.
        accumulates: usize,
    },

    /// A gradient of an optimizer step is infinite or NaN and nothing may skip the step (no
    /// loss scaler): the run stops. Restore from the last checkpoint (it is intact) and
    /// change what diverged (a lower learning rate, a clip, loss scaling).
    #[error(
        "a gradient of optimizer step {step} is infinite or NaN, and without a loss scaler \
         the step is not skipped: {}",
        if *in_place {
            "host groups had stepped in place during backward, so the optimizer state holds \
             the bad step; restore from the last checkpoint"
        } else {
            "the optimizer state is as before the step; restore from the last checkpoint"
        }
    )]
    NonFiniteGradients {
        /// The optimizer step (1 for the first).
        step: u64,
        /// Whether host groups had already stepped in place (the state holds the bad step).
        in_place: bool,
    },

    /// An activation is not of the shape or type a layer takes.
    #[error(
        "`{what}` is [{rows}, {cols}] {dtype}; expected [{}, {expected_cols}] {expected_dtype}",
        expected_rows.map_or("N".to_string(), |r| r.to_string())
    )]
    ActivationShape {
        /// Which input (or gradient) of the layer.
        what: String,
        /// Its rows.
        rows: usize,
        /// Its columns.
        cols: usize,
        /// Its element type.
        dtype: DType,
        /// The rows expected, when the layer fixes them.
        expected_rows: Option<usize>,
        /// The columns expected.
        expected_cols: usize,
        /// The element type expected.
        expected_dtype: DType,
    },

    /// A layer or model registered for one place on the process grid (a rank of a tensor
    /// group, a pipeline stage, a layout) is run at another, or without the groups it needs.
    #[error("{what} registered {registered} run {run}")]
    WrongPlace {
        /// What was registered.
        what: &'static str,
        /// Where it was registered.
        registered: String,
        /// Where it is run.
        run: String,
    },

    /// A count or length that does not match the one it goes with (weights for indices,
    /// gradients for rows, bytes for a shape).
    #[error("{what}: {got} given, {expected} expected")]
    Length {
        /// What was counted, and what it goes with (`per-sample weights for 12 indices`).
        what: String,
        /// The count given.
        got: usize,
        /// The count expected.
        expected: usize,
    },

    /// An index past the end of what it indexes (a rank of a world, a chunk of a trace, a
    /// stage of a pipeline, a micro-batch of a step).
    #[error("{what} {index} is out of range: there are {len}")]
    IndexOutOfRange {
        /// What the index names (`rank`, `chunk`, `stage`).
        what: String,
        /// The index.
        index: usize,
        /// How many there are.
        len: usize,
    },

    /// Fewer of something than a setting needs (at least one rank, a micro-batch a stage).
    #[error("{what}: {got}, at least {need} needed")]
    TooFew {
        /// What was counted.
        what: String,
        /// How many were given.
        got: usize,
        /// The fewest that work.
        need: usize,
    },

    /// Nothing where at least one is needed (a batch of no samples, a model of no tensor).
    #[error("{what} is empty")]
    Empty {
        /// What is empty.
        what: String,
    },

    /// A size computed from the inputs overflows its integer type.
    #[error("{what} overflows")]
    Overflow {
        /// The size, and the inputs it comes from.
        what: String,
    },

    /// A tensor or value of an element type the operation does not take.
    #[error("{what} is {dtype}; it must be {expected}")]
    WrongDType {
        /// What has the type.
        what: String,
        /// Its type.
        dtype: DType,
        /// The types allowed.
        expected: &'static str,
    },

    /// Text that does not read as the setting it names (a policy, a tensor mode, a byte size).
    #[error("{what} {input:?}: expected {expected}")]
    Parse {
        /// The setting.
        what: &'static str,
        /// The text given.
        input: String,
        /// What it may be.
        expected: String,
    },

    /// Two settings or inputs that cannot be used together.
    #[error("{what} cannot be used with {with}")]
    Conflict {
        /// The first.
        what: String,
        /// The one it conflicts with, and why where it helps.
        with: String,
    },

    /// The saved state handed to a layer's backward is not the one its forward returned (from
    /// another layer, layout or core).
    #[error("{layer}: the saved state handed to backward is not from this layer's forward")]
    SavedMismatch {
        /// The layer.
        layer: String,
    },

    /// Bag offsets that do not run up from 0 to the number of indices.
    #[error(
        "{}offsets: {why} (entry {at})",
        table.map_or(String::new(), |t| format!("table {t}: "))
    )]
    BadOffsets {
        /// The table, in a collection of several.
        table: Option<usize>,
        /// The first entry that is wrong.
        at: usize,
        /// What is wrong with it.
        why: &'static str,
    },

    /// A pipeline op list that is not a schedule of its micro-batches (a missing, repeated or
    /// out-of-range op).
    #[error("the op list of stage {stage} is not a schedule: {reason}")]
    BadSchedule {
        /// The stage.
        stage: usize,
        /// What is wrong.
        reason: String,
    },

    /// Pipeline op lists that cannot all run: each stuck stage's next op waits for an op that
    /// waits, directly or not, for it.
    #[error("the schedule deadlocks after {done} of {total} ops; stuck: {stuck:?}")]
    Deadlock {
        /// Ops that ran.
        done: usize,
        /// Ops in all.
        total: usize,
        /// `(stage, its next op)` of every unfinished stage, the op as `F3` or `B3`.
        stuck: Vec<(usize, String)>,
    },

    /// A thread the crate ran a caller's work on panicked (an in-process rank's closure, a host
    /// optimizer thread); the panic was caught and the other threads were stopped.
    #[error("{what} panicked{}", if message.is_empty() { String::new() } else { format!(": {message}") })]
    Panicked {
        /// The thread.
        what: String,
        /// The panic's message, when it was a string.
        message: String,
    },

    /// A broken invariant inside the crate: a bug in `tidemem`, not in the call.
    #[error("internal error (a bug in tidemem): {what}")]
    Internal {
        /// What was found broken.
        what: String,
    },

    /// The file tier cannot reserve the disk space of a buffer: its directory's filesystem is
    /// full (or the quota is spent, or the filesystem caps the size of one file). Nothing was
    /// mapped; the space is reserved before a byte is touched, so a full disk is this error,
    /// never a signal on first touch.
    #[error(
        "the file tier cannot reserve {requested} bytes in {}{}: {source}",
        dir.display(),
        free_of(.available)
    )]
    FileTierFull {
        /// Bytes asked for.
        requested: usize,
        /// The file tier's directory.
        dir: std::path::PathBuf,
        /// Bytes free for this process on the directory's filesystem when the request was
        /// refused (`None` where the filesystem does not say).
        available: Option<u64>,
        /// What the OS said (`ENOSPC` when the space was seen missing before asking).
        #[source]
        source: std::io::Error,
    },

    /// A thread could not be started (the process or the system is out of threads or memory
    /// for their stacks). Whatever had started was stopped before this error was returned.
    #[error("cannot start {what}: {source}")]
    ThreadSpawn {
        /// The thread (`the thread of in-process rank 7 of 100`).
        what: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },

    /// An I/O error from the file-backed tier.
    #[error("I/O error in {during}: {source}")]
    Io {
        /// What the host tier was doing.
        during: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    // --- states a trainer matches on (parameter stores and their passes) ---
    /// A call that the stage of the iteration in progress does not allow (a backward fetch
    /// before the forward pass ended, an optimizer pass during backward, ...). The iteration
    /// runs forward, `end_forward`, backward, `end_backward`, the optimizer step.
    #[error("{call} is not allowed during the {stage} stage")]
    WrongStage {
        /// What was called.
        call: String,
        /// The stage in progress: `forward`, `backward`, `optimizer`, or `idle` between
        /// iterations.
        stage: &'static str,
    },

    /// A store refuses every call after a failure left its bookkeeping and its memory apart
    /// (a chunk move the scheduler ordered failed, a checkpoint load stopped midway). Restore
    /// from a checkpoint into a new store.
    #[error("the {what} is unusable: {reason}")]
    Poisoned {
        /// Which store.
        what: &'static str,
        /// The failure that left it unusable.
        reason: String,
    },

    /// Memory that must move or be freed is still referenced by a view handed out earlier.
    #[error("a view of {what} is still alive at {during}; drop views first")]
    ViewAlive {
        /// What the view points into (a chunk, a gather buffer).
        what: String,
        /// What needed the memory free (a release, an eviction).
        during: &'static str,
    },

    /// A tensor id the store never registered.
    #[error("unknown tensor #{id}")]
    UnknownTensor {
        /// The id's index.
        id: u32,
    },

    // --- files: checkpoints read and written ---
    /// A checkpoint (or an imported model file) that cannot be read as one, or that does not
    /// fit what it is loaded into: what is wrong, and with which file.
    #[error("checkpoint {}: {what}", path.display())]
    Checkpoint {
        /// The file, as the caller named it.
        path: PathBuf,
        /// What is wrong with it.
        what: String,
    },

    /// An I/O error on a named file.
    #[error("I/O error {during} {}: {source}", path.display())]
    FileIo {
        /// What was being done (`writing`, `opening`, ...).
        during: &'static str,
        /// The file, as the caller named it.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A path that must be a regular file (a checkpoint to read, or one to replace) is
    /// something else; nothing was read or replaced.
    #[error("{} is a {kind}, not a regular file{}", path.display(), not_a_file_hint(kind))]
    NotAFile {
        /// The path, as the caller named it.
        path: PathBuf,
        /// What it is: `directory`, `character device`, `block device`, `fifo`, `socket`.
        kind: &'static str,
    },

    /// A tensor's data in a checkpoint does not match the checksum written with it: the file
    /// was damaged after it was written. Nothing was loaded.
    #[error(
        "checkpoint {}: the data of tensor '{tensor}' does not match its checksum (the file \
         was damaged since it was written); nothing was loaded",
        path.display()
    )]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor whose data is damaged.
        tensor: String,
    },

    /// A checkpoint's header (its tensors' names, dtypes, shapes and offsets, and its
    /// metadata: step counts, loss scale, ranks) does not match the checksum written with it:
    /// the file was edited or damaged since. Nothing was loaded.
    #[error(
        "checkpoint {}: its header (tensor names, dtypes, shapes, metadata) does not match its \
         checksum (the file was edited or damaged since it was written); nothing was loaded",
        path.display()
    )]
    HeaderChecksumMismatch {
        /// The file.
        path: PathBuf,
    },

    /// A checkpoint of this crate without checksums (written before they were added, or with
    /// them removed): nothing in it can be verified, so it is refused unless the environment
    /// variable `TIDEMEM_LEGACY_LOAD=1` asks for an unverified load.
    #[error(
        "checkpoint {}: it has {what}, so it cannot be verified (written by an older version, \
         or edited); set TIDEMEM_LEGACY_LOAD=1 to load it unverified",
        path.display()
    )]
    Unverified {
        /// The file.
        path: PathBuf,
        /// What it lacks: `no header checksum`, `no tensor checksums`.
        what: &'static str,
    },

    /// NaN or infinity in a tensor read from a model file, or about to be written to a
    /// checkpoint (then nothing was written, and an earlier file at the path stays).
    #[error(
        "{}: tensor '{tensor}' has a non-finite value (NaN or infinity) at element {index}{}",
        path.display(),
        if *.saving { "; nothing was saved, an earlier file stays as it was" } else { "" }
    )]
    NonFinite {
        /// The file read, or the one that was to be written.
        path: PathBuf,
        /// The tensor, as the file names it.
        tensor: String,
        /// The first non-finite element, as a row-major index into the tensor as stored.
        index: u64,
        /// Whether the tensor was being saved (otherwise read).
        saving: bool,
    },

    /// The files of a checkpoint of several ranks are not all from one save: no save is held
    /// by every rank, and this rank's files (its current and previous generation) lack the one
    /// the others' files point to.
    #[error(
        "checkpoint {} of rank {rank} holds save {found:?}, not save {wanted} that the other \
         ranks' files share: the files come from different saves or runs; no rank loads",
        path.display()
    )]
    SaveMismatch {
        /// This rank's file.
        path: PathBuf,
        /// This rank.
        rank: usize,
        /// The save other ranks hold (the oldest of the ranks' newest saves).
        wanted: i64,
        /// The saves this rank's files hold.
        found: Vec<i64>,
    },

    /// Another rank failed in a step the ranks take together (see
    /// [`Communicator::agree`](crate::comm::Communicator::agree)); that rank reports its own
    /// error.
    #[error("another rank failed (rank {rank}, which reports why); every rank stops")]
    RankFailed {
        /// The lowest rank that failed.
        rank: usize,
    },
}

impl Error {
    pub(crate) fn cuda(during: &'static str, e: impl std::fmt::Display) -> Self {
        Error::Cuda {
            during,
            message: e.to_string(),
        }
    }
}

/// The amount of a [`Error::TooLarge`] message (`u128::MAX` stands for an overflow).
fn amount(requested: &u128) -> String {
    match *requested {
        u128::MAX => "more than 2^128 (an overflow)".into(),
        r => r.to_string(),
    }
}

/// The end of a [`Error::BudgetExceeded`] message: the fetch that was refused.
fn fetch_of(tensors: &[String], chunks: &[u32]) -> String {
    match (tensors.is_empty(), chunks.is_empty()) {
        (true, true) => String::new(),
        (true, false) => format!("; the moment needs chunks {chunks:?}"),
        (false, _) => format!("; the fetch of {tensors:?} needs chunks {chunks:?}"),
    }
}

/// The free bytes of a [`Error::FileTierFull`] message, when known.
fn free_of(available: &Option<u64>) -> String {
    match available {
        Some(b) => format!(" ({b} bytes free)"),
        None => String::new(),
    }
}

/// The end of a [`Error::CommTimeout`] message: the ranks that did not come, when known.
fn waiting_for(missing: &[usize]) -> String {
    if missing.is_empty() {
        String::new()
    } else {
        format!(" waiting for ranks {missing:?}")
    }
}

/// The end of a [`Error::NotAFile`] message: what a directory given as a checkpoint may be.
fn not_a_file_hint(kind: &str) -> &'static str {
    if kind == "directory" {
        " (a checkpoint of several ranks is a directory of one file per rank: load or save it \
         with as many ranks, each naming its own file)"
    } else {
        ""
    }
}
