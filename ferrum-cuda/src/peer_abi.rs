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

#[cfg(test)]
mod tests {
    use super::PeerArgs;
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
