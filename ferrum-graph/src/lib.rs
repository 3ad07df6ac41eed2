//! # ferrum-graph
//!
//! CUDA graph capture and replay of ferrum's decode step. It will own:
//! - capture of a closure on a stream into a graph, instantiate, upload, replay;
//! - step parameters (token id, position, KV length) in device buffers that the captured
//!   kernels read, so one graph serves every position of a sequence;
//! - re-capture only when the buffers a graph references change, and refusal of
//!   host-to-device copies during capture.
//!
//! Nothing is implemented yet: this crate is a placeholder in the workspace layering
//! (it sits above `ferrum-cuda`, below `ferrum-tp` and `ferrum-runner`).
#![forbid(unsafe_code)]
