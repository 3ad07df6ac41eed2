//! # ferrum-runner
//!
//! Model loading (GGUF and HF safetensors), the tokenizer and chat template, sampling, the CPU
//! reference decode path on `candle-core`, and the `ferrum` CLI.
//!
//! ```no_run
//! use ferrum_runner::{load::load_model, weights::WeightFormat};
//! # fn main() -> ferrum_runner::error::Result<()> {
//! let model = load_model("SmolLM2-135M-Instruct.Q4_1.gguf".as_ref(), WeightFormat::Quantized)?;
//! println!("{} layers", model.weights.config.num_layers);
//! # Ok(()) }
//! ```
pub mod backend;
pub mod chat;
pub mod config;
pub mod cpu_quant;
#[cfg(feature = "cuda")]
pub mod cuda_backend;
#[cfg(feature = "cuda")]
pub mod cuda_rank;
#[cfg(feature = "cuda")]
pub mod cuda_tp;
pub mod error;
pub mod fetch;
pub mod generate;
pub mod gguf;
pub mod hf;
pub mod load;
pub mod model;
pub mod npy;
pub mod sampling;
pub mod screen;
pub mod session;
pub mod shard;
pub mod step_tune;
pub mod synthetic;
pub mod tokenizer;
pub mod tp;
#[cfg(feature = "cuda")]
pub mod watchdog;
pub mod weights;

pub use error::{Error, Result};

/// The environment variable that must be `0` on ferrum's GPU machines (no NVLink multicast);
/// the `ferrum` binary sets it when unset.
pub const NVLS_ENV: &str = "NCCL_NVLS_ENABLE";
