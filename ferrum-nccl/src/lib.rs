//! # ferrum-nccl
//!
//! The NCCL rank wrapper of ferrum. It will own:
//! - `NcclRank`: one communicator rank, made either for all local GPUs of one process
//!   (`ncclCommInitAll`) or for one rank of a multi-process group from a unique id
//!   (`ncclCommInitRank`), the id handed over by a file or TCP rendezvous;
//! - in-place all-reduce (sum) for f16, bf16 and f32 and an all-gather, graph-capturable;
//! - errors that carry NCCL's own text, communicators aborted on failure so no rank waits
//!   forever, and a `Drop` that never panics.
//!
//! Nothing is implemented yet: this crate is a placeholder in the workspace layering
//! (it sits beside `ferrum-cuda`, below `ferrum-tp` and `ferrum-runner`).
#![forbid(unsafe_code)]
