//! In-process CPU all-reduce (sum of `f32` slices) for tensor-parallel ranks
//! that are threads of one process.
//!
//! # Protocol
//!
//! Each rank owns one slot (a buffer of `max_len` floats, allocated once) per
//! *parity*; call `k` of every rank uses the slots of parity `k % 2`:
//!
//! 1. rank `r` copies its partial into its own slot `slots[k % 2][r]` and
//!    records its length;
//! 2. barrier (all ranks have written);
//! 3. every rank sums all slots **in rank order** `0, 1, …, world-1` into its
//!    own buffer, with the same instruction sequence, so every rank gets
//!    bit-identical results.
//!
//! The "synchronise again before the slots can be reused" step is the
//! barrier of call `k + 1`: rank `r` writes the parity-`k % 2` slot again
//! only in call `k + 2`, after passing the barrier of call `k + 1`, which
//! every rank reaches only after finishing its reads of call `k`. Double
//! buffering thus costs one barrier round per all-reduce instead of two.
//!
//! Abort: the barrier is abortable ([`crate::GroupBarrier`]). Once aborted,
//! every rank blocked in (or later entering) [`AllReduceRank::sum`] returns
//! [`CollectiveError::Aborted`]. A call checks for abort *before* writing its
//! slot, so after a failed round nobody writes a slot another rank might
//! still be reading (which the barrier no longer guarantees). Three things
//! abort: [`CpuAllReduce::abort`], a call with too long a buffer, and
//! dropping an [`AllReduceRank`] (a rank thread that panics or returns early
//! can never hang the others). The first of them is kept as the root cause
//! ([`CpuAllReduce::abort_origin`]): peers fail *because* of it.
//!
//! Soundness: each slot has exactly one writer, the unique [`AllReduceRank`]
//! of its rank (not `Clone`, not `Sync`), and the barrier orders every write
//! before every read of the same call and every read before the next write
//! of the same slot (two calls later).

use std::cell::Cell;
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use crate::loom::cell::UnsafeCell;
use crate::loom::sync::atomic::{AtomicUsize, Ordering};
use crate::{AbortableBarrier, GroupBarrier};

/// Why an all-reduce failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    /// A world of zero ranks was requested.
    #[error("an all-reduce needs at least one rank")]
    ZeroWorldSize,
    /// The collective was aborted (a rank failed, or the TP group is
    /// poisoned). Permanent.
    #[error("the all-reduce was aborted (a peer rank failed)")]
    Aborted,
    /// This rank's buffer is longer than the slots. The collective is aborted
    /// so that the other ranks do not wait for this one.
    #[error("all-reduce of {len} floats exceeds the buffer capacity of {max_len}")]
    TooLong {
        /// The length passed.
        len: usize,
        /// The capacity the collective was built with.
        max_len: usize,
    },
    /// Ranks passed buffers of different lengths to the same call. Every
    /// rank of that call gets this error (no data is reduced); the collective
    /// stays usable.
    #[error("ranks passed buffers of different lengths to the same all-reduce")]
    LengthMismatch,
    /// [`CpuAllReduce::new`] could not allocate its buffers
    /// (`2 × world_size × max_len` floats): the size overflows, or the
    /// allocator refused it.
    #[error("cannot allocate an all-reduce of {world_size} ranks × {max_len} floats (2 buffers each)")]
    TooLarge {
        /// The world size asked.
        world_size: usize,
        /// The buffer capacity asked, in floats.
        max_len: usize,
    },
}

/// What aborted a [`CpuAllReduce`] first: the root cause that the peers'
/// [`CollectiveError::Aborted`] follow from. See
/// [`CpuAllReduce::abort_origin`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortOrigin {
    /// [`CpuAllReduce::abort`] (e.g. the TP group, after a rank failed).
    Control,
    /// Rank `rank` passed a buffer longer than the slots
    /// ([`CollectiveError::TooLong`]).
    TooLong {
        /// The rank whose call aborted.
        rank: usize,
    },
    /// Rank `rank`'s [`AllReduceRank`] was dropped.
    Dropped {
        /// The rank whose handle was dropped.
        rank: usize,
    },
}

/// `Shared::origin` encoding: `rank << 2 | kind`; 0 is "not aborted". A rank
/// shifted by 2 cannot overflow: the `world` ranks own `2 × world` atomics of
/// at least 4 bytes each in allocations of at most `isize::MAX` bytes.
const ORIGIN_CONTROL: usize = 1;
const ORIGIN_TOO_LONG: usize = 2;
const ORIGIN_DROPPED: usize = 3;
const ORIGIN_KIND: usize = 0b11;

impl AbortOrigin {
    fn encode(self) -> usize {
        match self {
            AbortOrigin::Control => ORIGIN_CONTROL,
            AbortOrigin::TooLong { rank } => (rank << 2) | ORIGIN_TOO_LONG,
            AbortOrigin::Dropped { rank } => (rank << 2) | ORIGIN_DROPPED,
        }
    }

    fn decode(word: usize) -> Option<Self> {
        let rank = word >> 2;
        match word & ORIGIN_KIND {
            ORIGIN_CONTROL => Some(AbortOrigin::Control),
            ORIGIN_TOO_LONG => Some(AbortOrigin::TooLong { rank }),
            ORIGIN_DROPPED => Some(AbortOrigin::Dropped { rank }),
            _ => None,
        }
    }
}

/// One rank's buffer (`max_len` floats).
type Slot = UnsafeCell<Box<[f32]>>;

/// `n` items made by `make`, in one fallible allocation: `err` when it
/// cannot be made, rather than a capacity-overflow panic or an abort.
fn try_boxed<T>(
    n: usize,
    mut make: impl FnMut() -> Result<T, CollectiveError>,
    err: CollectiveError,
) -> Result<Box<[T]>, CollectiveError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| err)?;
    for _ in 0..n {
        v.push(make()?);
    }
    Ok(v.into_boxed_slice())
}

struct Shared {
    world: usize,
    max_len: usize,
    barrier: GroupBarrier,
    /// `slots[parity][rank]`, `max_len` floats each.
    slots: [Box<[Slot]>; 2],
    /// `lens[parity][rank]`: the length rank wrote in its slot.
    lens: [Box<[CachePadded<AtomicUsize>]>; 2],
    /// The first abort's [`AbortOrigin`], encoded (0 until then).
    origin: AtomicUsize,
}

impl Shared {
    /// Records `origin` unless an earlier abort was recorded, then aborts.
    #[cold]
    fn abort(&self, origin: AbortOrigin) {
        // AcqRel/Acquire, though the barrier alone would do: the record is
        // sequenced before the barrier's Release abort, which every reader
        // of the record acquires first (`abort_origin`). First record wins.
        let _ = self.origin.compare_exchange(0, origin.encode(), Ordering::AcqRel, Ordering::Acquire);
        self.barrier.abort();
    }
}

// SAFETY: the only non-Sync fields are the `UnsafeCell` slots. Slot
// `[p][r]` is written only by the unique `AllReduceRank` of rank `r` (which is
// neither `Clone` nor `Sync`, so one thread at a time), and only between the
// barrier rounds that bracket it (module docs); reads by all ranks happen
// after the barrier that follows the write and before the barrier that
// precedes the next write. The barrier makes those happens-before edges.
unsafe impl Sync for Shared {}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuAllReduce")
            .field("world", &self.world)
            .field("max_len", &self.max_len)
            .field("barrier", &self.barrier)
            .finish_non_exhaustive()
    }
}

/// Shared control handle of an in-process CPU all-reduce: abort it, ask
/// whether it is aborted. Cheap to clone; `Send + Sync`.
///
/// The per-rank handles that do the reducing are [`AllReduceRank`]s, made
/// together with this by [`CpuAllReduce::new`].
///
/// ```
/// use ferrum_tp::CpuAllReduce;
///
/// let (_control, ranks) = CpuAllReduce::new(2, 4).unwrap();
/// let threads: Vec<_> = ranks
///     .into_iter()
///     .map(|rank| {
///         std::thread::spawn(move || {
///             let mut data = [rank.rank() as f32 + 1.0; 4];
///             rank.sum(&mut data).unwrap();
///             data
///         })
///     })
///     .collect();
/// for t in threads {
///     assert_eq!(t.join().unwrap(), [3.0; 4]);
/// }
/// ```
#[derive(Clone, Debug)]
pub struct CpuAllReduce {
    shared: Arc<Shared>,
}

impl CpuAllReduce {
    /// An all-reduce over `world_size` ranks for buffers of up to `max_len`
    /// floats. Allocates all buffers now (`2 × world_size × max_len` floats);
    /// [`AllReduceRank::sum`] allocates nothing.
    ///
    /// Returns the control handle and one handle per rank, in rank order.
    ///
    /// # Errors
    /// [`CollectiveError::ZeroWorldSize`] if `world_size == 0`;
    /// [`CollectiveError::TooLarge`] if the buffers' size overflows or cannot
    /// be allocated (never a panic or an abort of the process).
    pub fn new(world_size: usize, max_len: usize) -> Result<(Self, Vec<AllReduceRank>), CollectiveError> {
        if world_size == 0 {
            return Err(CollectiveError::ZeroWorldSize);
        }
        let too_large = CollectiveError::TooLarge { world_size, max_len };
        // The whole size first, so that an overflowing one fails before any
        // allocation; then each allocation is fallible on its own.
        let floats = world_size.checked_mul(max_len).and_then(|n| n.checked_mul(2)).ok_or(too_large)?;
        std::alloc::Layout::array::<f32>(floats).map_err(|_| too_large)?;
        let slot = || {
            let mut v = Vec::new();
            v.try_reserve_exact(max_len).map_err(|_| too_large)?;
            v.resize(max_len, 0.0f32);
            Ok(UnsafeCell::new(v.into_boxed_slice()))
        };
        let slots = [try_boxed(world_size, slot, too_large)?, try_boxed(world_size, slot, too_large)?];
        let len = || Ok(CachePadded::new(AtomicUsize::new(0)));
        let lens = [try_boxed(world_size, len, too_large)?, try_boxed(world_size, len, too_large)?];
        let shared = Arc::new(Shared {
            world: world_size,
            max_len,
            barrier: GroupBarrier::with_parties(world_size),
            slots,
            lens,
            origin: AtomicUsize::new(0),
        });
        let ranks = (0..world_size)
            .map(|rank| AllReduceRank {
                rank,
                calls: Cell::new(0),
                own_abort: Cell::new(None),
                shared: Arc::clone(&shared),
            })
            .collect();
        Ok((Self { shared }, ranks))
    }

    /// Aborts the collective: every rank blocked in, or later calling,
    /// [`AllReduceRank::sum`] gets [`CollectiveError::Aborted`]. Idempotent.
    pub fn abort(&self) {
        self.shared.abort(AbortOrigin::Control);
    }

    /// Whether the collective has been aborted.
    #[must_use]
    pub fn is_aborted(&self) -> bool {
        self.shared.barrier.is_aborted()
    }

    /// What aborted the collective first (`None` while it is not aborted):
    /// the root cause, where the peers' [`CollectiveError::Aborted`] are only
    /// its consequences. A peer that got `Aborted` always finds it set.
    #[must_use]
    pub fn abort_origin(&self) -> Option<AbortOrigin> {
        // Acquire (both): the origin was recorded before the barrier's
        // Release abort; observing the abort with Acquire first makes the
        // record (the first one, or one that a failed record read) visible.
        if !self.shared.barrier.is_aborted() {
            return None;
        }
        AbortOrigin::decode(self.shared.origin.load(Ordering::Acquire))
    }

    /// Number of ranks.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.shared.world
    }

    /// Capacity of each rank's buffer, in floats.
    #[must_use]
    pub fn max_len(&self) -> usize {
        self.shared.max_len
    }
}

/// One rank's handle on a [`CpuAllReduce`]. Exactly one exists per rank; it
/// is `Send` (move it to the rank's thread) but neither `Clone` nor `Sync`.
///
/// Dropping it aborts the collective ([`AbortOrigin::Dropped`]): a rank whose
/// thread panics or returns early can never leave its peers blocked in
/// [`sum`](Self::sum) waiting for calls it will not make. Dropping it after
/// the rank's last call is harmless: each call a peer makes that this rank
/// made too has had its round completed, and a completed round is `Ok` under
/// both barriers, abort or not. Only a peer's *extra* calls (ones this rank
/// never made) return [`CollectiveError::Aborted`].
#[derive(Debug)]
pub struct AllReduceRank {
    rank: usize,
    /// Number of `sum` calls made; its parity picks the slot set.
    calls: Cell<u64>,
    /// The error of this handle's call that aborted the collective (too long
    /// a buffer), if any.
    own_abort: Cell<Option<CollectiveError>>,
    shared: Arc<Shared>,
}

impl Drop for AllReduceRank {
    fn drop(&mut self) {
        // Never panics; never blocks for long (see `AbortableBarrier::abort`).
        self.shared.abort(AbortOrigin::Dropped { rank: self.rank });
    }
}

impl AllReduceRank {
    /// This handle's rank.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.shared.world
    }

    /// Capacity of the buffers, in floats.
    #[must_use]
    pub fn max_len(&self) -> usize {
        self.shared.max_len
    }

    /// The shared control handle (for aborting).
    #[must_use]
    pub fn control(&self) -> CpuAllReduce {
        CpuAllReduce { shared: Arc::clone(&self.shared) }
    }

    /// The error of this handle's call that aborted the collective (too long
    /// a buffer), if one did: the TP group reports it when the worker
    /// swallowed it.
    #[inline]
    #[cfg_attr(loom, allow(dead_code))] // the group is not built under loom
    pub(crate) fn own_abort(&self) -> Option<CollectiveError> {
        self.own_abort.get()
    }

    /// All-reduce (sum) in place: on return, `data` holds the element-wise sum
    /// of every rank's `data`, summed in rank order, bit-identical on every
    /// rank. Every rank must make the same sequence of calls with buffers of
    /// the same lengths. Allocates nothing.
    ///
    /// # Errors
    /// * [`CollectiveError::Aborted`] if the collective is or gets aborted
    ///   (`data` is then unspecified);
    /// * [`CollectiveError::TooLong`] if `data.len() > max_len` (this aborts
    ///   the collective so that no peer waits forever);
    /// * [`CollectiveError::LengthMismatch`] if the ranks' lengths differ
    ///   (every rank of the call gets it; `data` is unchanged).
    pub fn sum(&self, data: &mut [f32]) -> Result<(), CollectiveError> {
        let shared = &*self.shared;
        let len = data.len();
        if len > shared.max_len {
            let err = CollectiveError::TooLong { len, max_len: shared.max_len };
            self.own_abort.set(Some(err));
            shared.abort(AbortOrigin::TooLong { rank: self.rank });
            return Err(err);
        }
        // Must precede the slot write: after an aborted round the barrier no
        // longer orders our write after the peers' reads of two calls ago.
        if shared.barrier.is_aborted() {
            return Err(CollectiveError::Aborted);
        }
        let calls = self.calls.get();
        self.calls.set(calls.wrapping_add(1));
        let parity = (calls & 1) as usize;
        let slots = &shared.slots[parity];
        let lens = &shared.lens[parity];

        slots[self.rank].with_mut(|slot| {
            // SAFETY: only this rank's unique handle writes this slot, and no
            // rank reads it now: the last reads of this parity (call
            // `calls - 2`) finished before every rank arrived at the barrier
            // of call `calls - 1`, which we passed (it returned Ok, or we
            // would have seen the abort above). No reference into the slot
            // outlives this closure.
            let slot = unsafe { &mut *slot };
            slot[..len].copy_from_slice(data);
        });
        // Relaxed: published to the other ranks by the barrier below.
        lens[self.rank].store(len, Ordering::Relaxed);

        if shared.barrier.wait().is_err() {
            return Err(CollectiveError::Aborted);
        }

        // Relaxed: written before the barrier by their ranks.
        if lens.iter().any(|l| l.load(Ordering::Relaxed) != len) {
            return Err(CollectiveError::LengthMismatch);
        }
        for (r, slot) in slots.iter().enumerate() {
            slot.with(|slot| {
                // SAFETY: every rank wrote its slot of this parity before the
                // barrier we just passed, and none writes it again before
                // the barrier of our next call (which waits for us); shared
                // reads by the other ranks are fine.
                let slot = unsafe { &*slot };
                let src = &slot[..len];
                if r == 0 {
                    data.copy_from_slice(src);
                } else {
                    for (d, s) in data.iter_mut().zip(src) {
                        *d += *s;
                    }
                }
            });
        }
        Ok(())
    }
}
