//! An offline run (spec `executor.md` §2): a YAML config's model, dataset and scheduler settings
//! through the engine, with the figures written to `res/<run-id>/`: `summary.json`,
//! `requests.jsonl` (prompt, output, timings per request) and `run.log` (one line per step).
//! `model_config.next_n` > 0 loads the MTP layer and runs MTP speculative decoding in the engine
//! (spec `executor.md` §2.8), with its figures under `mtp` in the summary.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use cachalot_engine::comm::{Communicator, SingleProcess};
use cachalot_engine::engine::kv_bytes_per_block;
use cachalot_engine::metrics::Distribution;
use cachalot_engine::metrics::EngineStats;
use cachalot_engine::{
    Engine, EngineConfig, FinishReason, Model, ReasoningSplitter, Request, RequestOutput,
    SamplingParams, SpecialText, StopConditions,
};
use cachalot_model::tokenizer::{Tokenizer, ToolCallFormat};
use cachalot_model::{
    detect_family, BalancedRouting, DeepseekV3, DeepseekV4, ExpertShard, Fp8Mode, KvCacheDtype,
    LoadOptions, ModelFamily, TensorShard, V4CacheMode, V4LoadOptions,
};
use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use crate::dataset::{self, PromptBuilder};
use rayon::prelude::*;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Settings of a run that are not in the YAML.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The YAML file (names the run and resolves nothing else).
    pub config_path: PathBuf,
    /// Where `res/` goes.
    pub res_dir: PathBuf,
    /// KV pool size in blocks (null block included), instead of the seed's sizing.
    pub kv_blocks: Option<usize>,
    /// Overrides `data_config.num_requests`.
    pub num_requests: Option<usize>,
    /// A chat template (tokenizer_config.json or Jinja) instead of the model's.
    pub chat_template: Option<PathBuf>,
    pub progress: bool,
    pub fp8: Fp8Mode,
    /// Hold the output head in int8 (W8A8) instead of bf16 (`DeepseekV3::quantize_head_int8`).
    pub int8_head: bool,
    /// Multiply bf16 weights as BF16 × BF16 (`LoadOptions::bf16_dot`).
    pub bf16_dot: bool,
    /// How the KV cache stores its float values (`DeepseekV3::set_kv_cache_dtype`,
    /// `DeepseekV4::set_kv_cache_dtype`). None (`--kv-cache-dtype auto`): f32 when `model_config.dtype` is
    /// float32, else bf16 (the seed's C16) for the DeepSeek-V3 family and f32 for V4.
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// Prefix caching (`Engine::set_prefix_caching`): None where it can run.
    pub prefix_caching: Option<bool>,
    /// DeepSeek-V4's cache layout (`DeepseekV4::set_cache_mode`; compact by default).
    pub v4_cache: V4CacheMode,
    /// Expert placement from an earlier run's measured loads (`ExpertPlacement::from_file`),
    /// under a layout that splits the routed experts over the ranks.
    pub expert_placement: Option<PathBuf>,
    /// Extra copies of each placed layer's busiest experts (`--redundant-experts`; dispatched
    /// experts only).
    pub redundant_experts: usize,
    /// Read every tensor before the run and refuse NaN or infinite values
    /// (`Checkpoint::check_values`).
    pub check_tensors: bool,
    /// `model_config.next_n` was set by `--mtp` (errors name the option, not the YAML key).
    pub mtp_option: bool,
    /// Ranks of the run on this host (each sizes its KV pool from its share of the memory
    /// budget); 1 for a one-process run.
    pub host_ranks: usize,
    /// How the ranks of `run_ranked` share the work.
    pub parallel: Parallel,
}

/// How the ranks of a run share the work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Parallel {
    /// Each rank holds the whole model and serves its share of the requests (`batch_size`
    /// split over the ranks), as the seed's attention-DP ranks.
    #[default]
    Data,
    /// The ranks hold the routed experts between them (`ExpertShard`) and run every request
    /// together: all ranks step the same batches, each computes its own experts' outputs and
    /// the MoE layers gather them (one model too large for one host's memory, spread over
    /// several). DeepSeek-V3/R1/Kimi-K2 and V4 checkpoints.
    Expert,
    /// The ranks hold the attention heads and every MLP's intermediate features between them
    /// (`TensorShard`) and run every request together: each layer's attention and MLP outputs
    /// are partial sums added over the ranks. DeepSeek-V3/R1/Kimi-K2 checkpoints.
    Tensor,
    /// Tensor parallel, with the routed experts split whole over the same ranks (as Expert)
    /// instead of each expert's features: vLLM's `--enable-expert-parallel` with tensor
    /// parallelism. Each MoE layer's routed sum is partial too, added with the rest.
    #[serde(rename = "tensor-expert")]
    TensorExpert,
    /// Data-parallel attention with the routed experts split over the same ranks (the seed's
    /// layout with `attn_tp_size: 1, moe_tp_size: 1`; vLLM's data parallelism with
    /// `--enable-expert-parallel`): each rank serves its share of the requests as under Data,
    /// and each MoE layer sends every token to the ranks holding its experts and takes the
    /// outputs back (`ExpertShard::dispatch`). The ranks step together. DeepSeek-V3/R1/Kimi-K2
    /// and V4 checkpoints.
    #[serde(rename = "data-expert")]
    DataExpert,
    /// DataExpert with prefill context parallelism (the seed's `cp_size` = `world_size`,
    /// `attn_tp_size: 1`): every prompt is computed by all ranks, each taking two of its
    /// 2·ranks pieces, with each layer's latent rows (V4: window rows and compressor inputs)
    /// gathered; the request's own rank keeps its KV and decodes it as under DataExpert
    /// (`ExpertShard::context`). DeepSeek-V3/R1/Kimi-K2 and V4 checkpoints.
    Context,
}

impl Parallel {
    /// The `--parallel` spelling.
    pub fn name(self) -> &'static str {
        match self {
            Parallel::Data => "data",
            Parallel::Expert => "expert",
            Parallel::Tensor => "tensor",
            Parallel::TensorExpert => "tensor-expert",
            Parallel::DataExpert => "data-expert",
            Parallel::Context => "context",
        }
    }

    /// What runs a YAML's `parallel_config` as the seed would, for a run with fewer ranks than
    /// its `world_size` (which then records the sizes and applies none).
    pub fn config_hint(pc: &crate::config::ParallelConfig) -> String {
        let w = pc.world_size;
        match Parallel::from_config(pc, w) {
            Ok(Some((p, _))) => format!("--ranks {w} runs its layout ({})", p.name()),
            _ => format!(
                "its sizes are not a layout run here: --ranks {w} --parallel LAYOUT runs one \
                 (docs/CONFIG.md)"
            ),
        }
    }

    /// The layout a YAML's `parallel_config` asks of a group of `ranks` processes (executor
    /// spec §4.3), for a command line that gives no `--parallel`: None when the config's
    /// `world_size` is not `ranks` (its sizes are then recorded, not applied, and the ranks run
    /// data parallel), else the layout with a note on the sizes held whole here, or an error
    /// naming the sizes when it is a layout not done here.
    ///
    /// - `attn_tp_size: 1, moe_tp_size: 1` (the seed's DP attention with EP experts): DataExpert
    ///   (Data for one rank).
    /// - `attn_tp_size` = `moe_tp_size` = `world_size`: Tensor.
    /// - `attn_tp_size` = `world_size`, `moe_tp_size: 1`: TensorExpert.
    /// - `cp_size` = `world_size` with `attn_tp_size: 1, moe_tp_size: 1`: Context.
    pub fn from_config(
        pc: &crate::config::ParallelConfig,
        ranks: usize,
    ) -> Result<Option<(Parallel, Option<String>)>, String> {
        let w = pc.world_size;
        if w != ranks {
            return Ok(None);
        }
        if w == 1 {
            return Ok(Some((Parallel::Data, None)));
        }
        let sizes = format!(
            "parallel_config world_size {w}, attn_tp_size {}, moe_tp_size {}, cp_size {}",
            pc.attn_tp_size, pc.moe_tp_size, pc.cp_size
        );
        if pc.cp_size > 1 && (pc.cp_size != w || pc.attn_tp_size != 1 || pc.moe_tp_size != 1) {
            return Err(format!(
                "{sizes}: context parallelism runs with cp_size equal to world_size, \
                 attn_tp_size 1 and moe_tp_size 1 (as the seed's); give --parallel \
                 data|expert|tensor|tensor-expert|data-expert|context to choose a layout"
            ));
        }
        let (layout, whole) = match (pc.attn_tp_size, pc.moe_tp_size) {
            (1, 1) => (
                if pc.cp_size > 1 {
                    Parallel::Context
                } else {
                    Parallel::DataExpert
                },
                [
                    ("embed_tp_size", pc.embed_tp_size),
                    ("lmhead_tp_size", pc.lmhead_tp_size),
                    ("dense_tp_size", pc.dense_tp_size),
                    ("o_proj_tp_size", pc.o_proj_tp_size),
                    ("shared_tp_size", pc.shared_tp_size),
                ]
                .iter()
                .filter(|(_, v)| *v > 1)
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>(),
            ),
            (a, m) if a == w && (m == w || m == 1) => (
                if m == w {
                    Parallel::Tensor
                } else {
                    Parallel::TensorExpert
                },
                // (The parts those layouts split besides attention and the experts.)
                [
                    ("lmhead_tp_size", pc.lmhead_tp_size),
                    ("dense_tp_size", pc.dense_tp_size),
                ]
                .iter()
                .filter(|(_, v)| *v != w)
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>(),
            ),
            _ => {
                return Err(format!(
                    "{sizes}: this mix is not done here (the layouts run over ranks are DP \
                     attention with EP experts, attn_tp_size 1 and moe_tp_size 1; the same \
                     with prefill context parallelism, cp_size world_size; tensor parallel, \
                     attn_tp_size and moe_tp_size world_size; and tensor parallel with EP \
                     experts, attn_tp_size world_size and moe_tp_size 1); give --parallel to \
                     choose one"
                ))
            }
        };
        let note = (!whole.is_empty()).then(|| {
            if matches!(layout, Parallel::Tensor | Parallel::TensorExpert) {
                format!(
                    "parallel_config: {} split over all {w} ranks all the same (the tensor \
                     layouts here split every layer)",
                    whole.join(", ")
                )
            } else {
                format!(
                    "parallel_config: {} held whole on every rank (each rank runs its own \
                     batch through them; the routed experts are split)",
                    whole.join(", ")
                )
            }
        });
        Ok(Some((layout, note)))
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Throughput {
    /// Generated tokens over the run's wall time.
    pub output_tok_s: f64,
    /// Prompt and generated tokens over the run's wall time.
    pub total_tok_s: f64,
    /// `output_tok_s` over the ranks (processes) that served the run.
    pub output_tok_s_per_rank: f64,
    /// Prompt tokens over the forward time of steps that carried prompt work.
    pub prefill_tok_s: f64,
    /// Generated tokens per second in pure decode steps (`decode tokens / decode step time`);
    /// null when no step was a pure decode step (every request ended at its first token).
    pub decode_tok_s: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub run_id: String,
    pub config: String,
    pub model_name: String,
    pub model_path: String,
    pub dataset: String,
    pub requests: usize,
    pub batch_size: usize,
    /// The prefill budget each rank steps under (derived per rank where the YAML gives 0).
    pub max_prefill_tokens: usize,
    pub max_new_tokens: usize,
    pub ignore_eos: bool,
    /// `model_config.force_eplb`: balanced synthetic expert routing (outputs not meaningful).
    pub force_eplb: bool,
    /// `model_config.with_ckpt`: false when the run used random weights (outputs not meaningful).
    pub with_ckpt: bool,
    /// The output head held in int8 (`--int8-head`).
    pub int8_head: bool,
    /// bf16 weights multiplied as BF16 × BF16 (`--bf16-dot`).
    pub bf16_dot: bool,
    /// The latent KV cache's float values: "f32" or "bf16" (`--kv-cache-dtype`); with
    /// `kv_cache_c8` only the rope keys (the latents are int8).
    pub kv_cache_dtype: &'static str,
    /// The latents are stored as int8 (C8: a W8A8C8 checkpoint's `ckv_scale`).
    #[serde(default)]
    pub kv_cache_c8: bool,
    /// DeepSeek-V4's cache layout, "compact" or "full" (`--v4-cache`); absent for other models.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub v4_cache: Option<&'static str>,
    /// Processes that ran (the config's `world_size` is recorded beside it): with `parallel`
    /// "data" each served every `ranks`-th request; with "expert" they held the routed experts
    /// (with "tensor" the heads and intermediate features) between them and ran every request
    /// together (`per_rank` is then empty and
    /// `output_tok_s_per_rank` is the group's rate over its ranks).
    pub ranks: usize,
    pub parallel: Parallel,
    /// How the ranks exchanged data: "none" (one process), "tcp", "shared memory" or "mpi".
    pub transport: &'static str,
    pub world_size_in_config: usize,
    /// How the config's layout would run ([`Parallel::config_hint`]; the table's note).
    #[serde(skip)]
    pub parallel_hint: String,
    pub threads: usize,
    /// What the products ran on (`cachalot_kernels::kernel_isa`: "avx512+amx-int8", "avx2", …).
    pub kernels: String,
    pub load_s: f64,
    pub wall_s: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub throughput: Throughput,
    pub ttft_s: Distribution,
    /// None (null) when no request decoded a second token (e.g. `max_new_tokens: 1`).
    pub tpot_s: Option<Distribution>,
    pub e2e_s: Distribution,
    /// Engine steps, every rank's summed where ranks ran their own batches (`per_rank` has
    /// each rank's).
    pub steps: usize,
    /// None (null) when no step decoded (every request stopped at its first token).
    pub mean_decode_step_ms: Option<f64>,
    pub preemptions: usize,
    pub kv_block_size: usize,
    /// One rank's KV pool (where ranks run their own batches: the rank whose pool filled
    /// most, with its peak below).
    pub kv_capacity_blocks: usize,
    pub kv_peak_blocks: usize,
    pub kv_peak_fraction: f64,
    /// One rank's KV cache (the largest).
    pub kv_cache_bytes: usize,
    pub finish_reasons: std::collections::BTreeMap<String, usize>,
    /// Each rank's share, when more than one ran.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub per_rank: Vec<RankFigures>,
    /// MTP speculative decoding figures (absent when `next_n` is 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mtp: Option<MtpSummary>,
    /// Prefix caching figures (absent when it was off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_cache: Option<PrefixCacheSummary>,
    /// Tokens per routed expert and how evenly they fall on the ranks (absent without routed
    /// experts).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_load: Option<ExpertLoadSummary>,
}

/// How the run's tokens fell on the routed experts (`expert_load` in summary.json): what expert
/// load balancing would spread.
#[derive(Clone, Debug, Serialize)]
pub struct ExpertLoadSummary {
    /// Tokens each routed expert took, per MoE layer (its checkpoint index; MTP layers after
    /// the main ones), every rank's routing summed.
    pub tokens: std::collections::BTreeMap<String, Vec<u64>>,
    /// Expert-parallel ranks the balancedness is of (the run's; 1 without expert parallelism).
    pub ep_ranks: usize,
    /// Extra copies of the busiest experts per placed layer (`--redundant-experts`).
    #[serde(skip_serializing_if = "is_zero")]
    pub redundant_experts: usize,
    /// vLLM's EPLB balancedness (the mean over the maximum of the ranks' tokens, 1 = even)
    /// over the layers: their mean and the worst layer's.
    pub balancedness_mean: f64,
    pub balancedness_min: f64,
    /// The busiest expert's tokens over the mean expert's, in the layer where that is largest.
    pub hottest_over_mean: f64,
}

impl ExpertLoadSummary {
    /// The figures of per-layer counts over `ep_ranks` expert-parallel ranks holding the
    /// experts as `shard` places them (None without routed experts). `served_by_rank`: under
    /// dispatched experts, the (token, expert) pairs each rank computed per layer (rank
    /// order), which are what the ranks' balance is of (redundant copies split an expert's
    /// tokens); empty where every rank routed the same tokens (each expert's primary copy
    /// computes them).
    pub fn of(
        load: &[(u32, Vec<u64>)],
        ep_ranks: usize,
        shard: ExpertShard,
        served_by_rank: &[Vec<(u32, u64)>],
    ) -> Option<ExpertLoadSummary> {
        if load.is_empty() {
            return None;
        }
        let bal: Vec<f64> = load
            .iter()
            .map(|(k, c)| {
                if ep_ranks > 1 && served_by_rank.len() == ep_ranks {
                    let ranks: Vec<u64> = served_by_rank
                        .iter()
                        .map(|s| s.iter().find(|(key, _)| key == k).map_or(0, |&(_, n)| n))
                        .collect();
                    return cachalot_model::eplb::balancedness_of(&ranks);
                }
                cachalot_model::eplb::balancedness(c, ep_ranks, |e| {
                    if ep_ranks > 1 {
                        shard.owner(*k, e, c.len())
                    } else {
                        0
                    }
                })
            })
            .collect();
        let hottest = load
            .iter()
            .map(|(_, c)| {
                let total: u64 = c.iter().sum();
                let max = c.iter().copied().max().unwrap_or(0);
                if total == 0 {
                    1.0
                } else {
                    max as f64 * c.len() as f64 / total as f64
                }
            })
            .fold(0.0, f64::max);
        Some(ExpertLoadSummary {
            tokens: load
                .iter()
                .map(|(k, c)| (k.to_string(), c.clone()))
                .collect(),
            ep_ranks,
            redundant_experts: shard.placement.map_or(0, |p| p.redundant()),
            balancedness_mean: bal.iter().sum::<f64>() / bal.len() as f64,
            balancedness_min: bal.iter().copied().fold(1.0, f64::min),
            hottest_over_mean: hottest,
        })
    }
}

/// serde's `skip_serializing_if` for counts that are usually zero.
fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Sums per-layer expert counts of several ranks (layers by key).
fn sum_expert_loads<'a>(
    loads: impl Iterator<Item = &'a Vec<(u32, Vec<u64>)>>,
) -> Vec<(u32, Vec<u64>)> {
    let mut sum: std::collections::BTreeMap<u32, Vec<u64>> = Default::default();
    for load in loads {
        for (k, c) in load {
            let acc = sum.entry(*k).or_insert_with(|| vec![0; c.len()]);
            for (a, b) in acc.iter_mut().zip(c) {
                *a += b;
            }
        }
    }
    sum.into_iter().collect()
}

/// Figures of prefix caching over a run.
#[derive(Clone, Debug, Serialize)]
pub struct PrefixCacheSummary {
    /// Prompt tokens of requests when admitted (first admissions and recomputes after
    /// preemption; not prompts being scored), and how many of them had their KV taken from the
    /// cache instead of computed.
    pub queried_tokens: usize,
    pub cached_tokens: usize,
    /// cached / queried.
    pub hit_rate: f64,
}

/// One rank's share of a data-parallel run.
#[derive(Clone, Debug, Serialize)]
pub struct RankFigures {
    pub rank: usize,
    pub requests: usize,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub wall_s: f64,
    pub output_tok_s: f64,
    pub steps: usize,
}

/// What a rank sends rank 0 at the end of a run.
#[derive(Serialize, Deserialize)]
struct RankReport {
    outputs: Vec<RequestOutput>,
    stats: EngineStats,
    expert_load: Vec<(u32, Vec<u64>)>,
    /// Per layer, the dispatched (token, expert) pairs this rank computed.
    #[serde(default)]
    expert_served: Vec<(u32, u64)>,
    wall_s: f64,
    load_s: f64,
    prompt_tokens: usize,
    cache_bytes: usize,
}

/// Figures of MTP speculative decoding over a run.
#[derive(Clone, Debug, Serialize)]
pub struct MtpSummary {
    pub next_n: usize,
    /// Draft tokens verified, and accepted.
    pub drafted: usize,
    pub accepted: usize,
    /// accepted / drafted.
    pub acceptance_rate: f64,
    /// Tokens emitted per verifying step of a request (accepted drafts + 1).
    pub mean_accepted_length: f64,
    /// Tokens emitted per main-model forward of a request (prefill sampling steps included).
    pub tokens_per_main_step: f64,
    /// Time in the MTP layer's drafting forwards (included in the step times); its pass over
    /// each prompt, run with the request's first decode step, counts as prefill time instead.
    pub draft_s: f64,
}

pub struct RunResult {
    pub summary: Summary,
    pub dir: PathBuf,
    pub outputs: Vec<RequestOutput>,
}

/// KV blocks of `per_block` bytes in `fraction` of the memory available less `state_bytes`:
/// Ok(None) where the system does not say how much is available, Err(budget in bytes) where
/// the budget holds fewer than the pool's 2 blocks (the null block and one more).
pub fn blocks_in_memory_share(
    fraction: f64,
    state_bytes: u64,
    per_block: u64,
) -> Result<Option<usize>, u64> {
    let Some(available) = mem_available() else {
        return Ok(None);
    };
    let budget = ((available as f64 * fraction) as u64).saturating_sub(state_bytes);
    if budget < 2 * per_block {
        return Err(budget);
    }
    Ok(Some(cachalot_engine::kv_pool::blocks_for_budget(
        budget, per_block,
    )))
}

/// Memory this process may still take, where the system says: the least of `MemAvailable`,
/// its cgroup's room (cgroup v2 `memory.max` less `memory.current`: a container's limit) and
/// its address space's room (`ulimit -v` less the process's size).
pub fn mem_available() -> Option<u64> {
    let mut room = proc_number("/proc/meminfo", "MemAvailable:", 1)? * 1024;
    for limit in [cgroup_room(), address_space_room()].into_iter().flatten() {
        room = room.min(limit);
    }
    Some(room)
}

/// The process's memory cgroup's limit less its working set (use less inactive page cache):
/// cgroup v2 (`memory.max`, `memory.current`, `inactive_file`) or v1
/// (`memory.limit_in_bytes`, `memory.usage_in_bytes`, `total_inactive_file`); None without a
/// limit or a hierarchy mounted where it usually is.
fn cgroup_room() -> Option<u64> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    // Use less the page cache the kernel can take back (the checkpoint just read fills it):
    // the working set, as the kubelet counts it.
    let room = |dir: PathBuf, max: &str, used: &str, inactive: &str| -> Option<u64> {
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
        let max: u64 = read(max)?.trim().parse().ok()?;
        let used: u64 = read(used)?.trim().parse().ok()?;
        let cache: u64 = read("memory.stat")
            .and_then(|st| {
                st.lines().find_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    (k == inactive).then(|| v.trim().parse().ok())?
                })
            })
            .unwrap_or(0);
        Some(max.saturating_sub(used.saturating_sub(cache)))
    };
    let v1 = groups.lines().find_map(|l| {
        let (_, rest) = l.split_once(':')?;
        let (controllers, path) = rest.split_once(':')?;
        controllers.split(',').any(|c| c == "memory").then(|| {
            let dir = Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
            room(
                dir,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
        })?
    });
    let v2 = groups
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .and_then(|path| {
            let dir = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
            room(dir, "memory.max", "memory.current", "inactive_file")
        });
    match (v1, v2) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `ulimit -v`: the soft address-space limit less the process's virtual size (None when
/// unlimited).
fn address_space_room() -> Option<u64> {
    let soft = proc_number("/proc/self/limits", "Max address space", 3)?;
    let kb = proc_number("/proc/self/status", "VmSize:", 1)?;
    Some(soft.saturating_sub(kb * 1024))
}

/// Word `nth` (whitespace-split) of the first line of `file` that starts with `prefix`, as a
/// number (None when absent or not a number, e.g. "unlimited").
fn proc_number(file: &str, prefix: &str, nth: usize) -> Option<u64> {
    std::fs::read_to_string(file)
        .ok()?
        .lines()
        .find(|l| l.starts_with(prefix))?
        .split_whitespace()
        .nth(nth)?
        .parse()
        .ok()
}

/// The KV pool's size is one the engine can hold: at least the null block and one more, block
/// ids within `u32`, and (where the available memory is known) its bytes within it — two
/// blocks of a huge `block_size`, or a mistyped `--kv-blocks`, are named here instead of
/// failing as an allocation.
fn check_kv_pool(
    num_blocks: usize,
    per_block: u64,
    block_size: usize,
    from_cli: bool,
    available: Option<u64>,
) -> Result<(), Error> {
    let what = if from_cli {
        format!("--kv-blocks {num_blocks}")
    } else {
        format!("the KV pool of {num_blocks} blocks (scheduler_config.block_size {block_size})")
    };
    if num_blocks < 2 {
        return Err(format!(
            "{what}: the pool needs at least 2 blocks (the reserved null block and one more)"
        )
        .into());
    }
    if num_blocks > u32::MAX as usize {
        return Err(format!("{what}: at most {} blocks", u32::MAX).into());
    }
    let bytes = (num_blocks as u64).checked_mul(per_block);
    if let Some(avail) = available {
        if bytes.is_none_or(|b| b > avail) {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            let fix = if from_cli {
                "give fewer blocks"
            } else {
                "lower scheduler_config.block_size (the seed uses 128)"
            };
            return Err(format!(
                "{what} needs {} of KV cache ({per_block} bytes per block), more than the {:.1} GiB of memory available; {fix}",
                bytes.map_or("more than 16 EiB".to_string(), |b| format!("{:.1} GiB", gib(b))),
                gib(avail)
            )
            .into());
        }
    }
    Ok(())
}

/// A u64 another rank sent (8 little-endian bytes); `what` names it when it is not.
fn u64_part(b: &[u8], what: impl Fn() -> String) -> Result<u64, Error> {
    let arr: [u8; 8] = b
        .try_into()
        .map_err(|_| format!("{} of {} bytes, not 8", what(), b.len()))?;
    Ok(u64::from_le_bytes(arr))
}

/// `YYYYMMDD-HHMMSS` in UTC.
fn timestamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn new_run_dir(res: &Path, model_name: &str, config: &Path) -> std::io::Result<(String, PathBuf)> {
    let stem = config
        .file_stem()
        .map_or("run".into(), |s| s.to_string_lossy().into_owned());
    let base = format!("{}_{model_name}_{stem}", timestamp());
    for n in 0.. {
        let id = if n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        };
        let dir = res.join(&id);
        if !dir.exists() {
            std::fs::create_dir_all(&dir)?;
            return Ok((id, dir));
        }
    }
    unreachable!()
}

/// The other ranks' partial files beside `mine` (ranks on this host write into the same run
/// directory), as the end of an error's sentence: `; the other ranks' in A, B` or nothing.
fn other_partials(mine: &Path) -> String {
    let Some(dir) = mine.parent() else {
        return String::new();
    };
    let mut others: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p != mine
                && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n.starts_with("requests.rank") && n.ends_with(".partial.jsonl")
                })
                && std::fs::metadata(p).is_ok_and(|m| m.len() > 0)
        })
        .map(|p| p.display().to_string())
        .collect();
    others.sort();
    if others.is_empty() {
        String::new()
    } else {
        format!("; the other ranks' in {}", others.join(", "))
    }
}

/// One line of `requests.jsonl`: the request's prompt, output, ids, timings, and the tool
/// calls its answer holds (or why they do not parse).
fn request_line(
    o: &RequestOutput,
    prepared: &[dataset::Prepared],
    tool_format: Option<ToolCallFormat>,
) -> Result<serde_json::Value, Error> {
    let p = &prepared[o.id as usize];
    let mut v = serde_json::json!({
        "id": o.id,
        "prompt": p.user,
        "prompt_text": p.text,
        "prompt_ids": o.prompt,
        "prompt_truncated_tokens": p.truncated,
        "output": o.text,
        "output_ids": o.tokens,
        "valid_output_tokens": o.valid_tokens,
        "finish_reason": o.finish.as_str(),
        "timing": o.timing,
    });
    // Tool calls the model wrote (only when it wrote a tool-call section).
    if let (Some(f), Some(obj)) = (tool_format, v.as_object_mut()) {
        let answer = ReasoningSplitter::split_at(&p.text, &o.text, f.ends_reasoning()).1;
        if f.mentions_tool_calls(&answer) {
            match f.parse_ended(&answer, o.finish == FinishReason::Length) {
                Ok(parsed) => {
                    obj.insert(
                        "tool_calls".into(),
                        serde_json::to_value(parsed.tool_calls)?,
                    );
                }
                Err(e) => {
                    obj.insert("tool_call_error".into(), e.to_string().into());
                }
            }
        }
    }
    Ok(v)
}

/// The placement `--expert-placement` names (run's and serve's), with `--redundant-experts`
/// copies, for `ranks` ranks that split the routed experts (`splits_experts`: every rank runs
/// the same tokens; `dispatch`: each its own, dispatched to the experts' ranks); refused under
/// a layout that does not, and copies where the tokens are not dispatched.
pub fn expert_placement(
    path: Option<&Path>,
    redundant: usize,
    splits_experts: bool,
    dispatch: bool,
    ranks: usize,
) -> Result<Option<&'static cachalot_model::ExpertPlacement>, Error> {
    match path {
        None if redundant > 0 => Err("--redundant-experts copies the busiest experts of an \
             earlier run's loads: give --expert-placement FILE (that run's summary.json) too"
            .into()),
        None => Ok(None),
        Some(_) if !splits_experts && !dispatch => Err("--expert-placement places the routed \
             experts over expert-parallel ranks: give --ranks N and --parallel expert, \
             tensor-expert, data-expert or context"
            .into()),
        Some(_) if redundant > 0 && !dispatch => Err("--redundant-experts: redundant expert \
             copies serve the tokens each rank dispatches (--parallel data-expert or context); \
             where every rank runs the same tokens (expert, tensor-expert) give none"
            .into()),
        Some(path) => Ok(Some(
            cachalot_model::ExpertPlacement::from_file(path, ranks, redundant)?.leak(),
        )),
    }
}

/// What an interrupted run (Ctrl-C, SIGTERM) leaves tidy: temporary directories to remove
/// (random weights of `with_ckpt: false`) and the file its finished requests are in.
struct InterruptState {
    remove: Vec<PathBuf>,
    partial: Option<PathBuf>,
}

static INTERRUPT: std::sync::Mutex<InterruptState> = std::sync::Mutex::new(InterruptState {
    remove: Vec::new(),
    partial: None,
});

/// Registers a temporary directory for [`on_interrupt`] to remove.
pub fn remove_on_interrupt(dir: &Path) {
    if let Ok(mut g) = INTERRUPT.lock() {
        g.remove.push(dir.to_path_buf());
    }
}

/// Unregisters a directory removed in the ordinary way.
pub fn forget_on_interrupt(dir: &Path) {
    if let Ok(mut g) = INTERRUPT.lock() {
        g.remove.retain(|d| d != dir);
    }
}

/// For a Ctrl-C/SIGTERM handler: removes the registered temporary directories and says where
/// the requests finished so far are, if a run is under way (this rank's partial file, and the
/// other ranks' beside it).
pub fn on_interrupt() -> Option<String> {
    let mut g = INTERRUPT.lock().ok()?;
    for d in g.remove.drain(..) {
        let _ = std::fs::remove_dir_all(d);
    }
    // (Ranks on this host write theirs beside it: a signal to rank 0 alone names them too.)
    let p = g.partial.as_ref()?;
    Some(format!("{}{}", p.display(), other_partials(p)))
}

fn set_partial(p: Option<PathBuf>) {
    if let Ok(mut g) = INTERRUPT.lock() {
        g.partial = p;
    }
}

/// Why a `batch_size` that does not divide by the data-parallel ranks is refused.
pub fn batch_split_refusal(config: &Path, batch: usize, ranks: usize) -> String {
    format!(
        "{}: scheduler_config.batch_size {batch} is the batch over all ranks and must divide by \
         the {ranks} ranks (each rank runs batch_size / ranks); give a multiple of {ranks}",
        config.display()
    )
}

/// Why `--kv-cache-dtype fp8` is refused outside DeepSeek-V4.
pub fn fp8_cache_refusal() -> String {
    "--kv-cache-dtype fp8 is DeepSeek-V4's cache (compressed entries in e4m3); the \
     DeepSeek-V3/R1/Kimi-K2 latent cache is f32 or bf16, or int8 (C8) from a W8A8C8 checkpoint \
     (cachalot convert --quant-mode w8a8c8)"
        .to_string()
}

pub fn run(cfg: &RunConfig, opts: &RunOptions) -> Result<RunResult, Error> {
    run_ranked(cfg, opts, Arc::new(SingleProcess))
}

/// A run as one rank of `comm`'s group. Data parallel (`opts.parallel`): every rank loads the
/// model and serves requests `rank, rank + ranks, ...` (each sampled with the seed it has in a
/// one-process run, so outputs do not depend on the number of ranks); rank 0 makes the run
/// directory, gathers every rank's outputs and figures and writes `summary.json` and
/// `requests.jsonl` for the whole run. Expert parallel: every rank loads its share of the
/// routed experts and all ranks run every request in lockstep (the same outputs on each);
/// rank 0 writes the files. Other ranks log to `run.rank<R>.log` beside rank 0's `run.log` and
/// return their own figures.
pub fn run_ranked(
    cfg: &RunConfig,
    opts: &RunOptions,
    comm: Arc<dyn Communicator>,
) -> Result<RunResult, Error> {
    // A run that fails after its log was opened ends the log with why.
    let mut log_path = None;
    let result = run_logged(cfg, opts, comm, &mut log_path);
    if let (Err(e), Some(path)) = (&result, &log_path) {
        // (A stop the run logged itself, "the run stopped: …", is said there already.)
        let logged = std::fs::read_to_string(path).is_ok_and(|log| {
            log.lines()
                .last()
                .is_some_and(|l| l.contains("the run stopped"))
        });
        if !logged {
            if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(path) {
                let _ = writeln!(f, "error: {e}");
            }
        }
    }
    result
}

/// The config's problems that only its checkpoint in `model_dir` shows, all at once and with
/// their lines, before a results directory is made or a weight is loaded: a `model_name` of
/// another family, `custom_params.num_hidden_layers` beyond the checkpoint's layers, drafts
/// (`next_n`) without an MTP layer, DeepSeek-V4's random weights without `force_eplb`.
/// Returns the model's positions (`max_position_embeddings`).
fn check_against_checkpoint(
    cfg: &RunConfig,
    opts: &RunOptions,
    model_dir: &Path,
) -> Result<usize, Error> {
    let m = &cfg.model_config;
    let family = detect_family(model_dir)?;
    let v4 = family == ModelFamily::DeepseekV4;
    let (v3, v4_cfg) = if v4 {
        (
            None,
            Some(cachalot_model::DeepseekV4Config::from_dir(model_dir)?),
        )
    } else {
        (
            Some(cachalot_model::DeepseekV3Config::from_dir(model_dir)?),
            None,
        )
    };
    let mut found = Vec::new();
    // (A YAML without model_name, "model" here, runs whatever the checkpoint is.)
    if m.model_name != "model" && (m.model_name == "deepseek_v4") != v4 {
        let name = match &v3 {
            None => "deepseek_v4",
            // A Kimi-K2 checkpoint (its config's model_type) is named as the seed names it.
            Some(c) if c.model_type == cachalot_model::ModelType::KimiK2 => "kimi_k2_thinking",
            Some(_) => "deepseek_r1",
        };
        found.push((
            "model_config.model_name".to_string(),
            format!(
                "{:?} does not match the checkpoint in {} ({family:?}); use model_name \"{name}\"",
                m.model_name,
                model_dir.display(),
            ),
        ));
    }
    let layers = m
        .custom_params
        .get("num_hidden_layers")
        .and_then(serde_json::Value::as_u64);
    if let (Some(n), Some(c)) = (layers, &v3) {
        if n as usize > c.num_hidden_layers {
            found.push((
                "model_config.custom_params.num_hidden_layers".to_string(),
                format!(
                    "{n} exceeds the checkpoint's {} layers (config.json num_hidden_layers); \
                     give at most {}, or leave it out to run the whole model",
                    c.num_hidden_layers, c.num_hidden_layers
                ),
            ));
        }
    }
    let (mtp_layers, positions) = match (&v3, &v4_cfg) {
        (Some(c), _) => (c.num_nextn_predict_layers, c.max_position_embeddings),
        (_, Some(c)) => (c.num_nextn_predict_layers, c.max_position_embeddings),
        _ => (0, usize::MAX),
    };
    if m.next_n > 0 && mtp_layers == 0 {
        let (key, off) = if opts.mtp_option {
            ("--mtp", "--mtp 0")
        } else {
            ("model_config.next_n", "next_n: 0")
        };
        found.push((
            key.to_string(),
            format!(
                "{} draft tokens need the model's MTP layer, and {} has none \
                 (num_nextn_predict_layers 0 in its config.json): give {off}",
                m.next_n,
                model_dir.display()
            ),
        ));
    }
    if !m.with_ckpt && v4 && !m.force_eplb {
        found.push((
            "model_config.with_ckpt".to_string(),
            "false with a DeepSeek-V4 model requires model_config.force_eplb: true (as in the \
             seed: random gates and hash tables would route unevenly); set force_eplb: true"
                .to_string(),
        ));
    }
    if found.is_empty() {
        Ok(positions)
    } else {
        Err(crate::config::issues_at(&opts.config_path, found).into())
    }
}

/// [`run_ranked`], naming its log in `log_path` once it is open.
fn run_logged(
    cfg: &RunConfig,
    opts: &RunOptions,
    comm: Arc<dyn Communicator>,
    log_path: &mut Option<PathBuf>,
) -> Result<RunResult, Error> {
    let (rank, ranks) = (comm.rank(), comm.world_size());
    // Expert or tensor parallel: one model over the ranks, which run every request in
    // lockstep (named `expert` for the lockstep below; `tensor` picks the shard).
    let tensor = matches!(opts.parallel, Parallel::Tensor | Parallel::TensorExpert) && ranks > 1;
    // Data-parallel ranks whose MoE layers dispatch tokens to the experts' ranks.
    let dispatch = matches!(opts.parallel, Parallel::DataExpert | Parallel::Context) && ranks > 1;
    let context = opts.parallel == Parallel::Context && ranks > 1;
    let experts_split =
        matches!(opts.parallel, Parallel::Expert | Parallel::TensorExpert) && ranks > 1;
    let expert = (experts_split || tensor) && ranks > 1;
    // Data-parallel ranks (1 under expert or tensor parallelism: the group serves one request
    // stream), and this rank's place among them.
    let (dp_rank, dp) = if expert { (0, 1) } else { (rank, ranks) };
    // The routed experts this rank holds, or its share of heads and intermediate features.
    let placement = expert_placement(
        opts.expert_placement.as_deref(),
        opts.redundant_experts,
        experts_split,
        dispatch,
        ranks,
    )?;
    let shard = if experts_split || dispatch {
        ExpertShard {
            rank,
            ranks,
            dispatch,
            context,
            placement,
        }
    } else {
        ExpertShard::default()
    };
    let tensor_shard = if tensor {
        TensorShard { rank, ranks }
    } else {
        TensorShard::default()
    };
    // `batch_size` is the global batch over data-parallel ranks, as the seed's (executor spec
    // §1: `batch_size_per_dp_rank = batch_size / attn_dp_size`, an error when it does not
    // divide); each rank batches its share.
    let batch = cfg.scheduler_config.batch_size;
    if !batch.is_multiple_of(dp) {
        return Err(batch_split_refusal(&opts.config_path, batch, dp).into());
    }
    let rank_batch = batch / dp;
    let prefill_budget = match cfg.scheduler_config.max_prefill_tokens {
        0 if dp > 1 => cfg.data_config.input_truncated_len * rank_batch,
        _ => cfg.max_prefill_tokens(),
    };
    let m = &cfg.model_config;
    let model_dir = PathBuf::from(&m.model_path);
    if m.model_path.trim().is_empty() {
        return Err(format!(
            "{}: model_config.model_path is not set (the model's Hugging Face directory; an \
             empty or comment-only file sets nothing; configs/default.yaml is an example)",
            opts.config_path.display()
        )
        .into());
    }
    if !model_dir.join("config.json").is_file() {
        let hint = if m.model_path.starts_with("assets/") {
            " (the small model ships in assets/cachalot-tiny-r1; run from the repository \
             root, or fix model_path)"
        } else {
            ""
        };
        let hint = if hint.is_empty() {
            " (put the model's Hugging Face directory there, or a link to it, or fix \
             model_path; docs/CONFIG.md)"
        } else {
            hint
        };
        return Err(format!(
            "model_config.model_path {:?}: no config.json there{hint}",
            m.model_path
        )
        .into());
    }
    let positions = check_against_checkpoint(cfg, opts, &model_dir)?;
    // Prompts first (tokenizer, chat template, dataset, truncation): a missing dataset or a
    // bad prompt is named before a results directory is made or a weight is loaded.
    let n_req = opts.num_requests.unwrap_or(cfg.num_requests());
    let tokenizer = Tokenizer::from_dir(&model_dir)?;
    let template = match &opts.chat_template {
        Some(f) => Some(tokenizer.chat_template_from_file(f)?),
        None => tokenizer.chat_template()?,
    };
    let mut early_notes = Vec::new();
    if let (Some(p), Some(path)) = (placement, &opts.expert_placement) {
        early_notes.push(format!(
            "expert placement from {}: {} layers placed by their measured loads{}",
            path.display(),
            p.layers_placed(),
            match p.redundant() {
                0 => String::new(),
                r => format!(", {r} redundant copies each"),
            }
        ));
    }
    if template.is_none() {
        early_notes.push("no chat template: prompts are sent as raw text".to_string());
    }

    // Prompts.
    let d = &cfg.data_config;
    let base = if d.dataset_path.is_empty() {
        PathBuf::from("dataset")
    } else {
        PathBuf::from(&d.dataset_path)
    };
    let loaded = dataset::load(&d.dataset, &base)?;
    early_notes.extend(loaded.notes.iter().cloned());
    let n_prompts = loaded.prompts.len();
    let builder = PromptBuilder {
        tokenizer: &tokenizer,
        template: template.as_ref(),
        max_len: d.input_truncated_len,
    };
    let s = &cfg.scheduler_config;
    // Each distinct prompt is prepared once, over the pool's threads (a long context's
    // tokenization is the costly part), then the list is cycled to the request count as the
    // seed does.
    let distinct: Vec<dataset::Prepared> = loaded.prompts[..n_prompts.min(n_req)]
        .par_iter()
        .map(|p| {
            if d.dataset == "default" {
                builder.prepare(p)
            } else {
                builder.prepare_summary(p, s.max_new_tokens)
            }
        })
        .collect::<Result<_, _>>()?;
    let prepared: Vec<dataset::Prepared> = distinct.iter().cycle().take(n_req).cloned().collect();
    drop(distinct);
    // A prompt that fills the model's positions leaves nothing to generate: said before a
    // results directory is made (the engine would refuse it at its turn).
    let too_long = |p: &dataset::Prepared| p.ids.len() >= positions;
    if let Some((i, p)) = prepared.iter().enumerate().find(|(_, p)| too_long(p)) {
        let n = prepared.iter().filter(|p| too_long(p)).count();
        return Err(format!(
            "request {i} (prompt {} of the {} dataset){}: the prompt has {} tokens; the model \
             takes at most {positions} positions (max_position_embeddings in {}) and this \
             leaves none to generate: shorten the prompts (data_config.input_truncated_len {} \
             in {}: give at most {})",
            i % n_prompts.max(1),
            d.dataset,
            if n > 1 {
                format!(" and {} more", n - 1)
            } else {
                String::new()
            },
            p.ids.len(),
            model_dir.join("config.json").display(),
            d.input_truncated_len,
            opts.config_path.display(),
            positions.saturating_sub(1)
        )
        .into());
    }
    let truncated = prepared.iter().filter(|p| p.truncated > 0).count();
    if truncated > 0 {
        early_notes.push(format!(
            "{truncated} prompts cut to input_truncated_len {}",
            d.input_truncated_len
        ));
    }

    // Rank 0 names the run; the others learn the name (and fail with rank 0's error, as a
    // closed connection, if it could not make the directory).
    let made = if rank == 0 {
        Some(
            new_run_dir(&opts.res_dir, &m.model_name, &opts.config_path).map_err(|e| {
                format!(
                    "--res-dir {}: cannot make the run's directory there: {e}",
                    opts.res_dir.display()
                )
            })?,
        )
    } else {
        None
    };
    // With the name goes what every rank must agree on to shard the same request list.
    // (Paths may differ between hosts.)
    let mut same = cfg.clone();
    same.model_config.model_path.clear();
    same.data_config.dataset_path.clear();
    // With the options that change what a rank computes (a chat template's path may differ
    // between hosts; whether there is one may not).
    // Named fields, so a mismatch names what differs. The checkpoint is identified by its
    // config.json and the prompts by their token ids (tokenizer, template and dataset
    // together), since paths may differ between hosts.
    let digest = |bytes: &[u8]| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        bytes.hash(&mut h);
        format!("{:016x}", h.finish())
    };
    let model_config = std::fs::read(model_dir.join("config.json"))?;
    let prompt_ids: Vec<u32> = prepared
        .iter()
        .flat_map(|p| p.ids.iter().copied().chain([u32::MAX]))
        .collect();
    let mut fields: Vec<(String, String)> = [
        ("--num-requests", n_req.to_string()),
        ("--parallel", format!("{:?}", opts.parallel)),
        ("--int8-head", opts.int8_head.to_string()),
        ("--bf16-dot", opts.bf16_dot.to_string()),
        (
            "--kv-cache-dtype",
            opts.kv_cache_dtype.map_or("auto", |d| d.name()).to_string(),
        ),
        ("--fp8", format!("{:?}", opts.fp8)),
        ("--chat-template", opts.chat_template.is_some().to_string()),
        ("--kv-blocks", format!("{:?}", opts.kv_blocks)),
        ("--prefix-caching", format!("{:?}", opts.prefix_caching)),
        (
            "the expert placement (--expert-placement, --redundant-experts)",
            digest(format!("{placement:?}").as_bytes()),
        ),
        ("the model's config.json", digest(&model_config)),
        (
            "the prompts' token ids (tokenizer, template, dataset)",
            digest(
                &prompt_ids
                    .iter()
                    .flat_map(|t| t.to_le_bytes())
                    .collect::<Vec<_>>(),
            ),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    // The YAML key by key (options such as --mtp write theirs into it), so that a mismatch
    // names the key.
    fn leaves(prefix: String, v: &serde_json::Value, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(o) => {
                for (k, x) in o {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    leaves(key, x, out);
                }
            }
            other => out.push((
                format!("the YAML's {prefix} (or the option that sets it)"),
                other.to_string().replace('\n', " "),
            )),
        }
    }
    leaves(
        String::new(),
        &serde_json::to_value(&same).unwrap_or_default(),
        &mut fields,
    );
    let fingerprint: String = fields
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("\n");
    let named = made
        .as_ref()
        .map_or(String::new(), |(id, _)| format!("{id}\n{fingerprint}"));
    let named = String::from_utf8(comm.broadcast(0, named.as_bytes())?)?;
    let (run_id, theirs) = named
        .split_once('\n')
        .ok_or_else(|| format!("rank {rank}: rank 0 sent no run name"))?;
    let verdict = if theirs != fingerprint {
        let differs = fields
            .iter()
            .zip(theirs.lines())
            .find(|((k, v), line)| *line != format!("{k}={v}"))
            .map_or("the run's settings", |((k, _), _)| k.as_str());
        format!(
            "rank {rank}: {differs} differs from rank 0's; every rank must run the same YAML, \
             options, checkpoint and prompts"
        )
    } else {
        String::new()
    };
    // Every rank (rank 0 included) learns which ranks refused and why.
    let refusals: Vec<String> = comm
        .all_gather(verdict.as_bytes())?
        .iter()
        .filter(|v| !v.is_empty())
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    if !refusals.is_empty() {
        return Err(refusals.join("; ").into());
    }
    let run_id = run_id.to_string();
    // Each rank's own --res-dir (ranks on other hosts write their logs there).
    let dir = made.map_or_else(|| opts.res_dir.join(&run_id), |(_, d)| d);
    std::fs::create_dir_all(&dir)?;
    let log_name = if rank == 0 {
        "run.log".to_string()
    } else {
        format!("run.rank{rank}.log")
    };
    let mut log = std::fs::File::create(dir.join(&log_name))?;
    *log_path = Some(dir.join(&log_name));
    let t_start = Instant::now();
    // A log that cannot be written (a full disk) is said once; the run goes on without it
    // (what it must keep, the finished requests, fails by name where it is written).
    let log_failed = std::cell::Cell::new(false);
    macro_rules! logln {
        ($($a:tt)*) => {{
            let line = format!($($a)*);
            if !log_failed.get() {
                if let Err(e) = writeln!(log, "[{:9.3}s] {line}", t_start.elapsed().as_secs_f64()) {
                    log_failed.set(true);
                    eprintln!(
                        "warning: cannot write {} ({e}); the run goes on without its log",
                        dir.join(&log_name).display()
                    );
                }
            }
        }};
    }
    logln!("config {}", opts.config_path.display());
    logln!(
        "kernels: {} ({} threads)",
        cachalot_kernels::kernel_isa(),
        rayon_threads()
    );
    if tensor {
        logln!(
            "rank {rank} of {ranks} (tensor parallel: this rank holds heads \
             [{rank}·H/{ranks}, {}·H/{ranks}) and that share of every MLP's intermediate \
             features{}; all ranks run every request)",
            rank + 1,
            if experts_split {
                " but the routed experts', which it holds whole: experts [r·E/N, (r+1)·E/N)"
            } else {
                ""
            }
        );
    } else if expert {
        logln!(
            "rank {rank} of {ranks} (expert parallel: this rank holds routed experts \
             [{rank}·E/{ranks}, {}·E/{ranks}) of every MoE layer; all ranks run every request)",
            rank + 1
        );
    } else if dispatch {
        logln!(
            "rank {rank} of {ranks} (data parallel with expert parallel MoE: requests {rank}, \
             {rank} + {ranks}, ...; batch {rank_batch} of the global {batch}, prefill budget \
             {prefill_budget} tokens; this rank holds routed experts [{rank}·E/{ranks}, \
             {}·E/{ranks}) and each MoE layer sends tokens to their experts' ranks)",
            rank + 1
        );
    } else if ranks > 1 {
        logln!(
            "rank {rank} of {ranks} (data parallel: requests {rank}, {rank} + {ranks}, ...; \
             batch {rank_batch} of the global {batch}, prefill budget {prefill_budget} tokens)"
        );
    }
    if ranks > 1 {
        logln!("the ranks exchange data over {}", comm.transport());
    }
    logln!("{}", serde_json::to_string(cfg)?);
    if cfg.parallel_config.world_size > ranks {
        logln!(
            "note: the config's world_size {} and its TP/EP/CP sizes are recorded, not applied; \
             {ranks} process(es) run the whole model ({})",
            cfg.parallel_config.world_size,
            Parallel::config_hint(&cfg.parallel_config)
        );
    }

    let t_load = Instant::now();
    // The checkpoint decides the family; model_name must agree with it.
    let family = detect_family(&model_dir)?;
    // The seed's `model_config.dtype` names the cache's dtype (executor spec §1.1: its only
    // use there); bfloat16, its default, gives V4 f32 here unless --kv-cache-dtype says bf16
    // (V4's f32 cache is exact against its reference), or fp8 on platform_version 950.
    let dtype = m.dtype.to_ascii_lowercase();
    let dtype = dtype.strip_prefix("torch.").unwrap_or(&dtype);
    let f32_dtype = ["float32", "fp32", "f32", "float"].contains(&dtype);
    // (The YAML's check; here too for configs built in code.)
    if !crate::config::is_torch_dtype(&m.dtype) {
        return Err(format!(
            "model_config.dtype {:?}: expected bfloat16 (the seed's default) or float32 (an f32 \
             cache; also fp32, f32), or float16",
            m.dtype
        )
        .into());
    }
    let kv_cache_dtype = match opts.kv_cache_dtype {
        Some(d) => d,
        None if f32_dtype => KvCacheDtype::F32,
        // The seed's Ascend 950 keeps DeepSeek-V4's cache in fp8 (spec deepseek-v4.md §3).
        None if family == ModelFamily::DeepseekV4
            && m.platform_version.as_deref() == Some("950")
            && opts.v4_cache == V4CacheMode::Compact =>
        {
            KvCacheDtype::Fp8
        }
        None if family == ModelFamily::DeepseekV4 => KvCacheDtype::F32,
        None => KvCacheDtype::Bf16,
    };
    if kv_cache_dtype == KvCacheDtype::Fp8 && family != ModelFamily::DeepseekV4 {
        return Err(fp8_cache_refusal().into());
    }
    // with_ckpt: false (the seed's dummy loader, executor spec §6.6): random weights of the
    // config's shapes in a temporary directory (removed when the run ends); config and
    // tokenizer stay those of model_path.
    let dummy = if m.with_ckpt {
        None
    } else {
        let d =
            crate::random_model::dummy(&model_dir, None, shard).map_err(|e| format!("{e:#}"))?;
        logln!(
            "with_ckpt: false: random {} weights ({:.1} MB) in {} (outputs are not meaningful)",
            d.quant,
            crate::random_model::dir_bytes(&d.dir) as f64 / 1e6,
            d.dir.display()
        );
        Some(d)
    };
    let weights_dir = dummy.as_ref().map_or(model_dir.clone(), |d| d.dir.clone());
    if opts.check_tensors {
        cachalot_model::checkpoint::Checkpoint::open(&weights_dir)?.check_values()?;
        logln!(
            "--check-tensors: every tensor of {} holds numbers",
            weights_dir.display()
        );
    }
    // custom_params: model-specific switches of the seed's NPU models; the one that changes
    // the model, num_hidden_layers (reduced-layer testing), is applied to V3-family models.
    // (Types and near misses of num_hidden_layers are checked with the YAML.)
    let mut max_layers = None;
    for (k, v) in &m.custom_params {
        if k == "num_hidden_layers" {
            let n = v.as_u64().filter(|&n| n >= 1).ok_or_else(|| {
                format!(
                    "model_config.custom_params.num_hidden_layers: expected a positive integer, \
                     got {v}"
                )
            })?;
            if family == ModelFamily::DeepseekV4 {
                logln!(
                    "note: custom_params.num_hidden_layers {n} is not applied to DeepSeek-V4 \
                     (the whole model runs)"
                );
            } else {
                logln!("custom_params.num_hidden_layers: only the first {n} decoder layers run");
                max_layers = Some(n as usize);
            }
        } else if crate::config::CUSTOM_KEYS.iter().any(|c| c.name == k) {
            logln!("custom_params.{k}: an NPU switch, no effect here");
        } else {
            let keys = crate::config::CUSTOM_KEYS.iter().map(|c| c.name);
            let near = crate::config::closest(k, keys, 0.92)
                .map_or(String::new(), |c| format!(" (did you mean `{c}`?)"));
            logln!(
                "note: custom_params.{k} is not a key of the seed's models{near}; no effect here"
            );
            // A near miss of a key is most likely a typo: said where the user sees it too.
            if !near.is_empty() && rank == 0 {
                eprintln!(
                    "cachalot run: warning: model_config.custom_params.{k} is not a key of the \
                     seed's models{near}; it has no effect"
                );
            }
        }
    }
    // force_eplb's balanced assignment: data-parallel ranks that dispatch to each other's
    // experts shift it by their rank, as the seed's ranks do, so each rank's tokens start on
    // other experts; otherwise as one process.
    let balanced = |e: usize| {
        if dispatch {
            BalancedRouting::new(rank, ranks, e)
        } else {
            BalancedRouting::single_process(e)
        }
    };
    // The run log's line on the weights this rank holds.
    let held = |bytes: usize| {
        format!(
            "{:.1} MB of weights held on this rank{}",
            bytes as f64 / 1e6,
            if tensor {
                " (its share of the heads, intermediate features and vocabulary)"
            } else if expert || dispatch {
                " (its share of the routed experts)"
            } else {
                ""
            }
        )
    };
    let (v3, v4);
    let (model, config_eos): (&(dyn Model + Sync), Vec<u32>) = match family {
        ModelFamily::DeepseekV3 => {
            if opts.v4_cache == V4CacheMode::Full {
                return Err(format!(
                    "--v4-cache full: {} is a DeepSeek-V3/R1/Kimi-K2 model, whose cache has one \
                     layout (the option is DeepSeek-V4's); drop it",
                    weights_dir.display()
                )
                .into());
            }
            let mut model = DeepseekV3::load(
                &weights_dir,
                LoadOptions {
                    fp8: opts.fp8,
                    load_mtp: m.next_n > 0,
                    bf16_dot: opts.bf16_dot,
                    expert_shard: shard,
                    tensor_shard,
                    max_layers,
                },
            )?;
            if expert || dispatch {
                model.set_communicator(comm.clone())?;
            }
            if opts.int8_head {
                model.quantize_head_int8();
            }
            model.set_kv_cache_dtype(kv_cache_dtype);
            if m.force_eplb {
                let e = model.config().n_routed_experts.unwrap_or(0);
                model.set_force_eplb(Some(balanced(e)?))?;
            }
            logln!("{}", held(model.weight_bytes()));
            v3 = model;
            (&v3, v3.config().eos_token_ids.clone())
        }
        ModelFamily::DeepseekV4 => {
            let mut model = DeepseekV4::load(
                &weights_dir,
                V4LoadOptions {
                    load_mtp: m.next_n > 0,
                    bf16_dot: opts.bf16_dot,
                    expert_shard: shard,
                    tensor_shard,
                },
            )?;
            if expert || dispatch {
                model.set_communicator(comm.clone())?;
            }
            if opts.int8_head {
                model.quantize_head_int8();
            }
            if m.force_eplb {
                let e = model.config().n_routed_experts;
                model.set_force_eplb(Some(balanced(e)?))?;
            }
            model.set_cache_mode(opts.v4_cache);
            model.set_kv_cache_dtype(kv_cache_dtype);
            logln!("{}", held(model.weight_bytes()));
            v4 = model;
            (&v4, v4.config().eos_token_ids.clone())
        }
    };
    let load_s = t_load.elapsed().as_secs_f64();
    logln!("loaded {} in {load_s:.2}s", weights_dir.display());
    if m.force_eplb {
        logln!(
            "force_eplb: routed experts get a balanced synthetic assignment (a throughput \
             benchmark: the generated text is not meaningful)"
        );
    }
    for n in &early_notes {
        logln!("{n}");
    }

    // KV pool: the seed's offline sizing, capped by the memory budget.
    let block_size = s.block_size;
    model.check_block_size(block_size).map_err(|e| match e {
        // (An option that does not go with another: not the block size's fault.)
        cachalot_engine::EngineError::Model(cachalot_model::ModelError::Options(why)) => why,
        e => format!("scheduler_config.block_size {block_size}: {e}"),
    })?;
    let per_block = kv_bytes_per_block(model.cache_spec(), block_size);
    // A W8A8C8 checkpoint's latents are int8 whatever the float part's dtype.
    let kv_cache_c8 = model.cache_spec().int8_width > 0;
    // A request stops at the model's positions (finish_reason "length", as vLLM's
    // max_model_len), so no sequence needs more blocks than those.
    let positions = model.max_positions();
    if cfg.max_total_len() > positions {
        logln!(
            "note: the longest request, input_truncated_len + max_new_tokens (with MTP's \
             drafts: max_new_tokens × (next_n + 1) + next_n), {} positions, exceeds the model's \
             {positions} \
             positions (max_position_embeddings): requests stop there (finish_reason length), \
             and the KV pool is sized for {positions}",
            cfg.max_total_len()
        );
    }
    let seed_blocks = cfg.max_total_len().min(positions).div_ceil(block_size) * rank_batch + 1;
    // A state slot per running sequence (DeepSeek-V4's compact rings) comes out of the budget.
    let state_bytes = (model.cache_spec().seq_state_bytes() * rank_batch) as u64;
    if state_bytes > 0 {
        logln!(
            "per-sequence cache state: {:.1} MiB for {rank_batch} sequences ({} bytes of \
             entries per token)",
            state_bytes as f64 / (1u64 << 20) as f64,
            model.cache_spec().bytes_per_token()
        );
    }
    let num_blocks = match opts.kv_blocks {
        Some(n) => n,
        None => {
            let share = s.mem_fraction_static / opts.host_ranks.max(1) as f64;
            let cap = blocks_in_memory_share(share, state_bytes, per_block).map_err(|b| {
                format!(
                    "{}: scheduler_config.mem_fraction_static {} leaves {b} bytes for the KV \
                     pool, less than the 2 blocks of {per_block} bytes it needs at least: raise \
                     it, lower block_size, or give the pool's size with --kv-blocks",
                    opts.config_path.display(),
                    s.mem_fraction_static
                )
            })?;
            seed_blocks.min(cap.unwrap_or(usize::MAX))
        }
    };
    check_kv_pool(
        num_blocks,
        per_block,
        block_size,
        opts.kv_blocks.is_some(),
        mem_available(),
    )?;
    // Expert-parallel ranks step the same batches: the same pool everywhere, the smallest any
    // rank can hold (each checked its own above).
    let num_blocks = if expert {
        let parts = comm.all_gather(&(num_blocks as u64).to_le_bytes())?;
        let mut least = num_blocks;
        for (r, b) in parts.iter().enumerate() {
            let b = u64_part(b, || format!("rank {rank}: rank {r} sent a KV pool size"))?;
            least = least.min(b as usize);
        }
        least
    } else {
        num_blocks
    };
    // Sampling without a seed draws from the OS on each rank; expert-parallel ranks must sample
    // the same tokens, so rank 0 draws the seed for all of them.
    let run_seed = match d.seed {
        None if expert => {
            let mine = std::collections::hash_map::RandomState::new();
            let drawn = std::hash::BuildHasher::hash_one(&mine, std::process::id()).to_le_bytes();
            let b = comm.broadcast(0, &drawn)?;
            Some(u64_part(&b, || format!("rank {rank}: rank 0 sent a seed"))?)
        }
        s => s,
    };
    logln!(
        "KV pool: {num_blocks} blocks of {block_size} tokens ({} bytes each; seed sizing {seed_blocks})",
        per_block
    );

    let stop_ids = StopConditions::eos_ids(&config_eos, Some(&tokenizer), &model_dir);
    let engine_cfg = EngineConfig {
        block_size,
        num_blocks,
        batch_size: rank_batch,
        max_prefill_tokens: prefill_budget,
    };
    let mut engine = Engine::new(model, Some(&tokenizer), engine_cfg)?;
    if m.next_n > 0 {
        engine.enable_mtp(m.next_n).map_err(|e| {
            format!(
                "{} {}: {e} ({})",
                if opts.mtp_option {
                    "--mtp"
                } else {
                    "model_config.next_n"
                },
                m.next_n,
                model_dir.display()
            )
        })?;
        logln!("MTP speculative decoding: {} drafts per step", m.next_n);
    }
    if engine
        .set_prefix_caching(opts.prefix_caching)
        .map_err(|e| format!("--prefix-caching on: {e} ({})", model_dir.display()))?
    {
        logln!("prefix caching: on (blocks of {block_size} tokens)");
    }
    let tool_format = ToolCallFormat::for_tokenizer(&tokenizer, family == ModelFamily::DeepseekV4);
    // The seed decodes its outputs with `skip_special_tokens=True`; the markers of reasoning
    // and tool calls stay, for `requests.jsonl`'s tool calls to be read from the text.
    let special_text =
        SpecialText::skip_except(ToolCallFormat::parser_tokens(tool_format, &tokenizer));
    let mut prompt_tokens = 0;
    // Engine request id -> index of the request in the run.
    let mut global_id = std::collections::HashMap::new();
    for (i, p) in prepared.iter().enumerate() {
        if i % dp != dp_rank {
            continue;
        }
        prompt_tokens += p.ids.len();
        // top_p 0 keeps only the most likely token (the seed accepts it): greedy.
        let greedy = d.top_p == 0.0;
        let params = SamplingParams {
            temperature: if greedy { 0.0 } else { d.temperature as f32 },
            top_k: d.top_k,
            top_p: if greedy { 1.0 } else { d.top_p as f32 },
            seed: run_seed.map(|s| s.wrapping_add(i as u64)),
            ..SamplingParams::greedy()
        };
        let id = engine
            .add_request(Request {
                prompt: p.ids.clone(),
                params,
                stop: StopConditions {
                    max_new_tokens: s.max_new_tokens,
                    stop_token_ids: stop_ids.clone(),
                    stop_strings: Vec::new(),
                    include_stop_str: false,
                },
                ignore_eos: d.ignore_eos,
                logprobs: None,
                prompt_logprobs: None,
                json_object: false,
                json_after: None,
                json_lead: Vec::new(),
                json_more: Vec::new(),
                json_schema: None,
                dsml: false,
                special_text: special_text.clone(),
                waited_s: 0.0,
            })
            .map_err(|e| {
                format!(
                    "request {i} (prompt {} of the {} dataset): {e}",
                    i % n_prompts.max(1),
                    d.dataset
                )
            })?;
        global_id.insert(id, i as u64);
    }
    let n_local = global_id.len();

    let bar = if opts.progress && rank == 0 {
        indicatif::ProgressBar::new(n_local as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    // (Data-parallel ranks each run their own requests: the bar is rank 0's share.)
    let whose = if expert || ranks == 1 {
        String::new()
    } else {
        format!("rank 0 of {ranks}: ")
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{{spinner}} [{{elapsed_precise}}] {whose}{{bar:30}} {{pos}}/{{len}} requests  {{msg}}"
        ))?
        .progress_chars("=> "),
    );
    // Finished requests are written as they finish, so that none is lost to a failed step, a
    // rank that dies or a signal: rank 0's (and, with data-parallel ranks, each rank's own) to
    // requests.rank<R>.partial.jsonl, removed once the run's files are written.
    let partial_path = dir.join(format!("requests.rank{rank}.partial.jsonl"));
    let mut partial = if rank == 0 || !expert {
        set_partial(Some(partial_path.clone()));
        Some(std::fs::File::create(&partial_path)?)
    } else {
        None
    };
    let mut partial_len = 0u64;
    let mut write_partial = |done: &[RequestOutput]| -> Result<(), Error> {
        let Some(f) = partial.as_mut() else {
            return Ok(());
        };
        let mut text = String::new();
        for o in done {
            let mut g = o.clone();
            g.id = global_id[&o.id];
            text.push_str(&request_line(&g, &prepared, tool_format)?.to_string());
            text.push('\n');
        }
        if let Err(e) = f.write_all(text.as_bytes()) {
            // A record cut short (a full disk) goes again: the file stays whole lines.
            let _ = f.set_len(partial_len);
            let _ = std::io::Seek::seek(f, std::io::SeekFrom::Start(partial_len));
            return Err(e.into());
        }
        partial_len += text.len() as u64;
        Ok(())
    };
    let mut n_saved = 0usize;
    // A step that fails ends the run with the file of the requests finished before it named.
    macro_rules! stopped {
        ($e:expr) => {{
            let e = $e;
            if rank == 0 || !expert {
                logln!(
                    "the run stopped: {e}; its {n_saved} finished requests are in {}",
                    partial_path.display()
                );
                return Err(format!(
                    "{e}; the run is incomplete: {n_saved} finished requests are saved in {}{}",
                    partial_path.display(),
                    other_partials(&partial_path)
                )
                .into());
            }
            return Err(format!("{e}").into());
        }};
    }
    // All ranks start generating together, so the run's wall time is the slowest rank's.
    comm.barrier()?;
    let t_run = Instant::now();
    engine.restamp_arrivals(t_run);
    let mut outputs = Vec::with_capacity(n_local);
    let mut step = 0usize;
    let capacity = engine.stats().kv_capacity_blocks;
    // Data-parallel ranks meet only at the end: each looks at its peers' connections every
    // second, so that a rank that died stops the others then, not once their shares are done.
    let apart = ranks > 1 && !expert && !dispatch;
    let mut peers_checked = Instant::now();
    // Dispatched experts: the ranks step together; one whose requests are done keeps serving
    // the others' MoE tokens (`Engine::end_step`) until no rank has work.
    loop {
        if !engine.has_unfinished() {
            let more = dispatch
                && match engine.end_step() {
                    Ok(more) => more,
                    Err(e) => stopped!(e),
                };
            if more {
                continue;
            }
            break;
        }
        if apart && peers_checked.elapsed() >= std::time::Duration::from_secs(1) {
            peers_checked = Instant::now();
            if let Err(e) = comm.check_peers() {
                stopped!(e);
            }
        }
        let r = match engine.step() {
            Ok(r) => r,
            Err(e) => stopped!(e),
        };
        // The step's finished requests on disk before anything else can fail.
        let done = engine.take_finished();
        if let Err(e) = write_partial(&done) {
            // (The file keeps whole records: what did not fit was cut off again.)
            stopped!(format!(
                "cannot append {} finished requests to {} ({e})",
                done.len(),
                partial_path.display()
            ));
        }
        n_saved += done.len();
        // Every rank ends each step together; when none has work left, all leave here.
        let group_more = !dispatch
            || match engine.end_step() {
                Ok(more) => more,
                Err(e) => stopped!(e),
            };
        step += 1;
        logln!(
            "step {step}: {} seqs, prefill {} + decode {}{} tokens, {:.2} ms, KV {}/{capacity}{}{}",
            r.seqs,
            r.prefill_tokens,
            r.decode_tokens,
            // (Under MTP each decoding sequence also forwards its drafts.)
            if r.drafted > 0 {
                format!(" + {} draft", r.drafted)
            } else {
                String::new()
            },
            r.forward_s * 1e3,
            r.kv_used_blocks,
            // The MTP layer's time in the step (its pass over prompt rows included), then what
            // its drafts did.
            match (r.draft_s > 0.0, r.drafted > 0) {
                (true, true) => format!(
                    ", MTP {:.2} ms, {}/{} drafts accepted",
                    r.draft_s * 1e3,
                    r.accepted,
                    r.drafted
                ),
                (true, false) => format!(", MTP {:.2} ms", r.draft_s * 1e3),
                _ => String::new(),
            },
            if r.preempted > 0 {
                format!(", {} preempted", r.preempted)
            } else {
                String::new()
            }
        );
        bar.inc(done.len() as u64);
        // Every token generated so far, running requests' too (not only finished ones').
        let out_tokens = engine.stats().sampled_tokens;
        bar.set_message(format!(
            "{:.1} tok/s, {} running, KV {:.0}%",
            out_tokens as f64 / t_run.elapsed().as_secs_f64().max(1e-9),
            engine.scheduler().num_running(),
            100.0 * r.kv_used_blocks as f64 / capacity as f64
        ));
        outputs.extend(done);
        if !group_more {
            break;
        }
    }
    bar.finish_and_clear();
    let mut wall_s = t_run.elapsed().as_secs_f64();
    for o in &mut outputs {
        o.id = global_id[&o.id];
    }
    let mut stats = engine.stats().clone();
    let mut load_s = load_s;
    let mut cache_bytes = engine.cache_bytes();
    let mut per_rank = Vec::new();
    // Under expert or tensor parallelism every rank routed the whole batch: this rank's counts
    // are the run's; data-parallel ranks' are summed on rank 0 below.
    let mut expert_load = model.expert_load();
    // Under dispatched experts: the (token, expert) pairs each rank computed per layer (rank 0
    // gathers them).
    let mut served_by_rank: Vec<Vec<(u32, u64)>> = Vec::new();
    // Per-rank rates, summed over ranks that ran at the same time.
    let per = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let mut prefill_tok_s = per(stats.prefill_tokens, stats.prefill_step_s);
    let decode_rate = |s: &EngineStats| {
        (s.decode_steps > 0 && s.decode_step_s > 0.0)
            .then(|| s.decode_sampled as f64 / s.decode_step_s)
    };
    let mut decode_tok_s = decode_rate(&stats);
    if expert {
        // Every rank has every output; the wall time is the group's.
        comm.barrier()?;
    } else if ranks > 1 {
        logln!(
            "rank {rank}: {} requests done in {wall_s:.2}s; gathering on rank 0",
            outputs.len()
        );
        let report = RankReport {
            outputs: std::mem::take(&mut outputs),
            stats: stats.clone(),
            expert_load: std::mem::take(&mut expert_load),
            expert_served: model.expert_served(),
            wall_s,
            load_s,
            prompt_tokens,
            cache_bytes,
        };
        let parts = match comm.all_gather(&serde_json::to_vec(&report)?) {
            Ok(p) => p,
            Err(e) => {
                // Another rank failed: this rank's finished requests are in its partial file
                // (never lose work).
                logln!(
                    "gathering failed ({e}); this rank's {} finished requests are in {}",
                    report.outputs.len(),
                    partial_path.display()
                );
                return Err(format!(
                    "{e}; the run is incomplete: rank {rank}'s {} finished requests are saved in \
                     {}{}",
                    report.outputs.len(),
                    partial_path.display(),
                    other_partials(&partial_path)
                )
                .into());
            }
        };
        if rank == 0 {
            let reports = parts
                .iter()
                .enumerate()
                .map(|(r, b)| {
                    serde_json::from_slice::<RankReport>(b)
                        .map_err(|e| format!("rank {r} sent a report rank 0 cannot read: {e}"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            stats = merge_stats(reports.iter().map(|r| &r.stats));
            expert_load = sum_expert_loads(reports.iter().map(|r| &r.expert_load));
            if dispatch {
                served_by_rank = reports.iter().map(|r| r.expert_served.clone()).collect();
            }
            prefill_tok_s = reports
                .iter()
                .map(|r| per(r.stats.prefill_tokens, r.stats.prefill_step_s))
                .sum();
            decode_tok_s = reports
                .iter()
                .filter_map(|r| decode_rate(&r.stats))
                .reduce(|a, b| a + b);
            wall_s = reports.iter().map(|r| r.wall_s).fold(0.0, f64::max);
            load_s = reports.iter().map(|r| r.load_s).fold(0.0, f64::max);
            cache_bytes = reports.iter().map(|r| r.cache_bytes).max().unwrap_or(0);
            prompt_tokens = reports.iter().map(|r| r.prompt_tokens).sum();
            for (r, rep) in reports.into_iter().enumerate() {
                let out: usize = rep.outputs.iter().map(|o| o.tokens.len()).sum();
                per_rank.push(RankFigures {
                    rank: r,
                    requests: rep.outputs.len(),
                    prompt_tokens: rep.prompt_tokens,
                    output_tokens: out,
                    wall_s: rep.wall_s,
                    output_tok_s: per(out, rep.wall_s),
                    steps: rep.stats.steps,
                });
                outputs.extend(rep.outputs);
            }
        } else {
            outputs = report.outputs;
        }
    }
    outputs.sort_by_key(|o| o.id);

    // Figures.
    let output_tokens: usize = outputs.iter().map(|o| o.tokens.len()).sum();
    let ttft: Vec<f64> = outputs.iter().map(|o| o.timing.ttft_s).collect();
    let tpot: Vec<f64> = outputs.iter().filter_map(|o| o.timing.tpot_s).collect();
    let e2e: Vec<f64> = outputs.iter().map(|o| o.timing.e2e_s).collect();
    let mut finish_reasons = std::collections::BTreeMap::new();
    for o in &outputs {
        *finish_reasons
            .entry(o.finish.as_str().to_string())
            .or_insert(0) += 1;
    }
    let output_tok_s = per(output_tokens, wall_s);
    // A rank other than 0 reports its own share only (data parallel); expert-parallel ranks
    // serve the whole run together.
    let ranks_here = if rank == 0 || expert { ranks } else { 1 };
    // A placement made for another model (or layer count) places layers this run's MoE does
    // not route, or leaves some of its layers in contiguous shares: said in the log.
    if let (Some(p), false) = (placement, expert_load.is_empty()) {
        let placed = p.placed_keys();
        let routed: Vec<u32> = expert_load.iter().map(|(k, _)| *k).collect();
        let extra: Vec<u32> = placed
            .iter()
            .copied()
            .filter(|k| !routed.contains(k))
            .collect();
        let unplaced: Vec<u32> = routed
            .iter()
            .copied()
            .filter(|k| !placed.contains(k))
            .collect();
        if !extra.is_empty() || !unplaced.is_empty() {
            logln!(
                "note: the expert placement places layers {extra:?} that no token was routed \
                 through in this run (not MoE layers of this model?) and leaves MoE layers \
                 {unplaced:?} in contiguous shares; make the placement from a run of this model"
            );
        }
    }
    let summary = Summary {
        run_id: run_id.clone(),
        config: opts.config_path.display().to_string(),
        model_name: m.model_name.clone(),
        model_path: m.model_path.clone(),
        dataset: d.dataset.clone(),
        requests: outputs.len(),
        batch_size: s.batch_size,
        max_prefill_tokens: prefill_budget,
        max_new_tokens: s.max_new_tokens,
        ignore_eos: d.ignore_eos,
        force_eplb: m.force_eplb,
        with_ckpt: m.with_ckpt,
        int8_head: opts.int8_head,
        bf16_dot: opts.bf16_dot,
        kv_cache_dtype: kv_cache_dtype.name(),
        kv_cache_c8,
        v4_cache: (family == ModelFamily::DeepseekV4).then(|| opts.v4_cache.name()),
        ranks,
        transport: comm.transport(),
        parallel: if tensor && experts_split {
            Parallel::TensorExpert
        } else if tensor {
            Parallel::Tensor
        } else if expert {
            Parallel::Expert
        } else if context {
            Parallel::Context
        } else if dispatch {
            Parallel::DataExpert
        } else {
            Parallel::Data
        },
        world_size_in_config: cfg.parallel_config.world_size,
        parallel_hint: Parallel::config_hint(&cfg.parallel_config),
        threads: rayon_threads(),
        kernels: cachalot_kernels::kernel_isa(),
        load_s,
        wall_s,
        prompt_tokens,
        output_tokens,
        throughput: Throughput {
            output_tok_s,
            total_tok_s: per(output_tokens + prompt_tokens, wall_s),
            output_tok_s_per_rank: output_tok_s / ranks_here as f64,
            prefill_tok_s,
            decode_tok_s,
        },
        ttft_s: Distribution::of(&ttft),
        tpot_s: (!tpot.is_empty()).then(|| Distribution::of(&tpot)),
        e2e_s: Distribution::of(&e2e),
        steps: stats.steps,
        mean_decode_step_ms: (stats.decode_steps > 0)
            .then(|| stats.decode_step_s / stats.decode_steps as f64 * 1e3),
        preemptions: stats.preemptions,
        kv_block_size: block_size,
        kv_capacity_blocks: stats.kv_capacity_blocks,
        kv_peak_blocks: stats.kv_peak_blocks,
        kv_peak_fraction: stats.kv_peak_blocks as f64 / stats.kv_capacity_blocks as f64,
        kv_cache_bytes: cache_bytes,
        finish_reasons,
        per_rank,
        mtp: (stats.mtp_next_n > 0).then(|| MtpSummary {
            next_n: stats.mtp_next_n,
            drafted: stats.drafted,
            accepted: stats.accepted_drafts,
            acceptance_rate: stats.acceptance_rate(),
            mean_accepted_length: stats.mean_accepted_length(),
            tokens_per_main_step: stats.tokens_per_main_step(),
            draft_s: stats.draft_s,
        }),
        prefix_cache: stats.prefix_caching.then(|| PrefixCacheSummary {
            queried_tokens: stats.prefix_query_tokens,
            cached_tokens: stats.prefix_cached_tokens,
            hit_rate: stats.prefix_cached_tokens as f64 / stats.prefix_query_tokens.max(1) as f64,
        }),
        expert_load: ExpertLoadSummary::of(
            &expert_load,
            if experts_split || dispatch { ranks } else { 1 },
            shard,
            &served_by_rank,
        ),
    };
    if rank != 0 {
        logln!(
            "done: {} requests (rank 0 writes the run's files)",
            outputs.len()
        );
        // Rank 0 writes the run's files from this rank's report; this rank's partial file
        // goes once they are written (rank 0 says so with a barrier; if it fails first, the
        // barrier fails and the file stays).
        if !expert {
            comm.barrier()?;
        }
        set_partial(None);
        let _ = std::fs::remove_file(&partial_path);
        return Ok(RunResult {
            summary,
            dir,
            outputs,
        });
    }
    // Each file whole or not at all: written beside its name, then renamed (requests.jsonl
    // first, summary.json last); a failure (a full disk) names the file and keeps the partial
    // file of what finished.
    let mut lines = String::new();
    for o in &outputs {
        let v = request_line(o, &prepared, tool_format)?;
        lines.push_str(&v.to_string());
        lines.push('\n');
    }
    let summary_text = serde_json::to_string_pretty(&summary)? + "\n";
    for (name, text) in [("requests.jsonl", &lines), ("summary.json", &summary_text)] {
        let path = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp"));
        let written = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(format!(
                "cannot write {} ({e}); every finished request is in {}",
                path.display(),
                partial_path.display()
            )
            .into());
        }
    }
    set_partial(None);
    let _ = std::fs::remove_file(&partial_path);
    if ranks > 1 && !expert {
        // The other ranks keep their partial files until these are written.
        comm.barrier()?;
    }
    logln!(
        "done: {} requests, {output_tokens} tokens in {wall_s:.2}s",
        outputs.len()
    );
    Ok(RunResult {
        summary,
        dir,
        outputs,
    })
}

/// Counters of ranks that ran side by side: sums, but the KV peak and capacity are those of the
/// fullest rank's pool (ranks may size their pools differently).
fn merge_stats<'a>(all: impl Iterator<Item = &'a EngineStats>) -> EngineStats {
    let mut m = EngineStats::default();
    let fill = |peak: usize, cap: usize| peak as f64 / cap.max(1) as f64;
    for s in all {
        // Destructured whole, so a new counter cannot be forgotten here.
        let EngineStats {
            steps,
            prefill_tokens,
            decode_tokens,
            sampled_tokens,
            transferred_tokens,
            sample_steps,
            decode_sampled,
            mtp_next_n,
            drafted,
            accepted_drafts,
            verify_steps,
            draft_s,
            forward_s,
            prefill_step_s,
            decode_step_s,
            decode_steps,
            preemptions,
            kv_peak_blocks,
            kv_capacity_blocks,
            kv_block_size,
            prefix_caching,
            prefix_query_tokens,
            prefix_cached_tokens,
        } = s;
        m.steps += steps;
        m.prefill_tokens += prefill_tokens;
        m.decode_tokens += decode_tokens;
        m.sampled_tokens += sampled_tokens;
        m.transferred_tokens += transferred_tokens;
        m.sample_steps += sample_steps;
        m.decode_sampled += decode_sampled;
        m.mtp_next_n = *mtp_next_n;
        m.drafted += drafted;
        m.accepted_drafts += accepted_drafts;
        m.verify_steps += verify_steps;
        m.draft_s += draft_s;
        m.forward_s += forward_s;
        m.prefill_step_s += prefill_step_s;
        m.decode_step_s += decode_step_s;
        m.decode_steps += decode_steps;
        m.preemptions += preemptions;
        if m.kv_capacity_blocks == 0
            || fill(*kv_peak_blocks, *kv_capacity_blocks)
                > fill(m.kv_peak_blocks, m.kv_capacity_blocks)
        {
            m.kv_peak_blocks = *kv_peak_blocks;
            m.kv_capacity_blocks = *kv_capacity_blocks;
        }
        m.kv_block_size = *kv_block_size;
        m.prefix_caching |= prefix_caching;
        m.prefix_query_tokens += prefix_query_tokens;
        m.prefix_cached_tokens += prefix_cached_tokens;
    }
    m
}

/// Threads of this process's pool (per rank).
fn rayon_threads() -> usize {
    rayon::current_num_threads()
}

/// The summary as a small table for the terminal.
pub fn summary_table(s: &Summary) -> String {
    let ms = |x: f64| format!("{:.2} ms", x * 1e3);
    let spread =
        |d: &Distribution| format!("mean {}  p50 {}  p99 {}", ms(d.mean), ms(d.p50), ms(d.p99));
    let mut rows: Vec<(String, String)> = vec![
        ("run".into(), s.run_id.clone()),
        (
            "requests".into(),
            format!(
                "{} (batch {}, prefill budget {} tokens)",
                s.requests, s.batch_size, s.max_prefill_tokens
            ),
        ),
        (
            "tokens".into(),
            format!("{} prompt, {} generated", s.prompt_tokens, s.output_tokens),
        ),
        ("wall time".into(), format!("{:.2} s", s.wall_s)),
        (
            "throughput".into(),
            format!(
                "{:.1} generated tok/s ({:.1} per rank, {} rank{}), {:.1} tok/s with prompts",
                s.throughput.output_tok_s,
                s.throughput.output_tok_s_per_rank,
                s.ranks,
                if s.ranks == 1 { "" } else { "s" },
                s.throughput.total_tok_s
            ),
        ),
        (
            "prefill".into(),
            format!("{:.1} tok/s", s.throughput.prefill_tok_s),
        ),
        ("TTFT".into(), spread(&s.ttft_s)),
        (
            "TPOT".into(),
            s.tpot_s.as_ref().map_or(
                "n/a (no request decoded past its first token)".into(),
                spread,
            ),
        ),
        (
            "KV peak".into(),
            format!(
                "{}/{} blocks of {} ({:.0}%), {} preemptions",
                s.kv_peak_blocks,
                s.kv_capacity_blocks,
                s.kv_block_size,
                100.0 * s.kv_peak_fraction,
                s.preemptions
            ),
        ),
        (
            "finish".into(),
            s.finish_reasons
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", "),
        ),
    ];
    if s.world_size_in_config > s.ranks {
        rows.push((
            "parallel".into(),
            format!(
                "the config's world_size {} and its TP/EP/CP sizes are recorded, not applied: \
                 {} process{} ran ({})",
                s.world_size_in_config,
                s.ranks,
                if s.ranks == 1 { "" } else { "es" },
                s.parallel_hint
            ),
        ));
    }
    if !s.with_ckpt {
        rows.push((
            "weights".into(),
            "with_ckpt: false: random weights of the config's shapes (outputs not meaningful)"
                .into(),
        ));
    }
    if s.int8_head {
        rows.push(("head".into(), "lm_head held in int8 (--int8-head)".into()));
    }
    rows.push((
        "KV cache".into(),
        match s.v4_cache {
            Some(layout) => format!(
                "{} layout (--v4-cache), values stored as {}",
                layout, s.kv_cache_dtype
            ),
            None if s.kv_cache_c8 => format!(
                "latents stored as int8 (C8, the checkpoint's ckv_scale), rope keys as {} \
                 (--kv-cache-dtype)",
                s.kv_cache_dtype
            ),
            None => format!("latents stored as {} (--kv-cache-dtype)", s.kv_cache_dtype),
        },
    ));
    if let Some(p) = &s.prefix_cache {
        rows.push((
            "prefix cache".into(),
            format!(
                "{} of {} prompt tokens taken from the cache ({:.1}%)",
                p.cached_tokens,
                p.queried_tokens,
                100.0 * p.hit_rate
            ),
        ));
    }
    if let Some(e) = &s.expert_load {
        rows.push((
            "expert load".into(),
            format!(
                "busiest expert {:.2}x the mean; balancedness over {} EP rank(s) {:.3} mean, \
                 {:.3} worst layer",
                e.hottest_over_mean, e.ep_ranks, e.balancedness_mean, e.balancedness_min
            ),
        ));
    }
    if s.bf16_dot {
        rows.push((
            "bf16 products".into(),
            "bf16 x bf16, activations rounded to bf16 (--bf16-dot)".into(),
        ));
    }
    if s.force_eplb {
        rows.push((
            "routing".into(),
            "force_eplb: balanced synthetic expert ids (outputs not meaningful)".into(),
        ));
    }
    if let Some(m) = &s.mtp {
        rows.push((
            "MTP".into(),
            format!(
                "next_n {}: acceptance {} ({}/{}), {:.2} tokens per verify step, {:.2} per \
                 main step, {:.2} s drafting",
                m.next_n,
                if m.drafted > 0 {
                    format!("{:.2}", m.acceptance_rate)
                } else {
                    "n/a".into()
                },
                m.accepted,
                m.drafted,
                m.mean_accepted_length,
                m.tokens_per_main_step,
                m.draft_s
            ),
        ));
    }
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    rows.iter()
        .map(|(k, v)| format!("{k:<w$}  {v}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{check_kv_pool, other_partials, Parallel};
    use crate::config::{ParallelConfig, RunConfig};

    /// A failed run's error names the other ranks' saved requests beside this rank's.
    #[test]
    fn other_ranks_partial_files_are_named() {
        let tmp = tempfile::tempdir().unwrap();
        let mine = tmp.path().join("requests.rank0.partial.jsonl");
        std::fs::write(&mine, "{}\n").unwrap();
        assert_eq!(other_partials(&mine), "");
        let one = tmp.path().join("requests.rank1.partial.jsonl");
        std::fs::write(&one, "{}\n").unwrap();
        // An empty one (a rank that finished nothing) is not worth naming.
        std::fs::write(tmp.path().join("requests.rank2.partial.jsonl"), "").unwrap();
        std::fs::write(tmp.path().join("run.log"), "x").unwrap();
        assert_eq!(
            other_partials(&mine),
            format!("; the other ranks' in {}", one.display())
        );
    }

    /// The seed's layouts map onto --parallel when the config's world_size is the group's:
    /// every shipped config of the seed, and the mixes not done here are named.
    #[test]
    fn parallel_config_names_the_layout_of_its_own_group_size() {
        let pc = |w, a, m, cp| ParallelConfig {
            world_size: w,
            attn_tp_size: a,
            moe_tp_size: m,
            cp_size: cp,
            ..Default::default()
        };
        let layout = |p: &ParallelConfig, n| Parallel::from_config(p, n).map(|o| o.map(|x| x.0));
        assert_eq!(layout(&pc(16, 1, 1, 1), 16), Ok(Some(Parallel::DataExpert)));
        assert_eq!(layout(&pc(16, 1, 1, 1), 2), Ok(None));
        assert_eq!(layout(&pc(1, 1, 1, 1), 1), Ok(Some(Parallel::Data)));
        assert_eq!(layout(&pc(4, 4, 4, 1), 4), Ok(Some(Parallel::Tensor)));
        assert_eq!(layout(&pc(4, 4, 1, 1), 4), Ok(Some(Parallel::TensorExpert)));
        let e = layout(&pc(8, 2, 1, 1), 8).unwrap_err();
        assert!(
            e.contains("attn_tp_size 2") && e.contains("--parallel"),
            "{e}"
        );
        assert_eq!(layout(&pc(4, 1, 1, 4), 4), Ok(Some(Parallel::Context)));
        let e = layout(&pc(4, 1, 1, 2), 4).unwrap_err();
        assert!(e.contains("cp_size"), "{e}");
        // Sizes held whole are said.
        let mut p = pc(16, 1, 1, 1);
        p.lmhead_tp_size = 4;
        let (l, note) = Parallel::from_config(&p, 16).unwrap().unwrap();
        assert_eq!(l, Parallel::DataExpert);
        assert!(note.unwrap().contains("lmhead_tp_size 4"));
        // Under the tensor layouts, what they split all the same is said.
        let mut p = pc(4, 4, 1, 1);
        p.dense_tp_size = 4;
        let (l, note) = Parallel::from_config(&p, 4).unwrap().unwrap();
        assert_eq!(l, Parallel::TensorExpert);
        let note = note.unwrap();
        assert!(
            note.contains("lmhead_tp_size 1") && !note.contains("dense"),
            "{note}"
        );
        // The seed's configs at their own world_size, by the layout their names give: `Ntp`
        // alone tensor, `Ntp_Nep` tensor-expert, `cp_size` > 1 context parallel, the
        // `Nep`/`Ndp_Nep` ones DP attention with EP experts.
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let mut seen = 0;
        for dir in [
            "deepseek_r1",
            "deepseek_v4/ci_a3",
            "deepseek_v4/ci_950",
            "kimi_k2_thinking",
        ] {
            for f in std::fs::read_dir(root.join(dir)).unwrap() {
                let f = f.unwrap().path();
                if f.extension().is_none_or(|e| e != "yaml") {
                    continue;
                }
                let name = f.file_name().unwrap().to_string_lossy().into_owned();
                let cfg = RunConfig::from_file(&f).unwrap();
                let w = cfg.parallel_config.world_size;
                let got = Parallel::from_config(&cfg.parallel_config, w).map(|o| o.map(|x| x.0));
                // Parts like `16tp`: digits, then the kind.
                let has = |kind: &str| {
                    name.trim_end_matches(".yaml").split('_').any(|part| {
                        part.strip_suffix(kind)
                            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                    })
                };
                let want = if cfg.parallel_config.cp_size > 1 {
                    Some(Parallel::Context)
                } else if has("tp") && has("ep") {
                    Some(Parallel::TensorExpert)
                } else if has("tp") {
                    Some(Parallel::Tensor)
                } else {
                    Some(Parallel::DataExpert)
                };
                match want {
                    Some(l) => assert_eq!(got, Ok(Some(l)), "{name}"),
                    None => assert!(got.is_err(), "{name}: {got:?}"),
                }
                seen += 1;
            }
        }
        assert!(seen >= 14, "{seen} configs");
    }

    #[test]
    fn kv_pool_sizes_the_engine_cannot_hold_are_named() {
        let gib = 1u64 << 30;
        assert!(check_kv_pool(100, 1 << 20, 128, false, Some(gib)).is_ok());
        assert!(check_kv_pool(100, 1 << 20, 128, true, None).is_ok());
        let e = check_kv_pool(1, 1 << 20, 128, true, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--kv-blocks 1") && e.contains("at least 2"),
            "{e}"
        );
        let e = check_kv_pool(1 << 33, 1, 128, true, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most"), "{e}");
        // Two blocks of a huge block_size: more than the memory there is.
        let e = check_kv_pool(2, 600 * gib, 1 << 20, false, Some(16 * gib))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("scheduler_config.block_size") && e.contains("GiB"),
            "{e}"
        );
        let e = check_kv_pool(1 << 31, u64::MAX / 4, 128, true, Some(gib))
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 16 EiB"), "{e}");
    }
}
