//! Random-weight DeepSeek-V3-shaped checkpoints for `cachalot bench --random-weights` and for
//! offline runs with `with_ckpt: false`, so large shapes can be timed without a download.
//!
//! The same recipe as `tools/random_checkpoint.py` (which documents it in full), ported so the
//! bench needs no Python: the DeepSeek-R1 release layout of spec
//! `shared/specs/deepseek-v3-r1-kimi-k2.md` §2 — FP8 e4m3 linears with f32 128×128
//! `weight_scale_inv` block scales, bf16 norms / embedding / lm_head / router, f32
//! `e_score_correction_bias` — with FP8 codes drawn from a normal of std 100 code units and block
//! scales `gain / sqrt(in_features) / 100` (×0.875–1.125 jitter), so dequantized weights look like
//! N(0, 1/in_features) and activations stay O(1). It is written to a temporary directory (one
//! shard per layer, with `model.safetensors.index.json`) and, for `bfloat16` or `w8a8c16`,
//! converted there by the project's own converter (`cachalot_convert`, spec §5), so the model the
//! bench times is exactly what `cachalot convert` makes of such a checkpoint. Both directories
//! are removed when the bench ends. The bench's model has no MTP layer (it does not load one), and
//! no tokenizer (the bench feeds random ids).
//!
//! Values differ from the Python tool's (another generator); shapes, dtypes and scales match.
//!
//! [`dummy`] makes the same kind of checkpoint for `model_config.with_ckpt: false` (the seed's
//! dummy loader, executor spec §6.6): the shapes of a model directory's `config.json`, MTP
//! layers included, held in the format its `quantization_config` names (FP8 blocks; none →
//! bf16; compressed-tensors int8 → W8A8, with C8 scales of 1.0 when it has a `kv_cache_scheme`).
//! The seed fills every tensor uniform in ±1e-3 (seed 1234); we use the recipe above instead,
//! so activations stay O(1) and routing spreads over the experts as in a trained model. Either
//! way the outputs mean nothing: it is for timing without a download.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use cachalot_kernels::f32_to_bf16;
use cachalot_kernels::fp8::f32_to_e4m3;
use cachalot_model::ExpertShard;
use rayon::prelude::*;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};

const BLOCK: usize = 128;
const SIGMA_CODE: f32 = 100.0;
/// Std of the random int4 codes (in code units) of a `pack-quantized` weight.
const SIGMA_INT4: f32 = 2.5;

/// Named shapes (the same as `tools/random_checkpoint.py --preset`).
pub const PRESETS: &[&str] = &["v3-1b", "v3-tiny", "v4-1b", "v4-tiny"];

fn preset(name: &str) -> Option<Value> {
    // Fields: vocab, hidden, dense inter, moe inter, layers, first dense, heads, q_lora, kv_lora,
    // nope, rope, v, experts, top-k, groups, topk groups, shared, max positions.
    let p = match name {
        "v3-1b" => [
            32000, 2048, 8192, 256, 8, 1, 16, 768, 512, 128, 64, 128, 64, 6, 8, 4, 1, 163840,
        ],
        "v3-tiny" => [
            512, 192, 320, 96, 3, 1, 4, 96, 64, 32, 16, 32, 16, 4, 4, 2, 1, 8192,
        ],
        _ => return None,
    };
    Some(json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": false,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "vocab_size": p[0],
        "hidden_size": p[1],
        "intermediate_size": p[2],
        "moe_intermediate_size": p[3],
        "num_hidden_layers": p[4],
        "first_k_dense_replace": p[5],
        "moe_layer_freq": 1,
        "num_attention_heads": p[6],
        "num_key_value_heads": p[6],
        "q_lora_rank": p[7],
        "kv_lora_rank": p[8],
        "qk_nope_head_dim": p[9],
        "qk_rope_head_dim": p[10],
        "v_head_dim": p[11],
        "n_routed_experts": p[12],
        "num_experts_per_tok": p[13],
        "n_group": p[14],
        "topk_group": p[15],
        "n_shared_experts": p[16],
        "max_position_embeddings": p[17],
        "norm_topk_prob": true,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn"
        },
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
    }))
}

/// A random checkpoint on disk; its directories are removed on drop.
pub struct RandomModel {
    pub dir: PathBuf,
    pub shape: String,
    pub quant: String,
    to_remove: Vec<PathBuf>,
    /// Directories above the model that were made for it (a `--random-dir` that did not
    /// exist), deepest first: removed when empty.
    made_parents: Vec<PathBuf>,
}

/// The file that marks a random model's directory as temporary while its process runs: one
/// that a process killed (SIGKILL, a crash) left behind is removed by the next random model
/// written beside it; a kept one ([`RandomModel::keep`]) has the mark taken off.
const UNFINISHED: &str = ".cachalot-temporary";

impl RandomModel {
    /// Leaves the directories in place when dropped (the caller owns them from now on).
    pub fn keep(&mut self) {
        for d in self.to_remove.drain(..) {
            let _ = std::fs::remove_file(d.join(UNFINISHED));
            crate::offline::forget_on_interrupt(&d);
        }
        self.made_parents.clear();
    }
}

/// Removes the `parent/<prefix>-<pid>` directories of random models whose process is gone
/// (Linux's `/proc` says which run) and that still carry the [`UNFINISHED`] mark; returns them.
fn remove_stale(parent: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(parent) else {
        return removed;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let pid = name.to_str().and_then(|n| {
            n.strip_prefix(prefix)?
                .strip_prefix('-')?
                .parse::<u32>()
                .ok()
        });
        let Some(pid) = pid else { continue };
        let path = e.path();
        if cachalot_convert::process_gone(pid)
            && path.join(UNFINISHED).is_file()
            && std::fs::remove_dir_all(&path).is_ok()
        {
            removed.push(path);
        }
    }
    removed
}

impl Drop for RandomModel {
    fn drop(&mut self) {
        for d in &self.to_remove {
            let _ = std::fs::remove_dir_all(d);
            crate::offline::forget_on_interrupt(d);
        }
        for d in &self.made_parents {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// The config of `spec`: a preset name or a `config.json` path, with FP8 block quantization and
/// no MTP layer.
fn config_for(spec: &str) -> Result<Value> {
    let mut cfg = match preset(spec).or_else(|| crate::random_model_v4::preset(spec)) {
        Some(c) => c,
        None => {
            let p = Path::new(spec);
            if !p.is_file() {
                bail!(
                    "--random-weights {spec}: neither a preset ({}) nor a config.json file",
                    PRESETS.join(", ")
                );
            }
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            serde_json::from_str::<Value>(&text)
                .with_context(|| format!("{}: not valid JSON", p.display()))?
        }
    };
    if crate::random_model_v4::is_v4(&cfg) {
        return Ok(cfg);
    }
    let Some(obj) = cfg.as_object_mut() else {
        bail!("--random-weights {spec}: the config is not a JSON object");
    };
    obj.insert("num_nextn_predict_layers".into(), json!(0));
    obj.insert(
        "quantization_config".into(),
        json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
               "weight_block_size": [BLOCK, BLOCK]}),
    );
    Ok(cfg)
}

pub(crate) fn field(cfg: &Value, key: &str) -> Result<usize> {
    cfg.get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .with_context(|| format!("random model config: `{key}` missing or not an integer"))
}

/// An optional integer field, `default` when absent (or not an integer).
pub(crate) fn field_or(cfg: &Value, key: &str, default: usize) -> usize {
    cfg.get(key)
        .and_then(Value::as_u64)
        .map_or(default, |v| v as usize)
}

#[derive(Clone, Copy)]
enum Kind {
    /// FP8 weight (`gain` goes into its scale tensor).
    Fp8,
    /// f32 `weight_scale_inv` of the FP8 weight before it, std of the dequantized weight.
    Scale(f32),
    /// bf16 RMSNorm weight, 1 + 0.1·N(0,1).
    Norm,
    /// bf16 N(0, std²).
    Bf16(f32),
    /// f32 N(0, std²).
    F32(f32),
    /// Int4 codes of a `pack-quantized` weight (Kimi-K2-Thinking's routed experts, spec §2.3):
    /// q from N(0, SIGMA_INT4²) rounded and clipped to [-8, 7], stored q + 8, 8 to an int32
    /// word, low nibble first.
    Int4Packed,
    /// bf16 `weight_scale` of the int4 weight before it (one per group), std of the
    /// dequantized weight.
    Int4Scale(f32),
    /// int32 `weight_shape` `[rows, cols]`.
    Int4Shape(usize, usize),
}

struct Spec {
    name: String,
    kind: Kind,
    shape: Vec<usize>,
}

struct Plan {
    shards: Vec<Vec<Spec>>,
}

/// The tensors of `cfg`'s checkpoint: the FP8 release layout, or with `int4_group` Kimi-K2-
/// Thinking's (routed experts `pack-quantized` int4 with one scale per `int4_group` columns,
/// every other Linear bf16).
fn plan(cfg: &Value, int4_group: Option<usize>) -> Result<Plan> {
    let h = field(cfg, "hidden_size")?;
    let v = field(cfg, "vocab_size")?;
    let nh = field(cfg, "num_attention_heads")?;
    let nope = field(cfg, "qk_nope_head_dim")?;
    let rope = field(cfg, "qk_rope_head_dim")?;
    let vd = field(cfg, "v_head_dim")?;
    let kv = field(cfg, "kv_lora_rank")?;
    let q_lora = field_or(cfg, "q_lora_rank", 0);
    let layers = field(cfg, "num_hidden_layers")?;
    let mtp_layers = field_or(cfg, "num_nextn_predict_layers", 0);
    let first_dense = field(cfg, "first_k_dense_replace")?;
    let freq = field_or(cfg, "moe_layer_freq", 1).max(1);
    let inter = field(cfg, "intermediate_size")?;
    let experts = field_or(cfg, "n_routed_experts", 0);
    let moe_inter = field(cfg, "moe_intermediate_size")?;
    let shared = field_or(cfg, "n_shared_experts", 0);

    let push = |out: &mut Vec<Spec>, name: String, kind: Kind, shape: Vec<usize>| {
        out.push(Spec { name, kind, shape })
    };
    let lin = |out: &mut Vec<Spec>, name: &str, rows: usize, cols: usize| {
        let std = 1.0 / (cols as f32).sqrt();
        match int4_group {
            Some(g) if name.contains(".mlp.experts.") => {
                push(
                    out,
                    format!("{name}.weight_packed"),
                    Kind::Int4Packed,
                    vec![rows, cols / 8],
                );
                push(
                    out,
                    format!("{name}.weight_scale"),
                    Kind::Int4Scale(std),
                    vec![rows, cols.div_ceil(g)],
                );
                push(
                    out,
                    format!("{name}.weight_shape"),
                    Kind::Int4Shape(rows, cols),
                    vec![2],
                );
            }
            Some(_) => push(
                out,
                format!("{name}.weight"),
                Kind::Bf16(std),
                vec![rows, cols],
            ),
            None => {
                push(out, format!("{name}.weight"), Kind::Fp8, vec![rows, cols]);
                push(
                    out,
                    format!("{name}.weight_scale_inv"),
                    Kind::Scale(std),
                    vec![rows.div_ceil(BLOCK), cols.div_ceil(BLOCK)],
                );
            }
        }
    };
    let norm = |out: &mut Vec<Spec>, name: &str, dim: usize| {
        out.push(Spec {
            name: name.to_string(),
            kind: Kind::Norm,
            shape: vec![dim],
        })
    };
    let mut shards = Vec::new();
    let mut first = Vec::new();
    push(
        &mut first,
        "model.embed_tokens.weight".into(),
        Kind::Bf16(1.0),
        vec![v, h],
    );
    norm(&mut first, "model.norm.weight", h);
    push(
        &mut first,
        "lm_head.weight".into(),
        Kind::Bf16(1.0 / (h as f32).sqrt()),
        vec![v, h],
    );
    shards.push(first);
    for li in 0..layers + mtp_layers {
        let mut s = Vec::new();
        let p = format!("model.layers.{li}");
        norm(&mut s, &format!("{p}.input_layernorm.weight"), h);
        let a = format!("{p}.self_attn");
        if q_lora == 0 {
            lin(&mut s, &format!("{a}.q_proj"), nh * (nope + rope), h);
        } else {
            lin(&mut s, &format!("{a}.q_a_proj"), q_lora, h);
            norm(&mut s, &format!("{a}.q_a_layernorm.weight"), q_lora);
            lin(&mut s, &format!("{a}.q_b_proj"), nh * (nope + rope), q_lora);
        }
        lin(&mut s, &format!("{a}.kv_a_proj_with_mqa"), kv + rope, h);
        norm(&mut s, &format!("{a}.kv_a_layernorm.weight"), kv);
        lin(&mut s, &format!("{a}.kv_b_proj"), nh * (nope + vd), kv);
        lin(&mut s, &format!("{a}.o_proj"), h, nh * vd);
        norm(&mut s, &format!("{p}.post_attention_layernorm.weight"), h);
        let m = format!("{p}.mlp");
        // MTP layers are MoE layers whatever their index (spec §3.8).
        let moe = experts > 0 && (li >= layers || (li >= first_dense && li % freq == 0));
        let mlp = |s: &mut Vec<Spec>, name: &str, i: usize| {
            lin(s, &format!("{name}.gate_proj"), i, h);
            lin(s, &format!("{name}.up_proj"), i, h);
            lin(s, &format!("{name}.down_proj"), h, i);
        };
        if moe {
            push(
                &mut s,
                format!("{m}.gate.weight"),
                Kind::Bf16(1.0 / (h as f32).sqrt()),
                vec![experts, h],
            );
            push(
                &mut s,
                format!("{m}.gate.e_score_correction_bias"),
                Kind::F32(0.02),
                vec![experts],
            );
            for e in 0..experts {
                mlp(&mut s, &format!("{m}.experts.{e}"), moe_inter);
            }
            if shared > 0 {
                mlp(&mut s, &format!("{m}.shared_experts"), moe_inter * shared);
            }
        } else {
            mlp(&mut s, &m, inter);
        }
        if li >= layers {
            // An MTP layer (spec §3.8): its own norms, eh_proj and head norm, and copies of
            // the embedding and head (parameter-shared; the loader skips them).
            norm(&mut s, &format!("{p}.enorm.weight"), h);
            norm(&mut s, &format!("{p}.hnorm.weight"), h);
            lin(&mut s, &format!("{p}.eh_proj"), h, 2 * h);
            norm(&mut s, &format!("{p}.shared_head.norm.weight"), h);
            push(
                &mut s,
                format!("{p}.shared_head.head.weight"),
                Kind::Bf16(1.0 / (h as f32).sqrt()),
                vec![v, h],
            );
            push(
                &mut s,
                format!("{p}.embed_tokens.weight"),
                Kind::Bf16(1.0),
                vec![v, h],
            );
        }
        shards.push(s);
    }
    Ok(Plan { shards })
}

/// splitmix64: a small, fast, seedable generator (one stream per tensor).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn for_name(name: &str) -> Rng {
        // FNV-1a of the tensor name, so every tensor has its own reproducible stream.
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        Rng(h)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    /// N(0, 1) by Box–Muller.
    pub(crate) fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
}

/// 65536 e4m3 codes of N(0, SIGMA_CODE²) samples (saturated at ±448); a uniform u16 indexes it.
fn code_table() -> Vec<u8> {
    let mut rng = Rng(0x5eed);
    (0..65536)
        .map(|_| f32_to_e4m3(rng.normal() * SIGMA_CODE))
        .collect()
}

fn generate(spec: &Spec, codes: &[u8]) -> (Dtype, Vec<u8>) {
    let n: usize = spec.shape.iter().product();
    let mut rng = Rng::for_name(&spec.name);
    match spec.kind {
        Kind::Fp8 => {
            let mut out = Vec::with_capacity(n);
            while out.len() < n {
                let r = rng.next();
                for k in 0..4 {
                    if out.len() < n {
                        out.push(codes[((r >> (16 * k)) & 0xffff) as usize]);
                    }
                }
            }
            (Dtype::F8_E4M3, out)
        }
        Kind::Scale(std) => {
            let base = std / SIGMA_CODE;
            let v: Vec<f32> = (0..n)
                .map(|_| base * (1.0 + 0.25 * (rng.uniform() - 0.5)))
                .collect();
            (Dtype::F32, cachalot_kernels::f32s_to_le_bytes(&v))
        }
        Kind::Norm | Kind::Bf16(_) => {
            let v: Vec<u16> = (0..n)
                .map(|_| {
                    let x = rng.normal();
                    f32_to_bf16(match spec.kind {
                        Kind::Bf16(s) => x * s,
                        _ => 1.0 + 0.1 * x,
                    })
                })
                .collect();
            (Dtype::BF16, cachalot_kernels::u16s_to_le_bytes(&v))
        }
        Kind::F32(s) => {
            let v: Vec<f32> = (0..n).map(|_| rng.normal() * s).collect();
            (Dtype::F32, cachalot_kernels::f32s_to_le_bytes(&v))
        }
        Kind::Int4Packed => {
            let mut out = Vec::with_capacity(4 * n);
            for _ in 0..n {
                let word = (0..8).fold(0u32, |acc, i| {
                    let q = (rng.normal() * SIGMA_INT4).round().clamp(-8.0, 7.0) as i32 + 8;
                    acc | ((q as u32) << (4 * i))
                });
                out.extend_from_slice(&word.to_le_bytes());
            }
            (Dtype::I32, out)
        }
        Kind::Int4Scale(std) => {
            let base = std / SIGMA_INT4;
            let v: Vec<u16> = (0..n)
                .map(|_| f32_to_bf16(base * (1.0 + 0.25 * (rng.uniform() - 0.5))))
                .collect();
            (Dtype::BF16, cachalot_kernels::u16s_to_le_bytes(&v))
        }
        Kind::Int4Shape(rows, cols) => {
            let v = [rows as i32, cols as i32];
            (Dtype::I32, v.iter().flat_map(|d| d.to_le_bytes()).collect())
        }
    }
}

/// Writes the FP8 checkpoint of `cfg` into `dir` (created).
/// Whether tensor `name` is written for `shard`: every tensor but another rank's routed experts
/// (`model.layers.{L}.mlp.experts.{j}.…`, owned as `ExpertShard::owner` says).
fn held(name: &str, shard: ExpertShard, experts: usize) -> bool {
    if shard.ranks <= 1 {
        return true;
    }
    let Some((head, rest)) = name.split_once(".mlp.experts.") else {
        return true;
    };
    let layer = head
        .rsplit('.')
        .next()
        .and_then(|l| l.parse::<u32>().ok())
        .unwrap_or(0);
    match rest.split('.').next().and_then(|j| j.parse::<usize>().ok()) {
        Some(j) => shard.holds(layer, j, experts),
        None => true,
    }
}

fn write_fp8(cfg: &Value, dir: &Path) -> Result<()> {
    write_fp8_shard(cfg, dir, ExpertShard::default(), None)
}

/// The FP8 checkpoint of `cfg` (with `int4_group`, Kimi-K2-Thinking's int4 + bf16 layout, see
/// [`plan`]) with only the routed experts `shard` holds.
fn write_fp8_shard(
    cfg: &Value,
    dir: &Path,
    shard: ExpertShard,
    int4_group: Option<usize>,
) -> Result<()> {
    let plan = plan(cfg, int4_group)?;
    let codes = code_table();
    let experts = field_or(cfg, "n_routed_experts", 0);
    let shards: Vec<Vec<&Spec>> = plan
        .shards
        .iter()
        .map(|s| s.iter().filter(|t| held(&t.name, shard, experts)).collect())
        .filter(|s: &Vec<&Spec>| !s.is_empty())
        .collect();
    write_checkpoint(
        dir,
        cfg,
        &shards,
        |s| (s.name.as_str(), s.shape.as_slice()),
        |s| generate(s, &codes),
    )
}

/// Writes `shards` (tensors generated in parallel by `generate`, named and shaped by `meta`) as
/// `model-0000i-of-0000n.safetensors`, `model.safetensors.index.json` and `cfg` as
/// `config.json` into `dir` (created).
pub(crate) fn write_checkpoint<S: Sync>(
    dir: &Path,
    cfg: &Value,
    shards: &[Vec<&S>],
    meta: impl Fn(&S) -> (&str, &[usize]),
    generate: impl Fn(&S) -> (Dtype, Vec<u8>) + Sync,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        let data: Vec<(Dtype, Vec<u8>)> = shard.par_iter().map(|s| generate(s)).collect();
        let mut views = Vec::with_capacity(shard.len());
        for (s, (dtype, bytes)) in shard.iter().zip(&data) {
            let (name, shape) = meta(s);
            let view = TensorView::new(*dtype, shape.to_vec(), bytes)
                .with_context(|| format!("random tensor {name}"))?;
            views.push((name.to_string(), view));
            weight_map.insert(name.to_string(), json!(file));
        }
        safetensors::tensor::serialize_to_file(views, None, &dir.join(&file))
            .with_context(|| format!("cannot write {}", dir.join(&file).display()))?;
    }
    let index = json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index)?,
    )?;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(cfg)?)?;
    Ok(())
}

/// Builds the random model `spec` (preset or config.json) under `parent` (the system temporary
/// directory if None), held as `quant`: `fp8` (as DeepSeek ships it), `bfloat16` or `w8a8c16`.
pub fn build(spec: &str, quant: &str, parent: Option<&Path>) -> Result<RandomModel> {
    use cachalot_convert::QuantMode;
    let mut cfg = config_for(spec)?;
    let v4 = crate::random_model_v4::is_v4(&cfg);
    if quant == W4A16 && !v4 {
        // Kimi-K2-Thinking's release layout, loaded as is (no conversion).
        const GROUP: usize = 32;
        if let Some(obj) = cfg.as_object_mut() {
            obj.insert(
                "quantization_config".into(),
                packed_int4_quantization(GROUP),
            );
        }
        check_before_writing(
            &cfg,
            &format!("--random-weights {spec}"),
            ExpertShard::default(),
        )?;
        let write = |dir: &Path| write_fp8_shard(&cfg, dir, ExpertShard::default(), Some(GROUP));
        return materialize(
            spec,
            quant,
            None,
            parent,
            "cachalot-bench-random",
            write,
            None,
        );
    }
    check_before_writing(
        &cfg,
        &format!("--random-weights {spec}"),
        ExpertShard::default(),
    )?;
    let mode = match (quant, QuantMode::parse(quant)) {
        ("fp8", _) => None,
        (_, Some(m @ (QuantMode::Bfloat16 | QuantMode::W8A8C16))) if !v4 => Some(m),
        (
            _,
            Some(
                m @ (QuantMode::Bfloat16
                | QuantMode::W8A8Int
                | QuantMode::W4A8Int
                | QuantMode::W4A8Mx
                | QuantMode::W4A8MxHif),
            ),
        ) if v4 => Some(m),
        (q, _) if v4 => bail!(
            "--random-quant {q}: a DeepSeek-V4 model is fp8 (the native FP8 + MXFP4 release), \
             bfloat16, w8a8-int, w4a8-int, w4a8-mx or w4a8-mx-hif"
        ),
        (q, _) => bail!("--random-quant {q}: expected fp8, bfloat16, w8a8c16 or w4a16"),
    };
    let write = |dir: &Path| {
        if v4 {
            v4_write(&cfg, dir)
        } else {
            write_fp8(&cfg, dir)
        }
    };
    materialize(
        spec,
        quant,
        mode,
        parent,
        "cachalot-bench-random",
        write,
        None,
    )
}

/// Before any random weight is written: `cfg` is a config the model would load (the model's own
/// validation, so a bad field is named now and not met as a panic or a huge allocation while
/// writing), and its weights fit in the memory there is (a run loads them all).
fn check_before_writing(cfg: &Value, what: &str, shard: ExpertShard) -> Result<()> {
    let text = cfg.to_string();
    let path = Path::new("config.json");
    let v4 = crate::random_model_v4::is_v4(cfg);
    if v4 {
        cachalot_model::DeepseekV4Config::from_json_str(&text, path)
            .map(drop)
            .with_context(|| what.to_string())?;
    } else {
        cachalot_model::DeepseekV3Config::from_json_str(&text, path)
            .map(drop)
            .with_context(|| what.to_string())?;
    }
    // Int4 routed experts (`pack-quantized`) hold their rows in int32 words of 8 nibbles: their
    // input widths must fill whole words (the loader refuses others).
    if !v4 && packed_int4_group(cfg).is_some() {
        for key in ["hidden_size", "moe_intermediate_size"] {
            let n = cfg.get(key).and_then(Value::as_u64).unwrap_or(0);
            if !n.is_multiple_of(8) {
                bail!(
                    "{what}: {key} {n} is not a multiple of 8, and the routed experts' int4 rows \
                     (pack-quantized) are packed 8 columns to an int32 word; give a multiple of 8"
                );
            }
        }
    }
    // The writer lists every tensor first: bound their count (DeepSeek-V3: ~50k, Kimi-K2 ~75k).
    let count = |k: &str| cfg.get(k).and_then(Value::as_u64).unwrap_or(0);
    let tensors = (count("num_hidden_layers") + count("num_nextn_predict_layers")).saturating_mul(
        count("n_routed_experts")
            .saturating_mul(6)
            .saturating_add(64),
    );
    if tensors > 4_000_000 {
        bail!(
            "{what}: num_hidden_layers × n_routed_experts make about {tensors} tensors, far more \
             than any DeepSeek model; use a smaller config"
        );
    }
    let bytes = if v4 {
        crate::random_model_v4::native_bytes(cfg)?
    } else {
        fp8_shard_bytes(cfg, shard)?
    };
    if let Some(avail) = crate::offline::mem_available() {
        if bytes > avail {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            bail!(
                "{what}: the config's shapes make {:.1} GiB of random weights, more than the \
                 {:.1} GiB of memory available; use a smaller config",
                gib(bytes),
                gib(avail)
            );
        }
    }
    Ok(())
}

/// `--random-quant` of Kimi-K2-Thinking's layout: int4 routed experts (`pack-quantized`, one
/// bf16 scale per 32 columns), bf16 elsewhere, int4 products with f32 activations.
const W4A16: &str = "w4a16";

/// The group size of a `pack-quantized` (int4) `quantization_config` in `cfg` (the columns of
/// a row for the `channel` strategy), None for any other quantization or a config the model's
/// own parser refuses (which names the problem before any weight is written).
fn packed_int4_group(cfg: &Value) -> Option<usize> {
    use cachalot_model::config::QuantizationConfig;
    let c =
        cachalot_model::DeepseekV3Config::from_json_str(&cfg.to_string(), Path::new("config.json"))
            .ok()?;
    match c.quantization {
        // One scale per row: a group as wide as the widest row.
        Some(QuantizationConfig::PackedInt4 { group_size, .. }) => {
            Some(group_size.unwrap_or(usize::MAX / 2))
        }
        _ => None,
    }
}

/// Kimi-K2-Thinking's `quantization_config` (spec §1.1, §2.3) with int4 groups of `group`.
fn packed_int4_quantization(group: usize) -> Value {
    json!({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "input_activations": null,
            "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
                        "group_size": group, "dynamic": false}
        }},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": null
    })
}

/// The estimated bytes of the FP8 checkpoint of `cfg` with the routed experts `shard` holds.
fn fp8_shard_bytes(cfg: &Value, shard: ExpertShard) -> Result<u64> {
    let plan = plan(cfg, packed_int4_group(cfg))?;
    let experts = field_or(cfg, "n_routed_experts", 0);
    Ok(plan
        .shards
        .iter()
        .flatten()
        .filter(|s| held(&s.name, shard, experts))
        .map(|s| {
            let n = s
                .shape
                .iter()
                .fold(1u64, |n, &d| n.saturating_mul(d as u64));
            n.saturating_mul(match s.kind {
                Kind::Fp8 => 1,
                Kind::Norm | Kind::Bf16(_) | Kind::Int4Scale(_) => 2,
                Kind::Scale(_) | Kind::F32(_) | Kind::Int4Packed | Kind::Int4Shape(..) => 4,
            })
        })
        .fold(0u64, u64::saturating_add))
}

/// `with_ckpt: false`: a random checkpoint with the shapes of `model_dir/config.json` (MTP
/// layers included), in the format its `quantization_config` names, under `parent` (the system
/// temporary directory if None). Removed on drop. The tokenizer stays in `model_dir`. With an
/// expert shard (expert parallelism; DeepSeek-V3/R1/Kimi-K2), only the routed experts it holds
/// are written (each tensor's values depend only on its name, so every rank's experts are
/// those of the whole random checkpoint).
pub fn dummy(model_dir: &Path, parent: Option<&Path>, shard: ExpertShard) -> Result<RandomModel> {
    let path = model_dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let orig: Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON", path.display()))?;
    check_before_writing(
        &orig,
        &format!("with_ckpt: false ({})", path.display()),
        shard,
    )?;
    // Ranks in one process (threads) share a pid: the shard tells their directories apart.
    let prefix = if shard.ranks > 1 {
        format!("cachalot-dummy-rank{}", shard.rank)
    } else {
        "cachalot-dummy".to_string()
    };
    if crate::random_model_v4::is_v4(&orig) {
        // (Written whole: each V4 rank loads only its experts from it.)
        let mode = v4_mode(&orig).with_context(|| path.display().to_string())?;
        let quant = mode.map_or("fp8", |m| m.name());
        let shape = path.display().to_string();
        let write = |dir: &Path| v4_write(&orig, dir);
        return materialize(&shape, quant, mode, parent, &prefix, write, None);
    }
    let q = orig.get("quantization_config");
    let method = q
        .and_then(|q| q.get("quant_method"))
        .and_then(Value::as_str);
    if let Some(group) = packed_int4_group(&orig) {
        // Kimi-K2-Thinking's own layout (int4 routed experts, bf16 elsewhere), written as is
        // under the config's own quantization_config.
        let shape = path.display().to_string();
        let write = |dir: &Path| {
            write_fp8_shard(&orig, dir, shard, Some(group)).with_context(|| {
                format!(
                    "with_ckpt: false: writing a random checkpoint of about {:.1} GB",
                    fp8_shard_bytes(&orig, shard).unwrap_or(0) as f64 / 1e9
                )
            })
        };
        return materialize(&shape, W4A16, None, parent, &prefix, write, None);
    }
    let mode = match method {
        None => Some(cachalot_convert::QuantMode::Bfloat16),
        Some("fp8") => None,
        Some("compressed-tensors") => Some(
            if q.and_then(|q| q.get("kv_cache_scheme"))
                .is_some_and(|v| !v.is_null())
            {
                cachalot_convert::QuantMode::W8A8C8
            } else {
                cachalot_convert::QuantMode::W8A8C16
            },
        ),
        Some(other) => bail!(
            "{}: with_ckpt: false cannot make random weights for quant_method {other:?} \
             (supported: fp8, compressed-tensors int8 or pack-quantized int4, none for bf16)",
            path.display()
        ),
    };
    let mut cfg = orig.clone();
    let Some(obj) = cfg.as_object_mut() else {
        bail!("{}: the config is not a JSON object", path.display());
    };
    obj.insert(
        "quantization_config".into(),
        json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
               "weight_block_size": [BLOCK, BLOCK]}),
    );
    let quant = mode.map_or("fp8", |m| m.name());
    // W8A8C8: one C8 scale per layer (main + MTP), 1.0, as meaningless as the weights.
    let c8_layers = (mode == Some(cachalot_convert::QuantMode::W8A8C8)).then(|| {
        field_or(&cfg, "num_hidden_layers", 0) + field_or(&cfg, "num_nextn_predict_layers", 0)
    });
    let shape = path.display().to_string();
    let write = |dir: &Path| {
        write_fp8_shard(&cfg, dir, shard, None).with_context(|| {
            format!(
                "with_ckpt: false: writing a random checkpoint of about {:.1} GB",
                fp8_shard_bytes(&cfg, shard).unwrap_or(0) as f64 / 1e9
            )
        })
    };
    materialize(&shape, quant, mode, parent, &prefix, write, c8_layers)
}

/// The V4 conversion a config's `quantization_config` says its checkpoint went through: None
/// for the native release (quant_method fp8, or the seed's `convert_config` rewrite of it),
/// else the `--quant_type` (`crates/cachalot-convert/src/v4.rs` writes these configs).
fn v4_mode(cfg: &Value) -> Result<Option<cachalot_convert::QuantMode>> {
    use cachalot_convert::QuantMode;
    let Some(q) = cfg.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(None);
    };
    match q.get("quant_method").and_then(Value::as_str) {
        Some("fp8") => Ok(None),
        Some("compressed-tensors") => {
            let groups = q.get("config_groups");
            let strategy = groups
                .and_then(|g| g.get("group_0"))
                .and_then(|g| g.get("weights"))
                .and_then(|w| w.get("strategy"))
                .and_then(Value::as_str)
                .unwrap_or("");
            let int4_experts = groups.and_then(|g| g.get("group_1")).is_some();
            match q.get("format").and_then(Value::as_str) {
                Some("int-quantized") if int4_experts => Ok(Some(QuantMode::W4A8Int)),
                Some("int-quantized") => Ok(Some(QuantMode::W8A8Int)),
                Some("float-quantized") => Ok(match strategy {
                    "channel" => Some(QuantMode::W4A8MxHif),
                    "group" => Some(QuantMode::W4A8Mx),
                    _ => None, // convert_config's rewrite of the native release
                }),
                other => bail!(
                    "with_ckpt: false: unknown compressed-tensors format {other:?} in \
                     quantization_config"
                ),
            }
        }
        other => bail!(
            "with_ckpt: false: cannot make random DeepSeek-V4 weights for quant_method {other:?}"
        ),
    }
}

/// A random checkpoint under `parent/<prefix>-<pid>/`: `write` makes the FP8 (V3) or native
/// FP8 + MXFP4 (V4) checkpoint in the directory it is given; with `mode` it is then converted
/// as `cachalot convert` would (C8 scales of 1.0 for `c8_layers` layers when given).
fn materialize(
    shape: &str,
    quant: &str,
    mode: Option<cachalot_convert::QuantMode>,
    parent: Option<&Path>,
    prefix: &str,
    write: impl FnOnce(&Path) -> Result<()>,
    c8_layers: Option<usize>,
) -> Result<RandomModel> {
    let parent = parent.map_or_else(std::env::temp_dir, Path::to_path_buf);
    let base = parent.join(format!("{prefix}-{}", std::process::id()));
    // (Named by its format when it is not converted: `w4a16` is written as it is.)
    let native = base.join(if mode.is_none() { quant } else { "fp8" });
    let mut model = RandomModel {
        dir: native.clone(),
        shape: shape.to_string(),
        quant: quant.to_string(),
        to_remove: vec![base.clone()],
        made_parents: parent
            .ancestors()
            .take_while(|d| !d.exists())
            .map(Path::to_path_buf)
            .collect(),
    };
    for old in remove_stale(&parent, prefix) {
        eprintln!(
            "removed {}, a random model a process that is gone left behind",
            old.display()
        );
    }
    crate::offline::remove_on_interrupt(&base);
    std::fs::create_dir_all(&base)
        .and_then(|_| std::fs::write(base.join(UNFINISHED), b""))
        .with_context(|| format!("cannot write under {}", base.display()))?;
    write(&native).with_context(|| format!("under {}", parent.display()))?;
    if let Some(mode) = mode {
        let c8_scales = match c8_layers {
            Some(n) => {
                let f = base.join("c8_scales.json");
                std::fs::write(&f, json!({ "ckv_scale": vec![1.0; n] }).to_string())?;
                Some(f)
            }
            None => None,
        };
        let out = base.join(quant);
        cachalot_convert::convert(&cachalot_convert::ConvertOptions {
            input: native.clone(),
            output: out.clone(),
            mode,
            c8_scales,
            quant_param_path: None,
            force: true,
            progress: false,
        })
        .with_context(|| format!("converting the random checkpoint to {quant}"))?;
        std::fs::remove_dir_all(&native).ok();
        model.dir = out;
    }
    Ok(model)
}

/// The native random V4 checkpoint of `cfg` in `dir`.
fn v4_write(cfg: &Value, dir: &Path) -> Result<()> {
    crate::random_model_v4::write_native(cfg, dir).with_context(|| {
        format!(
            "writing a random DeepSeek-V4 checkpoint of about {:.1} GB",
            crate::random_model_v4::native_bytes(cfg).unwrap_or(0) as f64 / 1e9
        )
    })
}

/// Bytes under `dir` (the random checkpoint's size, for the log).
pub fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A random model whose process is gone is removed by the next one, unless it was kept
    /// (no mark) or its process still runs.
    #[test]
    fn stale_random_models_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let dead = (1_000_000u32..4_000_000)
            .rev()
            .find(|p| !Path::new(&format!("/proc/{p}")).exists())
            .unwrap();
        let make = |name: String, mark: bool| {
            let d = tmp.path().join(name);
            std::fs::create_dir_all(d.join("fp8")).unwrap();
            if mark {
                std::fs::write(d.join(UNFINISHED), b"").unwrap();
            }
            d
        };
        let stale = make(format!("cachalot-bench-random-{dead}"), true);
        let kept = make(format!("cachalot-bench-random-{}", dead - 1), false);
        let live = make("cachalot-bench-random-1".into(), true);
        let other = make(format!("something-else-{dead}"), true);
        assert_eq!(
            remove_stale(tmp.path(), "cachalot-bench-random"),
            vec![stale.clone()]
        );
        assert!(!stale.exists() && kept.exists() && live.exists() && other.exists());
        // A kept model loses its mark; a dropped one is gone.
        let mut m = build("v3-tiny", "fp8", Some(tmp.path())).unwrap();
        let base = m.dir.parent().unwrap().to_path_buf();
        assert!(base.join(UNFINISHED).is_file());
        m.keep();
        drop(m);
        assert!(base.is_dir() && !base.join(UNFINISHED).exists());
        std::fs::remove_dir_all(&base).unwrap();
        let m = build("v3-tiny", "fp8", Some(tmp.path())).unwrap();
        let base = m.dir.parent().unwrap().to_path_buf();
        drop(m);
        assert!(!base.exists());
    }

    #[test]
    fn tiny_preset_loads_and_converts() {
        let tmp = tempfile::tempdir().expect("tempdir");
        for quant in ["fp8", "bfloat16", "w8a8c16"] {
            let m = build("v3-tiny", quant, Some(tmp.path())).expect("build");
            let model = cachalot_model::DeepseekV3::load(&m.dir, Default::default())
                .expect("the random checkpoint loads");
            assert_eq!(model.config().hidden_size, 192);
            let dir = m.dir.clone();
            drop(m);
            assert!(!dir.exists(), "{} left behind", dir.display());
        }
    }

    /// A width the int4 rows cannot pack is refused before any weight is written.
    #[test]
    fn w4a16_needs_widths_of_whole_words() {
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = config_for("v3-tiny").unwrap();
        cfg["hidden_size"] = json!(300);
        let path = tmp.path().join("config.json");
        std::fs::write(&path, cfg.to_string()).unwrap();
        let e = build(path.to_str().unwrap(), "w4a16", Some(tmp.path()))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("hidden_size 300 is not a multiple of 8"), "{e}");
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
    }

    #[test]
    fn w4a16_is_kimi_k2_thinkings_layout() {
        // (Two parents: a process's random models share one directory name.)
        let (t1, t2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let fp8 = build("v3-tiny", "fp8", Some(t1.path())).expect("build");
        let int4 = build("v3-tiny", "w4a16", Some(t2.path())).expect("build");
        let idx = std::fs::read_to_string(int4.dir.join("model.safetensors.index.json")).unwrap();
        for name in [
            "model.layers.1.mlp.experts.0.down_proj.weight_packed",
            "model.layers.1.mlp.experts.0.down_proj.weight_scale",
            "model.layers.1.mlp.experts.0.down_proj.weight_shape",
            "model.layers.1.mlp.shared_experts.down_proj.weight",
            "model.layers.1.self_attn.o_proj.weight",
        ] {
            assert!(idx.contains(&format!("\"{name}\"")), "{name} missing");
        }
        assert!(!idx.contains("weight_scale_inv"));
        let a = cachalot_model::DeepseekV3::load(&fp8.dir, Default::default()).unwrap();
        let b = cachalot_model::DeepseekV3::load(&int4.dir, Default::default()).unwrap();
        // Int4 experts: half a byte per weight plus a bf16-as-f32 scale per 32, against FP8's
        // byte plus a scale per 128 × 128 block.
        let (fp8_expert, _) = a.routed_expert_bytes();
        let (int4_expert, _) = b.routed_expert_bytes();
        assert!(
            int4_expert * 10 < fp8_expert * 7,
            "{int4_expert} vs {fp8_expert}"
        );
        // The random int4 weights keep activations O(1): finite log-probabilities.
        let toks: Vec<u32> = (0..24).map(|i| (i * 37 % 500) as u32).collect();
        let lp = cachalot_model::eval::next_token_logprobs(&b, &toks, 4096).unwrap();
        assert!(lp.iter().all(|x| x.is_finite() && *x <= 0.0), "{lp:?}");
    }

    #[test]
    fn bad_spec_is_an_error() {
        let err = build("no-such-preset", "fp8", None)
            .err()
            .expect("an error");
        assert!(err.to_string().contains("neither a preset"), "{err}");
        let err = build("v3-tiny", "int4", None).err().expect("an error");
        assert!(err.to_string().contains("--random-quant"), "{err}");
    }

    #[test]
    fn a_bad_or_huge_config_is_named_before_any_weight_is_written() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let base = preset("v3-tiny").expect("preset");
        for (field, value, expect) in [
            ("num_attention_heads", json!(0), "`num_attention_heads`"),
            ("vocab_size", json!(12_928_000_000u64), "`vocab_size`"),
            ("n_routed_experts", json!(1u64 << 20), "tensors"),
            ("hidden_size", json!(1u64 << 24), "GiB of random weights"),
        ] {
            let mut cfg = base.clone();
            cfg[field] = value;
            let dir = tmp.path().join(field);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
            let err = dummy(&dir, Some(tmp.path()), ExpertShard::default())
                .err()
                .expect("an error");
            let msg = format!("{err:#}");
            assert!(
                msg.contains(expect) && msg.contains("with_ckpt: false"),
                "{msg}"
            );
        }
        // Nothing was written.
        let left: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("cachalot-dummy")
            })
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn fp8_codes_are_finite_and_centred() {
        let codes = code_table();
        let t = cachalot_kernels::fp8::e4m3_table();
        let vals: Vec<f32> = codes.iter().map(|&c| t[c as usize]).collect();
        assert!(vals.iter().all(|v| v.is_finite()));
        let mean = vals.iter().sum::<f32>() / vals.len() as f32;
        let var = vals.iter().map(|v| v * v).sum::<f32>() / vals.len() as f32;
        assert!(mean.abs() < 2.0, "mean {mean}");
        assert!((var.sqrt() - SIGMA_CODE).abs() < 5.0, "std {}", var.sqrt());
    }
}
