//! `std::sync::Barrier`, made abortable.
//!
//! `std::sync::Barrier` cannot be interrupted: a thread blocked in its `wait`
//! returns only when the round has `parties` arrivals. So aborting means
//! **completing the round with stand-ins** and then telling every party it
//! was aborted:
//!
//! * `state` holds a `POISONED` bit and `entries`, the number of arrivals at
//!   the current (incomplete) std round, modulo `parties`. A party enters with
//!   a CAS that fails if `POISONED` is set (then it returns `Aborted` without
//!   touching the std barrier), and otherwise counts itself in.
//! * `abort` sets `POISONED` with one `fetch_or`, which freezes `entries` at
//!   some `e`: no party can count itself in afterwards. Those `e` parties are
//!   between their CAS and (or inside) the std `wait`; the round needs
//!   `parties - e` more arrivals (none if `e == 0`). The aborting thread
//!   supplies them: it spawns `parties - e - 1` short-lived stand-in threads
//!   that each call the std `wait` once, and calls it once itself.
//! * After its std `wait` returns, a party checks `POISONED`: set means
//!   `Aborted`, even if it was the std leader.
//!
//! Why this releases everybody: every party that counted itself in calls the
//! std `wait` exactly once, with no user code in between, and so does every
//! stand-in. Since rounds of std's barrier are formed by consecutive groups
//! of `parties` calls, and the total number of calls ever made is a multiple
//! of `parties` (`k·parties + e` by the counted parties, `parties - e` by the
//! stand-ins), every round fills and every call returns. The stand-ins
//! arrive after the `fetch_or`, so whoever shares a round with a stand-in
//! sees `POISONED` once released (std's internal mutex orders the stand-in's
//! arrival before the release); a party never passes a round that a
//! stand-in completed with `Ok`.
//!
//! Unlike [`SpinParkBarrier`](super::SpinParkBarrier), rounds are not
//! all-or-nothing under abort: a party released by a round that completed
//! normally, but that checks `POISONED` only after the abort, also returns
//! `Aborted`. That is conservative (it never reports `Ok` for a round that a
//! stand-in completed) and enough to never hang.
//!
//! Abort is a blocking call (it waits for the `e` counted parties
//! to reach the std barrier, which takes no longer than a few instructions
//! of theirs) that may start up to `parties - 2` threads. There is no timed
//! wait: `std::sync::Barrier` has none. Use [`SpinParkBarrier`](super::SpinParkBarrier)
//! for deadlines, or abort from a watchdog.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use super::{AbortableBarrier, BarrierError, BarrierWaitResult};

/// `state` bit: aborted.
const POISONED: usize = 1;
/// One arrival, in `state` (arrivals live in bits 1..).
const ENTRY_ONE: usize = 2;

/// How often a stand-in thread spawn is retried, and how long to sleep in
/// between, before giving up (the OS being out of threads).
const SPAWN_RETRIES: u32 = 100;
const SPAWN_RETRY_SLEEP: std::time::Duration = std::time::Duration::from_millis(10);

/// [`std::sync::Barrier`] plus abort: rounds go through the std barrier;
/// [`abort`](Self::abort) completes the current round with stand-ins and
/// makes every current and future wait return [`BarrierError::Aborted`]. See
/// the [module docs](self) for the protocol.
#[derive(Debug)]
pub struct StdBarrier {
    inner: Arc<std::sync::Barrier>,
    /// `entries << 1 | POISONED`.
    state: CachePadded<AtomicUsize>,
    parties: usize,
}

impl StdBarrier {
    /// A barrier for `parties` parties (`0` behaves like `1`, as in std).
    #[must_use]
    pub fn new(parties: usize) -> Self {
        let parties = parties.max(1);
        Self {
            inner: Arc::new(std::sync::Barrier::new(parties)),
            state: CachePadded::new(AtomicUsize::new(0)),
            parties,
        }
    }

    /// The number of parties a round waits for.
    #[must_use]
    pub fn parties(&self) -> usize {
        self.parties
    }

    /// Blocks until all parties have arrived (through
    /// `std::sync::Barrier::wait`).
    ///
    /// # Errors
    /// [`BarrierError::Aborted`] if the barrier was aborted before the call,
    /// or before this party was released.
    pub fn wait(&self) -> Result<BarrierWaitResult, BarrierError> {
        // Relaxed (load and CAS): `state` only decides whether we may enter
        // and counts us in; the data ordering of the rendezvous comes from
        // std's barrier (its mutex).
        let mut state = self.state.load(Ordering::Relaxed);
        loop {
            if state & POISONED != 0 {
                return Err(BarrierError::Aborted);
            }
            let entries = state / ENTRY_ONE + 1;
            let next = if entries == self.parties { 0 } else { entries * ENTRY_ONE };
            match self.state.compare_exchange_weak(state, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break,
                Err(actual) => state = actual,
            }
        }
        let result = self.inner.wait();
        // Relaxed would do (a stand-in's arrival happens-after the abort's
        // fetch_or, and our release happens-after that arrival through std's
        // mutex, so coherence makes the bit visible); Acquire also makes the
        // aborter's earlier writes visible.
        if self.state.load(Ordering::Acquire) & POISONED != 0 {
            return Err(BarrierError::Aborted);
        }
        Ok(BarrierWaitResult { leader: result.is_leader() })
    }

    /// Aborts the barrier, completing the current round with stand-ins (see
    /// the module docs). Blocks until that round has been completed; may
    /// start up to `parties - 2` short-lived threads. Idempotent: only the
    /// first call does anything.
    #[cold]
    pub fn abort(&self) {
        // AcqRel: Release so parties that see the bit see the aborter's
        // earlier writes. The RMW freezes `entries`: every later CAS of
        // `wait` sees POISONED and backs off.
        let old = self.state.fetch_or(POISONED, Ordering::AcqRel);
        if old & POISONED != 0 {
            return;
        }
        let entries = old / ENTRY_ONE;
        if entries == 0 {
            // No one is in the current round: nothing to release.
            return;
        }
        let missing = self.parties - entries;
        for _ in 1..missing {
            self.spawn_stand_in();
        }
        // This thread is the last stand-in.
        let _ = self.inner.wait();
    }

    #[cold]
    fn spawn_stand_in(&self) {
        for attempt in 0..SPAWN_RETRIES {
            let inner = Arc::clone(&self.inner);
            match std::thread::Builder::new().name("tp-barrier-stand-in".into()).spawn(move || {
                let _ = inner.wait();
            }) {
                Ok(_detached) => return,
                Err(err) => {
                    tracing::warn!(attempt, %err, "could not spawn a barrier stand-in thread; retrying");
                    std::thread::sleep(SPAWN_RETRY_SLEEP);
                }
            }
        }
        tracing::error!("could not spawn a barrier stand-in thread: parties blocked in the aborted round stay blocked");
    }

    /// Whether the barrier has been aborted.
    #[must_use]
    pub fn is_aborted(&self) -> bool {
        // Acquire: pairs with the Release of `abort`.
        self.state.load(Ordering::Acquire) & POISONED != 0
    }
}

impl AbortableBarrier for StdBarrier {
    fn with_parties(parties: usize) -> Self {
        Self::new(parties)
    }

    fn parties(&self) -> usize {
        StdBarrier::parties(self)
    }

    fn wait(&self) -> Result<BarrierWaitResult, BarrierError> {
        StdBarrier::wait(self)
    }

    fn abort(&self) {
        StdBarrier::abort(self);
    }

    fn is_aborted(&self) -> bool {
        StdBarrier::is_aborted(self)
    }
}
