//! The typed error of ferrum-runner's library.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a {expected} file ({detail})")]
    NotAModelFile { path: PathBuf, expected: &'static str, detail: String },
    #[error("{path}: file is truncated or corrupt: {detail}")]
    Corrupt { path: PathBuf, detail: String },
    #[error("unknown architecture `{0}` (supported: llama, mistral, qwen2, qwen3)")]
    UnknownArchitecture(String),
    #[error("invalid model config: {0}")]
    BadConfig(String),
    #[error("missing tensor `{name}` in {path}")]
    MissingTensor { path: PathBuf, name: String },
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    BadShape { name: String, got: Vec<usize>, expected: Vec<usize> },
    #[error("tensor `{name}` has dtype {got}, expected {expected}")]
    BadDtype { name: String, got: String, expected: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("token id {token} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("position {position} is past the KV capacity of {capacity} tokens")]
    ContextOverflow { position: usize, capacity: usize },
    #[error("unknown sequence id {0}")]
    UnknownSequence(u64),
    #[error("model fetch: {0}")]
    Fetch(String),
    #[error("{0} is not available: {1}")]
    Unavailable(&'static str, String),
    #[error("tensor-parallel: {0}")]
    Tp(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// ferrum-runner's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
