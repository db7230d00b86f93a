//! DeepSeek-V4 conversions (spec `deepseek-v4.md` §4.2–§4.6, §1.2): the native Hybrid
//! FP8-MXFP4 checkpoint (FP8 e4m3 weights with `<layer>.scale` E8M0 128×128 block scales, routed
//! experts as packed e2m1 `I8 [N, K/2]` with E8M0 scales per 32 columns) to `bfloat16`,
//! `w8a8-int`, `w4a8-int`, `w4a8-mx` or `w4a8-mx-hif`, producing what the seed's
//! `convert_model.py --quant_type` produces: the same shard names, tensor names, dtypes and
//! values, `<layer>.scale` (and `.bias` for INT4) for re-quantised layers, the regenerated index,
//! and `config.json` with the compressed-tensors `quantization_config` of §4.2 (unchanged for
//! `bfloat16`). [`convert_config`] is the seed's `convert_config.py` (§1.2).
//!
//! Per weight: dequantise to bf16 (FP8: `bf16(fp8 · 2^(s−127))` per 128×128 block; FP4:
//! `bf16(e2m1 · 2^(s−127))` per 32 columns; exact), then, if its layer is in the type's
//! `quant_layers` (§4.2's table), re-quantise: INT8 per channel (§4.3, the bf16 double rounding
//! of [`quantize_row_bf16_to_int8`]), INT4 per channel with the range search (§4.4), MXFP8 /
//! MXFP4 (§4.5, `quantize_mx`) or HiF8 per row (§4.6). BF16 weights in the list (the compressor
//! and `weights_proj` projections under `w4a8-mx-hif`) are re-quantised from their bf16 values.
//!
//! Same machinery as the V3 converter (crate documentation): every input checked before anything
//! is written, one shard at a time, parallel positioned writes, a temporary directory renamed at
//! the end. `--quant_param_path` clip factors (§4.3 step 1) clamp the INT8 and INT4 layers that
//! have them before quantisation ([`crate::clip`]).

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use cachalot_kernels::hif8::quantize_row_hif8;
use cachalot_kernels::int4::{pack_int4_along_n, quantize_row_int4_search, scale_to_u64};
use cachalot_kernels::int8::quantize_row_bf16_to_int8;
use cachalot_kernels::mx::{
    e2m1_to_f32, e8m0_to_f32, quantize_mxfp4_row, quantize_mxfp8_row, MX_BLOCK,
};
use cachalot_kernels::{bf16_to_f32, f32_to_bf16};
use rayon::prelude::*;
use serde_json::{json, Map, Value};

use crate::clip::{load_clip_params, Clip};
use crate::safetensors_io::{self, OutTensor};
use crate::{
    check_output, dequantize_rows_to_bf16, fingerprint, finish_dir, out_tensor, progress_bar,
    start_shard, write_json, write_through_temp, BlockScales, ConvertError, ConvertOptions,
    ConvertReport, Input, QuantMode, Result, CONFIG_FILE, ITEM_BYTES,
};

/// Whether a checkpoint's config describes the V4 layout (it has `compress_ratios`).
pub(crate) fn is_v4_config(config: &Map<String, Value>) -> bool {
    config.contains_key("compress_ratios")
}

/// The V4 types' flags as the seed derives them from the name.
#[derive(Clone, Copy, Debug)]
struct TypeFlags {
    w4a8: bool,
    w8a8: bool,
    mx: bool,
    hif: bool,
}

fn flags(mode: QuantMode) -> Result<TypeFlags> {
    let (w4a8, w8a8, mx, hif) = match mode {
        QuantMode::Bfloat16 => (false, false, false, false),
        QuantMode::W8A8Int => (false, true, false, false),
        QuantMode::W4A8Int => (true, false, false, false),
        QuantMode::W4A8Mx => (true, false, true, false),
        QuantMode::W4A8MxHif => (true, false, true, true),
        QuantMode::W8A8C16 | QuantMode::W8A8C8 => {
            return Err(ConvertError::Usage(format!(
                "{} is a DeepSeek-V3/R1 mode; this checkpoint is DeepSeek-V4 (config.json \
                 has compress_ratios): use --quant-type bfloat16, w8a8-int, w4a8-int, w4a8-mx or \
                 w4a8-mx-hif",
                mode.name()
            )))
        }
    };
    Ok(TypeFlags {
        w4a8,
        w8a8,
        mx,
        hif,
    })
}

/// §4.2 `quant_layers`: layer name (tensor name without `.weight`) → bits.
fn quant_layers(
    num_layers: usize,
    num_experts: usize,
    ratios: &[u64],
    f: TypeFlags,
) -> HashMap<String, u8> {
    let mut q = HashMap::new();
    let moe = if f.w4a8 { 4 } else { 8 };
    let mlp = ["w1", "w2", "w3"];
    for (i, &ratio) in ratios.iter().enumerate().take(num_layers) {
        for j in 0..num_experts {
            for n in mlp {
                q.insert(format!("layers.{i}.ffn.experts.{j}.{n}"), moe);
            }
        }
        for n in mlp {
            q.insert(format!("layers.{i}.ffn.shared_experts.{n}"), 8);
        }
        let mut attn = vec!["wq_b", "wo_b"];
        if f.mx {
            attn.extend(["wq_a", "wkv", "wo_a"]);
        }
        if ratio == 4 {
            attn.push("indexer.wq_b");
            if f.hif {
                attn.extend([
                    "compressor.wkv",
                    "compressor.wgate",
                    "indexer.weights_proj",
                    "indexer.compressor.wkv",
                    "indexer.compressor.wgate",
                ]);
            }
        } else if ratio > 0 && f.hif {
            // A compressor without an indexer (the releases' 128; any ratio but 4).
            attn.extend(["compressor.wkv", "compressor.wgate"]);
        }
        for a in attn {
            q.insert(format!("layers.{i}.attn.{a}"), 8);
        }
    }
    for j in 0..num_experts {
        for n in mlp {
            q.insert(format!("mtp.0.ffn.experts.{j}.{n}"), moe);
        }
    }
    for n in mlp {
        q.insert(format!("mtp.0.ffn.shared_experts.{n}"), 8);
    }
    let mut mtp = vec!["attn.wq_b", "attn.wo_b", "e_proj", "h_proj"];
    if f.mx {
        mtp.extend(["attn.wq_a", "attn.wkv", "attn.wo_a"]);
    }
    for m in mtp {
        q.insert(format!("mtp.0.{m}"), 8);
    }
    q
}

/// §1.2 / §4.2: the modules listed in `ignore`, in the seed's order.
pub fn v4_ignore_list(num_layers: usize, ratios: &[u64], is_fp: bool, hif: bool) -> Vec<String> {
    let mut out = Vec::new();
    for (i, &ratio) in ratios.iter().enumerate().take(num_layers) {
        if !is_fp {
            for n in ["wq_a", "wkv", "wo_a"] {
                out.push(format!("layers.{i}.attn.{n}"));
            }
        }
        if ratio == 4 && !hif {
            for n in [
                "indexer.weights_proj",
                "indexer.compressor.wgate",
                "indexer.compressor.wkv",
                "compressor.wgate",
                "compressor.wkv",
            ] {
                out.push(format!("layers.{i}.attn.{n}"));
            }
        }
        // A compressor without an indexer: the releases' 128 (the seed names that one), and
        // any other ratio the model takes but 4.
        if ratio > 0 && ratio != 4 && !hif {
            for n in ["compressor.wgate", "compressor.wkv"] {
                out.push(format!("layers.{i}.attn.{n}"));
            }
        }
    }
    if !is_fp {
        for n in ["wq_a", "wkv", "wo_a"] {
            out.push(format!("mtp.0.attn.{n}"));
        }
    }
    out.push("mtp.0.head".into());
    out.push("head".into());
    out
}

/// One compressed-tensors quantization group (without `targets`).
fn quant_group(
    w_bits: u8,
    qtype: &str,
    is_mx: bool,
    hif: bool,
    input_strategy: &str,
) -> Map<String, Value> {
    let (a_strategy, w_strategy, a_group, w_group, w_block) = if hif {
        (
            input_strategy,
            "channel",
            Value::Null,
            Value::Null,
            Value::Null,
        )
    } else if qtype == "int" {
        ("token", "channel", Value::Null, Value::Null, Value::Null)
    } else if is_mx {
        ("group", "group", json!(32), json!(32), Value::Null)
    } else {
        ("group", "block", json!(128), Value::Null, json!("128x128"))
    };
    let mut g = Map::new();
    g.insert(
        "input_activations".into(),
        json!({"actorder": null, "block_structure": null, "dynamic": true,
               "group_size": a_group, "num_bits": 8, "observer": "memoryless",
               "observer_kwargs": {}, "strategy": a_strategy, "symmetric": true, "type": qtype}),
    );
    g.insert("activation_use_clip".into(), json!(false));
    g.insert("output_activations".into(), Value::Null);
    g.insert(
        "weights".into(),
        json!({"actorder": null, "block_structure": w_block, "dynamic": false,
               "group_size": w_group, "num_bits": w_bits, "observer": "minmax",
               "observer_kwargs": {}, "strategy": w_strategy, "symmetric": true, "type": qtype}),
    );
    g
}

/// §1.2 / §4.2: the compressed-tensors `quantization_config` (the seed's
/// `generate_quant_config`). `mx_cache` picks the float (true) or int KV / indexer cache schemes.
pub fn v4_quantization_config(
    ignore: &[String],
    mx_cache: bool,
    w4a8: bool,
    is_fp: bool,
    is_mx: bool,
    hif: bool,
) -> Value {
    let qtype = if is_fp { "float" } else { "int" };
    let mut groups = Map::new();
    let mut g0 = Map::new();
    g0.insert("targets".into(), json!(["Linear"]));
    g0.extend(quant_group(
        8,
        qtype,
        is_mx,
        hif,
        if hif { "tensor" } else { "group" },
    ));
    groups.insert("group_0".into(), Value::Object(g0));
    if w4a8 {
        let mut g1 = Map::new();
        g1.insert("targets".into(), json!(["MoEGMM"]));
        g1.extend(quant_group(4, qtype, is_fp, false, "token"));
        groups.insert("group_1".into(), Value::Object(g1));
    }
    let mut q = Map::new();
    q.insert("config_groups".into(), Value::Object(groups));
    q.insert(
        "format".into(),
        json!(if is_fp {
            "float-quantized"
        } else {
            "int-quantized"
        }),
    );
    q.insert("global_compression_ratio".into(), json!(1));
    q.insert("ignore".into(), json!(ignore));
    q.insert("quant_method".into(), json!("compressed-tensors"));
    q.insert("quantization_status".into(), json!("compressed"));
    q.insert(
        "kv_cache_scheme".into(),
        if mx_cache {
            json!({"num_bits": 8, "type": "float"})
        } else {
            Value::Null
        },
    );
    q.insert(
        "li_cache_scheme".into(),
        json!({"type": if mx_cache { "float" } else { "int" }, "num_bits": 8}),
    );
    if hif {
        q.insert("weight_block_size".into(), json!([128, 128]));
    }
    Value::Object(q)
}

/// `num_hidden_layers` and `compress_ratios` (at least one per main layer) of a V4 config.
fn layer_ratios(config: &Map<String, Value>, file: &Path) -> Result<(usize, Vec<u64>)> {
    let err = |why: String| ConvertError::Config {
        file: file.to_path_buf(),
        why,
    };
    let n = config
        .get("num_hidden_layers")
        .and_then(Value::as_u64)
        .ok_or_else(|| err("num_hidden_layers is missing or not a number".into()))?
        as usize;
    // Whole numbers (4 or 4.0, as Python writes either).
    let whole = |v: &Value| {
        v.as_u64().or_else(|| {
            v.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1e9)
                .map(|f| f as u64)
        })
    };
    let ratios: Vec<u64> = config
        .get("compress_ratios")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(whole).collect())
        .ok_or_else(|| {
            err(
                "compress_ratios is missing or not a list of whole numbers (is this a \
                 DeepSeek-V4 config?)"
                    .into(),
            )
        })?;
    if let Some((i, r)) = ratios.iter().enumerate().find(|(_, &r)| r == 1) {
        return Err(err(format!(
            "compress_ratios[{i}] is {r}: 0 for a window-only layer, or a ratio of at least 2"
        )));
    }
    if ratios.len() < n {
        return Err(err(format!(
            "compress_ratios has {} entries; num_hidden_layers is {n} (one per layer needed)",
            ratios.len()
        )));
    }
    Ok((n, ratios))
}

/// The seed's `convert_config.py`: rewrites `quantization_config` of `dir/config.json` in place
/// to describe the native Hybrid FP8-MXFP4 checkpoint (or its HiF8 variant with `hif`).
pub fn convert_config(dir: &Path, hif: bool) -> Result<ConfigRewrite> {
    let path = dir.join(CONFIG_FILE);
    let text = fs::read_to_string(&path).map_err(|e| ConvertError::io(&path, e))?;
    let mut config: Map<String, Value> =
        serde_json::from_str(&text).map_err(|e| ConvertError::Config {
            file: path.clone(),
            why: format!("is not a JSON object: {e}"),
        })?;
    match config.get("model_type").and_then(Value::as_str) {
        None | Some("deepseek_v4") => {}
        Some(other) => {
            return Err(ConvertError::Config {
                file: path.clone(),
                why: format!(
                    "model_type is {other:?}: convert-config rewrites a DeepSeek-V4 config \
                     (model_type \"deepseek_v4\")"
                ),
            })
        }
    }
    let (n, ratios) = layer_ratios(&config, &path)?;
    let ignore = v4_ignore_list(n, &ratios, true, hif);
    let wanted = v4_quantization_config(&ignore, true, true, true, false, hif);
    if config.get("quantization_config") == Some(&wanted) {
        return Ok(ConfigRewrite::AlreadyDone);
    }
    // Only the release's own weights (FP8 + MXFP4) are described so: a checkpoint `convert`
    // made holds other formats, which the new description would misname.
    let q = config.get("quantization_config");
    let native = match q {
        None => false,
        Some(q) => {
            q.get("quant_method").and_then(Value::as_str) == Some("fp8")
                || describes_native_v4(&config, &path)
        }
    };
    if !native {
        return Err(ConvertError::Config {
            file: path.clone(),
            why: format!(
                "its quantization_config ({}) does not describe DeepSeek-V4's FP8 + MXFP4 \
                 release: convert-config rewrites the release's own config; a checkpoint made \
                 by `convert` already has the description of its formats",
                q.map_or("none".to_string(), |q| {
                    let m = |k: &str| q.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
                    format!("quant_method {}, format {}", m("quant_method"), m("format"))
                })
            ),
        });
    }
    // The original description is kept beside it once (`config.json.orig`): `convert` reads
    // the checkpoint's own FP8 description, and a user may want it back.
    let orig = dir.join(format!("{CONFIG_FILE}.orig"));
    if orig.exists() {
        // Kept only where it is an earlier description of this config (the same config but
        // for its quantization_config), not some other file of that name.
        let bare = |mut m: Map<String, Value>| {
            m.remove("quantization_config");
            Value::Object(m)
        };
        let earlier = fs::read_to_string(&orig)
            .ok()
            .and_then(|t| serde_json::from_str::<Map<String, Value>>(&t).ok());
        if !earlier.is_some_and(|e| same(&bare(e), &bare(config.clone()))) {
            return Err(ConvertError::Config {
                file: orig,
                why: "exists but is not an earlier description of this config (it differs \
                      from config.json beyond quantization_config: another file, or config.json \
                      was edited since); convert-config keeps the first description there: \
                      move that file away (or put back the config it describes) and run it \
                      again"
                    .into(),
            });
        }
    } else {
        fs::write(&orig, &text).map_err(|e| ConvertError::io(&orig, e))?;
    }
    config.remove("quantization_config");
    config.insert("quantization_config".into(), wanted);
    // A link (a Hugging Face cache's snapshot points into its blobs) is replaced by the new
    // file, not written through: the blob other snapshots share stays as it was.
    if fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
        fs::remove_file(&path).map_err(|e| ConvertError::io(&path, e))?;
    }
    write_json(&path, &Value::Object(config))?;
    Ok(ConfigRewrite::Rewritten { orig })
}

/// Whether `config` (a DeepSeek-V4 one) describes the native FP8 + MXFP4 release as
/// [`convert_config`] (or the seed's `convert_config.py`) writes it, plain or HiF8: the weights
/// are then still the release's, whatever `quant_method` says. Numbers compare by value (`1` and
/// `1.0` alike), objects whatever their key order.
pub(crate) fn describes_native_v4(config: &Map<String, Value>, file: &Path) -> bool {
    let (Some(q), true) = (config.get("quantization_config"), is_v4_config(config)) else {
        return false;
    };
    let Ok((n, ratios)) = layer_ratios(config, file) else {
        return false;
    };
    [false, true].into_iter().any(|hif| {
        let ignore = v4_ignore_list(n, &ratios, true, hif);
        same(
            q,
            &v4_quantization_config(&ignore, true, true, true, false, hif),
        )
    })
}

/// Two JSON values alike, numbers by value (`1` and `1.0`), objects whatever their key order.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

/// What [`convert_config`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigRewrite {
    /// `quantization_config` rewritten; the first description is kept in `orig`.
    Rewritten { orig: PathBuf },
    /// It already described the checkpoint so (nothing written).
    AlreadyDone,
}

/// What a weight becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    Bf16,
    Int8,
    Int4,
    Mxfp8,
    Mxfp4,
    Hif8,
}

/// Where a weight's bf16 values come from.
#[derive(Clone, Copy, Debug)]
enum Src {
    /// FP8 e4m3 `[rows, cols]` with 128×128 block scales (`scales` index).
    Fp8 { start: u64, scales: usize },
    /// Packed e2m1 `[rows, cols/2]` with scales per 32 columns.
    Fp4 { start: u64, scales: usize },
    /// BF16 `[rows, cols]`.
    Bf16 { start: u64 },
}

/// One output-producing job of a shard.
enum Job {
    /// Bytes copied as they are into output tensor `out`.
    Copy { start: u64, len: usize, out: usize },
    /// A weight `[rows, cols]` (logical) converted into outputs `outs` (weight, scale, bias).
    Weight {
        src: Src,
        rows: usize,
        cols: usize,
        target: Target,
        outs: [usize; 3],
        /// Clip factors (INT8 / INT4 targets with `--quant-param-path`).
        clip: Option<Clip>,
    },
}

/// Reads an E8M0 (`F8_E8M0` / `U8`) or `F32` scale tensor of shape `grid` as f32 values.
fn read_scales(
    input: &Input,
    weight: &str,
    wfile: &Path,
    grid: [usize; 2],
    what: &str,
) -> Result<Vec<f32>> {
    let sname = format!("{}.scale", weight.strip_suffix(".weight").unwrap_or(weight));
    let Some((sfile, s)) = input.info(&sname) else {
        return Err(ConvertError::Tensor {
            tensor: weight.to_string(),
            file: wfile.to_path_buf(),
            why: format!(
                "is {what} but {sname} (E8M0 {grid:?} scales) is in no shard; the checkpoint is \
                 incomplete"
            ),
        });
    };
    let spath = input.dir.join(sfile);
    let bad = |why: String| ConvertError::Tensor {
        tensor: sname.clone(),
        file: spath.clone(),
        why,
    };
    if s.shape != grid {
        return Err(bad(format!(
            "has shape {:?}; expected {grid:?} (the scale grid of {weight}, {what})",
            s.shape
        )));
    }
    let mut bytes = vec![0u8; (s.end - s.start) as usize];
    File::open(&spath)
        .and_then(|f| f.read_exact_at(&mut bytes, s.start))
        .map_err(|e| ConvertError::io(&spath, e))?;
    let values: Vec<f32> = match s.dtype.as_str() {
        "F8_E8M0" | "U8" => bytes.iter().map(|&b| e8m0_to_f32(b)).collect(),
        "F32" => super::floats_of("F32", &bytes),
        other => {
            return Err(bad(format!(
                "has dtype {other}; expected F8_E8M0 (or U8 / F32) scales"
            )))
        }
    };
    if let Some(v) = values.iter().find(|v| !v.is_finite()) {
        return Err(bad(format!(
            "holds a non-finite scale {v} (E8M0 byte 255?)"
        )));
    }
    Ok(values)
}

/// Converts a V4 checkpoint (called by [`crate::convert`] once the layout is detected).
pub(crate) fn convert_v4(
    opts: &ConvertOptions,
    input: Input,
    t0: Instant,
) -> Result<ConvertReport> {
    let f = flags(opts.mode)?;
    if opts.c8_scales.is_some() {
        return Err(ConvertError::Usage(
            "--c8-scales is for DeepSeek-V3/R1 w8a8c8; V4 conversions take none".into(),
        ));
    }
    let config_path = input.dir.join(CONFIG_FILE);
    let (num_layers, ratios) = layer_ratios(&input.config, &config_path)?;
    let num_experts = input
        .config
        .get("n_routed_experts")
        .and_then(Value::as_u64)
        .ok_or_else(|| ConvertError::Config {
            file: config_path.clone(),
            why: "n_routed_experts is missing or not a number".into(),
        })? as usize;
    let resume = fingerprint(opts, &input.files());
    let adopt = check_output(&opts.input, &opts.output, opts.force, &resume)?;
    // INT8/INT4 weights the conversion writes (what clip factors apply to).
    let mut int_targets = 0usize;
    let clips = match &opts.quant_param_path {
        Some(dir) => load_clip_params(dir, num_layers)?,
        None => HashMap::new(),
    };
    let quantize = f.w4a8 || f.w8a8;
    let qlayers = if quantize {
        quant_layers(num_layers, num_experts, &ratios, f)
    } else {
        HashMap::new()
    };

    // Plan every shard (checking every weight and its scales) before writing anything.
    let mut report = ConvertReport::default();
    // Clip factors that reached a weight (the others name nothing in this checkpoint).
    let mut clipped: HashSet<String> = HashSet::new();
    let mut plans = Vec::new();
    for (si, (_, tensors)) in input.shards.iter().enumerate() {
        let file = input.shard_path(si);
        let mut outs: Vec<OutTensor> = Vec::new();
        let mut jobs: Vec<Job> = Vec::new();
        let mut scales: Vec<BlockScales> = Vec::new();
        let mut names = HashSet::new();
        for (name, t) in tensors {
            if name.ends_with(".scale") {
                continue;
            }
            report.input_bytes += t.end - t.start;
            let terr = |why: String| ConvertError::Tensor {
                tensor: name.clone(),
                file: file.clone(),
                why,
            };
            let size = safetensors_io::dtype_size(&t.dtype).unwrap_or(0);
            let key = name.rsplit_once('.').map(|(k, _)| k).unwrap_or(name);
            let bits = qlayers.get(key).copied();
            let src = match t.dtype.as_str() {
                "F8_E4M3" | "I8" => {
                    if t.shape.len() != 2 {
                        return Err(terr(format!(
                            "is {} with shape {:?}; 1-byte weights are 2-D",
                            t.dtype, t.shape
                        )));
                    }
                    crate::check_weight_dims(&t.shape).map_err(terr)?;
                    let (rows, c) = (t.shape[0], t.shape[1]);
                    if t.dtype == "F8_E4M3" {
                        let grid = [rows.div_ceil(128), c.div_ceil(128)];
                        let values = read_scales(&input, name, &file, grid, "FP8")?;
                        scales.push(BlockScales {
                            values,
                            block: (128, 128),
                            grid_cols: grid[1],
                        });
                        (
                            Src::Fp8 {
                                start: t.start,
                                scales: scales.len() - 1,
                            },
                            rows,
                            c,
                        )
                    } else {
                        let cols = 2 * c;
                        let grid = [rows, cols.div_ceil(MX_BLOCK)];
                        let values = read_scales(&input, name, &file, grid, "packed FP4 (I8)")?;
                        scales.push(BlockScales {
                            values,
                            block: (1, MX_BLOCK),
                            grid_cols: grid[1],
                        });
                        (
                            Src::Fp4 {
                                start: t.start,
                                scales: scales.len() - 1,
                            },
                            rows,
                            cols,
                        )
                    }
                }
                _ if size == 1 => {
                    return Err(terr(format!(
                        "has dtype {}; the 1-byte weights of a native V4 checkpoint are F8_E4M3 \
                         and I8 (packed FP4) (is this checkpoint already converted?)",
                        t.dtype
                    )))
                }
                "BF16" if bits.is_some() && t.shape.len() == 2 => {
                    crate::check_weight_dims(&t.shape).map_err(terr)?;
                    (Src::Bf16 { start: t.start }, t.shape[0], t.shape[1])
                }
                _ => {
                    names.insert(name.clone());
                    outs.push(out_tensor(name, crate::dtype_static(&t.dtype), &t.shape));
                    jobs.push(Job::Copy {
                        start: t.start,
                        len: (t.end - t.start) as usize,
                        out: outs.len() - 1,
                    });
                    continue;
                }
            };
            let (src, rows, cols) = src;
            let target = match bits {
                None => Target::Bf16,
                Some(4) if f.mx => Target::Mxfp4,
                Some(4) => Target::Int4,
                Some(_) if f.mx && f.hif && !key.contains("shared_experts") => Target::Hif8,
                Some(_) if f.mx => Target::Mxfp8,
                Some(_) => Target::Int8,
            };
            let scale_name = format!("{key}.scale");
            let w = outs.len();
            let mut o = [w, usize::MAX, usize::MAX];
            let mut add = |outs: &mut Vec<OutTensor>, n: &str, d: &'static str, s: &[usize]| {
                names.insert(n.to_string());
                outs.push(out_tensor(n, d, s));
                outs.len() - 1
            };
            match target {
                Target::Bf16 => {
                    add(&mut outs, name, "BF16", &[rows, cols]);
                    report.bf16_weights += 1;
                }
                Target::Int8 => {
                    add(&mut outs, name, "I8", &[rows, cols]);
                    o[1] = add(&mut outs, &scale_name, "F32", &[rows, 1]);
                    report.int8_weights += 1;
                }
                Target::Int4 => {
                    if rows % 2 != 0 {
                        return Err(terr(format!(
                            "has {rows} rows; INT4 packs pairs of output rows, so it needs an \
                             even count"
                        )));
                    }
                    add(&mut outs, name, "I8", &[rows / 2, cols]);
                    o[1] = add(&mut outs, &scale_name, "U64", &[rows, 1]);
                    let bias = format!("{key}.bias");
                    o[2] = add(&mut outs, &bias, "F32", &[rows]);
                    report.int4_weights += 1;
                }
                Target::Mxfp8 | Target::Mxfp4 => {
                    let g = cols.div_ceil(MX_BLOCK);
                    if target == Target::Mxfp4 {
                        if cols % 2 != 0 {
                            return Err(terr(format!(
                                "has {cols} columns; MXFP4 needs an even count"
                            )));
                        }
                        add(&mut outs, name, "U8", &[rows, cols / 2]);
                    } else {
                        add(&mut outs, name, "F8_E4M3", &[rows, cols]);
                    }
                    o[1] = add(&mut outs, &scale_name, "U8", &[rows, g]);
                    report.mx_weights += 1;
                }
                Target::Hif8 => {
                    add(&mut outs, name, "U8", &[rows, cols]);
                    o[1] = add(&mut outs, &scale_name, "F32", &[rows, 1]);
                    report.hif8_weights += 1;
                }
            }
            let clip = match target {
                Target::Int8 | Target::Int4 => {
                    int_targets += 1;
                    clips.get(key).cloned()
                }
                _ => None,
            };
            if let Some(c) = &clip {
                c.check_rows(rows).map_err(terr)?;
                clipped.insert(key.to_string());
            }
            jobs.push(Job::Weight {
                src,
                rows,
                cols,
                target,
                outs: o,
                clip,
            });
        }
        if names.len() != outs.len() {
            return Err(ConvertError::Shard {
                file,
                why: "two output tensors would have the same name (a `.bias` or `.scale` that \
                      is not a scale?)"
                    .into(),
            });
        }
        plans.push((outs, jobs, scales));
    }
    // Factors for modules this conversion does not quantize to INT8/INT4 (another model's, a
    // renamed key, or a module kept in another format) would be dropped without a word: none
    // matching is an error (the wrong file or key names), some is a note.
    let mut unused: Vec<&String> = clips.keys().filter(|k| !clipped.contains(*k)).collect();
    unused.sort();
    // (A type without INT8/INT4 layers, the MX ones, does not use them: the caller says so.)
    let clipping = quantize && int_targets > 0;
    if let (Some(dir), Some(first)) = (&opts.quant_param_path, unused.first()) {
        if clipping && clipped.is_empty() {
            return Err(ConvertError::Usage(format!(
                "--quant-param-path {}: none of its clip factors ({} modules, first `{first}`) \
                 names an INT8/INT4 weight of {} under {}; the keys are module names of this \
                 checkpoint (e.g. `layers.0.attn.wq_a`): give the factors made for it",
                dir.display(),
                unused.len(),
                opts.input.display(),
                opts.mode.name(),
            )));
        }
        if clipping {
            report.notes.push(format!(
                "{} of the clip factors in {} name no INT8/INT4 weight under {} and were not \
                 used (first: `{first}`)",
                unused.len(),
                dir.display(),
                opts.mode.name()
            ));
        }
    }

    write_through_temp(&opts.output, opts.force, &resume, adopt, |tmp, shards| {
        let pb = progress_bar(report.input_bytes, opts.progress);
        let mut weight_map = Map::new();
        for (si, (outs, jobs, scales)) in plans.into_iter().enumerate() {
            let (file_name, _) = &input.shards[si];
            let (names, bytes) = shards.shard(
                file_name,
                outs,
                |outs| outs.into_iter().map(|o| o.name).collect(),
                |outs| {
                    write_shard(
                        &input.shard_path(si),
                        &tmp.join(file_name),
                        outs,
                        &jobs,
                        &scales,
                        &pb,
                    )
                },
            )?;
            report.output_bytes += bytes;
            for name in names {
                report.tensors_written += 1;
                weight_map.insert(name, Value::String(file_name.clone()));
            }
            report.shards += 1;
        }
        report.resumed = shards.resumed;
        pb.finish_and_clear();
        let mut config = input.config.clone();
        if quantize {
            config.remove("quantization_config");
            let ignore = v4_ignore_list(num_layers, &ratios, f.mx, f.hif);
            config.insert(
                "quantization_config".into(),
                v4_quantization_config(&ignore, f.mx, f.w4a8, f.mx, f.mx, f.hif),
            );
        }
        finish_dir(&input.dir, tmp, &opts.output, config, weight_map)
    })?;
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// One unit of parallel work: rows `rows` of job `job` (bytes, for copies).
struct Item {
    job: usize,
    rows: std::ops::Range<usize>,
}

fn write_shard(
    input: &Path,
    output: &Path,
    mut outs: Vec<OutTensor>,
    jobs: &[Job],
    scales: &[BlockScales],
    pb: &indicatif::ProgressBar,
) -> Result<(Vec<String>, u64)> {
    let names: Vec<String> = outs.iter().map(|o| o.name.clone()).collect();
    let (map, out, total) = start_shard(input, output, &mut outs)?;

    let mut items = Vec::new();
    for (j, job) in jobs.iter().enumerate() {
        let (n, step) = match job {
            Job::Copy { len, .. } => (*len, ITEM_BYTES),
            Job::Weight { rows, cols, .. } => {
                // Even row counts (INT4 packs row pairs).
                (
                    *rows,
                    (ITEM_BYTES / (2 * cols).max(1)).max(2).div_ceil(2) * 2,
                )
            }
        };
        let mut r = 0;
        while r < n {
            items.push(Item {
                job: j,
                rows: r..(r + step).min(n),
            });
            r += step;
        }
    }
    items.par_iter().try_for_each(|item| -> Result<()> {
        let consumed = run_item(
            &jobs[item.job],
            item.rows.clone(),
            &outs,
            scales,
            &map,
            &out,
        )
        .map_err(|e| crate::item_error(e, input, output))?;
        pb.inc(consumed);
        Ok(())
    })?;
    drop(map);
    out.sync_all().map_err(|e| ConvertError::io(output, e))?;
    Ok((names, total))
}

fn le_bytes<const N: usize, T: Copy>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

/// Produces and writes rows `rows` of one job; returns the input bytes consumed.
fn run_item(
    job: &Job,
    rows: std::ops::Range<usize>,
    outs: &[OutTensor],
    scales: &[BlockScales],
    map: &[u8],
    out: &File,
) -> std::io::Result<u64> {
    let (src, cols, target, o, clip) = match *job {
        Job::Copy { start, out: t, .. } => {
            let s = start as usize + rows.start;
            crate::check_finite(&outs[t], &map[s..start as usize + rows.end], rows.start)?;
            out.write_all_at(
                &map[s..start as usize + rows.end],
                outs[t].offset + rows.start as u64,
            )?;
            return Ok(rows.len() as u64);
        }
        Job::Weight {
            src,
            cols,
            target,
            outs: o,
            ref clip,
            ..
        } => (src, cols, target, o, clip),
    };
    let n = rows.len();
    let r0 = rows.start;
    // The bf16 values of the rows.
    let mut bf = vec![0u16; n * cols];
    let consumed = match src {
        Src::Fp8 { start, scales: s } => {
            crate::check_fp8_codes(&outs[o[0]].name, &map[start as usize..], cols, rows.clone())?;
            dequantize_rows_to_bf16(
                &map[start as usize..],
                cols,
                rows.clone(),
                &scales[s],
                &mut bf,
            );
            n * cols
        }
        Src::Fp4 { start, scales: s } => {
            let bs = &scales[s];
            let half = cols / 2;
            for (i, r) in rows.clone().enumerate() {
                let packed = &map[start as usize + r * half..start as usize + (r + 1) * half];
                let srow = &bs.values[r * bs.grid_cols..(r + 1) * bs.grid_cols];
                for (c, o) in bf[i * cols..(i + 1) * cols].iter_mut().enumerate() {
                    let v = e2m1_to_f32(packed[c / 2] >> (4 * (c % 2))) * srow[c / MX_BLOCK];
                    *o = f32_to_bf16(v);
                }
            }
            n * half
        }
        Src::Bf16 { start } => {
            let b = &map[start as usize + 2 * r0 * cols..start as usize + 2 * (r0 + n) * cols];
            crate::check_floats(&outs[o[0]].name, "BF16", b, r0 * cols)?;
            for (o, p) in bf.iter_mut().zip(b.chunks_exact(2)) {
                *o = u16::from_le_bytes([p[0], p[1]]);
            }
            2 * n * cols
        }
    };
    crate::check_scaled_finite(&outs[o[0]].name, &bf, cols, r0)?;
    if let Some(c) = clip {
        c.apply(&mut bf, cols, r0);
    }
    let w = &outs[o[0]];
    let f32_row = |i: usize| -> Vec<f32> {
        bf[i * cols..(i + 1) * cols]
            .iter()
            .map(|&b| bf16_to_f32(b))
            .collect()
    };
    match target {
        Target::Bf16 => {
            out.write_all_at(
                &le_bytes(&bf, u16::to_le_bytes),
                w.offset + (r0 * cols * 2) as u64,
            )?;
        }
        Target::Int8 => {
            let mut q = vec![0i8; n * cols];
            let mut s = Vec::with_capacity(n);
            for (row, qrow) in bf.chunks_exact(cols).zip(q.chunks_exact_mut(cols)) {
                s.push(quantize_row_bf16_to_int8(row, qrow));
            }
            out.write_all_at(
                &le_bytes(&q, i8::to_le_bytes),
                w.offset + (r0 * cols) as u64,
            )?;
            out.write_all_at(
                &le_bytes(&s, f32::to_le_bytes),
                outs[o[1]].offset + 4 * r0 as u64,
            )?;
        }
        Target::Int4 => {
            let mut q = vec![0i8; n * cols];
            let mut s = Vec::with_capacity(n);
            let mut bias = Vec::with_capacity(n);
            for i in 0..n {
                let r = quantize_row_int4_search(&f32_row(i), &mut q[i * cols..(i + 1) * cols]);
                s.push(scale_to_u64(r.scale));
                bias.push(r.bias);
            }
            let mut packed = vec![0u8; n / 2 * cols];
            pack_int4_along_n(&q, n, cols, &mut packed);
            out.write_all_at(&packed, w.offset + (r0 / 2 * cols) as u64)?;
            out.write_all_at(
                &le_bytes(&s, u64::to_le_bytes),
                outs[o[1]].offset + 8 * r0 as u64,
            )?;
            out.write_all_at(
                &le_bytes(&bias, f32::to_le_bytes),
                outs[o[2]].offset + 4 * r0 as u64,
            )?;
        }
        Target::Mxfp8 | Target::Mxfp4 => {
            let g = cols.div_ceil(MX_BLOCK);
            let fp4 = target == Target::Mxfp4;
            let row_bytes = if fp4 { cols / 2 } else { cols };
            let mut data = vec![0u8; n * row_bytes];
            let mut sc = vec![0u8; n * g];
            for i in 0..n {
                let d = &mut data[i * row_bytes..(i + 1) * row_bytes];
                let s = &mut sc[i * g..(i + 1) * g];
                if fp4 {
                    quantize_mxfp4_row(&f32_row(i), d, s);
                } else {
                    quantize_mxfp8_row(&f32_row(i), d, s);
                }
            }
            out.write_all_at(&data, w.offset + (r0 * row_bytes) as u64)?;
            out.write_all_at(&sc, outs[o[1]].offset + (r0 * g) as u64)?;
        }
        Target::Hif8 => {
            let mut q = vec![0u8; n * cols];
            let mut s = Vec::with_capacity(n);
            for i in 0..n {
                s.push(quantize_row_hif8(
                    &f32_row(i),
                    &mut q[i * cols..(i + 1) * cols],
                ));
            }
            out.write_all_at(&q, w.offset + (r0 * cols) as u64)?;
            out.write_all_at(
                &le_bytes(&s, f32::to_le_bytes),
                outs[o[1]].offset + 4 * r0 as u64,
            )?;
        }
    }
    Ok(consumed as u64)
}
