//! The API without the `cuda` feature: everything that needs NCCL returns
//! [`Error::Unavailable`], so crates above build (and test their CPU parts) without CUDA.

use crate::error::{Error, Result};
use crate::rendezvous::{Rendezvous, RendezvousOptions, ID_LEN};
use std::convert::Infallible;

fn unavailable<T>() -> Result<T> {
    Err(Error::Unavailable("ferrum-nccl was built without the `cuda` feature".into()))
}

/// NCCL's unique id (128 opaque bytes). Without the `cuda` feature it can be carried but not
/// made.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; ID_LEN]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

impl UniqueId {
    /// Always [`Error::Unavailable`] without the `cuda` feature.
    pub fn new() -> Result<Self> {
        unavailable()
    }
    /// An id received from rank 0.
    pub fn from_bytes(bytes: [u8; ID_LEN]) -> Self {
        UniqueId(bytes)
    }
    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; ID_LEN] {
        &self.0
    }
}

/// Element type of a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// `f32`
    F32,
    /// `f16`
    F16,
    /// `bf16`
    BF16,
    /// `u8`
    U8,
    /// `i32`
    I32,
    /// `u32`
    U32,
}

/// One rank of an NCCL communicator. Without the `cuda` feature none can be made.
#[derive(Debug)]
pub struct NcclRank {
    never: Infallible,
}

impl NcclRank {
    /// Always [`Error::Unavailable`] without the `cuda` feature.
    pub fn init_all(_ordinals: &[usize]) -> Result<Vec<NcclRank>> {
        unavailable()
    }
    /// Always [`Error::Unavailable`] without the `cuda` feature.
    pub fn init_rank_rendezvous_on(
        _ordinal: usize,
        _rank: usize,
        _world_size: usize,
        _rendezvous: &Rendezvous,
        _opts: &RendezvousOptions,
    ) -> Result<NcclRank> {
        unavailable()
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        match self.never {}
    }
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        match self.never {}
    }
    /// The CUDA device ordinal.
    pub fn device_ordinal(&self) -> usize {
        match self.never {}
    }
    /// A handle that aborts this communicator from any thread.
    pub fn abort_handle(&self) -> AbortHandle {
        match self.never {}
    }
    /// Aborts the communicator.
    pub fn abort(&self, _reason: &str) {
        match self.never {}
    }
    /// True once aborted.
    pub fn is_aborted(&self) -> bool {
        match self.never {}
    }
    /// Runs `f` while the communicator is live (see the `cuda` build).
    pub fn while_live<R>(&self, _f: impl FnOnce() -> R) -> Result<R> {
        match self.never {}
    }
    /// Polls NCCL for an asynchronous error.
    pub fn check_async_error(&self) -> Result<()> {
        match self.never {}
    }
}

/// Aborts a rank's communicator from any thread.
#[derive(Clone, Debug)]
pub struct AbortHandle {
    never: Infallible,
}

impl AbortHandle {
    /// Aborts the communicator.
    pub fn abort(&self, _reason: &str) {
        match self.never {}
    }
    /// True once aborted.
    pub fn is_aborted(&self) -> bool {
        match self.never {}
    }
}

/// Always [`Error::Unavailable`] without the `cuda` feature.
pub fn nccl_version() -> Result<i32> {
    unavailable()
}
