//! TpDecodeGroup and CpuAllReduce: parameters, commands, all-reduce results,
//! bad input, and failure injection (errors and panics at step k, including
//! a panic while the other ranks are inside the all-reduce). Runs under
//! whichever barrier the features select.
#![cfg(not(loom))]
// Index loops mirror the reference computations' rank order.
#![allow(clippy::needless_range_loop)]

use std::collections::HashSet;
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ferrum_tp::{
    AbortOrigin, CollectiveError, CpuAllReduce, RankContext, RankWorker, SequenceId, StepInput, TpConfig,
    TpDecodeGroup, TpError,
};

fn with_watchdog<R: Send + 'static>(limit: Duration, f: impl FnOnce() -> R + Send + 'static) -> R {
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
            panic!("watchdog: test body still running after {limit:?} (hang?)")
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
enum WorkerError {
    #[error("unknown sequence {0}")]
    UnknownSequence(SequenceId),
    #[error("injected failure at step {0}")]
    Injected(usize),
    #[error("all-reduce: {0}")]
    Collective(#[from] CollectiveError),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    None,
    /// Return an error on `rank` at step `k` (before the all-reduce).
    ErrorAt {
        rank: usize,
        step: usize,
    },
    /// Panic on `rank` at step `k`, before the all-reduce (so the other ranks
    /// are blocked inside it).
    PanicAt {
        rank: usize,
        step: usize,
    },
    /// Panic while the group is being built.
    PanicInFactory {
        rank: usize,
    },
    ErrorInFactory {
        rank: usize,
    },
    PanicInDrop {
        rank: usize,
    },
    /// Pass too long a buffer to the all-reduce on `rank` at step `k` (after
    /// a pause, so the other ranks are blocked inside it), and return the
    /// error.
    TooLongAt {
        rank: usize,
        step: usize,
    },
    /// As `TooLongAt`, but the worker swallows the error and returns `Ok`.
    TooLongIgnoredAt {
        rank: usize,
        step: usize,
    },
}

const HIDDEN: usize = 576;

/// A worker that checks the step parameters, keeps "KV caches" (a set of
/// sequence ids), all-reduces a rank-dependent vector each step, and logs
/// what it saw.
struct TestWorker {
    rank: usize,
    fault: Fault,
    steps: usize,
    sequences: HashSet<SequenceId>,
    buf: Vec<f32>,
    log: Log,
    thread_name: String,
}

impl RankWorker for TestWorker {
    type Error = WorkerError;

    fn decode_step(&mut self, ctx: &RankContext, step: StepInput) -> Result<(), WorkerError> {
        if !self.sequences.contains(&step.sequence) {
            return Err(WorkerError::UnknownSequence(step.sequence));
        }
        let k = self.steps;
        self.steps += 1;
        match self.fault {
            Fault::ErrorAt { rank, step } if rank == self.rank && step == k => {
                return Err(WorkerError::Injected(k));
            }
            Fault::PanicAt { rank, step } if rank == self.rank && step == k => {
                // Give the other ranks time to block inside the all-reduce.
                thread::sleep(Duration::from_millis(50));
                panic!("injected panic on rank {rank} at step {k}");
            }
            Fault::TooLongAt { rank, step } if rank == self.rank && step == k => {
                thread::sleep(Duration::from_millis(20));
                ctx.all_reduce_sum(&mut vec![0.0; HIDDEN + 1])?;
            }
            Fault::TooLongIgnoredAt { rank, step } if rank == self.rank && step == k => {
                thread::sleep(Duration::from_millis(20));
                if ctx.all_reduce_sum(&mut vec![0.0; HIDDEN + 1]).is_err() {
                    return Ok(());
                }
            }
            _ => {}
        }
        // Partial sums that are not exactly representable, so the summation
        // order matters for the bits.
        for (i, x) in self.buf.iter_mut().enumerate() {
            *x = (step.token as f32 + 0.1) * (i as f32 + 1.0) / (ctx.rank() as f32 + 3.0)
                + (step.position as f32) * 1e-3;
        }
        ctx.all_reduce_sum(&mut self.buf)?;
        // A second all-reduce, like a transformer layer's two.
        ctx.all_reduce_sum(&mut self.buf[..HIDDEN / 2])?;
        self.log.lock().unwrap().push((ctx.rank(), step, self.buf.clone()));
        Ok(())
    }

    fn kv_init(&mut self, _ctx: &RankContext, sequence: SequenceId) -> Result<(), WorkerError> {
        self.sequences.insert(sequence);
        Ok(())
    }

    fn kv_release(&mut self, _ctx: &RankContext, sequence: SequenceId) -> Result<(), WorkerError> {
        if self.sequences.remove(&sequence) {
            Ok(())
        } else {
            Err(WorkerError::UnknownSequence(sequence))
        }
    }
}

impl Drop for TestWorker {
    fn drop(&mut self) {
        if self.fault == (Fault::PanicInDrop { rank: self.rank }) && !thread::panicking() {
            panic!("injected panic in drop on rank {}", self.rank);
        }
    }
}

type Log = Arc<Mutex<Vec<(usize, StepInput, Vec<f32>)>>>;

fn group(world: usize, fault: Fault) -> (Result<TpDecodeGroup<TestWorker>, TpError<WorkerError>>, Log) {
    let log: Log = Arc::default();
    let factory_log = Arc::clone(&log);
    let g = TpDecodeGroup::new(TpConfig::new(world).all_reduce_max_len(HIDDEN), move |ctx: &RankContext| {
        match fault {
            Fault::PanicInFactory { rank } if rank == ctx.rank() => panic!("factory panic"),
            Fault::ErrorInFactory { rank } if rank == ctx.rank() => {
                return Err(WorkerError::Injected(0));
            }
            _ => {}
        }
        Ok(TestWorker {
            rank: ctx.rank(),
            fault,
            steps: 0,
            sequences: HashSet::new(),
            buf: vec![0.0; HIDDEN],
            log: Arc::clone(&factory_log),
            thread_name: thread::current().name().unwrap_or("").to_owned(),
        })
    });
    (g, log)
}

#[test]
fn zero_world_size_is_an_error() {
    let (g, _) = group(0, Fault::None);
    assert!(matches!(g, Err(TpError::ZeroWorldSize)));
    assert!(matches!(CpuAllReduce::new(0, 8), Err(CollectiveError::ZeroWorldSize)));
}

/// Buffers too large to size or to allocate are a typed error, not a
/// capacity-overflow panic or an out-of-memory abort of the process.
#[test]
fn oversized_all_reduce_is_an_error() {
    for (world_size, max_len) in [
        (2, usize::MAX),     // 2 × 2 × max_len overflows
        (1, usize::MAX / 2), // the float count fits; the bytes do not
        (usize::MAX, 0),     // the per-rank tables overflow
        (usize::MAX, 1),
        (2, 1 << 59), // a valid size that no allocator grants (2^61 bytes per buffer)
    ] {
        let r = CpuAllReduce::new(world_size, max_len);
        assert_eq!(r.err(), Some(CollectiveError::TooLarge { world_size, max_len }), "{world_size} × {max_len}");
    }
    let g = TpDecodeGroup::new(
        TpConfig::new(2).all_reduce_max_len(usize::MAX),
        |_: &RankContext| -> Result<TestWorker, WorkerError> {
            unreachable!("no rank is built when the all-reduce cannot be")
        },
    );
    let too_large = CollectiveError::TooLarge { world_size: 2, max_len: usize::MAX };
    assert!(matches!(g, Err(TpError::AllReduce(e)) if e == too_large));
}

#[test]
fn steps_pass_parameters_and_all_reduce_is_bit_identical() {
    with_watchdog(Duration::from_secs(60), || {
        for world in [1, 2, 3, 4] {
            let (g, log) = group(world, Fault::None);
            let mut g = g.unwrap();
            assert_eq!(g.world_size(), world);
            g.kv_init(SequenceId(7)).unwrap();
            g.kv_init(SequenceId(9)).unwrap();
            let steps = 50;
            for k in 0..steps {
                let seq = if k % 2 == 0 { SequenceId(7) } else { SequenceId(9) };
                g.decode_step(100 + k as u32, k, seq).unwrap();
            }
            let log = log.lock().unwrap();
            assert_eq!(log.len(), world * steps);
            for k in 0..steps {
                let entries: Vec<_> = log.iter().filter(|(_, s, _)| s.position == k).collect();
                assert_eq!(entries.len(), world);
                let seq = if k % 2 == 0 { SequenceId(7) } else { SequenceId(9) };
                let expected_step = StepInput { token: 100 + k as u32, position: k, sequence: seq };
                // Reference: the same sums, in rank order, then the second
                // all-reduce over the first half.
                let mut expected = vec![0.0f32; HIDDEN];
                for r in 0..world {
                    for (i, e) in expected.iter_mut().enumerate() {
                        let x = (expected_step.token as f32 + 0.1) * (i as f32 + 1.0) / (r as f32 + 3.0)
                            + (k as f32) * 1e-3;
                        if r == 0 {
                            *e = x
                        } else {
                            *e += x
                        }
                    }
                }
                let half: Vec<f32> = expected[..HIDDEN / 2]
                    .iter()
                    .map(|&v| {
                        let mut acc = v;
                        for _ in 1..world {
                            acc += v
                        }
                        acc
                    })
                    .collect();
                expected[..HIDDEN / 2].copy_from_slice(&half);
                for (_, step, buf) in &entries {
                    assert_eq!(*step, expected_step);
                    let bits: Vec<u32> = buf.iter().map(|v| v.to_bits()).collect();
                    let want: Vec<u32> = expected.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(bits, want, "world {world} step {k}: not bit-identical");
                }
            }
            drop(log);
            g.kv_release(SequenceId(7)).unwrap();
            g.kv_release(SequenceId(9)).unwrap();
            g.shutdown().unwrap();
        }
    });
}

#[test]
fn rank_threads_are_named_and_run_on_ranks_returns_in_rank_order() {
    with_watchdog(Duration::from_secs(30), || {
        let (g, _) = group(4, Fault::None);
        let mut g = g.unwrap();
        let got = g
            .run_on_ranks(|w: &mut TestWorker, ctx: &RankContext| {
                Ok((ctx.rank(), ctx.world_size(), w.thread_name.clone(), thread::current().name().map(str::to_owned)))
            })
            .unwrap();
        for (r, (rank, world, built_on, runs_on)) in got.into_iter().enumerate() {
            assert_eq!(rank, r);
            assert_eq!(world, 4);
            assert_eq!(built_on, format!("tp-rank-{r}"));
            assert_eq!(runs_on.as_deref(), Some(format!("tp-rank-{r}").as_str()));
        }
    });
}

#[test]
fn unknown_sequence_error_is_propagated_and_poisons() {
    with_watchdog(Duration::from_secs(30), || {
        let (g, _) = group(2, Fault::None);
        let mut g = g.unwrap();
        match g.decode_step(1, 0, SequenceId(404)) {
            Err(TpError::Rank { rank, source: WorkerError::UnknownSequence(SequenceId(404)) }) => {
                assert!(rank < 2);
            }
            other => panic!("expected the worker's typed error, got {other:?}"),
        }
        assert!(g.is_poisoned());
        assert!(matches!(g.decode_step(1, 0, SequenceId(404)), Err(TpError::Poisoned { rank: Some(_) })));
        assert!(matches!(g.kv_init(SequenceId(1)), Err(TpError::Poisoned { .. })));
    });
}

#[test]
fn kv_release_of_unknown_sequence_is_a_typed_error() {
    with_watchdog(Duration::from_secs(30), || {
        let (g, _) = group(3, Fault::None);
        let mut g = g.unwrap();
        let err = g.kv_release(SequenceId(5)).unwrap_err();
        assert!(matches!(err, TpError::Rank { source: WorkerError::UnknownSequence(SequenceId(5)), .. }), "{err:?}");
        assert!(err.to_string().contains("rank"));
        drop(g); // must not hang
    });
}

fn expect_failure_at_step(fault: Fault, world: usize, failing_rank: usize, at: usize, panic: bool) {
    let (g, log) = group(world, fault);
    let mut g = g.unwrap();
    g.kv_init(SequenceId(1)).unwrap();
    for k in 0..at {
        g.decode_step(k as u32, k, SequenceId(1)).unwrap();
    }
    let t0 = Instant::now();
    let err = g.decode_step(at as u32, at, SequenceId(1)).unwrap_err();
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(1), "failure took {took:?} to surface");
    match (&err, panic) {
        (TpError::RankPanicked { rank, message }, true) => {
            assert_eq!(*rank, failing_rank);
            assert!(message.contains("injected panic"), "{message}");
        }
        (TpError::Rank { rank, source: WorkerError::Injected(k) }, false) => {
            assert_eq!(*rank, failing_rank);
            assert_eq!(*k, at);
        }
        _ => panic!("unexpected error {err:?}"),
    }
    assert!(g.is_poisoned());
    match g.decode_step(0, 0, SequenceId(1)) {
        Err(TpError::Poisoned { rank }) => assert_eq!(rank, Some(failing_rank)),
        other => panic!("expected Poisoned, got {other:?}"),
    }
    assert_eq!(log.lock().unwrap().len(), world * at);
    let t0 = Instant::now();
    drop(g);
    assert!(t0.elapsed() < Duration::from_secs(1), "drop took {:?}", t0.elapsed());
}

#[test]
fn error_at_step_k_names_the_rank_and_poisons() {
    with_watchdog(Duration::from_secs(60), || {
        for world in [2, 4] {
            for rank in [0, world - 1] {
                expect_failure_at_step(Fault::ErrorAt { rank, step: 5 }, world, rank, 5, false);
            }
        }
    });
}

#[test]
fn panic_at_step_k_while_others_are_in_all_reduce() {
    with_watchdog(Duration::from_secs(60), || {
        for world in [1, 2, 4] {
            for rank in [0, world - 1] {
                expect_failure_at_step(Fault::PanicAt { rank, step: 3 }, world, rank, 3, true);
            }
        }
    });
}

/// A rank aborts the all-reduce itself (too long a buffer) while the others
/// are blocked in it: they wake with `Aborted` and fail, often before the
/// culprit's worker has returned. The caller must still get the culprit's
/// error, every time.
#[test]
fn too_long_all_reduce_reports_the_culprit_not_its_peers() {
    with_watchdog(Duration::from_secs(120), || {
        let too_long = CollectiveError::TooLong { len: HIDDEN + 1, max_len: HIDDEN };
        for world in [2, 4] {
            for culprit in [0, world - 1] {
                for _ in 0..10 {
                    let (g, _) = group(world, Fault::TooLongAt { rank: culprit, step: 2 });
                    let mut g = g.unwrap();
                    g.kv_init(SequenceId(1)).unwrap();
                    for k in 0..2 {
                        g.decode_step(k, k as usize, SequenceId(1)).unwrap();
                    }
                    match g.decode_step(2, 2, SequenceId(1)) {
                        Err(TpError::Rank { rank, source: WorkerError::Collective(e) }) => {
                            assert_eq!((rank, e), (culprit, too_long), "world {world}");
                        }
                        other => panic!("world {world}, culprit {culprit}: {other:?}"),
                    }
                    assert!(
                        matches!(g.decode_step(3, 3, SequenceId(1)), Err(TpError::Poisoned { rank: Some(r) }) if r == culprit)
                    );
                }
                // The worker swallows its TooLong and returns Ok: the group
                // reports the all-reduce's error itself (and does not hang).
                let (g, _) = group(world, Fault::TooLongIgnoredAt { rank: culprit, step: 0 });
                let mut g = g.unwrap();
                g.kv_init(SequenceId(1)).unwrap();
                match g.decode_step(0, 0, SequenceId(1)) {
                    Err(TpError::Collective { rank, source }) => assert_eq!((rank, source), (culprit, too_long)),
                    other => panic!("world {world}, culprit {culprit}: {other:?}"),
                }
            }
        }
    });
}

#[test]
fn factory_error_and_panic_are_reported() {
    with_watchdog(Duration::from_secs(30), || {
        let (g, _) = group(3, Fault::ErrorInFactory { rank: 2 });
        assert!(matches!(g, Err(TpError::Rank { rank: 2, source: WorkerError::Injected(0) })), "{g:?}");
        let (g, _) = group(3, Fault::PanicInFactory { rank: 1 });
        match g {
            Err(TpError::RankPanicked { rank: 1, message }) => assert_eq!(message, "factory panic"),
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn panic_in_worker_drop_is_reported_by_shutdown() {
    with_watchdog(Duration::from_secs(30), || {
        let (g, _) = group(2, Fault::PanicInDrop { rank: 1 });
        let mut g = g.unwrap();
        match g.shutdown() {
            Err(TpError::RankPanicked { rank: 1, message }) => assert!(message.contains("drop")),
            other => panic!("{other:?}"),
        }
        // A second shutdown / drop must not hang.
        g.shutdown().unwrap();
    });
}

#[test]
fn calls_after_shutdown_are_errors() {
    with_watchdog(Duration::from_secs(30), || {
        let (g, _) = group(2, Fault::None);
        let mut g = g.unwrap();
        g.shutdown().unwrap();
        g.shutdown().unwrap(); // idempotent
        assert!(matches!(g.decode_step(0, 0, SequenceId(0)), Err(TpError::ShutDown)));
        assert!(matches!(g.kv_init(SequenceId(0)), Err(TpError::ShutDown)));
        assert!(!g.is_poisoned());
    });
}

#[test]
fn drop_of_a_healthy_group_joins_promptly() {
    with_watchdog(Duration::from_secs(30), || {
        for world in [1, 2, 8] {
            let (g, _) = group(world, Fault::None);
            let mut g = g.unwrap();
            g.kv_init(SequenceId(3)).unwrap();
            g.decode_step(1, 0, SequenceId(3)).unwrap();
            let t0 = Instant::now();
            drop(g);
            assert!(t0.elapsed() < Duration::from_secs(1));
        }
    });
}

#[test]
fn many_steps_oversubscribed() {
    // 8 ranks + caller on 2 cores.
    with_watchdog(Duration::from_secs(120), || {
        let (g, log) = group(8, Fault::None);
        let mut g = g.unwrap();
        g.kv_init(SequenceId(1)).unwrap();
        for k in 0..2000 {
            g.decode_step(k as u32, k, SequenceId(1)).unwrap();
            if k % 100 == 0 {
                log.lock().unwrap().clear();
            }
        }
    });
}

// --- CpuAllReduce on its own ---------------------------------------------

#[test]
fn all_reduce_alone_various_lengths() {
    with_watchdog(Duration::from_secs(60), || {
        let world = 4;
        let (control, ranks) = CpuAllReduce::new(world, 1024).unwrap();
        assert_eq!(control.world_size(), world);
        let threads: Vec<_> = ranks
            .into_iter()
            .map(|h| {
                thread::spawn(move || {
                    let mut out = Vec::new();
                    for call in 0..200usize {
                        let len = [0, 1, 7, 576, 1024][call % 5];
                        let mut data: Vec<f32> = (0..len).map(|i| (i + call) as f32 * 0.37 + h.rank() as f32).collect();
                        h.sum(&mut data).unwrap();
                        out.push(data);
                    }
                    out
                })
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for call in 0..200 {
            let len = results[0][call].len();
            for i in 0..len {
                let mut want = 0.0f32;
                for r in 0..world {
                    let x = (i + call) as f32 * 0.37 + r as f32;
                    if r == 0 {
                        want = x
                    } else {
                        want += x
                    }
                }
                for r in 0..world {
                    assert_eq!(results[r][call][i].to_bits(), want.to_bits());
                }
            }
        }
    });
}

#[test]
fn all_reduce_too_long_aborts_and_mismatch_is_reported() {
    with_watchdog(Duration::from_secs(30), || {
        let (_, ranks) = CpuAllReduce::new(2, 8).unwrap();
        let mut it = ranks.into_iter();
        let (a, b) = (it.next().unwrap(), it.next().unwrap());
        let t = thread::spawn(move || {
            let mut d = [1.0f32; 4];
            let mismatch = b.sum(&mut d);
            let mut d = [1.0f32; 8];
            let aborted = b.sum(&mut d);
            (mismatch, aborted)
        });
        let mut d = [1.0f32; 3];
        assert_eq!(a.sum(&mut d), Err(CollectiveError::LengthMismatch));
        assert_eq!(d, [1.0; 3]);
        let mut d = [1.0f32; 9];
        assert_eq!(a.sum(&mut d), Err(CollectiveError::TooLong { len: 9, max_len: 8 }));
        let (mismatch, aborted) = t.join().unwrap();
        // With either barrier a round is all-or-nothing, so b sees the
        // mismatch even if `a` aborts before b has looked.
        assert_eq!(mismatch, Err(CollectiveError::LengthMismatch));
        assert_eq!(aborted, Err(CollectiveError::Aborted));
        assert!(a.control().is_aborted());
        assert_eq!(a.control().abort_origin(), Some(AbortOrigin::TooLong { rank: 0 }));
        assert_eq!(a.sum(&mut [0.0; 2]), Err(CollectiveError::Aborted));
    });
}

#[test]
fn all_reduce_abort_releases_a_blocked_rank() {
    with_watchdog(Duration::from_secs(30), || {
        let (control, ranks) = CpuAllReduce::new(3, 16).unwrap();
        let blocked: Vec<_> = ranks.into_iter().take(2).map(|h| thread::spawn(move || h.sum(&mut [1.0; 16]))).collect();
        thread::sleep(Duration::from_millis(50));
        control.abort();
        for t in blocked {
            assert_eq!(t.join().unwrap(), Err(CollectiveError::Aborted));
        }
    });
}

/// A rank's thread ends early (its handle is dropped mid-sequence): the
/// others get `Aborted` instead of waiting for it forever.
#[test]
fn all_reduce_rank_dropped_mid_sequence_releases_the_others() {
    with_watchdog(Duration::from_secs(30), || {
        for world in [2, 3, 5] {
            let (control, ranks) = CpuAllReduce::new(world, 16).unwrap();
            let threads: Vec<_> = ranks
                .into_iter()
                .map(|h| {
                    thread::spawn(move || {
                        let calls = if h.rank() == 1 { 3 } else { 10 };
                        for call in 0..calls {
                            if let Err(e) = h.sum(&mut [1.0; 16]) {
                                return (call, Err(e));
                            }
                        }
                        if h.rank() == 1 {
                            // Give the others time to block in call 3.
                            thread::sleep(Duration::from_millis(50));
                        }
                        (calls, Ok(()))
                    })
                })
                .collect();
            for (rank, t) in threads.into_iter().enumerate() {
                let (call, result) = t.join().unwrap();
                if rank == 1 {
                    assert_eq!((call, result), (3, Ok(())));
                } else {
                    assert_eq!((call, result), (3, Err(CollectiveError::Aborted)), "rank {rank}");
                }
            }
            assert_eq!(control.abort_origin(), Some(AbortOrigin::Dropped { rank: 1 }));
        }
    });
}

/// Every rank drops its handle right after its last call: nobody's last call
/// fails (with the std barrier too, whose abort used to fail a completed
/// round that a party had not yet looked at).
#[test]
fn all_reduce_rank_dropped_after_the_last_call_is_harmless() {
    with_watchdog(Duration::from_secs(60), || {
        for _ in 0..500 {
            let (control, ranks) = CpuAllReduce::new(2, 4).unwrap();
            let threads: Vec<_> = ranks
                .into_iter()
                .map(|h| {
                    thread::spawn(move || {
                        let mut data = [h.rank() as f32; 4];
                        h.sum(&mut data).map(|()| data)
                    })
                })
                .collect();
            for t in threads {
                assert_eq!(t.join().unwrap(), Ok([1.0; 4]));
            }
            assert!(matches!(control.abort_origin(), Some(AbortOrigin::Dropped { .. })));
        }
    });
}

#[test]
fn features_select_the_group_barrier() {
    let name = std::any::type_name::<ferrum_tp::GroupBarrier>();
    // barrier-std wins when both features are on.
    if cfg!(feature = "barrier-std") {
        assert!(name.ends_with("StdBarrier"), "{name}");
    } else {
        assert!(name.ends_with("SpinParkBarrier"), "{name}");
    }
}
