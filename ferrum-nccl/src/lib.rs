//! # ferrum-nccl
//!
//! The NCCL rank wrapper of ferrum, usable on its own (it depends only on cudarc):
//!
//! - [`NcclRank`]: one communicator rank, made either for all local GPUs of one process
//!   ([`NcclRank::init_all`], `ncclCommInitAll`) or for one rank of a multi-process group
//!   ([`NcclRank::init_rank`], `ncclCommInitRank`) from a [`UniqueId`] handed over by a
//!   [`Rendezvous`]: a file (rank 0 writes it atomically, the others poll) or a TCP address
//!   (rank 0 serves it, the others connect with retries), both with timeouts and clear errors;
//! - in-place all-reduce (sum) for `f32`, `f16`, `bf16` and an all-gather, on a cudarc
//!   `CudaStream` or a raw `CUstream`. They only enqueue work: no allocation, no host
//!   synchronisation, so they can be captured in a CUDA graph;
//! - errors that carry NCCL's own text (`ncclGetErrorString` and `ncclGetLastError`); on any
//!   failure the communicator is aborted (`ncclCommAbort`) so no rank waits forever;
//!   [`AbortHandle`] aborts it from another thread; `Drop` aborts and never panics or blocks.
//!
//! ## `NCCL_NVLS_ENABLE=0`
//!
//! ferrum's GPU machines must never use NVLink multicast (NVLS). NCCL reads
//! `NCCL_NVLS_ENABLE` once, at its first communicator creation, so set it **in the
//! environment before starting the process** (`NCCL_NVLS_ENABLE=0 ferrum ...`), or with
//! `std::env::set_var` before any thread starts and before the first NCCL call (the tests do
//! this). ferrum-nccl never creates multicast objects itself, and logs a warning when a
//! communicator is made without [`NVLS_ENV`]`=0`; [`nvls_disabled`] tells whether it is set.
//!
//! ## Without the `cuda` feature
//!
//! The crate still builds: the rendezvous works (it only moves 128 bytes), and every NCCL entry
//! point returns [`Error::Unavailable`]. With the feature, NCCL and the CUDA driver are loaded
//! at run time; a missing library is also [`Error::Unavailable`], never a panic.

mod error;
pub mod rendezvous;

pub use error::{Error, RendezvousError, Result};
pub use rendezvous::{IdFile, Publication, Rendezvous, RendezvousOptions, ID_LEN};

#[cfg(feature = "cuda")]
mod comm;
#[cfg(feature = "cuda")]
pub use comm::{group, nccl_version, AbortHandle, DType, Group, NcclElement, NcclRank, UniqueId};
/// cudarc, re-exported so that callers use the same version as ferrum-nccl.
#[cfg(feature = "cuda")]
pub use cudarc;

#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub use stub::{nccl_version, AbortHandle, DType, NcclRank, UniqueId};

/// The environment variable that must be `0` on ferrum's GPU machines (no NVLink multicast).
pub const NVLS_ENV: &str = "NCCL_NVLS_ENABLE";

/// True when `NCCL_NVLS_ENABLE=0` is set in this process's environment.
pub fn nvls_disabled() -> bool {
    std::env::var(NVLS_ENV).map(|v| v.trim() == "0").unwrap_or(false)
}

/// True when this build has the NCCL backend.
pub const fn cuda_built() -> bool {
    cfg!(feature = "cuda")
}
