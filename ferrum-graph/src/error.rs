//! Typed errors of ferrum-graph.

/// The error type a capture closure may return (anything convertible: `ferrum_cuda::Error`,
/// cudarc's `DriverError`, `anyhow::Error`, `String`, ...).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result of ferrum-graph's fallible calls.
pub type Result<T, E = GraphError> = std::result::Result<T, E>;

/// Everything that can go wrong capturing or replaying a graph. After any of these the stream
/// is out of capture mode and usable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GraphError {
    /// No CUDA backend: built without the `cuda` feature, or the driver library is missing.
    #[error("CUDA graphs are unavailable: {0}")]
    Unavailable(String),
    /// A CUDA driver call failed; `msg` is the driver's own text.
    #[error("CUDA driver error during {op}: {msg}")]
    Driver {
        /// The driver call.
        op: &'static str,
        /// The driver's error text.
        msg: String,
    },
    /// The legacy default stream (null `CUstream`) cannot be captured.
    #[error("the legacy default stream cannot be captured: capture on a stream made with `CudaContext::new_stream`")]
    LegacyStream,
    /// The stream's context has cudarc's multi-stream event tracking on: cudarc would record and
    /// wait on events inside the capture (events recorded outside a capture cannot be waited on
    /// inside it).
    #[error(
        "the stream's context tracks buffer events across streams (cudarc's default with several \
         streams): call `unsafe {{ ctx.disable_event_tracking() }}` before allocating the buffers \
         that captured work uses, and order streams yourself"
    )]
    EventTracking,
    /// The stream is already capturing (nested capture on one stream is not allowed).
    #[error("the stream is already capturing a graph")]
    AlreadyCapturing,
    /// A call made inside the capture closure is not allowed while capturing, and CUDA
    /// invalidated the capture: a synchronous copy (`cuMemcpyHtoD`, `clone_dtoh`...), a stream,
    /// event or context synchronisation, a stream query, a call on the legacy stream...
    #[error(
        "the CUDA graph capture was invalidated by an operation that is not allowed while \
         capturing (host<->device copy, synchronisation, legacy-stream work): {cause}"
    )]
    CaptureInvalidated {
        /// The failing call's error, or what CUDA reported when the capture ended.
        cause: String,
    },
    /// The capture succeeded but recorded work that a replayable decode graph must not contain.
    #[error("the captured graph contains forbidden work: {what}")]
    Forbidden {
        /// The offending nodes and why.
        what: String,
    },
    /// The capture closure returned an error (the capture was still valid; it was discarded).
    #[error("the capture closure failed: {0}")]
    Closure(#[source] BoxError),
    /// A graph replayed (or uploaded) on a stream of another context/device.
    #[error("graph captured on device {graph_device} used with a stream of device {stream_device}")]
    WrongContext {
        /// The graph's device ordinal.
        graph_device: usize,
        /// The stream's device ordinal.
        stream_device: usize,
    },
    /// Step parameters written with a host copy while their stream is capturing (the copy would
    /// be baked into the graph with a host address).
    #[error("step parameters must be written outside capture (the stream is capturing)")]
    WriteDuringCapture,
}
