//! One GPU's share of decoding: a [`CudaDecodeRunner`] plus its captured decode graphs.
//!
//! The same [`CudaRank`] serves the single-GPU backend, each thread of the in-process
//! tensor-parallel group ([`crate::cuda_tp`]) and each process of a multi-process run (those two
//! with a reducer installed in the runner, so the all-reduces are captured too: ferrum-cuda's
//! peer all-reduce kernels for an in-process group with peer access, else NCCL's).
//!
//! # Device-fed decoding
//!
//! ```text
//! device_begin(seq, t0, pos0)            host -> device: [t0, pos0]
//! device_steps(seq, first, n) x batches  n steps as graph replays (captured on first use),
//!                                        then the read-back of the n tokens they chose;
//!                                        waits for them
//! device_end(seq, pos0 + kept)           steps run past what the caller kept are discarded
//! ```
//!
//! Each step runs the whole forward pass — every layer, the reductions, the LM head and the
//! choice of the next token, which its last kernel writes back as the next step's input — so
//! the host only enqueues replays and reads tokens back once per batch. A graph holds
//! `CudaDecodeRunner::steps_per_graph` consecutive steps (a batch's remainder replays a
//! one-step graph): inside a graph the next step's first kernel overlaps the last one's end
//! like any other kernel boundary, and a TP rank whose graphs hold NCCL kernels, which waits
//! for each replay, waits once per graph.

use std::time::{Duration, Instant};

use std::sync::Arc;

use ferrum_graph::cudarc::driver::sys::CUevent_flags;
use ferrum_graph::cudarc::driver::CudaEvent;

use ferrum_cuda::peer::PeerHandle;
use ferrum_cuda::timeline::StepTimeline;
use ferrum_cuda::{CudaDecodeRunner, DeviceSampling, DeviceStepKey};
use ferrum_graph::DecodeGraphCache;
use ferrum_nccl::NcclRank;

use crate::error::{Error, Result};

/// Graphs kept per rank: one per live sequence buffer set, sampling mode and step count (4
/// keys of one step count, as before multi-step graphs, times the one-step and the
/// `steps_per_graph` graphs). Only captured graphs are held.
const GRAPH_CACHE: usize = 8;
/// What a captured step depends on besides the runner's fixed buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GraphKey {
    /// Device-fed steps the graph holds (`CudaDecodeRunner::steps_per_graph`, or 1).
    steps: usize,
    step: DeviceStepKey,
    /// `(1/T bits, seed)` when sampling on the device, `None` when greedy.
    sampling: Option<(u32, u64)>,
}

/// Counters of device-fed decoding on one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeviceLoopStats {
    /// Graphs captured.
    pub captures: u64,
    /// Time spent capturing, instantiating and uploading them.
    pub capture_time: Duration,
    /// Device-fed steps run (replayed, or enqueued eagerly).
    pub steps: u64,
    /// Graph replays queued (each runs `steps_per_graph` steps, or one).
    pub replays: u64,
    /// Host time inside the replay calls: from the call to the replay being queued.
    pub enqueue_time: Duration,
}

/// A failure to inject on purpose (failure tests): on rank `rank`, when it is asked to run
/// past `after_steps` decode steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    pub after_steps: u64,
    pub kind: FaultKind,
}

/// What the injected failure is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// A kernel launch that CUDA rejects (a genuine driver error).
    CudaLaunch,
    /// The rank's NCCL communicator is aborted, then the step runs: its all-reduce fails with
    /// NCCL's error while the peers wait in theirs.
    NcclAbort,
    /// The rank's thread panics.
    Panic,
}

/// One GPU's runner and decode graphs.
pub struct CudaRank {
    /// Declared before the runner: graphs are destroyed before the buffers they reference.
    graphs: DecodeGraphCache<GraphKey>,
    runner: CudaDecodeRunner,
    /// Replay captured graphs (default) or enqueue every kernel eagerly.
    graphed: bool,
    stats: DeviceLoopStats,
    rank: usize,
    fault: Option<Fault>,
    /// Aborts this rank's communicator (for [`FaultKind::NcclAbort`]).
    abort: Option<Box<dyn Fn() + Send>>,
    /// The communicator whose collectives the graphs captured (TP): replays are launched only
    /// while it is live (see [`NcclRank::while_live`]).
    comm: Option<Arc<NcclRank>>,
    /// Recorded after each replay on TP ranks (see `device_steps`).
    replay_done: Option<CudaEvent>,
    /// The peer all-reduce group of an in-process TP group, when its decode steps use one:
    /// checked after the GPU work was waited for (a kernel that gave up leaves garbage).
    peer: Option<PeerHandle>,
    /// Graph replays still to record in the kernel timeline (the timeline build of the
    /// kernels; see [`arm_timeline`](Self::arm_timeline)).
    timeline_steps: usize,
    /// The timeline recorded since the last [`arm_timeline`](Self::arm_timeline).
    timeline: Option<StepTimeline>,
}

impl std::fmt::Debug for CudaRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRank")
            .field("rank", &self.rank)
            .field("runner", &self.runner)
            .field("graphed", &self.graphed)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// How `n` device-fed steps run with graphs of `k` steps: `(steps a graph, replays)` pairs, in
/// order. As many `k`-step replays as `n` holds, then the rest as one-step replays (so at most
/// two graphs per sequence and sampling mode, whatever the batch sizes).
fn replay_plan(k: usize, n: usize) -> impl Iterator<Item = (usize, usize)> {
    let k = k.max(1);
    let (multi, rest) = if k > 1 { (n / k, n % k) } else { (0, n) };
    [(k, multi), (1, rest)].into_iter().filter(|&(_, r)| r > 0)
}

/// Maps ferrum-graph's errors onto ferrum-runner's.
fn graph_error(e: ferrum_graph::GraphError) -> Error {
    Error::Unavailable("CUDA graph", e.to_string())
}

impl CudaRank {
    /// Wraps the runner of rank `rank` (0 on one GPU). Graphs are on.
    pub fn new(runner: CudaDecodeRunner, rank: usize) -> Self {
        Self {
            graphs: DecodeGraphCache::new(GRAPH_CACHE),
            runner,
            graphed: true,
            stats: DeviceLoopStats::default(),
            rank,
            fault: None,
            abort: None,
            comm: None,
            replay_done: None,
            peer: None,
            timeline_steps: 0,
            timeline: None,
        }
    }

    /// Sets the peer group whose kernels the runner's reducer launches (see
    /// [`ferrum_cuda::peer`]); [`check_peer`](Self::check_peer) then reports their failures.
    pub fn set_peer(&mut self, peer: PeerHandle) {
        self.peer = Some(peer);
    }

    /// The peer group set by [`set_peer`](Self::set_peer), if any (to abort it from outside).
    pub fn peer(&self) -> Option<&PeerHandle> {
        self.peer.as_ref()
    }

    /// `Ok` unless this rank's collectives failed: its communicator was aborted (a GPU wait
    /// that returned after an abort leaves garbage) or a peer all-reduce gave up. Call it once
    /// the rank's stream was waited for.
    pub fn check_collectives(&self) -> Result<()> {
        if let Some(c) = &self.comm {
            c.while_live(|| ()).map_err(|e| Error::Tp(format!("rank {}: {e}", self.rank)))?;
        }
        self.check_peer()
    }

    /// `Ok` unless a peer all-reduce of this rank gave up (aborted, or timed out waiting for a
    /// peer): call it once the rank's stream was waited for.
    pub fn check_peer(&self) -> Result<()> {
        match &self.peer {
            None => Ok(()),
            Some(p) => p.check().map_err(|e| Error::Tp(format!("rank {}: {e}", self.rank))),
        }
    }

    /// Sets the communicator the runner's reducer uses (graph replays then check it is live).
    pub fn set_comm(&mut self, comm: Arc<NcclRank>) {
        self.comm = Some(comm);
    }

    /// The runner.
    pub fn runner(&mut self) -> &mut CudaDecodeRunner {
        &mut self.runner
    }

    /// The vocabulary size.
    pub fn spec_vocab(&self) -> usize {
        self.runner.spec().vocab
    }

    /// Whether device-fed steps replay graphs.
    pub fn graphed(&self) -> bool {
        self.graphed
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Replay captured graphs (`true`, the default) or enqueue each kernel (`false`).
    pub fn set_graphed(&mut self, graphed: bool) {
        self.graphed = graphed;
    }

    /// Device-fed decoding counters.
    pub fn stats(&self) -> DeviceLoopStats {
        self.stats
    }

    /// Arms a failure for tests (it fires on this rank only if `fault.rank` is this rank).
    pub fn set_fault(&mut self, fault: Option<Fault>, abort: Option<Box<dyn Fn() + Send>>) {
        self.fault = fault.filter(|f| f.rank == self.rank);
        self.abort = abort;
    }

    /// Fires the armed fault if `n` more steps would run past it.
    fn maybe_fail(&mut self, n: u64) -> Result<()> {
        let Some(f) = self.fault else { return Ok(()) };
        if self.stats.steps + n <= f.after_steps {
            return Ok(());
        }
        self.fault = None;
        tracing::warn!(rank = self.rank, kind = ?f.kind, "injecting a failure");
        match f.kind {
            FaultKind::CudaLaunch => self.runner.inject_launch_failure().map_err(crate::cuda_backend::cuda_error),
            FaultKind::NcclAbort => {
                if let Some(abort) = &self.abort {
                    abort();
                }
                Ok(()) // the step's all-reduce now fails
            }
            FaultKind::Panic => panic!("injected panic on rank {}", self.rank),
        }
    }

    /// One host-fed eager step (the path that returns logits every step).
    pub fn step(&mut self, seq: u64, token: u32, position: usize) -> Result<()> {
        self.maybe_fail(1)?;
        self.stats.steps += 1;
        self.runner.decode_step(seq, token, position).map(|_| ()).map_err(crate::cuda_backend::cuda_error)
    }

    /// Starts device-fed decoding of `seq` from `token` at `position`.
    pub fn device_begin(&mut self, seq: u64, token: u32, position: usize) -> Result<()> {
        self.runner.device_decode_begin(seq, token, position).map_err(crate::cuda_backend::cuda_error)
    }

    /// Runs `n` device-fed steps of `seq` and returns the `n` tokens they chose (those at
    /// positions `first .. first + n`, `first` being one past the position of the first step).
    /// Waits for the GPU once, at the end.
    pub fn device_steps(&mut self, seq: u64, first: usize, n: usize, sampling: DeviceSampling) -> Result<Vec<u32>> {
        tracing::trace!(rank = self.rank, seq, first, n, "device steps");
        self.maybe_fail(n as u64)?;
        let cuda = crate::cuda_backend::cuda_error;
        if self.graphed {
            // The kernel timeline maps one step per replay row: while it records, one step a
            // graph.
            let k = if self.timeline_steps > 0 { 1 } else { self.runner.steps_per_graph() };
            for (steps, replays) in replay_plan(k, n) {
                self.replay_graphs(seq, sampling, steps, replays)?;
            }
        } else {
            for _ in 0..n {
                self.runner.enqueue_device_step(seq, sampling).map_err(cuda)?;
            }
        }
        self.stats.steps += n as u64;
        self.runner.enqueue_token_readback(seq, first, n).map_err(cuda)?;
        let tokens = self.runner.token_readback().map_err(cuda)?.to_vec();
        self.check_peer()?;
        Ok(tokens)
    }

    /// `n` replays of the graph of `steps` consecutive device-fed steps of `seq` (captured on
    /// first use): `n * steps` steps.
    fn replay_graphs(&mut self, seq: u64, sampling: DeviceSampling, steps: usize, n: usize) -> Result<()> {
        let cuda = crate::cuda_backend::cuda_error;
        let key = GraphKey {
            steps,
            step: self.runner.device_step_key(seq).map_err(cuda)?,
            sampling: sampling.kernel_args().map_err(cuda)?.map(|(t, s)| (t.to_bits(), s)),
        };
        let stream = self.runner.stream().clone();
        let t0 = Instant::now();
        let runner = &mut self.runner;
        let mut captured = false;
        let graph = self
            .graphs
            .get_or_capture(key, &stream, |_scope| {
                captured = true;
                (0..steps).try_for_each(|_| runner.enqueue_device_step(seq, sampling))
            })
            .map_err(graph_error)?;
        if captured {
            graph.upload(&stream).map_err(graph_error)?;
            self.stats.captures += 1;
            self.stats.capture_time += t0.elapsed();
        }
        // A replay does not go through the runner's checks: make sure `seq` still owns the
        // step buffer.
        self.runner.check_fed(seq).map_err(cuda)?;
        // Timeline build, when armed: the first `record` replays stamp, each as its own
        // replay row (stream-ordered flag copies between the replays).
        let record = self.timeline_steps.min(n).min(ferrum_cuda::timeline::REPLAYS);
        self.timeline_steps -= record;
        // Only the runner modules' kernels stamp (`timeline::stamps`): the other nodes (NCCL's
        // collectives, cuBLAS, the peer group's own all-reduce at the TP vocab split) are left
        // out of the mapping, and the kernel before one of them is charged its time up to the
        // next stamping kernel.
        let names: Option<Vec<String>> = (record > 0)
            .then(|| graph.kernel_names().iter().filter(|n| ferrum_cuda::timeline::stamps(n)).cloned().collect());
        let runner = &self.runner;
        let mark = |i: usize| -> Result<()> {
            if i < record {
                runner.timeline_arm(Some(i as u32)).map_err(cuda)?;
            } else if i == record && record > 0 {
                runner.timeline_arm(None).map_err(cuda)?;
            }
            Ok(())
        };
        let comm = self.comm.clone();
        let replay_all = || -> Result<()> {
            match comm {
                None => {
                    for i in 0..n {
                        mark(i)?;
                        let t = Instant::now();
                        graph.replay(&stream).map_err(graph_error)?;
                        self.stats.enqueue_time += t.elapsed();
                        self.stats.replays += 1;
                    }
                    mark(n)?;
                }
                Some(c) => {
                    // The graph holds NCCL kernels: launch it only while its communicator is
                    // live (under the communicator's lock, so an abort cannot free it mid-launch),
                    // one replay at a time, each after the previous one finished. So
                    // cuGraphLaunch never blocks on a full launch queue while holding the lock,
                    // and an abort from another thread (the group's failure path) can always
                    // take it. The wait is an event synchronisation (cuEventSynchronize) outside the lock:
                    // an abort makes NCCL kernels stuck on a dead peer exit, so it returns, and
                    // the next `while_live` fails at once instead of waiting for the aborting
                    // thread (whose ncclCommAbort can wait for this thread to drop its graphs:
                    // see `NcclRank::while_live`).
                    let ev = match self.replay_done.take() {
                        Some(e) => e,
                        None => stream
                            .context()
                            .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                            .map_err(|e| Error::Unavailable("CUDA", format!("creating an event: {e}")))?,
                    };
                    let ev = &*self.replay_done.insert(ev);
                    let rank = self.rank;
                    for i in 0..n {
                        mark(i)?;
                        let t = Instant::now();
                        c.while_live(|| graph.replay(&stream))
                            .map_err(|e| Error::Tp(format!("rank {rank}: {e}")))?
                            .map_err(graph_error)?;
                        self.stats.enqueue_time += t.elapsed();
                        self.stats.replays += 1;
                        ev.record(&stream).map_err(|e| Error::Unavailable("CUDA", format!("event record: {e}")))?;
                        ev.synchronize().map_err(|e| Error::Unavailable("CUDA", format!("rank {rank}: {e}")))?;
                    }
                    mark(n)?;
                    // A replay also "finishes" when an abort made its NCCL kernels exit; its
                    // tokens are then garbage. The abort marks the communicator before it starts
                    // (under the lock `while_live` takes), so this refuses them.
                    c.while_live(|| ()).map_err(|e| Error::Tp(format!("rank {rank}: {e}")))?;
                }
            }
            Ok(())
        };
        let replayed = replay_all();
        if replayed.is_err() && record > 0 {
            // Leave no later kernel stamping (best effort: the stream may be broken).
            let _ = runner.timeline_arm(None);
        }
        replayed?;
        if let Some(names) = names {
            // Mapped per call (grid ids are consecutive within a run of replays only),
            // then merged with the earlier calls' recordings.
            let stamps = self.runner.timeline_read().map_err(cuda)?;
            let t = ferrum_cuda::timeline::step_timeline(&stamps, &names);
            self.timeline
                .get_or_insert_with(Default::default)
                .merge(&t)
                .map_err(|e| Error::Unavailable("kernel timeline", e.to_string()))?;
        }
        Ok(())
    }

    /// Records the kernel timeline of the next `steps` graph replays of
    /// [`device_steps`](Self::device_steps) calls (see ferrum-cuda's `timeline`). `false` when the
    /// kernels are not the timeline build (`cargo xtask ptx --timeline`), which records nothing.
    pub fn arm_timeline(&mut self, steps: usize) -> bool {
        let ok = self.runner.has_timeline();
        self.timeline_steps = if ok { steps } else { 0 };
        self.timeline = None;
        ok
    }

    /// The timeline recorded since [`arm_timeline`](Self::arm_timeline), if any.
    pub fn take_timeline(&mut self) -> Option<StepTimeline> {
        // A decode stopped before all the armed steps ran leaves nothing armed for the next.
        self.timeline_steps = 0;
        self.timeline.take()
    }

    /// Ends device-fed decoding: `seq` keeps `len` tokens.
    pub fn device_end(&mut self, seq: u64, len: usize) -> Result<()> {
        self.runner.device_decode_end(seq, len).map_err(crate::cuda_backend::cuda_error)
    }
}

#[cfg(test)]
mod tests {
    use super::replay_plan;

    #[test]
    fn replay_plans_cover_every_step_with_at_most_two_graphs() {
        let plan = |k, n| replay_plan(k, n).collect::<Vec<_>>();
        assert_eq!(plan(1, 32), [(1, 32)]);
        assert_eq!(plan(8, 32), [(8, 4)]);
        assert_eq!(plan(8, 4), [(1, 4)]);
        assert_eq!(plan(3, 8), [(3, 2), (1, 2)]);
        assert_eq!(plan(0, 5), [(1, 5)]);
        assert!(plan(4, 0).is_empty());
        for k in 1..=32 {
            for n in 0..=100 {
                let p = plan(k, n);
                assert_eq!(p.iter().map(|&(s, r)| s * r).sum::<usize>(), n, "k {k} n {n}");
                assert!(p.iter().all(|&(s, _)| s == 1 || s == k), "k {k} n {n}: {p:?}");
            }
        }
    }
}
