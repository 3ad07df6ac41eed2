//! The API without the `cuda` feature: no graph can be made; every entry point returns
//! [`GraphError::Unavailable`].

use crate::error::{GraphError, Result};
use std::convert::Infallible;

/// How strictly CUDA refuses unsafe calls while capturing (see the `cuda` build's docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// Refused on the capturing thread only (default).
    #[default]
    ThreadLocal,
    /// Refused on every thread.
    Global,
    /// Not refused.
    Relaxed,
}

/// An instantiated CUDA graph. Without the `cuda` feature none can exist.
#[derive(Debug)]
pub struct CapturedGraph {
    never: Infallible,
}

impl CapturedGraph {
    /// Number of nodes in the graph.
    pub fn node_count(&self) -> usize {
        match self.never {}
    }
    /// Number of kernel nodes.
    pub fn kernel_count(&self) -> usize {
        match self.never {}
    }
    /// The kernel nodes' function names, in node order.
    pub fn kernel_names(&self) -> &[String] {
        match self.never {}
    }
    /// Ordinal of the device the graph runs on.
    pub fn device_ordinal(&self) -> usize {
        match self.never {}
    }
}

/// Always [`GraphError::Unavailable`]: built without the `cuda` feature.
pub fn unavailable<T>() -> Result<T> {
    Err(GraphError::Unavailable("ferrum-graph was built without the `cuda` feature".into()))
}
