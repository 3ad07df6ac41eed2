//! `std::sync::Barrier`, made abortable.
//!
//! `std::sync::Barrier` cannot be interrupted: a thread blocked in its `wait`
//! returns only when the round has `parties` arrivals. So aborting means
//! **completing the round with stand-ins** and then telling every party it
//! was aborted:
//!
//! * `state` holds a `POISONED` bit, a `SENSE` bit (the parity of the
//!   current round: it flips when a round's last party counts itself in) and
//!   `entries`, the number of arrivals at the current (incomplete) std round,
//!   modulo `parties`. A party enters with a CAS that fails if `POISONED` is
//!   set (then it returns `Aborted` without touching the std barrier), and
//!   otherwise counts itself in, noting the `SENSE` of the round it joined.
//! * `abort` sets `POISONED` with one `fetch_or`, which freezes `state` for
//!   good (every later CAS of `wait` fails), with `entries` at some `e`: no
//!   party can count itself in afterwards. Those `e` parties are between
//!   their CAS and (or inside) the std `wait`; the round needs `parties - e`
//!   more arrivals (none if `e == 0`). The aborting thread supplies them: it
//!   spawns `parties - e - 1` short-lived stand-in threads that each call the
//!   std `wait` once, and calls it once itself.
//! * After its std `wait` returns, a party reads `state`: `POISONED` set
//!   *and* the frozen `SENSE` equal to the one it noted means that its round
//!   is the one the stand-ins completed: `Aborted`, even if it was the std
//!   leader. Otherwise real parties completed its round: `Ok`.
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
//! Rounds are all-or-nothing under abort, as with
//! [`SpinParkBarrier`](super::SpinParkBarrier). Testing `POISONED` alone is
//! not enough: it would fail a party released by a round that completed
//! normally but that reads `state` only after a later abort (e.g. a peer that
//! leaves after its last round and aborts on its way out would fail the
//! others' last round). Why the parity test suffices: number the rounds by
//! tickets. A party's CAS takes ticket `t` (the arrivals counted before it)
//! and joins round `r = t / parties`; let `R` be the round the abort froze. With `parties` threads taking part (std's barrier assumes
//! as much):
//!
//! * `R >= r`: our CAS precedes the `fetch_or` in `state`'s order.
//! * `R <= r + 1`: round `r + 1` cannot fill while we have not left round
//!   `r`: before it completes, each of the other `parties - 1` threads holds
//!   at most one of its tickets, and we hold none.
//! * Std rounds are the ticket rounds: when the first ticket of round `k + 1`
//!   is taken, every call of rounds `<= k` has been made (its taker has left
//!   its previous wait, so at most `parties - 1` threads hold a ticket or
//!   wait, and `(k + 1)·parties` tickets exist), so neither a call of a later
//!   round nor a stand-in (they start after the freeze, after every ticket)
//!   can join an earlier std round.
//!
//! So the frozen `SENSE` equals a party's exactly when `R == r`: its round
//! was short of arrivals and the stand-ins completed it (`Aborted`, for every
//! party of it). When `R == r + 1` its round had all its real parties (`Ok`,
//! for every party of it, although the bit is set).
//!
//! Abort is a blocking call (it waits for the `e` counted parties
//! to reach the std barrier, which takes no longer than a few instructions
//! of theirs) that may start up to `parties - 2` threads. If the OS refuses
//! a thread, abort must not wait (a thread blocked in std's `wait` cannot
//! make the other arrivals, so it would never return): it records the
//! arrivals still owed and returns, and every later `abort` call retries
//! starting them. There is no timed wait: `std::sync::Barrier` has none. Use
//! [`SpinParkBarrier`](super::SpinParkBarrier) for deadlines, or abort from
//! a watchdog.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use super::{AbortableBarrier, BarrierError, BarrierWaitResult};

/// `state` bit: aborted.
const POISONED: usize = 0b01;
/// `state` bit: the parity of the current round.
const SENSE: usize = 0b10;
/// One arrival, in `state` (arrivals live in bits 2..).
const ENTRY_ONE: usize = 0b100;

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
    /// `entries << 2 | SENSE | POISONED`.
    state: CachePadded<AtomicUsize>,
    /// Arrivals at the aborted round that no stand-in has been started for
    /// yet (the OS refused a thread); later `abort` calls retry.
    owed: AtomicUsize,
    parties: usize,
}

/// Starts stand-ins: returns whether one was started (tests inject refusals).
type SpawnStandIn = dyn Fn(&Arc<std::sync::Barrier>) -> bool;

impl StdBarrier {
    /// A barrier for `parties` parties (`0` behaves like `1`, as in std).
    #[must_use]
    pub fn new(parties: usize) -> Self {
        let parties = parties.max(1);
        Self {
            inner: Arc::new(std::sync::Barrier::new(parties)),
            state: CachePadded::new(AtomicUsize::new(0)),
            owed: AtomicUsize::new(0),
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
    /// or before this party's round completed.
    pub fn wait(&self) -> Result<BarrierWaitResult, BarrierError> {
        let sense = self.enter()?;
        let result = self.inner.wait();
        self.leave(sense, result.is_leader())
    }

    /// Counts this party in to the current round; returns the round's sense.
    #[inline]
    fn enter(&self) -> Result<usize, BarrierError> {
        // Relaxed (load and CAS): `state` only decides whether we may enter
        // and counts us in; the data ordering of the rendezvous comes from
        // std's barrier (its mutex).
        let mut state = self.state.load(Ordering::Relaxed);
        loop {
            if state & POISONED != 0 {
                return Err(BarrierError::Aborted);
            }
            let sense = state & SENSE;
            let entries = state / ENTRY_ONE + 1;
            // The round's last party starts the next one: no entries, the
            // other sense.
            let next = if entries == self.parties { sense ^ SENSE } else { (entries * ENTRY_ONE) | sense };
            match self.state.compare_exchange_weak(state, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Ok(sense),
                Err(actual) => state = actual,
            }
        }
    }

    /// After std's `wait` returned: `Ok` unless this party's round (of sense
    /// `sense`) is the one an abort froze, which the stand-ins completed.
    #[inline]
    fn leave(&self, sense: usize, leader: bool) -> Result<BarrierWaitResult, BarrierError> {
        // Relaxed would do (a stand-in's arrival happens-after the abort's
        // fetch_or, and our release happens-after that arrival through std's
        // mutex, so coherence makes the frozen word visible; a round of real
        // parties needs no bit at all); Acquire also makes the aborter's
        // earlier writes visible. Once POISONED is set the word never changes
        // again, so its SENSE is the frozen round's.
        let state = self.state.load(Ordering::Acquire);
        if state & POISONED != 0 && state & SENSE == sense {
            return Err(BarrierError::Aborted);
        }
        Ok(BarrierWaitResult { leader })
    }

    /// Aborts the barrier, completing the current round with stand-ins (see
    /// the module docs). Blocks until that round has been completed; may
    /// start up to `parties - 2` short-lived threads. Never blocks forever:
    /// if the OS refuses a thread it returns at once, leaving the round's
    /// parties blocked until a later call starts the rest. Idempotent: only
    /// the first call aborts; later ones only retry those stand-ins.
    #[cold]
    pub fn abort(&self) {
        self.abort_with(&spawn_stand_in);
    }

    /// [`abort`](Self::abort), starting stand-ins with `spawn`.
    #[cold]
    fn abort_with(&self, spawn: &SpawnStandIn) {
        // AcqRel: Release so parties that see the bit see the aborter's
        // earlier writes. The RMW freezes `state`: every later CAS of `wait`
        // sees POISONED and backs off.
        let old = self.state.fetch_or(POISONED, Ordering::AcqRel);
        if old & POISONED != 0 {
            self.supply_owed(spawn);
            return;
        }
        let entries = old / ENTRY_ONE;
        if entries == 0 {
            // No one is in the current round: nothing to release.
            return;
        }
        let missing = self.parties - entries;
        let mut started = 0;
        while started + 1 < missing && spawn(&self.inner) {
            started += 1;
        }
        if started + 1 == missing {
            // This thread is the last stand-in: every other arrival has been
            // made or is on its way, so this returns promptly.
            let _ = self.inner.wait();
            return;
        }
        // The OS refused a thread. Calling std's `wait` here would never
        // return (a thread blocked in it cannot make the other arrivals), so
        // owe them all, this thread's included, and return: the round's
        // parties stay blocked until a later `abort` starts the rest.
        let owed = missing - started;
        tracing::error!(
            owed,
            "could not start barrier stand-in threads: the parties of the aborted round stay blocked until a \
             later abort() starts them"
        );
        // Relaxed: `owed` is a plain counter, no data is published through
        // it; RMWs of one atomic are totally ordered, so each owed arrival is
        // claimed by exactly one `supply_owed` and the round never gets more
        // than `parties` arrivals (a surplus stand-in would stay blocked).
        self.owed.fetch_add(owed, Ordering::Relaxed);
    }

    /// Starts the stand-ins an earlier abort could not, claiming one owed
    /// arrival at a time; gives it back and stops at the first refusal. Never
    /// calls std's `wait` itself, so it cannot block.
    #[cold]
    fn supply_owed(&self, spawn: &SpawnStandIn) {
        // Relaxed: see `abort_with`.
        while self.owed.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
            if !spawn(&self.inner) {
                self.owed.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }

    /// Whether the barrier has been aborted.
    #[must_use]
    pub fn is_aborted(&self) -> bool {
        // Acquire: pairs with the Release of `abort`.
        self.state.load(Ordering::Acquire) & POISONED != 0
    }
}

/// Starts one stand-in thread that calls `inner.wait()` once, retrying a
/// while if the OS refuses; returns whether it started.
#[cold]
fn spawn_stand_in(inner: &Arc<std::sync::Barrier>) -> bool {
    for attempt in 0..SPAWN_RETRIES {
        let inner = Arc::clone(inner);
        match std::thread::Builder::new().name("tp-barrier-stand-in".into()).spawn(move || {
            let _ = inner.wait();
        }) {
            Ok(_detached) => return true,
            Err(err) => {
                tracing::warn!(attempt, %err, "could not spawn a barrier stand-in thread; retrying");
                std::thread::sleep(SPAWN_RETRY_SLEEP);
            }
        }
    }
    false
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

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::thread;
    use std::time::{Duration, Instant};

    use super::*;

    /// Runs `f` on a thread; panics if it has not returned after `limit` (the
    /// thread is leaked: a regression fails instead of hanging the suite).
    fn within<R: Send + 'static>(limit: Duration, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(limit).unwrap_or_else(|_| panic!("still blocked after {limit:?} (hang?)"))
    }

    fn wait_for_entries(b: &StdBarrier, entries: usize) {
        let t0 = Instant::now();
        while b.state.load(Ordering::Relaxed) / ENTRY_ONE != entries {
            assert!(t0.elapsed() < Duration::from_secs(10), "parties did not arrive");
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// Both parties of a round have been released by std's barrier, then one
    /// of them aborts before the other has looked at `state` (a rank leaving
    /// after its last round): the other must still get `Ok`, as with the
    /// spin-park barrier.
    #[test]
    fn a_completed_round_stays_ok_after_a_later_abort() {
        let b = Arc::new(StdBarrier::new(2));
        let other = {
            let b = Arc::clone(&b);
            thread::spawn(move || {
                let sense = b.enter().unwrap();
                let leader = b.inner.wait().is_leader();
                (sense, leader)
            })
        };
        let sense = b.enter().unwrap();
        let leader = b.inner.wait().is_leader();
        let (other_sense, other_leader) = other.join().unwrap();
        assert_eq!(sense, other_sense);
        b.abort();
        assert!(b.is_aborted());
        assert_eq!(b.leave(sense, leader), Ok(BarrierWaitResult { leader }));
        assert_eq!(b.leave(other_sense, other_leader), Ok(BarrierWaitResult { leader: other_leader }));
        assert_eq!(b.wait(), Err(BarrierError::Aborted));
    }

    /// The aborted round itself (completed by stand-ins) fails for every
    /// party of it, over several earlier completed rounds (both senses).
    #[test]
    fn the_aborted_round_fails_for_all_its_parties() {
        for completed in 0..4 {
            let b = Arc::new(StdBarrier::new(3));
            let parties: Vec<_> = (0..2)
                .map(|_| {
                    let b = Arc::clone(&b);
                    thread::spawn(move || {
                        for _ in 0..completed {
                            b.wait().unwrap();
                        }
                        b.wait()
                    })
                })
                .collect();
            for _ in 0..completed {
                b.wait().unwrap();
            }
            wait_for_entries(&b, 2);
            within(Duration::from_secs(10), {
                let b = Arc::clone(&b);
                move || b.abort()
            });
            for p in parties {
                assert_eq!(p.join().unwrap(), Err(BarrierError::Aborted));
            }
        }
    }

    /// The OS refuses every stand-in thread: abort must return anyway (it
    /// used to call std's `wait` and block forever), and a later abort, with
    /// threads available again, releases the blocked party.
    #[test]
    fn abort_returns_when_no_stand_in_can_be_started() {
        let b = Arc::new(StdBarrier::new(3));
        let party = {
            let b = Arc::clone(&b);
            thread::spawn(move || b.wait())
        };
        wait_for_entries(&b, 1);
        within(Duration::from_secs(10), {
            let b = Arc::clone(&b);
            move || b.abort_with(&|_| false)
        });
        assert!(b.is_aborted());
        // Two arrivals owed: one stand-in, and the first aborter's own.
        assert_eq!(b.owed.load(Ordering::Relaxed), 2);
        assert!(!party.is_finished());
        // Still refused: nothing changes, nothing blocks.
        within(Duration::from_secs(10), {
            let b = Arc::clone(&b);
            move || b.abort_with(&|_| false)
        });
        assert_eq!(b.owed.load(Ordering::Relaxed), 2);
        // Threads again: a later abort (e.g. the TP group's `Drop`) pays.
        within(Duration::from_secs(10), {
            let b = Arc::clone(&b);
            move || b.abort()
        });
        assert_eq!(b.owed.load(Ordering::Relaxed), 0);
        let released = within(Duration::from_secs(10), move || party.join().unwrap());
        assert_eq!(released, Err(BarrierError::Aborted));
    }

    /// Only some stand-ins start: the started ones are not wasted, the
    /// remaining arrivals are owed, and the round completes once they start.
    #[test]
    fn partly_refused_stand_ins_are_completed_later() {
        let b = Arc::new(StdBarrier::new(5));
        let party = {
            let b = Arc::clone(&b);
            thread::spawn(move || b.wait())
        };
        wait_for_entries(&b, 1);
        // 4 arrivals missing: allow 2 stand-ins, then refuse.
        let allowed = AtomicUsize::new(2);
        let spawn = move |inner: &Arc<std::sync::Barrier>| {
            allowed.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok()
                && spawn_stand_in(inner)
        };
        within(Duration::from_secs(10), {
            let b = Arc::clone(&b);
            move || b.abort_with(&spawn)
        });
        assert_eq!(b.owed.load(Ordering::Relaxed), 2);
        within(Duration::from_secs(10), {
            let b = Arc::clone(&b);
            move || b.abort()
        });
        let released = within(Duration::from_secs(10), move || party.join().unwrap());
        assert_eq!(released, Err(BarrierError::Aborted));
    }
}
