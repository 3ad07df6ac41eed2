//! # ferrum-graph
//!
//! CUDA graph capture and replay for batch-1 decoding, usable on its own (it depends only on
//! cudarc, not on the rest of ferrum):
//!
//! - [`CapturedGraph::capture`] runs a closure that enqueues work on a stream while the stream
//!   captures, checks the result, and instantiates it; [`CapturedGraph::upload`] and
//!   [`CapturedGraph::replay`] then run it (replay only enqueues: no allocation, no
//!   synchronisation);
//! - [`StepParams`]: the token id, position and KV length of a step in a 16-byte device buffer
//!   that captured kernels read, so one graph serves every position; they are written by an
//!   asynchronous host-to-device copy *outside* capture (or by a kernel);
//! - [`GraphCache`]: graphs keyed by what they reference (e.g. the sequence's cache-buffer
//!   pointers and dtype), so a new capture happens only when those buffers change.
//!
//! ## What capture enforces
//!
//! A graph replays exactly what was recorded, with the addresses seen at capture; a host copy
//! inside it would read the same host bytes forever, and a synchronisation cannot be recorded.
//! So [`CapturedGraph::capture`]:
//! 1. refuses the legacy default stream, a stream already capturing, and contexts where cudarc
//!    tracks events across streams ([`GraphError::EventTracking`]: disable event tracking);
//! 2. captures in [`CaptureMode::ThreadLocal`] mode (or the mode you choose), in which CUDA itself
//!    fails synchronous copies, synchronisations and other "unsafe" calls made by the capturing
//!    thread with `CUDA_ERROR_STREAM_CAPTURE_*`, invalidating the capture → reported as
//!    [`GraphError::CaptureInvalidated`] whether or not the closure propagated the error
//!    (a synchronous `cuMemcpyHtoD` on the legacy stream is *not* refused: it does not order
//!    with non-blocking streams, so it runs eagerly and never enters the graph — seen on an
//!    H200 with driver 580);
//! 3. inspects every node of the finished graph and refuses copies with a host end (including
//!    asynchronous copies from pinned memory, which CUDA would accept), host callbacks, and
//!    stream-ordered allocations/frees ([`GraphError::Forbidden`]);
//! 4. always ends the capture on error paths (including a panicking closure), so the stream stays
//!    usable.
//!
//! The closure receives a [`CaptureScope`] (the capturing stream) rather than running free, and
//! returns `Result<(), E>` for any `E: Into<BoxError>`.
//!
//! ## Without the `cuda` feature
//!
//! The crate builds; [`StepValues`], [`GraphCache`] (generic over the stored graph) and the error
//! types exist, and no graph can be made.
//!
//! ## Example (with the `cuda` feature)
//!
//! ```no_run
//! # #[cfg(feature = "cuda")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use ferrum_graph::cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
//! use ferrum_graph::{CapturedGraph, StepParams, StepValues};
//!
//! let ctx = CudaContext::new(0)?;
//! // Captured buffers must not use cudarc's cross-stream event tracking.
//! unsafe { ctx.disable_event_tracking() };
//! let stream = ctx.new_stream()?;
//! # let module = ctx.load_module(ferrum_graph::cudarc::nvrtc::compile_ptx("extern \"C\" __global__ void step(const unsigned* p, float* y) { y[threadIdx.x] = p[1]; }")?)?;
//! let kernel = module.load_function("step")?;
//! let mut params = StepParams::new(&stream)?;
//! let mut y = stream.alloc_zeros::<f32>(32)?;
//! let graph = CapturedGraph::capture(&stream, |scope| {
//!     let mut b = scope.stream().launch_builder(&kernel);
//!     b.arg(params.buffer()).arg(&mut y);
//!     // SAFETY: the kernel reads 4 u32 and writes 32 f32, both allocated above.
//!     unsafe { b.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 }) }?;
//!     Ok::<_, ferrum_graph::cudarc::driver::DriverError>(())
//! })?;
//! graph.upload(&stream)?;
//! for pos in 0..100 {
//!     params.write(&stream, StepValues::decode(42, pos))?; // outside capture
//!     graph.replay(&stream)?;
//! }
//! stream.synchronize()?;
//! # Ok(()) }
//! # #[cfg(not(feature = "cuda"))]
//! # fn main() {}
//! ```

mod cache;
mod error;
mod step;

pub use cache::{CacheStats, GraphCache};
pub use error::{BoxError, GraphError, Result};
pub use step::StepValues;

#[cfg(feature = "cuda")]
mod graph;
/// cudarc, re-exported so that callers use the same version as ferrum-graph.
#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "cuda")]
pub use graph::{CaptureMode, CaptureScope, CapturedGraph};
#[cfg(feature = "cuda")]
pub use step::StepParams;

/// A cache of captured decode graphs keyed by `K`.
#[cfg(feature = "cuda")]
pub type DecodeGraphCache<K> = GraphCache<K, CapturedGraph>;

#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub use stub::{unavailable, CaptureMode, CapturedGraph};

/// True when this build has the CUDA backend.
pub const fn cuda_built() -> bool {
    cfg!(feature = "cuda")
}
