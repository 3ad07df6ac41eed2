//! Barrier round latency (spin-park vs `std::sync::Barrier`) for 2, 4 and 8
//! parties, and the `TpDecodeGroup::decode_step` round trip with a no-op
//! worker.
//!
//! `cargo bench -p ferrum-tp --bench barrier` (~1–2 min). One party is the
//! bench thread, the others are persistent threads; a sample times `iters`
//! consecutive rounds. Compare with `nproc`: parties ≤ cores is the
//! spinning regime, parties > cores the oversubscribed one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use ferrum_tp::{RankContext, RankWorker, SequenceId, SpinParkBarrier, StdBarrier, StepInput, TpConfig, TpDecodeGroup};

/// `parties - 1` threads looping on `wait` until `stop`; the bench thread is
/// the last party.
struct Parties<B> {
    barrier: Arc<B>,
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
    wait: fn(&B),
}

impl<B: Send + Sync + 'static> Parties<B> {
    fn new(barrier: B, parties: usize, wait: fn(&B)) -> Self {
        let barrier = Arc::new(barrier);
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (1..parties)
            .map(|_| {
                let (b, stop) = (Arc::clone(&barrier), Arc::clone(&stop));
                thread::spawn(move || loop {
                    wait(&b);
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                })
            })
            .collect();
        Self { barrier, stop, threads, wait }
    }

    fn rounds(&self, iters: u64) -> Duration {
        let t0 = Instant::now();
        for _ in 0..iters {
            (self.wait)(&self.barrier);
        }
        t0.elapsed()
    }
}

impl<B> Drop for Parties<B> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        (self.wait)(&self.barrier);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

fn spin_park_wait(b: &SpinParkBarrier) {
    b.wait().unwrap();
}
fn std_wait(b: &std::sync::Barrier) {
    b.wait();
}
fn std_wrapper_wait(b: &StdBarrier) {
    b.wait().unwrap();
}

/// Tuning aid: `FERRUM_TP_BACKOFF=spin_checks,spin_hints_cap,yield_checks`
/// adds a `spin_park_env` variant with that policy.
fn policy_from_env() -> Option<ferrum_tp::BackoffPolicy> {
    let v = std::env::var("FERRUM_TP_BACKOFF").ok()?;
    let n: Vec<u32> = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
    let [spin_checks, spin_hints_cap, yield_checks] = n[..] else {
        return None;
    };
    Some(ferrum_tp::BackoffPolicy { spin_checks, spin_hints_cap, yield_checks })
}

fn barrier_round(c: &mut Criterion) {
    let cores = thread::available_parallelism().map_or(1, |n| n.get());
    let mut group = c.benchmark_group(format!("barrier_round_{cores}cores"));
    group.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for parties in [2usize, 4, 8] {
        {
            let p = Parties::new(SpinParkBarrier::new(parties), parties, spin_park_wait);
            group.bench_with_input(BenchmarkId::new("spin_park", parties), &parties, |b, _| {
                b.iter_custom(|iters| p.rounds(iters));
            });
        }
        if let Some(policy) = policy_from_env() {
            let p = Parties::new(SpinParkBarrier::with_backoff(parties, policy), parties, spin_park_wait);
            group.bench_with_input(BenchmarkId::new("spin_park_env", parties), &parties, |b, _| {
                b.iter_custom(|iters| p.rounds(iters));
            });
        }
        {
            let p = Parties::new(std::sync::Barrier::new(parties), parties, std_wait);
            group.bench_with_input(BenchmarkId::new("std", parties), &parties, |b, _| {
                b.iter_custom(|iters| p.rounds(iters));
            });
        }
        {
            let p = Parties::new(StdBarrier::new(parties), parties, std_wrapper_wait);
            group.bench_with_input(BenchmarkId::new("std_abortable", parties), &parties, |b, _| {
                b.iter_custom(|iters| p.rounds(iters));
            });
        }
    }
    group.finish();
}

struct NoOp;

impl RankWorker for NoOp {
    type Error = std::convert::Infallible;
    fn decode_step(&mut self, _: &RankContext, step: StepInput) -> Result<(), Self::Error> {
        std::hint::black_box(step);
        Ok(())
    }
    fn kv_init(&mut self, _: &RankContext, _: SequenceId) -> Result<(), Self::Error> {
        Ok(())
    }
    fn kv_release(&mut self, _: &RankContext, _: SequenceId) -> Result<(), Self::Error> {
        Ok(())
    }
}

fn decode_step_round_trip(c: &mut Criterion) {
    let cores = thread::available_parallelism().map_or(1, |n| n.get());
    let mut group = c.benchmark_group(format!("decode_step_noop_{cores}cores"));
    group.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for world in [1usize, 2, 7] {
        let mut tp = TpDecodeGroup::new(TpConfig::new(world), |_| Ok(NoOp)).unwrap();
        let label = if cfg!(feature = "barrier-std") { "std" } else { "spin_park" };
        group.bench_with_input(BenchmarkId::new(label, world), &world, |b, _| {
            let mut pos = 0usize;
            b.iter(|| {
                pos += 1;
                tp.decode_step(1, pos, SequenceId(0)).unwrap();
            });
        });
        tp.shutdown().unwrap();
    }
    group.finish();
}

criterion_group!(benches, barrier_round, decode_step_round_trip);
criterion_main!(benches);
