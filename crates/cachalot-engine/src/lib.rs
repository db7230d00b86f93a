//! The engine: requests and their sampling, stop conditions and streamed text, driving a model
//! family's forward pass. Today it runs one request at a time ([`generate::generate`]); the
//! step loop, scheduler and paged block pool of `shared/DESIGN.md` will drive the same
//! per-sequence pieces ([`sampler::Sampler`], [`generate::TextStream`]).

pub mod generate;
pub mod reasoning;
pub mod sampler;

pub use generate::{generate, FinishReason, Generation, StopConditions, TextStream};
pub use reasoning::{ReasoningSplitter, Segment};
pub use sampler::{Sampler, SamplingError, SamplingParams};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] cachalot_model::ModelError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error("bad request: {0}")]
    Request(String),
}
