//! Typed errors of ferrum-nccl.

use std::path::PathBuf;
use std::time::Duration;

/// Result of ferrum-nccl's fallible calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ferrum-nccl.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No NCCL / CUDA backend: the crate was built without its `cuda` feature, or the NCCL or
    /// CUDA driver library could not be loaded, or there is no such GPU.
    #[error("NCCL is unavailable: {0}")]
    Unavailable(String),
    /// An NCCL call failed. `code` is NCCL's result name, `msg` is `ncclGetErrorString`, and
    /// `detail` is `ncclGetLastError` (NCCL's own description of the last failure).
    #[error("NCCL error during {op}: {code} ({msg}){}", fmt_detail(detail))]
    Nccl {
        /// The NCCL function that failed.
        op: &'static str,
        /// The `ncclResult_t` name, e.g. `ncclSystemError`.
        code: String,
        /// `ncclGetErrorString(code)`.
        msg: String,
        /// `ncclGetLastError(comm)`, empty when NCCL had nothing more to say.
        detail: String,
    },
    /// A CUDA driver call made by ferrum-nccl failed (context creation, binding).
    #[error("CUDA driver error during {op}: {msg}")]
    Cuda {
        /// What was being done.
        op: &'static str,
        /// The driver's own text.
        msg: String,
    },
    /// The communicator was aborted (explicitly, or after an earlier failure); it cannot be
    /// used any more: make a new one.
    #[error("NCCL communicator (rank {rank} of {world_size}) was aborted: {reason}")]
    Aborted {
        /// This communicator's rank.
        rank: usize,
        /// The communicator's size.
        world_size: usize,
        /// Why it was aborted.
        reason: String,
    },
    /// A caller-side mistake (sizes, ranks, streams on the wrong device, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Handing the unique id over failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
}

fn fmt_detail(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(": {detail}")
    }
}

/// Failures of the unique-id rendezvous (file or TCP). These never involve a GPU.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// The id did not arrive (or the peers did not come) within the timeout.
    #[error("rendezvous timed out after {waited:?} {what}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long it waited.
        waited: Duration,
    },
    /// The id file exists but does not hold a valid id.
    #[error("rendezvous id file {path} is not a valid ferrum-nccl id file: {reason} (delete it, or use a fresh path per launch)")]
    BadIdFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The TCP peer spoke something else than the rendezvous protocol, or refused the request.
    #[error("rendezvous protocol error with {peer}: {reason}")]
    Protocol {
        /// The other end.
        peer: String,
        /// What went wrong.
        reason: String,
    },
    /// The id file was written for a world of another size than this rank's (ranks launched
    /// with different world sizes).
    #[error("rendezvous id file {path} is for a world of {theirs} ranks, but this rank was started with a world of {ours} (launch every rank with the same world size)")]
    WorldSizeMismatch {
        /// The file.
        path: PathBuf,
        /// The world size in the file.
        theirs: usize,
        /// This rank's world size.
        ours: usize,
    },
    /// An I/O error (file system, sockets).
    #[error("rendezvous I/O error while {what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Bad arguments (rank not below world size, unresolvable address, ...).
    #[error("invalid rendezvous argument: {0}")]
    InvalidArgument(String),
}

impl RendezvousError {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RendezvousError {
        let what = what.into();
        move |source| RendezvousError::Io { what, source }
    }
}
