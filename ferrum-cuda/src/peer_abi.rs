//! The parameter block of the peer all-reduce kernels (`PeerArgs` in `kernels/peer.cuh`),
//! outside the `cuda` feature so that its layout is tested against the PTX on every build.

/// Most ranks of a peer group (the kernels' pointer tables have this many entries).
pub const MAX_PEER_RANKS: usize = 8;

/// The peer kernels' first parameter, passed by value: the same fields, order and types as
/// `PeerArgs` in `kernels/peer.cuh` (device pointers as `u64`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct PeerArgs {
    /// Every rank's receive buffer, `[2][world][2 * cap]` floats (16-byte lines of an 8-byte
    /// payload and two epoch words).
    pub(crate) recv: [u64; MAX_PEER_RANKS],
    /// `recv[rank]` (the kernels index the array only with constants).
    pub(crate) own_recv: u64,
    /// This rank's {epoch, failed} words (device memory, 8-byte aligned).
    pub(crate) counter: u64,
    /// This rank's abort and status words (host memory mapped to the device).
    pub(crate) abort: u64,
    pub(crate) status: u64,
    /// How long the kernel waits for its peers.
    pub(crate) timeout_ns: u64,
    pub(crate) rank: i32,
    pub(crate) world: i32,
    /// Payload floats per message (a multiple of 4).
    pub(crate) cap: i32,
}

/// The sizes of a peer group's buffers, checked ([`peer_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct PeerLayout {
    /// Payload floats per message ([`PeerArgs::cap`]): the capacity asked, rounded up to a
    /// multiple of 4.
    pub(crate) cap: i32,
    /// Byte offset of the {epoch, failed} words after one rank's receive buffer of
    /// `[2][world][2 * cap]` floats (at most `i32::MAX` floats), 256-aligned.
    pub(crate) counter_offset: usize,
    /// Bytes of one rank's allocation: the receive buffer and the two words.
    pub(crate) bytes: usize,
}

/// The buffer sizes of a peer group of `world` ranks for messages of up to `capacity`
/// floats, with every product checked: an `InvalidArgument` error when `world` is not
/// 1..=[`MAX_PEER_RANKS`], `capacity` is 0, or the receive buffer would not be indexable by
/// the kernels' `i32`s (never an overflow that wraps to a small size).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn peer_layout(world: usize, capacity: usize) -> crate::Result<PeerLayout> {
    use crate::Error;
    if world == 0 || world > MAX_PEER_RANKS {
        return Err(Error::InvalidArgument(format!("a peer group has 1 to {MAX_PEER_RANKS} ranks, not {world}")));
    }
    if capacity == 0 {
        return Err(Error::InvalidArgument("a peer group needs a capacity of at least one float".into()));
    }
    let too_large = || Error::InvalidArgument(format!("peer capacity {capacity} × {world} ranks is too large"));
    // A multiple of 4 keeps every slot 16-byte aligned (the kernels' vector stores). A slot
    // carries `cap` floats of payload in 16-byte lines of 8 payload bytes and two epoch words.
    let cap = capacity.checked_next_multiple_of(4).ok_or_else(too_large)?;
    let slots = [2, world, 2].into_iter().try_fold(cap, usize::checked_mul).ok_or_else(too_large)?;
    // The kernels index the receive buffer with i32s. `slots` bounds `cap`, so `cap` fits too.
    i32::try_from(slots).map_err(|_| too_large())?;
    let cap = i32::try_from(cap).map_err(|_| too_large())?;
    let counter_offset = slots
        .checked_mul(std::mem::size_of::<f32>())
        .and_then(|b| b.checked_next_multiple_of(256))
        .ok_or_else(too_large)?;
    let bytes = counter_offset.checked_add(2 * std::mem::size_of::<u32>()).ok_or_else(too_large)?;
    Ok(PeerLayout { cap, counter_offset, bytes })
}

#[cfg(test)]
mod tests {
    use super::{peer_layout, PeerArgs, PeerLayout, MAX_PEER_RANKS};

    #[test]
    fn peer_layout_rounds_up_and_sizes_the_buffers() {
        let l = peer_layout(2, 5).unwrap();
        // cap 8; slots 2 × 2 × 2 × 8 = 64 floats = 256 bytes; the two words after them.
        assert_eq!(l, PeerLayout { cap: 8, counter_offset: 256, bytes: 264 });
        // cap 4; slots 2 × 1 × 2 × 4 = 16 floats = 64 bytes, rounded up to 256.
        assert_eq!(peer_layout(1, 4).unwrap(), PeerLayout { cap: 4, counter_offset: 256, bytes: 264 });
        // cap 100; slots 2 × 3 × 2 × 100 = 1200 floats = 4800 bytes, rounded up to 4864.
        assert_eq!(peer_layout(3, 97).unwrap(), PeerLayout { cap: 100, counter_offset: 4864, bytes: 4872 });
        // The largest capacity whose receive buffer fits an i32 (8 ranks: slots = 32 × cap).
        let max = (i32::MAX as usize / 32) / 4 * 4;
        let l = peer_layout(MAX_PEER_RANKS, max).unwrap();
        assert_eq!((l.cap as usize, l.counter_offset), (max, (32 * max * 4).next_multiple_of(256)));
        assert!(peer_layout(MAX_PEER_RANKS, max + 1).is_err());
    }

    /// Capacities whose rounding or products overflow `usize` are refused, not wrapped: in
    /// release builds `(2^62 + 4).div_ceil(4) * 4` wrapped to 4 and the group was built with
    /// a 4-float capacity; in debug builds it panicked.
    #[test]
    fn peer_layout_refuses_overflowing_capacities() {
        for world in [0, MAX_PEER_RANKS + 1] {
            assert!(matches!(peer_layout(world, 4), Err(crate::Error::InvalidArgument(_))), "{world}");
        }
        for (world, capacity) in [
            (1, 0),
            (1, usize::MAX),
            (1, usize::MAX - 2),
            (2, (1 << 62) + 4),
            (8, 1 << 61),
            (1, i32::MAX as usize),
            (1, (i32::MAX as usize).div_ceil(4) + 1),
        ] {
            let r = peer_layout(world, capacity);
            assert!(matches!(r, Err(crate::Error::InvalidArgument(_))), "{world} × {capacity}: {r:?}");
        }
    }
    use crate::Kernel;

    /// The field offsets that peer.cuh's static_assert checks on the C side, and the size of
    /// the by-value parameter of every peer kernel in both PTX builds.
    #[test]
    fn peer_args_match_the_ptx_parameter() {
        use std::mem::offset_of;
        let offsets = [
            offset_of!(PeerArgs, own_recv),
            offset_of!(PeerArgs, counter),
            offset_of!(PeerArgs, abort),
            offset_of!(PeerArgs, status),
            offset_of!(PeerArgs, timeout_ns),
            offset_of!(PeerArgs, rank),
            offset_of!(PeerArgs, world),
            offset_of!(PeerArgs, cap),
        ];
        assert_eq!(offsets, [64, 72, 80, 88, 96, 104, 108, 112]);
        let want = std::mem::size_of::<PeerArgs>();
        assert_eq!(want, 120);
        for k in [
            Kernel::PeerAllReduceF32,
            Kernel::PeerAllReduceF16,
            Kernel::PeerAllReduceBf16,
            Kernel::PeerAddRmsNormF16,
            Kernel::PeerAddRmsNormBf16,
            Kernel::PeerAddRmsNormPushedF16,
            Kernel::PeerAddRmsNormPushedBf16,
            Kernel::GemvPushF16,
            Kernel::GemvPushBf16,
            Kernel::Gemv4PushF16,
            Kernel::Gemv4PushBf16,
        ] {
            for set in [crate::ptx::MODULES, crate::ptx::MODULES_SM90] {
                let (_, text) = set.iter().find(|(n, _)| *n == k.module()).unwrap();
                let needle = format!(".param .align 8 .b8 {}_param_0[", k.name());
                let at = text.find(&needle).unwrap_or_else(|| panic!("{} takes no struct parameter", k.name()));
                let rest = &text[at + needle.len()..];
                let size: usize = rest[..rest.find(']').unwrap()].parse().unwrap();
                assert_eq!(size, want, "{}", k.name());
            }
        }
    }
}
