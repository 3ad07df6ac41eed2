//! One-shot all-reduce over peer-to-peer (NVLink) buffers, for tensor-parallel ranks that are
//! threads of one process.
//!
//! A decode step's all-reduce moves one hidden vector (16 KB at width 4096): a latency problem,
//! not a bandwidth one. Each rank pushes its partial straight into every peer's receive buffer
//! in 16-byte lines that carry the call's epoch beside every 4-byte payload word (no fence, no
//! separate flag: a value crosses NVLink once, one way), waits until its peers' lines show the
//! epoch and sums the partials in rank order — one kernel of one block, which the runner fuses with the residual add + RMSNorm that follows each
//! reduction (`ferrum_peer_add_rmsnorm_*`). The protocol, and why two buffer parities suffice,
//! is written next to the kernels in `kernels/peer.cuh`. Results are bit-identical on every
//! rank, and for two ranks bit-identical to NCCL's sum.
//!
//! NCCL stays the general path: prefill chunks (messages larger than the buffers), several
//! processes or machines, GPUs without peer access. [`PeerReducer`] wraps any other
//! [`Reducer`] as its fallback for the messages it does not take.
//!
//! **Never hang.** A rank whose peers stop pushing gives up after the group's timeout; a failed
//! TP group sets the abort word ([`PeerHandle::abort`]) and every waiting kernel returns. Both
//! leave a status the host reads ([`PeerHandle::check`]), so the step's tokens are refused.
//!
//! ```no_run
//! # fn main() -> ferrum_cuda::Result<()> {
//! use ferrum_cuda::cudarc::driver::CudaContext;
//! use ferrum_cuda::peer::{peer_group, DEFAULT_PEER_TIMEOUT};
//! let ranks = peer_group(&[0, 1], 4096, DEFAULT_PEER_TIMEOUT)?;
//! // On each rank's thread: its stream, its buffer of partial sums.
//! let ctx = CudaContext::new(ranks[0].ordinal()).expect("GPU 0");
//! let stream = ctx.new_stream().expect("stream");
//! let mut x = stream.alloc_zeros::<f32>(4096).expect("buffer");
//! ranks[0].all_reduce_sum_in_place(&mut x, 4096, &stream)?; // rank 1 does the same on GPU 1
//! stream.synchronize().expect("sync");
//! ranks[0].handle().check()?; // did the peers answer?
//! # Ok(()) }
//! ```
use super::{DevBuf, ReduceBuf, Reducer};
use crate::error::{Error, Result};
use crate::kernel_list::Kernel;
pub(crate) use crate::peer_abi::PeerArgs;
pub use crate::peer_abi::MAX_PEER_RANKS;
use crate::peer_abi::{peer_layout, PeerLayout};
use cudarc::driver::sys as cu;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use half::{bf16, f16};
use std::sync::Arc;
use std::time::Duration;

/// How long a rank waits for its peers before its kernel gives up (then [`PeerHandle::check`]
/// reports [`Error::PeerTimedOut`]). Generous: the first step of a rank may wait for another
/// rank's graph capture and module loading.
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// Status word value of a kernel that gave up waiting (`PEER_TIMED_OUT` in peer.cuh; an
/// aborted one writes `PEER_ABORTED` = 1).
const STATUS_TIMED_OUT: u32 = 2;

// SAFETY: plain `repr(C)` data (integers only) whose layout is the kernel's `PeerArgs` struct
// (crate::peer_abi says so and a test checks it): the driver copies its bytes into the
// kernel's parameter buffer.
unsafe impl DeviceRepr for PeerArgs {}

/// Every rank's buffers, freed together once no rank can use them.
struct Buffers {
    /// One per rank (ranks may share a device, e.g. in tests on one GPU).
    ctxs: Vec<Arc<CudaContext>>,
    /// Rank r's device memory: its receive slots (`[2][world][2 * cap]` floats), then its
    /// {epoch, failed} words. The kernels reach them through `PeerArgs`.
    mem: Vec<RawAlloc>,
    /// Host memory mapped into every device: `[abort word of rank 0..w, status word of rank 0..w]`.
    ctl: PinnedHostSlice<u32>,
    /// `ctl`'s host address (read and written only with volatile accesses).
    ctl_host: *mut u32,
}

// SAFETY: the raw pointer is `ctl`'s own allocation, alive as long as `Buffers`; it is only
// used for volatile loads and stores of aligned u32 words (no references are formed), which
// any thread may do concurrently with the devices' accesses. The device buffers are only
// handed to kernels.
unsafe impl Send for Buffers {}
// SAFETY: as for Send: shared access is volatile word access only.
unsafe impl Sync for Buffers {}

impl Buffers {
    fn word(&self, i: usize) -> u32 {
        debug_assert!(i < self.ctl.len());
        // SAFETY: i < ctl.len() (callers pass rank or world + rank < 2 * world = len); the
        // pointer is aligned and the allocation alive; volatile because a device writes it.
        unsafe { std::ptr::read_volatile(self.ctl_host.add(i)) }
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        // Any rank's kernels may still write into any rank's buffers: wait for every device
        // before the frees (errors are only logged: Drop never panics). Abort every rank first,
        // so a kernel still waiting for a peer that will never come returns (within its abort
        // poll, not its timeout), and so does every call queued behind it (the failure is
        // sticky).
        for r in 0..self.ctl.len() / 2 {
            // SAFETY: word r < world of the live ctl allocation, aligned; volatile because a
            // device reads it.
            unsafe { std::ptr::write_volatile(self.ctl_host.add(r), 1) };
        }
        let sync = |what: &str| {
            for c in &self.ctxs {
                if let Err(e) = c.synchronize() {
                    tracing::warn!(device = c.ordinal(), error = %e, "synchronising {what} the peer buffers");
                }
            }
        };
        sync("before freeing");
        self.mem.clear();
    }
}

/// Device memory from `cuMemAlloc`, zeroed. Not from the stream-ordered pool that cudarc's
/// allocations use: peers reach pool memory only after `cuMemPoolSetAccess` on the whole pool,
/// while `cuCtxEnablePeerAccess` maps these allocations into every peer.
struct RawAlloc {
    ctx: Arc<CudaContext>,
    ptr: u64,
}

impl RawAlloc {
    fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(Error::driver("binding a context"))?;
        let mut ptr = 0u64;
        // SAFETY: `ptr` is a valid out-pointer; the context is current on this thread.
        match unsafe { cu::cuMemAlloc_v2(&mut ptr, bytes) } {
            cu::CUresult::CUDA_SUCCESS => {}
            cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let (free, total) = ctx.mem_get_info().map_err(Error::driver("cuMemGetInfo"))?;
                let (free, total) = (free as u64, total as u64);
                return Err(Error::OutOfMemory { what: "peer buffers".into(), asked: bytes as u64, free, total });
            }
            e => return Err(Error::Driver { what: "cuMemAlloc", msg: format!("{e:?}") }),
        }
        let mem = RawAlloc { ctx: ctx.clone(), ptr };
        // SAFETY: `ptr` holds `bytes` bytes just allocated in this (current) context.
        unsafe { cu::cuMemsetD8_v2(ptr, 0, bytes) }.result().map_err(Error::driver("cuMemsetD8"))?;
        ctx.synchronize().map_err(Error::driver("zeroing the peer buffers"))?;
        Ok(mem)
    }
}

impl Drop for RawAlloc {
    fn drop(&mut self) {
        // Errors are only logged: Drop never panics.
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!(error = %e, "binding a context to free the peer buffers");
            return;
        }
        // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once, here; no kernel
        // uses it any more (`Buffers::drop` synchronised every device first).
        if let Err(e) = unsafe { cu::cuMemFree_v2(self.ptr) }.result() {
            tracing::warn!(error = %e, "freeing the peer buffers");
        }
    }
}

/// Abort and status access to one rank of a peer group (cheap to clone, `Send + Sync`).
#[derive(Clone)]
pub struct PeerHandle {
    bufs: Arc<Buffers>,
    rank: usize,
}

impl std::fmt::Debug for PeerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerHandle").field("rank", &self.rank).finish_non_exhaustive()
    }
}

impl PeerHandle {
    /// Aborts this rank (as NCCL's abort of one communicator): its kernels that wait for a peer
    /// return within their next abort poll (every few thousand spins, well under a
    /// millisecond), those after them at once, and [`check`](Self::check) then fails (a kernel
    /// whose peers had already answered may still complete; `check` refuses its result too). A
    /// failed TP group aborts every rank. Permanent.
    pub fn abort(&self) {
        // SAFETY: word `rank` (< world < ctl.len()) of the live ctl allocation, aligned;
        // volatile because a device reads it.
        unsafe { std::ptr::write_volatile(self.bufs.ctl_host.add(self.rank), 1) };
    }

    /// `Ok` unless one of this rank's peer kernels gave up: call it after the work was waited
    /// for (a stream synchronisation); its outputs are then garbage.
    pub fn check(&self) -> Result<()> {
        let world = self.bufs.ctl.len() / 2;
        match self.bufs.word(world + self.rank) {
            0 if self.bufs.word(self.rank) == 0 => Ok(()),
            STATUS_TIMED_OUT => Err(Error::PeerTimedOut { rank: self.rank }),
            // STATUS_ABORTED, or the rank was aborted while its kernels were done.
            _ => Err(Error::PeerAborted { rank: self.rank }),
        }
    }
}

/// One rank of a peer group: its kernel arguments and a launcher of the plain all-reduce.
pub struct PeerRank {
    handle: PeerHandle,
    args: PeerArgs,
    ordinal: usize,
    device: cu::CUdevice,
    /// The all-reduce kernels, indexed by [`PeerElement::INDEX`].
    funcs: [CudaFunction; 3],
    _module: Arc<CudaModule>,
}

impl std::fmt::Debug for PeerRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerRank")
            .field("rank", &self.handle.rank)
            .field("world", &self.args.world)
            .field("ordinal", &self.ordinal)
            .field("capacity", &self.args.cap)
            .finish_non_exhaustive()
    }
}

/// Lets every device of `ctxs` access every other one's memory (a no-op between contexts of
/// one device). Fails with [`Error::Unavailable`] when a pair has no peer access.
fn enable_peer_access(ctxs: &[Arc<CudaContext>]) -> Result<()> {
    for a in ctxs {
        for b in ctxs {
            if a.cu_device() == b.cu_device() {
                continue;
            }
            let mut can = 0;
            // SAFETY: `can` is a valid out-pointer; both devices are valid handles of live
            // contexts.
            unsafe { cu::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
                .result()
                .map_err(Error::driver("cuDeviceCanAccessPeer"))?;
            if can == 0 {
                return Err(Error::Unavailable(format!(
                    "GPU {} cannot access GPU {}'s memory directly (no peer access)",
                    a.ordinal(),
                    b.ordinal()
                )));
            }
            a.bind_to_thread().map_err(Error::driver("binding a context"))?;
            // SAFETY: `a` is current on this thread and `b` is a live context of another device.
            match unsafe { cu::cuCtxEnablePeerAccess(b.cu_ctx(), 0) } {
                // Already enabled (by NCCL, or an earlier group): what we want.
                cu::CUresult::CUDA_SUCCESS | cu::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                e => return Err(Error::Driver { what: "cuCtxEnablePeerAccess", msg: format!("{e:?}") }),
            }
        }
    }
    Ok(())
}

/// A peer group over the GPUs `ordinals` (rank r on `ordinals[r]`; a GPU may repeat, which
/// tests use on one GPU), for messages of up to `capacity` floats, each rank waiting at most
/// `timeout` for its peers. Enables peer access between the GPUs; fails with
/// [`Error::Unavailable`] when some pair has none (use NCCL then), and with
/// [`Error::InvalidArgument`] for 0 or more than [`MAX_PEER_RANKS`] GPUs, a capacity of 0, or
/// buffers too large for the kernels' `i32` indices.
///
/// Every rank must then make the same sequence of calls (the same lengths, in the same order),
/// each on a stream of its own GPU — as the ranks of a TP decode do.
pub fn peer_group(ordinals: &[usize], capacity: usize, timeout: Duration) -> Result<Vec<PeerRank>> {
    let world = ordinals.len();
    let PeerLayout { cap, counter_offset, bytes } = peer_layout(world, capacity)?;
    let ctxs = ordinals.iter().map(|&o| super::context(o)).collect::<Result<Vec<_>>>()?;
    enable_peer_access(&ctxs)?;
    // Each rank's receive slots, then its {epoch, failed} words (8-byte aligned: the kernels
    // read them with one load), in one allocation.
    let mem = ctxs.iter().map(|c| RawAlloc::zeroed(c, bytes)).collect::<Result<Vec<_>>>()?;
    // SAFETY: initialised right below, before anything reads it.
    let mut ctl = unsafe {
        ctxs[0].alloc_pinned_with_flags::<u32>(2 * world, cu::CU_MEMHOSTALLOC_PORTABLE | cu::CU_MEMHOSTALLOC_DEVICEMAP)
    }
    .map_err(Error::driver("cuMemHostAlloc"))?;
    ctl.as_mut_slice().map_err(Error::driver("host slice"))?.fill(0);
    let ctl_host = ctl.as_mut_ptr().map_err(Error::driver("host pointer"))?;
    let mut recv_ptrs = [0u64; MAX_PEER_RANKS];
    for (r, m) in mem.iter().enumerate() {
        recv_ptrs[r] = m.ptr;
    }
    let bufs = Arc::new(Buffers { ctxs: ctxs.clone(), mem, ctl, ctl_host });
    let (_, norm_ptx) = crate::ptx::MODULES
        .iter()
        .find(|(n, _)| *n == Kernel::PeerAllReduceF32.module())
        .ok_or(Error::MissingKernel(Kernel::PeerAllReduceF32.name()))?;
    let mut ranks = Vec::with_capacity(world);
    for (r, c) in ctxs.iter().enumerate() {
        c.bind_to_thread().map_err(Error::driver("binding a context"))?;
        let mut dev = 0u64;
        // SAFETY: `ctl_host` is a live allocation made with DEVICEMAP | PORTABLE, so it has a
        // device address in every context; `dev` is a valid out-pointer; flags must be 0.
        unsafe { cu::cuMemHostGetDevicePointer_v2(&mut dev, ctl_host.cast(), 0) }
            .result()
            .map_err(Error::driver("cuMemHostGetDevicePointer"))?;
        let module = c
            .load_module(Ptx::from_src(*norm_ptx))
            .map_err(|e| Error::Driver { what: "loading PTX", msg: format!("module norm: {e}") })?;
        let load = |k: Kernel| module.load_function(k.name()).map_err(|_| Error::MissingKernel(k.name()));
        let funcs = [load(f32::KERNEL)?, load(f16::KERNEL)?, load(bf16::KERNEL)?];
        let args = PeerArgs {
            recv: recv_ptrs,
            own_recv: recv_ptrs[r],
            counter: recv_ptrs[r] + counter_offset as u64,
            abort: dev + (r * std::mem::size_of::<u32>()) as u64,
            status: dev + ((world + r) * std::mem::size_of::<u32>()) as u64,
            timeout_ns: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
            rank: r as i32,
            world: world as i32,
            cap,
        };
        ranks.push(PeerRank {
            handle: PeerHandle { bufs: bufs.clone(), rank: r },
            args,
            ordinal: c.ordinal(),
            device: c.cu_device(),
            funcs,
            _module: module,
        });
    }
    Ok(ranks)
}

impl PeerRank {
    /// This rank (0-based).
    pub fn rank(&self) -> usize {
        self.handle.rank
    }
    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.args.world as usize
    }
    /// The GPU this rank runs on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    /// This rank's CUDA context (the primary context of its GPU).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.handle.bufs.ctxs[self.handle.rank]
    }
    /// The longest message (floats) the group takes.
    pub fn capacity(&self) -> usize {
        self.args.cap as usize
    }
    /// Abort and status access (for the failure path of a TP group).
    pub fn handle(&self) -> PeerHandle {
        self.handle.clone()
    }
    pub(crate) fn args(&self) -> &PeerArgs {
        &self.args
    }

    /// Whether `stream` belongs to this rank's GPU.
    pub(crate) fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        if stream.context().cu_device() != self.device {
            return Err(Error::InvalidArgument(format!(
                "peer rank {} runs on GPU {}, the stream is on GPU {}",
                self.rank(),
                self.ordinal,
                stream.context().ordinal()
            )));
        }
        Ok(())
    }

    /// Sums `data[..len]` over the ranks, in place, on `stream` (of this rank's GPU): f32, f16
    /// or bf16, accumulated in fp32 in rank order and rounded once. Every rank must make the
    /// same calls in the same order, and a rank's calls must be ordered on one stream (the
    /// kernels keep the rank's call count on the device). Fails at once (nothing enqueued) when `len` exceeds the capacity or `data`; a
    /// peer that never answers shows up in [`PeerHandle::check`].
    pub fn all_reduce_sum_in_place<T: PeerElement>(
        &self,
        data: &mut DevBuf<T>,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        if len > self.capacity() || len > data.len() {
            return Err(Error::InvalidArgument(format!(
                "peer all-reduce of {len} floats: capacity {}, buffer {}",
                self.capacity(),
                data.len()
            )));
        }
        if len == 0 {
            return Ok(());
        }
        self.check_stream(stream)?;
        let n = len as i32; // len <= cap, which fits i32
        let (p, _guard) = data.device_ptr(stream);
        // One thread per 8-byte payload line, up to 1024.
        let per_line = 8 / std::mem::size_of::<T>();
        let threads = len.div_ceil(per_line).next_multiple_of(32).clamp(32, 1024) as u32;
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(&self.funcs[T::INDEX]);
        b.arg(&self.args).arg(&p).arg(&n);
        // SAFETY: the signature is (PeerArgs, T*, int) for T's kernel; `data` holds at least
        // len values; the peer buffers hold `cap >= len` floats (so at least len values of T) per slot and live as long as this rank
        // (`Buffers`, freed only after every device synchronised); the kernel runs in this
        // rank's context (the stream was checked to be on its device, whose module it is).
        unsafe { b.launch(cfg) }.map_err(Error::driver("peer all-reduce"))?;
        Ok(())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type the peer all-reduce sums: `f32`, `half::f16`, `half::bf16`.
pub trait PeerElement: DeviceRepr + sealed::Sealed {
    /// Its kernel.
    const KERNEL: Kernel;
    #[doc(hidden)]
    const INDEX: usize;
}

// The kernels this module launches are the ones the kernel timeline knows never stamp.
const _: () = {
    let k = crate::timeline::PEER_GROUP_KERNELS;
    assert!(k[<f32 as PeerElement>::INDEX] as usize == <f32 as PeerElement>::KERNEL as usize);
    assert!(k[<f16 as PeerElement>::INDEX] as usize == <f16 as PeerElement>::KERNEL as usize);
    assert!(k[<bf16 as PeerElement>::INDEX] as usize == <bf16 as PeerElement>::KERNEL as usize);
};

impl PeerElement for f32 {
    const KERNEL: Kernel = Kernel::PeerAllReduceF32;
    const INDEX: usize = 0;
}
impl PeerElement for f16 {
    const KERNEL: Kernel = Kernel::PeerAllReduceF16;
    const INDEX: usize = 1;
}
impl PeerElement for bf16 {
    const KERNEL: Kernel = Kernel::PeerAllReduceBf16;
    const INDEX: usize = 2;
}

/// A [`Reducer`] that sums messages of up to its group's capacity with the one-shot peer
/// kernel (and offers it to the runner for the fused add + RMSNorm), and hands longer ones
/// (prefill chunks) to `fallback` — every rank takes the same branch, as every rank reduces
/// the same lengths.
pub struct PeerReducer {
    peer: PeerRank,
    fallback: Box<dyn Reducer>,
}

impl std::fmt::Debug for PeerReducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerReducer").field("peer", &self.peer).finish_non_exhaustive()
    }
}

impl PeerReducer {
    /// The one-shot path over `peer`, `fallback` for longer messages.
    pub fn new(peer: PeerRank, fallback: Box<dyn Reducer>) -> Self {
        Self { peer, fallback }
    }
}

impl Reducer for PeerReducer {
    fn all_reduce(&mut self, buf: ReduceBuf<'_>) -> Result<()> {
        if buf.len <= self.peer.capacity() {
            self.peer.all_reduce_sum_in_place(buf.data, buf.len, buf.stream)
        } else {
            self.fallback.all_reduce(buf)
        }
    }

    fn peer(&self) -> Option<&PeerRank> {
        Some(&self.peer)
    }
}
