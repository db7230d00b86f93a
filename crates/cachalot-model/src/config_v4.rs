//! `config.json` of DeepSeek-V4 (Flash / Pro) checkpoints, and the family detector that tells a
//! V3-style directory from a V4 one.
//!
//! Spec: `shared/specs/deepseek-v4.md` §1.1 (fields and values), §1.2 (the seed's
//! `convert_config` rewrite of `quantization_config` to compressed-tensors), §4.7 (trust tensor
//! dtypes, not the config). Field names are DeepSeek's official ones (`compress_ratios`,
//! `num_hash_layers`, `rope_scaling`, `qk_rope_head_dim`). Unknown extra fields are ignored; a
//! field with the wrong type or an unsupported value is an error naming the field. An optional
//! field left out takes transformers' `DeepseekV4Config` default (`sliding_window` 128,
//! `index_topk` 512, `hc_mult` 4, `scoring_func` sqrtsoftplus, `num_hash_layers` 3 or the
//! model's layers where fewer, `routed_scaling_factor` 1.5, `swiglu_limit` 10,
//! `num_nextn_predict_layers` 1), so a checkpoint reads as transformers reads it.

use std::path::Path;

use serde_json::Value;

use crate::config::{json_object, Fields, MAX_DIM, MAX_LAYERS, MAX_MTP_LAYERS};
use crate::error::{ModelError, Result};

/// Which forward pass a model directory needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFamily {
    /// DeepSeek-V3/R1 and Kimi-K2 (`model_type` `deepseek_v3` / `kimi_k2`): [`crate::DeepseekV3`].
    DeepseekV3,
    /// DeepSeek-V4 Flash / Pro (`model_type` `deepseek_v4`): [`crate::DeepseekV4`].
    DeepseekV4,
}

/// Reads `<dir>/config.json` far enough to tell the family: `model_type` first, then
/// `architectures`.
pub fn detect_family(dir: &Path) -> Result<ModelFamily> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
        path: path.clone(),
        error: source,
    })?;
    family_from_json_str(&text, &path)
}

pub fn family_from_json_str(text: &str, path: &Path) -> Result<ModelFamily> {
    let value = Value::Object(json_object(text, path)?);
    let err = |field: &str, message: String| ModelError::Config {
        path: path.to_path_buf(),
        field: field.into(),
        message,
    };
    if let Some(mt) = value.get("model_type").and_then(Value::as_str) {
        return match mt {
            "deepseek_v3" | "kimi_k2" => Ok(ModelFamily::DeepseekV3),
            "deepseek_v4" => Ok(ModelFamily::DeepseekV4),
            other => Err(err(
                "model_type",
                format!(
                    "unsupported model type `{other}`; supported: `deepseek_v3`, `kimi_k2`, \
                     `deepseek_v4`"
                ),
            )),
        };
    }
    let archs: Vec<&str> = value
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for a in &archs {
        match *a {
            "DeepseekV3ForCausalLM" | "KimiK2ForCausalLM" => return Ok(ModelFamily::DeepseekV3),
            "DeepseekV4ForCausalLM" => return Ok(ModelFamily::DeepseekV4),
            _ => {}
        }
    }
    Err(err(
        "model_type",
        format!(
            "missing, and `architectures` {archs:?} names no supported model; expected \
             `model_type` `deepseek_v3`, `kimi_k2` or `deepseek_v4`"
        ),
    ))
}

/// YaRN for the compressed layers (spec §2.5): `rope_scaling` `{type: yarn, factor,
/// original_max_position_embeddings, beta_fast, beta_slow}`.
#[derive(Clone, Debug, PartialEq)]
pub struct V4Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// Router scoring (spec §2.9; [REF] `Gate` also knows `softmax` and `sigmoid`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoringFunc {
    SqrtSoftplus,
    Sigmoid,
    Softmax,
}

/// What `quantization_config` declares. Informational: the loader dispatches on tensor dtypes
/// (spec §4.7), since `convert_model --quant_type bfloat16` keeps the fp8 block (§4.2).
#[derive(Clone, Debug, PartialEq)]
pub enum V4Quantization {
    /// The native release: FP8 e4m3 with ue8m0 128×128 scales, MXFP4 experts.
    Fp8 {
        block_rows: usize,
        block_cols: usize,
    },
    /// The seed's `convert_config` / `convert_model` rewrite (§1.2, §4.2).
    CompressedTensors { format: String },
}

#[derive(Clone, Debug)]
pub struct DeepseekV4Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub q_lora_rank: usize,
    pub o_lora_rank: usize,
    pub o_groups: usize,
    pub sliding_window: usize,
    /// One ratio per main layer then per MTP layer (entries past those are ignored, §1.1).
    pub compress_ratios: Vec<usize>,
    pub compress_rope_theta: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<V4Yarn>,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub scoring_func: ScoringFunc,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    /// 0 = no clamp.
    pub swiglu_limit: f32,
    pub num_hash_layers: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub num_nextn_predict_layers: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub quantization: Option<V4Quantization>,
}

impl DeepseekV4Config {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            error: source,
        })?;
        Self::from_json_str(&text, &path)
    }

    /// Parses and validates; `path` is used in error messages only.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let map = json_object(text, path)?;
        let f = Fields {
            path,
            map: &map,
            prefix: "",
        };
        if family_from_json_str(text, path)? != ModelFamily::DeepseekV4 {
            return Err(f.err(
                "model_type",
                "describes a DeepSeek-V3-family model; load it with DeepseekV3",
            ));
        }
        let scoring_func = match f.str_opt("scoring_func")? {
            None | Some("sqrtsoftplus") => ScoringFunc::SqrtSoftplus,
            Some("sigmoid") => ScoringFunc::Sigmoid,
            Some("softmax") => ScoringFunc::Softmax,
            Some(other) => {
                return Err(f.err(
                    "scoring_func",
                    format!(
                        "unsupported scoring `{other}`; expected `sqrtsoftplus`, `sigmoid` or \
                         `softmax`"
                    ),
                ))
            }
        };
        match f.str_opt("topk_method")? {
            None | Some("noaux_tc") => {}
            Some(other) => {
                return Err(f.err(
                    "topk_method",
                    format!("unsupported routing `{other}`; V4 uses `noaux_tc` without groups"),
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
        let compress_ratios = match f.get("compress_ratios") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().map(|x| x as usize).ok_or_else(|| {
                        f.err(
                            "compress_ratios",
                            format!("expected non-negative integers, found {v}"),
                        )
                    })
                })
                .collect::<Result<Vec<_>>>()?,
            Some(other) => {
                return Err(f.err(
                    "compress_ratios",
                    format!("expected a list of per-layer ratios, found {other}"),
                ))
            }
            None => {
                return Err(f.err(
                    "compress_ratios",
                    "missing; V4 needs one ratio per layer (0 for a window-only layer, else a \
                     compression ratio of at least 2: DeepSeek's releases use 4 and 128)",
                ))
            }
        };
        // `rope_scaling`, or transformers 5's `rope_parameters` of the same fields (with
        // `rope_theta` inside when the top level has none).
        let (rope_field, rope_prefix, rope_value) = match f.get("rope_scaling") {
            Some(v) => ("rope_scaling", "rope_scaling.", Some(v)),
            None => (
                "rope_parameters",
                "rope_parameters.",
                f.get("rope_parameters"),
            ),
        };
        let mut inner_theta = None;
        let rope_scaling = match rope_value {
            None => None,
            Some(Value::Object(m)) => {
                let r = Fields {
                    path,
                    map: m,
                    prefix: rope_prefix,
                };
                if rope_field == "rope_parameters" {
                    inner_theta = r.f64_opt("rope_theta")?;
                }
                let kind = r.str_opt("type")?.or(r.str_opt("rope_type")?);
                match kind {
                    Some("yarn") => {}
                    Some("default") | None => {}
                    Some(other) => {
                        return Err(r.err(
                            "type",
                            format!("unsupported rope scaling `{other}`; V4 uses `yarn`"),
                        ))
                    }
                }
                if kind == Some("yarn") {
                    Some(V4Yarn {
                        factor: r
                            .f64_opt("factor")?
                            .ok_or_else(|| r.err("factor", "missing"))?,
                        original_max_position_embeddings: r
                            .usize_req("original_max_position_embeddings")?,
                        beta_fast: r.f64_or("beta_fast", 32.0)?,
                        beta_slow: r.f64_or("beta_slow", 1.0)?,
                    })
                } else {
                    None
                }
            }
            Some(other) => {
                return Err(f.err(rope_field, format!("expected an object, found {other}")))
            }
        };
        if f.map.get("sliding_window").is_some_and(Value::is_null) {
            return Err(f.err(
                "sliding_window",
                "null; V4 attends to a window of this many positions (128 in its release)",
            ));
        }
        let quantization = match f.get("quantization_config") {
            None => None,
            Some(Value::Object(m)) => {
                let q = Fields {
                    path,
                    map: m,
                    prefix: "quantization_config.",
                };
                match q.str_opt("quant_method")? {
                    Some("fp8") => {
                        let block = match q.get("weight_block_size") {
                            None => (128, 128),
                            Some(Value::Array(a))
                                if a.len() == 2
                                    && a.iter().all(|v| v.as_u64().is_some_and(|x| x > 0)) =>
                            {
                                (
                                    a[0].as_u64().unwrap_or(128) as usize,
                                    a[1].as_u64().unwrap_or(128) as usize,
                                )
                            }
                            Some(other) => {
                                return Err(q.err(
                                    "weight_block_size",
                                    format!("expected [rows, cols], found {other}"),
                                ))
                            }
                        };
                        Some(V4Quantization::Fp8 {
                            block_rows: block.0,
                            block_cols: block.1,
                        })
                    }
                    Some("compressed-tensors") => Some(V4Quantization::CompressedTensors {
                        format: q.str_opt("format")?.unwrap_or("").to_string(),
                    }),
                    Some(other) => {
                        return Err(q.err(
                            "quant_method",
                            format!(
                                "unsupported quantization `{other}`; expected `fp8` (the native \
                                 release) or `compressed-tensors` (the seed's conversion)"
                            ),
                        ))
                    }
                    None => return Err(q.err("quant_method", "missing")),
                }
            }
            Some(other) => {
                return Err(f.err(
                    "quantization_config",
                    format!("expected an object, found {other}"),
                ))
            }
        };
        let head_dim = f.usize_req("head_dim")?;
        let cfg = DeepseekV4Config {
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size: f.usize_req("hidden_size")?,
            num_hidden_layers: f.usize_req("num_hidden_layers")?,
            num_attention_heads: f.usize_req("num_attention_heads")?,
            head_dim,
            qk_rope_head_dim: f.usize_or("qk_rope_head_dim", 64)?,
            q_lora_rank: f.usize_req("q_lora_rank")?,
            o_lora_rank: f.usize_req("o_lora_rank")?,
            o_groups: f.usize_req("o_groups")?,
            sliding_window: f.usize_or("sliding_window", 128)?,
            compress_ratios,
            compress_rope_theta: f.f64_or("compress_rope_theta", 160000.0)?,
            rope_theta: match f.f64_opt("rope_theta")? {
                Some(t) => t,
                None => inner_theta.unwrap_or(10000.0),
            },
            rope_scaling,
            max_position_embeddings: f.usize_or("max_position_embeddings", 1 << 20)?,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)? as f32,
            n_routed_experts: f.usize_req("n_routed_experts")?,
            n_shared_experts: f.usize_or("n_shared_experts", 1)?,
            num_experts_per_tok: f.usize_req("num_experts_per_tok")?,
            moe_intermediate_size: f.usize_req("moe_intermediate_size")?,
            scoring_func,
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            routed_scaling_factor: f.f64_or("routed_scaling_factor", 1.5)? as f32,
            swiglu_limit: f.f64_or("swiglu_limit", 10.0)? as f32,
            // transformers' default: the first 3 layers hash-routed (as many as there are).
            num_hash_layers: match f.usize_opt("num_hash_layers")? {
                Some(n) => n,
                None => 3.min(f.usize_req("num_hidden_layers")?),
            },
            index_n_heads: f.usize_or("index_n_heads", 64)?,
            index_head_dim: f.usize_or("index_head_dim", 128)?,
            index_topk: f.usize_or("index_topk", 512)?,
            hc_mult: f.usize_or("hc_mult", 4)?,
            hc_sinkhorn_iters: f.usize_or("hc_sinkhorn_iters", 20)?,
            hc_eps: f.f64_or("hc_eps", 1e-6)? as f32,
            num_nextn_predict_layers: f.usize_or("num_nextn_predict_layers", 1)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
            quantization,
        };
        cfg.validate(&f)?;
        Ok(cfg)
    }

    fn validate(&self, f: &Fields) -> Result<()> {
        crate::config::special_ids_in_vocab(
            self.bos_token_id,
            &self.eos_token_ids,
            self.vocab_size,
        )
        .map_err(|(field, message)| f.err(field, message))?;
        // V4's attention has one shared key/value head (MQA, spec §2); the tensors are shaped
        // for one.
        if let Some(kv) = f.usize_opt("num_key_value_heads")? {
            if kv != 1 {
                return Err(f.err(
                    "num_key_value_heads",
                    format!("{kv}; DeepSeek-V4 attention has one key/value head"),
                ));
            }
        }
        // Float fields that would turn activations into NaN or ±∞ rather than fail.
        for (name, v, ok, what) in [
            (
                "rms_norm_eps",
                self.rms_norm_eps as f64,
                (0.0..=1.0).contains(&(self.rms_norm_eps as f64)),
                "expected a small non-negative number (1e-6 in DeepSeek-V4)",
            ),
            (
                "hc_eps",
                self.hc_eps as f64,
                (0.0..=1.0).contains(&(self.hc_eps as f64)),
                "expected a small non-negative number (1e-6 in DeepSeek-V4)",
            ),
            (
                "rope_theta",
                self.rope_theta,
                self.rope_theta > 1.0,
                "expected a base above 1 (10000 in DeepSeek-V4)",
            ),
            (
                "compress_rope_theta",
                self.compress_rope_theta,
                self.compress_rope_theta > 1.0,
                "expected a base above 1 (160000 in DeepSeek-V4)",
            ),
            (
                "routed_scaling_factor",
                self.routed_scaling_factor as f64,
                self.routed_scaling_factor > 0.0 && self.routed_scaling_factor <= 1e6,
                "expected a positive number (1.5 in DeepSeek-V4)",
            ),
            (
                "swiglu_limit",
                self.swiglu_limit as f64,
                self.swiglu_limit >= 0.0,
                "expected 0 (no limit) or a positive clamp (10 in DeepSeek-V4)",
            ),
        ] {
            if !v.is_finite() || !ok {
                return Err(f.err(name, format!("{v} is out of range: {what}")));
            }
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("head_dim", self.head_dim),
            ("q_lora_rank", self.q_lora_rank),
            ("o_lora_rank", self.o_lora_rank),
            ("o_groups", self.o_groups),
            ("sliding_window", self.sliding_window),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("hc_mult", self.hc_mult),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(f.err(name, "must be positive"));
            }
        }
        // Upper bounds far above any released model (see `config::MAX_DIM`): sizes multiplied
        // from them cannot overflow, and a mistyped value is named here.
        let bounded = [
            ("vocab_size", self.vocab_size, MAX_DIM),
            ("hidden_size", self.hidden_size, MAX_DIM),
            ("num_attention_heads", self.num_attention_heads, MAX_DIM),
            ("head_dim", self.head_dim, MAX_DIM),
            ("q_lora_rank", self.q_lora_rank, MAX_DIM),
            ("o_lora_rank", self.o_lora_rank, MAX_DIM),
            ("n_routed_experts", self.n_routed_experts, MAX_DIM),
            ("moe_intermediate_size", self.moe_intermediate_size, MAX_DIM),
            ("index_n_heads", self.index_n_heads, MAX_DIM),
            ("index_head_dim", self.index_head_dim, MAX_DIM),
            ("index_topk", self.index_topk, MAX_DIM),
            ("hc_mult", self.hc_mult, 64),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_DIM,
            ),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            (
                "num_nextn_predict_layers",
                self.num_nextn_predict_layers,
                MAX_MTP_LAYERS,
            ),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters, 10_000),
        ];
        for (name, v, max) in bounded {
            if v > max {
                return Err(f.err(
                    name,
                    format!("{v} is out of range (at most {max}); check the value"),
                ));
            }
        }
        if self.sliding_window > self.max_position_embeddings {
            return Err(f.err(
                "sliding_window",
                format!(
                    "{} is more than max_position_embeddings {}: one of the two is wrong",
                    self.sliding_window, self.max_position_embeddings
                ),
            ));
        }
        if self.qk_rope_head_dim == 0
            || !self.qk_rope_head_dim.is_multiple_of(2)
            || self.qk_rope_head_dim > self.head_dim
        {
            return Err(f.err(
                "qk_rope_head_dim",
                format!(
                    "{} must be even, positive and at most head_dim {}",
                    self.qk_rope_head_dim, self.head_dim
                ),
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.o_groups) {
            return Err(f.err(
                "o_groups",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.o_groups, self.num_attention_heads
                ),
            ));
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return Err(f.err(
                "num_experts_per_tok",
                format!(
                    "{} exceeds n_routed_experts {}",
                    self.num_experts_per_tok, self.n_routed_experts
                ),
            ));
        }
        if self.n_shared_experts != 1 {
            return Err(f.err(
                "n_shared_experts",
                format!(
                    "{}; DeepSeek-V4 has exactly one shared expert",
                    self.n_shared_experts
                ),
            ));
        }
        if self.compress_ratios.len() < self.num_hidden_layers {
            return Err(f.err(
                "compress_ratios",
                format!(
                    "has {} entries for {} layers; one per layer (then one per MTP layer) is needed",
                    self.compress_ratios.len(),
                    self.num_hidden_layers
                ),
            ));
        }
        if let Some((i, r)) = self
            .compress_ratios
            .iter()
            .enumerate()
            .find(|(_, &r)| r == 1)
        {
            return Err(f.err(
                &format!("compress_ratios[{i}]"),
                format!("ratio {r}: use 0 for a window-only layer, or a ratio of at least 2"),
            ));
        }
        if self.has_indexer() {
            let di = self.index_head_dim;
            if self.index_n_heads == 0 || self.index_topk == 0 {
                return Err(f.err(
                    if self.index_n_heads == 0 {
                        "index_n_heads"
                    } else {
                        "index_topk"
                    },
                    "index_n_heads and index_topk must be positive for ratio-4 layers",
                ));
            }
            if !di.is_power_of_two() || di < self.qk_rope_head_dim {
                return Err(f.err(
                    "index_head_dim",
                    format!(
                        "{di} must be a power of two (Hadamard) and at least qk_rope_head_dim {}",
                        self.qk_rope_head_dim
                    ),
                ));
            }
        }
        if let Some(y) = &self.rope_scaling {
            if y.factor.is_nan() || y.factor <= 0.0 || y.original_max_position_embeddings == 0 {
                return Err(f.err(
                    "rope_scaling",
                    "factor and original_max_position_embeddings must be positive",
                ));
            }
        }
        if self.num_hash_layers > self.num_hidden_layers {
            return Err(f.err(
                "num_hash_layers",
                format!(
                    "{} exceeds num_hidden_layers {}",
                    self.num_hash_layers, self.num_hidden_layers
                ),
            ));
        }
        Ok(())
    }

    /// Ratio of main layer `i` or MTP layer `num_hidden_layers + j` (0 = window only). MTP layers
    /// missing from the list are window-only (as in every released config).
    pub fn compress_ratio(&self, layer: usize) -> usize {
        self.compress_ratios.get(layer).copied().unwrap_or(0)
    }

    /// A ratio-4 layer (main or MTP: the list's entries past `num_hidden_layers` are the MTP
    /// layers') has the indexer.
    fn has_indexer(&self) -> bool {
        let used = (self.num_hidden_layers + self.num_nextn_predict_layers)
            .min(self.compress_ratios.len());
        self.compress_ratios[..used].contains(&4)
    }

    /// Hash-routed (`tid2eid`) layers: main layers below `num_hash_layers`; never MTP.
    pub fn is_hash_layer(&self, layer: usize) -> bool {
        layer < self.num_hash_layers && layer < self.num_hidden_layers
    }

    pub fn nope_dim(&self) -> usize {
        self.head_dim - self.qk_rope_head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flash_json() -> Value {
        let mut ratios = vec![0, 0];
        for _ in 0..20 {
            ratios.extend([4, 128]);
        }
        ratios.extend([4, 0]);
        let mut v = serde_json::json!({
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
            "num_nextn_predict_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 1,
            "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024,
            "o_groups": 8, "sliding_window": 128, "compress_ratios": ratios,
            "compress_rope_theta": 160000, "rope_theta": 10000,
            "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "n_routed_experts": 256,
            "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048
        });
        let more = serde_json::json!({
            "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": true,
            "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3,
            "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
            "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "expert_dtype": "fp4",
            "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": false, "hidden_act": "silu"
        });
        for (key, val) in more.as_object().unwrap() {
            v[key] = val.clone();
        }
        v["rope_scaling"] = serde_json::json!({"type": "yarn", "factor": 16,
            "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1});
        v["quantization_config"] = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
            "scale_fmt": "ue8m0", "activation_scheme": "dynamic", "weight_block_size": [128, 128]});
        v
    }

    fn parse(v: &Value) -> Result<DeepseekV4Config> {
        DeepseekV4Config::from_json_str(&v.to_string(), Path::new("config.json"))
    }

    /// transformers 5's `rope_parameters` (rope_theta inside) reads as `rope_scaling` does;
    /// a null `sliding_window` is refused.
    #[test]
    fn rope_parameters_and_a_null_window() {
        let base = parse(&flash_json()).unwrap();
        let mut v = flash_json();
        let o = v.as_object_mut().unwrap();
        let mut rp = o.remove("rope_scaling").unwrap();
        rp["rope_type"] = rp["type"].take();
        rp["rope_theta"] = o.remove("rope_theta").unwrap();
        o.insert("rope_parameters".into(), rp);
        let c = parse(&v).unwrap();
        assert_eq!(c.rope_scaling, base.rope_scaling);
        assert_eq!(c.rope_theta, base.rope_theta);
        assert!(c.rope_scaling.is_some());
        let mut v = flash_json();
        v["sliding_window"] = Value::Null;
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("sliding_window"), "{e}");
    }

    /// The cache widths docs/ARCHITECTURE.md gives for Flash's shapes: 3712 f32 per token and
    /// layer in the full layout (653 KB per token over 44 cache layers), 160 in the compact one
    /// (28 KB), and a state slot of 221 184 f32 per layer (38.9 MB per sequence).
    #[test]
    fn flash_cache_sizes() {
        use crate::deepseek_v4::{RingLayout, SlotLayout};
        let c = parse(&flash_json()).unwrap();
        let layers = c.num_hidden_layers + 1;
        let max = |f: &dyn Fn(usize) -> usize| (0..layers).map(|l| f(c.compress_ratio(l))).max();
        let full = max(&|r| SlotLayout::for_ratio(&c, r).width).unwrap();
        let compact = max(&|r| RingLayout::for_ratio(&c, r).token_width()).unwrap();
        let state = max(&|r| RingLayout::for_ratio(&c, r).state_width(c.head_dim)).unwrap();
        assert_eq!((full, compact, state), (3712, 160, 221_184));
        assert_eq!(layers * full * 4, 653_312);
        assert_eq!(layers * compact * 4, 28_160);
        assert_eq!(layers * state * 4, 38_928_384);
        // fp8: a ratio-4 entry (448 e4m3 + 7 scales + 64 bf16) and its key (128 + 4) over
        // 4 slots; the rings in bf16.
        let codec = crate::v4_ops::Fp8Codec {
            nope: c.nope_dim(),
            rope: c.qk_rope_head_dim,
            index: c.index_head_dim,
        };
        let fp8 = max(&|r| RingLayout::for_ratio(&c, r).fp8_token_bytes(&codec, c.head_dim));
        assert_eq!(fp8, Some((583 + 132usize).div_ceil(4)));
        assert_eq!(layers * fp8.unwrap(), 7_876);
        assert_eq!(layers * state * 2, 19_464_192);
    }

    #[test]
    fn flash_config_parses() {
        let c = parse(&flash_json()).unwrap();
        assert_eq!(c.compress_ratios.len(), 44);
        assert_eq!(c.compress_ratio(43), 0);
        assert_eq!(c.compress_ratio(2), 4);
        assert_eq!(c.compress_ratio(3), 128);
        assert!(c.is_hash_layer(2) && !c.is_hash_layer(3) && !c.is_hash_layer(43));
        assert_eq!(c.nope_dim(), 448);
        assert_eq!(c.scoring_func, ScoringFunc::SqrtSoftplus);
        assert_eq!(
            c.quantization,
            Some(V4Quantization::Fp8 {
                block_rows: 128,
                block_cols: 128
            })
        );
        assert_eq!(c.rope_scaling.as_ref().unwrap().factor, 16.0);
    }

    #[test]
    fn compressed_tensors_rewrite_is_accepted() {
        let mut v = flash_json();
        v["quantization_config"] = serde_json::json!({
            "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "format": "float-quantized", "config_groups": {}, "ignore": ["head"]
        });
        let c = parse(&v).unwrap();
        assert!(matches!(
            c.quantization,
            Some(V4Quantization::CompressedTensors { .. })
        ));
    }

    #[test]
    fn bad_fields_are_named() {
        let cases: Vec<(&str, Value, &str)> = vec![
            ("compress_ratios", Value::Null, "compress_ratios"),
            (
                "compress_ratios",
                serde_json::json!([0, 0, 4]),
                "compress_ratios",
            ),
            ("compress_ratios", serde_json::json!("x"), "compress_ratios"),
            ("o_groups", serde_json::json!(7), "o_groups"),
            ("index_topk", serde_json::json!(0), "index_topk"),
            ("n_shared_experts", serde_json::json!(2), "n_shared_experts"),
            ("scoring_func", serde_json::json!("relu"), "scoring_func"),
            ("index_head_dim", serde_json::json!(96), "index_head_dim"),
            (
                "qk_rope_head_dim",
                serde_json::json!(63),
                "qk_rope_head_dim",
            ),
            ("hidden_size", serde_json::json!("big"), "hidden_size"),
            (
                "quantization_config",
                serde_json::json!({"quant_method": "gptq"}),
                "quantization_config.quant_method",
            ),
            (
                "rope_scaling",
                serde_json::json!({"type": "yarn", "factor": 16}),
                "rope_scaling.original_max_position_embeddings",
            ),
        ];
        for (key, val, field) in cases {
            let mut v = flash_json();
            if val.is_null() {
                v.as_object_mut().unwrap().remove(key);
            } else {
                v[key] = val;
            }
            let e = parse(&v).unwrap_err().to_string();
            assert!(e.contains(&format!("`{field}`")), "{key}: {e}");
        }
        let mut v = flash_json();
        v["compress_ratios"][5] = serde_json::json!(1);
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("compress_ratios[5]"), "{e}");
    }

    #[test]
    fn out_of_range_sizes_are_named() {
        for (key, val) in [
            ("sliding_window", serde_json::json!(100_000_000_000u64)),
            (
                "hc_sinkhorn_iters",
                serde_json::json!(1_000_000_000_000_000u64),
            ),
            ("num_hidden_layers", serde_json::json!(1_000_000_000_000u64)),
            (
                "num_nextn_predict_layers",
                serde_json::json!(1_000_000_000u64),
            ),
            ("vocab_size", serde_json::json!(1u64 << 40)),
        ] {
            let mut v = flash_json();
            v[key] = val;
            let e = parse(&v).unwrap_err().to_string();
            assert!(
                e.contains(&format!("`{key}`"))
                    && (e.contains("out of range") || e.contains("max_position_embeddings")),
                "{key}: {e}"
            );
        }
        // num_hash_layers left out: transformers' 3, or every layer of a shallower model.
        let mut v = flash_json();
        v.as_object_mut().unwrap().remove("num_hash_layers");
        assert_eq!(parse(&v).unwrap().num_hash_layers, 3);
        v["num_hidden_layers"] = 2.into();
        assert_eq!(parse(&v).unwrap().num_hash_layers, 2);
        v["q_lora_rank"] = serde_json::Value::Null;
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("`q_lora_rank`") && e.contains("null"), "{e}");
    }

    #[test]
    fn an_mtp_indexer_needs_valid_index_settings() {
        // The main layers have no ratio-4 layer; the MTP layer (the list's last entry) has.
        let mut v = flash_json();
        let n = v["num_hidden_layers"].as_u64().unwrap() as usize;
        let mut ratios = vec![serde_json::json!(0); n];
        ratios.push(serde_json::json!(4));
        v["compress_ratios"] = Value::from(ratios);
        v["num_nextn_predict_layers"] = serde_json::json!(1);
        v["index_head_dim"] = serde_json::json!(96);
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("`index_head_dim`"), "{e}");
        v["index_head_dim"] = serde_json::json!(128);
        parse(&v).expect("valid index settings");
    }

    #[test]
    fn family_detection() {
        let p = Path::new("config.json");
        let f = |s: &str| family_from_json_str(s, p);
        assert_eq!(
            f(r#"{"model_type":"deepseek_v4"}"#).unwrap(),
            ModelFamily::DeepseekV4
        );
        assert_eq!(
            f(r#"{"model_type":"kimi_k2"}"#).unwrap(),
            ModelFamily::DeepseekV3
        );
        assert_eq!(
            f(r#"{"architectures":["DeepseekV4ForCausalLM"]}"#).unwrap(),
            ModelFamily::DeepseekV4
        );
        assert!(f(r#"{"model_type":"llama"}"#)
            .unwrap_err()
            .to_string()
            .contains("`model_type`"));
        assert!(f(r#"{}"#).is_err());
        let v3 = parse(&serde_json::json!({"model_type": "deepseek_v3"}));
        assert!(v3.unwrap_err().to_string().contains("DeepseekV3"));
    }
}
