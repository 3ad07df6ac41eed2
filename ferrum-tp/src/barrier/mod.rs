//! Abortable barriers: [`SpinParkBarrier`] (ferrum's own) and [`StdBarrier`]
//! (`std::sync::Barrier` made abortable), behind one trait, [`AbortableBarrier`].
//!
//! Both mirror [`std::sync::Barrier`]: `wait()` blocks until all `parties`
//! have called it, then releases them all; exactly one of them (the last to
//! arrive) gets a [`BarrierWaitResult`] whose [`is_leader`](BarrierWaitResult::is_leader)
//! is `true`. Unlike std, `wait()` returns a `Result`: after
//! [`abort`](AbortableBarrier::abort) every current and future waiter gets
//! [`BarrierError::Aborted`] at once, so a party that fails can never hang the
//! others.

pub mod spin_park;
#[cfg(not(loom))]
pub mod std_barrier;

pub use spin_park::{BackoffPolicy, SpinParkBarrier, SPIN_BACKOFF_CAP, SPIN_CHECKS, YIELD_CHECKS};
#[cfg(not(loom))]
pub use std_barrier::StdBarrier;

/// What a successful [`wait`](AbortableBarrier::wait) returns, like
/// [`std::sync::BarrierWaitResult`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarrierWaitResult {
    pub(crate) leader: bool,
}

impl BarrierWaitResult {
    /// `true` for exactly one party per round: the last one to arrive.
    #[inline]
    #[must_use]
    pub fn is_leader(&self) -> bool {
        self.leader
    }
}

/// Why a barrier wait did not complete its round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BarrierError {
    /// The barrier was aborted (by [`AbortableBarrier::abort`], or because a
    /// party's deadline passed). Every later wait fails the same way: an
    /// aborted barrier is dead for good.
    #[error("the barrier was aborted")]
    Aborted,
    /// This party's deadline passed before the round completed. The party
    /// aborted the barrier on its way out (the other parties see
    /// [`BarrierError::Aborted`]): a party that has arrived cannot un-arrive
    /// without racing the round's completion, and a round short of one party
    /// could never complete anyway.
    #[error("the barrier wait timed out (the barrier is now aborted)")]
    TimedOut,
}

/// A barrier for a fixed number of parties that can be aborted.
///
/// Implemented by [`SpinParkBarrier`] and [`StdBarrier`]; the TP group uses
/// whichever the crate features select ([`crate::GroupBarrier`]).
pub trait AbortableBarrier: Send + Sync + std::fmt::Debug {
    /// A barrier for `parties` parties (`0` behaves like `1`, as in std).
    fn with_parties(parties: usize) -> Self
    where
        Self: Sized;

    /// The number of parties a round waits for.
    fn parties(&self) -> usize;

    /// Blocks until all parties have arrived at this round, or the barrier is
    /// aborted.
    ///
    /// # Errors
    /// [`BarrierError::Aborted`] if the barrier is (or becomes) aborted before
    /// this round completes.
    fn wait(&self) -> Result<BarrierWaitResult, BarrierError>;

    /// Aborts the barrier: every party blocked in `wait` and every later
    /// `wait` returns [`BarrierError::Aborted`] promptly. Idempotent.
    fn abort(&self);

    /// Whether the barrier has been aborted.
    fn is_aborted(&self) -> bool;
}
