//! `config.json` of DeepSeek-V3/R1 and Kimi-K2 checkpoints, as a typed, validated struct.
//!
//! Spec: `shared/specs/deepseek-v3-r1-kimi-k2.md` §1 (fields, real values, derived constants) and
//! §8 (what `transformers`' `DeepseekV3Config` reads). Field names are DeepSeek's official ones
//! (`rope_scaling`, `num_nextn_predict_layers`); the transformers aliases (`rope_parameters`,
//! `num_mtp_layers`, `num_local_experts`) are accepted too. Unknown extra fields are ignored, as
//! real configs carry many informational ones (`ep_size`, `auto_map`, …); a field with the wrong
//! type or an unsupported value is an error naming the field.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

/// Which checkpoint family a `config.json` describes. Both share one architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelType {
    DeepseekV3,
    KimiK2,
}

impl ModelType {
    pub fn as_str(self) -> &'static str {
        match self {
            ModelType::DeepseekV3 => "deepseek_v3",
            ModelType::KimiK2 => "kimi_k2",
        }
    }
}

/// YaRN parameters (`rope_scaling` with `type`/`rope_type` = `yarn`), spec §3.2.
#[derive(Clone, Debug, PartialEq)]
pub struct YarnScaling {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    /// Explicit cos/sin amplitude (`attention_factor`), rarely present.
    pub attention_factor: Option<f64>,
    /// Floor/ceil the correction range (transformers' `truncate`, default true).
    pub truncate: bool,
}

/// The weight format declared by `quantization_config`.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantizationConfig {
    /// DeepSeek's FP8 e4m3 checkpoints with `weight_scale_inv` blocks.
    Fp8Block {
        block_rows: usize,
        block_cols: usize,
    },
    /// compressed-tensors `int-quantized` (the W8A8 converter's output): int8 weights with
    /// per-output-row `weight_scale`; `ignore` lists modules kept in BF16.
    CompressedInt8 {
        ignore: Vec<String>,
        kv_cache_int8: bool,
    },
    /// compressed-tensors `pack-quantized` (Kimi-K2-Thinking's release, spec §2.3): the
    /// targeted Linears (K2-Thinking: the routed experts) hold symmetric int4 weights
    /// (`weight_packed` int32 `[out, in/8]`, `weight_scale` `[out, in/group_size]`,
    /// `weight_shape`), multiplied with f32 activations (the seed's W4A16); `ignore` lists the
    /// modules kept in BF16. `group_size` is `None` for the `channel` strategy (one scale per row).
    PackedInt4 {
        group_size: Option<usize>,
        ignore: Vec<String>,
    },
}

#[derive(Clone, Debug)]
pub struct DeepseekV3Config {
    pub model_type: ModelType,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_routed_experts: Option<usize>,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<YarnScaling>,
    /// Checkpoint rope dims are interleaved pairs (DeepSeek's layout; transformers' default).
    pub rope_interleave: bool,
    pub max_position_embeddings: usize,
    pub num_nextn_predict_layers: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub quantization: Option<QuantizationConfig>,
}

/// The norm epsilon of the latent norms (`q_a_layernorm`, `kv_a_layernorm`): always 1e-6,
/// not `rms_norm_eps` (spec §1.3).
pub const LATENT_NORM_EPS: f32 = 1e-6;

/// The largest size (vocabulary, widths, heads, experts, positions) a config may give: far
/// above every released model (DeepSeek-V3: vocabulary 129280, hidden 7168), low enough that
/// products of a few sizes fit in `usize`.
pub const MAX_DIM: usize = 1 << 24;
/// The most decoder layers a config may give (DeepSeek-V3: 61).
pub const MAX_LAYERS: usize = 4096;
/// The most MTP layers a config may give (released models: 1).
pub const MAX_MTP_LAYERS: usize = 16;

pub(crate) struct Fields<'a> {
    pub(crate) path: &'a Path,
    pub(crate) map: &'a Map<String, Value>,
    pub(crate) prefix: &'a str,
}

impl<'a> Fields<'a> {
    pub(crate) fn err(&self, field: &str, message: impl Into<String>) -> ModelError {
        ModelError::Config {
            path: self.path.to_path_buf(),
            field: format!("{}{}", self.prefix, field),
            message: message.into(),
        }
    }

    pub(crate) fn get(&self, field: &str) -> Option<&'a Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    pub(crate) fn usize_opt(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            // Integers written as floats (`4096.0`, as some exported configs have them) count,
            // as Python's json and transformers take them.
            Some(v) => v
                .as_u64()
                .or_else(|| {
                    v.as_f64()
                        .filter(|x| {
                            x.fract() == 0.0 && (0.0..=9.007_199_254_740_992e15).contains(x)
                        })
                        .map(|x| x as u64)
                })
                .map(|x| Some(x as usize))
                .ok_or_else(|| {
                    self.err(field, format!("expected a non-negative integer, found {v}"))
                }),
        }
    }

    pub(crate) fn usize_req(&self, field: &str) -> Result<usize> {
        self.usize_opt(field)?.ok_or_else(|| {
            self.err(
                field,
                if self.map.contains_key(field) {
                    "null; this field is required (a non-negative integer)"
                } else {
                    "missing; this field is required"
                },
            )
        })
    }

    pub(crate) fn usize_or(&self, field: &str, default: usize) -> Result<usize> {
        Ok(self.usize_opt(field)?.unwrap_or(default))
    }

    pub(crate) fn f64_opt(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected a number, found {v}"))),
        }
    }

    pub(crate) fn f64_or(&self, field: &str, default: f64) -> Result<f64> {
        Ok(self.f64_opt(field)?.unwrap_or(default))
    }

    pub(crate) fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(field, format!("expected true or false, found {v}"))),
        }
    }

    pub(crate) fn str_opt(&self, field: &str) -> Result<Option<&'a str>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected a string, found {v}"))),
        }
    }

    pub(crate) fn token_ids(&self, field: &str) -> Result<Vec<u32>> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| self.err(field, format!("expected token ids, found {v}")))
                })
                .collect(),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(|x| vec![x])
                .ok_or_else(|| self.err(field, format!("expected a token id, found {v}"))),
        }
    }
}

impl DeepseekV3Config {
    /// Reads `<dir>/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("config.json"))
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            error: source,
        })?;
        Self::from_json_str(&text, path)
    }

    /// Parses and validates; `path` is used in error messages only.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let map = json_object(text, path)?;
        let f = Fields {
            path,
            map: &map,
            prefix: "",
        };

        let model_type = match f.str_opt("model_type")? {
            Some("deepseek_v3") => ModelType::DeepseekV3,
            Some("kimi_k2") => ModelType::KimiK2,
            Some(other) => {
                return Err(f.err(
                    "model_type",
                    format!(
                        "unsupported model type `{other}`; this loader reads `deepseek_v3` \
                         (DeepSeek-V3/R1) and `kimi_k2` (Kimi-K2)"
                    ),
                ))
            }
            None => return Err(f.err(
                "model_type",
                "missing; expected `deepseek_v3` (DeepSeek-V3/R1), `kimi_k2` (Kimi-K2) or `deepseek_v4` (DeepSeek-V4)",
            )),
        };
        match f.str_opt("topk_method")? {
            None | Some("noaux_tc") => {}
            Some(other) => {
                return Err(f.err(
                    "topk_method",
                    format!("unsupported routing method `{other}`; only `noaux_tc` is implemented"),
                ))
            }
        }
        match f.str_opt("scoring_func")? {
            None | Some("sigmoid") => {}
            Some(other) => {
                return Err(f.err(
                    "scoring_func",
                    format!("unsupported expert scoring `{other}`; only `sigmoid` is implemented"),
                ))
            }
        }
        match f.str_opt("hidden_act")? {
            None | Some("silu") => {}
            Some(other) => {
                return Err(f.err(
                    "hidden_act",
                    format!("unsupported activation `{other}`; only `silu` is implemented"),
                ))
            }
        }
        if f.bool_or("attention_bias", false)? {
            return Err(f.err(
                "attention_bias",
                "attention biases are not supported (every DeepSeek-V3/Kimi-K2 release has false)",
            ));
        }

        let num_attention_heads = f.usize_req("num_attention_heads")?;
        let n_routed_experts = match f.usize_opt("n_routed_experts")? {
            Some(e) => Some(e),
            None => f.usize_opt("num_local_experts")?,
        };
        let num_nextn_predict_layers = match f.usize_opt("num_nextn_predict_layers")? {
            Some(n) => n,
            // transformers' default (`num_mtp_layers` 1): DeepSeek's MTP layer after the
            // main ones; a checkpoint without it still runs without `--mtp`.
            None => f.usize_or("num_mtp_layers", 1)?,
        };

        let (rope_theta, rope_scaling) = parse_rope(&f)?;

        let cfg = DeepseekV3Config {
            model_type,
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size: f.usize_req("hidden_size")?,
            intermediate_size: f.usize_req("intermediate_size")?,
            moe_intermediate_size: f.usize_or("moe_intermediate_size", 0)?,
            num_hidden_layers: f.usize_req("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", num_attention_heads)?,
            q_lora_rank: f.usize_opt("q_lora_rank")?,
            kv_lora_rank: f.usize_req("kv_lora_rank")?,
            qk_nope_head_dim: f.usize_req("qk_nope_head_dim")?,
            qk_rope_head_dim: f.usize_req("qk_rope_head_dim")?,
            v_head_dim: f.usize_req("v_head_dim")?,
            n_routed_experts,
            // Fields a config leaves out take transformers' `DeepseekV3Config` defaults (the
            // same in DeepSeek's `configuration_deepseek.py`): routing as DeepSeek-V3's.
            n_shared_experts: f.usize_or("n_shared_experts", 1)?,
            num_experts_per_tok: f.usize_or("num_experts_per_tok", 8)?,
            n_group: f.usize_or("n_group", 8)?,
            topk_group: f.usize_or("topk_group", 4)?,
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            routed_scaling_factor: f.f64_or("routed_scaling_factor", 2.5)? as f32,
            first_k_dense_replace: f.usize_or("first_k_dense_replace", 3)?,
            moe_layer_freq: f.usize_or("moe_layer_freq", 1)?,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)? as f32,
            rope_theta,
            rope_scaling,
            rope_interleave: f.bool_or("rope_interleave", true)?,
            max_position_embeddings: f.usize_or("max_position_embeddings", 4096)?,
            num_nextn_predict_layers,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
            quantization: parse_quantization(&f)?,
        };
        // A defaulted field a check refuses is named as defaulted.
        cfg.validate(path).map_err(|e| match e {
            ModelError::Config {
                path,
                field,
                message,
            } if DEFAULTED.iter().any(|(k, _)| *k == field) && f.get(&field).is_none() => {
                let d = DEFAULTED
                    .iter()
                    .find(|(k, _)| *k == field)
                    .map_or("", |(_, d)| d);
                ModelError::Config {
                    path,
                    message: format!(
                        "{message} (config.json does not set {field}; transformers' default \
                         {d} was taken: write the model's value)"
                    ),
                    field,
                }
            }
            e => e,
        })?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let err = |field: &str, message: String| ModelError::Config {
            path: path.to_path_buf(),
            field: field.to_string(),
            message,
        };
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("moe_layer_freq", self.moe_layer_freq),
            ("n_group", self.n_group),
        ] {
            if v == 0 {
                return Err(err(name, "must be at least 1".into()));
            }
        }
        // Upper bounds far above any released model, so that sizes multiplied from them cannot
        // overflow and a mistyped value is named here, not met as an allocation failure or a
        // hang later.
        let dims = [
            ("vocab_size", Some(self.vocab_size)),
            ("hidden_size", Some(self.hidden_size)),
            ("intermediate_size", Some(self.intermediate_size)),
            ("moe_intermediate_size", Some(self.moe_intermediate_size)),
            ("num_attention_heads", Some(self.num_attention_heads)),
            ("q_lora_rank", self.q_lora_rank),
            ("kv_lora_rank", Some(self.kv_lora_rank)),
            ("qk_nope_head_dim", Some(self.qk_nope_head_dim)),
            ("qk_rope_head_dim", Some(self.qk_rope_head_dim)),
            ("v_head_dim", Some(self.v_head_dim)),
            ("n_routed_experts", self.n_routed_experts),
            ("n_shared_experts", Some(self.n_shared_experts)),
            ("num_experts_per_tok", Some(self.num_experts_per_tok)),
            ("n_group", Some(self.n_group)),
            (
                "max_position_embeddings",
                Some(self.max_position_embeddings),
            ),
        ];
        for (name, v) in dims {
            if let Some(v) = v.filter(|&v| v > MAX_DIM) {
                return Err(err(
                    name,
                    format!("{v} is out of range (at most {MAX_DIM}); check the value"),
                ));
            }
        }
        for (name, v, max) in [
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            (
                "num_nextn_predict_layers",
                self.num_nextn_predict_layers,
                MAX_MTP_LAYERS,
            ),
        ] {
            if v > max {
                return Err(err(
                    name,
                    format!("{v} is out of range (at most {max}); check the value"),
                ));
            }
        }
        if self.max_position_embeddings == 0 {
            return Err(err("max_position_embeddings", "must be at least 1".into()));
        }
        special_ids_in_vocab(self.bos_token_id, &self.eos_token_ids, self.vocab_size)
            .map_err(|(field, message)| err(field, message))?;
        // Float fields that would turn every activation into NaN or ±∞ rather than fail.
        let finite = |name: &str, v: f64, ok: bool, what: &str| {
            if v.is_finite() && ok {
                Ok(())
            } else {
                Err(err(name, format!("{v} is out of range: {what}")))
            }
        };
        let eps = self.rms_norm_eps as f64;
        finite(
            "rms_norm_eps",
            eps,
            (0.0..=1.0).contains(&eps),
            "expected a small non-negative number (1e-6 in DeepSeek-V3)",
        )?;
        let rsf = self.routed_scaling_factor as f64;
        finite(
            "routed_scaling_factor",
            rsf,
            rsf > 0.0 && rsf <= 1e6,
            "expected a positive number (2.5 in DeepSeek-V3)",
        )?;
        match &self.rope_scaling {
            Some(y) => {
                // YaRN's correction range divides by ln θ.
                finite(
                    "rope_theta",
                    self.rope_theta,
                    self.rope_theta > 1.0,
                    "YaRN needs a base above 1 (10000 in DeepSeek-V3)",
                )?;
                finite(
                    "rope_scaling.factor",
                    y.factor,
                    y.factor > 0.0,
                    "expected a positive number",
                )?;
                for (name, v) in [
                    ("rope_scaling.mscale", y.mscale),
                    ("rope_scaling.mscale_all_dim", y.mscale_all_dim),
                    ("rope_scaling.attention_factor", y.attention_factor),
                    ("rope_scaling.beta_fast", Some(y.beta_fast)),
                    ("rope_scaling.beta_slow", Some(y.beta_slow)),
                ] {
                    if let Some(v) = v {
                        finite(name, v, v.abs() <= 1e6, "expected a moderate number")?;
                    }
                }
            }
            None => finite(
                "rope_theta",
                self.rope_theta,
                self.rope_theta > 0.0,
                "expected a positive base (10000 in DeepSeek-V3)",
            )?,
        }
        if self.qk_rope_head_dim == 0 || !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(err(
                "qk_rope_head_dim",
                format!(
                    "must be a positive even number, found {}",
                    self.qk_rope_head_dim
                ),
            ));
        }
        if self.q_lora_rank == Some(0) {
            return Err(err("q_lora_rank", "must be null or at least 1".into()));
        }
        if self.num_key_value_heads != self.num_attention_heads {
            return Err(err(
                "num_key_value_heads",
                format!(
                    "MLA has one latent KV per token; expected num_key_value_heads = \
                     num_attention_heads = {}, found {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if let Some(e) = self.n_routed_experts {
            if self.has_moe_layers() {
                if e == 0 || self.num_experts_per_tok == 0 || self.moe_intermediate_size == 0 {
                    let field = if e == 0 {
                        "n_routed_experts"
                    } else if self.num_experts_per_tok == 0 {
                        "num_experts_per_tok"
                    } else {
                        "moe_intermediate_size"
                    };
                    return Err(err(
                        field,
                        "MoE layers need n_routed_experts, num_experts_per_tok and \
                         moe_intermediate_size of at least 1"
                            .into(),
                    ));
                }
                if e % self.n_group != 0 {
                    return Err(err(
                        "n_group",
                        format!(
                            "n_routed_experts = {e} is not divisible by n_group = {}",
                            self.n_group
                        ),
                    ));
                }
                if self.topk_group == 0 || self.topk_group > self.n_group {
                    return Err(err(
                        "topk_group",
                        format!(
                            "must be in 1..=n_group ({}), found {}",
                            self.n_group, self.topk_group
                        ),
                    ));
                }
                let per_group = e / self.n_group;
                if self.n_group > 1 && per_group < 2 {
                    return Err(err(
                        "n_group",
                        format!("group-limited routing scores groups by their top 2 experts; groups of {per_group} are too small"),
                    ));
                }
                if self.num_experts_per_tok > self.topk_group * per_group {
                    return Err(err(
                        "num_experts_per_tok",
                        format!(
                            "{} experts per token cannot be picked from {} groups of {per_group}",
                            self.num_experts_per_tok, self.topk_group
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Layer `i` is MoE iff routed experts exist, `i >= first_k_dense_replace` and
    /// `i % moe_layer_freq == 0` (spec §1.3). The MTP layer (index `num_hidden_layers`) is MoE.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.n_routed_experts.is_some_and(|e| e > 0)
            && i >= self.first_k_dense_replace
            && i.is_multiple_of(self.moe_layer_freq)
    }

    /// Any main layer is MoE, or an MTP layer (always MoE, spec §3.8) exists.
    fn has_moe_layers(&self) -> bool {
        (0..self.num_hidden_layers).any(|i| self.is_moe_layer(i))
            || (self.num_nextn_predict_layers > 0 && self.n_routed_experts.is_some_and(|e| e > 0))
    }

    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Values per token per layer in the latent KV cache: `kv_lora_rank + qk_rope_head_dim`.
    pub fn latent_cache_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// The attention softmax scale: `qk_head_dim^-0.5 · m²` with `m = 0.1·mscale_all_dim·ln f + 1`
    /// under YaRN (spec §1.2; transformers' `yarn_apply_mscale`).
    pub fn softmax_scale(&self) -> f32 {
        let mut scale = (self.qk_head_dim() as f64).powf(-0.5);
        if let Some(y) = &self.rope_scaling {
            if let Some(all) = y.mscale_all_dim.filter(|&m| m != 0.0) {
                let m = yarn_get_mscale(y.factor, all);
                scale *= m * m;
            }
        }
        scale as f32
    }

    /// Total parameters stored, by a count over the shapes this config implies (no MTP layer).
    pub fn parameter_counts(&self) -> ParameterCounts {
        let h = self.hidden_size;
        let n = self.num_attention_heads;
        let q = match self.q_lora_rank {
            Some(r) => h * r + r + r * n * self.qk_head_dim(),
            None => h * n * self.qk_head_dim(),
        };
        let attn = q
            + h * self.latent_cache_width()
            + self.kv_lora_rank
            + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            + n * self.v_head_dim * h
            + 2 * h;
        let mlp = |i: usize| 3 * h * i;
        let mut total = 2 * self.vocab_size * h + h;
        let mut active = total;
        for layer in 0..self.num_hidden_layers {
            total += attn;
            active += attn;
            if self.is_moe_layer(layer) {
                let e = self.n_routed_experts.unwrap_or(0);
                let router = e * h + e;
                let shared = mlp(self.moe_intermediate_size * self.n_shared_experts);
                total += router + shared + e * mlp(self.moe_intermediate_size);
                active +=
                    router + shared + self.num_experts_per_tok * mlp(self.moe_intermediate_size);
            } else {
                total += mlp(self.intermediate_size);
                active += mlp(self.intermediate_size);
            }
        }
        ParameterCounts { total, active }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct ParameterCounts {
    pub total: usize,
    /// Parameters touched per token (routed experts counted `num_experts_per_tok` times).
    pub active: usize,
}

/// The routing fields a config may leave out and the transformers defaults they take.
const DEFAULTED: &[(&str, &str)] = &[
    ("n_shared_experts", "1"),
    ("num_experts_per_tok", "8"),
    ("n_group", "8"),
    ("topk_group", "4"),
    ("routed_scaling_factor", "2.5"),
    ("first_k_dense_replace", "3"),
];

/// YaRN's magnitude correction `0.1·mscale·ln(scale) + 1` (1 for scale ≤ 1).
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

fn parse_rope(f: &Fields) -> Result<(f64, Option<YarnScaling>)> {
    // Official configs: `rope_theta` + `rope_scaling`; transformers 5 also writes
    // `rope_parameters` (which carries `rope_theta` inside).
    let (scaling_field, scaling) = match f.get("rope_scaling") {
        Some(v) => ("rope_scaling", Some(v)),
        None => ("rope_parameters", f.get("rope_parameters")),
    };
    let mut theta = f.f64_opt("rope_theta")?;
    // Both written (a re-save keeps the old field): they must say the same.
    if let (Some(Value::Object(sc)), Some(Value::Object(pa))) =
        (f.get("rope_scaling"), f.get("rope_parameters"))
    {
        let kind = |m: &Map<String, Value>| {
            m.get("rope_type")
                .or(m.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default")
                .to_string()
        };
        let num = |m: &Map<String, Value>, k: &str| m.get(k).and_then(Value::as_f64);
        let differs = if kind(sc) != kind(pa) {
            Some(format!("rope type `{}` against `{}`", kind(pa), kind(sc)))
        } else if num(pa, "factor").is_some() && num(pa, "factor") != num(sc, "factor") {
            Some(format!(
                "factor {:?} against {:?}",
                num(pa, "factor"),
                num(sc, "factor")
            ))
        } else if let (Some(a), Some(b)) = (num(pa, "rope_theta"), theta) {
            (a != b).then(|| format!("rope_theta {a} against the top level's {b}"))
        } else {
            None
        };
        if let Some(d) = differs {
            return Err(f.err(
                "rope_parameters",
                format!("disagrees with rope_scaling ({d}); keep one of the two"),
            ));
        }
    }
    let Some(scaling) = scaling else {
        return Ok((theta.unwrap_or(10000.0), None));
    };
    let Value::Object(map) = scaling else {
        return Err(f.err(
            scaling_field,
            format!("expected an object, found {scaling}"),
        ));
    };
    let prefix = format!("{scaling_field}.");
    let s = Fields {
        path: f.path,
        map,
        prefix: &prefix,
    };
    if theta.is_none() {
        theta = s.f64_opt("rope_theta")?;
    }
    let theta = theta.unwrap_or(10000.0);
    let kind = match s.str_opt("rope_type")? {
        Some(t) => t,
        None => s.str_opt("type")?.unwrap_or("default"),
    };
    match kind {
        "default" => Ok((theta, None)),
        "yarn" => {
            let factor = s
                .f64_opt("factor")?
                .ok_or_else(|| s.err("factor", "missing; YaRN needs a scaling factor"))?;
            let original = s
                .usize_opt("original_max_position_embeddings")?
                .ok_or_else(|| {
                    s.err(
                    "original_max_position_embeddings",
                    "missing; YaRN needs the pre-training context length (4096 for DeepSeek-V3)",
                )
                })?;
            // transformers treats 0/absent betas as their defaults (`or 32`, `or 1`).
            let beta_fast = s
                .f64_opt("beta_fast")?
                .filter(|&b| b != 0.0)
                .unwrap_or(32.0);
            let beta_slow = s.f64_opt("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0);
            if factor <= 0.0 {
                return Err(s.err("factor", format!("must be positive, found {factor}")));
            }
            Ok((
                theta,
                Some(YarnScaling {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast,
                    beta_slow,
                    mscale: s.f64_opt("mscale")?,
                    mscale_all_dim: s.f64_opt("mscale_all_dim")?,
                    attention_factor: s.f64_opt("attention_factor")?,
                    truncate: s.bool_or("truncate", true)?,
                }),
            ))
        }
        other => Err(s.err(
            "type",
            format!("unsupported rope scaling `{other}`; DeepSeek-V3/Kimi-K2 use `yarn`"),
        )),
    }
}

fn parse_quantization(f: &Fields) -> Result<Option<QuantizationConfig>> {
    let Some(v) = f.get("quantization_config") else {
        return Ok(None);
    };
    let Value::Object(map) = v else {
        return Err(f.err(
            "quantization_config",
            format!("expected an object, found {v}"),
        ));
    };
    let q = Fields {
        path: f.path,
        map,
        prefix: "quantization_config.",
    };
    match q.str_opt("quant_method")? {
        Some("fp8") => {
            if let Some(scheme) = q.str_opt("activation_scheme")? {
                if scheme != "dynamic" {
                    return Err(q.err(
                        "activation_scheme",
                        format!(
                            "`{scheme}` is not supported: FP8 weights multiply unquantized \
                             activations here, which stands for `dynamic` (DeepSeek's FP8 \
                             checkpoints); static activation scales are not read"
                        ),
                    ));
                }
            }
            if let Some(fmt) = q.str_opt("fmt")? {
                if fmt != "e4m3" {
                    return Err(q.err(
                        "fmt",
                        format!("unsupported FP8 format `{fmt}`; expected `e4m3`"),
                    ));
                }
            }
            let (block_rows, block_cols) = match q.get("weight_block_size") {
                None => (128, 128),
                Some(Value::Array(items)) if items.len() == 2 => {
                    let dim = |v: &Value| {
                        v.as_u64()
                            .filter(|&x| x > 0)
                            .map(|x| x as usize)
                            .ok_or_else(|| {
                                q.err(
                                    "weight_block_size",
                                    format!("expected positive integers, found {v}"),
                                )
                            })
                    };
                    (dim(&items[0])?, dim(&items[1])?)
                }
                Some(other) => {
                    return Err(q.err(
                        "weight_block_size",
                        format!("expected [rows, cols], found {other}"),
                    ))
                }
            };
            Ok(Some(QuantizationConfig::Fp8Block {
                block_rows,
                block_cols,
            }))
        }
        Some("compressed-tensors") => {
            let format = q.str_opt("format")?.unwrap_or("");
            if format != "int-quantized" && format != "pack-quantized" {
                return Err(q.err(
                    "format",
                    format!(
                        "compressed-tensors format `{format}` is not supported; \
                         `int-quantized` (W8A8, per-channel int8) and `pack-quantized` (int4 \
                         weights with bf16/f32 activations, Kimi-K2-Thinking) are"
                    ),
                ));
            }
            let ignore = match q.get("ignore") {
                None => Vec::new(),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| q.err("ignore", format!("expected strings, found {v}")))
                    })
                    .collect::<Result<_>>()?,
                Some(other) => {
                    return Err(q.err("ignore", format!("expected a list, found {other}")))
                }
            };
            if format == "pack-quantized" {
                if q.get("kv_cache_scheme").is_some_and(|v| !v.is_null()) {
                    return Err(q.err(
                        "kv_cache_scheme",
                        "an int8 KV cache with pack-quantized int4 weights is not supported; \
                         remove kv_cache_scheme (K2-Thinking has none)",
                    ));
                }
                let group_size = packed_int4_group_size(&q)?;
                return Ok(Some(QuantizationConfig::PackedInt4 { group_size, ignore }));
            }
            check_int8_groups(&q)?;
            let kv_cache_int8 = q.get("kv_cache_scheme").is_some();
            Ok(Some(QuantizationConfig::CompressedInt8 {
                ignore,
                kv_cache_int8,
            }))
        }
        Some(other) => Err(q.err(
            "quant_method",
            format!("unsupported quantization `{other}`; supported: `fp8`, `compressed-tensors`"),
        )),
        None => Err(q.err("quant_method", "missing")),
    }
}

/// An `int-quantized` config's groups describe what the loader runs (spec §4/§5.3, the W8A8
/// converter's output): 8-bit symmetric int weights with one scale per output channel, and
/// activations (when given) 8-bit int quantized per token. Absent fields are not checked.
fn check_int8_groups(q: &Fields) -> Result<()> {
    let Some(groups) = q.get("config_groups") else {
        return Ok(());
    };
    let Value::Object(groups) = groups else {
        return Err(q.err(
            "config_groups",
            format!("expected an object of quantization groups, found {groups}"),
        ));
    };
    for (name, group) in groups {
        for (part, strategies) in [
            ("weights", &["channel"][..]),
            ("input_activations", &["token"][..]),
        ] {
            let Some(args) = group.get(part).and_then(Value::as_object) else {
                continue;
            };
            let bad = |k: &str, v: &Value, want: &str| {
                q.err(
                    &format!("config_groups.{name}.{part}.{k}"),
                    format!("{v} is not supported with int-quantized; expected {want}"),
                )
            };
            if let Some(v) = args.get("num_bits").filter(|v| v.as_u64() != Some(8)) {
                return Err(bad("num_bits", v, "8"));
            }
            if let Some(v) = args.get("type").filter(|v| v.as_str() != Some("int")) {
                return Err(bad("type", v, "\"int\""));
            }
            if let Some(v) = args
                .get("symmetric")
                .filter(|v| part == "weights" && v.as_bool() == Some(false))
            {
                return Err(bad("symmetric", v, "true (no zero point)"));
            }
            if let Some(v) = args
                .get("strategy")
                .filter(|v| !v.as_str().is_some_and(|s| strategies.contains(&s)))
            {
                return Err(bad(
                    "strategy",
                    v,
                    &format!("\"{}\"", strategies.join("\" or \"")),
                ));
            }
        }
    }
    Ok(())
}

/// `bos_token_id` and every `eos_token_id` name a token of the vocabulary (an EOS outside it
/// could never stop generation): else the field and why (V3 and V4 configs).
pub(crate) fn special_ids_in_vocab(
    bos: Option<u32>,
    eos: &[u32],
    vocab_size: usize,
) -> std::result::Result<(), (&'static str, String)> {
    for (name, id) in bos
        .iter()
        .map(|&b| ("bos_token_id", b))
        .chain(eos.iter().map(|&e| ("eos_token_id", e)))
    {
        if id as usize >= vocab_size {
            let why = if name == "bos_token_id" {
                "no prompt could begin with it"
            } else {
                "generation could never stop on it"
            };
            return Err((
                name,
                format!("{id} is outside the vocabulary (vocab_size {vocab_size}); {why}"),
            ));
        }
    }
    Ok(())
}

/// The weights' group size of a `pack-quantized` config (spec §2.3: K2-Thinking has one
/// group, `targets: ["Linear"]`, weights `{num_bits: 4, type: int, symmetric: true, strategy:
/// group, group_size: 32}`, no input activations): `None` for the `channel` strategy. Every
/// group must describe the same weights: the loader tells int4 tensors by their
/// `weight_packed` name, not by matching targets.
fn packed_int4_group_size(q: &Fields) -> Result<Option<usize>> {
    // Sparse (2:4) weights are stored otherwise; a dense description, or none, is ours.
    if let Some(sp) = q.get("sparsity_config").filter(|v| !v.is_null()) {
        let format = sp.get("format").and_then(Value::as_str).unwrap_or("");
        if !format.is_empty() && format != "dense" {
            return Err(q.err(
                "sparsity_config.format",
                format!("\"{format}\"; sparse weights are not supported (dense packed int4 is)"),
            ));
        }
    }
    let groups = match q.get("config_groups") {
        Some(Value::Object(g)) if !g.is_empty() => g,
        Some(other) => {
            return Err(q.err(
                "config_groups",
                format!("expected an object of quantization groups, found {other}"),
            ))
        }
        None => return Err(q.err("config_groups", "missing (pack-quantized needs one)")),
    };
    let mut found: Option<Option<usize>> = None;
    for (name, group) in groups {
        let field = |k: &str| format!("config_groups.{name}.{k}");
        let bad = |k: &str, m: String| q.err(&field(k), m);
        let Some(w) = group.get("weights").and_then(Value::as_object) else {
            return Err(bad("weights", "missing or not an object".into()));
        };
        let bits = w.get("num_bits").and_then(Value::as_u64);
        if bits != Some(4) {
            return Err(bad(
                "weights.num_bits",
                format!(
                    "{}; pack-quantized weights are supported with 4 bits only",
                    w.get("num_bits")
                        .map_or("missing".into(), |v| v.to_string())
                ),
            ));
        }
        match w.get("type").and_then(Value::as_str) {
            None | Some("int") => {}
            Some(other) => {
                return Err(bad(
                    "weights.type",
                    format!("`{other}`; pack-quantized weights are supported as `int`"),
                ))
            }
        }
        if w.get("symmetric").and_then(Value::as_bool) == Some(false) {
            return Err(bad(
                "weights.symmetric",
                "false; only symmetric int4 weights (no zero point) are supported".into(),
            ));
        }
        if w.get("dynamic").and_then(Value::as_bool) == Some(true) {
            return Err(bad(
                "weights.dynamic",
                "true; int4 weights must be stored quantized (dynamic: false)".into(),
            ));
        }
        if group.get("input_activations").is_some_and(|a| !a.is_null()) {
            return Err(bad(
                "input_activations",
                "quantized activations with int4 weights are not supported; K2-Thinking's \
                 int4 weights take bf16 activations (input_activations: null)"
                    .into(),
            ));
        }
        let size = match w.get("strategy").and_then(Value::as_str) {
            Some("group") => match w.get("group_size").and_then(Value::as_u64) {
                Some(g) if g > 0 && g % 2 == 0 => Some(g as usize),
                _ => {
                    return Err(bad(
                        "weights.group_size",
                        format!(
                            "{}; the group strategy needs a positive even group size",
                            w.get("group_size")
                                .map_or("missing".into(), |v| v.to_string())
                        ),
                    ))
                }
            },
            Some("channel") => None,
            other => {
                return Err(bad(
                    "weights.strategy",
                    format!(
                        "{}; pack-quantized int4 weights are supported with the `group` or \
                         `channel` strategy",
                        other.map_or("missing".into(), |s| format!("`{s}`"))
                    ),
                ))
            }
        };
        if let Some(prev) = found {
            if prev != size {
                return Err(bad(
                    "weights",
                    "quantization groups with different group sizes are not supported".into(),
                ));
            }
        }
        found = Some(size);
    }
    Ok(found.flatten())
}

/// Parses `text` (the contents of `path`) as a JSON object.
pub(crate) fn json_object(text: &str, path: &Path) -> Result<Map<String, Value>> {
    let value: Value = serde_json::from_str(text).map_err(|e| ModelError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    match value {
        Value::Object(map) => Ok(map),
        _ => Err(ModelError::Json {
            path: path.to_path_buf(),
            message: "expected a JSON object at the top level".into(),
        }),
    }
}

/// Convenience for error messages that point at a model directory's config.
pub fn config_path(dir: &Path) -> PathBuf {
    dir.join("config.json")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r1_json() -> Value {
        serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
            "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "norm_topk_prob": true, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
            "moe_layer_freq": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "max_position_embeddings": 163840, "num_nextn_predict_layers": 1,
            "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                "quant_method": "fp8", "weight_block_size": [128, 128]}
        })
    }

    fn parse(v: &Value) -> Result<DeepseekV3Config> {
        DeepseekV3Config::from_json_str(&v.to_string(), Path::new("config.json"))
    }

    #[test]
    fn r1_constants() {
        let c = parse(&r1_json()).unwrap();
        assert_eq!(c.model_type, ModelType::DeepseekV3);
        assert!((c.softmax_scale() - 0.135_233_78).abs() < 1e-7);
        assert!(!c.is_moe_layer(2) && c.is_moe_layer(3) && c.is_moe_layer(61));
        assert_eq!(c.latent_cache_width(), 576);
        assert_eq!(
            c.quantization,
            Some(QuantizationConfig::Fp8Block {
                block_rows: 128,
                block_cols: 128
            })
        );
        let p = c.parameter_counts();
        // DeepSeek-V3: 671 B total without MTP, 37 B activated.
        assert!((p.total as f64 / 1e9 - 671.0).abs() < 2.0, "{}", p.total);
        assert!((p.active as f64 / 1e9 - 37.5).abs() < 1.5, "{}", p.active);
    }

    /// Routing fields a config leaves out take transformers' defaults (named when a check
    /// then refuses them); rope_scaling and rope_parameters that disagree are refused.
    #[test]
    fn missing_routing_fields_take_transformers_defaults() {
        let mut v = r1_json();
        let o = v.as_object_mut().unwrap();
        for k in [
            "n_group",
            "topk_group",
            "routed_scaling_factor",
            "first_k_dense_replace",
        ] {
            o.remove(k);
        }
        let c = parse(&v).unwrap();
        assert_eq!((c.n_group, c.topk_group), (8, 4));
        assert_eq!((c.routed_scaling_factor, c.first_k_dense_replace), (2.5, 3));
        v["n_routed_experts"] = 12.into();
        let e = parse(&v).unwrap_err().to_string();
        assert!(
            e.contains("n_group") && e.contains("transformers' default 8"),
            "{e}"
        );
        let mut v = r1_json();
        v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e6});
        let e = parse(&v).unwrap_err().to_string();
        assert!(
            e.contains("rope_parameters") && e.contains("disagrees"),
            "{e}"
        );
    }

    #[test]
    fn k2_thinking_pack_quantized_int4() {
        let mut v = r1_json();
        v["model_type"] = "kimi_k2".into();
        v["quantization_config"] = serde_json::json!({
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": null,
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
                "output_activations": null,
                "weights": {"num_bits": 4, "type": "int", "symmetric": true,
                    "strategy": "group", "group_size": 32, "dynamic": false, "actorder": null}}},
            "ignore": ["lm_head", "re:.*self_attn.*"]
        });
        let c = parse(&v).unwrap();
        assert_eq!(
            c.quantization,
            Some(QuantizationConfig::PackedInt4 {
                group_size: Some(32),
                ignore: vec!["lm_head".into(), "re:.*self_attn.*".into()],
            })
        );
        let w = &mut v["quantization_config"]["config_groups"]["group_0"]["weights"];
        w["strategy"] = "channel".into();
        let c = parse(&v).unwrap();
        assert!(matches!(
            c.quantization,
            Some(QuantizationConfig::PackedInt4 {
                group_size: None,
                ..
            })
        ));
        v["quantization_config"]["config_groups"]["group_0"]["input_activations"] =
            serde_json::json!({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": true});
        let e = parse(&v).unwrap_err().to_string();
        assert!(
            e.contains("quantization_config.config_groups.group_0.input_activations"),
            "{e}"
        );
    }

    #[test]
    fn kimi_and_null_q_lora() {
        let mut v = r1_json();
        v["model_type"] = "kimi_k2".into();
        v["q_lora_rank"] = Value::Null;
        v["n_group"] = 1.into();
        v["topk_group"] = 1.into();
        v["eos_token_id"] = serde_json::json!([163585, 163586]);
        v["vocab_size"] = 163840.into();
        let c = parse(&v).unwrap();
        assert_eq!(c.model_type, ModelType::KimiK2);
        assert_eq!(c.q_lora_rank, None);
        assert_eq!(c.eos_token_ids, vec![163585, 163586]);
    }

    #[test]
    fn bad_fields_are_named() {
        for (field, value, expect) in [
            ("model_type", Value::from("llama"), "model_type"),
            ("topk_method", Value::from("greedy"), "topk_method"),
            ("scoring_func", Value::from("softmax"), "scoring_func"),
            ("hidden_size", Value::from("big"), "hidden_size"),
            ("n_group", Value::from(3), "n_group"),
            ("num_experts_per_tok", Value::from(0), "num_experts_per_tok"),
            (
                "moe_intermediate_size",
                Value::from(0),
                "moe_intermediate_size",
            ),
        ] {
            let mut v = r1_json();
            v[field] = value;
            let e = parse(&v).unwrap_err().to_string();
            assert!(e.contains(expect), "{e}");
            assert!(e.contains("config.json"), "{e}");
        }
        let mut v = r1_json();
        v["rope_scaling"]["type"] = "ntk".into();
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("rope_scaling.type"), "{e}");
        let mut v = r1_json();
        v.as_object_mut().unwrap().remove("kv_lora_rank");
        assert!(parse(&v).unwrap_err().to_string().contains("kv_lora_rank"));
    }

    #[test]
    fn out_of_range_sizes_are_named() {
        // Values that would overflow sizes, exhaust memory or make the parser scan for ages.
        for (field, value) in [
            ("num_hidden_layers", Value::from(1_000_000_000_000u64)),
            ("num_nextn_predict_layers", Value::from(1_000_000_000u64)),
            ("vocab_size", Value::from(12_928_000_000u64)),
            ("hidden_size", Value::from(1u64 << 40)),
            ("n_routed_experts", Value::from(1u64 << 30)),
        ] {
            let mut v = r1_json();
            v[field] = value;
            let e = parse(&v).unwrap_err().to_string();
            assert!(
                e.contains(&format!("`{field}`")) && e.contains("out of range"),
                "{field}: {e}"
            );
        }
    }

    #[test]
    fn integers_written_as_floats_are_taken() {
        let mut v = r1_json();
        v["rope_scaling"]["original_max_position_embeddings"] = Value::from(4096.0);
        v["num_hidden_layers"] = Value::from(61.0);
        let c = parse(&v).unwrap();
        assert_eq!(c.num_hidden_layers, 61);
        assert_eq!(
            c.rope_scaling.unwrap().original_max_position_embeddings,
            4096
        );
        for bad in [Value::from(61.5), Value::from(-1.0)] {
            v["num_hidden_layers"] = bad;
            let e = parse(&v).unwrap_err().to_string();
            assert!(e.contains("non-negative integer"), "{e}");
        }
    }

    #[test]
    fn an_mtp_only_moe_layer_gets_the_routing_checks() {
        // Every main layer dense: the MTP layer is still MoE, so its routing settings count.
        let mut v = r1_json();
        v["first_k_dense_replace"] = Value::from(100);
        v["num_experts_per_tok"] = Value::from(1000);
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("num_experts_per_tok"), "{e}");
        v["num_nextn_predict_layers"] = Value::from(0);
        parse(&v).expect("no MoE layer at all: the routing settings are unused");
    }
}
