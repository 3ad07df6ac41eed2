//! Model checks of the spin-park barrier and the CPU all-reduce.
//!
//! ```text
//! CARGO_TARGET_DIR=target/loom RUSTFLAGS="--cfg loom" \
//!     cargo test -p ferrum-tp --release --test loom
//! ```
//!
//! Under `cfg(loom)` the crate's atomics, mutex, condition variables, spin
//! hints and `UnsafeCell` are loom's, so loom explores the interleavings (and
//! the weak-memory behaviours) of the real barrier code, detects lost
//! wake-ups as deadlocks and unordered slot accesses as data races.
#![cfg(loom)]

use ferrum_tp::{AbortOrigin, BackoffPolicy, BarrierError, CpuAllReduce, SpinParkBarrier};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

/// Preemption bound 3 (unless `LOOM_MAX_PREEMPTIONS` says otherwise): the
/// whole file then runs in ~30 s in release on 2 cores. Bound 2 already
/// catches a missing lock in the wake path and a relaxed publishing CAS
/// (both tried as mutations).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

/// Data written before the barrier by one party and read after it by the
/// other, through an `UnsafeCell`: loom reports a data race if the barrier
/// does not order them. Also: exactly one leader per round.
fn rounds(parties: usize, rounds: usize, policy: BackoffPolicy) {
    model(move || {
        let barrier = Arc::new(SpinParkBarrier::with_backoff(parties, policy));
        // One cell per (round, party).
        let cells: Arc<Vec<UnsafeCell<usize>>> = Arc::new((0..rounds * parties).map(|_| UnsafeCell::new(0)).collect());
        let leaders = Arc::new(AtomicUsize::new(0));
        let body = {
            let (barrier, cells, leaders) = (barrier.clone(), cells.clone(), leaders.clone());
            move |me: usize| {
                for r in 0..rounds {
                    cells[r * parties + me].with_mut(|p| {
                        // SAFETY: only party `me` writes its cell of round r,
                        // before the barrier of round r (loom checks it).
                        unsafe { *p = r + 1 }
                    });
                    if barrier.wait().unwrap().is_leader() {
                        leaders.fetch_add(1, Ordering::Relaxed);
                    }
                    for other in 0..parties {
                        let v = cells[r * parties + other].with(|p| {
                            // SAFETY: written before the barrier we passed
                            // (loom checks it).
                            unsafe { *p }
                        });
                        assert_eq!(v, r + 1, "round {r}: party {other}'s write not visible");
                    }
                }
            }
        };
        let handles: Vec<_> = (1..parties)
            .map(|me| {
                let body = body.clone();
                thread::spawn(move || body(me))
            })
            .collect();
        body(0);
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(leaders.load(Ordering::Relaxed), rounds);
    });
}

#[test]
fn two_parties_three_rounds_park() {
    rounds(2, 3, BackoffPolicy::PARK);
}

#[test]
fn two_parties_three_rounds_spin_then_park() {
    rounds(2, 3, BackoffPolicy::for_parties(2));
}

#[test]
fn three_parties_two_rounds_park() {
    rounds(3, 2, BackoffPolicy::PARK);
}

/// Two parties wait (and may park); a third never arrives and aborts
/// instead: both must return `Aborted` (a lost abort wake-up is a deadlock).
#[test]
fn abort_releases_waiters() {
    model(|| {
        let barrier = Arc::new(SpinParkBarrier::with_backoff(3, BackoffPolicy::PARK));
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let b = barrier.clone();
                thread::spawn(move || b.wait())
            })
            .collect();
        barrier.abort();
        for h in handles {
            assert_eq!(h.join().unwrap(), Err(BarrierError::Aborted));
        }
        assert_eq!(barrier.wait(), Err(BarrierError::Aborted));
    });
}

/// Two parties complete a round while a third thread aborts: the round is
/// all-or-nothing.
#[test]
fn abort_races_completion() {
    model(|| {
        let barrier = Arc::new(SpinParkBarrier::with_backoff(2, BackoffPolicy::PARK));
        let other = {
            let b = barrier.clone();
            thread::spawn(move || b.wait())
        };
        let aborter = {
            let b = barrier.clone();
            thread::spawn(move || b.abort())
        };
        let mine = barrier.wait();
        let theirs = other.join().unwrap();
        aborter.join().unwrap();
        match (mine, theirs) {
            (Ok(a), Ok(b)) => assert_ne!(a.is_leader(), b.is_leader()),
            (Err(BarrierError::Aborted), Err(BarrierError::Aborted)) => {}
            outcome => panic!("round not all-or-nothing: {outcome:?}"),
        }
        assert!(barrier.is_aborted());
    });
}

/// A party whose deadline has already passed races the round's completion:
/// either both pass, or the barrier is aborted for both.
#[test]
fn expired_deadline_races_completion() {
    model(|| {
        let barrier = Arc::new(SpinParkBarrier::with_backoff(2, BackoffPolicy::PARK));
        let other = {
            let b = barrier.clone();
            thread::spawn(move || b.wait())
        };
        let mine = barrier.wait_deadline(std::time::Instant::now());
        let theirs = other.join().unwrap();
        match (mine, theirs) {
            (Ok(a), Ok(b)) => assert_ne!(a.is_leader(), b.is_leader()),
            (Err(BarrierError::TimedOut), Err(BarrierError::Aborted)) => {}
            outcome => panic!("inconsistent outcome: {outcome:?}"),
        }
    });
}

/// Three all-reduce calls on two ranks: exercises both slot parities and the
/// reuse of the first one, which is only safe because of the next call's
/// barrier. Loom checks every slot access for races.
#[test]
fn all_reduce_two_ranks_three_calls() {
    model(|| {
        let (_control, ranks) = CpuAllReduce::new(2, 2).unwrap();
        let mut ranks = ranks.into_iter();
        let (r0, r1) = (ranks.next().unwrap(), ranks.next().unwrap());
        let run = |h: ferrum_tp::AllReduceRank| {
            for call in 0..3u8 {
                let x = f32::from(call) + h.rank() as f32;
                let mut data = [x, 2.0 * x];
                h.sum(&mut data).unwrap();
                let want = 2.0 * f32::from(call) + 1.0;
                assert_eq!(data, [want, 2.0 * want]);
            }
        };
        let t = thread::spawn(move || run(r1));
        run(r0);
        t.join().unwrap();
    });
}

/// One rank fails (aborts) while the other may be blocked in the all-reduce:
/// it returns `Aborted`, never hangs.
#[test]
fn all_reduce_abort_releases_peer() {
    model(|| {
        let (control, ranks) = CpuAllReduce::new(2, 1).unwrap();
        let mut ranks = ranks.into_iter();
        let (r0, _r1) = (ranks.next().unwrap(), ranks.next().unwrap());
        let t = thread::spawn(move || r0.sum(&mut [1.0]));
        control.abort();
        assert_eq!(t.join().unwrap(), Err(ferrum_tp::CollectiveError::Aborted));
    });
}

/// A rank's handle is dropped (its thread ended early) while the other may
/// be blocked in the all-reduce: it returns `Aborted`, never hangs, and the
/// origin names the dropped rank. (Dropping the handles after the last call,
/// as `all_reduce_two_ranks_three_calls` does, must fail no call.)
#[test]
fn all_reduce_dropped_rank_releases_peer() {
    model(|| {
        let (control, ranks) = CpuAllReduce::new(2, 1).unwrap();
        let mut ranks = ranks.into_iter();
        let (r0, r1) = (ranks.next().unwrap(), ranks.next().unwrap());
        let t = thread::spawn(move || r0.sum(&mut [1.0]));
        drop(r1);
        assert_eq!(t.join().unwrap(), Err(ferrum_tp::CollectiveError::Aborted));
        assert_eq!(control.abort_origin(), Some(AbortOrigin::Dropped { rank: 1 }));
    });
}
