//! The NCCL communicator rank (real backend, `cuda` feature).
//!
//! Layering follows cudarc's: raw `cudarc::nccl::sys` calls stay in this module, each behind a
//! safe method that checks sizes and devices first. The raw communicator is owned here (not by
//! cudarc's `Comm`, whose `Drop` panics on error): it is aborted, never destroyed, when the rank
//! is dropped or fails, so no rank can block forever on a dead peer.

use crate::error::{Error, Result};
use crate::rendezvous::{Rendezvous, RendezvousOptions, ID_LEN};
use cudarc::driver::sys as cu;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use cudarc::nccl::sys;
use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError};

// ---------------------------------------------------------------------------------------------
// Library presence, error text
// ---------------------------------------------------------------------------------------------

/// cudarc loads libcuda / libnccl lazily and panics when they are missing; check first.
fn ensure_libs() -> Result<()> {
    static PRESENT: OnceLock<(bool, bool)> = OnceLock::new();
    let (cuda, nccl) = *PRESENT.get_or_init(|| {
        // SAFETY: these only try `dlopen` on the library's usual names and close the handle
        // again; they have no preconditions (cudarc marks them unsafe because loading a library
        // runs its initialisers).
        unsafe { (cu::is_culib_present(), sys::is_culib_present()) }
    });
    if !cuda {
        return Err(Error::Unavailable("the CUDA driver library (libcuda.so.1) could not be loaded".into()));
    }
    if !nccl {
        return Err(Error::Unavailable(
            "the NCCL library (libnccl.so.2) could not be loaded: install NCCL or add it to LD_LIBRARY_PATH".into(),
        ));
    }
    Ok(())
}

/// Copies a C string returned by NCCL.
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string that stays valid during this call.
unsafe fn c_text(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: non-null and NUL-terminated per this function's contract.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().trim().to_string()
    }
}

/// Builds the typed error of a failed NCCL call, with NCCL's own text.
///
/// # Safety
/// `comm` must be null or a live (not yet aborted) communicator.
unsafe fn nccl_error(op: &'static str, code: sys::ncclResult_t, comm: sys::ncclComm_t) -> Error {
    // SAFETY: ncclGetErrorString takes any result code and returns a pointer to a static
    // NUL-terminated string.
    let msg = unsafe { c_text(sys::ncclGetErrorString(code)) };
    // SAFETY: `comm` is null (NCCL then reports the last global error) or live per this
    // function's contract; the returned string is owned by NCCL and copied before any other
    // NCCL call.
    let detail = unsafe { c_text(sys::ncclGetLastError(comm)) };
    Error::Nccl { op, code: format!("{code:?}"), msg, detail }
}

fn is_ok(code: sys::ncclResult_t) -> bool {
    // ncclInProgress only comes from non-blocking communicators (never made here) and means the
    // call was accepted.
    matches!(code, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress)
}

fn cuda_err(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda { op, msg: e.to_string() }
}

/// Makes `ctx` current on this thread (without cudarc's `bind_to_thread`, which also reports and
/// clears errors recorded by unrelated drops). Does not allocate or synchronise.
fn make_current(ctx: &CudaContext) -> Result<()> {
    let current = cudarc::driver::result::ctx::get_current().map_err(cuda_err("cuCtxGetCurrent"))?;
    if current != Some(ctx.cu_ctx()) {
        // SAFETY: `ctx.cu_ctx()` is a live context: `ctx` keeps it retained for this call.
        unsafe { cudarc::driver::result::ctx::set_current(ctx.cu_ctx()) }.map_err(cuda_err("cuCtxSetCurrent"))?;
    }
    Ok(())
}

fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    ensure_libs()?;
    let n = CudaContext::device_count().map_err(|e| Error::Unavailable(format!("no CUDA devices: {e}")))?;
    if ordinal >= n.max(0) as usize {
        return Err(Error::Unavailable(format!("no CUDA device {ordinal} ({n} visible)")));
    }
    CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))
}

fn warn_nvls() {
    if !crate::nvls_disabled() {
        tracing::warn!(
            "{}=0 is not set: NCCL may use NVLink multicast (NVLS) objects; ferrum's GPU machines must not. \
             Set it in the environment before starting the process.",
            crate::NVLS_ENV
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Unique id, element types
// ---------------------------------------------------------------------------------------------

/// NCCL's unique id: 128 opaque bytes made by rank 0 and handed to every other rank.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; ID_LEN]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

impl UniqueId {
    /// A fresh id (`ncclGetUniqueId`); call on rank 0 only. NCCL starts its bootstrap listener
    /// here, so the id is only valid while this process lives.
    pub fn new() -> Result<Self> {
        ensure_libs()?;
        let mut id = sys::ncclUniqueId { internal: [0; ID_LEN] };
        // SAFETY: `id` is a valid, writable ncclUniqueId for the duration of the call.
        let code = unsafe { sys::ncclGetUniqueId(&mut id) };
        if !is_ok(code) {
            // SAFETY: a null communicator asks NCCL for its last global error.
            return Err(unsafe { nccl_error("ncclGetUniqueId", code, std::ptr::null_mut()) });
        }
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }

    /// An id received from rank 0 (through [`Rendezvous`] or any other channel).
    pub fn from_bytes(bytes: [u8; ID_LEN]) -> Self {
        UniqueId(bytes)
    }

    /// The id's bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; ID_LEN] {
        &self.0
    }

    fn to_sys(self) -> sys::ncclUniqueId {
        sys::ncclUniqueId { internal: self.0.map(|b| b as std::ffi::c_char) }
    }
}

/// Element type of a collective, as NCCL sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// `f32`
    F32,
    /// `half::f16`
    F16,
    /// `half::bf16`
    BF16,
    /// `u8` (bytes)
    U8,
    /// `i32`
    I32,
    /// `u32`
    U32,
}

impl DType {
    fn to_sys(self) -> sys::ncclDataType_t {
        match self {
            DType::F32 => sys::ncclDataType_t::ncclFloat32,
            DType::F16 => sys::ncclDataType_t::ncclFloat16,
            DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
            DType::U8 => sys::ncclDataType_t::ncclUint8,
            DType::I32 => sys::ncclDataType_t::ncclInt32,
            DType::U32 => sys::ncclDataType_t::ncclUint32,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Element types NCCL can move (all-gather) and sum (all-reduce).
pub trait NcclElement: DeviceRepr + sealed::Sealed {
    /// NCCL's name for this type.
    const DTYPE: DType;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl NcclElement for $t {
            const DTYPE: DType = $d;
        }
    };
}
element!(f32, DType::F32);
element!(half::f16, DType::F16);
element!(half::bf16, DType::BF16);
element!(u8, DType::U8);
element!(i32, DType::I32);
element!(u32, DType::U32);

// ---------------------------------------------------------------------------------------------
// The communicator
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
enum State {
    Live,
    Aborted(String),
}

/// The raw communicator and its life state, shared by a rank and its [`AbortHandle`]s.
///
/// `comm` is only used while `state` is locked and `Live`; aborting sets `Aborted` under the same
/// lock before `ncclCommAbort` frees it, so no call can use a freed communicator.
#[derive(Debug)]
struct Shared {
    comm: sys::ncclComm_t,
    state: Mutex<State>,
    /// Set when an abort *begins* (under `state`'s lock, before `ncclCommAbort`): lets callers
    /// notice an abort without taking the lock, which the abort holds while it runs (and
    /// `ncclCommAbort` can wait for the caller: see [`NcclRank::while_live`]).
    aborted: AtomicBool,
    /// Why it was aborted: set (once) before `aborted`, so a caller that sees the flag can
    /// report the cause without the lock.
    reason: OnceLock<String>,
    rank: usize,
    world_size: usize,
}

// SAFETY: an NCCL communicator is not tied to the thread that made it (NCCL only requires that
// calls on one communicator are not concurrent); every use of `comm` happens with `state` locked,
// which serialises them, and the pointer is never used after it is freed (see `Shared`).
unsafe impl Send for Shared {}
// SAFETY: as for Send: all access to `comm` goes through the `state` mutex.
unsafe impl Sync for Shared {}

impl Shared {
    /// A live communicator's shared state.
    fn new(comm: sys::ncclComm_t, rank: usize, world_size: usize) -> Arc<Self> {
        Arc::new(Shared {
            comm,
            state: Mutex::new(State::Live),
            aborted: AtomicBool::new(false),
            reason: OnceLock::new(),
            rank,
            world_size,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; if a caller's panic poisoned it anyway, the
        // state itself is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn aborted_error(&self, reason: &str) -> Error {
        Error::Aborted { rank: self.rank, world_size: self.world_size, reason: reason.to_string() }
    }

    /// Aborts with the lock held. Never panics; NCCL's error, if any, is logged.
    fn abort_locked(&self, state: &mut State, reason: String) {
        if matches!(state, State::Aborted(_)) {
            return;
        }
        tracing::debug!(rank = self.rank, %reason, "aborting the NCCL communicator");
        let _ = self.reason.set(reason.clone());
        *state = State::Aborted(reason);
        // Release (paired with the Acquire loads): the flag publishes no data — the state is
        // only read under the mutex, and the communicator only used under it — so Relaxed
        // would do; callers just stop early when they see it. Release/Acquire costs nothing
        // here (one store on the abort path; plain loads on x86 and an ldar on ARM).
        self.aborted.store(true, Ordering::Release);
        let t0 = std::time::Instant::now();
        // SAFETY: `comm` is live (state was Live, and only this function, under the lock, ever
        // frees it); after this call the state is Aborted, so it is never used again.
        let code = unsafe { sys::ncclCommAbort(self.comm) };
        if !is_ok(code) {
            tracing::warn!(rank = self.rank, code = ?code, "ncclCommAbort failed (ignored)");
        }
        tracing::debug!(rank = self.rank, took_ms = t0.elapsed().as_secs_f64() * 1e3, "NCCL communicator aborted");
    }

    /// Runs one NCCL call on the live communicator; on failure, aborts it (unless `in_group`,
    /// where the group aborts after `ncclGroupEnd`) and returns NCCL's error.
    ///
    /// `call` must only use the communicator it is given.
    fn call_locked(
        &self,
        state: &mut State,
        op: &'static str,
        in_group: bool,
        call: impl FnOnce(sys::ncclComm_t) -> sys::ncclResult_t,
    ) -> Result<()> {
        if let State::Aborted(reason) = state {
            return Err(self.aborted_error(reason));
        }
        let code = call(self.comm);
        if is_ok(code) {
            return Ok(());
        }
        // SAFETY: `comm` is live (state is Live, checked above, under the lock).
        let err = unsafe { nccl_error(op, code, self.comm) };
        if !in_group {
            self.abort_locked(state, format!("{op} failed: {err}"));
        }
        Err(err)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if matches!(state, State::Live) {
            *state = State::Aborted("dropped".into());
            // SAFETY: the communicator is live (state was Live) and this is its last owner.
            let code = unsafe { sys::ncclCommAbort(self.comm) };
            if !is_ok(code) {
                tracing::warn!(rank = self.rank, code = ?code, "ncclCommAbort in Drop failed (ignored)");
            }
        }
    }
}

/// A clonable, `Send + Sync` handle that aborts a rank's communicator from any thread (a TP
/// group's watchdog or failure path). Aborting makes NCCL kernels that wait for a dead peer
/// exit, so a host thread blocked in a stream synchronisation returns.
#[derive(Clone, Debug)]
pub struct AbortHandle {
    shared: Arc<Shared>,
}

impl AbortHandle {
    /// Aborts the communicator (`ncclCommAbort`); idempotent: returns at once when an abort has
    /// already begun (never waits for another thread's abort, which can wait for this thread:
    /// see [`NcclRank::while_live`]). Otherwise waits only for an NCCL *enqueue* call that
    /// another thread is making on this communicator (never for GPU work).
    pub fn abort(&self, reason: &str) {
        // Acquire: pairs with the Release store when an abort began (see `abort_locked`).
        if self.shared.aborted.load(Ordering::Acquire) {
            return;
        }
        let mut state = self.shared.lock();
        self.shared.abort_locked(&mut state, reason.to_string());
    }

    /// True once an abort (explicit, after a failure, or because the rank was dropped) has
    /// begun. Never blocks.
    pub fn is_aborted(&self) -> bool {
        // Acquire: pairs with the Release store when the abort began (see `abort_locked`).
        self.shared.aborted.load(Ordering::Acquire)
    }
}

/// One rank of an NCCL communicator, bound to one GPU.
///
/// Collectives are enqueued on the stream you pass and return at once (no host synchronisation,
/// no allocation), so they can be captured in a CUDA graph. Any NCCL failure aborts the
/// communicator (`ncclCommAbort`) and is returned with NCCL's own text; every later call then
/// returns [`Error::Aborted`]. Dropping a rank aborts its communicator (never blocks, never
/// panics). `NcclRank` is `Send + Sync`.
///
/// Set `NCCL_NVLS_ENABLE=0` in the environment before the first NCCL call (see
/// [`crate::NVLS_ENV`]); ferrum's GPU machines must not use NVLink multicast.
#[derive(Debug)]
pub struct NcclRank {
    shared: Arc<Shared>,
    ctx: Arc<CudaContext>,
}

impl Drop for NcclRank {
    fn drop(&mut self) {
        // Free the communicator now even if AbortHandles outlive the rank.
        let mut state = self.shared.lock();
        self.shared.abort_locked(&mut state, "the rank was dropped".into());
    }
}

impl NcclRank {
    /// One rank per listed device, all in this process (`ncclCommInitAll`); rank `i` runs on
    /// device `ordinals[i]`. Drive the ranks from one thread inside [`group`], or move each
    /// to its own thread.
    pub fn init_all(ordinals: &[usize]) -> Result<Vec<NcclRank>> {
        if ordinals.is_empty() {
            return Err(Error::InvalidArgument("init_all needs at least one device".into()));
        }
        for (i, o) in ordinals.iter().enumerate() {
            if ordinals[..i].contains(o) {
                return Err(Error::InvalidArgument(format!("device {o} is listed twice (one rank per GPU)")));
            }
        }
        let ctxs = ordinals.iter().map(|&o| context(o)).collect::<Result<Vec<_>>>()?;
        let n = c_int::try_from(ordinals.len())
            .map_err(|_| Error::InvalidArgument(format!("{} devices is too many", ordinals.len())))?;
        let devs: Vec<c_int> = ordinals.iter().map(|&o| o as c_int).collect();
        warn_nvls();
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); ordinals.len()];
        // SAFETY: `comms` has room for `n` communicators and `devs` holds `n` valid device
        // ordinals (checked against the device count above); both outlive the call.
        let code = unsafe { sys::ncclCommInitAll(comms.as_mut_ptr(), n, devs.as_ptr()) };
        if !is_ok(code) {
            // SAFETY: no communicator exists; null asks for the last global error.
            return Err(unsafe { nccl_error("ncclCommInitAll", code, std::ptr::null_mut()) });
        }
        let world_size = ordinals.len();
        Ok(comms
            .into_iter()
            .zip(ctxs)
            .enumerate()
            .map(|(rank, (comm, ctx))| NcclRank { shared: Shared::new(comm, rank, world_size), ctx })
            .collect())
    }

    /// One rank of a `world_size`-rank communicator, on `ctx`'s device, from rank 0's id
    /// (`ncclCommInitRank`). Blocks until every rank joined. **Known limit:** NCCL's bootstrap
    /// has no timeout of its own, so a rank that never joins (not started, crashed after
    /// fetching the id, launched with another world size) leaves the live ranks waiting here;
    /// a bounded initialisation is written on branch `wip/s50-gpu-untested`, not yet run on a GPU.
    pub fn init_rank(ctx: &Arc<CudaContext>, rank: usize, world_size: usize, id: &UniqueId) -> Result<NcclRank> {
        ensure_libs()?;
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!("rank {rank} is not below world size {world_size}")));
        }
        let nranks = c_int::try_from(world_size)
            .map_err(|_| Error::InvalidArgument(format!("world size {world_size} is too large")))?;
        warn_nvls();
        // NCCL binds the communicator to the calling thread's current device.
        make_current(ctx)?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id is passed by value; `rank < world_size`
        // both fit in c_int (checked above).
        let code = unsafe { sys::ncclCommInitRank(&mut comm, nranks, id.to_sys(), rank as c_int) };
        if !is_ok(code) {
            // SAFETY: no communicator was made; null asks for the last global error.
            return Err(unsafe { nccl_error("ncclCommInitRank", code, std::ptr::null_mut()) });
        }
        Ok(NcclRank { shared: Shared::new(comm, rank, world_size), ctx: ctx.clone() })
    }

    /// [`init_rank`](Self::init_rank) with the id handed over by `rendezvous`: rank 0 makes the
    /// id and publishes it (file or TCP), the other ranks fetch it (polling, up to
    /// `opts.timeout`).
    pub fn init_rank_rendezvous(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world_size: usize,
        rendezvous: &Rendezvous,
        opts: &RendezvousOptions,
    ) -> Result<NcclRank> {
        if rank == 0 {
            let id = UniqueId::new()?;
            let publication = rendezvous.publish(id.as_bytes(), world_size, opts)?;
            let me = Self::init_rank(ctx, 0, world_size, &id)?;
            publication.finish()?;
            Ok(me)
        } else {
            let bytes = rendezvous.fetch(rank, world_size, opts)?;
            Self::init_rank(ctx, rank, world_size, &UniqueId::from_bytes(bytes))
        }
    }

    /// [`init_rank_rendezvous`](Self::init_rank_rendezvous) on device `ordinal` (its primary
    /// context), for callers that hold no cudarc context.
    pub fn init_rank_rendezvous_on(
        ordinal: usize,
        rank: usize,
        world_size: usize,
        rendezvous: &Rendezvous,
        opts: &RendezvousOptions,
    ) -> Result<NcclRank> {
        let ctx = context(ordinal)?;
        Self::init_rank_rendezvous(&ctx, rank, world_size, rendezvous, opts)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.shared.world_size
    }

    /// The CUDA device ordinal of this rank.
    pub fn device_ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// This rank's CUDA context (device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A handle that aborts this communicator from any thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle { shared: self.shared.clone() }
    }

    /// Aborts the communicator now (`ncclCommAbort`); idempotent. Later calls return
    /// [`Error::Aborted`].
    pub fn abort(&self, reason: &str) {
        self.abort_handle().abort(reason)
    }

    /// True once an abort has begun. Never blocks.
    pub fn is_aborted(&self) -> bool {
        // Acquire: pairs with the Release store when the abort began (see `abort_locked`).
        self.shared.aborted.load(Ordering::Acquire)
    }

    /// Runs `f` while the communicator is live and cannot be aborted, or returns
    /// [`Error::Aborted`] without running it.
    ///
    /// For launching a CUDA graph that captured this communicator's collectives: the graph's
    /// NCCL kernels use the communicator's resources, which `ncclCommAbort` frees, and a replay
    /// does not go through this wrapper. Launching under this guard orders every replay either
    /// before an abort (whose `ncclCommAbort` then terminates the kernels it enqueued) or after
    /// it (refused here). [`AbortHandle::abort`] waits for `f` to return, so keep `f` to
    /// enqueueing work; this call never waits for an abort in progress (it fails instead).
    pub fn while_live<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        let _state = self.lock_live()?;
        Ok(f())
    }

    /// The communicator's lock, taken only while it is live: never *waits* for an abort in
    /// progress (it fails instead). Seen with NCCL 2.28 on two H200s: the ncclCommAbort that
    /// tears an ncclCommInitAll clique down (the last of its communicators to be aborted) did
    /// not return while the rank thread owning this communicator's captured graphs was blocked
    /// on this lock; that thread frees its graphs only after it gives up (NCCL keeps
    /// graph-captured work referenced until then). So: fail as soon as an abort has begun (the
    /// flag is set right after the abort takes the lock), and otherwise only try the lock,
    /// yielding while another thread holds it.
    fn lock_live(&self) -> Result<MutexGuard<'_, State>> {
        loop {
            // Acquire: pairs with the Release store when an abort began (see `abort_locked`).
            if self.shared.aborted.load(Ordering::Acquire) {
                let reason = self.shared.reason.get().map_or("aborted", String::as_str);
                return Err(self.shared.aborted_error(reason));
            }
            let state = match self.shared.state.try_lock() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    std::thread::yield_now();
                    continue;
                }
            };
            if let State::Aborted(reason) = &*state {
                let err = self.shared.aborted_error(reason);
                return Err(err);
            }
            return Ok(state);
        }
    }

    /// Polls NCCL for an asynchronous error (a peer or network failure noticed by NCCL's proxy
    /// thread, `ncclCommGetAsyncError`). On error the communicator is aborted and NCCL's text is
    /// returned. Cheap; call it from a watchdog while waiting for GPU work.
    pub fn check_async_error(&self) -> Result<()> {
        let mut state = self.lock_live()?;
        let mut async_code = sys::ncclResult_t::ncclSuccess;
        self.shared.call_locked(&mut state, "ncclCommGetAsyncError", false, |comm| {
            // SAFETY: `comm` is live (call_locked checked it under the lock) and `async_code`
            // is a valid out-pointer.
            unsafe { sys::ncclCommGetAsyncError(comm, &mut async_code) }
        })?;
        if is_ok(async_code) {
            return Ok(());
        }
        // SAFETY: still live: only call_locked/abort_locked free it, under this held lock.
        let err = unsafe { nccl_error("asynchronous NCCL operation", async_code, self.shared.comm) };
        self.shared.abort_locked(&mut state, format!("asynchronous error: {err}"));
        Err(err)
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        let theirs = stream.context().ordinal();
        if theirs != self.ctx.ordinal() {
            return Err(Error::InvalidArgument(format!(
                "stream of device {theirs} given to NCCL rank {} on device {}",
                self.rank(),
                self.ctx.ordinal()
            )));
        }
        Ok(())
    }

    /// In-place sum over all ranks of `buf` (every rank passes the same length), enqueued on
    /// `stream` (a stream of this rank's device). Graph-capturable: no allocation, no host
    /// synchronisation.
    pub fn all_reduce_sum_in_place<T: NcclElement, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        stream: &CudaStream,
    ) -> Result<()> {
        let mut state = self.lock_live()?;
        self.all_reduce_locked(&mut state, buf, stream, false)
    }

    fn all_reduce_locked<T: NcclElement, B: DevicePtrMut<T>>(
        &self,
        state: &mut State,
        buf: &mut B,
        stream: &CudaStream,
        in_group: bool,
    ) -> Result<()> {
        self.check_stream(stream)?;
        make_current(&self.ctx)?;
        let count = buf.len();
        let (ptr, _record) = buf.device_ptr_mut(stream);
        // SAFETY: `ptr` points to `count` elements of `T` in an allocation of this device that
        // `buf`'s borrow keeps alive and exclusively ours until `_record` is dropped (after the
        // enqueue); the stream is a live stream of this rank's device (checked above).
        unsafe { self.enqueue_all_reduce(state, ptr, count, T::DTYPE, stream.cu_stream(), in_group) }
    }

    /// Raw-pointer version of [`all_reduce_sum_in_place`](Self::all_reduce_sum_in_place), for
    /// buffers that are not cudarc slices.
    ///
    /// # Safety
    /// `buf` must point to `count` elements of `dtype` in device memory of this rank's GPU that
    /// stays allocated, and is not accessed by other work, until the reduction completes on
    /// `stream`; `stream` must be a live stream of this rank's device.
    pub unsafe fn all_reduce_sum_in_place_raw(
        &self,
        buf: cu::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: cu::CUstream,
    ) -> Result<()> {
        make_current(&self.ctx)?;
        let mut state = self.lock_live()?;
        // SAFETY: forwarded from this function's contract.
        unsafe { self.enqueue_all_reduce(&mut state, buf, count, dtype, stream, false) }
    }

    /// # Safety
    /// As for [`all_reduce_sum_in_place_raw`](Self::all_reduce_sum_in_place_raw).
    unsafe fn enqueue_all_reduce(
        &self,
        state: &mut State,
        buf: cu::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: cu::CUstream,
        in_group: bool,
    ) -> Result<()> {
        self.shared.call_locked(state, "ncclAllReduce", in_group, |comm| {
            // SAFETY: `comm` is live (checked under the lock by call_locked); the buffer and
            // stream are valid per this function's contract; in-place (send == recv) is allowed
            // by NCCL.
            unsafe {
                sys::ncclAllReduce(
                    buf as *const c_void,
                    buf as *mut c_void,
                    count,
                    dtype.to_sys(),
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    stream as sys::cudaStream_t,
                )
            }
        })
    }

    /// All-gather: `recv[r * send.len() .. (r + 1) * send.len()]` receives rank `r`'s `send`.
    /// `recv` must hold at least `send.len() * world_size` elements. Graph-capturable.
    pub fn all_gather<T: NcclElement, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &self,
        send: &S,
        recv: &mut R,
        stream: &CudaStream,
    ) -> Result<()> {
        let mut state = self.lock_live()?;
        self.all_gather_locked(&mut state, send, recv, stream, false)
    }

    fn all_gather_locked<T: NcclElement, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &self,
        state: &mut State,
        send: &S,
        recv: &mut R,
        stream: &CudaStream,
        in_group: bool,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let count = send.len();
        let need = count.saturating_mul(self.world_size());
        if recv.len() < need {
            return Err(Error::InvalidArgument(format!(
                "all_gather: receive buffer holds {} elements, {} ranks x {count} are needed",
                recv.len(),
                self.world_size()
            )));
        }
        make_current(&self.ctx)?;
        let (src, _record_src) = send.device_ptr(stream);
        let (dst, _record_dst) = recv.device_ptr_mut(stream);
        // SAFETY: `src` holds `count` elements and `dst` at least `count * world_size`
        // (checked above), both allocations of this device kept alive by the borrows until the
        // records drop (after the enqueue); the stream is of this device (checked above).
        unsafe { self.enqueue_all_gather(state, src, dst, count, T::DTYPE, stream.cu_stream(), in_group) }
    }

    /// Raw-pointer all-gather (also in place, with `send == recv + rank * count` elements).
    ///
    /// # Safety
    /// `send` must point to `count` elements and `recv` to `count * world_size` elements of
    /// `dtype` in device memory of this rank's GPU, allocated and not used by other work until
    /// the operation completes on `stream`; `stream` must be a live stream of this device.
    pub unsafe fn all_gather_raw(
        &self,
        send: cu::CUdeviceptr,
        recv: cu::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: cu::CUstream,
    ) -> Result<()> {
        make_current(&self.ctx)?;
        let mut state = self.lock_live()?;
        // SAFETY: forwarded from this function's contract.
        unsafe { self.enqueue_all_gather(&mut state, send, recv, count, dtype, stream, false) }
    }

    /// # Safety
    /// As for [`all_gather_raw`](Self::all_gather_raw).
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue_all_gather(
        &self,
        state: &mut State,
        send: cu::CUdeviceptr,
        recv: cu::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: cu::CUstream,
        in_group: bool,
    ) -> Result<()> {
        self.shared.call_locked(state, "ncclAllGather", in_group, |comm| {
            // SAFETY: `comm` is live (checked under the lock); buffers and stream are valid per
            // this function's contract.
            unsafe {
                sys::ncclAllGather(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    dtype.to_sys(),
                    comm,
                    stream as sys::cudaStream_t,
                )
            }
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Groups (several ranks driven by one thread)
// ---------------------------------------------------------------------------------------------

/// The open NCCL group of [`group`]: enqueue one collective per rank through it.
///
/// It holds every rank's lock, so no other thread can abort a communicator while NCCL holds
/// the group's pending operations.
#[derive(Debug)]
pub struct Group<'a> {
    ranks: &'a [&'a NcclRank],
    states: Vec<std::cell::RefCell<MutexGuard<'a, State>>>,
    failed: std::cell::Cell<bool>,
}

impl<'a> Group<'a> {
    fn slot(&self, i: usize) -> Result<(&'a NcclRank, std::cell::RefMut<'_, MutexGuard<'a, State>>)> {
        let rank = self
            .ranks
            .get(i)
            .ok_or_else(|| Error::InvalidArgument(format!("group has {} ranks, index {i} asked", self.ranks.len())))?;
        let state = self.states[i]
            .try_borrow_mut()
            .map_err(|_| Error::InvalidArgument(format!("group rank {i} is already borrowed")))?;
        Ok((rank, state))
    }

    /// [`NcclRank::all_reduce_sum_in_place`] on the group's rank `i` (index into the slice given
    /// to [`group`]).
    pub fn all_reduce_sum_in_place<T: NcclElement, B: DevicePtrMut<T>>(
        &self,
        i: usize,
        buf: &mut B,
        stream: &CudaStream,
    ) -> Result<()> {
        let (rank, mut state) = self.slot(i)?;
        let r = rank.all_reduce_locked(&mut state, buf, stream, true);
        self.failed.set(self.failed.get() || r.is_err());
        r
    }

    /// [`NcclRank::all_gather`] on the group's rank `i`.
    pub fn all_gather<T: NcclElement, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &self,
        i: usize,
        send: &S,
        recv: &mut R,
        stream: &CudaStream,
    ) -> Result<()> {
        let (rank, mut state) = self.slot(i)?;
        let r = rank.all_gather_locked(&mut state, send, recv, stream, true);
        self.failed.set(self.failed.get() || r.is_err());
        r
    }
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`, to drive several ranks of one
/// communicator from one thread (required after [`NcclRank::init_all`] when one thread issues
/// the collectives of every rank). If anything fails, every rank in `ranks` is aborted after
/// `ncclGroupEnd` (so none waits for the others) and the first error is returned.
///
/// Inside `f`, use only the [`Group`]'s methods: the group holds every listed rank's lock, so
/// calling the ranks' own methods (or aborting them) from `f` would deadlock. Other threads that
/// abort one of these ranks wait until the group is closed.
///
/// The group allocates one small vector (the rank locks); the collectives themselves do not.
pub fn group<R>(ranks: &[&NcclRank], f: impl FnOnce(&Group<'_>) -> Result<R>) -> Result<R> {
    ensure_libs()?;
    // Lock in address order so two threads grouping overlapping ranks cannot deadlock.
    let mut order: Vec<usize> = (0..ranks.len()).collect();
    order.sort_by_key(|&i| Arc::as_ptr(&ranks[i].shared) as usize);
    for w in order.windows(2) {
        if Arc::ptr_eq(&ranks[w[0]].shared, &ranks[w[1]].shared) {
            return Err(Error::InvalidArgument("a rank is listed twice in the group".into()));
        }
    }
    let mut guards: Vec<Option<MutexGuard<'_, State>>> = (0..ranks.len()).map(|_| None).collect();
    for &i in &order {
        guards[i] = Some(ranks[i].shared.lock());
    }
    let states: Vec<_> = guards.into_iter().flatten().map(std::cell::RefCell::new).collect();
    let g = Group { ranks, states, failed: std::cell::Cell::new(false) };

    // SAFETY: ncclGroupStart has no arguments; it opens this thread's group.
    let code = unsafe { sys::ncclGroupStart() };
    if !is_ok(code) {
        // SAFETY: null asks for the last global error.
        return Err(unsafe { nccl_error("ncclGroupStart", code, std::ptr::null_mut()) });
    }
    let result = f(&g);
    // The group must be closed whatever `f` did.
    // SAFETY: closes the group opened above; the communicators it references are live and
    // cannot be aborted meanwhile (their locks are held by `g`).
    let end = unsafe { sys::ncclGroupEnd() };
    let end_err = (!is_ok(end)).then(|| {
        // SAFETY: null asks for the last global error.
        unsafe { nccl_error("ncclGroupEnd", end, std::ptr::null_mut()) }
    });
    let failed = g.failed.get() || result.is_err() || end_err.is_some();
    if failed {
        let reason = match (&result, &end_err) {
            (Err(e), _) | (_, Some(e)) => format!("a grouped NCCL call failed: {e}"),
            _ => "a grouped NCCL call failed".into(),
        };
        for (rank, state) in g.ranks.iter().zip(&g.states) {
            if let Ok(mut state) = state.try_borrow_mut() {
                rank.shared.abort_locked(&mut state, reason.clone());
            }
        }
    }
    match (result, end_err) {
        (Err(e), _) => Err(e),
        (Ok(_), Some(e)) => Err(e),
        (Ok(r), None) => Ok(r),
    }
}

/// The NCCL library version, e.g. `22703` for 2.27.3.
pub fn nccl_version() -> Result<i32> {
    ensure_libs()?;
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer.
    let code = unsafe { sys::ncclGetVersion(&mut v) };
    if !is_ok(code) {
        // SAFETY: null asks for the last global error.
        return Err(unsafe { nccl_error("ncclGetVersion", code, std::ptr::null_mut()) });
    }
    Ok(v)
}
