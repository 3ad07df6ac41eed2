//! Tensor parallelism over CPU ranks (placeholder until the sharding pass lands).
use crate::backend::DecodeBackend;
use crate::error::{Error, Result};
use crate::weights::ModelWeights;

/// A backend that runs `tp` CPU ranks, each on its shard of `weights`.
pub fn cpu_tp_backend(_weights: &ModelWeights, tp: usize, _progress: bool) -> Result<Box<dyn DecodeBackend>> {
    Err(Error::Unavailable("--tp", format!("tensor parallelism over {tp} CPU ranks is not built yet")))
}
