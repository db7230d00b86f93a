//! The seed system's YAML run config (spec `executor.md` §1): four sections, `model_config`,
//! `data_config`, `parallel_config`, `scheduler_config`, each optional, every key optional with
//! the seed's default. Unlike the seed (which ignores unknown keys silently, §7.10), every key is
//! checked against the schema below, and all problems are reported at once: unknown keys (with
//! the valid ones and the closest suggested), wrong types and ranges, and contradictory sizes.
//! What every key does here is in docs/CONFIG.md (a test keeps it complete).

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The type and range of one key.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Bool,
    /// An integer `>= min`.
    Int(i64),
    /// An integer `>= min`, or null.
    IntOrNull(i64),
    /// An integer in `[min, max]`.
    IntIn(i64, i64),
    /// A number in `[min, max]`.
    Float(f64, f64),
    /// A number in `(min, max]`.
    FloatAbove(f64, f64),
    Str,
    /// A torch dtype's name as the seed's `dtype` takes it ([`is_torch_dtype`]).
    Dtype,
    /// One of these strings.
    OneOf(&'static [&'static str]),
    /// One of these strings, or null (the seed's "detect it").
    OneOfOrNull(&'static [&'static str]),
    /// A mapping of anything (model-specific switches).
    AnyMap,
}

#[derive(Clone, Copy, Debug)]
pub struct Key {
    pub name: &'static str,
    pub kind: Kind,
    /// A cachalot addition, not in the seed's schema.
    pub extension: bool,
}

const fn k(name: &'static str, kind: Kind) -> Key {
    Key {
        name,
        kind,
        extension: false,
    }
}
const fn ext(name: &'static str, kind: Kind) -> Key {
    Key {
        name,
        kind,
        extension: true,
    }
}

/// Model names of the seed's registry that this schema knows; the V3 family runs here.
pub const MODEL_NAMES: &[&str] = &[
    "deepseek_r1",
    "deepseek_v3",
    "kimi_k2",
    "kimi_k2_thinking",
    "deepseek_v4",
];
/// The largest value an integer key takes (token counts, sizes, parallel sizes; not the
/// sampling seed): far above real use, low enough that sizes multiplied from a few of them fit
/// in `usize`.
pub const MAX_INT: i64 = 1 << 24;
/// The largest `scheduler_config.batch_size`.
pub const MAX_BATCH: i64 = 1 << 16;
/// The largest `scheduler_config.block_size` (KV slots per block; the seed uses 128).
pub const MAX_BLOCK_SIZE: i64 = 4096;
pub const DATASETS: &[&str] = &["default", "LongBench", "InfiniteBench"];

const MODEL_KEYS: &[Key] = &[
    k("model_name", Kind::OneOf(MODEL_NAMES)),
    k("model_path", Kind::Str),
    k("output_path", Kind::Str),
    k("dtype", Kind::Dtype),
    k("with_ckpt", Kind::Bool),
    k("next_n", Kind::Int(0)),
    k("platform_version", Kind::OneOfOrNull(&["A2", "A3", "950"])),
    k(
        "exe_mode",
        Kind::OneOf(&["eager", "ge_graph", "npugraph_ex"]),
    ),
    k("enable_cache_compile", Kind::Bool),
    k("enable_static_kernel", Kind::Bool),
    k("enable_dynamic_graph", Kind::Bool),
    k("force_eplb", Kind::Bool),
    k("enable_profiler", Kind::Bool),
    k("enable_weight_nz", Kind::Bool),
    k("enable_hadamard", Kind::Bool),
    k("hadamard_weight_path", Kind::Str),
    k("custom_params", Kind::AnyMap),
];
const DATA_KEYS: &[Key] = &[
    k("dataset", Kind::OneOf(DATASETS)),
    k("dataset_path", Kind::Str),
    k("input_truncated_len", Kind::Int(1)),
    // (Sampling runs in f32: a larger value would be infinite there.)
    k("temperature", Kind::Float(0.0, f32::MAX as f64)),
    k("top_p", Kind::Float(0.0, 1.0)),
    k("top_k", Kind::Int(0)),
    // Negative: no fixed seed (the seed system does not check it; -1 is the usual "random").
    k("seed", Kind::IntOrNull(i64::MIN)),
    ext("num_requests", Kind::Int(1)),
    ext("ignore_eos", Kind::Bool),
];
const PARALLEL_KEYS: &[Key] = &[
    k("world_size", Kind::Int(1)),
    k("attn_tp_size", Kind::Int(1)),
    k("embed_tp_size", Kind::Int(1)),
    k("lmhead_tp_size", Kind::Int(1)),
    k("dense_tp_size", Kind::Int(1)),
    k("moe_tp_size", Kind::Int(1)),
    k("shared_tp_size", Kind::Int(1)),
    k("o_proj_tp_size", Kind::Int(1)),
    k("cp_size", Kind::Int(1)),
    k("offline_prefill_dp_group_size", Kind::Int(1)),
    // Derived by the seed (`world_size / moe_tp_size`) and ignored when given; one of its
    // shipped configs sets it. Accepted here, and checked against the derived value.
    k("moe_ep_size", Kind::Int(1)),
];
const SCHEDULER_KEYS: &[Key] = &[
    k("batch_size", Kind::IntIn(1, MAX_BATCH)),
    k("max_new_tokens", Kind::Int(1)),
    k("max_prefill_tokens", Kind::Int(0)),
    k("mem_fraction_static", Kind::FloatAbove(0.0, 1.0)),
    k("block_size", Kind::IntIn(1, MAX_BLOCK_SIZE)),
    k("num_reserved_decode_tokens", Kind::Int(0)),
    k("cp_mini_batch", Kind::Int(i64::MIN)),
];

/// `model_config.custom_params` keys the seed's executor and DeepSeek/Kimi models read, with
/// their types (other keys pass: the seed reads the ones it knows and ignores the rest; run.log
/// notes them).
pub const CUSTOM_KEYS: &[Key] = &[
    k("enable_mla_prolog", Kind::Bool),
    k("enable_multi_streams", Kind::Bool),
    k("enable_superkernel", Kind::Bool),
    k("enable_o_proj_alltoall", Kind::Bool),
    k("enable_pypto", Kind::Bool),
    k("enable_limit_core", Kind::Bool),
    k("enable_afd", Kind::Bool),
    k("enable_mega_moe", Kind::Bool),
    k("enable_prefetch", Kind::Bool),
    k("enable_offload", Kind::Bool),
    k("enable_mm_all_reduce_base", Kind::Bool),
    k("kernel_config", Kind::AnyMap),
    k("moe_chunk_max_len", Kind::Int(1)),
    k("micro_batch_mode", Kind::IntIn(0, 2)),
    k("num_hidden_layers", Kind::Int(1)),
];

/// The sections and their keys.
pub const SECTIONS: &[(&str, &[Key])] = &[
    ("model_config", MODEL_KEYS),
    ("data_config", DATA_KEYS),
    ("parallel_config", PARALLEL_KEYS),
    ("scheduler_config", SCHEDULER_KEYS),
];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelConfig {
    pub model_name: String,
    pub model_path: String,
    pub output_path: String,
    pub dtype: String,
    pub with_ckpt: bool,
    pub next_n: usize,
    pub platform_version: Option<String>,
    pub exe_mode: String,
    pub enable_cache_compile: bool,
    pub enable_static_kernel: bool,
    pub enable_dynamic_graph: bool,
    pub force_eplb: bool,
    pub enable_profiler: bool,
    pub enable_weight_nz: bool,
    pub enable_hadamard: bool,
    pub hadamard_weight_path: String,
    /// (An empty `custom_params:`, every entry commented out, is an empty mapping.)
    #[serde(deserialize_with = "null_as_empty")]
    pub custom_params: Map<String, Value>,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Map<String, Value>, D::Error> {
    Ok(Option::<Map<String, Value>>::deserialize(d)?.unwrap_or_default())
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            model_name: "model".into(),
            model_path: String::new(),
            output_path: String::new(),
            dtype: "bfloat16".into(),
            with_ckpt: true,
            next_n: 0,
            platform_version: None,
            exe_mode: "eager".into(),
            enable_cache_compile: false,
            enable_static_kernel: false,
            enable_dynamic_graph: true,
            force_eplb: false,
            enable_profiler: false,
            enable_weight_nz: true,
            enable_hadamard: false,
            hadamard_weight_path: String::new(),
            custom_params: Map::new(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DataConfig {
    pub dataset: String,
    pub dataset_path: String,
    pub input_truncated_len: usize,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
    pub seed: Option<u64>,
    /// cachalot: requests in the run (the prompt list repeated or cut to it); default
    /// `batch_size`, as the seed.
    pub num_requests: Option<usize>,
    /// cachalot: the seed's fixed-length mode (every request generates `max_new_tokens`).
    pub ignore_eos: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            dataset: "default".into(),
            dataset_path: String::new(),
            input_truncated_len: 256,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            num_requests: None,
            ignore_eos: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ParallelConfig {
    pub world_size: usize,
    pub attn_tp_size: usize,
    pub embed_tp_size: usize,
    pub lmhead_tp_size: usize,
    pub dense_tp_size: usize,
    pub moe_tp_size: usize,
    pub shared_tp_size: usize,
    pub o_proj_tp_size: usize,
    pub cp_size: usize,
    pub offline_prefill_dp_group_size: usize,
    pub moe_ep_size: Option<usize>,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            world_size: 1,
            attn_tp_size: 1,
            embed_tp_size: 1,
            lmhead_tp_size: 1,
            dense_tp_size: 1,
            moe_tp_size: 1,
            shared_tp_size: 1,
            o_proj_tp_size: 1,
            cp_size: 1,
            offline_prefill_dp_group_size: 1,
            moe_ep_size: None,
        }
    }
}

impl ParallelConfig {
    /// Independent request shards (`world_size / attn_tp_size`).
    pub fn attn_dp_size(&self) -> usize {
        self.world_size / self.attn_tp_size.max(1)
    }
    /// Expert-parallel degree (`world_size / moe_tp_size`).
    pub fn moe_ep_size(&self) -> usize {
        self.world_size / self.moe_tp_size.max(1)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    pub batch_size: usize,
    pub max_new_tokens: usize,
    /// 0: derived (`input_truncated_len × batch_size_per_dp_rank`).
    pub max_prefill_tokens: usize,
    pub mem_fraction_static: f64,
    pub block_size: usize,
    pub num_reserved_decode_tokens: usize,
    pub cp_mini_batch: i64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            batch_size: 1,
            max_new_tokens: 32,
            max_prefill_tokens: 0,
            mem_fraction_static: 0.85,
            block_size: 128,
            num_reserved_decode_tokens: 64,
            cp_mini_batch: -1,
        }
    }
}

/// A parsed and validated run config.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunConfig {
    pub model_config: ModelConfig,
    pub data_config: DataConfig,
    pub parallel_config: ParallelConfig,
    pub scheduler_config: SchedulerConfig,
}

impl RunConfig {
    pub fn batch_size_per_dp_rank(&self) -> usize {
        self.scheduler_config.batch_size / self.parallel_config.attn_dp_size().max(1)
    }

    /// `max_prefill_tokens`, or the seed's derived value when it is 0 (§1.6).
    pub fn max_prefill_tokens(&self) -> usize {
        match self.scheduler_config.max_prefill_tokens {
            0 => self.data_config.input_truncated_len * self.batch_size_per_dp_rank().max(1),
            n => n,
        }
    }

    /// Longest a request gets offline: prompt + output (+ MTP drafts), §1.6.
    pub fn max_total_len(&self) -> usize {
        let n = self.model_config.next_n;
        self.data_config.input_truncated_len + self.scheduler_config.max_new_tokens * (n + 1) + n
    }

    /// Requests in the run.
    pub fn num_requests(&self) -> usize {
        self.data_config
            .num_requests
            .unwrap_or(self.scheduler_config.batch_size)
    }
}

/// One problem in a config: where (line, key path) and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigIssue {
    pub line: Option<usize>,
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(l) => write!(f, "line {l}: {}: {}", self.path, self.message),
            None => write!(f, "{}: {}", self.path, self.message),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    // (`error`, not `source`: the message holds it; as a source it was printed twice.)
    #[error("cannot read {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: not valid YAML: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("{}", format_issues(path, issues))]
    Invalid {
        path: PathBuf,
        issues: Vec<ConfigIssue>,
    },
}

/// The YAML parser's message with its advice to programmers (parser options, API names)
/// replaced by what a config's author can do.
fn plain_yaml_error(message: &str) -> String {
    let mut m = message.to_string();
    for (from, to) in [
        (
            ", set DuplicateKeyPolicy in Options if acceptable",
            " (each key may appear once per section)",
        ),
        (
            "; use from_multiple or from_multiple_with_options",
            " (a run config is one document: remove the `---` line)",
        ),
        (
            " rejected by reject_non_finite_typeless_float",
            " (give a finite number)",
        ),
        (
            "cannot deserialize null into string; use Option<String>",
            "a key is null (`~`, `null` or nothing before the colon): keys are names",
        ),
    ] {
        m = m.replace(from, to);
    }
    if let Some(i) = m.find("budget breached: Depth") {
        let end = m[i..].find('\n').map_or(m.len(), |j| i + j);
        m.replace_range(
            i..end,
            "nested too deeply (a run config is sections of keys)",
        );
    }
    m
}

/// Problems of the config at `path` found after it was read (against its checkpoint): each
/// `(key path, message)`, located in the file when it can be read again (a path that is no
/// YAML key, as `--mtp`, has no line).
pub fn issues_at(path: &Path, found: Vec<(String, String)>) -> ConfigError {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut issues: Vec<ConfigIssue> = found
        .into_iter()
        .map(|(key_path, message)| {
            let parts: Vec<&str> = key_path.split('.').collect();
            let line = match parts[..] {
                [section, key] => find_line(&text, section, Some(key)),
                [section, key, sub] => {
                    find_nested_line(&text, find_line(&text, section, Some(key)), sub)
                }
                _ => None,
            };
            ConfigIssue {
                line,
                path: key_path,
                message,
            }
        })
        .collect();
    issues.sort_by_key(|i| i.line.unwrap_or(usize::MAX));
    ConfigError::Invalid {
        path: path.to_path_buf(),
        issues,
    }
}

fn format_issues(path: &Path, issues: &[ConfigIssue]) -> String {
    let mut s = format!(
        "{}: {} problem{} in the run config",
        path.display(),
        issues.len(),
        if issues.len() == 1 { "" } else { "s" }
    );
    for i in issues {
        s.push_str("\n  ");
        s.push_str(&i.to_string());
    }
    s
}

impl RunConfig {
    /// Reads and validates a YAML file.
    pub fn from_file(path: &Path) -> Result<RunConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            error: source,
        })?;
        RunConfig::from_yaml(&text, path)
    }

    /// Parses and validates YAML text; `origin` names it in errors.
    pub fn from_yaml(text: &str, origin: &Path) -> Result<RunConfig, ConfigError> {
        let value: Value = if text.trim().is_empty() {
            Value::Object(Map::new())
        } else {
            serde_saphyr::from_str(text).map_err(|e| {
                let mut message = plain_yaml_error(&e.to_string());
                // The parser may see a tab where a scalar before it ends: where it is.
                let tab = text.lines().position(|l| {
                    !l.trim().is_empty()
                        && l.chars()
                            .take_while(|c| c.is_whitespace())
                            .any(|c| c == '\t')
                });
                if let (true, Some(i)) = (message.contains("tab"), tab) {
                    message.push_str(&format!(
                        "\n(the first tab in an indentation is on line {}: YAML indents with \
                         spaces)",
                        i + 1
                    ));
                }
                ConfigError::Syntax {
                    path: origin.to_path_buf(),
                    message,
                }
            })?
        };
        let mut value = match value {
            Value::Null => Value::Object(Map::new()),
            v => v,
        };
        // A section written with nothing under it (`scheduler_config:`) is an empty section:
        // its keys keep their defaults, as in the seed's loader.
        if let Value::Object(top) = &mut value {
            for (_, v) in top.iter_mut() {
                if v.is_null() {
                    *v = Value::Object(Map::new());
                }
            }
        }
        let mut issues = Vec::new();
        check_schema(&value, text, &mut issues);
        // Without the keys that failed (their defaults stand in), the cross-key checks still
        // run, so every problem is reported at once; a check on a failed key is left out.
        let failed: Vec<String> = issues.iter().map(|i| i.path.clone()).collect();
        if let Value::Object(top) = &mut value {
            for path in &failed {
                match path.split_once('.') {
                    Some((section, key)) => {
                        if let Some(Value::Object(m)) = top.get_mut(section) {
                            m.remove(key);
                        }
                    }
                    None => {
                        top.remove(path.as_str());
                    }
                }
            }
            // A negative sampling seed means none fixed.
            if let Some(Value::Object(d)) = top.get_mut("data_config") {
                if d.get("seed")
                    .and_then(Value::as_f64)
                    .is_some_and(|x| x < 0.0)
                {
                    d.insert("seed".into(), Value::Null);
                }
            }
        }
        let parsed = if value.is_object() {
            serde_json::from_value::<RunConfig>(value)
        } else {
            serde_json::from_value::<RunConfig>(Value::Object(Map::new()))
        };
        match parsed {
            Ok(cfg) => {
                let mut more = Vec::new();
                cfg.check_consistency(text, &mut more);
                issues.extend(more.into_iter().filter(|i| !failed.contains(&i.path)));
                if issues.is_empty() {
                    return Ok(cfg);
                }
            }
            Err(e) if issues.is_empty() => issues.push(ConfigIssue {
                line: None,
                path: "(config)".into(),
                message: e.to_string(),
            }),
            Err(_) => {}
        }
        issues.sort_by_key(|i| i.line.unwrap_or(usize::MAX));
        Err(ConfigError::Invalid {
            path: origin.to_path_buf(),
            issues,
        })
    }

    fn check_consistency(&self, text: &str, issues: &mut Vec<ConfigIssue>) {
        let mut add = |section: &str, key: &str, message: String| {
            issues.push(ConfigIssue {
                line: find_line(text, section, Some(key)),
                path: format!("{section}.{key}"),
                message,
            })
        };
        let p = &self.parallel_config;
        let ws = p.world_size;
        for (name, size) in [
            ("attn_tp_size", p.attn_tp_size),
            ("embed_tp_size", p.embed_tp_size),
            ("lmhead_tp_size", p.lmhead_tp_size),
            ("dense_tp_size", p.dense_tp_size),
            ("moe_tp_size", p.moe_tp_size),
            ("shared_tp_size", p.shared_tp_size),
            ("o_proj_tp_size", p.o_proj_tp_size),
            ("cp_size", p.cp_size),
            (
                "offline_prefill_dp_group_size",
                p.offline_prefill_dp_group_size,
            ),
        ] {
            if !ws.is_multiple_of(size) {
                add(
                    "parallel_config",
                    name,
                    format!("{size} does not divide world_size {ws}"),
                );
            }
        }
        if p.cp_size > 1 && (p.cp_size != ws || p.attn_tp_size != 1) {
            add(
                "parallel_config",
                "cp_size",
                format!(
                    "context parallelism needs cp_size == world_size ({ws}) and attn_tp_size == 1 \
                     (got cp_size {}, attn_tp_size {})",
                    p.cp_size, p.attn_tp_size
                ),
            );
        }
        if let Some(ep) = p.moe_ep_size {
            if ws.is_multiple_of(p.moe_tp_size) && ep != p.moe_ep_size() {
                add(
                    "parallel_config",
                    "moe_ep_size",
                    format!(
                        "{ep} contradicts world_size {ws} / moe_tp_size {} = {} (it is derived; \
                         leave it out)",
                        p.moe_tp_size,
                        p.moe_ep_size()
                    ),
                );
            }
        }
        let dp = p.attn_dp_size();
        let s = &self.scheduler_config;
        if ws.is_multiple_of(p.attn_tp_size)
            && p.cp_size == 1
            && dp > 1
            && !s.batch_size.is_multiple_of(dp)
        {
            add(
                "scheduler_config",
                "batch_size",
                format!(
                    "{} is not a multiple of the attention data-parallel size {dp} \
                     (world_size {ws} / attn_tp_size {})",
                    s.batch_size, p.attn_tp_size
                ),
            );
        }
        let g = p.offline_prefill_dp_group_size;
        if g > 1 && dp > 0 && !(s.batch_size / dp).is_multiple_of(g) {
            add(
                "parallel_config",
                "offline_prefill_dp_group_size",
                format!(
                    "{g} does not divide batch_size per DP rank {}",
                    s.batch_size / dp
                ),
            );
        }
        let m = &self.model_config;
        if m.enable_static_kernel && m.exe_mode != "npugraph_ex" {
            add(
                "model_config",
                "enable_static_kernel",
                format!(
                    "only valid with exe_mode npugraph_ex (exe_mode is {})",
                    m.exe_mode
                ),
            );
        }
        if m.next_n > 3 {
            add(
                "model_config",
                "next_n",
                format!("{} draft tokens; the DeepSeek models allow 0..=3", m.next_n),
            );
        }
        if m.exe_mode == "eager" && m.enable_cache_compile {
            add(
                "model_config",
                "enable_cache_compile",
                "compile caching needs a graph exe_mode (ge_graph or npugraph_ex), not eager"
                    .into(),
            );
        }
    }
}

/// Type and range checks of every key against [`SECTIONS`].
fn check_schema(value: &Value, text: &str, issues: &mut Vec<ConfigIssue>) {
    let Value::Object(top) = value else {
        issues.push(ConfigIssue {
            line: None,
            path: "(top level)".into(),
            message: format!(
                "expected a mapping of sections ({}), got {}",
                section_names().join(", "),
                describe(value)
            ),
        });
        return;
    };
    for (name, body) in top {
        let Some((_, keys)) = SECTIONS.iter().find(|(s, _)| s == name) else {
            issues.push(ConfigIssue {
                line: find_line(text, name, None),
                path: name.clone(),
                message: unknown(name, &section_names(), "section"),
            });
            continue;
        };
        let body = match body {
            Value::Null => continue,
            Value::Object(m) => m,
            other => {
                issues.push(ConfigIssue {
                    line: find_line(text, name, None),
                    path: name.clone(),
                    message: format!("expected a mapping of keys, got {}", describe(other)),
                });
                continue;
            }
        };
        let valid: Vec<&str> = keys.iter().map(|k| k.name).collect();
        for (key, v) in body {
            let path = format!("{name}.{key}");
            let line = find_line(text, name, Some(key));
            let Some(spec) = keys.iter().find(|k| k.name == key) else {
                // A key of another section (the seed's older loader read
                // `data_config.batch_size`): where it goes.
                let home = SECTIONS
                    .iter()
                    .find(|(s, ks)| s != name && ks.iter().any(|k| k.name == key))
                    .map(|(s, _)| *s);
                issues.push(ConfigIssue {
                    line,
                    path,
                    message: match home {
                        Some(s) => {
                            format!("unknown key in {name}: `{key}` belongs in {s} (move it there)")
                        }
                        None => unknown(key, &valid, "key"),
                    },
                });
                continue;
            };
            if let Some(message) = check_value(spec.kind, v) {
                issues.push(ConfigIssue {
                    line,
                    path,
                    message,
                });
            } else if let ("custom_params", Value::Object(params)) = (key.as_str(), v) {
                check_custom_params(params, text, line, issues);
            }
        }
    }
}

/// `model_config.custom_params`: the seed's keys hold their types; a near miss of
/// `num_hidden_layers`, the one applied here, is an error (the model would run whole).
fn check_custom_params(
    params: &Map<String, Value>,
    text: &str,
    from: Option<usize>,
    issues: &mut Vec<ConfigIssue>,
) {
    for (key, v) in params {
        let path = format!("model_config.custom_params.{key}");
        let line = find_nested_line(text, from, key).or(from);
        let message = match CUSTOM_KEYS.iter().find(|k| k.name == key) {
            Some(spec) => check_value(spec.kind, v),
            None if strsim::jaro_winkler(key, "num_hidden_layers") >= 0.9 => Some(
                "unknown key; did you mean `num_hidden_layers`? (the one custom_params key \
                 applied here; the others are the seed's NPU switches, without effect)"
                    .into(),
            ),
            None => None,
        };
        if let Some(message) = message {
            issues.push(ConfigIssue {
                line,
                path,
                message,
            });
        }
    }
}

/// 1-based line of `key:` on or after line `from` (a key of a nested mapping, block or flow).
fn find_nested_line(text: &str, from: Option<usize>, key: &str) -> Option<usize> {
    let from = from?;
    text.lines()
        .enumerate()
        .skip(from - 1)
        .find(|(_, l)| names_key(l, key))
        .map(|(i, _)| i + 1)
}

fn section_names() -> Vec<&'static str> {
    SECTIONS.iter().map(|(s, _)| *s).collect()
}

fn unknown(name: &str, valid: &[&str], what: &str) -> String {
    // Keys that name the same size with a prefix (`ep_size` is `moe_ep_size`; `tp_size`,
    // `attn_tp_size` or `moe_tp_size`) before the closest spelling.
    let named: Vec<String> = valid
        .iter()
        .filter(|v| v.ends_with(&format!("_{name}")))
        .map(|v| format!("`{v}`"))
        .collect();
    let hint = match closest(name, valid.iter().copied(), 0.8) {
        _ if !named.is_empty() => format!("did you mean {}? ", named.join(" or ")),
        Some(v) => format!("did you mean `{v}`? "),
        None => String::new(),
    };
    format!("unknown {what}; {hint}valid {what}s: {}", valid.join(", "))
}

/// The spelling among `valid` closest to `name` (Jaro-Winkler), if at least `min` alike.
pub fn closest<'a>(
    name: &str,
    valid: impl IntoIterator<Item = &'a str>,
    min: f64,
) -> Option<&'a str> {
    valid
        .into_iter()
        .map(|v| (strsim::jaro_winkler(name, v), v))
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .filter(|(score, _)| *score >= min)
        .map(|(_, v)| v)
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "a mapping".into(),
    }
}

/// The seed's `model_config.dtype` values: bfloat16, float32 or float16 by any of their
/// names, in any case, with or without `torch.`.
pub fn is_torch_dtype(d: &str) -> bool {
    let d = d.to_ascii_lowercase();
    let d = d.strip_prefix("torch.").unwrap_or(&d);
    [
        "float32", "fp32", "f32", "float", "bfloat16", "bf16", "float16", "fp16", "f16", "half",
    ]
    .contains(&d)
}

fn check_value(kind: Kind, v: &Value) -> Option<String> {
    let got = || describe(v);
    match kind {
        Kind::Bool => (!v.is_boolean()).then(|| format!("expected true or false, got {}", got())),
        Kind::Int(min) | Kind::IntOrNull(min) | Kind::IntIn(min, _) => {
            if v.is_null() && matches!(kind, Kind::IntOrNull(_)) {
                return None;
            }
            let max = match kind {
                Kind::IntIn(_, max) => max,
                // The seed (the only nullable integer) may be any 64-bit value.
                Kind::IntOrNull(_) => i64::MAX,
                _ => MAX_INT,
            };
            match v.as_i64() {
                Some(n) if n >= min && n <= max => None,
                Some(n) if n >= min => Some(format!("{n} is out of range: must be at most {max}")),
                Some(n) => Some(format!("{n} is out of range: must be >= {min}")),
                // A whole number past i64 (u64 up to 2^64 - 1).
                // The seed: any 64-bit value, signed or not.
                None if v.as_u64().is_some() && matches!(kind, Kind::IntOrNull(_)) => None,
                None if v.as_u64().is_some() => Some(format!(
                    "{} is out of range: must be at most {max}",
                    v.as_u64().unwrap_or(0)
                )),
                // A whole number YAML read as a decimal one (`1e4`, a leading zero: `010`).
                None if v
                    .as_f64()
                    .is_some_and(|x| x.is_finite() && x.fract() == 0.0) =>
                {
                    let x = v.as_f64().unwrap_or(0.0);
                    // (The seed's top is 2^64 - 1, which no f64 below 2^64 passes.)
                    let (over, top) = match kind {
                        Kind::IntOrNull(_) => (x >= 18_446_744_073_709_551_616.0, u64::MAX as i128),
                        _ => (x > max as f64, max as i128),
                    };
                    // (The seed: a negative one past 64 bits is none fixed, as any negative.)
                    if matches!(kind, Kind::IntOrNull(_)) && x < 0.0 {
                        return None;
                    }
                    Some(if over {
                        // (Printed as YAML read it: a number past 64 bits is a float there.)
                        format!("{x:e} is out of range: must be at most {top}")
                    } else if x < min as f64 {
                        format!("{x} is out of range: must be >= {min}")
                    } else {
                        format!(
                            "expected an integer, got {x}: YAML read a decimal number here (a \
                             fraction such as 128.0, an exponent such as 1e4, or leading zeros, \
                             which the seed's PyYAML reads as octal: 010 is 8 there); write the \
                             integer's digits alone, as {}",
                            x as i128
                        )
                    })
                }
                None => Some(format!(
                    "expected an integer{}, got {}",
                    if min > i64::MIN {
                        format!(" >= {min}")
                    } else {
                        String::new()
                    },
                    got()
                )),
            }
        }
        Kind::Float(min, max) => match v.as_f64() {
            Some(x) if x >= min && x <= max => None,
            Some(x) if x > max && max == f32::MAX as f64 => Some(format!(
                "{x:e} is out of range: must be >= {min} and at most {:e} (a 32-bit float)",
                f32::MAX
            )),
            Some(x) if max.is_finite() => {
                Some(format!("{x} is out of range: must be in [{min}, {max}]"))
            }
            Some(x) => Some(format!("{x} is out of range: must be >= {min}")),
            None => Some(format!("expected a number, got {}", got())),
        },
        Kind::FloatAbove(min, max) => match v.as_f64() {
            Some(x) if x > min && x <= max => None,
            Some(x) => Some(format!("{x} is out of range: must be in ({min}, {max}]")),
            None => Some(format!("expected a number, got {}", got())),
        },
        Kind::Str => (!v.is_string()).then(|| format!("expected a string, got {}", got())),
        Kind::Dtype => match v.as_str() {
            Some(d) if is_torch_dtype(d) => None,
            _ => Some(format!(
                "{}: expected bfloat16 (the seed's default), float32 (an f32 cache; also fp32, \
                 f32) or float16",
                got()
            )),
        },
        Kind::OneOf(allowed) | Kind::OneOfOrNull(allowed) => match v.as_str() {
            Some(s) if allowed.contains(&s) => None,
            _ if v.is_null() && matches!(kind, Kind::OneOfOrNull(_)) => None,
            other => {
                // A value that differs only in case, or a number where a string is meant.
                let text = other
                    .map(str::to_string)
                    .or_else(|| v.is_number().then(|| v.to_string()));
                let hint = text
                    .as_deref()
                    .and_then(|t| allowed.iter().find(|a| a.eq_ignore_ascii_case(t)))
                    .map(|a| {
                        if v.is_number() {
                            format!(" (write it as a string: \"{a}\")")
                        } else {
                            format!(" (did you mean `{a}`? values are case-sensitive)")
                        }
                    })
                    .unwrap_or_default();
                Some(format!(
                    "expected one of {}, got {}{hint}",
                    allowed.join(", "),
                    got()
                ))
            }
        },
        Kind::AnyMap => {
            (!v.is_object() && !v.is_null()).then(|| format!("expected a mapping, got {}", got()))
        }
    }
}

/// 1-based line of `section:` (at column 0), or of `key:` under it: indented below it, or in
/// a flow mapping on its line (`section: {key: 1}`); names may be quoted, and a byte-order
/// mark before the first line is no part of it.
fn find_line(text: &str, section: &str, key: Option<&str>) -> Option<usize> {
    let mut in_section = false;
    // The indentation of the section's keys (its first key's): deeper lines are nested values.
    let mut key_indent = None;
    for (i, line) in text.lines().enumerate() {
        let line = if i == 0 {
            line.trim_start_matches('\u{feff}')
        } else {
            line
        };
        let indented = line.starts_with(' ') || line.starts_with('\t');
        let trimmed = line.trim_start();
        if !indented && !trimmed.is_empty() && !trimmed.starts_with('#') {
            let is_it = ["", "\"", "'"].iter().any(|q| {
                trimmed
                    .strip_prefix(q)
                    .and_then(|r| r.strip_prefix(section))
                    .and_then(|r| r.strip_prefix(q))
                    .is_some_and(|r| r.trim_start().starts_with(':'))
            });
            match key {
                None if is_it => return Some(i + 1),
                // A flow mapping on the section's own line.
                Some(key)
                    if is_it && names_key(trimmed.split_once(':').map_or("", |(_, r)| r), key) =>
                {
                    return Some(i + 1)
                }
                _ => {}
            }
            in_section = is_it;
            key_indent = None;
        } else if in_section && !trimmed.is_empty() && !trimmed.starts_with('#') {
            let indent = line.len() - trimmed.len();
            if *key_indent.get_or_insert(indent) == indent
                && key.is_some_and(|k| names_key(trimmed, k))
            {
                return Some(i + 1);
            }
        }
    }
    None
}

/// Line `l` (its comment aside) writes `key:` as a key (first on the line, or after `{` or `,`
/// in a flow mapping; quoted or not; not inside a value).
fn names_key(l: &str, key: &str) -> bool {
    let l = l.split('#').next().unwrap_or("");
    l.match_indices(key).any(|(i, _)| {
        let (before, after) = (&l[..i], &l[i + key.len()..]);
        // Quoted: the same quote on both sides.
        let (before, after) = match (before.chars().last(), after.chars().next()) {
            (Some(q @ ('"' | '\'')), Some(c)) if c == q => {
                (&before[..before.len() - 1], &after[1..])
            }
            _ => (before, after),
        };
        let before = before.trim_end();
        (before.is_empty() || before.ends_with('{') || before.ends_with(','))
            && after.trim_start().starts_with(':')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_is_all_defaults() {
        let c = RunConfig::from_yaml("", Path::new("x.yaml")).unwrap();
        assert_eq!(c, RunConfig::default());
        assert_eq!(c.max_prefill_tokens(), 256);
        assert_eq!(c.max_total_len(), 256 + 32);
    }

    /// `custom_params:` with every entry commented out (YAML's null) is an empty mapping.
    #[test]
    fn an_empty_custom_params_is_empty() {
        let y = "model_config:\n  custom_params:\n#    enable_mla_prolog: True\n";
        let cfg = RunConfig::from_yaml(y, Path::new("t.yaml")).unwrap();
        assert!(cfg.model_config.custom_params.is_empty());
    }

    /// custom_params' known keys are type-checked with the rest of the file (each named with
    /// its line), a near miss of num_hidden_layers is an error, other keys pass; a whole number
    /// YAML reads as a decimal one says how to write it; a size named without its prefix is
    /// pointed at the keys that carry it.
    #[test]
    fn custom_params_numbers_and_prefixed_sizes() {
        let y = "model_config:\n  custom_params:\n    enable_mla_prolog: 7\n    \
                 num_hidden_layer: 2\n    some_future_switch: 3\n    micro_batch_mode: 5\n\
                 scheduler_config:\n  batch_size: 0\n  max_prefill_tokens: 1e4\n\
                 parallel_config:\n  ep_size: 2\n";
        let e = RunConfig::from_yaml(y, Path::new("x.yaml"))
            .unwrap_err()
            .to_string();
        for want in [
            "line 3: model_config.custom_params.enable_mla_prolog: expected true or false",
            "line 4: model_config.custom_params.num_hidden_layer: unknown key; did you mean \
             `num_hidden_layers`?",
            "line 6: model_config.custom_params.micro_batch_mode: 5 is out of range",
            "line 8: scheduler_config.batch_size: 0 is out of range",
            "line 9: scheduler_config.max_prefill_tokens: expected an integer, got 10000",
            "write the integer's digits alone, as 10000",
            "line 11: parallel_config.ep_size: unknown key; did you mean `moe_ep_size`?",
        ] {
            assert!(e.contains(want), "`{want}` not in:\n{e}");
        }
        assert!(!e.contains("some_future_switch"), "{e}");
        let ok = "model_config:\n  custom_params: {enable_afd: false, kernel_config: \
                  {compressor: native}, moe_chunk_max_len: 1024}\n";
        RunConfig::from_yaml(ok, Path::new("x.yaml")).unwrap();
    }

    /// model_config.dtype is checked with the rest of the file (its torch spellings taken).
    #[test]
    fn dtype_is_checked_with_the_file() {
        let y = "model_config:\n  dtype: \"int8\"\nscheduler_config:\n  batch_size: 0\n";
        let e = RunConfig::from_yaml(y, Path::new("x.yaml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 2: model_config.dtype: the string \"int8\": expected bfloat16"),
            "{e}"
        );
        assert!(e.contains("line 4: scheduler_config.batch_size"), "{e}");
        for ok in ["torch.BFloat16", "fp32", "half"] {
            let y = format!("model_config:\n  dtype: {ok}\n");
            RunConfig::from_yaml(&y, Path::new("x.yaml")).unwrap();
        }
    }

    /// A section with nothing under it is an empty section; an integer past 64 bits is out of
    /// range, said so.
    #[test]
    fn empty_sections_and_integers_past_64_bits() {
        let c = RunConfig::from_yaml("model_config:\nscheduler_config:\n", Path::new("x.yaml"))
            .unwrap();
        assert_eq!(c, RunConfig::default());
        let e = RunConfig::from_yaml(
            "scheduler_config:\n  max_prefill_tokens: 18446744073709551615\n",
            Path::new("x.yaml"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("out of range") && e.contains("max_prefill_tokens"),
            "{e}"
        );
        for bad in ["0", "1.5", "-1"] {
            let e = RunConfig::from_yaml(
                &format!("scheduler_config:\n  mem_fraction_static: {bad}\n"),
                Path::new("x.yaml"),
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("must be in (0, 1]"), "{e}");
        }
    }

    #[test]
    fn derived_values_follow_the_seed() {
        let y = "parallel_config: {world_size: 16, attn_tp_size: 1}\n\
                 scheduler_config: {batch_size: 64}\nmodel_config: {next_n: 1}\n";
        let c = RunConfig::from_yaml(y, Path::new("x.yaml")).unwrap();
        assert_eq!(c.batch_size_per_dp_rank(), 4);
        assert_eq!(c.max_prefill_tokens(), 1024);
        assert_eq!(c.max_total_len(), 256 + 64 + 1);
        assert_eq!(c.num_requests(), 64);
    }

    #[test]
    fn lines_are_found() {
        let y = "a:\n  x: 1\nb:\n  # c\n  x: 2\n";
        assert_eq!(find_line(y, "b", Some("x")), Some(5));
        assert_eq!(find_line(y, "b", None), Some(3));
        assert_eq!(find_line(y, "c", None), None);
        // Not a nested mapping's key of the same name.
        let y = "m:\n  c:\n    n: 1\n  n: -1\n";
        assert_eq!(find_line(y, "m", Some("n")), Some(4));
        // Not inside a value; a quoted key spaced from its colon.
        let y = "d:\n  path: \"x top_k: y\"\n  \"top_k\" : -1\n";
        assert_eq!(find_line(y, "d", Some("top_k")), Some(3));
        // After a byte-order mark, quoted, in a flow mapping.
        let y = "\u{feff}a:\n  \"x\": 1\nb: {y: 2, 'x': 3}\n";
        assert_eq!(find_line(y, "a", None), Some(1));
        assert_eq!(find_line(y, "a", Some("x")), Some(2));
        assert_eq!(find_line(y, "b", Some("x")), Some(3));
        assert_eq!(find_line(y, "b", Some("z")), None);
    }

    /// A key written in another section is pointed there; the sampling seed takes any 64-bit
    /// value; a tab in an indentation and a null key are said plainly.
    #[test]
    fn misplaced_keys_seeds_tabs_and_null_keys() {
        let error = |y: &str| {
            RunConfig::from_yaml(y, Path::new("x.yaml"))
                .unwrap_err()
                .to_string()
        };
        let e = error("data_config:\n  batch_size: 4\n  seed: 18446744073709551615\n");
        assert!(
            e.contains(
                "line 2: data_config.batch_size: unknown key in data_config: `batch_size` \
                 belongs in scheduler_config"
            ) && !e.contains("seed"),
            "{e}"
        );
        let c = RunConfig::from_yaml(
            "data_config:\n  seed: 18446744073709551615\n",
            Path::new("x"),
        )
        .unwrap();
        assert_eq!(c.data_config.seed, Some(u64::MAX));
        let e = error("data_config:\n  seed: 18446744073709551616\n");
        assert!(
            e.contains(
                "1.8446744073709552e19 is out of range: must be at most 18446744073709551615"
            ),
            "{e}"
        );
        // Negative, even past 64 bits: none fixed.
        for seed in ["-1", "-9223372036854775808", "-9223372036854775809"] {
            let c =
                RunConfig::from_yaml(&format!("data_config:\n  seed: {seed}\n"), Path::new("x"))
                    .unwrap();
            assert_eq!(c.data_config.seed, None, "{seed}");
        }
        let e = error("a:\n  b: 1\n \tc: 2\n");
        assert!(
            e.contains("the first tab in an indentation is on line 3"),
            "{e}"
        );
        let e = error("data_config:\n  ~: 1\n");
        assert!(e.contains("a key is null") && !e.contains("Option<"), "{e}");
    }
}
