//! Model families of cachalot: `config.json` parsing, safetensors checkpoints, and the
//! DeepSeek-V3/R1/Kimi-K2 forward pass over a packed batch with a paged latent KV cache, and the
//! DeepSeek-V4 (Flash/Pro) forward pass over the same batch and cache
//! (`shared/specs/deepseek-v4.md`).
//! See `docs/ARCHITECTURE.md` and `shared/specs/deepseek-v3-r1-kimi-k2.md`.

pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod config_v4;
pub(crate) mod context_parallel;
pub mod deepseek_v3;
pub mod deepseek_v4;
pub mod eplb;
pub mod error;
pub mod eval;
pub mod expert_parallel;
pub mod profile;
pub mod rope;
pub mod tensor_parallel;
pub mod tokenizer;
pub mod v4_ops;

pub use batch::{
    Batch, BlockAllocator, CacheSpec, FloatsMut, KvCache, KvCacheDtype, LayerMut, LogitsWanted,
};
pub use config::{DeepseekV3Config, ModelType};
pub use config_v4::{detect_family, DeepseekV4Config, ModelFamily};
pub use deepseek_v3::{
    AttentionPath, DeepseekV3, ExpertShard, ForwardOutput, Fp8Mode, LoadOptions,
};
pub use deepseek_v4::{DeepseekV4, V4CacheMode, V4LoadOptions};
pub use eplb::BalancedRouting;
pub use error::{ModelError, Result};
pub use expert_parallel::ExpertPlacement;
pub use tensor_parallel::TensorShard;
