//! Errors of the model crate. Every variant names the file, tensor or field at fault and, where
//! one exists, what would fix it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    // (`error`, not `source`: the message already holds it; as a source it was printed twice.)
    #[error("cannot read {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: invalid JSON: {message}")]
    Json { path: PathBuf, message: String },
    #[error("{path}: field `{field}`: {message}")]
    Config {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("{path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error("tensor `{tensor}` in {path}: {message}")]
    Tensor {
        tensor: String,
        path: PathBuf,
        message: String,
    },
    #[error("tensor `{tensor}` is missing from the checkpoint in {dir} (expected {expected})")]
    MissingTensor {
        tensor: String,
        dir: PathBuf,
        expected: String,
    },
    #[error("{0}")]
    Tokenizer(String),
    #[error("invalid batch: {0}")]
    Batch(String),
    #[error("kernel: {0}")]
    Kernel(String),
    /// Non-finite values where the model computes (what, where, the likely cause).
    #[error("{0}")]
    NonFinite(String),
    /// An option given to the model that it cannot honour (what, and how to fix it).
    #[error("{0}")]
    Options(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
