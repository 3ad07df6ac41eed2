//! Capture, check, instantiate, upload and replay (real backend, `cuda` feature).
//!
//! Layering follows cudarc's: raw `cudarc::driver::sys` calls stay in this module behind safe
//! functions. The graph and its executable are owned here (destroyed in `Drop`, errors logged,
//! never a panic).

use crate::cache::GraphCache;
use crate::error::{BoxError, GraphError, Result};
use cudarc::driver::sys as cu;
use cudarc::driver::{CudaContext, CudaStream, DriverError};
use std::any::Any;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

pub(crate) fn driver_err(op: &'static str) -> impl FnOnce(DriverError) -> GraphError {
    move |e| GraphError::Driver { op, msg: e.to_string() }
}

fn check(op: &'static str, code: cu::CUresult) -> Result<()> {
    code.result().map_err(driver_err(op))
}

/// cudarc loads libcuda lazily and panics when it is missing; check first.
fn ensure_driver() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries `dlopen` on the driver's usual names; no preconditions.
    if *PRESENT.get_or_init(|| unsafe { cu::is_culib_present() }) {
        Ok(())
    } else {
        Err(GraphError::Unavailable("the CUDA driver library (libcuda.so.1) could not be loaded".into()))
    }
}

/// Makes `ctx` current on this thread (no allocation, no synchronisation).
pub(crate) fn make_current(ctx: &CudaContext) -> Result<()> {
    let current = cudarc::driver::result::ctx::get_current().map_err(driver_err("cuCtxGetCurrent"))?;
    if current != Some(ctx.cu_ctx()) {
        // SAFETY: `ctx` keeps its context retained for the duration of the call.
        unsafe { cudarc::driver::result::ctx::set_current(ctx.cu_ctx()) }.map_err(driver_err("cuCtxSetCurrent"))?;
    }
    Ok(())
}

fn capture_status(stream: &CudaStream) -> Result<cu::CUstreamCaptureStatus> {
    // SAFETY: the stream is alive (borrowed) and belongs to a live context.
    unsafe { cudarc::driver::result::stream::is_capturing(stream.cu_stream()) }
        .map_err(driver_err("cuStreamIsCapturing"))
}

/// True while `stream` is capturing (actively or invalidated).
pub(crate) fn is_capturing(stream: &CudaStream) -> Result<bool> {
    ensure_driver()?;
    make_current(stream.context())?;
    Ok(capture_status(stream)? != cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// How strictly CUDA refuses "potentially unsafe" calls (synchronous copies, allocations,
/// synchronisations) while capturing. Whatever the mode, operations on the capturing stream
/// itself that cannot be captured (a stream synchronisation, a synchronous copy ordered with it)
/// fail and invalidate the capture.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// Unsafe calls are refused on the capturing thread only (the default: other threads, e.g.
    /// other GPUs' runners capturing at the same time, are unaffected).
    #[default]
    ThreadLocal,
    /// Unsafe calls are refused on every thread of the process while the capture lasts.
    Global,
    /// Nothing is refused beyond what cannot be captured at all (not recommended).
    Relaxed,
}

impl CaptureMode {
    fn to_sys(self) -> cu::CUstreamCaptureMode {
        match self {
            CaptureMode::ThreadLocal => cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Global => cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::Relaxed => cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }
}

/// What the capture closure receives: the capturing stream. Enqueue kernels (and NCCL
/// collectives, device-to-device copies, memsets) on it; do not synchronise it or copy between
/// host and device (see [`CapturedGraph::capture`]). Not `Send`: it cannot leave the capturing
/// thread.
pub struct CaptureScope<'a> {
    stream: &'a Arc<CudaStream>,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for CaptureScope<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureScope").field("device", &self.stream.context().ordinal()).finish()
    }
}

impl CaptureScope<'_> {
    /// The capturing stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

/// Ends the capture on drop unless disarmed (a panicking closure leaves the stream usable).
struct ActiveCapture<'a> {
    stream: &'a CudaStream,
    armed: bool,
}

impl ActiveCapture<'_> {
    fn end_raw(stream: &CudaStream) -> (cu::CUresult, cu::CUgraph) {
        let mut graph: cu::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is alive (borrowed) and `graph` is a valid out-pointer.
        let code = unsafe { cu::cuStreamEndCapture(stream.cu_stream(), &mut graph) };
        (code, graph)
    }

    fn end(mut self) -> (cu::CUresult, Option<OwnedGraph>) {
        self.armed = false;
        let (code, graph) = Self::end_raw(self.stream);
        (code, OwnedGraph::from_raw(graph))
    }
}

impl Drop for ActiveCapture<'_> {
    fn drop(&mut self) {
        if self.armed {
            let (code, graph) = Self::end_raw(self.stream);
            drop(OwnedGraph::from_raw(graph));
            if code != cu::CUresult::CUDA_SUCCESS {
                tracing::debug!(?code, "cuStreamEndCapture after a panicking capture closure");
            }
        }
    }
}

/// A `CUgraph` destroyed on drop.
struct OwnedGraph(cu::CUgraph);

impl OwnedGraph {
    fn from_raw(g: cu::CUgraph) -> Option<Self> {
        (!g.is_null()).then_some(OwnedGraph(g))
    }
}

impl Drop for OwnedGraph {
    fn drop(&mut self) {
        // SAFETY: `self.0` is a graph this wrapper owns (from cuStreamEndCapture) and destroys
        // once.
        if let Err(e) = unsafe { cudarc::driver::result::graph::destroy(self.0) } {
            tracing::warn!(error = %e, "cuGraphDestroy failed (ignored)");
        }
    }
}

fn is_capture_code(code: cu::CUresult) -> bool {
    use cu::CUresult::*;
    matches!(
        code,
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
            | CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
            | CUDA_ERROR_STREAM_CAPTURE_MERGE
            | CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
            | CUDA_ERROR_STREAM_CAPTURE_ISOLATION
            | CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
            | CUDA_ERROR_CAPTURED_EVENT
            | CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
    )
}

/// True when `e` (or a source) is a CUDA "not allowed while capturing" error. Errors that wrap
/// the driver's text in a string (as ferrum-cuda's do) are recognised by that text.
fn is_capture_error(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(d) = err.downcast_ref::<DriverError>() {
            if is_capture_code(d.0) {
                return true;
            }
        }
        let text = err.to_string();
        if text.contains("STREAM_CAPTURE") || text.contains("CAPTURED_EVENT") || text.contains("stream is capturing") {
            return true;
        }
        cur = err.source();
    }
    false
}

#[derive(Debug, Default)]
struct Summary {
    nodes: usize,
    kernels: usize,
    violations: Vec<String>,
}

/// The nodes of a live graph, in node order.
fn graph_nodes(graph: cu::CUgraph) -> Result<Vec<cu::CUgraphNode>> {
    let mut n: usize = 0;
    // SAFETY: `graph` is a live graph; a null node array asks for the count only.
    check("cuGraphGetNodes", unsafe { cu::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) })?;
    if n == 0 {
        // An empty graph (the driver rejects a second call with an empty array, so don't make one).
        return Ok(Vec::new());
    }
    let mut nodes: Vec<cu::CUgraphNode> = vec![std::ptr::null_mut(); n];
    let mut got = n;
    // SAFETY: `nodes` has room for `got` handles.
    check("cuGraphGetNodes", unsafe { cu::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut got) })?;
    nodes.truncate(got.min(n));
    Ok(nodes)
}

/// A node's type, as the `u32` of `CUgraphNodeType`.
fn node_type(node: cu::CUgraphNode) -> Result<u32> {
    let mut ty: u32 = u32::MAX;
    // SAFETY: `node` belongs to a live graph; `CUgraphNodeType` is `repr(u32)`, so a u32 slot has
    // its layout and reading it as u32 is defined whatever value the driver writes.
    check("cuGraphNodeGetType", unsafe { cu::cuGraphNodeGetType(node, (&mut ty as *mut u32).cast()) })?;
    Ok(ty)
}

/// The kernel nodes' function names of a live graph, in node order (empty when the driver
/// does not list the nodes).
fn graph_kernel_names(graph: cu::CUgraph) -> Vec<String> {
    const KERNEL: u32 = cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL as u32;
    graph_nodes(graph)
        .unwrap_or_default()
        .into_iter()
        .filter(|&node| node_type(node).is_ok_and(|t| t == KERNEL))
        .map(kernel_name)
        .collect()
}

/// The function name of a kernel node (`"?"` when the driver does not say, e.g. a node made from
/// a `CUkernel` without a function handle). Needs `cuFuncGetName` (CUDA 12.3 drivers and
/// later; ferrum's PTX needs a CUDA 13 driver anyway).
fn kernel_name(node: cu::CUgraphNode) -> String {
    let mut p = std::mem::MaybeUninit::<cu::CUDA_KERNEL_NODE_PARAMS>::zeroed();
    // SAFETY: `node` is a kernel node of a live graph; `p` is writable, zeroed storage of the
    // parameter struct, which the driver fills.
    if unsafe { cu::cuGraphKernelNodeGetParams_v2(node, p.as_mut_ptr()) } != cu::CUresult::CUDA_SUCCESS {
        return "?".into();
    }
    // SAFETY: the struct was zeroed and then written by the driver: every field is initialised
    // (the handles are plain pointers, null where unset).
    let func = unsafe { p.assume_init() }.func;
    if func.is_null() {
        return "?".into();
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `func` is the node's live function handle (its module outlives the graph's use);
    // `name` is writable storage for the returned pointer.
    if unsafe { cu::cuFuncGetName(&mut name, func) } != cu::CUresult::CUDA_SUCCESS || name.is_null() {
        return "?".into();
    }
    // SAFETY: the driver returned a NUL-terminated string it owns (valid while the module is
    // loaded); it is copied at once.
    unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned()
}

/// Whether a memcpy endpoint is host memory.
fn is_host(mem_type: u32, ptr: cu::CUdeviceptr) -> bool {
    const HOST: u32 = cu::CUmemorytype::CU_MEMORYTYPE_HOST as u32;
    const UNIFIED: u32 = cu::CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32;
    match mem_type {
        HOST => true,
        UNIFIED => {
            let mut t: u32 = 0;
            // SAFETY: `t` is a valid out-slot for CU_POINTER_ATTRIBUTE_MEMORY_TYPE (an unsigned
            // int); the driver only inspects the address.
            let code = unsafe {
                cu::cuPointerGetAttribute(
                    (&mut t as *mut u32).cast(),
                    cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    ptr,
                )
            };
            // An address CUDA does not know is pageable host memory.
            code != cu::CUresult::CUDA_SUCCESS || t == HOST
        }
        _ => false,
    }
}

/// Lists the graph's nodes and what a replayable decode graph must not contain.
fn inspect(graph: cu::CUgraph) -> Result<Summary> {
    let nodes = graph_nodes(graph)?;
    let mut s = Summary { nodes: nodes.len(), ..Default::default() };
    use cu::CUgraphNodeType::*;
    for (i, &node) in nodes.iter().enumerate() {
        let ty = node_type(node)?;
        if ty == CU_GRAPH_NODE_TYPE_KERNEL as u32 {
            s.kernels += 1;
        } else if ty == CU_GRAPH_NODE_TYPE_MEMCPY as u32 {
            let mut p = std::mem::MaybeUninit::<cu::CUDA_MEMCPY3D>::zeroed();
            // SAFETY: `node` is a memcpy node of the live graph; `p` is writable storage of the
            // parameter struct.
            check("cuGraphMemcpyNodeGetParams", unsafe { cu::cuGraphMemcpyNodeGetParams(node, p.as_mut_ptr()) })?;
            let p = p.as_ptr();
            // SAFETY: `p` points to the initialised (zeroed, then written by the driver) struct;
            // the memory types are `repr(u32)` enums read as u32, the rest are plain integers.
            let (src_t, dst_t, src, dst, bytes) = unsafe {
                (
                    std::ptr::addr_of!((*p).srcMemoryType).cast::<u32>().read(),
                    std::ptr::addr_of!((*p).dstMemoryType).cast::<u32>().read(),
                    std::ptr::addr_of!((*p).srcDevice).read(),
                    std::ptr::addr_of!((*p).dstDevice).read(),
                    std::ptr::addr_of!((*p).WidthInBytes).read(),
                )
            };
            let (sh, dh) = (is_host(src_t, src), is_host(dst_t, dst));
            if sh || dh {
                let dir = match (sh, dh) {
                    (true, true) => "host-to-host",
                    (true, false) => "host-to-device",
                    _ => "device-to-host",
                };
                s.violations.push(format!(
                    "node {i}: {dir} copy of {bytes} bytes (a graph copies from/to the host address seen at \
                     capture, every replay: write step values with StepParams::write outside capture, and \
                     read results after replay)"
                ));
            }
        } else if ty == CU_GRAPH_NODE_TYPE_HOST as u32 {
            s.violations.push(format!("node {i}: host callback (cuLaunchHostFunc) stalls the GPU on the host"));
        } else if ty == CU_GRAPH_NODE_TYPE_MEM_ALLOC as u32 || ty == CU_GRAPH_NODE_TYPE_MEM_FREE as u32 {
            s.violations.push(format!(
                "node {i}: stream-ordered allocation or free inside capture (allocate every buffer before capturing)"
            ));
        }
    }
    Ok(s)
}

/// An instantiated CUDA graph: captured once, replayed many times.
///
/// The graph holds raw device addresses: every buffer its kernels use must outlive it (keep them
/// alive with [`hold`](Self::hold), or key a [`GraphCache`] by them and evict before freeing).
/// Replay on any stream of the capturing device. `Send` (not `Sync`: CUDA requires calls on one
/// graph to be serialised, which `&mut`/single-owner use guarantees).
pub struct CapturedGraph {
    exec: cu::CUgraphExec,
    graph: Option<OwnedGraph>,
    ctx: Arc<CudaContext>,
    nodes: usize,
    kernels: usize,
    /// The kernel nodes' names, read on the first [`CapturedGraph::kernel_names`] call.
    kernel_names: std::cell::OnceCell<Vec<String>>,
    keep: Vec<Box<dyn Any + Send>>,
}

// SAFETY: CUgraph / CUgraphExec handles are not tied to a thread; CUDA only requires that calls
// on one graph are not concurrent. `CapturedGraph` is not `Sync`, so only its single owner (on one
// thread at a time) calls it; the held values are `Send`, and `CudaContext` is `Send + Sync`.
unsafe impl Send for CapturedGraph {}

impl std::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedGraph")
            .field("device", &self.ctx.ordinal())
            .field("nodes", &self.nodes)
            .field("kernels", &self.kernels)
            .field("held", &self.keep.len())
            .finish()
    }
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        // The held values may own buffers that an in-flight replay still uses, and replays run
        // on any stream: freeing them now (e.g. cudarc's `cuMemFreeAsync` on the buffer's own
        // stream, which is not ordered after a replay on another one) would let the replay touch
        // freed memory. So wait for the replays first. Synchronising the context costs nothing
        // on the hot path, unlike recording an event after every replay, and needs no stream
        // handle (`replay` borrows its stream, which may be gone by now); it also waits for
        // unrelated work, but only here, when a graph holding values is dropped (a cold path).
        // If it fails, leak the values: a leak is better than a use-after-free on the GPU.
        if !self.keep.is_empty() {
            if let Err(e) = self.ctx.synchronize() {
                tracing::warn!(
                    error = %e,
                    held = self.keep.len(),
                    "could not wait for the graph's replays before releasing its held values: leaking them"
                );
                std::mem::forget(std::mem::take(&mut self.keep));
            }
        }
        // In-flight replays complete: the driver frees an executing graph after it finishes.
        // SAFETY: `exec` was instantiated by `capture` and is destroyed exactly once, here.
        if let Err(e) = unsafe { cudarc::driver::result::graph::exec_destroy(self.exec) } {
            tracing::warn!(error = %e, "cuGraphExecDestroy failed (ignored)");
        }
        // Then the graph (OwnedGraph's Drop), then the held values and the context reference.
        self.graph.take();
    }
}

impl CapturedGraph {
    /// Captures what `f` enqueues on `stream` into a graph (thread-local capture mode, see
    /// [`CaptureMode`]), checks it, and instantiates it. Nothing runs on the GPU until
    /// [`replay`](Self::replay).
    ///
    /// Enforced:
    /// - before capture: `stream` is not the legacy default stream, not already capturing, and
    ///   its context does not track events across streams ([`GraphError::EventTracking`]);
    /// - during capture (by CUDA, thread-local mode): synchronous copies, stream / context /
    ///   event synchronisation and other calls that would wait for the GPU fail with
    ///   `CUDA_ERROR_STREAM_CAPTURE_*` and invalidate the capture; the closure should propagate
    ///   that error (`?`), which is reported as [`GraphError::CaptureInvalidated`] (so is an
    ///   invalidation the closure swallowed);
    /// - after capture, by inspecting every node: any copy with a host end (even an async copy
    ///   from pinned memory), host callbacks, and stream-ordered allocations/frees are refused
    ///   ([`GraphError::Forbidden`]).
    ///
    /// On every error path the capture is ended and the partial graph destroyed, so `stream` is
    /// usable again; a panicking closure also ends the capture (during unwinding).
    pub fn capture<F, E>(stream: &Arc<CudaStream>, f: F) -> Result<Self>
    where
        F: FnOnce(&CaptureScope<'_>) -> Result<(), E>,
        E: Into<BoxError>,
    {
        Self::capture_with(stream, CaptureMode::default(), f)
    }

    /// [`capture`](Self::capture) with an explicit [`CaptureMode`].
    pub fn capture_with<F, E>(stream: &Arc<CudaStream>, mode: CaptureMode, f: F) -> Result<Self>
    where
        F: FnOnce(&CaptureScope<'_>) -> Result<(), E>,
        E: Into<BoxError>,
    {
        ensure_driver()?;
        if stream.cu_stream().is_null() {
            return Err(GraphError::LegacyStream);
        }
        let ctx = stream.context();
        if ctx.is_managing_stream_synchronization() {
            return Err(GraphError::EventTracking);
        }
        make_current(ctx)?;
        if capture_status(stream)? != cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(GraphError::AlreadyCapturing);
        }
        // SAFETY: the stream is alive, not the legacy stream, and not capturing (checked above).
        check("cuStreamBeginCapture", unsafe { cu::cuStreamBeginCapture_v2(stream.cu_stream(), mode.to_sys()) })?;
        let active = ActiveCapture { stream, armed: true };

        let scope = CaptureScope { stream, _not_send: PhantomData };
        let result = f(&scope).map_err(Into::into);
        // The closure may have switched the current context; ending must happen in ours.
        let _ = make_current(ctx);
        let status = capture_status(stream);
        let (code, graph) = active.end();

        if let Err(e) = result {
            let invalidated = matches!(status, Ok(cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED))
                || is_capture_code(code)
                || is_capture_error(&*e);
            return Err(if invalidated {
                GraphError::CaptureInvalidated { cause: e.to_string() }
            } else {
                GraphError::Closure(e)
            });
        }
        if code != cu::CUresult::CUDA_SUCCESS {
            return Err(match code {
                cu::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => GraphError::CaptureInvalidated {
                    cause: "a call inside the closure failed because the stream was capturing, and the \
                            closure did not return that error"
                        .into(),
                },
                cu::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED => GraphError::Driver {
                    op: "cuStreamEndCapture",
                    msg: "work forked onto another stream during capture was not joined back (record an \
                          event on that stream and make the capturing stream wait on it)"
                        .into(),
                },
                cu::CUresult::CUDA_ERROR_ILLEGAL_STATE => GraphError::Driver {
                    op: "cuStreamEndCapture",
                    msg: "the stream was no longer capturing (did the closure end the capture itself?)".into(),
                },
                other => driver_err("cuStreamEndCapture")(DriverError(other)),
            });
        }
        let graph = graph.ok_or_else(|| GraphError::Driver {
            op: "cuStreamEndCapture",
            msg: "the driver returned no graph".into(),
        })?;
        let summary = inspect(graph.0)?;
        if !summary.violations.is_empty() {
            return Err(GraphError::Forbidden { what: summary.violations.join("; ") });
        }
        // SAFETY: `graph.0` is a live, complete graph (capture ended successfully).
        let exec = unsafe { cudarc::driver::result::graph::instantiate(graph.0, cu::CUgraphInstantiate_flags(0)) }
            .map_err(driver_err("cuGraphInstantiate"))?;
        Ok(CapturedGraph {
            exec,
            graph: Some(graph),
            ctx: ctx.clone(),
            nodes: summary.nodes,
            kernels: summary.kernels,
            kernel_names: std::cell::OnceCell::new(),
            keep: Vec::new(),
        })
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        let theirs = stream.context();
        if theirs.cu_ctx() != self.ctx.cu_ctx() {
            return Err(GraphError::WrongContext { graph_device: self.ctx.ordinal(), stream_device: theirs.ordinal() });
        }
        Ok(())
    }

    /// Uploads the graph's resources to the device ahead of the first replay (optional; makes
    /// the first replay as fast as the others). Asynchronous on `stream`.
    pub fn upload(&self, stream: &CudaStream) -> Result<()> {
        self.check_stream(stream)?;
        make_current(&self.ctx)?;
        // SAFETY: `exec` is live (owned by self) and the stream belongs to its context (checked).
        unsafe { cudarc::driver::result::graph::upload(self.exec, stream.cu_stream()) }
            .map_err(driver_err("cuGraphUpload"))
    }

    /// Enqueues one replay on `stream` (any stream of the capturing device). Returns at once: no
    /// allocation, no synchronisation — time this call to measure host cost per step.
    pub fn replay(&self, stream: &CudaStream) -> Result<()> {
        self.check_stream(stream)?;
        make_current(&self.ctx)?;
        // SAFETY: `exec` is live (owned by self) and the stream belongs to its context (checked).
        unsafe { cudarc::driver::result::graph::launch(self.exec, stream.cu_stream()) }
            .map_err(driver_err("cuGraphLaunch"))
    }

    /// Keeps `value` alive as long as the graph (e.g. an `Arc` of the buffers it references),
    /// and until its replays have finished on the device: dropping a graph that holds values
    /// first synchronises its context (whatever streams it was replayed on), and leaks the values
    /// if that fails. That wait has no time limit and covers all of the context's work (it also
    /// makes the context current on the dropping thread): a graph holding values whose replays
    /// could be stuck, e.g. on an NCCL collective waiting for a dead peer, must be dropped only
    /// after that communicator was aborted, and not by the thread that is to abort it
    /// (`ncclCommAbort` in turn waits for the graphs that captured its work to be released).
    pub fn hold<T: Send + 'static>(&mut self, value: T) {
        self.keep.push(Box::new(value));
    }

    /// Number of nodes in the graph.
    pub fn node_count(&self) -> usize {
        self.nodes
    }

    /// Number of kernel nodes in the graph.
    pub fn kernel_count(&self) -> usize {
        self.kernels
    }

    /// The kernel nodes' function names, in the graph's node order (for a stream capture, the
    /// order of the launches); `"?"` where the driver does not name one.
    pub fn kernel_names(&self) -> &[String] {
        self.kernel_names.get_or_init(|| match &self.graph {
            Some(g) => graph_kernel_names(g.0),
            None => Vec::new(),
        })
    }

    /// Ordinal of the device the graph runs on.
    pub fn device_ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
}

impl<K: std::hash::Hash + Eq + Clone> GraphCache<K, CapturedGraph> {
    /// The graph for `key`, captured from `f` on `stream` on a miss (see
    /// [`CapturedGraph::capture`]). The key must identify every buffer the captured work
    /// references (e.g. the sequence's KV-cache pointers, the step-parameter pointer and the
    /// dtype), so a graph is re-captured exactly when those change.
    pub fn get_or_capture<F, E>(&mut self, key: K, stream: &Arc<CudaStream>, f: F) -> Result<&CapturedGraph>
    where
        F: FnOnce(&CaptureScope<'_>) -> Result<(), E>,
        E: Into<BoxError>,
    {
        self.get_or_try_insert_with(key, || CapturedGraph::capture(stream, f))
    }

    /// Replays the graph for `key` on `stream`, capturing it first on a miss. Returns whether a
    /// capture happened.
    pub fn replay_or_capture<F, E>(&mut self, key: K, stream: &Arc<CudaStream>, f: F) -> Result<bool>
    where
        F: FnOnce(&CaptureScope<'_>) -> Result<(), E>,
        E: Into<BoxError>,
    {
        let before = self.stats().captures;
        let graph = self.get_or_capture(key, stream, f)?;
        graph.replay(stream)?;
        Ok(self.stats().captures != before)
    }
}
