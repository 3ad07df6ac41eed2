//! Tensor-parallel orchestration for ferrum's decode engine.
//!
//! Tensor-parallel (TP) decode runs one persistent thread per rank; every
//! decode step the caller releases all ranks and waits for them. That round
//! trip happens once per token, so it must cost well under a microsecond when
//! cores are free, and a failed rank must never turn into a hang.
//!
//! The crate has three layers, each usable on its own:
//!
//! * **Barriers** ([`barrier`]): [`SpinParkBarrier`], a sense-reversing
//!   barrier (Mellor-Crummey & Scott) whose waiters spin with a bounded
//!   backoff, yield, then park, and which can be aborted or waited on with a
//!   deadline; and [`StdBarrier`], `std::sync::Barrier` made abortable. Both
//!   implement [`AbortableBarrier`] and mirror `std::sync::Barrier`
//!   (`wait()` → [`BarrierWaitResult::is_leader`]). The protocol and the
//!   argument that no wake-up is lost are in [`barrier::spin_park`]; the
//!   abortable std barrier's "stand-in" protocol is in
//!   [`barrier::std_barrier`].
//! * **Collective** ([`CpuAllReduce`]): an in-process, allocation-free,
//!   abortable all-reduce (sum of `f32` slices) whose result is bit-identical
//!   on every rank.
//! * **Group** ([`TpDecodeGroup`]): persistent `tp-rank-{r}` threads, each
//!   owning a [`RankWorker`] built on its own thread; an allocation-free
//!   `decode_step` hot path; cold-path commands through channels; typed
//!   errors naming the failing rank; poisoning; a `Drop` that never hangs.
//!
//! # Feature flags
//!
//! Exactly one barrier drives the group, [`GroupBarrier`]:
//!
//! * `barrier-spin-park` (default): [`SpinParkBarrier`];
//! * `barrier-std`: [`StdBarrier`].
//!
//! If both are enabled, **`barrier-std` wins**: default features switch
//! `barrier-spin-park` on implicitly, so `barrier-std` is the one somebody
//! asked for. If neither is enabled the crate does not compile. Both barrier
//! types are always public, whatever the features. The group's
//! [`CpuAllReduce`] synchronises with [`GroupBarrier`] too.
//!
//! # Model checking
//!
//! Under `RUSTFLAGS="--cfg loom"` the barrier and the all-reduce are built on
//! [loom](https://docs.rs/loom)'s primitives (through the private `loom` shim
//! module) and `tests/loom.rs` model-checks them; [`StdBarrier`] and the group
//! are left out (loom has no `std::sync::Barrier` and no OS threads), and
//! [`GroupBarrier`] is then [`SpinParkBarrier`].

#[cfg(not(any(feature = "barrier-spin-park", feature = "barrier-std")))]
compile_error!("ferrum-tp needs a barrier: enable the `barrier-spin-park` (default) or the `barrier-std` feature");

mod loom;

pub mod all_reduce;
pub mod barrier;
#[cfg(not(loom))]
pub mod group;

pub use all_reduce::{AbortOrigin, AllReduceRank, CollectiveError, CpuAllReduce};
#[cfg(not(loom))]
pub use barrier::StdBarrier;
pub use barrier::{AbortableBarrier, BackoffPolicy, BarrierError, BarrierWaitResult, SpinParkBarrier};
#[cfg(not(loom))]
pub use group::{RankContext, RankWorker, SequenceId, StepInput, TpConfig, TpDecodeGroup, TpError};

/// The barrier [`TpDecodeGroup`] and its [`CpuAllReduce`] use, picked by the
/// crate features (see the crate docs): here [`StdBarrier`].
#[cfg(all(feature = "barrier-std", not(loom)))]
pub type GroupBarrier = StdBarrier;

/// The barrier [`TpDecodeGroup`] and its [`CpuAllReduce`] use, picked by the
/// crate features (see the crate docs): here [`SpinParkBarrier`].
#[cfg(any(loom, not(feature = "barrier-std")))]
pub type GroupBarrier = SpinParkBarrier;
