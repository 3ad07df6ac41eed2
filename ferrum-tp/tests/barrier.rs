//! Barrier semantics (compared against `std::sync::Barrier`), abort, deadline
//! and stress tests, for both barrier types whatever the features.
#![cfg(not(loom))]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use ferrum_tp::{AbortableBarrier, BackoffPolicy, BarrierError, SpinParkBarrier, StdBarrier};

/// Runs `f` on a thread; fails the test (instead of hanging) if it takes longer
/// than `limit`, calling `on_timeout` first (e.g. to abort the barrier so the
/// stuck threads can end).
fn with_watchdog<R: Send + 'static>(
    limit: Duration,
    on_timeout: impl FnOnce(),
    f: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (tx, rx) = mpsc::channel();
    let handle = thread::spawn(move || {
        let r = f();
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(limit) {
        Ok(()) => handle.join().expect("test body panicked"),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(handle.join().err().expect("body ended without sending"))
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            on_timeout();
            panic!("watchdog: test body still running after {limit:?} (hang?)");
        }
    }
}

/// The std-like semantics every barrier must have, checked for `parties`
/// threads and `rounds` rounds, with `wait` returning `is_leader`:
/// exactly one leader per round; nobody leaves round r before all parties
/// arrived at round r; nobody arrives at round r+1 before everybody arrived
/// at round r (follows); the leader is the last arriver.
fn check_semantics<B: Send + Sync + 'static>(barrier: Arc<B>, parties: usize, rounds: usize, wait: fn(&B) -> bool) {
    let arrived: Arc<Vec<AtomicUsize>> = Arc::new((0..rounds).map(|_| AtomicUsize::new(0)).collect());
    let leaders: Arc<Vec<AtomicUsize>> = Arc::new((0..rounds).map(|_| AtomicUsize::new(0)).collect());
    let departed: Arc<Vec<AtomicUsize>> = Arc::new((0..rounds).map(|_| AtomicUsize::new(0)).collect());
    let threads: Vec<_> = (0..parties)
        .map(|_| {
            let (barrier, arrived, leaders, departed) =
                (Arc::clone(&barrier), Arc::clone(&arrived), Arc::clone(&leaders), Arc::clone(&departed));
            thread::spawn(move || {
                for r in 0..rounds {
                    if r > 0 {
                        // Everybody left r-1's arrival phase: all arrived there.
                        assert_eq!(arrived[r - 1].load(Ordering::SeqCst), parties);
                    }
                    arrived[r].fetch_add(1, Ordering::SeqCst);
                    let leader = wait(&barrier);
                    assert_eq!(
                        arrived[r].load(Ordering::SeqCst),
                        parties,
                        "a party left round {r} before all parties arrived"
                    );
                    if leader {
                        leaders[r].fetch_add(1, Ordering::SeqCst);
                    }
                    if r + 1 < rounds {
                        assert!(arrived[r + 1].load(Ordering::SeqCst) <= parties);
                    }
                    departed[r].fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("party panicked");
    }
    for r in 0..rounds {
        assert_eq!(leaders[r].load(Ordering::SeqCst), 1, "round {r}: not exactly one leader");
        assert_eq!(departed[r].load(Ordering::SeqCst), parties);
    }
}

fn spin_wait(b: &SpinParkBarrier) -> bool {
    b.wait().expect("spin-park wait").is_leader()
}
fn std_wrapper_wait(b: &StdBarrier) -> bool {
    b.wait().expect("std wrapper wait").is_leader()
}
fn std_wait(b: &std::sync::Barrier) -> bool {
    b.wait().is_leader()
}

#[test]
fn reference_std_barrier_semantics() {
    // The checker itself, against the reference implementation.
    for parties in [1, 2, 3, 5] {
        check_semantics(Arc::new(std::sync::Barrier::new(parties)), parties, 500, std_wait);
    }
}

#[test]
fn spin_park_matches_std_semantics() {
    for parties in [1, 2, 3, 5] {
        for policy in [BackoffPolicy::SPIN, BackoffPolicy::OVERSUBSCRIBED, BackoffPolicy::PARK] {
            let b = Arc::new(SpinParkBarrier::with_backoff(parties, policy));
            with_watchdog(Duration::from_secs(60), || (), move || check_semantics(b, parties, 500, spin_wait));
        }
    }
}

#[test]
fn std_wrapper_matches_std_semantics() {
    for parties in [1, 2, 3, 5] {
        let b = Arc::new(StdBarrier::new(parties));
        with_watchdog(Duration::from_secs(60), || (), move || check_semantics(b, parties, 500, std_wrapper_wait));
    }
}

#[test]
fn zero_parties_behaves_like_one() {
    let b = SpinParkBarrier::new(0);
    assert_eq!(b.parties(), 1);
    assert!(b.wait().unwrap().is_leader());
    assert!(b.wait().unwrap().is_leader());
    let s = StdBarrier::new(0);
    assert_eq!(s.parties(), 1);
    assert!(s.wait().unwrap().is_leader());
    assert!(std::sync::Barrier::new(0).wait().is_leader());
}

/// `parties - 1` threads wait (and, with `PARK`, sleep); abort must release
/// them all with `Aborted`, promptly; later waits fail at once.
fn abort_releases_blocked_waiters<B: AbortableBarrier + 'static>(barrier: B) {
    let parties = barrier.parties();
    let barrier = Arc::new(barrier);
    // A few healthy rounds first.
    let threads: Vec<_> = (0..parties - 1)
        .map(|_| {
            let b = Arc::clone(&barrier);
            thread::spawn(move || {
                for _ in 0..10 {
                    b.wait().expect("healthy round");
                }
                let t0 = Instant::now();
                let r = b.wait();
                (r, t0.elapsed())
            })
        })
        .collect();
    for _ in 0..10 {
        barrier.wait().unwrap();
    }
    // Let the others block (spin out and park) in round 11, then abort
    // instead of arriving.
    thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    barrier.abort();
    assert!(t0.elapsed() < Duration::from_secs(1), "abort took {:?}", t0.elapsed());
    for t in threads {
        let (r, _) = t.join().unwrap();
        assert_eq!(r, Err(BarrierError::Aborted));
    }
    assert!(barrier.is_aborted());
    assert_eq!(barrier.wait(), Err(BarrierError::Aborted));
    barrier.abort(); // idempotent
    assert_eq!(barrier.wait(), Err(BarrierError::Aborted));
}

#[test]
fn spin_park_abort_releases_blocked_waiters() {
    for parties in [2, 3, 8] {
        for policy in [BackoffPolicy::SPIN, BackoffPolicy::PARK] {
            with_watchdog(
                Duration::from_secs(30),
                || (),
                move || abort_releases_blocked_waiters(SpinParkBarrier::with_backoff(parties, policy)),
            );
        }
    }
}

#[test]
fn std_wrapper_abort_releases_blocked_waiters() {
    for parties in [2, 3, 8] {
        with_watchdog(Duration::from_secs(30), || (), move || abort_releases_blocked_waiters(StdBarrier::new(parties)));
    }
}

/// A party panics instead of arriving; its guard aborts the barrier; the
/// others are released.
fn dead_party_does_not_hang<B: AbortableBarrier + 'static>(barrier: B) {
    struct AbortOnDrop<B: AbortableBarrier>(Arc<B>);
    impl<B: AbortableBarrier> Drop for AbortOnDrop<B> {
        fn drop(&mut self) {
            if thread::panicking() {
                self.0.abort();
            }
        }
    }
    let parties = barrier.parties();
    let barrier = Arc::new(barrier);
    let mut threads = Vec::new();
    for p in 0..parties {
        let b = Arc::clone(&barrier);
        threads.push(thread::spawn(move || {
            let _guard = AbortOnDrop(Arc::clone(&b));
            for round in 0..100 {
                if p == parties - 1 && round == 50 {
                    panic!("party {p} dies in round {round}");
                }
                b.wait()?;
            }
            Ok::<(), BarrierError>(())
        }));
    }
    let results: Vec<_> = threads.into_iter().map(|t| t.join()).collect();
    for (p, r) in results.into_iter().enumerate() {
        if p == parties - 1 {
            assert!(r.is_err(), "the dying party panicked");
        } else {
            assert_eq!(r.unwrap(), Err(BarrierError::Aborted));
        }
    }
}

#[test]
fn spin_park_dead_party_does_not_hang() {
    for parties in [2, 3, 8] {
        with_watchdog(Duration::from_secs(30), || (), move || dead_party_does_not_hang(SpinParkBarrier::new(parties)));
    }
}

#[test]
fn std_wrapper_dead_party_does_not_hang() {
    for parties in [2, 3, 8] {
        with_watchdog(Duration::from_secs(30), || (), move || dead_party_does_not_hang(StdBarrier::new(parties)));
    }
}

#[test]
fn std_wrapper_abort_with_no_round_in_progress() {
    let b = StdBarrier::new(4);
    b.abort();
    assert_eq!(b.wait(), Err(BarrierError::Aborted));
}

#[test]
fn deadline_timeout_aborts_the_barrier() {
    for policy in [BackoffPolicy::SPIN, BackoffPolicy::PARK] {
        let b = Arc::new(SpinParkBarrier::with_backoff(3, policy));
        let other = {
            let b = Arc::clone(&b);
            thread::spawn(move || b.wait())
        };
        let t0 = Instant::now();
        let r = b.wait_timeout(Duration::from_millis(50));
        let took = t0.elapsed();
        assert_eq!(r, Err(BarrierError::TimedOut));
        assert!(took >= Duration::from_millis(50) && took < Duration::from_secs(2), "{took:?}");
        assert_eq!(other.join().unwrap(), Err(BarrierError::Aborted));
        assert!(b.is_aborted());
        assert_eq!(b.wait(), Err(BarrierError::Aborted));
        assert_eq!(b.wait_deadline(Instant::now() + Duration::from_secs(1)), Err(BarrierError::Aborted));
    }
}

#[test]
fn deadline_met_is_ok() {
    for policy in [BackoffPolicy::SPIN, BackoffPolicy::PARK] {
        let b = Arc::new(SpinParkBarrier::with_backoff(2, policy));
        for _ in 0..200 {
            let other = {
                let b = Arc::clone(&b);
                thread::spawn(move || b.wait_timeout(Duration::from_secs(10)))
            };
            let mine = b.wait_deadline(Instant::now() + Duration::from_secs(10)).unwrap();
            let theirs = other.join().unwrap().unwrap();
            assert_ne!(mine.is_leader(), theirs.is_leader());
        }
        // The round completes while the waiter is parked with a deadline.
        let other = {
            let b = Arc::clone(&b);
            thread::spawn(move || b.wait_timeout(Duration::from_secs(10)))
        };
        thread::sleep(Duration::from_millis(50));
        assert!(b.wait().is_ok());
        assert!(other.join().unwrap().is_ok());
        assert!(!b.is_aborted());
    }
}

/// The policy's fields are public: `spin_checks + yield_checks` past
/// `u32::MAX` must mean "yield (practically) forever", not an overflow panic
/// (debug) or a wrapped-around "park at once" (release).
#[test]
fn extreme_backoff_policy_does_not_overflow() {
    let policy = BackoffPolicy { spin_checks: 1, spin_hints_cap: 1, yield_checks: u32::MAX };
    let b = Arc::new(SpinParkBarrier::with_backoff(2, policy));
    let on_timeout = {
        let b = Arc::clone(&b);
        move || b.abort()
    };
    with_watchdog(Duration::from_secs(30), on_timeout, move || {
        let other = {
            let b = Arc::clone(&b);
            thread::spawn(move || b.wait())
        };
        // Let the other party run past its single spin read into the yields.
        thread::sleep(Duration::from_millis(20));
        let mine = b.wait().unwrap();
        let theirs = other.join().expect("the waiter panicked").unwrap();
        assert_ne!(mine.is_leader(), theirs.is_leader());
    });
}

#[test]
fn expired_deadline_races_completion_all_or_nothing() {
    // A party with an already-expired deadline races the round's completion:
    // either the round completes for everybody or it is aborted for everybody
    // (with the timed-out party seeing TimedOut).
    let (mut completed, mut aborted) = (0, 0);
    for _ in 0..300 {
        let b = Arc::new(SpinParkBarrier::new(2));
        let other = {
            let b = Arc::clone(&b);
            thread::spawn(move || b.wait())
        };
        let mine = b.wait_deadline(Instant::now());
        let theirs = other.join().unwrap();
        match (mine, theirs) {
            (Ok(a), Ok(b)) => {
                assert_ne!(a.is_leader(), b.is_leader());
                completed += 1;
            }
            (Err(BarrierError::TimedOut), Err(BarrierError::Aborted)) => aborted += 1,
            other => panic!("inconsistent round outcome: {other:?}"),
        }
    }
    assert_eq!(completed + aborted, 300);
}

/// 8 parties on (typically) 2 cores, 100k rounds, watchdog.
fn stress<B: AbortableBarrier + 'static>(barrier: B, rounds: usize) {
    let parties = barrier.parties();
    let barrier = Arc::new(barrier);
    let leaders = Arc::new(AtomicUsize::new(0));
    let on_timeout = {
        let b = Arc::clone(&barrier);
        move || b.abort()
    };
    let body = {
        let barrier = Arc::clone(&barrier);
        let leaders = Arc::clone(&leaders);
        move || {
            let threads: Vec<_> = (0..parties)
                .map(|_| {
                    let b = Arc::clone(&barrier);
                    let leaders = Arc::clone(&leaders);
                    thread::spawn(move || {
                        for _ in 0..rounds {
                            if b.wait().expect("stress round").is_leader() {
                                leaders.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().expect("stress party panicked");
            }
        }
    };
    let t0 = Instant::now();
    with_watchdog(Duration::from_secs(120), on_timeout, body);
    eprintln!(
        "stress: {parties} parties x {rounds} rounds in {:?} ({} cores)",
        t0.elapsed(),
        thread::available_parallelism().map_or(0, |n| n.get())
    );
    assert_eq!(leaders.load(Ordering::Relaxed), rounds);
}

#[test]
fn stress_spin_park_8_parties_100k_rounds() {
    stress(SpinParkBarrier::new(8), 100_000);
}

#[test]
fn stress_spin_park_forced_spin_8_parties() {
    // The spinning policy even though oversubscribed: slow, but must not hang.
    stress(SpinParkBarrier::with_backoff(8, BackoffPolicy::SPIN), 20_000);
}

#[test]
fn stress_spin_park_always_park_3_parties() {
    stress(SpinParkBarrier::with_backoff(3, BackoffPolicy::PARK), 20_000);
}

#[test]
fn stress_std_wrapper_8_parties_100k_rounds() {
    stress(StdBarrier::new(8), 100_000);
}
