//! The engine: requests and their sampling, stop conditions and streamed text, driving a model
//! family's forward pass. [`engine::Engine`] is the step loop (continuous batching over a paged
//! KV block pool, [`kv_pool`], planned by the pure-logic [`scheduler`]); [`generate::generate`]
//! is the one-request loop the CLI's `generate` and `chat` use.

/// The collectives (re-exported: `cachalot-comm` sits below the model, which uses them for
/// expert parallelism).
pub use cachalot_comm as comm;
pub mod dsml_args;
pub mod engine;
pub mod generate;
mod json_constraints;
pub mod json_mode;
pub mod json_schema;
pub mod kv_pool;
pub mod metrics;
pub mod reasoning;
pub mod sampler;
pub mod scheduler;
pub mod transfer;

pub use comm::{CommError, Communicator, SingleProcess, TcpComm, TcpRendezvous};
pub use engine::{
    Engine, EngineConfig, JsonLead, Model, Request, RequestOutput, StepReport, TokenLogprob,
};
pub use generate::{
    generate, generate_mtp, FinishReason, Generation, SpecialText, StopConditions, TextStream,
};
pub use reasoning::{ReasoningSplitter, Segment};
pub use sampler::{RngState, Sampler, SamplingError, SamplingParams};
pub use transfer::{KvSnapshot, MtpRows, TransferError};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] cachalot_model::ModelError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// A request or option the engine cannot take, with what would fix it (said as it is:
    /// a server answers it as a 400, a command prints it).
    #[error("{0}")]
    Request(String),
}
