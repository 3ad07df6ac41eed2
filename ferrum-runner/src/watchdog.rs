//! The watchdog of a multi-process TP rank: it aborts the rank's NCCL communicator when NCCL
//! reports an asynchronous error, or when a call into the rank makes no progress for the stall
//! timeout.
//!
//! Why: a rank whose peer *process* dies waits in its next collective for a peer that will
//! never come. Over NVLink or shared memory NCCL notices nothing (its kernels just spin), so
//! without this the rank would hang forever. The in-process group needs no watchdog: a rank
//! thread that fails poisons the group, which aborts every communicator at once.
//!
//! Progress is marked by the wrapped backend ([`Watched`]): when a call starts and after every
//! batch of device-chosen tokens; between calls, and while the caller's token callback runs,
//! the rank is idle and never aborted. Aborting the communicator makes its kernels exit, so the
//! blocked wait returns and the call fails with the communicator's error. The watchdog starts
//! before the rank's first collective (`open_process_rank`'s warm-up all-reduce). The
//! rendezvous before the NCCL init has its own timeout; the init itself has none (a known
//! limit of ferrum-nccl's `init_rank`: a rank that never joins leaves the others waiting).
//!
//! Limit: a whole call is one unit of progress, so the stall timeout must exceed the longest
//! legitimate prefill (the default, 120 s, is far above what a prompt takes on the supported
//! models: an 8k-token Llama-3-8B prompt takes 0.33 s on an H200).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferrum_nccl::NcclRank;

use crate::backend::{DecodeBackend, DeviceRun, DeviceSampling};
use crate::error::{Error, Result};

/// How often the watchdog looks.
const POLL: Duration = Duration::from_millis(50);

/// Default stall timeout: generous, since one call may legitimately take long (a prefill of a
/// long prompt on a large model); `FERRUM_TP_STALL_TIMEOUT_S` sets another.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(120);

/// `FERRUM_TP_STALL_TIMEOUT_S` (whole seconds, 1 ..= 86400), else [`DEFAULT_STALL_TIMEOUT`].
pub fn stall_timeout_from_env() -> Result<Duration> {
    let name = "FERRUM_TP_STALL_TIMEOUT_S";
    let v = std::env::var(name).ok();
    let secs =
        ferrum_cuda::plan::knob(name, v.as_deref(), 1, 86_400).map_err(|e| Error::InvalidInput(e.to_string()))?;
    Ok(secs.map_or(DEFAULT_STALL_TIMEOUT, |s| Duration::from_secs(s as u64)))
}

struct State {
    start: Instant,
    /// Milliseconds since `start` of the last progress mark of the running call, plus one;
    /// 0 while no call runs. Relaxed everywhere: it is a heuristic clock reading that publishes
    /// no other data, and a stale read only delays or advances the abort by one poll.
    busy_since: AtomicU64,
    /// Set by Drop to stop the thread (Relaxed: it publishes nothing; the join orders the rest).
    stop: AtomicBool,
}

impl State {
    fn mark(&self) {
        let ms = self.start.elapsed().as_millis() as u64 + 1;
        self.busy_since.store(ms, Ordering::Relaxed);
    }
}

/// Marks the running call idle when dropped (also on an error or a panic).
struct Busy<'a>(&'a State);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy_since.store(0, Ordering::Relaxed);
    }
}

/// Marks a call as running, progress now, until the guard drops.
fn busy(state: &State) -> Busy<'_> {
    state.mark();
    Busy(state)
}

/// The watchdog thread of one communicator. Stops (and is joined) when dropped.
pub struct Watchdog {
    state: Arc<State>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog").finish_non_exhaustive()
    }
}

impl Watchdog {
    /// Starts watching `comm`: it is aborted on an asynchronous error, or when a call marked
    /// with [`Watchdog::busy`] makes no progress for `stall`.
    pub fn start(comm: Arc<NcclRank>, stall: Duration) -> Result<Self> {
        let state =
            Arc::new(State { start: Instant::now(), busy_since: AtomicU64::new(0), stop: AtomicBool::new(false) });
        let s = state.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ferrum-watchdog-{}", comm.rank()))
            .spawn(move || watch(&s, &comm, stall))
            .map_err(|e| Error::Tp(format!("starting the watchdog thread: {e}")))?;
        Ok(Self { state, thread: Some(thread) })
    }

    /// Marks a call as running, progress now, until the guard drops.
    pub fn busy(&self) -> impl Sized + '_ {
        busy(&self.state)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            // The thread sleeps, polls and at most aborts the communicator once; it returns
            // within one poll after that. A panic in it is only logged (Drop never panics).
            if t.join().is_err() {
                tracing::warn!("the TP watchdog thread panicked");
            }
        }
    }
}

fn watch(s: &State, comm: &NcclRank, stall: Duration) {
    let stall_ms = stall.as_millis() as u64;
    while !s.stop.load(Ordering::Relaxed) {
        std::thread::sleep(POLL);
        if comm.is_aborted() {
            return; // nothing left to watch (an abort is permanent)
        }
        if let Err(e) = comm.check_async_error() {
            // check_async_error aborted the communicator already.
            tracing::warn!(rank = comm.rank(), error = %e, "NCCL reported an asynchronous error");
            return;
        }
        let since = s.busy_since.load(Ordering::Relaxed);
        if since != 0 {
            let now = s.start.elapsed().as_millis() as u64 + 1;
            if now.saturating_sub(since) > stall_ms {
                let why = format!("no progress for {} s: a peer rank may have died", stall.as_secs());
                tracing::warn!(rank = comm.rank(), "{why}: aborting the communicator");
                comm.abort(&why);
                return;
            }
        }
    }
}

/// A backend of a multi-process rank with its watchdog.
pub struct Watched<B: DecodeBackend> {
    /// `Some` until dropped: the backend goes first (its captured graphs included: an
    /// `ncclCommAbort` in progress on the watchdog thread may wait for them), then the
    /// watchdog is joined.
    inner: Option<B>,
    dog: Watchdog,
}

impl<B: DecodeBackend> std::fmt::Debug for Watched<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched").field("backend", &self.inner.as_ref().map(|b| b.describe())).finish_non_exhaustive()
    }
}

impl<B: DecodeBackend> Watched<B> {
    /// Wraps `inner`, whose collectives the (already started) `dog` watches.
    pub fn new(inner: B, dog: Watchdog) -> Self {
        Self { inner: Some(inner), dog }
    }

    /// The backend and the watchdog's clock (`inner` is `None` only inside Drop).
    fn parts(&mut self) -> Result<(&mut B, &Arc<State>)> {
        match self.inner.as_mut() {
            Some(b) => Ok((b, &self.dog.state)),
            None => Err(Error::Tp("the backend was dropped".into())),
        }
    }

    fn inner(&self) -> Option<&B> {
        self.inner.as_ref()
    }
}

impl<B: DecodeBackend> Drop for Watched<B> {
    fn drop(&mut self) {
        // The backend first; the watchdog is joined when `dog` drops after this.
        drop(self.inner.take());
    }
}

impl<B: DecodeBackend> DecodeBackend for Watched<B> {
    fn vocab_size(&self) -> usize {
        self.inner().map_or(0, B::vocab_size)
    }

    fn prefill(&mut self, tokens: &[u32], capacity: usize) -> Result<Vec<f32>> {
        let (b, s) = self.parts()?;
        let _busy = busy(s);
        b.prefill(tokens, capacity)
    }

    fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        let (b, s) = self.parts()?;
        let _busy = busy(s);
        b.step(token)
    }

    fn describe(&self) -> String {
        self.inner().map_or_else(String::new, B::describe)
    }

    fn profile_step(&mut self, token: u32) -> Result<Option<Vec<(&'static str, f64)>>> {
        let (b, s) = self.parts()?;
        let _busy = busy(s);
        b.profile_step(token)
    }

    fn profile_prefill(&mut self, tokens: &[u32], capacity: usize) -> Result<Option<Vec<(&'static str, f64)>>> {
        let (b, s) = self.parts()?;
        let _busy = busy(s);
        b.profile_prefill(tokens, capacity)
    }

    fn has_device_decode(&self) -> bool {
        self.inner().is_some_and(B::has_device_decode)
    }

    fn set_screened_head(&mut self, on: bool) -> Result<bool> {
        let (b, s) = self.parts()?;
        let _busy = busy(s);
        b.set_screened_head(on)
    }

    fn prepare(&mut self) -> Result<()> {
        let (b, s) = self.parts()?;
        let _busy = busy(s);
        b.prepare()
    }

    fn decode_on_device(
        &mut self,
        token: u32,
        max_steps: usize,
        sampling: DeviceSampling,
        on_token: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<DeviceRun> {
        let (b, s) = self.parts()?;
        let _busy = busy(s);
        // Each batch of tokens read back is progress; the caller's callback is not the rank's
        // time (a slow consumer must not look like a stall).
        let mut marked = |t: u32| {
            s.busy_since.store(0, Ordering::Relaxed);
            let r = on_token(t);
            s.mark();
            r
        };
        b.decode_on_device(token, max_steps, sampling, &mut marked)
    }
}

#[cfg(test)]
mod tests {
    use super::{stall_timeout_from_env, DEFAULT_STALL_TIMEOUT};
    use std::time::Duration;

    /// `FERRUM_TP_STALL_TIMEOUT_S`: whole seconds in 1 ..= 86400, unset means the default;
    /// zero, negative, fractional, non-numeric and too large values are errors naming the
    /// variable. One test, as it sets the process's environment.
    #[test]
    fn stall_timeout_knob() {
        let var = "FERRUM_TP_STALL_TIMEOUT_S";
        std::env::remove_var(var);
        assert_eq!(stall_timeout_from_env().unwrap(), DEFAULT_STALL_TIMEOUT);
        std::env::set_var(var, "5");
        assert_eq!(stall_timeout_from_env().unwrap(), Duration::from_secs(5));
        for bad in ["0", "-1", "1.5", "abc", "", "86401"] {
            std::env::set_var(var, bad);
            let e = stall_timeout_from_env().expect_err(bad).to_string();
            assert!(e.contains(var), "{bad:?}: {e}");
        }
        std::env::remove_var(var);
    }
}
