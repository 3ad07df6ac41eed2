//! [`TpDecodeGroup`]: one persistent thread per tensor-parallel rank, released
//! once per decode step by the group barrier.
//!
//! # How a round works
//!
//! The barrier has `world_size + 1` parties: the ranks and the caller's
//! thread. The rank threads loop:
//!
//! ```text
//! loop {
//!     barrier.wait()            // "start": released by the caller
//!     match op { STEP => worker.decode_step(..), COMMAND => run the queued command }
//!     barrier.wait()            // "end": the caller learns the step is done
//! }
//! ```
//!
//! * **Hot path** ([`TpDecodeGroup::decode_step`]): the caller stores the
//!   step's parameters (token, position, sequence) and the op code in
//!   relaxed atomics, then passes the start barrier, then waits at the end
//!   barrier. The barrier is a full rendezvous (everything written before it
//!   happens-before everything after it), so the ranks read the parameters
//!   after the start barrier, and the caller reads the outcome after the end
//!   barrier. Nothing is allocated; no channel or lock is touched.
//! * **Cold path** (KV init/release, [`TpDecodeGroup::run_on_ranks`],
//!   shutdown): the caller sends the command into each rank's crossbeam
//!   channel *before* releasing the start barrier, so each rank's `try_recv`
//!   after the barrier always finds it. A missing command is reported as
//!   [`TpError::Protocol`], never skipped.
//! * **Failure**: a rank whose worker returns an error or panics records it
//!   in its failure slot, claims `first_failure` (so the root cause wins over
//!   peers that fail *because* of it), aborts the all-reduce (peers blocked in
//!   it return [`CollectiveError::Aborted`]) and the barrier (the caller and
//!   the other ranks return at once), and its thread ends. The caller returns
//!   the root cause ([`TpError::Rank`] or [`TpError::RankPanicked`], naming
//!   the rank) and the group is poisoned: later calls return
//!   [`TpError::Poisoned`]. Any failure poisons the group, cold-path ones
//!   included: after it the ranks' states (KV caches) may disagree, and the
//!   collective is dead.
//! * **A rank that aborts the all-reduce itself** (too long a buffer) does so
//!   before its worker has returned, so its peers wake with `Aborted` and may
//!   fail first. Their failures are secondary ([`AbortOrigin::TooLong`] names
//!   the culprit): they record them but neither claim `first_failure` nor
//!   abort the barrier, which would wake the caller before the culprit's
//!   failure is recorded. The culprit's thread does both once its worker
//!   returns: with the worker's error or panic, or, if the worker swallowed
//!   the error and returned `Ok`, with [`TpError::Collective`]. (The caller
//!   thus waits for the culprit's worker to return, as every round does.)
//! * **Drop** never hangs: a healthy group runs a shutdown round, a poisoned
//!   one is already aborted; then every thread is joined. (A worker that
//!   never returns from a call cannot be joined; nothing can fix that from
//!   outside the worker.)

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use crossbeam_utils::CachePadded;

use crate::all_reduce::{AbortOrigin, AllReduceRank, CollectiveError, CpuAllReduce};
use crate::{AbortableBarrier, GroupBarrier};

/// Identifies a sequence (a request) whose KV cache the ranks hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceId(pub u64);

impl fmt::Display for SequenceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq#{}", self.0)
    }
}

/// The parameters of one decode step, as every rank sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepInput {
    /// The token to feed.
    pub token: u32,
    /// Its position in the sequence (0-based).
    pub position: usize,
    /// The sequence whose KV cache to use.
    pub sequence: SequenceId,
}

/// What a rank knows about its place in the group, and its collectives.
/// Passed to every [`RankWorker`] call, on the rank's own thread.
#[derive(Debug)]
pub struct RankContext {
    rank: usize,
    world_size: usize,
    all_reduce: AllReduceRank,
}

impl RankContext {
    /// This rank, `0..world_size`.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// In-place all-reduce (sum) over all ranks of the group, bit-identical on
    /// every rank; allocation-free. See [`AllReduceRank::sum`].
    ///
    /// # Errors
    /// As [`AllReduceRank::sum`]; in particular [`CollectiveError::Aborted`]
    /// promptly when another rank has failed.
    #[inline]
    pub fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CollectiveError> {
        self.all_reduce.sum(data)
    }

    /// This rank's all-reduce handle.
    #[must_use]
    pub fn all_reduce(&self) -> &AllReduceRank {
        &self.all_reduce
    }
}

/// The work of one rank: its shard of the model and its KV caches.
///
/// The worker is created *on its rank's thread* by the factory given to
/// [`TpDecodeGroup::new`] and never leaves it, so it need not be `Send`
/// (a CUDA rank can own thread-bound device state). Every method runs on
/// that thread, once per rank per call of the group.
pub trait RankWorker: 'static {
    /// The worker's error; the group returns it as [`TpError::Rank`].
    type Error: std::error::Error + Send + 'static;

    /// One decode step on this rank's shard. Collectives (e.g.
    /// [`RankContext::all_reduce_sum`]) must be called by every rank in the
    /// same order. Unknown sequences are the worker's to report.
    ///
    /// # Errors
    /// Any error poisons the group (the caller gets it as [`TpError::Rank`]).
    fn decode_step(&mut self, ctx: &RankContext, step: StepInput) -> Result<(), Self::Error>;

    /// Allocate this rank's KV cache for `sequence`.
    ///
    /// # Errors
    /// Any error poisons the group.
    fn kv_init(&mut self, ctx: &RankContext, sequence: SequenceId) -> Result<(), Self::Error>;

    /// Free this rank's KV cache for `sequence`.
    ///
    /// # Errors
    /// Any error poisons the group.
    fn kv_release(&mut self, ctx: &RankContext, sequence: SequenceId) -> Result<(), Self::Error>;
}

/// What went wrong with a [`TpDecodeGroup`].
#[derive(Debug, thiserror::Error)]
pub enum TpError<E> {
    /// A TP degree (world size) of 0 was requested.
    #[error("tensor-parallel world size must be at least 1, got 0")]
    ZeroWorldSize,
    /// A rank thread could not be spawned.
    #[error("could not spawn the thread of TP rank {rank}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A rank's worker (or its factory) returned an error. The group is
    /// poisoned.
    #[error("TP rank {rank} failed")]
    Rank {
        /// The failing rank.
        rank: usize,
        /// The worker's error.
        #[source]
        source: E,
    },
    /// A rank's worker (or its factory, or its drop) panicked. The group is
    /// poisoned.
    #[error("TP rank {rank} panicked: {message}")]
    RankPanicked {
        /// The panicking rank.
        rank: usize,
        /// The panic payload, if it was a string.
        message: String,
    },
    /// A rank's all-reduce call aborted the collective (its buffer was longer
    /// than [`TpConfig::all_reduce_max_len`]) but its worker returned `Ok`
    /// regardless. The group is poisoned.
    #[error("TP rank {rank}'s all-reduce failed and aborted the group, but its worker returned Ok")]
    Collective {
        /// The rank.
        rank: usize,
        /// Its all-reduce's error.
        #[source]
        source: CollectiveError,
    },
    /// A rank found the group's protocol broken (a bug in this crate). The
    /// group is poisoned.
    #[error("TP group protocol error{}: {detail}", fmt_rank(*.rank))]
    Protocol {
        /// The rank concerned, if known.
        rank: Option<usize>,
        /// What it noticed.
        detail: &'static str,
    },
    /// The group was poisoned by an earlier failure (of `rank`, if known);
    /// it must be dropped and rebuilt.
    #[error("the TP group is poisoned by an earlier failure{}", fmt_rank(*.rank))]
    Poisoned {
        /// The rank whose failure poisoned the group, if known.
        rank: Option<usize>,
    },
    /// The group has been shut down.
    #[error("the TP group has been shut down")]
    ShutDown,
    /// The group's all-reduce could not be built: its buffers
    /// (`2 × world_size × all_reduce_max_len` floats) are too large
    /// ([`CollectiveError::TooLarge`]).
    #[error("could not build the TP group's all-reduce")]
    AllReduce(#[source] CollectiveError),
}

fn fmt_rank(rank: Option<usize>) -> String {
    rank.map_or_else(String::new, |r| format!(" of rank {r}"))
}

/// Configuration of a [`TpDecodeGroup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpConfig {
    /// Number of ranks (TP degree). Must be ≥ 1.
    pub world_size: usize,
    /// Capacity, in floats, of the group's [`CpuAllReduce`] buffers (the
    /// longest vector a worker will all-reduce, e.g. `hidden_size`). 0 if the
    /// workers use no CPU all-reduce.
    pub all_reduce_max_len: usize,
    /// Stack size of the rank threads (`None`: std's default).
    pub stack_size: Option<usize>,
}

impl TpConfig {
    /// `world_size` ranks, no all-reduce buffers, default stacks.
    #[must_use]
    pub fn new(world_size: usize) -> Self {
        Self { world_size, all_reduce_max_len: 0, stack_size: None }
    }

    /// Sets [`all_reduce_max_len`](Self::all_reduce_max_len).
    #[must_use]
    pub fn all_reduce_max_len(mut self, max_len: usize) -> Self {
        self.all_reduce_max_len = max_len;
        self
    }

    /// Sets [`stack_size`](Self::stack_size).
    #[must_use]
    pub fn stack_size(mut self, bytes: usize) -> Self {
        self.stack_size = Some(bytes);
        self
    }
}

const OP_STEP: u32 = 1;
const OP_COMMAND: u32 = 2;
const NO_FAILURE: usize = usize::MAX;

type RunFn<W> = dyn Fn(&mut W, &RankContext) -> Result<Box<dyn Any + Send>, <W as RankWorker>::Error> + Send + Sync;

enum Command<W: RankWorker> {
    KvInit(SequenceId),
    KvRelease(SequenceId),
    Run(Arc<RunFn<W>>),
    Shutdown,
}

enum Failure<E> {
    Error(E),
    Panic(String),
    /// The worker returned `Ok` after its own all-reduce call aborted.
    Collective(CollectiveError),
    Protocol(&'static str),
}

/// State shared by the caller's thread and the rank threads.
struct Shared<E> {
    barrier: GroupBarrier,
    /// The step's parameters and op code: written (Relaxed) by the caller
    /// before the start barrier, read (Relaxed) by the ranks after it; the
    /// barrier's rendezvous orders them. Together on one line: they are
    /// written together and read together.
    params: CachePadded<Params>,
    /// The rank whose failure came first (`NO_FAILURE` if none).
    first_failure: CachePadded<AtomicUsize>,
    /// Per rank: its failure, if any. Locked only on failure.
    failures: Box<[parking_lot::Mutex<Option<Failure<E>>>]>,
    all_reduce: CpuAllReduce,
}

struct Params {
    op: AtomicU32,
    token: AtomicU32,
    position: AtomicUsize,
    sequence: AtomicU64,
}

impl<E> Shared<E> {
    /// Record a failure of `rank` and abort everything so no one waits for it
    /// (unless another rank aborted the all-reduce first: see below).
    #[cold]
    fn fail(&self, rank: usize, failure: Failure<E>) {
        *self.failures[rank].lock() = Some(failure);
        if let Some(AbortOrigin::TooLong { rank: culprit }) = self.all_reduce.abort_origin() {
            if culprit != rank {
                // Secondary (module docs): `culprit` is still inside its
                // worker call, and its thread claims and aborts once that
                // returns (`rank_main`). Aborting the barrier now would wake
                // the caller before the root cause is recorded, and our
                // claim would hide it.
                tracing::debug!(rank, culprit, "TP rank failed after another rank aborted the all-reduce");
                return;
            }
        }
        // AcqRel/Acquire: the failure slot written above is ordered before
        // the claim, and the claim before the aborts below (whose Release the
        // caller acquires when its wait fails). First claim wins: a peer that
        // fails because of our abort claims later.
        let _ = self.first_failure.compare_exchange(NO_FAILURE, rank, Ordering::AcqRel, Ordering::Acquire);
        self.all_reduce.abort();
        self.barrier.abort();
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Running,
    Poisoned(Option<usize>),
    ShutDown,
}

/// A tensor-parallel decode group: `world_size` persistent threads
/// (`tp-rank-{r}`), each owning one [`RankWorker`], driven in lock-step by the
/// caller. See the [module docs](self) for the protocol.
///
/// ```
/// use ferrum_tp::{RankContext, RankWorker, SequenceId, StepInput, TpConfig, TpDecodeGroup};
///
/// struct Shard;
/// impl RankWorker for Shard {
///     type Error = std::io::Error;
///     fn decode_step(&mut self, ctx: &RankContext, _: StepInput) -> Result<(), Self::Error> {
///         let mut partial = [ctx.rank() as f32; 4];
///         ctx.all_reduce_sum(&mut partial).map_err(std::io::Error::other)?;
///         Ok(())
///     }
///     fn kv_init(&mut self, _: &RankContext, _: SequenceId) -> Result<(), Self::Error> { Ok(()) }
///     fn kv_release(&mut self, _: &RankContext, _: SequenceId) -> Result<(), Self::Error> { Ok(()) }
/// }
///
/// let mut group = TpDecodeGroup::new(TpConfig::new(2).all_reduce_max_len(4), |_ctx| Ok(Shard))?;
/// group.kv_init(SequenceId(7))?;
/// group.decode_step(42, 0, SequenceId(7))?;
/// group.kv_release(SequenceId(7))?;
/// group.shutdown()?;
/// # Ok::<(), ferrum_tp::TpError<std::io::Error>>(())
/// ```
pub struct TpDecodeGroup<W: RankWorker> {
    world_size: usize,
    shared: Arc<Shared<W::Error>>,
    commands: Vec<Sender<Command<W>>>,
    replies: Receiver<(usize, Box<dyn Any + Send>)>,
    threads: Vec<JoinHandle<()>>,
    status: Status,
}

impl<W: RankWorker> fmt::Debug for TpDecodeGroup<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TpDecodeGroup")
            .field("world_size", &self.world_size)
            .field("status", &self.status)
            .field("barrier", &self.shared.barrier)
            .finish_non_exhaustive()
    }
}

impl<W: RankWorker> TpDecodeGroup<W> {
    /// Spawns `config.world_size` rank threads, named `tp-rank-{r}`; each calls
    /// `factory` with its [`RankContext`] to build its worker (on its own
    /// thread), then waits for work. Returns once every worker is built.
    ///
    /// # Errors
    /// [`TpError::ZeroWorldSize`]; [`TpError::AllReduce`] when the
    /// all-reduce's buffers are too large; [`TpError::Spawn`]; the factory's error
    /// ([`TpError::Rank`]) or panic ([`TpError::RankPanicked`]) on any rank.
    /// On error every thread already spawned has been joined.
    pub fn new<F>(config: TpConfig, factory: F) -> Result<Self, TpError<W::Error>>
    where
        F: Fn(&RankContext) -> Result<W, W::Error> + Send + Sync + 'static,
    {
        let world_size = config.world_size;
        let (all_reduce, rank_handles) =
            CpuAllReduce::new(world_size, config.all_reduce_max_len).map_err(|e| match e {
                CollectiveError::ZeroWorldSize => TpError::ZeroWorldSize,
                e => TpError::AllReduce(e),
            })?;
        let shared = Arc::new(Shared {
            barrier: GroupBarrier::with_parties(world_size + 1),
            params: CachePadded::new(Params {
                op: AtomicU32::new(0),
                token: AtomicU32::new(0),
                position: AtomicUsize::new(0),
                sequence: AtomicU64::new(0),
            }),
            first_failure: CachePadded::new(AtomicUsize::new(NO_FAILURE)),
            failures: (0..world_size).map(|_| parking_lot::Mutex::new(None)).collect(),
            all_reduce,
        });
        let (reply_tx, replies) = crossbeam_channel::unbounded();
        let mut group = Self {
            world_size,
            shared,
            commands: Vec::with_capacity(world_size),
            replies,
            threads: Vec::with_capacity(world_size),
            status: Status::Running,
        };
        let factory = Arc::new(factory);
        for (rank, all_reduce) in rank_handles.into_iter().enumerate() {
            let (command_tx, command_rx) = crossbeam_channel::unbounded();
            let ctx = RankContext { rank, world_size, all_reduce };
            let shared = Arc::clone(&group.shared);
            let factory = Arc::clone(&factory);
            let reply_tx = reply_tx.clone();
            let mut builder = std::thread::Builder::new().name(format!("tp-rank-{rank}"));
            if let Some(bytes) = config.stack_size {
                builder = builder.stack_size(bytes);
            }
            let spawned = builder.spawn(move || {
                rank_main(&ctx, &shared, &*factory, &command_rx, &reply_tx);
            });
            match spawned {
                Ok(handle) => {
                    group.threads.push(handle);
                    group.commands.push(command_tx);
                }
                Err(source) => {
                    // Dropping `group` aborts and joins the ranks spawned so far.
                    group.status = Status::Poisoned(None);
                    return Err(TpError::Spawn { rank, source });
                }
            }
        }
        // The "ready" round: every rank arrives once its worker is built.
        if group.shared.barrier.wait().is_err() || group.failed() {
            return Err(group.poison());
        }
        tracing::debug!(world_size, "TP decode group ready");
        Ok(group)
    }

    /// Number of ranks.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Whether an earlier failure has poisoned the group.
    #[must_use]
    pub fn is_poisoned(&self) -> bool {
        matches!(self.status, Status::Poisoned(_))
    }

    /// One decode step on every rank: releases the ranks, which run
    /// [`RankWorker::decode_step`] with these parameters, and waits for all of
    /// them. Allocates nothing.
    ///
    /// # Errors
    /// [`TpError::Rank`] / [`TpError::RankPanicked`] naming the first rank that
    /// failed (the group is then poisoned); [`TpError::Poisoned`] or
    /// [`TpError::ShutDown`] if the group was already unusable.
    #[inline]
    pub fn decode_step(&mut self, token: u32, position: usize, sequence: SequenceId) -> Result<(), TpError<W::Error>> {
        self.check_usable()?;
        let params = &self.shared.params;
        // Relaxed (all four): published to the ranks by the start barrier's
        // rendezvous (see the module docs).
        params.token.store(token, Ordering::Relaxed);
        params.position.store(position, Ordering::Relaxed);
        params.sequence.store(sequence.0, Ordering::Relaxed);
        params.op.store(OP_STEP, Ordering::Relaxed);
        self.round()
    }

    /// Runs [`RankWorker::kv_init`] for `sequence` on every rank.
    ///
    /// # Errors
    /// As [`decode_step`](Self::decode_step).
    pub fn kv_init(&mut self, sequence: SequenceId) -> Result<(), TpError<W::Error>> {
        self.command(|| Command::KvInit(sequence))
    }

    /// Runs [`RankWorker::kv_release`] for `sequence` on every rank.
    ///
    /// # Errors
    /// As [`decode_step`](Self::decode_step).
    pub fn kv_release(&mut self, sequence: SequenceId) -> Result<(), TpError<W::Error>> {
        self.command(|| Command::KvRelease(sequence))
    }

    /// Runs `f` on every rank's thread with its worker (cold path: allocates),
    /// and returns the results in rank order. For whatever the trait does not
    /// cover: reading outputs, prefill, statistics.
    ///
    /// # Errors
    /// As [`decode_step`](Self::decode_step); an error returned by `f`
    /// poisons the group like any worker error.
    pub fn run_on_ranks<R, F>(&mut self, f: F) -> Result<Vec<R>, TpError<W::Error>>
    where
        R: Send + 'static,
        F: Fn(&mut W, &RankContext) -> Result<R, W::Error> + Send + Sync + 'static,
    {
        let f: Arc<RunFn<W>> =
            Arc::new(move |w: &mut W, ctx: &RankContext| f(w, ctx).map(|r| Box::new(r) as Box<dyn Any + Send>));
        self.command(|| Command::Run(Arc::clone(&f)))?;
        let mut results: Vec<Option<R>> = (0..self.world_size).map(|_| None).collect();
        for _ in 0..self.world_size {
            // Every rank sent its reply before arriving at the end barrier.
            let Ok((rank, reply)) = self.replies.try_recv() else {
                return Err(self.protocol_failure("a rank's reply is missing"));
            };
            match reply.downcast::<R>() {
                Ok(r) => results[rank] = Some(*r),
                Err(_) => return Err(self.protocol_failure("a rank's reply has the wrong type")),
            }
        }
        results
            .into_iter()
            .collect::<Option<Vec<R>>>()
            .ok_or_else(|| self.protocol_failure("two replies from one rank"))
    }

    /// Shuts the group down: every rank drops its worker (on its own thread)
    /// and its thread ends; joins them all. Later calls return
    /// [`TpError::ShutDown`]. Idempotent; on a poisoned group it only tears
    /// down (and returns `Ok`).
    ///
    /// # Errors
    /// [`TpError::RankPanicked`] if a worker's drop panicked.
    pub fn shutdown(&mut self) -> Result<(), TpError<W::Error>> {
        let result = match self.status {
            Status::Running => {
                let result = self.command(|| Command::Shutdown);
                if result.is_ok() {
                    self.status = Status::ShutDown;
                }
                result
            }
            Status::Poisoned(_) | Status::ShutDown => Ok(()),
        };
        self.join_all();
        result
    }

    fn check_usable(&self) -> Result<(), TpError<W::Error>> {
        match self.status {
            Status::Running => Ok(()),
            Status::Poisoned(rank) => Err(TpError::Poisoned { rank }),
            Status::ShutDown => Err(TpError::ShutDown),
        }
    }

    /// Queue one command per rank, then run a command round.
    #[cold]
    fn command(&mut self, make: impl Fn() -> Command<W>) -> Result<(), TpError<W::Error>> {
        self.check_usable()?;
        for tx in &self.commands {
            if tx.send(make()).is_err() {
                // The rank's thread is gone: only possible after a failure.
                return Err(self.poison());
            }
        }
        // Relaxed: published by the start barrier, as in `decode_step`.
        self.shared.params.op.store(OP_COMMAND, Ordering::Relaxed);
        self.round()
    }

    /// Start barrier, end barrier, check for failures.
    #[inline]
    fn round(&mut self) -> Result<(), TpError<W::Error>> {
        let barrier = &self.shared.barrier;
        if barrier.wait().is_ok() && barrier.wait().is_ok() && !self.failed() {
            Ok(())
        } else {
            Err(self.poison())
        }
    }

    #[inline]
    fn failed(&self) -> bool {
        // Relaxed: read after a barrier round (which orders a rank's claim
        // before it) or after an aborted wait (whose Acquire read of the
        // abort orders the claim before it).
        self.shared.first_failure.load(Ordering::Relaxed) != NO_FAILURE
    }

    /// Poison the group and return the root cause.
    #[cold]
    #[inline(never)]
    fn poison(&mut self) -> TpError<W::Error> {
        self.shared.all_reduce.abort();
        self.shared.barrier.abort();
        // Acquire: pairs with the AcqRel claim in `Shared::fail`, making the
        // failure slot (written before the claim) visible.
        let first = self.shared.first_failure.load(Ordering::Acquire);
        let rank = (first != NO_FAILURE).then_some(first);
        if let Status::Poisoned(earlier) = self.status {
            return TpError::Poisoned { rank: earlier };
        }
        self.status = Status::Poisoned(rank);
        let Some(rank) = rank else {
            return TpError::Poisoned { rank: None };
        };
        let failure = self.shared.failures[rank].lock().take();
        match failure {
            Some(Failure::Error(source)) => {
                tracing::error!(rank, error = %source, "TP rank failed; group poisoned");
                TpError::Rank { rank, source }
            }
            Some(Failure::Panic(message)) => {
                tracing::error!(rank, %message, "TP rank panicked; group poisoned");
                TpError::RankPanicked { rank, message }
            }
            Some(Failure::Collective(source)) => {
                tracing::error!(rank, error = %source, "TP rank's all-reduce failed unreported; group poisoned");
                TpError::Collective { rank, source }
            }
            Some(Failure::Protocol(detail)) => TpError::Protocol { rank: Some(rank), detail },
            None => TpError::Poisoned { rank: Some(rank) },
        }
    }

    #[cold]
    fn protocol_failure(&mut self, detail: &'static str) -> TpError<W::Error> {
        let _ = self.poison();
        TpError::Protocol { rank: None, detail }
    }

    fn join_all(&mut self) {
        if self.status != Status::ShutDown {
            // Not a clean shutdown: make sure no rank waits for anything.
            self.shared.all_reduce.abort();
            self.shared.barrier.abort();
        }
        for (rank, handle) in self.threads.drain(..).enumerate() {
            if handle.join().is_err() {
                tracing::error!(rank, "TP rank thread panicked outside its worker");
            }
        }
    }
}

impl<W: RankWorker> Drop for TpDecodeGroup<W> {
    fn drop(&mut self) {
        if self.status == Status::Running {
            if let Err(err) = self.shutdown() {
                tracing::error!(error = %err, "TP group shutdown failed during drop");
            }
        }
        self.join_all();
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic payload>".to_owned()
    }
}

/// Runs `f` (a worker call), turning an error or a panic into a `Failure`.
#[inline]
fn guarded<W: RankWorker, R>(f: impl FnOnce() -> Result<R, W::Error>) -> Result<R, Failure<W::Error>> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(Failure::Error(e)),
        Err(payload) => Err(Failure::Panic(panic_message(&*payload))),
    }
}

/// A worker call's outcome, unless it returned `Ok` after its own all-reduce
/// call aborted the collective: peers that failed because of that abort left
/// the failing to this rank (`Shared::fail`), so it must not pass as a
/// success.
#[inline]
fn unless_aborted<E, R>(ctx: &RankContext, outcome: Result<R, Failure<E>>) -> Result<R, Failure<E>> {
    match (outcome, ctx.all_reduce.own_abort()) {
        (Ok(_), Some(err)) => Err(Failure::Collective(err)),
        (outcome, _) => outcome,
    }
}

/// Drop the worker on this thread, catching a panic in its `Drop`.
fn drop_worker<W: RankWorker>(worker: W) -> Result<(), Failure<W::Error>> {
    catch_unwind(AssertUnwindSafe(move || drop(worker))).map_err(|payload| Failure::Panic(panic_message(&*payload)))
}

/// The body of rank thread `ctx.rank()`.
fn rank_main<W: RankWorker, F>(
    ctx: &RankContext,
    shared: &Shared<W::Error>,
    factory: &F,
    commands: &Receiver<Command<W>>,
    replies: &Sender<(usize, Box<dyn Any + Send>)>,
) where
    F: Fn(&RankContext) -> Result<W, W::Error>,
{
    let rank = ctx.rank;
    let mut worker = match guarded::<W, W>(|| factory(ctx)) {
        Ok(worker) => match unless_aborted(ctx, Ok(())) {
            Ok(()) => worker,
            Err(failure) => {
                shared.fail(rank, failure);
                let _ = drop_worker(worker);
                return;
            }
        },
        Err(failure) => return shared.fail(rank, failure),
    };
    // The "ready" round.
    if shared.barrier.wait().is_err() {
        let _ = drop_worker(worker);
        return;
    }
    loop {
        // Start barrier: parameters and commands are visible after it.
        if shared.barrier.wait().is_err() {
            break;
        }
        let params = &shared.params;
        // Relaxed (all): written before the start barrier by the caller.
        let outcome = match params.op.load(Ordering::Relaxed) {
            OP_STEP => {
                let step = StepInput {
                    token: params.token.load(Ordering::Relaxed),
                    position: params.position.load(Ordering::Relaxed),
                    sequence: SequenceId(params.sequence.load(Ordering::Relaxed)),
                };
                guarded::<W, ()>(|| worker.decode_step(ctx, step))
            }
            OP_COMMAND => match commands.try_recv() {
                Ok(Command::KvInit(seq)) => guarded::<W, ()>(|| worker.kv_init(ctx, seq)),
                Ok(Command::KvRelease(seq)) => guarded::<W, ()>(|| worker.kv_release(ctx, seq)),
                Ok(Command::Run(f)) => guarded::<W, Box<dyn Any + Send>>(|| f(&mut worker, ctx)).and_then(|reply| {
                    replies.send((rank, reply)).map_err(|_| Failure::Protocol("the reply channel is closed"))
                }),
                Ok(Command::Shutdown) => {
                    match drop_worker(worker) {
                        Ok(()) => {
                            let _ = shared.barrier.wait();
                        }
                        Err(failure) => shared.fail(rank, failure),
                    }
                    tracing::debug!(rank, "TP rank shut down");
                    return;
                }
                Err(TryRecvError::Empty) => Err(Failure::Protocol("a command round found no command queued")),
                Err(TryRecvError::Disconnected) => Err(Failure::Protocol("the command channel is closed")),
            },
            _ => Err(Failure::Protocol("unknown op code")),
        };
        let outcome = unless_aborted(ctx, outcome);
        if let Err(failure) = outcome {
            shared.fail(rank, failure);
            break;
        }
        // End barrier: the caller learns the round is done.
        if shared.barrier.wait().is_err() {
            break;
        }
    }
    tracing::debug!(rank, "TP rank leaving after a failure; dropping its worker");
    if let Err(Failure::Panic(message)) = drop_worker(worker) {
        tracing::error!(rank, %message, "TP worker panicked while being dropped");
    }
    tracing::debug!(rank, "TP rank worker dropped");
}
