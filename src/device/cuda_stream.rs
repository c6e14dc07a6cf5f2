//! The CUDA backend's stream: a cudarc stream and the state libraries keep on it.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::library::LibraryState;

/// What the CUDA backend's [`RawStream`](super::RawStream) holds (see
/// [`Stream::raw`](super::Stream::raw)): the cudarc stream, and the per-stream state of the
/// libraries ops call (see [`LibraryCall::with_state`](super::LibraryCall::with_state)).
///
/// Dropping it first waits for the stream's pending work (only when a library made state on
/// it), then drops that state with the stream's context current, then the stream.
pub struct CudaRawStream {
    stream: Arc<CudaStream>,
    pub(super) libraries: LibraryState,
}

impl CudaRawStream {
    pub(super) fn new(stream: Arc<CudaStream>) -> Self {
        CudaRawStream {
            stream,
            libraries: LibraryState::default(),
        }
    }

    /// The cudarc stream.
    pub(crate) fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl std::fmt::Debug for CudaRawStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRawStream")
            .field("stream", &self.stream.cu_stream())
            .finish()
    }
}

impl Drop for CudaRawStream {
    fn drop(&mut self) {
        if self.libraries.is_empty() {
            return;
        }
        // cudarc's stream drop destroys the stream without waiting for its work, and a library
        // handle must not be destroyed while work of it is pending, nor without its context
        // current (this may be any thread). An error here (a context already failed) cannot
        // be reported from a drop; the states are dropped all the same.
        let _ = self.stream.context().bind_to_thread();
        let _ = self.stream.synchronize();
        drop(self.libraries.take());
        // `stream` drops after this, so the context outlived the states.
    }
}
