//! Offline weight conversion of DeepSeek-V3/R1 and Kimi-K2 FP8 checkpoints to BF16, W8A8C16 and
//! W8A8C8, producing what the seed's `convert_model.py` produces (spec
//! `deepseek-v3-r1-kimi-k2.md` §5): the same shard names, tensor names, dtypes, bf16 values,
//! int8 values and per-row scales bit for bit (the §5.2 bf16 double rounding), the same layers
//! kept in bf16 (the §5.3 ignore list), the rewritten index
//! `{"metadata": {}, "weight_map": ...}` and `quantization_config`, every `*.py`/`*.json` copied
//! (and the other files that are not weights: tokenizer models, templates).
//!
//! Inputs besides the seed's FP8 checkpoints: a BF16 (or F16/F32) one, whose Linear weights are
//! quantized from their bf16 values as an FP8 weight's are after dequantization, and
//! Kimi-K2-Thinking's int4 release (compressed-tensors `pack-quantized`, spec §2.3): each
//! `X.weight_packed` (with `X.weight_scale` per group and `X.weight_shape`) becomes `X.weight` =
//! bf16(q · scale), written as bf16 or quantized per row from those values (§5.2).
//!
//! Differences from the seed, on purpose (spec §5.5):
//! - The input is checked first: a missing or misshapen `weight_scale_inv`, an unexpected
//!   1-byte dtype, an index naming a missing shard or tensor, a truncated shard are errors naming
//!   the file and tensor (the seed copies an FP8 weight without a scale through, which nothing
//!   can load).
//! - C8 scales come from `cachalot calibrate` (a JSON file) instead of a vendor download, and go
//!   into the last shard as the seed puts them.
//! - Streaming: one input shard at a time (mmap'd and released), output written in place with
//!   positioned writes from all cores, so memory stays about one shard plus a few MB per thread;
//!   everything is written to a temporary directory beside the output and renamed at the end.
//! - The ignore list is matched as module names (a tensor of the module or below it), as the
//!   runtime matches it, not as substrings: the seed's `model.layers.{i}.mlp.gate` entry (i ≥ 3,
//!   R1's router, never FP8) would otherwise keep a dense layer's `mlp.gate_proj` in bf16 in a
//!   model with more than 3 dense layers.
//! - Tensors in a shard are laid out as Python `safetensors` lays them out, but byte-identical
//!   files are not a goal (§5.5); tensor-level equality is.

mod clip;
mod safetensors_io;
pub mod torch_pt;
mod v4;

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use cachalot_kernels::f32_to_bf16;
use cachalot_kernels::fp8::e4m3_table;
use cachalot_kernels::int8::quantize_row_bf16_to_int8;
use rayon::prelude::*;
use serde_json::{json, Map, Value};

use safetensors_io::{layout, OutTensor};
pub use safetensors_io::{read_header, TensorInfo};
pub use v4::{convert_config, v4_ignore_list, v4_quantization_config, ConfigRewrite};

/// The seed's `--quant_mode` (DeepSeek-V3/R1, Kimi-K2) and `--quant_type` (DeepSeek-V4, see
/// `v4.rs`); `Bfloat16` serves both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMode {
    Bfloat16,
    W8A8C16,
    W8A8C8,
    /// V4: INT8 per channel for the experts, shared experts and wq_b/wo_b.
    W8A8Int,
    /// V4: INT4 per channel (searched) routed experts, INT8 elsewhere.
    W4A8Int,
    /// V4: MXFP4 routed experts, MXFP8 elsewhere.
    W4A8Mx,
    /// V4: MXFP4 routed experts, MXFP8 shared experts, HiF8 elsewhere.
    W4A8MxHif,
}

impl QuantMode {
    pub fn parse(s: &str) -> Option<QuantMode> {
        match s.to_ascii_lowercase().as_str() {
            "bfloat16" | "bf16" => Some(QuantMode::Bfloat16),
            "w8a8c16" => Some(QuantMode::W8A8C16),
            "w8a8c8" => Some(QuantMode::W8A8C8),
            "w8a8-int" => Some(QuantMode::W8A8Int),
            "w4a8-int" => Some(QuantMode::W4A8Int),
            "w4a8-mx" => Some(QuantMode::W4A8Mx),
            "w4a8-mx-hif" => Some(QuantMode::W4A8MxHif),
            _ => None,
        }
    }
    /// The seed's spelling.
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Bfloat16 => "bfloat16",
            QuantMode::W8A8C16 => "w8a8c16",
            QuantMode::W8A8C8 => "w8a8c8",
            QuantMode::W8A8Int => "w8a8-int",
            QuantMode::W4A8Int => "w4a8-int",
            QuantMode::W4A8Mx => "w4a8-mx",
            QuantMode::W4A8MxHif => "w4a8-mx-hif",
        }
    }
    fn int8(self) -> bool {
        self != QuantMode::Bfloat16
    }
}

#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub input: PathBuf,
    pub output: PathBuf,
    pub mode: QuantMode,
    /// W8A8C8: the JSON written by `cachalot calibrate`.
    pub c8_scales: Option<PathBuf>,
    /// DeepSeek-V4: the seed's `--quant_param_path` directory of clip factors
    /// (`quant_params_{L}.pt`, spec `deepseek-v4.md` §4.3 step 1).
    pub quant_param_path: Option<PathBuf>,
    /// Replace a non-empty output directory.
    pub force: bool,
    /// Show a progress bar (on a terminal).
    pub progress: bool,
}

/// What a conversion did.
#[derive(Clone, Debug, Default)]
pub struct ConvertReport {
    pub shards: usize,
    pub tensors_written: usize,
    pub int8_weights: usize,
    pub bf16_weights: usize,
    /// V4: INT4 per-channel weights (`w4a8-int` experts).
    pub int4_weights: usize,
    /// V4: MXFP8 and MXFP4 weights.
    pub mx_weights: usize,
    /// V4: HiF8 weights.
    pub hif8_weights: usize,
    pub input_bytes: u64,
    pub output_bytes: u64,
    pub seconds: f64,
    /// Shards an interrupted run of the same conversion had written, taken as they were.
    pub resumed: usize,
    /// Things the caller should tell the user (e.g. clip factors that matched no weight).
    pub notes: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    // (`error`, not `source`: the message already holds it; as a source it was printed twice.)
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: {why}", file.display())]
    Shard { file: PathBuf, why: String },
    #[error("tensor {tensor} in {}: {why}", file.display())]
    Tensor {
        tensor: String,
        file: PathBuf,
        why: String,
    },
    #[error("{}: {why}", file.display())]
    Config { file: PathBuf, why: String },
    #[error("{0}")]
    Usage(String),
}

impl ConvertError {
    fn io(path: &Path, source: std::io::Error) -> ConvertError {
        ConvertError::Io {
            path: path.to_path_buf(),
            error: source,
        }
    }
}

type Result<T> = std::result::Result<T, ConvertError>;

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const CONFIG_FILE: &str = "config.json";

/// The name of the C8 scale tensor of layer `i` (spec §5.4).
pub fn ckv_scale_name(layer: usize) -> String {
    format!("model.layers.{layer}.self_attn.ckv_scale")
}

/// Whether tensor `name` belongs to a module of the ignore list: the module itself or a tensor
/// below it (`X.weight` of module `X`).
pub fn ignored(ignore: &[String], name: &str) -> bool {
    ignore.iter().any(|m| {
        name.strip_prefix(m.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    })
}

/// Spec §5.3: the modules kept in bf16 under W8A8, in the seed's order (matched as module
/// names, [`ignored`]).
pub fn ignore_list(num_hidden_layers: usize, num_layers: usize) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..num_layers {
        out.push(format!("model.layers.{i}.self_attn.kv_b_proj"));
        if i >= 3 {
            out.push(format!("model.layers.{i}.mlp.gate"));
        }
        if i >= num_hidden_layers {
            out.push(format!("model.layers.{i}.eh_proj"));
            out.push(format!("model.layers.{i}.shared_head.head"));
        }
    }
    out.push("lm_head".to_string());
    out
}

/// Spec §5.3: the compressed-tensors `quantization_config` of the W8A8 modes.
pub fn w8a8_quantization_config(ignore: &[String], c8: bool) -> Value {
    let kv = if c8 {
        json!({"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": false, "symmetric": true})
    } else {
        Value::Null
    };
    json!({
        "config_groups": {
            "group_0": {
                "input_activations": {
                    "actorder": null, "block_structure": null, "dynamic": true, "group_size": null,
                    "num_bits": 8, "observer": "memoryless", "observer_kwargs": {},
                    "strategy": "token", "symmetric": true, "type": "int"
                },
                "output_activations": null,
                "targets": ["Linear"],
                "weights": {
                    "actorder": null, "block_structure": null, "dynamic": false, "group_size": null,
                    "num_bits": 8, "observer": "minmax", "observer_kwargs": {},
                    "strategy": "channel", "symmetric": true, "type": "int"
                }
            }
        },
        "format": "int-quantized",
        "global_compression_ratio": 1,
        "ignore": ignore,
        "kv_cache_scheme": kv,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed"
    })
}

/// How one output tensor is made.
#[derive(Clone, Debug)]
enum Source {
    /// Bytes copied from the input shard.
    Copy { start: u64 },
    /// FP8 → bf16 with the block scales.
    Bf16 { start: u64, scale: usize },
    /// FP8 → bf16 → int8 per row; the scale tensor is written by the same task.
    Int8 {
        start: u64,
        scale: usize,
        scale_out: usize,
    },
    /// BF16 (or F16/F32, rounded to bf16) → int8 per row (an unquantized checkpoint's Linear
    /// weight); the scale tensor is written by the same task.
    Int8Float {
        start: u64,
        /// The stored dtype: "BF16", "F16" or "F32" (F16/F32 rounded to bf16 first).
        dtype: &'static str,
        scale_out: usize,
    },
    /// Kimi-K2-Thinking's packed int4 (`X.weight_packed` with its group scales) → bf16, then
    /// written as bf16 or (`scale_out`) quantized to int8 per row.
    Int4 {
        start: u64,
        scales: Int4Scales,
        scale_out: Option<usize>,
    },
    /// F16/F32 → bf16 (an unquantized checkpoint's other float tensors, and its Linear
    /// weights that stay bf16), element by element.
    ToBf16 { start: u64, dtype: &'static str },
    /// Written by its weight's task.
    Int8Scale,
    /// A C8 scale.
    Constant(f32),
}

struct Planned {
    out: OutTensor,
    source: Source,
}

/// Where a packed int4 weight's group scales are (`[rows, groups]`, possibly in another
/// shard): read with each item's rows.
#[derive(Clone, Debug)]
struct Int4Scales {
    file: PathBuf,
    start: u64,
    /// "BF16" (K2-Thinking), "F16" or "F32".
    dtype: &'static str,
    group: usize,
    groups: usize,
}

/// A checked FP8 weight's block scales, read once.
struct BlockScales {
    values: Vec<f32>,
    block: (usize, usize),
    grid_cols: usize,
}

struct Input {
    dir: PathBuf,
    config: Map<String, Value>,
    /// Shard file names in sorted order, and each one's tensors.
    shards: Vec<(String, Vec<(String, TensorInfo)>)>,
    /// tensor name → shard index.
    location: HashMap<String, usize>,
    block: (usize, usize),
    /// compressed-tensors `pack-quantized` (Kimi-K2-Thinking): the int4 weights' group size
    /// (`Some(None)`: one scale per row, the `channel` strategy).
    int4: Option<Option<usize>>,
    num_hidden_layers: usize,
    num_layers: usize,
}

impl Input {
    fn open(dir: &Path) -> Result<Input> {
        let config_path = dir.join(CONFIG_FILE);
        let text =
            fs::read_to_string(&config_path).map_err(|e| ConvertError::io(&config_path, e))?;
        let cfg_err = |why: String| ConvertError::Config {
            file: config_path.clone(),
            why,
        };
        let mut config: Map<String, Value> =
            serde_json::from_str(&text).map_err(|e| cfg_err(format!("is not JSON: {e}")))?;
        // (`"quantization_config": null` is none, as transformers reads it.)
        if config.get("quantization_config") == Some(&Value::Null) {
            config.remove("quantization_config");
        }
        // No quantization_config: a BF16 checkpoint (its Linear weights are quantized from
        // bf16 directly); any other quant_method is already converted.
        let no_q = Value::Object(Map::new());
        let q = config.get("quantization_config").unwrap_or(&no_q);
        let int4 = if is_pack_quantized(q) {
            Some(pack_quantized_group(q).map_err(&cfg_err)?)
        } else {
            None
        };
        if config.contains_key("quantization_config")
            && int4.is_none()
            && q.get("quant_method").and_then(Value::as_str) != Some("fp8")
            // DeepSeek-V4's own release described as `convert-config` (or the seed's
            // convert_config.py, which keeps no copy) rewrites it in place: still FP8 + MXFP4.
            && !v4::describes_native_v4(&config, &config_path)
        {
            let orig = dir.join(format!("{CONFIG_FILE}.orig"));
            let restore = if orig.is_file() {
                format!(
                    " ({} holds the description `convert-config` replaced: copy it back over \
                     config.json to convert these weights)",
                    orig.display()
                )
            } else {
                String::new()
            };
            return Err(cfg_err(format!(
                "quantization_config.quant_method is {}; the input must be an FP8 checkpoint \
                 (\"fp8\") as DeepSeek ships it, a BF16 one (no quantization_config) or \
                 Kimi-K2-Thinking's int4 release (compressed-tensors, format \
                 \"pack-quantized\"){restore}",
                q.get("quant_method").unwrap_or(&Value::Null)
            )));
        }
        let block = match q.get("weight_block_size").and_then(Value::as_array) {
            None => (128, 128),
            Some(a) if a.len() == 2 && a.iter().all(|v| v.as_u64().is_some_and(|x| x > 0)) => (
                a[0].as_u64().unwrap_or(128) as usize,
                a[1].as_u64().unwrap_or(128) as usize,
            ),
            Some(other) => {
                return Err(cfg_err(format!(
                    "quantization_config.weight_block_size is {other:?}; expected [rows, cols]"
                )))
            }
        };
        let field = |k: &str| config.get(k).and_then(Value::as_u64).map(|v| v as usize);
        let num_hidden_layers = field("num_hidden_layers")
            .ok_or_else(|| cfg_err("num_hidden_layers is missing".into()))?;
        let nextn = field("num_nextn_predict_layers").or_else(|| field("num_mtp_layers"));

        // The shards: the index's files, or every *.safetensors without one.
        let index_path = dir.join(INDEX_FILE);
        let mut indexed: Option<Vec<(String, String)>> = None;
        let files: BTreeSet<String> = if index_path.exists() {
            let text =
                fs::read_to_string(&index_path).map_err(|e| ConvertError::io(&index_path, e))?;
            let v: Value = serde_json::from_str(&text).map_err(|e| ConvertError::Config {
                file: index_path.clone(),
                why: format!("is not JSON: {e}"),
            })?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| ConvertError::Config {
                    file: index_path.clone(),
                    why: "has no weight_map object".into(),
                })?;
            let mut pairs = Vec::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| ConvertError::Config {
                    file: index_path.clone(),
                    why: format!("weight_map.{name} is not a file name"),
                })?;
                // Shards are read beside the index and written under the same names beside
                // the output's: no absolute paths, no `..`.
                let inside = !file.is_empty()
                    && Path::new(file).components().all(|c| {
                        matches!(
                            c,
                            std::path::Component::Normal(_) | std::path::Component::CurDir
                        )
                    });
                if !inside {
                    return Err(ConvertError::Config {
                        file: index_path.clone(),
                        why: format!(
                            "weight_map.{name} names {file:?}, which is not in the model \
                             directory; shards are file names beside the index"
                        ),
                    });
                }
                pairs.push((name.clone(), file.to_string()));
            }
            let mut files: BTreeSet<String> = pairs.iter().map(|(_, f)| f.clone()).collect();
            indexed = Some(pairs);
            // A shard that holds no tensor is in no index entry; the seed converts every
            // `*.safetensors` of the directory, so it is written too (empty) and counts as the
            // last shard where C8 scales go.
            for e in fs::read_dir(dir).map_err(|e| ConvertError::io(dir, e))? {
                let e = e.map_err(|e| ConvertError::io(dir, e))?;
                let name = e.file_name().to_string_lossy().into_owned();
                if !name.ends_with(".safetensors") || files.contains(&name) || !e.path().is_file() {
                    continue;
                }
                match read_header(&e.path()) {
                    Ok(t) if t.is_empty() => {
                        files.insert(name);
                    }
                    // Loaders read only the index's shards: a file of tensors beside them is
                    // not part of the model (a consolidated copy, a leftover).
                    _ => eprintln!(
                        "convert: note: {} is not in {INDEX_FILE} and is not converted (loaders \
                         read only the shards the index names)",
                        e.path().display()
                    ),
                }
            }
            files
        } else {
            let mut files = BTreeSet::new();
            for e in fs::read_dir(dir).map_err(|e| ConvertError::io(dir, e))? {
                let e = e.map_err(|e| ConvertError::io(dir, e))?;
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".safetensors") {
                    files.insert(name);
                }
            }
            files
        };
        if files.is_empty() {
            return Err(ConvertError::Usage(format!(
                "{}: no safetensors shards (and no {INDEX_FILE})",
                dir.display()
            )));
        }
        let mut shards = Vec::new();
        let mut location = HashMap::new();
        for (i, file) in files.iter().enumerate() {
            let path = dir.join(file);
            if let Some(why) = cachalot_kernels::shard_file_problem(&path) {
                return Err(ConvertError::Config { file: path, why });
            }
            if !path.is_file() {
                return Err(ConvertError::Config {
                    file: index_path.clone(),
                    why: format!("names the shard {file}, which is not in {}", dir.display()),
                });
            }
            let tensors = read_header(&path)?;
            for (name, _) in &tensors {
                if let Some(prev) = location.insert(name.clone(), i) {
                    return Err(ConvertError::Tensor {
                        tensor: name.clone(),
                        file: path.clone(),
                        why: format!("is also in {}", files.iter().nth(prev).unwrap_or(file)),
                    });
                }
            }
            shards.push((file.clone(), tensors));
        }
        if let Some(pairs) = indexed {
            for (name, file) in pairs {
                let i = files.iter().position(|f| *f == file).unwrap_or(usize::MAX);
                if location.get(&name) != Some(&i) {
                    return Err(ConvertError::Tensor {
                        tensor: name,
                        file: dir.join(&file),
                        why: format!("is named by {INDEX_FILE} but is not in this shard"),
                    });
                }
            }
        }
        // Without the key, the MTP layers the checkpoint holds (the runtime defaults to
        // DeepSeek's one, and runs without it where it is absent).
        let num_layers = match nextn {
            Some(n) => num_hidden_layers + n,
            None => (num_hidden_layers..)
                .find(|l| {
                    let prefix = format!("model.layers.{l}.");
                    !location.keys().any(|k| k.starts_with(&prefix))
                })
                .unwrap_or(num_hidden_layers),
        };
        Ok(Input {
            dir: dir.to_path_buf(),
            config,
            shards,
            location,
            block,
            int4,
            num_hidden_layers,
            num_layers,
        })
    }

    fn info(&self, name: &str) -> Option<(&Path, &TensorInfo)> {
        let &i = self.location.get(name)?;
        let (_, tensors) = &self.shards[i];
        tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| (Path::new(&self.shards[i].0), t))
    }

    fn shard_path(&self, i: usize) -> PathBuf {
        self.dir.join(&self.shards[i].0)
    }

    /// Every file the conversion reads: the shards, config.json and the index.
    fn files(&self) -> Vec<PathBuf> {
        (0..self.shards.len())
            .map(|i| self.shard_path(i))
            .chain([self.dir.join(CONFIG_FILE), self.dir.join(INDEX_FILE)])
            .collect()
    }

    /// Checks an FP8 weight (2-D, F32 scale grid of the right shape somewhere in the index) and
    /// reads its scales.
    fn block_scales(&self, shard: usize, name: &str, w: &TensorInfo) -> Result<BlockScales> {
        let file = self.shard_path(shard);
        let terr = |why: String| ConvertError::Tensor {
            tensor: name.to_string(),
            file: file.clone(),
            why,
        };
        if w.shape.len() != 2 {
            return Err(terr(format!(
                "is F8_E4M3 with shape {:?}; FP8 weights are 2-D",
                w.shape
            )));
        }
        check_weight_dims(&w.shape).map_err(terr)?;
        let sname = format!("{name}_scale_inv");
        let (br, bc) = self.block;
        let grid = [w.shape[0].div_ceil(br), w.shape[1].div_ceil(bc)];
        let Some((sfile, s)) = self.info(&sname) else {
            return Err(terr(format!(
                "is FP8 but {sname} (f32 {grid:?} block scales) is in no shard; the checkpoint \
                 is incomplete"
            )));
        };
        let spath = self.dir.join(sfile);
        if s.dtype != "F32" || s.shape != grid {
            return Err(ConvertError::Tensor {
                tensor: sname,
                file: spath,
                why: format!(
                    "is {} {:?}; expected F32 {grid:?} ({br}x{bc} blocks of {name} {:?})",
                    s.dtype, s.shape, w.shape
                ),
            });
        }
        let mut bytes = vec![0u8; (s.end - s.start) as usize];
        File::open(&spath)
            .and_then(|f| f.read_exact_at(&mut bytes, s.start))
            .map_err(|e| ConvertError::io(&spath, e))?;
        let values = floats_of("F32", &bytes);
        // (A block scale is its largest magnitude over 448: a negative one would flip the
        // block's signs.)
        if let Some(v) = values.iter().find(|v| !(v.is_finite() && **v >= 0.0)) {
            return Err(ConvertError::Tensor {
                tensor: sname,
                file: spath,
                why: format!(
                    "holds the block scale {v}; FP8 block scales are finite and not negative: \
                     the checkpoint is damaged"
                ),
            });
        }
        Ok(BlockScales {
            values,
            block: self.block,
            grid_cols: grid[1],
        })
    }
}

impl Input {
    /// Checks packed int4 weight `prefix.weight_packed` (`w`, in shard `shard`): int32
    /// `[rows, cols/8]`, `weight_shape` (when present) `[rows, cols]`, and `weight_scale`
    /// `[rows, ceil(cols/group)]` in BF16/F16/F32 somewhere in the index. Returns rows, cols and
    /// where the scales are.
    fn packed_int4(
        &self,
        shard: usize,
        prefix: &str,
        w: &TensorInfo,
    ) -> Result<(usize, usize, Int4Scales)> {
        let name = format!("{prefix}.weight_packed");
        let file = self.shard_path(shard);
        let terr = |tensor: &str, file: &Path, why: String| ConvertError::Tensor {
            tensor: tensor.to_string(),
            file: file.to_path_buf(),
            why,
        };
        let Some(group) = self.int4 else {
            return Err(terr(
                &name,
                &file,
                "is a packed int4 weight, but config.json's quantization_config is not \
                 compressed-tensors `pack-quantized` (give the checkpoint's own config.json)"
                    .into(),
            ));
        };
        if w.dtype != "I32" || w.shape.len() != 2 {
            return Err(terr(
                &name,
                &file,
                format!(
                    "is {} {:?}; packed int4 weights are 2-D I32 words of 8 nibbles",
                    w.dtype, w.shape
                ),
            ));
        }
        check_weight_dims(&w.shape).map_err(|why| terr(&name, &file, why))?;
        let rows = w.shape[0];
        let cols = w.shape[1] * 8;
        let shape_name = format!("{prefix}.weight_shape");
        if let Some((sfile, s)) = self.info(&shape_name) {
            let spath = self.dir.join(sfile);
            let dims = read_ints(&spath, s).map_err(|why| terr(&shape_name, &spath, why))?;
            if dims != [rows as i64, cols as i64] {
                return Err(terr(
                    &shape_name,
                    &spath,
                    format!(
                        "is {dims:?}; {name} is {:?}, 8 columns a word: [{rows}, {cols}]",
                        w.shape
                    ),
                ));
            }
        }
        let per = match group {
            Some(g) => format!("one per {g} columns, the config's group_size"),
            None => "one per row, the config's channel strategy".into(),
        };
        let group = group.unwrap_or(cols);
        let groups = cols.div_ceil(group);
        let sname = format!("{prefix}.weight_scale");
        let Some((sfile, s)) = self.info(&sname) else {
            return Err(terr(
                &name,
                &file,
                format!(
                    "is packed int4 but {sname} ([{rows}, {groups}] scales, {per}) is in no \
                     shard; the checkpoint is incomplete"
                ),
            ));
        };
        let spath = self.dir.join(sfile);
        let shape_ok = s.shape == [rows, groups] || (groups == 1 && s.shape == [rows]);
        if !shape_ok || !matches!(s.dtype.as_str(), "BF16" | "F16" | "F32") {
            return Err(terr(
                &sname,
                &spath,
                format!(
                    "is {} {:?}; expected BF16 (or F16/F32) [{rows}, {groups}], the scales of \
                     {name}: {per}",
                    s.dtype, s.shape
                ),
            ));
        }
        let scales = Int4Scales {
            file: spath,
            start: s.start,
            dtype: dtype_static(&s.dtype),
            group,
            groups,
        };
        Ok((rows, cols, scales))
    }
}

/// The integers of a small I32/I64 tensor (`weight_shape`).
fn read_ints(path: &Path, t: &TensorInfo) -> std::result::Result<Vec<i64>, String> {
    let size = match t.dtype.as_str() {
        "I32" => 4,
        "I64" => 8,
        other => return Err(format!("has dtype {other}; a shape is I32 or I64")),
    };
    let len = (t.end - t.start) as usize;
    if len > 64 {
        return Err(format!("holds {len} bytes; a shape is a few integers"));
    }
    let mut bytes = vec![0u8; len];
    File::open(path)
        .and_then(|f| f.read_exact_at(&mut bytes, t.start))
        .map_err(|e| format!("cannot be read: {e}"))?;
    Ok(bytes
        .chunks_exact(size)
        .map(|b| {
            if size == 4 {
                i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64
            } else {
                i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
            }
        })
        .collect())
}

/// Reads C8 scales, one positive scale per layer (main layers, then MTP layers): the JSON
/// written by `cachalot calibrate` (`{"ckv_scale": [s_0, ..., s_{L-1}]}`), or a directory of
/// the seed's `quant_parameters_{i}.pth` files (spec §5.4: `torch.save`d dicts, one per layer,
/// every one required, the scale under `self_attn.ckv_scale`; other `*_scale` keys, which no
/// model parameter consumes, are ignored).
pub fn read_c8_scales(path: &Path, num_layers: usize) -> Result<Vec<f32>> {
    if path.is_dir() {
        return read_c8_pth(path, num_layers);
    }
    let text = fs::read_to_string(path).map_err(|e| ConvertError::io(path, e))?;
    let err = |why: String| ConvertError::Config {
        file: path.to_path_buf(),
        why,
    };
    let v: Value = serde_json::from_str(&text).map_err(|e| err(format!("is not JSON: {e}")))?;
    let list = v
        .get("ckv_scale")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            err("has no \"ckv_scale\" list (write it with cachalot calibrate)".into())
        })?;
    if list.len() != num_layers {
        return Err(err(format!(
            "has {} ckv_scale values; the model has {num_layers} layers (main + MTP), every one \
             needs a scale",
            list.len()
        )));
    }
    list.iter()
        .enumerate()
        .map(|(i, s)| {
            s.as_f64()
                .map(|s| s as f32)
                .filter(|&s| usable_c8_scale(s))
                .ok_or_else(|| {
                    err(format!(
                        "ckv_scale[{i}] = {s} is not a positive number whose reciprocal is \
                         within f32's range (about 2.9e-39 to 3.4e38)"
                    ))
                })
        })
        .collect()
}

/// A C8 scale the cache can use: positive, finite, and its reciprocal (what a latent is
/// multiplied by when it is quantized) finite too.
pub fn usable_c8_scale(s: f32) -> bool {
    s.is_finite() && s > 0.0 && (1.0 / s).is_finite()
}

fn read_c8_pth(dir: &Path, num_layers: usize) -> Result<Vec<f32>> {
    (0..num_layers)
        .map(|i| {
            let file = dir.join(format!("quant_parameters_{i}.pth"));
            let err = |why: String| ConvertError::Config {
                file: file.clone(),
                why,
            };
            if !file.is_file() {
                return Err(err(format!(
                    "missing: the seed's C8 scales are quant_parameters_i.pth for every layer i \
                     in 0..{num_layers} (main + MTP)"
                )));
            }
            let torch_pt::PtValue::Dict(items) =
                torch_pt::load_pt(&file).map_err(ConvertError::Usage)?
            else {
                return Err(err("holds no dict".into()));
            };
            let v = items
                .iter()
                .find(|(k, _)| *k == torch_pt::PtValue::Str("self_attn.ckv_scale".into()))
                .map(|(_, v)| v)
                .ok_or_else(|| err("has no self_attn.ckv_scale".into()))?;
            let s = match v {
                torch_pt::PtValue::Tensor(t) if t.values.len() == 1 => t.values[0] as f32,
                torch_pt::PtValue::Float(x) => *x as f32,
                torch_pt::PtValue::Tensor(t) => {
                    return Err(err(format!(
                        "self_attn.ckv_scale is a tensor of {} values (shape {:?}), not one \
                         number (a per-layer scale)",
                        t.values.len(),
                        t.shape
                    )))
                }
                _ => {
                    return Err(err(
                        "self_attn.ckv_scale is not a number or a one-value tensor".into(),
                    ))
                }
            };
            if !usable_c8_scale(s) {
                return Err(err(format!(
                    "self_attn.ckv_scale = {s} is not a positive number whose reciprocal is \
                     within f32's range (about 2.9e-39 to 3.4e38)"
                )));
            }
            Ok(s)
        })
        .collect()
}

/// Converts per [`ConvertOptions`]; see the crate documentation.
pub fn convert(opts: &ConvertOptions) -> Result<ConvertReport> {
    let t0 = Instant::now();
    // `.`, `..` and links in --output resolved first: the directory replaced under --force
    // and the one the result is renamed to are then the one the user named.
    let opts = &ConvertOptions {
        output: resolve_output(&opts.output)?,
        ..opts.clone()
    };
    let input = Input::open(&opts.input)?;
    if v4::is_v4_config(&input.config) {
        if input.int4.is_some() {
            return Err(ConvertError::Config {
                file: opts.input.join(CONFIG_FILE),
                why: "is a DeepSeek-V4 config with a pack-quantized (int4) quantization_config; \
                      V4 converts from its FP8 + MXFP4 release"
                    .into(),
            });
        }
        return v4::convert_v4(opts, input, t0);
    }
    if !matches!(
        opts.mode,
        QuantMode::Bfloat16 | QuantMode::W8A8C16 | QuantMode::W8A8C8
    ) {
        return Err(ConvertError::Usage(format!(
            "{} is a DeepSeek-V4 quant type, but {} is not a V4 checkpoint (its config.json \
             has no compress_ratios); use --quant-mode bfloat16, w8a8c16 or w8a8c8",
            opts.mode.name(),
            opts.input.display()
        )));
    }
    // The seed's R1 converter takes its C8 scale directory as --quant_param_path.
    let c8_path = match (&opts.c8_scales, &opts.quant_param_path) {
        (Some(_), Some(_)) => {
            return Err(ConvertError::Usage(
                "give the C8 scales once: --c8-scales or --quant-param-path".into(),
            ))
        }
        (a, b) => a.as_ref().or(b.as_ref()),
    };
    let c8 =
        match (opts.mode, c8_path) {
            (QuantMode::W8A8C8, Some(p)) => Some(read_c8_scales(p, input.num_layers)?),
            (QuantMode::W8A8C8, None) => return Err(ConvertError::Usage(
                "--quant-mode w8a8c8 needs --c8-scales FILE (make one with `cachalot calibrate \
                 --model DIR --file TEXT --out FILE` on the model being converted) or the seed's \
                 directory of quant_parameters_i.pth files"
                    .into(),
            )),
            (_, Some(_)) => {
                return Err(ConvertError::Usage(
                    "--c8-scales / --quant-param-path are only for --quant-mode w8a8c8 (for \
                     DeepSeek-V3/R1/Kimi checkpoints)"
                        .into(),
                ))
            }
            (_, None) => None,
        };
    let resume = fingerprint(opts, &input.files());
    let adopt = check_output(&opts.input, &opts.output, opts.force, &resume)?;
    let ignore = ignore_list(input.num_hidden_layers, input.num_layers);

    // Plan every shard (and validate every FP8 weight) before writing anything.
    let mut plans: Vec<(Vec<Planned>, HashMap<usize, BlockScales>)> = Vec::new();
    let mut report = ConvertReport::default();
    let n_shards = input.shards.len();
    for (si, (_, tensors)) in input.shards.iter().enumerate() {
        let mut planned: Vec<Planned> = Vec::new();
        let mut scales = HashMap::new();
        for (name, t) in tensors {
            if name.ends_with("_scale_inv") {
                continue;
            }
            report.input_bytes += t.end - t.start;
            if let Some(prefix) = name.strip_suffix(".weight_packed") {
                // Kimi-K2-Thinking's int4 (routed experts): dequantized to bf16 (§2.3), then
                // written as an FP8 weight's bf16 values would be.
                let (rows, cols, scales) = input.packed_int4(si, prefix, t)?;
                let wname = format!("{prefix}.weight");
                let start = t.start;
                if opts.mode.int8() && !ignored(&ignore, &wname) {
                    report.int8_weights += 1;
                    plan_int8(&mut planned, &wname, &[rows, cols], |scale_out| {
                        Source::Int4 {
                            start,
                            scales,
                            scale_out: Some(scale_out),
                        }
                    });
                } else {
                    report.bf16_weights += 1;
                    planned.push(Planned {
                        out: out_tensor(&wname, "BF16", &[rows, cols]),
                        source: Source::Int4 {
                            start,
                            scales,
                            scale_out: None,
                        },
                    });
                }
                continue;
            }
            let packed_part = [".weight_scale", ".weight_shape"].iter().any(|suffix| {
                name.strip_suffix(suffix).is_some_and(|prefix| {
                    input
                        .location
                        .contains_key(&format!("{prefix}.weight_packed"))
                })
            });
            if packed_part {
                // Read with its packed weight.
                continue;
            }
            let size = safetensors_io::dtype_size(&t.dtype).unwrap_or(0);
            if size == 1 && t.dtype != "F8_E4M3" {
                return Err(ConvertError::Tensor {
                    tensor: name.clone(),
                    file: input.shard_path(si),
                    why: format!(
                        "has dtype {}; the only 1-byte dtype of an FP8 checkpoint is F8_E4M3 \
                         (is this checkpoint already converted?)",
                        t.dtype
                    ),
                });
            }
            if matches!(t.dtype.as_str(), "BF16" | "F16" | "F32")
                && opts.mode.int8()
                && is_quantized_linear(name)
                && t.shape.len() == 2
                && !ignored(&ignore, name)
            {
                // An unquantized checkpoint's Linear weight (one DeepSeek ships in FP8):
                // quantized from its bf16 values as an FP8 weight is after dequantization
                // (F16/F32 rounded to bf16 first, as the seed's bf16 default dtype loads them).
                report.int8_weights += 1;
                let dtype = dtype_static(&t.dtype);
                plan_int8(&mut planned, name, &t.shape, |scale_out| {
                    Source::Int8Float {
                        start: t.start,
                        dtype,
                        scale_out,
                    }
                });
                continue;
            }
            // The output is a bf16 checkpoint: F16/F32 tensors are rounded to bf16, as the
            // seed's bf16 default dtype loads them, but for the router's correction bias,
            // which DeepSeek's release keeps in F32.
            if matches!(t.dtype.as_str(), "F16" | "F32")
                && !name.ends_with("e_score_correction_bias")
            {
                if is_quantized_linear(name) && t.shape.len() == 2 {
                    report.bf16_weights += 1;
                }
                planned.push(Planned {
                    out: out_tensor(name, "BF16", &t.shape),
                    source: Source::ToBf16 {
                        start: t.start,
                        dtype: dtype_static(&t.dtype),
                    },
                });
                continue;
            }
            if t.dtype != "F8_E4M3" {
                planned.push(Planned {
                    out: out_tensor(name, dtype_static(&t.dtype), &t.shape),
                    source: Source::Copy { start: t.start },
                });
                continue;
            }
            let bs = input.block_scales(si, name, t)?;
            let scale = planned.len();
            scales.insert(scale, bs);
            let keep_bf16 = !opts.mode.int8() || ignored(&ignore, name);
            if keep_bf16 {
                report.bf16_weights += 1;
                planned.push(Planned {
                    out: out_tensor(name, "BF16", &t.shape),
                    source: Source::Bf16 {
                        start: t.start,
                        scale,
                    },
                });
            } else {
                report.int8_weights += 1;
                plan_int8(&mut planned, name, &t.shape, |scale_out| Source::Int8 {
                    start: t.start,
                    scale,
                    scale_out,
                });
            }
        }
        if si + 1 == n_shards {
            if let Some(c8) = &c8 {
                for (i, &s) in c8.iter().enumerate() {
                    planned.push(Planned {
                        out: out_tensor(&ckv_scale_name(i), "F32", &[1]),
                        source: Source::Constant(s),
                    });
                }
            }
        }
        plans.push((planned, scales));
    }

    // Write into a temporary directory beside the output.
    write_through_temp(&opts.output, opts.force, &resume, adopt, |tmp, shards| {
        let pb = progress_bar(report.input_bytes, opts.progress);
        let mut weight_map = Map::new();
        for (si, (planned, scales)) in plans.into_iter().enumerate() {
            let (file_name, _) = &input.shards[si];
            let written = shards.shard(
                file_name,
                planned,
                |planned| planned.into_iter().map(|p| p.out.name).collect(),
                |planned| {
                    write_shard(
                        &input.shard_path(si),
                        &tmp.join(file_name),
                        planned,
                        &scales,
                        &pb,
                    )
                },
            )?;
            report.output_bytes += written.1;
            for name in written.0 {
                report.tensors_written += 1;
                weight_map.insert(name, Value::String(file_name.clone()));
            }
            report.shards += 1;
        }
        report.resumed = shards.resumed;
        pb.finish_and_clear();
        let mut config = input.config.clone();
        config.remove("quantization_config");
        if opts.mode.int8() {
            config.insert(
                "quantization_config".into(),
                w8a8_quantization_config(&ignore, opts.mode == QuantMode::W8A8C8),
            );
        }
        finish_dir(&input.dir, tmp, &opts.output, config, weight_map)
    })?;
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// A weight that is dequantized or quantized row by row needs rows and columns: a zero
/// dimension is a corrupt header, not an empty weight.
pub(crate) fn check_weight_dims(shape: &[usize]) -> std::result::Result<(), String> {
    if shape.contains(&0) {
        return Err(format!(
            "has shape {shape:?}; weights need non-zero dimensions (a corrupt or truncated \
             checkpoint: re-download or re-export the shard)"
        ));
    }
    Ok(())
}

fn dtype_static(d: &str) -> &'static str {
    match d {
        "BOOL" => "BOOL",
        "U8" => "U8",
        "I8" => "I8",
        "F8_E4M3" => "F8_E4M3",
        "F8_E5M2" => "F8_E5M2",
        "F8_E8M0" => "F8_E8M0",
        "BF16" => "BF16",
        "F16" => "F16",
        "I16" => "I16",
        "U16" => "U16",
        "F32" => "F32",
        "I32" => "I32",
        "U32" => "U32",
        "F64" => "F64",
        "I64" => "I64",
        _ => "U64",
    }
}

fn out_tensor(name: &str, dtype: &'static str, shape: &[usize]) -> OutTensor {
    OutTensor {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        offset: 0,
    }
}

/// `p` absolute with symlinks resolved and `.`/`..` taken out: part by part, each prefix that
/// exists canonicalized (so a `..` after a link goes to the link target's parent), a link whose
/// target does not exist yet followed to that target, the parts that do not exist yet taken as
/// written.
fn resolve(p: &Path) -> PathBuf {
    resolve_within(p, &mut 40)
}

/// [`resolve`], following at most `links` more dangling links in all (as Linux follows 40).
fn resolve_within(p: &Path, links: &mut usize) -> PathBuf {
    use std::path::Component;
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let mut r = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::Prefix(_) | Component::RootDir => r.push(c.as_os_str()),
            Component::CurDir => {}
            Component::ParentDir => {
                r.pop();
            }
            Component::Normal(part) => {
                r.push(part);
                if let Ok(real) = fs::canonicalize(&r) {
                    r = real;
                } else if let (Ok(target), true) = (fs::read_link(&r), *links > 0) {
                    // (A relative target is read from the link's directory.)
                    *links -= 1;
                    r.pop();
                    r = resolve_within(&r.join(target), links);
                }
            }
        }
    }
    r
}

/// `--output` resolved ([`resolve`]); the file system's root is refused (it would be
/// replaced whole under `--force`).
fn resolve_output(out: &Path) -> Result<PathBuf> {
    let r = resolve(out);
    if r.file_name().is_none() {
        return Err(ConvertError::Usage(format!(
            "--output {} is the file system's root ({}); give a directory for the converted \
             model",
            out.display(),
            r.display()
        )));
    }
    Ok(r)
}

/// `out` may be written: not a file, not the input or a directory holding it (`--force` would
/// delete the input with it), and empty unless `force`.
fn check_output(input: &Path, out: &Path, force: bool, resume: &str) -> Result<Option<Adopt>> {
    let (inp, outp) = (resolve(input), resolve(out));
    if let Some(p) = running_conversion(&outp) {
        return Err(ConvertError::Usage(format!(
            "a conversion into {} is running now (its partial output is {}): wait for it to \
             finish, or stop it first (the same command then goes on from what it wrote)",
            out.display(),
            p.display()
        )));
    }
    // What interrupted conversions left goes first: an output one had moved aside is back in
    // place before its emptiness is judged (and a partial output of this same conversion
    // stays, for it to resume).
    let kept = clear_stale(&outp, resume);
    if inp.starts_with(&outp) {
        return Err(ConvertError::Usage(format!(
            "--output {} is the input directory or holds it ({}); writing there would delete \
             the input: choose another output directory",
            out.display(),
            input.display()
        )));
    }
    if out.is_file() {
        return Err(ConvertError::Usage(format!(
            "{} is a file; the output must be a directory",
            out.display()
        )));
    }
    if out.is_dir() {
        let non_empty = fs::read_dir(out)
            .map_err(|e| ConvertError::io(out, e))?
            .flatten()
            .any(|e| {
                kept.as_ref().is_none_or(|k| {
                    e.file_name().as_os_str() != k.dir.file_name().unwrap_or_default()
                })
            });
        if non_empty && !force {
            return Err(ConvertError::Usage(format!(
                "{} exists and is not empty; pass --force to replace it",
                out.display()
            )));
        }
    }
    Ok(kept)
}

/// Runs `write` on a new temporary directory, then puts it in place as `out`; on an error the
/// temporary directory is removed and `out` is untouched.
///
/// The directory is built beside `out` and renamed into its place where `out` does not exist;
/// where it is a directory (empty, or replaced under `force`; a mounted volume, as containers
/// give one), it is built inside `out` and its files are moved up at the end. `out` is
/// replaced only under `force`: one that was empty at the start and holds something at the end
/// (another conversion, a user's file) is left alone, the new output kept beside it under a
/// name the error gives.
fn write_through_temp(
    out: &Path,
    force: bool,
    resume: &str,
    adopt: Option<Adopt>,
    write: impl FnOnce(&Path, &mut Shards) -> Result<()>,
) -> Result<()> {
    let (tmp, inside) = temp_dir_for(out, adopt)?;
    // Two conversions into one output started together both passed `check_output`; each
    // looks again now that its own partial directory is locked, so the later of the two
    // looks sees the other and stops (both stop if they look at once).
    if let Some(p) = running_conversion(&resolve(out)) {
        keep_for_resume(&tmp);
        release_lock();
        return Err(ConvertError::Usage(format!(
            "a conversion into {} started at the same time as this one (its partial output \
             is {}): wait for it to finish, or stop it first (the same command then goes on \
             from what it wrote)",
            out.display(),
            p.display()
        )));
    }
    set_partial(Some(tmp.clone()));
    let written = Shards::open(&tmp, resume).and_then(|mut shards| {
        if !shards.done.is_empty() {
            eprintln!(
                "convert: resuming the interrupted conversion in {}: {} written already",
                tmp.display(),
                shards_word(shards.done.len())
            );
        }
        write(&tmp, &mut shards)
    });
    // Complete (or failed): from here an interrupt leaves it (the handler removes only what is
    // unfinished).
    set_partial(None);
    if let Err(e) = written {
        // Shards written and synced are kept for the same conversion run again (after a full
        // disk, say); nothing else is.
        // (The lock is held until then: no other run takes the directory meanwhile.)
        let kept = keep_for_resume(&tmp);
        release_lock();
        return Err(match kept {
            Some(n) => ConvertError::Usage(format!(
                "{e}\n({} written so far kept in {}: the same command, once \
                 this is fixed, goes on from there; delete it to start over)",
                shards_word(n),
                tmp.display()
            )),
            None => e,
        });
    }
    // (An interrupt waits for the files to be in place: [`placed_output`].)
    let placing = PLACING.lock().unwrap_or_else(|e| e.into_inner());
    let placed = if inside {
        move_up(&tmp, out, force)
    } else {
        rename_over(&tmp, out, force)
    };
    if placed.is_ok() {
        *PLACED.lock().unwrap_or_else(|e| e.into_inner()) = Some(out.to_path_buf());
    }
    drop(placing);
    // A finished conversion that cannot be put in place is kept, not lost.
    let done = placed.map_err(|e| match e {
        ConvertError::Io { .. } if tmp.exists() => keep_finished(&tmp, out, &e),
        e => e,
    });
    release_lock();
    done
}

/// What a conversion writing in a partial directory has finished, for the same conversion run
/// again after an interrupt or a failure: `.cachalot-convert-resume` there holds the
/// conversion's fingerprint ([`fingerprint`]: its inputs, options and converter) on its first
/// line, then one line per output shard written and synced, `BYTES NAME`.
pub(crate) struct Shards {
    file: File,
    path: PathBuf,
    /// Shards an earlier run wrote, still there at the size and modification time it
    /// recorded.
    done: HashMap<String, (u64, u128)>,
    /// Of those, how many this run took.
    pub(crate) resumed: usize,
}

/// The name of [`Shards`]' record in a partial directory.
const RESUME_FILE: &str = ".cachalot-convert-resume";

impl Shards {
    /// The record of partial directory `dir` for the conversion `fingerprint`: the shards it
    /// lists that are whole, where it is that conversion's; else a new record.
    fn open(dir: &Path, fingerprint: &str) -> Result<Shards> {
        let path = dir.join(RESUME_FILE);
        let mut done = HashMap::new();
        let mut ours = false;
        if let Ok(text) = fs::read_to_string(&path) {
            let mut lines = text.lines();
            ours = lines.next() == Some(fingerprint);
            for l in lines.filter(|_| ours) {
                let Some((bytes, rest)) = l.split_once(' ') else {
                    continue;
                };
                let Some((mtime, name)) = rest.split_once(' ') else {
                    continue;
                };
                let recorded = (bytes.parse::<u64>(), mtime.parse::<u128>());
                if let (Ok(b), Ok(t)) = recorded {
                    if shard_stamp(&dir.join(name)) == Some((b, t)) {
                        done.insert(name.to_string(), (b, t));
                    }
                }
            }
        }
        // The record, from now on, holds exactly the shards found whole (a line of one no
        // longer whole would vouch for a rewrite of it cut short), written whole by rename.
        let mut text = format!("{fingerprint}\n");
        for (name, (b, t)) in &done {
            text.push_str(&format!("{b} {t} {name}\n"));
        }
        let new = dir.join(format!("{RESUME_FILE}.new"));
        fs::write(&new, text)
            .and_then(|()| fs::rename(&new, &path))
            .map_err(|e| ConvertError::io(&path, e))?;
        if ours {
            // What else an earlier run left (a shard it had begun, side files) goes: the
            // output is made again from here as a fresh run makes it. (A shard named with a
            // directory keeps that directory.)
            let keep: Vec<String> = done
                .keys()
                .filter_map(|k| {
                    Path::new(k).components().find_map(|c| match c {
                        std::path::Component::Normal(n) => Some(n.to_string_lossy().into_owned()),
                        _ => None,
                    })
                })
                .collect();
            for e in fs::read_dir(dir)
                .map_err(|e| ConvertError::io(dir, e))?
                .flatten()
            {
                let name = e.file_name().to_string_lossy().into_owned();
                if !BOOKKEEPING.contains(&name.as_str()) && !keep.contains(&name) {
                    let p = e.path();
                    let gone = if p.is_dir() && !p.is_symlink() {
                        fs::remove_dir_all(&p)
                    } else {
                        fs::remove_file(&p)
                    };
                    gone.map_err(|e| ConvertError::io(&p, e))?;
                }
            }
        }
        // Appended to only: lines of shards written and synced.
        let file = fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| ConvertError::io(&path, e))?;
        Ok(Shards {
            file,
            path,
            done,
            resumed: 0,
        })
    }

    /// The bytes of output shard `name` if an earlier run of this conversion wrote it whole.
    fn done(&self, name: &str) -> Option<u64> {
        self.done.get(name).map(|&(b, _)| b)
    }

    /// Output shard `name` from `plan`: its tensors' names and its bytes, written by `write`
    /// (which syncs it) and recorded, unless an earlier run of this conversion wrote it (then
    /// `names` reads the names off the plan).
    pub(crate) fn shard<P>(
        &mut self,
        name: &str,
        plan: P,
        names: impl FnOnce(P) -> Vec<String>,
        write: impl FnOnce(P) -> Result<(Vec<String>, u64)>,
    ) -> Result<(Vec<String>, u64)> {
        if let Some(bytes) = self.done(name) {
            self.resumed += 1;
            return Ok((names(plan), bytes));
        }
        let written = write(plan)?;
        self.record(name)?;
        Ok(written)
    }

    /// Output shard `name` is written and synced: its size and modification time go on the
    /// record.
    fn record(&mut self, name: &str) -> Result<()> {
        use std::io::Write;
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let shard = dir.join(name);
        let (bytes, mtime) = shard_stamp(&shard).ok_or_else(|| {
            ConvertError::io(&shard, std::io::Error::other("the written shard is gone"))
        })?;
        self.file
            .write_all(format!("{bytes} {mtime} {name}\n").as_bytes())
            .and_then(|()| self.file.sync_data())
            .map_err(|e| ConvertError::io(&self.path, e))
    }
}

/// A shard file's size and modification time (ns since the epoch), what a resumed conversion
/// takes it whole by; None where it is not a file.
fn shard_stamp(p: &Path) -> Option<(u64, u128)> {
    let m = fs::metadata(p).ok().filter(|m| m.is_file())?;
    Some((m.len(), mtime_ns(&m)?))
}

/// A file's modification time in ns since the epoch, where the file system keeps one.
fn mtime_ns(m: &fs::Metadata) -> Option<u128> {
    let t = m.modified().ok()?;
    Some(t.duration_since(std::time::UNIX_EPOCH).ok()?.as_nanos())
}

/// `n shard(s)`.
pub fn shards_word(n: usize) -> String {
    format!("{n} shard{}", if n == 1 { "" } else { "s" })
}

/// How many whole shards partial directory `dir` records (None: none, and `dir` is removed).
fn keep_for_resume(dir: &Path) -> Option<usize> {
    let n = fs::read_to_string(dir.join(RESUME_FILE))
        .map_or(0, |t| t.lines().count().saturating_sub(1));
    if n == 0 {
        let _ = fs::remove_dir_all(dir);
        return None;
    }
    Some(n)
}

/// A conversion's identity for [`Shards`]: this converter (its version and executable), the
/// options that shape the output, and every input file it reads (path, size, modification
/// time): a partial output is resumed only by the same conversion of the same inputs.
pub(crate) fn fingerprint(opts: &ConvertOptions, input_files: &[PathBuf]) -> String {
    let stamp = |p: &Path| -> Value {
        match fs::metadata(p) {
            Ok(m) => {
                let mtime = mtime_ns(&m).unwrap_or(0);
                json!([resolve(p).display().to_string(), m.len(), mtime.to_string()])
            }
            Err(_) => json!([p.display().to_string()]),
        }
    };
    let mut files: Vec<Value> = input_files.iter().map(|p| stamp(p)).collect();
    for extra in [&opts.c8_scales, &opts.quant_param_path]
        .into_iter()
        .flatten()
    {
        files.push(stamp(extra));
        if let Ok(rd) = fs::read_dir(extra) {
            let mut inner: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
            inner.sort();
            files.extend(inner.iter().map(|p| stamp(p)));
        }
    }
    let exe = std::env::current_exe().map_or(Value::Null, |p| stamp(&p));
    json!({
        "converter": env!("CARGO_PKG_VERSION"),
        "exe": exe,
        "mode": opts.mode.name(),
        "files": files,
    })
    .to_string()
}

/// The finished `tmp` could not become `out` (`why`): it is kept under the name
/// [`keep_beside`] gives, and the error says where.
fn keep_finished(tmp: &Path, out: &Path, why: &ConvertError) -> ConvertError {
    ConvertError::Usage(format!(
        "the conversion finished but could not be put in place as {} ({why}); the converted \
         model is in {}: move its files there yourself",
        out.display(),
        keep_converted(tmp, out).display()
    ))
}

/// A directory is empty.
fn is_empty_dir(dir: &Path) -> bool {
    fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none())
}

/// The finished `tmp` beside `out` becomes `out`: a rename where `out` is absent or empty; under
/// `force` the old `out` moves aside, the new one in, and only then is the old one deleted (back
/// in place if the new one cannot go there).
fn rename_over(tmp: &Path, out: &Path, force: bool) -> Result<()> {
    // Everything written is on disk before the name says the output is complete, and the
    // rename is, after it: a power loss leaves the old state or the whole new one.
    sync_tree(tmp)?;
    drop_bookkeeping(tmp);
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let synced = |r: Result<()>| -> Result<()> {
        r?;
        sync_path(parent)
    };
    if !out.exists() || (out.is_dir() && is_empty_dir(out)) {
        // (A rename replaces an empty directory; one filled meanwhile fails: ENOTEMPTY.)
        match fs::rename(tmp, out) {
            Ok(()) => return synced(Ok(())),
            Err(_) if !force && out.exists() && !is_empty_dir(out) => {}
            Err(e) => return Err(ConvertError::io(out, e)),
        }
    }
    if !force {
        return Err(keep_beside(tmp, out));
    }
    let old = sibling(out, "old");
    if old.exists() {
        fs::remove_dir_all(&old).map_err(|e| ConvertError::io(&old, e))?;
    }
    fs::rename(out, &old).map_err(|e| ConvertError::io(out, e))?;
    if let Err(e) = fs::rename(tmp, out) {
        let _ = fs::rename(&old, out);
        return Err(ConvertError::io(out, e));
    }
    synced(fs::remove_dir_all(&old).map_err(|e| ConvertError::io(&old, e)))
}

/// A finished partial directory's lock and [`Shards`] record go just before it takes its
/// place (not before its last syncs: a run stopped there is resumed, with nothing left to
/// write). The lock stays held through its open file.
fn drop_bookkeeping(tmp: &Path) {
    for f in BOOKKEEPING {
        let _ = fs::remove_file(tmp.join(f));
    }
}

/// A partial directory's files that are not the output's.
const BOOKKEEPING: [&str; 2] = [LOCK_FILE, RESUME_FILE];

/// fsync of one file or directory.
fn sync_path(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| ConvertError::io(path, e))
}

/// fsync of every file under `dir` (shards already synced cost nothing more) and of the
/// directories themselves.
fn sync_tree(dir: &Path) -> Result<()> {
    for e in fs::read_dir(dir).map_err(|e| ConvertError::io(dir, e))? {
        let e = e.map_err(|e| ConvertError::io(dir, e))?;
        let ft = e
            .file_type()
            .map_err(|err| ConvertError::io(&e.path(), err))?;
        if ft.is_dir() {
            sync_tree(&e.path())?;
        } else if ft.is_file() {
            sync_path(&e.path())?;
        }
    }
    sync_path(dir)
}

/// `out` was filled while the conversion ran (without `--force`): the finished output goes to
/// `.{name}.converted-{pid}` beside `tmp` and the error says so.
fn keep_beside(tmp: &Path, out: &Path) -> ConvertError {
    let kept = keep_converted(tmp, out);
    ConvertError::Usage(format!(
        "{} was empty when the conversion started and is not now (another conversion, or files \
         put there meanwhile); it is left as it is, and the converted model is in {}: move it \
         into place, or convert again with --force to replace {}",
        out.display(),
        kept.display(),
        out.display()
    ))
}

/// A finished output `tmp` that cannot take its place as `out`, renamed to
/// `.{name}.converted-{pid}` beside it; where it now is (where it was, if it cannot be renamed).
fn keep_converted(tmp: &Path, out: &Path) -> PathBuf {
    let kept = tmp.with_file_name(format!(
        ".{}.converted-{}",
        out.file_name()
            .map_or("output".into(), |n| n.to_string_lossy().into_owned()),
        std::process::id()
    ));
    match fs::rename(tmp, &kept) {
        Ok(()) => kept,
        Err(_) => tmp.to_path_buf(),
    }
}

/// The finished `tmp` inside `out` becomes `out`'s contents: under `force` what else `out`
/// holds is deleted first; without it `out` must hold nothing else.
fn move_up(tmp: &Path, out: &Path, force: bool) -> Result<()> {
    // (Synced as [`rename_over`] syncs: the files before they move, `out` after.)
    sync_tree(tmp)?;
    // (The record stays until every file has moved: a run stopped while they move is resumed,
    // with --force, as OUT then holds some of them.)
    let others: Vec<PathBuf> = fs::read_dir(out)
        .map_err(|e| ConvertError::io(out, e))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p != tmp)
        .collect();
    if !others.is_empty() {
        if !force {
            drop_bookkeeping(tmp);
            return Err(keep_beside(tmp, out));
        }
        for p in &others {
            let gone = if p.is_dir() && !p.is_symlink() {
                fs::remove_dir_all(p)
            } else {
                fs::remove_file(p)
            };
            gone.map_err(|e| ConvertError::io(p, e))?;
        }
    }
    for e in fs::read_dir(tmp).map_err(|e| ConvertError::io(tmp, e))? {
        let e = e.map_err(|e| ConvertError::io(tmp, e))?;
        if BOOKKEEPING.iter().any(|b| e.file_name() == *b) {
            continue;
        }
        let to = out.join(e.file_name());
        fs::rename(e.path(), &to).map_err(|e| ConvertError::io(&to, e))?;
    }
    drop_bookkeeping(tmp);
    fs::remove_dir(tmp).map_err(|e| ConvertError::io(tmp, e))?;
    sync_path(out)
}

/// Held while a finished output's files are put in place ([`placed_output`]).
static PLACING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The output a conversion has put in place.
static PLACED: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

/// For a Ctrl-C or SIGTERM handler with no partial output to remove
/// ([`remove_partial_output`]): waits until a finished output's files are in place (a move
/// stopped halfway would leave half a model in an existing directory) and returns it, if one
/// was put in place.
pub fn placed_output() -> Option<PathBuf> {
    let _placing = PLACING.lock().unwrap_or_else(|e| e.into_inner());
    PLACED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The partial output directory being written now (for [`remove_partial_output`]).
static PARTIAL: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

fn set_partial(p: Option<PathBuf>) {
    if let Ok(mut g) = PARTIAL.lock() {
        *g = p;
    }
}

/// The output directory a conversion is writing, if one is under way, for a Ctrl-C or SIGTERM
/// handler: removed, unless it holds whole shards (then kept for the same command to resume,
/// with their count).
pub fn remove_partial_output() -> Option<(PathBuf, Option<usize>)> {
    let p = PARTIAL.lock().ok()?.take()?;
    let kept = keep_for_resume(&p);
    Some((p, kept))
}

/// A partial directory's lock file, held (`flock`) while its conversion runs: a conversion in
/// another PID namespace (a container sharing the disk) or a killed one not yet reaped is told
/// apart from one that has ended by whether the lock can be taken, not by its pid alone.
const LOCK_FILE: &str = ".cachalot-convert.lock";

/// The lock of the partial directory this process writes.
static LOCK: std::sync::Mutex<Option<File>> = std::sync::Mutex::new(None);

fn hold_lock(dir: &Path) -> Result<()> {
    let path = dir.join(LOCK_FILE);
    let f = File::create(&path).map_err(|e| ConvertError::io(&path, e))?;
    f.try_lock()
        .map_err(|e| ConvertError::io(&path, std::io::Error::other(e.to_string())))?;
    keep_lock(f);
    Ok(())
}

/// Holds lock file `f` (locked) until [`release_lock`].
fn keep_lock(f: File) {
    if let Ok(mut g) = LOCK.lock() {
        *g = Some(f);
    }
}

fn release_lock() {
    if let Ok(mut g) = LOCK.lock() {
        g.take();
    }
}

/// `.{name}.{what}-{pid}` beside `out`.
fn sibling(out: &Path, what: &str) -> PathBuf {
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let base = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    parent.join(format!(".{base}.{what}-{}", std::process::id()))
}

/// Whether process `pid`, another than this one, has ended, as Linux's `/proc` says (false
/// without `/proc`: nothing is known there): what a directory named after a process that left
/// it behind is removed on.
pub fn process_gone(pid: u32) -> bool {
    pid != std::process::id()
        && Path::new("/proc/self").exists()
        && !Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether the conversion that wrote partial directory `dir` (named after `pid`) has ended: its
/// lock can be taken (whatever namespace it ran in; Some of the lock, held), or, where it holds
/// no lock file, its process is gone (Some(None)). None while it runs.
fn abandoned_lock(dir: &Path, pid: u32) -> Option<Option<File>> {
    // (A directory named after this process's id is another's where PID namespaces differ,
    // as two containers' first processes: its lock tells.)
    match open_lock(&dir.join(LOCK_FILE)) {
        Ok(f) => match f.try_lock() {
            Ok(()) => Some(Some(f)),
            Err(std::fs::TryLockError::WouldBlock) => None,
            // A file system without locks: the process id tells.
            Err(std::fs::TryLockError::Error(_)) => process_gone(pid).then_some(None),
        },
        Err(_) => process_gone(pid).then_some(None),
    }
}

/// A lock file opened to be locked (for writing: NFS emulates `flock` with write locks).
fn open_lock(path: &Path) -> std::io::Result<File> {
    fs::OpenOptions::new().read(true).write(true).open(path)
}

/// An interrupted run's partial directory this conversion goes on with, and its lock (held).
pub(crate) struct Adopt {
    dir: PathBuf,
    lock: Option<File>,
}

/// Removes partial outputs for `out` that conversions no longer running left behind
/// (`.{name}.partial-{pid}` beside `out` or inside it, and `.{name}.old-{pid}` of a process
/// that is gone; Linux only, where `/proc` says which processes run); an old output moved
/// aside by a conversion that died before the new one took its place goes back. Returns what
/// it removed.
#[cfg(test)]
fn remove_stale_partials(out: &Path) -> Vec<PathBuf> {
    stale_partials(out, "").0
}

/// [`stale_partials`] for the conversion `resume`, saying what it removed; the partial
/// directory kept for it, if any.
fn clear_stale(out: &Path, resume: &str) -> Option<Adopt> {
    let (removed, kept) = stale_partials(out, resume);
    for p in removed {
        eprintln!(
            "convert: removed {}, left by an interrupted conversion that this one does not \
             continue",
            p.display()
        );
    }
    kept
}

/// The partial directory of a conversion into `out` that is running now (its lock held), if
/// any: beside `out` or inside it.
fn running_conversion(out: &Path) -> Option<PathBuf> {
    let (parent, name) = (out.parent()?, out.file_name()?.to_string_lossy());
    let prefix = format!(".{name}.partial-");
    [parent, out]
        .into_iter()
        .filter_map(|place| fs::read_dir(place).ok())
        .flat_map(|entries| entries.flatten())
        .find_map(|e| {
            let pid = e
                .file_name()
                .to_string_lossy()
                .strip_prefix(&prefix)?
                .parse()
                .ok()?;
            let p = e.path();
            (pid != std::process::id() && abandoned_lock(&p, pid).is_none()).then_some(p)
        })
}

/// [`remove_stale_partials`], except that one partial directory whose [`Shards`] record
/// belongs to the conversion `resume` is kept for it to finish (returned second).
fn stale_partials(out: &Path, resume: &str) -> (Vec<PathBuf>, Option<Adopt>) {
    let mut removed = Vec::new();
    let mut kept = None;
    let (Some(parent), Some(name)) = (out.parent(), out.file_name()) else {
        return (removed, kept);
    };
    let name = name.to_string_lossy();
    let mut places = vec![parent.to_path_buf()];
    if out.is_dir() {
        places.push(out.to_path_buf());
    }
    for place in places {
        let Ok(entries) = fs::read_dir(&place) else {
            continue;
        };
        for e in entries.flatten() {
            let file = e.file_name();
            let file = file.to_string_lossy();
            let found = [".partial-", ".old-"].iter().find_map(|what| {
                let pid = file
                    .strip_prefix('.')?
                    .strip_prefix(name.as_ref())?
                    .strip_prefix(what)?
                    .parse::<u32>()
                    .ok()?;
                Some((*what, pid))
            });
            let Some((what, pid)) = found else {
                continue;
            };
            let p = e.path();
            // (A partial directory's lock, taken to see that its conversion ended, is kept for
            // the one this conversion goes on with: no other run can take it meanwhile.)
            let lock = match what {
                ".partial-" => match abandoned_lock(&p, pid) {
                    Some(lock) => lock,
                    None => continue,
                },
                _ if process_gone(pid) && place == parent => None,
                _ => continue,
            };
            let resumable = || {
                fs::read_to_string(p.join(RESUME_FILE))
                    .is_ok_and(|t| !resume.is_empty() && t.lines().next() == Some(resume))
            };
            if what == ".partial-" && kept.is_none() && resumable() {
                kept = Some(Adopt { dir: p, lock });
                continue;
            }
            drop(lock);
            if what == ".old-" && !out.exists() {
                if fs::rename(&p, out).is_ok() {
                    eprintln!(
                        "convert: put back {}, the output an interrupted conversion had moved \
                         aside",
                        out.display()
                    );
                }
                continue;
            }
            if fs::remove_dir_all(&p).is_ok() {
                removed.push(p);
            }
        }
    }
    (removed, kept)
}

/// Completes a converted directory (`tmp`, to become `out`): the input's side files, `config`,
/// and the regenerated index
/// `{"metadata": {}, "weight_map": ...}`.
fn finish_dir(
    input_dir: &Path,
    tmp: &Path,
    out: &Path,
    config: Map<String, Value>,
    weight_map: Map<String, Value>,
) -> Result<()> {
    copy_side_files(input_dir, tmp, &resolve(out))?;
    write_json(&tmp.join(CONFIG_FILE), &Value::Object(config))?;
    write_json(
        &tmp.join(INDEX_FILE),
        &json!({"metadata": {}, "weight_map": weight_map}),
    )
}

/// Maps the input shard and creates the output shard with the header of `outs`, whose offsets
/// are set (their order is kept); returns the map, the output file and its length.
fn start_shard(
    input: &Path,
    output: &Path,
    outs: &mut [OutTensor],
) -> Result<(memmap2::Mmap, File, u64)> {
    let file = File::open(input).map_err(|e| ConvertError::io(input, e))?;
    // SAFETY: the input is only read; it is not expected to change during the conversion (a
    // concurrent writer could make us read torn data, never unsound Rust values: bytes only).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ConvertError::io(input, e))?;
    let mut sorted = outs.to_vec();
    let (header, total) = layout(&mut sorted);
    let offsets: HashMap<&str, u64> = sorted.iter().map(|o| (o.name.as_str(), o.offset)).collect();
    for o in outs.iter_mut() {
        o.offset = offsets[o.name.as_str()];
    }
    let out = File::create(output).map_err(|e| ConvertError::io(output, e))?;
    out.set_len(total)
        .map_err(|e| ConvertError::io(output, e))?;
    out.write_all_at(&header, 0)
        .map_err(|e| ConvertError::io(output, e))?;
    Ok((map, out, total))
}

/// A new directory for the output while it is written, with this process's lock in it, and
/// whether it is inside `out` ([`write_through_temp`]): beside `out` where `out` can be renamed,
/// else inside it.
fn temp_dir_for(out: &Path, adopt: Option<Adopt>) -> Result<(PathBuf, bool)> {
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    // The output is built beside where it will go: a parent that cannot hold a directory is
    // the --output's fault, said so.
    let unusable = |what: &Path, e: std::io::Error| {
        // (A file where the path wants a directory: said so, not as "File exists".)
        if let Some(file) = what
            .ancestors()
            .find(|a| a.exists())
            .filter(|a| !a.is_dir())
        {
            return ConvertError::Usage(format!(
                "--output {}: {} is a file, not a directory; give an output path in a writable \
                 directory",
                out.display(),
                file.display()
            ));
        }
        ConvertError::Usage(format!(
            "--output {}: cannot create {} ({e}); give an output path in a writable directory",
            out.display(),
            what.display()
        ))
    };
    fs::create_dir_all(&parent).map_err(|e| unusable(&parent, e))?;
    let beside = sibling(out, "partial");
    let within = out.join(beside.file_name().expect("a sibling has a name"));
    // The same conversion's partial output goes on where it is, under this process's name.
    if let Some(Adopt { dir, lock }) = adopt {
        let inside = dir.parent() == Some(out);
        let tmp = if inside { within } else { beside };
        fs::rename(&dir, &tmp).map_err(|e| ConvertError::io(&dir, e))?;
        // (The lock follows its file through the rename.)
        match lock {
            Some(f) => keep_lock(f),
            None => hold_lock(&tmp)?,
        }
        return Ok((tmp, inside));
    }
    // An existing directory is written into, as the seed's converter does (a shell or process
    // in it stays in the output, which keeps its owner and mode), and a mount point cannot be
    // renamed: build inside it.
    let build_inside = out.is_dir() || is_mount_point(out, &parent);
    // A directory of this name whose lock is held is another conversion's (a process of
    // another PID namespace with this id): it is left alone, and this one stops.
    for tmp in [&beside, &within] {
        if open_lock(&tmp.join(LOCK_FILE))
            .is_ok_and(|f| matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock)))
        {
            return Err(ConvertError::Usage(format!(
                "{}: another conversion is writing there (one in another PID namespace whose \
                 process id is this one's, {}): wait for it to end, or give another --output",
                tmp.display(),
                std::process::id()
            )));
        }
    }
    let make = |tmp: &Path| -> std::io::Result<()> {
        if tmp.exists() {
            fs::remove_dir_all(tmp)?;
        }
        fs::create_dir(tmp)
    };
    let (tmp, inside) = if build_inside {
        make(&within).map_err(|e| unusable(&within, e))?;
        (within, true)
    } else {
        match make(&beside) {
            Ok(()) => (beside, false),
            // A parent this process cannot write, around an output directory it can.
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied && out.is_dir() => {
                make(&within).map_err(|_| unusable(&beside, e))?;
                (within, true)
            }
            Err(e) => return Err(unusable(&beside, e)),
        }
    };
    if let Err(e) = hold_lock(&tmp) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok((tmp, inside))
}

/// Whether directory `dir` is a mount point: on another device than its parent, or listed as
/// one in `/proc/self/mountinfo` (a bind mount on its parent's own file system, which a rename
/// cannot replace either: EBUSY).
fn is_mount_point(dir: &Path, parent: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(d), Ok(p)) = (fs::metadata(dir), fs::metadata(parent)) else {
        return false;
    };
    if !d.is_dir() {
        return false;
    }
    if d.dev() != p.dev() {
        return true;
    }
    let (Ok(dir), Ok(info)) = (
        fs::canonicalize(dir),
        fs::read_to_string("/proc/self/mountinfo"),
    ) else {
        return false;
    };
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| Path::new(&unescape_mountinfo(m)) == dir)
}

/// A mountinfo path field: space, tab, newline and backslash are written as `\ooo` octal.
fn unescape_mountinfo(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn progress_bar(total: u64, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(total);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "converting {bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    pb
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(v).expect("JSON serializes");
    text.push('\n');
    fs::write(path, text).map_err(|e| ConvertError::io(path, e))
}

/// Copies the input's files other than weights (recursively, keeping relative paths): the
/// seed copies `*.py` and `*.json`; the tokenizer and template files a model needs besides
/// (Kimi-K2's `tiktoken.model`, `chat_template.jinja`, sentencepiece `*.model`, `merges.txt`,
/// the model card) come along. Weight files (`*.safetensors`, `*.bin`, `*.pt`, `*.pth`,
/// `*.gguf`, `*.ckpt`, `*.h5`, `*.msgpack`, `*.npz`) and hidden entries do not; the caller
/// writes config.json and the index over the copies.
fn copy_side_files(from: &Path, to: &Path, skip: &Path) -> Result<()> {
    const WEIGHTS: &[&str] = &[
        ".safetensors",
        ".bin",
        ".pt",
        ".pth",
        ".gguf",
        ".ckpt",
        ".h5",
        ".msgpack",
        ".npz",
        ".npy",
        ".onnx",
        ".onnx_data",
        ".pdparams",
        ".tflite",
        ".ot",
    ];
    for e in fs::read_dir(from).map_err(|e| ConvertError::io(from, e))? {
        let e = e.map_err(|e| ConvertError::io(from, e))?;
        let path = e.path();
        let name = e.file_name();
        let name_s = name.to_string_lossy();
        let ft = e.file_type().map_err(|err| ConvertError::io(&path, err))?;
        if name_s.starts_with('.') {
            continue;
        }
        if ft.is_dir() {
            // An output directory inside the input (an earlier conversion's) is not copied.
            if resolve(&path) == skip {
                continue;
            }
            let sub = to.join(&name);
            copy_side_files(&path, &sub, skip)?;
        } else if !WEIGHTS.iter().any(|w| name_s.ends_with(w)) && path.is_file() {
            fs::create_dir_all(to).map_err(|err| ConvertError::io(to, err))?;
            let dest = to.join(&name);
            fs::copy(&path, &dest).map_err(|err| copy_error(&path, &dest, err))?;
        }
    }
    Ok(())
}

/// A failed copy of `from` to `to`, named by the side that failed: the input where it cannot
/// be read, else the output (a full disk is the output's: said so, with the file).
fn copy_error(from: &Path, to: &Path, err: std::io::Error) -> ConvertError {
    if fs::File::open(from).is_err() {
        return ConvertError::io(from, err);
    }
    ConvertError::Io {
        path: to.to_path_buf(),
        error: std::io::Error::new(
            err.kind(),
            format!("{err}, copying {} there", from.display()),
        ),
    }
}

/// Rows (or bytes, for copies) per work item: a few MB of output each.
const ITEM_BYTES: usize = 4 << 20;

/// One unit of parallel work: rows `rows` of planned tensor `t`.
struct Item {
    t: usize,
    rows: std::ops::Range<usize>,
}

/// Writes one output shard; returns the tensor names written and the file's length.
fn write_shard(
    input: &Path,
    output: &Path,
    mut planned: Vec<Planned>,
    scales: &HashMap<usize, BlockScales>,
    pb: &indicatif::ProgressBar,
) -> Result<(Vec<String>, u64)> {
    let mut outs: Vec<OutTensor> = planned.iter().map(|p| p.out.clone()).collect();
    let (map, out, total) = start_shard(input, output, &mut outs)?;
    for (p, o) in planned.iter_mut().zip(outs) {
        p.out.offset = o.offset;
    }

    let mut items = Vec::new();
    for (t, p) in planned.iter().enumerate() {
        let (rows, row_bytes) = match p.source {
            Source::Int8Scale => continue,
            Source::Constant(_) => (1, 4),
            Source::Copy { .. } => (p.out.bytes() as usize, 1),
            // (Elements, whatever the shape.)
            Source::ToBf16 { .. } => (p.out.shape.iter().product(), 2),
            _ => (p.out.shape[0], p.out.shape[1] * 2),
        };
        let step = (ITEM_BYTES / row_bytes.max(1)).max(1);
        let mut r = 0;
        while r < rows {
            items.push(Item {
                t,
                rows: r..(r + step).min(rows),
            });
            r += step;
        }
        if rows == 0 {
            items.push(Item { t, rows: 0..0 });
        }
    }
    items.par_iter().try_for_each(|item| -> Result<()> {
        let p = &planned[item.t];
        let consumed = run_item(p, item, &planned, scales, &map, &out)
            .map_err(|e| item_error(e, input, output))?;
        pb.inc(consumed);
        Ok(())
    })?;
    drop(map);
    out.sync_all().map_err(|e| ConvertError::io(output, e))?;
    Ok((planned.into_iter().map(|p| p.out.name).collect(), total))
}

/// Produces and writes one item; returns the input bytes it consumed.
fn run_item(
    p: &Planned,
    item: &Item,
    planned: &[Planned],
    scales: &HashMap<usize, BlockScales>,
    map: &[u8],
    out: &File,
) -> std::io::Result<u64> {
    match p.source {
        Source::Copy { start } => {
            let s = start as usize + item.rows.start;
            let e = start as usize + item.rows.end;
            check_finite(&p.out, &map[s..e], item.rows.start)?;
            out.write_all_at(&map[s..e], p.out.offset + item.rows.start as u64)?;
            Ok(item.rows.len() as u64)
        }
        Source::Constant(v) => {
            out.write_all_at(&v.to_le_bytes(), p.out.offset)?;
            Ok(0)
        }
        Source::Int8Scale => Ok(0),
        Source::Int4 {
            start,
            ref scales,
            scale_out,
        } => {
            let cols = p.out.shape[1];
            let n = item.rows.len();
            let at = start as usize + item.rows.start * cols / 2;
            let packed = &map[at..at + n * cols / 2];
            let bf = dequantize_int4_rows(&p.out.name, packed, cols, item.rows.clone(), scales)?;
            check_scaled_finite(&p.out.name, &bf, cols, item.rows.start)?;
            match scale_out {
                None => {
                    let bytes: Vec<u8> = bf.iter().flat_map(|v| v.to_le_bytes()).collect();
                    out.write_all_at(&bytes, p.out.offset + (item.rows.start * cols * 2) as u64)?;
                }
                Some(so) => {
                    write_int8_rows(out, &bf, cols, item.rows.start, &p.out, &planned[so].out)?
                }
            }
            Ok((n * cols / 2) as u64)
        }
        Source::ToBf16 { start, dtype } => {
            let size = if dtype == "F32" { 4 } else { 2 };
            let at = start as usize + item.rows.start * size;
            let b = &map[at..at + item.rows.len() * size];
            check_floats(&p.out.name, dtype, b, item.rows.start)?;
            let bf: Vec<u16> = floats_of(dtype, b).into_iter().map(f32_to_bf16).collect();
            if let Some(i) = bf.iter().position(|&v| v & 0x7F80 == 0x7F80) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "tensor {}: element {} is beyond bf16's range (about 3.39e38), so the \
                         bf16 output cannot hold it; the input checkpoint is damaged",
                        p.out.name,
                        item.rows.start + i
                    ),
                ));
            }
            let bytes: Vec<u8> = bf.iter().flat_map(|v| v.to_le_bytes()).collect();
            out.write_all_at(&bytes, p.out.offset + (item.rows.start * 2) as u64)?;
            Ok((item.rows.len() * size) as u64)
        }
        Source::Int8Float {
            start,
            dtype,
            scale_out,
        } => {
            let cols = p.out.shape[1];
            let n = item.rows.len();
            let size = if dtype == "F32" { 4 } else { 2 };
            let at = start as usize + item.rows.start * cols * size;
            let b = &map[at..at + n * cols * size];
            check_floats(&p.out.name, dtype, b, item.rows.start * cols)?;
            // (bf16 → f32 → bf16 is the identity.)
            let bf: Vec<u16> = floats_of(dtype, b).into_iter().map(f32_to_bf16).collect();
            // A large F32/F16 value can round past bf16's range.
            check_scaled_finite(&p.out.name, &bf, cols, item.rows.start)?;
            write_int8_rows(
                out,
                &bf,
                cols,
                item.rows.start,
                &p.out,
                &planned[scale_out].out,
            )?;
            Ok((n * cols * size) as u64)
        }
        Source::Bf16 { start, scale } | Source::Int8 { start, scale, .. } => {
            let cols = p.out.shape[1];
            let bs = &scales[&scale];
            let n = item.rows.len();
            let mut bf = vec![0u16; n * cols];
            let codes = &map[start as usize..];
            check_fp8_codes(&p.out.name, codes, cols, item.rows.clone())?;
            dequantize_rows_to_bf16(codes, cols, item.rows.clone(), bs, &mut bf);
            check_scaled_finite(&p.out.name, &bf, cols, item.rows.start)?;
            match p.source {
                Source::Bf16 { .. } => {
                    let bytes: Vec<u8> = bf.iter().flat_map(|v| v.to_le_bytes()).collect();
                    out.write_all_at(&bytes, p.out.offset + (item.rows.start * cols * 2) as u64)?;
                }
                Source::Int8 { scale_out, .. } => {
                    let so = &planned[scale_out].out;
                    write_int8_rows(out, &bf, cols, item.rows.start, &p.out, so)?;
                }
                _ => unreachable!(),
            }
            Ok((n * cols) as u64)
        }
    }
}

/// Quantizes bf16 rows (`bf`, from row `row0` of weight `w`) to int8 per row (§5.2) and
/// writes them and their scales (`scale`, `[rows, 1]` f32).
fn write_int8_rows(
    out: &File,
    bf: &[u16],
    cols: usize,
    row0: usize,
    w: &OutTensor,
    scale: &OutTensor,
) -> std::io::Result<()> {
    let n = bf.len() / cols.max(1);
    let mut q = vec![0i8; n * cols];
    let mut s = Vec::with_capacity(n * 4);
    for (row, qrow) in bf.chunks_exact(cols).zip(q.chunks_exact_mut(cols)) {
        s.extend_from_slice(&quantize_row_bf16_to_int8(row, qrow).to_le_bytes());
    }
    let qb: Vec<u8> = q.iter().map(|&v| v as u8).collect();
    out.write_all_at(&qb, w.offset + (row0 * cols) as u64)?;
    out.write_all_at(&s, scale.offset + (row0 * 4) as u64)
}

/// Plans int8 weight `name` (`shape`, made by `source(scale index)`) and its per-row scale
/// `X.weight_scale` right after it, which the weight's task writes.
fn plan_int8(
    planned: &mut Vec<Planned>,
    name: &str,
    shape: &[usize],
    source: impl FnOnce(usize) -> Source,
) {
    let scale_out = planned.len() + 1;
    planned.push(Planned {
        out: out_tensor(name, "I8", shape),
        source: source(scale_out),
    });
    planned.push(Planned {
        out: out_tensor(&int8_scale_name(name), "F32", &[shape[0], 1]),
        source: Source::Int8Scale,
    });
}

/// `X.weight` → `X.weight_scale` (the W8A8 layout's per-row scale, §5.1).
fn int8_scale_name(name: &str) -> String {
    name.strip_suffix("weight")
        .map(|p| format!("{p}weight_scale"))
        .unwrap_or_else(|| format!("{name}_scale"))
}

/// `quantization_config` is compressed-tensors `pack-quantized` (Kimi-K2-Thinking's int4
/// release, spec `deepseek-v3-r1-kimi-k2.md` §2.3).
fn is_pack_quantized(q: &Value) -> bool {
    q.get("quant_method").and_then(Value::as_str) == Some("compressed-tensors")
        && q.get("format").and_then(Value::as_str) == Some("pack-quantized")
}

/// The int4 weights' group size of a `pack-quantized` config (`None`: the `channel` strategy,
/// one scale per row); what this converter cannot read is named by its field.
fn pack_quantized_group(q: &Value) -> std::result::Result<Option<usize>, String> {
    // Sparse (2:4) weights are stored otherwise; a dense description, or none, is ours.
    if let Some(sp) = q.get("sparsity_config").filter(|v| !v.is_null()) {
        let format = sp.get("format").and_then(Value::as_str).unwrap_or("");
        if !format.is_empty() && format != "dense" {
            return Err(format!(
                "quantization_config.sparsity_config.format is \"{format}\"; sparse weights are \
                 not converted (dense packed int4 is)"
            ));
        }
    }
    let groups = q
        .get("config_groups")
        .and_then(Value::as_object)
        .filter(|g| !g.is_empty())
        .ok_or("quantization_config.config_groups is missing or empty (pack-quantized needs the int4 weights' scheme)")?;
    let mut found: Option<Option<usize>> = None;
    for (g, group) in groups {
        let field = |k: &str| format!("quantization_config.config_groups.{g}.weights.{k}");
        let w = group
            .get("weights")
            .and_then(Value::as_object)
            .ok_or(format!(
                "quantization_config.config_groups.{g}.weights is missing or not an object"
            ))?;
        if w.get("num_bits").and_then(Value::as_u64) != Some(4) {
            return Err(format!(
                "{} is {}; packed weights are converted from 4 bits only",
                field("num_bits"),
                w.get("num_bits").unwrap_or(&Value::Null)
            ));
        }
        if !matches!(w.get("type").and_then(Value::as_str), None | Some("int")) {
            return Err(format!("{} is not \"int\"", field("type")));
        }
        if w.get("symmetric").and_then(Value::as_bool) == Some(false) {
            return Err(format!(
                "{} is false; only symmetric int4 weights (no zero point) are converted",
                field("symmetric")
            ));
        }
        let size = match w.get("strategy").and_then(Value::as_str) {
            Some("channel") => None,
            Some("group") | None => match w.get("group_size").and_then(Value::as_u64) {
                Some(n) if n > 0 => Some(n as usize),
                other => {
                    return Err(format!(
                        "{} is {}; the group strategy needs a positive group size",
                        field("group_size"),
                        other.map_or("missing".into(), |v| v.to_string())
                    ))
                }
            },
            Some(other) => {
                return Err(format!(
                    "{} is \"{other}\"; int4 weights are converted with the group or channel \
                     strategy",
                    field("strategy")
                ))
            }
        };
        if found.is_some_and(|f| f != size) {
            return Err(format!(
                "quantization_config.config_groups.{g} describes int4 weights unlike the other \
                 groups' (group sizes {:?} and {size:?}); one scheme for every packed weight is \
                 supported",
                found.flatten()
            ));
        }
        found = Some(size);
    }
    Ok(found.flatten())
}

/// A Linear weight DeepSeek-V3/R1/Kimi-K2 ship in FP8 (§5.1: the attention projections, the
/// dense and shared MLPs and the routed experts, MTP layers included; `q_proj` where
/// `q_lora_rank` is null): in a BF16 checkpoint, the weights the W8A8 modes quantize (before
/// the ignore list).
fn is_quantized_linear(name: &str) -> bool {
    const ATTN: &[&str] = &[
        "q_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
    ];
    const MLP: &[&str] = &["gate_proj", "up_proj", "down_proj"];
    let Some(module) = name.strip_suffix(".weight") else {
        return false;
    };
    let Some((path, last)) = module.rsplit_once('.') else {
        return false;
    };
    if !name.starts_with("model.layers.") {
        return false;
    }
    (path.ends_with(".self_attn") && ATTN.contains(&last))
        || (MLP.contains(&last)
            && (path.ends_with(".mlp")
                || path.ends_with(".mlp.shared_experts")
                || path
                    .rsplit_once(".mlp.experts.")
                    .is_some_and(|(_, e)| e.parse::<usize>().is_ok())))
}

/// Rows `rows` of an FP8 e4m3fn tensor (`codes` from its first byte, `cols` a row) hold no
/// NaN code: e4m3fn has no infinities, and 0x7F and 0xFF are NaN, a damaged weight rather than
/// a value to convert (it would come out NaN in bf16, or finite and wrong once quantized).
pub(crate) fn check_fp8_codes(
    name: &str,
    codes: &[u8],
    cols: usize,
    rows: std::ops::Range<usize>,
) -> std::io::Result<()> {
    let window = &codes[rows.start * cols..rows.end * cols];
    match window.iter().position(|&c| c & 0x7F == 0x7F) {
        None => Ok(()),
        Some(i) => {
            let at = rows.start * cols + i;
            Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "tensor {name}: FP8 code 0x{:02X} (NaN) at row {}, column {}; the input \
                     checkpoint is damaged (re-download this shard)",
                    window[i],
                    at / cols,
                    at % cols
                ),
            ))
        }
    }
}

/// Dequantized rows (`bf`, bf16 bits, rows from `row0`) are finite: FP8 codes are (checked
/// first), so an infinity here is a block scale too large for bf16 (a damaged or mis-stored
/// `weight_scale_inv`), which would be written as an infinite weight or scale.
pub(crate) fn check_scaled_finite(
    name: &str,
    bf: &[u16],
    cols: usize,
    row0: usize,
) -> std::io::Result<()> {
    match bf.iter().position(|&v| v & 0x7F80 == 0x7F80) {
        None => Ok(()),
        Some(i) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "tensor {name}: row {}, column {} overflows bf16 once scaled (its block scale \
                 is too large: a damaged scale tensor; re-download this shard)",
                row0 + i / cols.max(1),
                i % cols.max(1)
            ),
        )),
    }
}

/// A float tensor copied as it is (`bytes` from byte `at` of it) holds no NaN or infinity: a
/// damaged weight would pass into the output and make every forward through it garbage.
pub(crate) fn check_finite(t: &OutTensor, bytes: &[u8], at: usize) -> std::io::Result<()> {
    let size = safetensors_io::dtype_size(t.dtype).unwrap_or(1);
    check_floats(&t.name, t.dtype, bytes, at / size)
}

/// Values of float tensor `name` (`dtype` its safetensors name; `bytes` from element `first`)
/// hold no NaN or infinity (other dtypes pass): a damaged weight, not a value to convert.
pub(crate) fn check_floats(
    name: &str,
    dtype: &str,
    bytes: &[u8],
    first: usize,
) -> std::io::Result<()> {
    use cachalot_kernels::StoredFloat as S;
    let kind = match dtype {
        "BF16" => S::Bf16,
        "F16" => S::F16,
        "F32" => S::F32,
        _ => return Ok(()),
    };
    match cachalot_kernels::first_non_finite(kind, bytes) {
        None => Ok(()),
        Some(i) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "tensor {name}: a NaN or infinite {dtype} value at element {}; the input \
                 checkpoint is damaged (re-download this shard)",
                first + i
            ),
        )),
    }
}

/// The values of stored floats (`dtype` "F32", "F16" or "BF16"; little-endian `bytes`).
pub(crate) fn floats_of(dtype: &str, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        "F32" => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        "F16" => bytes
            .chunks_exact(2)
            .map(|b| cachalot_kernels::f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|b| cachalot_kernels::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
    }
}

/// The error of a work item converting `input` into `output`: damaged data of another shard (a
/// weight's scales, [`Located`]) names that shard, other damaged input data (`InvalidData`)
/// the input shard, anything else (writing) the output.
pub(crate) fn item_error(e: std::io::Error, input: &Path, output: &Path) -> ConvertError {
    if let Some(l) = e.get_ref().and_then(|r| r.downcast_ref::<Located>()) {
        return ConvertError::Shard {
            file: l.file.clone(),
            why: l.why.clone(),
        };
    }
    let file = if e.kind() == std::io::ErrorKind::InvalidData {
        input
    } else {
        output
    };
    ConvertError::io(file, e)
}

/// Damaged input found in a shard other than the one being converted (a weight's scales).
#[derive(Debug)]
struct Located {
    file: PathBuf,
    why: String,
}

impl std::fmt::Display for Located {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.file.display(), self.why)
    }
}

impl std::error::Error for Located {}

/// Spec §2.3: bf16(f32(q) · f32(scale[r, c / group])) for rows `rows` of a packed int4 weight
/// (`packed`: those rows, `cols / 2` bytes each; column c is nibble c % 8 of little-endian
/// word c / 8, i.e. byte c / 2, low nibble for even c; q = nibble − 8). The product is exact in
/// f32 and rounded to bf16 once, as an FP8 weight's dequantization is. The scales of the rows
/// are read from their shard and must be finite.
fn dequantize_int4_rows(
    name: &str,
    packed: &[u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    s: &Int4Scales,
) -> std::io::Result<Vec<u16>> {
    let size = if s.dtype == "F32" { 4 } else { 2 };
    let mut bytes = vec![0u8; rows.len() * s.groups * size];
    File::open(&s.file)
        .and_then(|f| f.read_exact_at(&mut bytes, s.start + (rows.start * s.groups * size) as u64))
        .map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the scales of {name} in {}: {e}", s.file.display()),
            )
        })?;
    let scale_name = name
        .strip_suffix("weight")
        .map_or(name.to_string(), |p| format!("{p}weight_scale"));
    let damaged = |r: usize, g: usize, v: f32, why: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            Located {
                file: s.file.clone(),
                why: format!(
                    "tensor {scale_name}: the scale at [{r}, {g}] ({v:e}) {why}; the input \
                     checkpoint is damaged (re-download this shard)"
                ),
            },
        )
    };
    let scale = floats_of(s.dtype, &bytes);
    if let Some(i) = scale.iter().position(|v| !v.is_finite()) {
        let r = rows.start + i / s.groups;
        return Err(damaged(r, i % s.groups, scale[i], "is not a finite number"));
    }
    // An int4 value (|q| ≤ 8) times the scale must fit bf16 (whose largest is ~3.39e38).
    let limit = cachalot_kernels::bf16_to_f32(0x7F7F) / 8.0;
    if let Some(i) = scale.iter().position(|v| v.abs() > limit) {
        let r = rows.start + i / s.groups;
        return Err(damaged(
            r,
            i % s.groups,
            scale[i],
            "is too large: an int4 weight (up to 8 in size) times it overflows bf16",
        ));
    }
    let mut out = vec![0u16; rows.len() * cols];
    for (i, (row, o)) in packed
        .chunks_exact(cols / 2)
        .zip(out.chunks_exact_mut(cols))
        .enumerate()
    {
        let srow = &scale[i * s.groups..(i + 1) * s.groups];
        for (c, v) in o.iter_mut().enumerate() {
            let nibble = (row[c / 2] >> (4 * (c % 2))) & 0x0F;
            *v = f32_to_bf16((nibble as f32 - 8.0) * srow[c / s.group]);
        }
    }
    Ok(out)
}

/// Spec §2.2: bf16(f32(fp8[r, c]) · scale_inv[r / br][c / bc]) for rows `rows`.
fn dequantize_rows_to_bf16(
    codes: &[u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    bs: &BlockScales,
    out: &mut [u16],
) {
    let table = e4m3_table();
    let (br, bc) = bs.block;
    for (i, r) in rows.enumerate() {
        let row = &codes[r * cols..(r + 1) * cols];
        let srow = &bs.values[(r / br) * bs.grid_cols..(r / br + 1) * bs.grid_cols];
        let o = &mut out[i * cols..(i + 1) * cols];
        for (b, (chunk, ochunk)) in row.chunks(bc).zip(o.chunks_mut(bc)).enumerate() {
            let s = srow[b];
            for (&code, ov) in chunk.iter().zip(ochunk) {
                *ov = f32_to_bf16(table[code as usize] * s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a conversion killed mid-way left beside its output: the unfinished output is
    /// removed, an old output it had moved aside goes back where it was (not deleted), and
    /// those of a conversion still running (this process) stay.
    #[test]
    fn leftovers_of_dead_conversions_are_removed_or_put_back() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("model");
        let dead = u32::MAX - 1;
        let partial = tmp.path().join(format!(".model.partial-{dead}"));
        let old = tmp.path().join(format!(".model.old-{dead}"));
        let mine = tmp
            .path()
            .join(format!(".model.partial-{}", std::process::id()));
        for d in [&partial, &old, &mine] {
            fs::create_dir_all(d).unwrap();
        }
        fs::write(old.join("config.json"), "{}").unwrap();
        let removed = remove_stale_partials(&out);
        assert_eq!(removed, vec![partial.clone()]);
        assert!(out.join("config.json").is_file() && !old.exists() && mine.exists());
        // With the output in place, a stale moved-aside copy is only a leftover.
        fs::create_dir_all(&old).unwrap();
        assert_eq!(remove_stale_partials(&out), vec![old.clone()]);
        assert!(out.join("config.json").is_file());
    }

    /// A finished conversion whose placement fails (`write_through_temp`: the output could not
    /// be renamed over) is kept beside, named in the error; `/proc/self/mountinfo`'s escapes
    /// are read back (mount points are found by their path there).
    #[test]
    fn a_finished_output_that_cannot_be_placed_is_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("model");
        let part = sibling(&out, "partial");
        fs::create_dir_all(&part).unwrap();
        fs::write(part.join("config.json"), "new").unwrap();
        let busy = ConvertError::io(&out, std::io::Error::other("busy"));
        let err = keep_finished(&part, &out, &busy).to_string();
        let kept = tmp
            .path()
            .join(format!(".model.converted-{}", std::process::id()));
        assert!(err.contains(&kept.display().to_string()), "{err}");
        assert_eq!(fs::read_to_string(kept.join("config.json")).unwrap(), "new");
        // A failed write leaves nothing.
        let err = write_through_temp(&out, false, "fp", None, |dir, _| {
            Err(ConvertError::io(dir, std::io::Error::other("disk full")))
        });
        assert!(err.is_err());
        let left: Vec<_> = fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left.len(), 1, "{left:?}");
        assert_eq!(unescape_mountinfo(r"/mnt/a\040b\134c"), "/mnt/a b\\c");
        assert!(!is_mount_point(tmp.path(), tmp.path().parent().unwrap()));
    }

    /// An output given as a link whose target does not exist yet is its target.
    #[cfg(unix)]
    #[test]
    fn a_dangling_output_link_is_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        std::os::unix::fs::symlink("models/r1-w8a8", root.join("out")).unwrap();
        assert_eq!(resolve(&root.join("out")), root.join("models/r1-w8a8"));
        assert_eq!(
            resolve(&root.join("out/../x")),
            root.join("models/x"),
            "a `..` after the link is the target's parent"
        );
        // A loop of links ends, one that names itself twice too (40 links followed in all).
        std::os::unix::fs::symlink("b", root.join("a")).unwrap();
        std::os::unix::fs::symlink("a", root.join("b")).unwrap();
        let _ = resolve(&root.join("a"));
        std::os::unix::fs::symlink("x/../x", root.join("x")).unwrap();
        let _ = resolve(&root.join("x"));
    }

    /// A partial directory whose lock a running conversion holds stays, whatever its pid says
    /// (another PID namespace); once the lock is free it is stale.
    #[test]
    fn a_locked_partial_is_left_to_its_conversion() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("model");
        let dead = u32::MAX - 1;
        let partial = tmp.path().join(format!(".model.partial-{dead}"));
        fs::create_dir_all(&partial).unwrap();
        let lock = File::create(partial.join(LOCK_FILE)).unwrap();
        lock.try_lock().unwrap();
        assert!(remove_stale_partials(&out).is_empty());
        assert!(partial.exists());
        // A second conversion into the same output is refused at its start.
        let input = tmp.path().join("input");
        fs::create_dir_all(&input).unwrap();
        let e = check_output(&input, &out, false, "fp")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("is running now") && e.contains(".model.partial-"),
            "{e}"
        );
        // One that starts after this conversion's check but before its own partial
        // directory is locked is seen then: this one stops, writing nothing.
        let err = write_through_temp(&out, false, "fp", None, |_, _| {
            panic!("a conversion started beside another must not write")
        })
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("started at the same time"), "{err}");
        assert!(!sibling(&out, "partial").exists());
        drop(lock);
        assert!(running_conversion(&out).is_none());
        assert_eq!(remove_stale_partials(&out), vec![partial.clone()]);
        // Inside the output too (a mounted output directory is written from within).
        fs::create_dir_all(&out).unwrap();
        let inner = out.join(format!(".model.partial-{dead}"));
        fs::create_dir_all(&inner).unwrap();
        assert_eq!(remove_stale_partials(&out), vec![inner]);
    }

    /// Without `force` an output filled while the conversion ran is left alone and the new one
    /// is kept beside it (named in the error); with `force` it is replaced. An output built
    /// inside its directory (a mount point) moves up the same way.
    #[test]
    fn an_output_filled_meanwhile_is_replaced_only_under_force() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("model");
        let built = |dir: &Path| {
            fs::create_dir_all(dir).unwrap();
            fs::write(dir.join("config.json"), "new").unwrap();
        };
        // Absent or empty: renamed into place.
        let part = sibling(&out, "partial");
        built(&part);
        rename_over(&part, &out, false).unwrap();
        assert_eq!(fs::read_to_string(out.join("config.json")).unwrap(), "new");
        // Filled: kept beside, the user's file untouched.
        fs::write(out.join("USER"), "mine").unwrap();
        built(&part);
        let e = rename_over(&part, &out, false).unwrap_err().to_string();
        assert!(
            e.contains("converted model is in") && e.contains("--force"),
            "{e}"
        );
        assert!(out.join("USER").is_file() && !part.exists());
        let kept = tmp
            .path()
            .join(format!(".model.converted-{}", std::process::id()));
        assert!(kept.join("config.json").is_file(), "{e}");
        built(&part);
        rename_over(&part, &out, true).unwrap();
        assert!(!out.join("USER").exists() && out.join("config.json").is_file());
        // Built inside.
        let inner = out.join(".model.partial-1");
        built(&inner);
        let e = move_up(&inner, &out, false).unwrap_err().to_string();
        assert!(e.contains("converted model is in"), "{e}");
        assert!(!inner.exists());
        built(&inner);
        fs::create_dir_all(out.join("sub")).unwrap();
        move_up(&inner, &out, true).unwrap();
        let names: Vec<String> = fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["config.json"]);
    }

    /// A conversion finds the partial output an interrupted run of the same conversion left
    /// and keeps the shards it recorded (here one whose bytes a rewrite would change: it stays
    /// as it is), writes the rest, and leaves no record in the output; a partial output of
    /// other options is removed, not reused.
    #[test]
    fn an_interrupted_conversion_resumes() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v3/r1_tiny");
        let tmp = tempfile::tempdir().unwrap();
        let opts = |out: &str, mode| ConvertOptions {
            input: fixture.clone(),
            output: tmp.path().join(out),
            mode,
            c8_scales: None,
            quant_param_path: None,
            force: false,
            progress: false,
        };
        let fresh = opts("fresh", QuantMode::Bfloat16);
        convert(&fresh).unwrap();
        let files = Input::open(&fixture).unwrap().files();
        let dead = u32::MAX - 1;
        let first = "model-00001-of-00003.safetensors";
        let size = fs::metadata(fresh.output.join(first)).unwrap().len();
        // An interrupted run: the first shard recorded, another half written.
        let left = |mode| {
            let part = tmp.path().join(format!(".out.partial-{dead}"));
            fs::create_dir_all(&part).unwrap();
            fs::write(part.join(first), vec![7u8; size as usize]).unwrap();
            fs::write(part.join("model-00002-of-00003.safetensors"), b"half").unwrap();
            let fp = fingerprint(&opts("out", mode), &files);
            let (b, t) = shard_stamp(&part.join(first)).unwrap();
            fs::write(part.join(RESUME_FILE), format!("{fp}\n{b} {t} {first}\n")).unwrap();
            part
        };
        let part = left(QuantMode::Bfloat16);
        convert(&opts("out", QuantMode::Bfloat16)).unwrap();
        let out = tmp.path().join("out");
        assert_eq!(fs::read(out.join(first)).unwrap(), vec![7u8; size as usize]);
        for f in [
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            INDEX_FILE,
            CONFIG_FILE,
        ] {
            assert_eq!(
                fs::read(out.join(f)).unwrap(),
                fs::read(fresh.output.join(f)).unwrap(),
                "{f}"
            );
        }
        assert!(!out.join(RESUME_FILE).exists() && !out.join(LOCK_FILE).exists());
        assert!(!part.exists());
        // Another conversion's leftovers are not taken.
        fs::remove_dir_all(&out).unwrap();
        let part = left(QuantMode::W8A8C16);
        convert(&opts("out", QuantMode::Bfloat16)).unwrap();
        assert!(!part.exists());
        assert_eq!(
            fs::read(out.join(first)).unwrap(),
            fs::read(fresh.output.join(first)).unwrap()
        );
        // A failure after a shard was written keeps it, and says so.
        let kept = tmp.path().join("kept");
        fs::create_dir_all(&kept).unwrap();
        let mut shards = Shards::open(&kept, "fp").unwrap();
        fs::write(kept.join(first), b"x").unwrap();
        shards.record(first).unwrap();
        assert_eq!(Shards::open(&kept, "fp").unwrap().done(first), Some(1));
        // One changed since at the same size is not taken (its modification time moved).
        let shard = File::options().write(true).open(kept.join(first)).unwrap();
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        shard.set_modified(later).unwrap();
        drop(shard);
        let mut shards = Shards::open(&kept, "fp").unwrap();
        assert_eq!(shards.done(first), None);
        assert!(!kept.join(first).exists(), "to be written again");
        fs::write(kept.join(first), b"x").unwrap();
        shards.record(first).unwrap();
        assert_eq!(Shards::open(&kept, "fp").unwrap().done(first), Some(1));
        // A recorded shard found missing leaves the record: one written again at its size but
        // cut short (a file is sized before it is filled) is not taken for whole.
        fs::remove_file(kept.join(first)).unwrap();
        assert_eq!(Shards::open(&kept, "fp").unwrap().done(first), None);
        fs::write(kept.join(first), b"y").unwrap();
        assert_eq!(Shards::open(&kept, "fp").unwrap().done(first), None);
        assert_eq!(Shards::open(&kept, "other").unwrap().done(first), None);
        assert_eq!(keep_for_resume(&kept), None);
        assert!(!kept.exists());
    }

    /// Paths resolve `.` and `..`, also in parts that do not exist yet.
    #[test]
    fn output_paths_resolve_dots() {
        let tmp = tempfile::tempdir().unwrap();
        let base = fs::canonicalize(tmp.path()).unwrap();
        assert_eq!(resolve(&base.join("a/b/../c/.")), base.join("a/c"));
        assert_eq!(resolve(&base.join(".")), base);
        assert!(resolve_output(Path::new("/")).is_err());
    }
}
