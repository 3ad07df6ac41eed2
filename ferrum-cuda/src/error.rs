//! Typed errors of the CUDA runner.

/// Result of ferrum-cuda's fallible calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ferrum-cuda. Input is validated on the host before any
/// launch, so bad ids, positions and sequences come back as these errors, never as GPU faults.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// ferrum-cuda was built without its `cuda` feature.
    #[error("ferrum-cuda was built without the `cuda` feature: no CUDA backend")]
    NotBuilt,
    /// No usable GPU or driver (the driver library failed to load, no device, ...).
    #[error("CUDA is unavailable: {0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error during {what}: {msg}")]
    Driver { what: &'static str, msg: String },
    /// A cuBLAS call failed.
    #[error("cuBLAS error during {what}: {msg}")]
    Cublas { what: &'static str, msg: String },
    /// A kernel the Rust side needs is missing from the embedded PTX.
    #[error("kernel {0} is missing from the embedded PTX (run `cargo xtask ptx`)")]
    MissingKernel(&'static str),
    /// Not enough free device memory for an allocation.
    #[error("out of GPU memory allocating {what}: asked for {asked} bytes, {free} bytes free of {total}")]
    OutOfMemory { what: String, asked: u64, free: u64, total: u64 },
    /// The model description is inconsistent or unsupported.
    #[error("invalid model spec: {0}")]
    InvalidSpec(String),
    /// A host weight has the wrong shape or length.
    #[error("weight {name}: {msg}")]
    BadWeight { name: String, msg: String },
    /// A token id is not below the vocabulary size.
    #[error("token id {token} is out of range (vocabulary size {vocab})")]
    TokenOutOfRange { token: u32, vocab: usize },
    /// A position is at or past the sequence's capacity.
    #[error("position {position} is out of range for sequence {seq} (capacity {capacity} tokens)")]
    PositionOutOfRange { seq: u64, position: usize, capacity: usize },
    /// A position skips over positions that were never filled.
    #[error("position {position} skips ahead: sequence {seq} holds {len} tokens")]
    PositionGap { seq: u64, position: usize, len: usize },
    /// The sequence id is unknown (never initialised, or released).
    #[error("sequence {0} is unknown (never initialised, or released)")]
    UnknownSequence(u64),
    /// The sequence id is already in use.
    #[error("sequence {0} already exists")]
    SequenceExists(u64),
    /// The sequence's KV cache has no room for the tokens asked.
    #[error("KV cache capacity exhausted for sequence {seq}: it holds {len} of {capacity} tokens and {asked} more were asked")]
    CapacityExhausted { seq: u64, len: usize, capacity: usize, asked: usize },
    /// The reducer (a tensor-parallel all-reduce, e.g. NCCL) failed; its own text.
    #[error("all-reduce failed: {0}")]
    Reduce(String),
    /// A peer all-reduce of this rank gave up because the rank was aborted (its TP group
    /// failed); the step's results are garbage.
    #[error("peer all-reduce on rank {rank} was aborted (the TP group failed)")]
    PeerAborted { rank: usize },
    /// A peer all-reduce of this rank waited past its timeout for a peer that never pushed.
    #[error("peer all-reduce on rank {rank} timed out waiting for a peer rank")]
    PeerTimedOut { rank: usize },
    /// Any other invalid argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An internal bounds check failed before a launch (a bug in ferrum-cuda, caught safely).
    #[error("internal bounds check failed: {0}")]
    Internal(String),
}

#[cfg(feature = "cuda")]
impl Error {
    pub(crate) fn driver(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
        move |e| Error::Driver { what, msg: e.to_string() }
    }
    pub(crate) fn cublas(what: &'static str) -> impl FnOnce(cudarc::cublas::result::CublasError) -> Error {
        move |e| Error::Cublas { what, msg: format!("{e:?}") }
    }
}
