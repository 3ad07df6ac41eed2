//! The spin-then-park sense-reversing barrier.
//!
//! # Protocol
//!
//! This is the centralised sense-reversing barrier of Mellor-Crummey & Scott
//! ("Algorithms for scalable synchronization on shared-memory
//! multiprocessors", 1991, fig. 8), with a bounded spin, then a park.
//!
//! State, each on its own cache line ([`CachePadded`]):
//!
//! * `count`: how many parties have arrived at the current round;
//! * `state`: one word holding the *global sense*, widened to a generation
//!   counter (bits 2.., the classic sense bit is the generation's low bit),
//!   plus two flags: `PARKED` (bit 1: some party of the current round may be
//!   asleep) and `POISONED` (bit 0: aborted, for good).
//!
//! A party's *local sense* is the generation it is waiting to see replaced.
//! MCS keep it in a thread-local and flip it on each arrival; here `wait` takes
//! `&self` (like `std::sync::Barrier`), so the party reads it from `state` on
//! entry instead. That read is exact: the generation cannot move between the
//! read and the party's own arrival, because the round cannot complete without
//! that arrival (and the party observed the previous generation when it left
//! the previous round).
//!
//! `wait()`:
//!
//! 1. Read `state`. Poisoned: fail at once. Otherwise `gen` := its generation.
//! 2. `count.fetch_add(1)`. The party that brings it to `parties` is the
//!    **leader** (the last arriver, as in std). It resets `count` to 0, then
//!    publishes generation `gen + 1` with a CAS on `state` that also clears
//!    `PARKED` — unless `POISONED` is set, in which case the round never
//!    completes and the leader fails like everyone else. If the CAS replaced a
//!    word with `PARKED` set, the leader takes the park mutex and
//!    `notify_all`s the condition variable of `gen`'s sense.
//! 3. Everyone else waits for the generation to move:
//!    * **spin**: re-read `state` up to `spin_checks` times, with a bounded
//!      exponential backoff of `spin_loop` hints between reads
//!      (1, 2, 4, … capped at `spin_hints_cap` hints, [`SPIN_BACKOFF_CAP`]
//!      by default);
//!    * **yield**: up to `yield_checks` more reads, each after a
//!      `thread::yield_now()`;
//!    * **park** (`#[cold]`): take the park mutex, CAS `PARKED` into `state`
//!      *if the generation is still `gen` and not poisoned*, then wait on the
//!      condition variable of `gen`'s sense, re-checking `state` after each
//!      wake-up (spurious or not).
//!
//!    Whenever the waiter sees the generation moved it returns `Ok` (not
//!    leader); if it sees `POISONED` with the generation unmoved it returns
//!    `Err(Aborted)`. The generation is tested first, so a round either
//!    completes for all its parties or for none (see *Abort*).
//!
//! ## Why no wake-up is lost
//!
//! A lost wake-up would be a waiter asleep on the condition variable of round
//! `gen` after the leader of `gen` finished notifying. A parker decides to
//! sleep while holding the park mutex, on reading a value `V` of `state` that
//! shows generation `gen`, unpoisoned, with `PARKED` set (by its own CAS, or
//! by an earlier parker of the same round), and it keeps the mutex until
//! `Condvar::wait` releases it and enqueues it, atomically.
//!
//! `state` is a single atomic word, so its writes are totally ordered
//! (modification order) and every read-modify-write reads the value just
//! before it in that order. Only the leader's CAS `L` moves the generation,
//! so `V` precedes `L`. Between the write of `PARKED` and `L` only
//! read-modify-writes that keep the bit can occur (other parkers' CASes,
//! `abort`'s `fetch_or`), so `L` reads a word with `PARKED` set, and the
//! leader will lock the park mutex and `notify_all`. Could the leader hold
//! the mutex *before* the parker took it? Then `L` (before the leader's
//! unlock in program order) happens-before the parker's read, and by
//! coherence the parker would have read `L`'s value or a later one, not `V`.
//! So the leader locks only after the parker has released the mutex, which it
//! does only by being enqueued in `Condvar::wait`: `notify_all` finds it
//! there.
//!
//! The same argument, with `abort`'s `fetch_or` (or a deadline's poisoning
//! CAS) in place of `L`, shows an abort cannot be missed either: the aborter
//! always takes the mutex and notifies both condition variables.
//!
//! After waking, the parker re-reads `state` under the mutex. The leader's
//! CAS happens-before its unlock, which happens-before the parker's
//! re-acquisition, so the parker sees the new generation and returns.
//!
//! *Exactly* the parked threads of round `gen` are woken: they all wait on
//! `condvars[sense(gen)]`. A fast party that has already left round `gen` and
//! parks in round `gen + 1` waits on the other condition variable, so the
//! leader of `gen` does not wake it, and the leader of `gen + 1` will (it sets
//! `PARKED` afresh: the leader of `gen` cleared it in the same CAS that
//! published `gen + 1`). Two rounds cannot share a condition variable while
//! either has sleepers, since round `gen + 2` cannot start before round
//! `gen + 1` completes.
//!
//! ## Abort
//!
//! [`abort`](SpinParkBarrier::abort) does `state.fetch_or(POISONED)`, then
//! takes the park mutex and notifies both condition variables. By the same
//! argument as above, a parker either sees `POISONED` in its CAS (and returns)
//! or is enqueued before the notify. Spinners see the bit on their next read.
//! Future waiters see it on entry.
//!
//! Once `POISONED` is set the leader's CAS refuses to publish a new
//! generation. So each round is all-or-nothing: if the leader's CAS precedes
//! the `fetch_or` in `state`'s order, every party of the round sees the new
//! generation and returns `Ok` (a waiter checks the generation before the
//! poison bit); otherwise the generation never moves and every party returns
//! `Err(Aborted)`.
//!
//! ## Deadlines
//!
//! [`wait_deadline`](SpinParkBarrier::wait_deadline): when the deadline passes,
//! the waiter does a CAS that sets `POISONED` only if the generation is still
//! `gen`. If the round completed first, the CAS fails and the wait returns
//! `Ok` after all; otherwise the waiter has aborted the barrier and returns
//! [`BarrierError::TimedOut`], and everybody else gets `Aborted`. A timed-out
//! party has already arrived, and it cannot take its arrival back without
//! racing the leader; a round missing a party could never complete anyway, so
//! aborting is the only answer that never hangs the others.
//!
//! ## Memory ordering
//!
//! Each arrival is a `Release` RMW on `count` (it is `AcqRel`), and the
//! leader's arrival is the last RMW of the round, so by release sequences the
//! leader *acquires* everything every party wrote before calling `wait`. The
//! leader's publishing CAS is `Release`, and every waiter leaves only after an
//! `Acquire` read of the new generation (or through the park mutex, ordered
//! after that CAS). Hence everything any party wrote before the barrier
//! happens-before everything any party does after it: `wait` is a full
//! rendezvous, as the TP group relies on for passing parameters through
//! relaxed atomics.

use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use super::{AbortableBarrier, BarrierError, BarrierWaitResult};
use crate::loom::sync::atomic::{AtomicUsize, Ordering};
use crate::loom::sync::{Condvar, Mutex, MutexGuard};
use crate::loom::{available_cores, hint, thread};

/// `state` bit: the barrier has been aborted (or a deadline expired).
const POISONED: usize = 0b01;
/// `state` bit: a party of the current generation may be parked.
const PARKED: usize = 0b10;
/// One generation, in `state` (the generation lives in bits 2..).
const GEN_ONE: usize = 0b100;
/// Mask of the generation bits of `state`.
const GEN_MASK: usize = !(POISONED | PARKED);

/// Spin phase: re-reads of `state` before yielding (parties ≤ cores).
///
/// Tuned with `benches/barrier.rs` (see the README's table). With 2 parties
/// on 2 free cores a round takes ~200 ns, far inside the spin phase
/// (16 reads, 1 + 2 + 4 + 13 × 8 = 111 `spin_loop` hints, a few µs). A
/// longer phase (64 reads, cap 16: ~1 k hints) bought nothing on free cores
/// but made rounds ~6× slower (22 µs vs 3.7 µs, std: 9.5 µs) when other
/// processes loaded the cores: a spinner whose partner has been descheduled
/// burns its own time slice before yielding to it.
pub const SPIN_CHECKS: u32 = 16;
/// Spin phase: the cap of the exponential backoff, in `spin_loop` hints
/// between two reads. Small, so a release is noticed within ~a hundred
/// cycles even late in the spin phase.
pub const SPIN_BACKOFF_CAP: u32 = 8;
/// Yield phase: re-reads of `state`, each after `thread::yield_now()`, before
/// parking. Yielding hands the core to a party that is runnable but not
/// running, which is what an oversubscribed barrier needs.
pub const YIELD_CHECKS: u32 = 16;

/// How long a waiter spins and yields before it parks.
///
/// The default ([`BackoffPolicy::for_parties`]) spins only when every party
/// can have a core of its own: when parties outnumber cores, a spinner burns
/// the very core that a party it waits for needs, so it only yields, then
/// parks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackoffPolicy {
    /// Reads of the barrier state, with a bounded exponential backoff of
    /// `spin_loop` hints between them, before the yield phase.
    pub spin_checks: u32,
    /// Cap of the exponential backoff between two spin-phase reads, in
    /// `spin_loop` hints (1, 2, 4, … up to this).
    pub spin_hints_cap: u32,
    /// Reads of the barrier state, each after `thread::yield_now()`, before
    /// parking.
    pub yield_checks: u32,
}

impl BackoffPolicy {
    /// Spin, then yield, then park: for parties ≤ cores.
    pub const SPIN: Self =
        Self { spin_checks: SPIN_CHECKS, spin_hints_cap: SPIN_BACKOFF_CAP, yield_checks: YIELD_CHECKS };

    /// Yield, then park (no spinning): for more parties than cores.
    pub const OVERSUBSCRIBED: Self =
        Self { spin_checks: 0, spin_hints_cap: SPIN_BACKOFF_CAP, yield_checks: YIELD_CHECKS };

    /// Park at once: lowest CPU use, highest latency.
    pub const PARK: Self = Self { spin_checks: 0, spin_hints_cap: SPIN_BACKOFF_CAP, yield_checks: 0 };

    /// Reads of the barrier state (spin, then yield) before a waiter parks.
    /// Saturating: the fields are public, so `u32::MAX` in both must mean
    /// "practically never park", not an overflow (a panic in debug builds, a
    /// wrapped-around "park at once" in release ones).
    #[inline]
    pub(crate) fn park_after(&self) -> u32 {
        self.spin_checks.saturating_add(self.yield_checks)
    }

    /// [`SPIN`](Self::SPIN) if `parties` ≤ the cores available to this
    /// process, else [`OVERSUBSCRIBED`](Self::OVERSUBSCRIBED).
    #[must_use]
    pub fn for_parties(parties: usize) -> Self {
        if cfg!(loom) {
            // Keep the model small: one spin read, then park.
            Self { spin_checks: 1, spin_hints_cap: 1, yield_checks: 0 }
        } else if parties <= available_cores() {
            Self::SPIN
        } else {
            Self::OVERSUBSCRIBED
        }
    }
}

/// A sense-reversing barrier whose waiters spin, then yield, then park, and
/// which can be aborted. See the [module docs](self) for the protocol and its
/// correctness argument.
///
/// ```
/// use std::sync::Arc;
/// use ferrum_tp::SpinParkBarrier;
///
/// let barrier = Arc::new(SpinParkBarrier::new(3));
/// let handles: Vec<_> = (0..3)
///     .map(|_| {
///         let b = Arc::clone(&barrier);
///         std::thread::spawn(move || b.wait().map(|r| r.is_leader()))
///     })
///     .collect();
/// let leaders = handles
///     .into_iter()
///     .map(|h| h.join().unwrap().unwrap())
///     .filter(|&leader| leader)
///     .count();
/// assert_eq!(leaders, 1);
/// ```
#[derive(Debug)]
pub struct SpinParkBarrier {
    /// Arrivals at the current round.
    count: CachePadded<AtomicUsize>,
    /// Generation (the global sense) | `PARKED` | `POISONED`.
    state: CachePadded<AtomicUsize>,
    parties: usize,
    backoff: BackoffPolicy,
    /// Serialises "decide to sleep" against "notify" (see the module docs).
    park_lock: Mutex<()>,
    /// Parked waiters of a round wait on the condition variable of the
    /// round's sense (generation parity).
    condvars: [Condvar; 2],
}

#[inline]
fn generation(state: usize) -> usize {
    state & GEN_MASK
}

#[inline]
fn sense(gen: usize) -> usize {
    (gen / GEN_ONE) & 1
}

impl SpinParkBarrier {
    /// A barrier for `parties` parties (`0` behaves like `1`, as in std), with
    /// the backoff policy [`BackoffPolicy::for_parties`].
    #[must_use]
    pub fn new(parties: usize) -> Self {
        Self::with_backoff(parties, BackoffPolicy::for_parties(parties))
    }

    /// A barrier for `parties` parties with an explicit backoff policy.
    #[must_use]
    pub fn with_backoff(parties: usize, backoff: BackoffPolicy) -> Self {
        Self {
            count: CachePadded::new(AtomicUsize::new(0)),
            state: CachePadded::new(AtomicUsize::new(0)),
            parties: parties.max(1),
            backoff,
            park_lock: Mutex::new(()),
            condvars: [Condvar::new(), Condvar::new()],
        }
    }

    /// The number of parties a round waits for.
    #[must_use]
    pub fn parties(&self) -> usize {
        self.parties
    }

    /// The backoff policy in use.
    #[must_use]
    pub fn backoff(&self) -> BackoffPolicy {
        self.backoff
    }

    /// Blocks until all parties have arrived, then returns; the last arriver
    /// is the leader.
    ///
    /// # Errors
    /// [`BarrierError::Aborted`] if the barrier is aborted before this round
    /// completes (or was aborted before the call).
    #[inline]
    pub fn wait(&self) -> Result<BarrierWaitResult, BarrierError> {
        self.wait_inner(None)
    }

    /// Like [`wait`](Self::wait), but gives up at `deadline`.
    ///
    /// # Errors
    /// [`BarrierError::TimedOut`] if the deadline passed first: **the barrier
    /// is then aborted** (the other parties get [`BarrierError::Aborted`]),
    /// because a party that has arrived cannot withdraw without racing the
    /// round's completion. [`BarrierError::Aborted`] as for `wait`.
    pub fn wait_deadline(&self, deadline: Instant) -> Result<BarrierWaitResult, BarrierError> {
        self.wait_inner(Some(deadline))
    }

    /// [`wait_deadline`](Self::wait_deadline) with a deadline `timeout` from
    /// now.
    ///
    /// # Errors
    /// As [`wait_deadline`](Self::wait_deadline).
    pub fn wait_timeout(&self, timeout: Duration) -> Result<BarrierWaitResult, BarrierError> {
        match Instant::now().checked_add(timeout) {
            Some(deadline) => self.wait_inner(Some(deadline)),
            None => self.wait_inner(None),
        }
    }

    /// Aborts the barrier: every party blocked in a wait, and every later
    /// wait, returns [`BarrierError::Aborted`]. Idempotent.
    #[cold]
    pub fn abort(&self) {
        // AcqRel: Release so that whatever the aborting thread wrote before
        // (e.g. the reason it aborted) is visible to waiters that observe the
        // bit with an Acquire load; Acquire is not needed but harmless. The
        // RMW also places the abort in `state`'s total order, which the
        // all-or-nothing argument (module docs) relies on.
        let old = self.state.fetch_or(POISONED, Ordering::AcqRel);
        if old & POISONED == 0 {
            self.wake_all();
        }
    }

    /// Whether the barrier has been aborted.
    #[must_use]
    pub fn is_aborted(&self) -> bool {
        // Acquire: pairs with the Release of `abort`, so a caller that sees
        // the bit also sees what the aborter wrote before aborting.
        self.state.load(Ordering::Acquire) & POISONED != 0
    }

    #[inline]
    fn wait_inner(&self, deadline: Option<Instant>) -> Result<BarrierWaitResult, BarrierError> {
        // Relaxed: we only need this party's own current generation, which
        // cannot change before our arrival below (the round cannot complete
        // without it), and which we already observed — with Acquire — when we
        // left the previous round (or got the barrier through a spawn/Arc,
        // which happens-after its construction). A stale POISONED-clear read
        // is harmless: the leader's CAS re-checks the bit.
        let state = self.state.load(Ordering::Relaxed);
        if state & POISONED != 0 {
            return Err(BarrierError::Aborted);
        }
        let gen = generation(state);

        // AcqRel: Release publishes this party's pre-barrier writes into the
        // release sequence of `count`; Acquire lets the leader (the last RMW of
        // the round) synchronise with every earlier arrival of the round.
        let arrived = self.count.fetch_add(1, Ordering::AcqRel) + 1;
        if arrived >= self.parties {
            self.lead(gen)
        } else {
            self.follow(gen, deadline)
        }
    }

    /// The last arriver: reset the count and publish the next generation.
    #[inline]
    fn lead(&self, gen: usize) -> Result<BarrierWaitResult, BarrierError> {
        // Relaxed: ordered before the Release CAS below, and every party's
        // next arrival happens after its Acquire observation of that CAS.
        self.count.store(0, Ordering::Relaxed);
        let next = generation(gen.wrapping_add(GEN_ONE));
        // Relaxed: the CAS below re-reads the value anyway.
        let mut current = self.state.load(Ordering::Relaxed);
        loop {
            if current & POISONED != 0 {
                // Aborted before the round completed: it never will.
                return Err(BarrierError::Aborted);
            }
            // Success Release: publishes the round (every party's writes,
            // acquired through `count`) and the count reset to the waiters'
            // Acquire reads. Failure Relaxed: we retry with the fresh value
            // (only PARKED or POISONED can have changed, the generation is
            // ours to move).
            match self.state.compare_exchange_weak(current, next, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => break,
                Err(actual) => current = actual,
            }
        }
        if current & PARKED != 0 {
            self.wake(sense(gen));
        }
        Ok(BarrierWaitResult { leader: true })
    }

    /// A non-leader: spin, yield, then park until the generation moves.
    #[inline]
    fn follow(&self, gen: usize, deadline: Option<Instant>) -> Result<BarrierWaitResult, BarrierError> {
        let policy = self.backoff;
        let park_after = policy.park_after();
        let mut check = 0u32;
        loop {
            // Acquire: pairs with the leader's Release CAS, so that a party
            // that sees the round complete sees everything written before it.
            let state = self.state.load(Ordering::Acquire);
            if generation(state) != gen {
                return Ok(BarrierWaitResult { leader: false });
            }
            if state & POISONED != 0 {
                return Err(BarrierError::Aborted);
            }
            if let Some(deadline) = deadline {
                if Instant::now() >= deadline {
                    return self.time_out(gen);
                }
            }
            if check < policy.spin_checks {
                let hints = (1u32 << check.min(31)).min(policy.spin_hints_cap);
                for _ in 0..hints {
                    hint::spin_loop();
                }
            } else if check < park_after {
                thread::yield_now();
            } else {
                return self.park(gen, deadline);
            }
            // No overflow: `check < park_after <= u32::MAX` here (else we parked).
            check += 1;
        }
    }

    /// Sleep on the condition variable of `gen`'s sense until the generation
    /// moves, the barrier is aborted, or the deadline passes.
    #[cold]
    #[inline(never)]
    fn park(&self, gen: usize, deadline: Option<Instant>) -> Result<BarrierWaitResult, BarrierError> {
        let mut guard = self.lock();
        // Acquire (load and CAS failure): a value showing the generation moved
        // must carry the round's writes, as in `follow`.
        let mut state = self.state.load(Ordering::Acquire);
        loop {
            if generation(state) != gen {
                return Ok(BarrierWaitResult { leader: false });
            }
            if state & POISONED != 0 {
                return Err(BarrierError::Aborted);
            }
            if state & PARKED != 0 {
                break;
            }
            // Success Acquire (Relaxed would do: the lost-wake-up argument
            // rests on the RMW order of `state` and on the park mutex, not on
            // this ordering; Acquire keeps the failure ordering legal on every
            // toolchain and loom).
            match self.state.compare_exchange_weak(state, state | PARKED, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => break,
                Err(actual) => state = actual,
            }
        }
        let condvar = &self.condvars[sense(gen)];
        loop {
            guard = match deadline {
                None => condvar.wait(guard).unwrap_or_else(std::sync::PoisonError::into_inner),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        drop(guard);
                        return self.time_out(gen);
                    }
                    condvar.wait_timeout(guard, deadline - now).unwrap_or_else(std::sync::PoisonError::into_inner).0
                }
            };
            // Acquire: as in `follow`. Under the mutex, so this read is
            // ordered after any notify that woke us.
            let state = self.state.load(Ordering::Acquire);
            if generation(state) != gen {
                return Ok(BarrierWaitResult { leader: false });
            }
            if state & POISONED != 0 {
                return Err(BarrierError::Aborted);
            }
        }
    }

    /// The deadline passed while waiting for `gen` to complete: abort the
    /// barrier unless the round completed first.
    #[cold]
    #[inline(never)]
    fn time_out(&self, gen: usize) -> Result<BarrierWaitResult, BarrierError> {
        // Acquire: as in `follow` (we may find the round completed after all).
        let mut state = self.state.load(Ordering::Acquire);
        loop {
            if generation(state) != gen {
                return Ok(BarrierWaitResult { leader: false });
            }
            if state & POISONED != 0 {
                return Err(BarrierError::Aborted);
            }
            // Success AcqRel: the same ordering as `abort`'s fetch_or. Failure
            // Acquire: as the load above. Setting POISONED only while the
            // generation is still `gen` is what makes a late completion win.
            match self.state.compare_exchange_weak(state, state | POISONED, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(actual) => state = actual,
            }
        }
        self.wake_all();
        Err(BarrierError::TimedOut)
    }

    /// Wake the parked waiters of the round whose sense is `sense`.
    #[cold]
    #[inline(never)]
    fn wake(&self, sense: usize) {
        // Taking the lock is what closes the lost-wake-up window.
        let _guard = self.lock();
        self.condvars[sense].notify_all();
    }

    /// Wake every parked waiter (abort / timeout).
    #[cold]
    #[inline(never)]
    fn wake_all(&self) {
        let _guard = self.lock();
        self.condvars[0].notify_all();
        self.condvars[1].notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        // Nothing panics while holding this mutex (no user code runs under
        // it), and it guards no data: a poisoned lock is as good as any.
        self.park_lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl AbortableBarrier for SpinParkBarrier {
    fn with_parties(parties: usize) -> Self {
        Self::new(parties)
    }

    fn parties(&self) -> usize {
        SpinParkBarrier::parties(self)
    }

    #[inline]
    fn wait(&self) -> Result<BarrierWaitResult, BarrierError> {
        SpinParkBarrier::wait(self)
    }

    fn abort(&self) {
        SpinParkBarrier::abort(self);
    }

    fn is_aborted(&self) -> bool {
        SpinParkBarrier::is_aborted(self)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn park_after_saturates_instead_of_overflowing() {
        let policy = BackoffPolicy { spin_checks: 1, spin_hints_cap: 1, yield_checks: u32::MAX };
        assert_eq!(policy.park_after(), u32::MAX);
        let policy = BackoffPolicy { spin_checks: u32::MAX, spin_hints_cap: 1, yield_checks: u32::MAX };
        assert_eq!(policy.park_after(), u32::MAX);
        assert_eq!(BackoffPolicy::SPIN.park_after(), SPIN_CHECKS + YIELD_CHECKS);
        assert_eq!(BackoffPolicy::PARK.park_after(), 0);
    }
}
