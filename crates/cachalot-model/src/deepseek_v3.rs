//! DeepSeek-V3/R1 and Kimi-K2: loading and the forward pass over a packed batch.
//!
//! Spec: `shared/specs/deepseek-v3-r1-kimi-k2.md` §2 (tensor names and layouts; §2.3 for
//! Kimi-K2-Thinking's `pack-quantized` int4 experts, run as W4A16 with f32 activations), §3.1 (RMSNorm,
//! pre-norm residual stream), §3.2 (YaRN rope, see [`crate::rope`]), §3.3 (MLA, naive form),
//! §3.4 (absorbed form over the latent cache), §3.5 (noaux_tc sigmoid routing), §3.6 (experts,
//! shared expert, dense MLP), §3.7 (final norm, lm_head), §8 (transformers' semantics, our
//! numerical reference). Activations are f32 throughout; weights stay in their stored format and
//! every product goes through [`cachalot_kernels::Matrix`], so this file never branches on format.
//!
//! Attention form: per sequence and layer we pick the naive form (up-project every cached
//! latent with `kv_b_proj`) or the absorbed form (fold `W_UK` into the query and `W_UV` into the
//! output, attend over the 576-wide latents) by their multiply-add counts; decode (one query)
//! always takes the absorbed form, long prefills the naive one. Both are exact rewrites of the
//! same math; tests check they agree.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use cachalot_comm::Communicator;

pub use crate::expert_parallel::ExpertShard;
use cachalot_kernels::int8::quantize_static_int8;
use cachalot_kernels::{self as k, Matrix, MatrixData};
use rayon::prelude::*;
use safetensors::tensor::Dtype;

use crate::batch::{slot_of, Batch, CacheSpec, KvCache, KvCacheDtype, LayerMut, SeqKind};
use crate::checkpoint::{Checkpoint, TensorView};
use crate::config::{DeepseekV3Config, QuantizationConfig, LATENT_NORM_EPS};
use crate::context_parallel::{self as cp, cp_pieces};
use crate::eplb::BalancedRouting;
use crate::error::{ModelError, Result};
use crate::profile::{Phase, Timer};
use crate::rope::Rope;
use crate::tensor_parallel::{self as tp, Cut, TensorShard, VocabRows};

/// How FP8 block-scaled weights are held in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fp8Mode {
    /// Keep the 1-byte codes and their block scales; decode them inside the matmul (default:
    /// decode reads a quarter of the bytes of f32, see docs/PERF.md).
    #[default]
    Native,
    /// Dequantize to f32 once at load (4× the memory; for measurement).
    DequantizeF32,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionPath {
    /// Cheapest by multiply-add count, per sequence and step.
    #[default]
    Auto,
    Naive,
    Absorbed,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    pub fp8: Fp8Mode,
    /// Load the MTP layer(s) (`model.layers.{num_hidden_layers + j}`), if the checkpoint has them.
    pub load_mtp: bool,
    /// Multiply bf16 weights as BF16 × BF16 (`Matrix::to_bf16_dot`: activations rounded to
    /// bf16, AVX-512 `vdpbf16ps` where the CPU has it), as llama.cpp does; the routers keep f32
    /// activations. Off: the exact f32-activation products.
    pub bf16_dot: bool,
    /// The routed experts this process holds (expert parallelism); default: all of them.
    pub expert_shard: ExpertShard,
    /// The heads and intermediate features this process holds (tensor parallelism,
    /// `crate::tensor_parallel`); default: all of them. Not together with `expert_shard`.
    pub tensor_shard: TensorShard,
    /// Only the first N decoder layers (the seed's `custom_params.num_hidden_layers`, for
    /// reduced-layer testing; the others are skipped, the MTP layers stay those of the
    /// checkpoint); None: all of them.
    pub max_layers: Option<usize>,
}

struct Mlp {
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

struct Moe {
    /// The layer's index in the checkpoint (`model.layers.{key}`, MTP layers after the main
    /// ones): how ranks name the layer when they dispatch tokens to its experts.
    key: u32,
    router: Matrix,
    bias: Vec<f32>,
    /// Every routed expert by id; `None` where another rank holds it (`ExpertShard`).
    experts: Vec<Option<Mlp>>,
    shared: Option<Mlp>,
}

enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

enum QProj {
    Direct(Matrix),
    Lora {
        a: Matrix,
        norm: Vec<f32>,
        b: Matrix,
    },
}

struct Mla {
    /// The heads held here: all of them, or this rank's share under tensor parallelism.
    heads: usize,
    q: QProj,
    kv_a: Matrix,
    kv_a_norm: Vec<f32>,
    kv_b: Matrix,
    /// Per head, W_UK,hᵀ (`kv_lora_rank x qk_nope_head_dim`, the head's key rows of `kv_b`
    /// transposed) for the absorbed query `q̃ = W_UK,hᵀ q` as a forward product, which streams
    /// weights about twice as fast at one token as the transposed product; made at load for
    /// 16- and 32-bit float `kv_b` and FP8 blocks that no head straddles (the same values), None
    /// for other formats (int8, straddled FP8 blocks), which keep `matmul_t_rows` over `kv_b`.
    uk_t: Option<Vec<Matrix>>,
    o: Matrix,
    /// C8 (spec §3.4): the static scale of this layer's int8 c_kv cache.
    ckv_scale: Option<f32>,
}

struct DecoderLayer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    attn: Mla,
    ffn: Ffn,
}

/// The multi-token-prediction module (spec §3.8); loaded here, driven by speculative decoding.
pub struct MtpLayer {
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    pub eh_proj: Matrix,
    pub shared_head_norm: Vec<f32>,
    layer: DecoderLayer,
}

pub struct DeepseekV3 {
    cfg: DeepseekV3Config,
    embed: VocabRows,
    layers: Vec<DecoderLayer>,
    norm: Vec<f32>,
    lm_head: Matrix,
    mtp: Vec<MtpLayer>,
    rope: Rope,
    softmax_scale: f32,
    pub attention_path: AttentionPath,
    /// `force_eplb`: routed expert ids replaced by a balanced assignment (`crate::eplb`).
    force_eplb: Option<BalancedRouting>,
    /// Tokens each routed expert took, per MoE layer ([`crate::eplb::ExpertLoad`]).
    expert_load: crate::eplb::ExpertLoad,
    /// The routed experts held here, and the group that holds the others.
    shard: ExpertShard,
    /// The heads and intermediate features held here (tensor parallelism).
    tp: TensorShard,
    comm: Option<Arc<dyn Communicator>>,
    /// How the cache's float part is stored (`set_kv_cache_dtype`).
    kv_dtype: KvCacheDtype,
}

/// Logits of the requested tokens, and (when asked) the final-normed hidden state of every token,
/// which MTP consumes.
pub struct ForwardOutput {
    /// `[logits_indices.len(), vocab_size]`.
    pub logits: Vec<f32>,
    pub hidden: Option<Vec<f32>>,
}

struct Loader<'a> {
    ckpt: &'a mut Checkpoint,
    opts: LoadOptions,
    block: (usize, usize),
    /// The checkpoint is compressed-tensors int8 (spec §4): its int8 weights run W8A8, with
    /// activations quantized per token inside the product.
    w8a8: bool,
    /// `kv_cache_scheme` int8 (C8): each layer has a `self_attn.ckv_scale`.
    c8: bool,
    /// compressed-tensors `pack-quantized` (K2-Thinking, spec §2.3): `Some(group size)`
    /// (`Some(None)`: one scale per row); the Linears stored as `weight_packed` load as
    /// [`MatrixData::Int4Group`] and run with f32 activations.
    int4: Option<Option<usize>>,
}

impl Loader<'_> {
    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>> {
        let v = self.ckpt.take(name, &format!("a vector of {len} values"))?;
        v.expect_shape(&[len])?;
        v.to_finite_f32_vec()
    }

    fn scale_vector(&mut self, view: &TensorView, name: &str, rows: usize) -> Result<Vec<f32>> {
        let s = self.ckpt.take(
            name,
            &format!(
                "per-row scales [{rows}, 1] for the int8 weight {}",
                view.name
            ),
        )?;
        if s.shape != [rows, 1] && s.shape != [rows] {
            return Err(s.error(format!("has shape {:?}; expected [{rows}, 1]", s.shape)));
        }
        s.to_f32_vec()
    }

    /// A linear weight `[rows, cols]` under `prefix` (`prefix.weight` plus its scales), bf16
    /// ones multiplied as BF16 × BF16 when `bf16_dot` is asked for.
    fn linear(&mut self, prefix: &str, rows: usize, cols: usize) -> Result<Matrix> {
        self.linear_cut(prefix, rows, cols, Cut::Whole)
    }

    /// [`Loader::linear`], of which only `cut` is kept (tensor parallelism).
    fn linear_cut(&mut self, prefix: &str, rows: usize, cols: usize, cut: Cut) -> Result<Matrix> {
        let m = self.linear_f32_acts_cut(prefix, rows, cols, cut)?;
        Ok(if self.opts.bf16_dot {
            m.to_bf16_dot()
        } else {
            m
        })
    }

    /// [`Loader::linear`] with f32 activations whatever `bf16_dot` says (the routers: their
    /// logits pick experts, so they stay exact).
    fn linear_f32_acts(&mut self, prefix: &str, rows: usize, cols: usize) -> Result<Matrix> {
        self.linear_f32_acts_cut(prefix, rows, cols, Cut::Whole)
    }

    fn linear_f32_acts_cut(
        &mut self,
        prefix: &str,
        rows: usize,
        cols: usize,
        cut: Cut,
    ) -> Result<Matrix> {
        let name = format!("{prefix}.weight");
        let packed = format!("{prefix}.weight_packed");
        if !self.ckpt.contains(&name) && self.ckpt.contains(&packed) {
            let m = self.packed_int4(prefix, rows, cols)?;
            return cut.apply(m, &name, self.opts.tensor_shard);
        }
        // Under a pack-quantized config a missing weight may be the packed one (its scales
        // left behind say so).
        let expected =
            if self.int4.is_some() && self.ckpt.contains(&format!("{prefix}.weight_scale")) {
                format!(
                "a [{rows}, {cols}] weight: here `{packed}` (int32 [{rows}, {}], packed int4), \
                 whose `{prefix}.weight_scale` is present",
                cols / 8
            )
            } else {
                format!("a [{rows}, {cols}] weight")
            };
        let w = self.ckpt.take(&name, &expected)?;
        if self.ckpt.contains(&packed) {
            return Err(w.error(format!(
                "is stored beside `{packed}`: a Linear is either a weight or packed int4 \
                 weights, not both"
            )));
        }
        w.expect_shape(&[rows, cols])?;
        if matches!(w.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            // Scales beside a float weight: the weight lost its quantized dtype (or the scales
            // are stray); either way the checkpoint is not what it claims.
            for (scale, goes_with) in [
                ("weight_scale_inv", "F8_E4M3 weights (FP8 block scales)"),
                ("weight_scale", "I8 weights (per-row int8 scales)"),
            ] {
                if self.ckpt.contains(&format!("{prefix}.{scale}")) {
                    return Err(w.error(format!(
                        "is {:?} but has `{prefix}.{scale}`, which goes with {goes_with}; the \
                         weight's dtype or the scales are wrong",
                        w.dtype
                    )));
                }
            }
        }
        let data = match w.dtype {
            Dtype::F32 => MatrixData::F32(w.bytes.clone()),
            Dtype::BF16 => MatrixData::Bf16(w.bytes.clone()),
            Dtype::F16 => MatrixData::F16(w.bytes.clone()),
            Dtype::F8_E4M3 => {
                let (br, bc) = self.block;
                let grid = [rows.div_ceil(br), cols.div_ceil(bc)];
                let sname = format!("{prefix}.weight_scale_inv");
                let s = self.ckpt.take(
                    &sname,
                    &format!("f32 {grid:?} block scales for the FP8 weight {name}"),
                )?;
                s.expect_shape(&grid)?;
                if s.dtype != Dtype::F32 {
                    return Err(
                        s.error(format!("has dtype {:?}; FP8 block scales are F32", s.dtype))
                    );
                }
                let scale_inv = s.to_f32_vec()?;
                // A block's scale is its largest magnitude over 448: never negative (which
                // would flip the block's signs) nor NaN/infinite. (Zero is a block of zeros.)
                if let Some(i) = scale_inv.iter().position(|v| !(v.is_finite() && *v >= 0.0)) {
                    return Err(s.error(format!(
                        "holds the block scale {} at [{}, {}]; FP8 block scales are finite and \
                         not negative: the checkpoint is damaged (re-download this shard)",
                        scale_inv[i],
                        i / grid[1],
                        i % grid[1]
                    )));
                }
                MatrixData::Fp8Block {
                    data: w.bytes.clone(),
                    scale_inv,
                    block_rows: br,
                    block_cols: bc,
                }
            }
            Dtype::I8 => {
                let scale_name = format!("{prefix}.weight_scale");
                let block_scale = format!("{prefix}.weight_scale_inv");
                if !self.ckpt.contains(&scale_name) && self.ckpt.contains(&block_scale) {
                    // An FP8 checkpoint's layout with an int8 weight: the dtype is what is wrong.
                    return Err(w.error(format!(
                        "has dtype I8 beside {block_scale} (an FP8 block scale): an FP8 \
                         checkpoint's Linear weights are F8_E4M3, a W8A8 one's I8 with per-row \
                         {scale_name}; this file mixes the two (a broken conversion?)"
                    )));
                }
                let scale = self.scale_vector(&w, &scale_name, rows)?;
                let data = w.bytes.clone();
                if self.w8a8 {
                    MatrixData::W8A8 { data, scale }
                } else {
                    MatrixData::Int8Row { data, scale }
                }
            }
            other => {
                return Err(w.error(format!(
                    "has dtype {other:?}; supported weight dtypes are F8_E4M3 (with \
                     weight_scale_inv), I8 (with weight_scale), BF16, F16 and F32"
                )))
            }
        };
        let m = Matrix::new(rows, cols, data).map_err(|e| w.error(e.to_string()))?;
        let m = cut.apply(m, &name, self.opts.tensor_shard)?;
        Ok(match (self.opts.fp8, w.dtype) {
            (Fp8Mode::DequantizeF32, Dtype::F8_E4M3) => m.to_f32_matrix(),
            _ => m,
        })
    }

    /// A compressed-tensors `pack-quantized` Linear (spec §2.3): `weight_packed` int32
    /// `[rows, cols/8]` (column 8j+i is nibble i of word j, low nibble first, stored as q + 8),
    /// `weight_scale` `[rows, cols/group]` (bf16 in K2-Thinking; f16 and f32 accepted) and, when
    /// present, `weight_shape` = `[rows, cols]`. The little-endian bytes of the words are
    /// already [`MatrixData::Int4Group`]'s layout (column c in byte c/2, low nibble for even c),
    /// so the weights stay the mmap'd bytes.
    fn packed_int4(&mut self, prefix: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let name = format!("{prefix}.weight_packed");
        let w = self.ckpt.take(
            &name,
            &format!("int32 [{rows}, {}] packed int4 weights", cols / 8),
        )?;
        let Some(group) = self.int4 else {
            return Err(w.error(
                "is a packed int4 weight, but config.json's quantization_config is not \
                 compressed-tensors `pack-quantized` (give the checkpoint's own config.json)",
            ));
        };
        if w.dtype != Dtype::I32 {
            return Err(w.error(format!(
                "has dtype {:?}; pack-quantized int4 weights are I32 words of 8 nibbles",
                w.dtype
            )));
        }
        if !cols.is_multiple_of(8) {
            return Err(w.error(format!(
                "packs {cols} input columns, not a multiple of 8: int32 words hold 8 nibbles"
            )));
        }
        w.expect_shape(&[rows, cols / 8])?;
        let shape_name = format!("{prefix}.weight_shape");
        if self.ckpt.contains(&shape_name) {
            let s = self
                .ckpt
                .take(&shape_name, "the [out, in] shape of the int4 weight")?;
            let dims = s.to_i64_vec()?;
            if dims != [rows as i64, cols as i64] {
                return Err(s.error(format!("is {dims:?}; the config implies [{rows}, {cols}]")));
            }
        }
        let group_size = group.unwrap_or(cols);
        let groups = cols.div_ceil(group_size);
        let sname = format!("{prefix}.weight_scale");
        let s = self.ckpt.take(
            &sname,
            &format!("[{rows}, {groups}] scales (one per {group_size} columns) for {name}"),
        )?;
        let shape_ok = s.shape == [rows, groups] || (groups == 1 && s.shape == [rows]);
        if !shape_ok {
            let per = match group {
                Some(_) => format!("one scale per {group_size} columns, the config's group_size"),
                None => "one scale per row, the config's channel strategy".into(),
            };
            return Err(s.error(format!(
                "has shape {:?}; expected [{rows}, {groups}] ({per})",
                s.shape
            )));
        }
        let scale = s.to_f32_vec()?;
        if let Some(i) = scale.iter().position(|v| !v.is_finite()) {
            return Err(s.error(format!(
                "holds a non-finite scale ({}) at [{}, {}]; the checkpoint is damaged \
                 (re-download this shard)",
                scale[i],
                i / groups,
                i % groups
            )));
        }
        let data = MatrixData::Int4Group {
            data: w.bytes.clone(),
            scale,
            group_size,
        };
        Matrix::new(rows, cols, data).map_err(|e| w.error(e.to_string()))
    }

    /// An MLP; under tensor parallelism, this rank's share of its intermediate features.
    fn mlp(&mut self, prefix: &str, hidden: usize, inter: usize) -> Result<Mlp> {
        self.mlp_of(prefix, hidden, inter, self.opts.tensor_shard)
    }

    /// An MLP, `shard`'s share of its intermediate features.
    fn mlp_of(
        &mut self,
        prefix: &str,
        hidden: usize,
        inter: usize,
        shard: TensorShard,
    ) -> Result<Mlp> {
        let part = shard.part(inter);
        Ok(Mlp {
            gate: self.linear_cut(
                &format!("{prefix}.gate_proj"),
                inter,
                hidden,
                Cut::Rows(part.clone()),
            )?,
            up: self.linear_cut(
                &format!("{prefix}.up_proj"),
                inter,
                hidden,
                Cut::Rows(part.clone()),
            )?,
            down: self.linear_cut(
                &format!("{prefix}.down_proj"),
                hidden,
                inter,
                Cut::Cols(part),
            )?,
        })
    }

    fn layer(&mut self, cfg: &DeepseekV3Config, i: usize, force_moe: bool) -> Result<DecoderLayer> {
        let p = format!("model.layers.{i}");
        let h = cfg.hidden_size;
        let n = cfg.num_attention_heads;
        let qk = cfg.qk_head_dim();
        // This rank's heads (all of them without tensor parallelism).
        let heads = self.opts.tensor_shard.part(n);
        let rows_of = |width: usize| Cut::Rows(heads.start * width..heads.end * width);
        let q = match cfg.q_lora_rank {
            Some(r) => QProj::Lora {
                a: self.linear(&format!("{p}.self_attn.q_a_proj"), r, h)?,
                norm: self.vector(&format!("{p}.self_attn.q_a_layernorm.weight"), r)?,
                b: self.linear_cut(&format!("{p}.self_attn.q_b_proj"), n * qk, r, rows_of(qk))?,
            },
            None => QProj::Direct(self.linear_cut(
                &format!("{p}.self_attn.q_proj"),
                n * qk,
                h,
                rows_of(qk),
            )?),
        };
        let kvw = cfg.qk_nope_head_dim + cfg.v_head_dim;
        let kv_b = self.linear_cut(
            &format!("{p}.self_attn.kv_b_proj"),
            n * kvw,
            cfg.kv_lora_rank,
            rows_of(kvw),
        )?;
        let uk_t = uk_transposed(&kv_b, heads.len(), cfg.qk_nope_head_dim, cfg.v_head_dim);
        let vd = cfg.v_head_dim;
        let attn = Mla {
            heads: heads.len(),
            q,
            kv_a: self.linear(
                &format!("{p}.self_attn.kv_a_proj_with_mqa"),
                cfg.latent_cache_width(),
                h,
            )?,
            kv_a_norm: self.vector(
                &format!("{p}.self_attn.kv_a_layernorm.weight"),
                cfg.kv_lora_rank,
            )?,
            kv_b,
            uk_t,
            o: self.linear_cut(
                &format!("{p}.self_attn.o_proj"),
                h,
                n * vd,
                Cut::Cols(heads.start * vd..heads.end * vd),
            )?,
            ckv_scale: if self.c8 {
                let name = format!("{p}.self_attn.ckv_scale");
                let s = self.vector(&name, 1)?[0];
                if !(s.is_finite() && s > 0.0 && (1.0 / s).is_finite()) {
                    return Err(ModelError::Options(format!(
                        "{name} = {s}; a C8 cache scale must be positive, with a finite \
                         reciprocal (recalibrate and convert again)"
                    )));
                }
                Some(s)
            } else {
                None
            },
        };
        let ffn = if force_moe || cfg.is_moe_layer(i) {
            let e = cfg.n_routed_experts.unwrap_or(0);
            let router = self.linear_f32_acts(&format!("{p}.mlp.gate"), e, h)?;
            let bias_name = format!("{p}.mlp.gate.e_score_correction_bias");
            // noaux_tc routing selects with this bias (spec §3.5): a checkpoint without it
            // would route differently, so it is required like any other tensor.
            let b = self.ckpt.take(
                &bias_name,
                &format!("the [{e}] routing bias that noaux_tc selects experts with"),
            )?;
            b.expect_shape(&[e])?;
            let bias = b.to_finite_f32_vec()?;
            let shard = self.opts.expert_shard;
            shard.validate(e)?;
            let experts = (0..e)
                .map(|j| {
                    let name = format!("{p}.mlp.experts.{j}");
                    if shard.holds(i as u32, j, e) {
                        // Whole under expert parallelism (with or without tensor parallelism
                        // of the rest), else this rank's tensor-parallel share.
                        let cut = if shard.ranks > 1 {
                            TensorShard::default()
                        } else {
                            self.opts.tensor_shard
                        };
                        self.mlp_of(&name, h, cfg.moe_intermediate_size, cut)
                            .map(Some)
                    } else {
                        // Another rank's expert: never read.
                        self.ckpt.skip_prefix(&format!("{name}."));
                        Ok(None)
                    }
                })
                .collect::<Result<Vec<_>>>()?;
            let shared = if cfg.n_shared_experts > 0 {
                Some(self.mlp(
                    &format!("{p}.mlp.shared_experts"),
                    h,
                    cfg.moe_intermediate_size * cfg.n_shared_experts,
                )?)
            } else {
                None
            };
            Ffn::Moe(Moe {
                key: i as u32,
                router,
                bias,
                experts,
                shared,
            })
        } else {
            Ffn::Dense(self.mlp(&format!("{p}.mlp"), h, cfg.intermediate_size)?)
        };
        self.ckpt
            .skip(&format!("{p}.self_attn.rotary_emb.inv_freq"));
        Ok(DecoderLayer {
            input_norm: self.vector(&format!("{p}.input_layernorm.weight"), h)?,
            post_norm: self.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
            attn,
            ffn,
        })
    }
}

/// Progress reporting for large loads (hidden when stderr is not a terminal).
fn progress_bar(len: u64, big: bool) -> indicatif::ProgressBar {
    if !big {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template("loading {bar:40} {pos}/{len} layers {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    pb
}

impl DeepseekV3 {
    pub fn load(dir: &Path, opts: LoadOptions) -> Result<DeepseekV3> {
        let cfg = DeepseekV3Config::from_dir(dir)?;
        let mut ckpt = Checkpoint::open(dir)?;
        Self::load_from(cfg, &mut ckpt, opts)
    }

    pub fn load_from(
        mut cfg: DeepseekV3Config,
        ckpt: &mut Checkpoint,
        opts: LoadOptions,
    ) -> Result<DeepseekV3> {
        let keep = match opts.max_layers {
            Some(0) => {
                return Err(ModelError::Options(
                    "num_hidden_layers override 0: a model needs at least one layer".into(),
                ))
            }
            Some(n) if n > cfg.num_hidden_layers => {
                return Err(ModelError::Options(format!(
                    "num_hidden_layers override {n} exceeds the checkpoint's {} layers \
                     (config.json num_hidden_layers): give at most {}, or none for the whole \
                     model",
                    cfg.num_hidden_layers, cfg.num_hidden_layers
                )))
            }
            Some(n) => n,
            None => cfg.num_hidden_layers,
        };
        let block = match &cfg.quantization {
            Some(QuantizationConfig::Fp8Block {
                block_rows,
                block_cols,
            }) => (*block_rows, *block_cols),
            _ => (128, 128),
        };
        let big = ckpt.total_bytes() > (1 << 30);
        let pb = progress_bar(
            (cfg.num_hidden_layers + cfg.num_nextn_predict_layers) as u64,
            big,
        );
        let (w8a8, c8) = match &cfg.quantization {
            Some(QuantizationConfig::CompressedInt8 { kv_cache_int8, .. }) => {
                (true, *kv_cache_int8)
            }
            _ => (false, false),
        };
        let int4 = match &cfg.quantization {
            Some(QuantizationConfig::PackedInt4 { group_size, .. }) => Some(*group_size),
            _ => None,
        };
        opts.tensor_shard
            .validate(&cfg, opts.expert_shard.ranks > 1)?;
        let (t, e) = (opts.tensor_shard, opts.expert_shard);
        if t.ranks > 1 && e.dispatch {
            return Err(ModelError::Options(
                "tensor parallelism with dispatched experts (data-parallel attention): the \
                 tensor-parallel ranks run one batch together, so their experts are gathered, \
                 not dispatched; use expert_shard.dispatch = false (--parallel tensor-expert)"
                    .into(),
            ));
        }
        if t.ranks > 1 && e.ranks > 1 && (t.rank, t.ranks) != (e.rank, e.ranks) {
            return Err(ModelError::Options(format!(
                "tensor parallelism as rank {} of {} and expert parallelism as rank {} of {}: \
                 both together split over one group (the same rank of the same ranks)",
                t.rank, t.ranks, e.rank, e.ranks
            )));
        }
        let mut l = Loader {
            ckpt,
            opts,
            block,
            w8a8,
            c8,
            int4,
        };
        let h = cfg.hidden_size;
        let v = cfg.vocab_size;
        // Under tensor parallelism each rank holds a share of the vocabulary's embedding rows
        // (vocabulary-parallel embedding, the seed's embed_tp); a lookup is summed over ranks.
        let vocab_share = opts.tensor_shard.share(v);
        let embed = l.linear_cut("model.embed_tokens", v, h, Cut::Rows(vocab_share.clone()))?;
        let mut layers = Vec::with_capacity(keep);
        for i in 0..cfg.num_hidden_layers {
            if i < keep {
                layers.push(l.layer(&cfg, i, false)?);
            } else {
                l.ckpt.skip_prefix(&format!("model.layers.{i}."));
            }
            pb.inc(1);
        }
        let norm = l.vector("model.norm.weight", h)?;
        // Under tensor parallelism each rank holds a share of the vocabulary's rows (the seed's
        // lmhead_tp); the logits are gathered.
        let vocab_rows = Cut::Rows(vocab_share.clone());
        let lm_head = if cfg.tie_word_embeddings && !l.ckpt.contains("lm_head.weight") {
            l.linear_cut("model.embed_tokens", v, h, vocab_rows)?
        } else {
            l.linear_cut("lm_head", v, h, vocab_rows)?
        };
        let mut mtp = Vec::new();
        for j in 0..cfg.num_nextn_predict_layers {
            let i = cfg.num_hidden_layers + j;
            let p = format!("model.layers.{i}");
            // The MTP copies of the embedding and head are parameter-shared with the main model
            // (spec §2.1); we use the main ones.
            l.ckpt.skip(&format!("{p}.embed_tokens.weight"));
            l.ckpt.skip(&format!("{p}.shared_head.head.weight"));
            if opts.load_mtp {
                mtp.push(MtpLayer {
                    enorm: l.vector(&format!("{p}.enorm.weight"), h)?,
                    hnorm: l.vector(&format!("{p}.hnorm.weight"), h)?,
                    eh_proj: l.linear(&format!("{p}.eh_proj"), h, 2 * h)?,
                    shared_head_norm: l.vector(&format!("{p}.shared_head.norm.weight"), h)?,
                    layer: l.layer(&cfg, i, true)?,
                });
            } else {
                l.ckpt.skip_prefix(&format!("{p}."));
            }
            pb.inc(1);
        }
        pb.finish_and_clear();
        // MTP layers (those with `enorm`) past those the config counts
        // (`num_nextn_predict_layers: 0` over DeepSeek's checkpoint, a common way to drop MTP)
        // are not loaded, as transformers skips them. (A main layer past the config's count is
        // still refused below: config and checkpoint disagree.)
        let mut extra = cfg.num_hidden_layers + cfg.num_nextn_predict_layers;
        loop {
            let prefix = format!("model.layers.{extra}.");
            if !l.ckpt.contains(&format!("{prefix}enorm.weight")) {
                break;
            }
            l.ckpt.skip_prefix(&prefix);
            eprintln!(
                "note: {}: model.layers.{extra} (an MTP layer past the {} num_nextn_predict_layers \
                 of config.json counts) is not loaded",
                l.ckpt.dir().display(),
                cfg.num_nextn_predict_layers
            );
            extra += 1;
        }
        l.ckpt.ensure_all_used()?;
        // MTP layers keep their checkpoint keys (after all the checkpoint's layers), also when
        // only the first `keep` run.
        let expert_load = crate::eplb::ExpertLoad::new(
            cfg.num_hidden_layers + mtp.len(),
            cfg.n_routed_experts.unwrap_or(0),
        );
        cfg.num_hidden_layers = keep;
        let rope = Rope::new(&cfg);
        let softmax_scale = cfg.softmax_scale();
        Ok(DeepseekV3 {
            cfg,
            embed: VocabRows {
                table: embed,
                share: vocab_share,
            },
            layers,
            norm,
            lm_head,
            mtp,
            rope,
            softmax_scale,
            expert_load,
            force_eplb: None,
            attention_path: AttentionPath::Auto,
            shard: opts.expert_shard,
            tp: opts.tensor_shard,
            comm: None,
            kv_dtype: KvCacheDtype::F32,
        })
    }

    /// Stores the latent cache's float values (c_kv, and k^R; only k^R under C8) as f32 (the
    /// default: exact) or bf16 (C16, as the seed stores them: half the memory per cached
    /// token). With bf16, each token's latents are rounded to bf16 once, when they are made,
    /// and every attention form reads those rounded values, so chunked, batched and
    /// one-at-a-time runs still agree token for token; and (without C8) the absorbed attention
    /// runs BF16 × BF16 over the cached rows, as the seed's bf16 attention and llama.cpp's
    /// 16-bit caches do: scores against bf16-rounded queries (`k::dot_rows_bf16`) and ō from
    /// bf16-rounded probabilities (`k::axpy_rows_bf16`), `vdpbf16ps` where the CPU has it. The
    /// naive form (long prefills) up-projects the rounded latents in f32. Set it before making
    /// the cache (`cache_spec` follows it). `Fp8` is DeepSeek-V4's cache (compressed entries
    /// in e4m3); this family's 8-bit cache is C8 (int8 latents, from a W8A8C8 checkpoint), so
    /// the CLI refuses fp8 here, and this setter keeps a bf16 cache for it.
    pub fn set_kv_cache_dtype(&mut self, dtype: KvCacheDtype) {
        self.kv_dtype = match dtype {
            KvCacheDtype::Fp8 => KvCacheDtype::Bf16,
            d => d,
        };
    }

    /// `force_eplb` (the seed's "perfect EPLB" benchmark mode, `crate::eplb`): with `Some`,
    /// every MoE layer (the MTP layer's too) replaces the router's top-k ids by the balanced
    /// assignment and keeps the gate's weights. Outputs are meaningless then; throughput is
    /// what it measures. Errors if the assignment is for another expert count.
    /// Tokens each routed expert took since load, per MoE layer that routed any (its key,
    /// MTP layers after the main ones): this process's routing (under dispatched expert
    /// parallelism, its own tokens only).
    pub fn expert_load(&self) -> Vec<(u32, Vec<u64>)> {
        self.expert_load.snapshot()
    }

    /// Per MoE layer: the routed (token, expert) pairs this rank computed for dispatched
    /// tokens since load (its own and other ranks'); empty without dispatched experts.
    pub fn expert_served(&self) -> Vec<(u32, u64)> {
        self.expert_load.served_snapshot()
    }

    pub fn set_force_eplb(&mut self, routing: Option<BalancedRouting>) -> Result<()> {
        if let Some(r) = &routing {
            r.check_model(self.cfg.n_routed_experts.unwrap_or(0))?;
        }
        self.force_eplb = routing;
        Ok(())
    }

    /// Whether `force_eplb` routes the experts (then a token's experts depend on its place in
    /// the step, so its KV depends on the batch: no prefix caching).
    pub fn forces_eplb(&self) -> bool {
        self.force_eplb.is_some()
    }

    /// Holds `lm_head` in int8 (W8A8: one scale per vocabulary row, int8 token activations;
    /// `Matrix::to_w8a8`), as llama.cpp's Q8_0 files hold their output matrix. A runtime
    /// choice, off by default: the seed's W8A8 checkpoints keep `lm_head` in bf16 (spec §5), so
    /// logits then differ from the seed's by the head's rounding. Halves the head's bytes per
    /// decoded token (the largest single matrix of a small-vocabulary-heavy model); the MTP
    /// layers share it.
    pub fn quantize_head_int8(&mut self) {
        self.lm_head = self.lm_head.to_w8a8();
    }

    pub fn config(&self) -> &DeepseekV3Config {
        &self.cfg
    }

    pub fn mtp_layers(&self) -> &[MtpLayer] {
        &self.mtp
    }

    /// One latent cache per main layer, then one per loaded MTP layer; with C8 the c_kv part
    /// (`kv_lora_rank` values) is int8 and k^R stays f32.
    pub fn cache_spec(&self) -> CacheSpec {
        let c8 = self
            .layers
            .first()
            .is_some_and(|l| l.attn.ckv_scale.is_some());
        CacheSpec {
            layers: self.layers.len() + self.mtp.len(),
            width: self.cfg.latent_cache_width(),
            int8_width: if c8 { self.cfg.kv_lora_rank } else { 0 },
            float: self.kv_dtype,
            seq_state_width: 0,
        }
    }

    /// Bytes of weights held (mmap'd or owned).
    pub fn weight_bytes(&self) -> usize {
        let mlp = |m: &Mlp| m.gate.storage_bytes() + m.up.storage_bytes() + m.down.storage_bytes();
        let layer = |l: &DecoderLayer| {
            let a = &l.attn;
            let q = match &a.q {
                QProj::Direct(m) => m.storage_bytes(),
                QProj::Lora { a, b, .. } => a.storage_bytes() + b.storage_bytes(),
            };
            let f = match &l.ffn {
                Ffn::Dense(m) => mlp(m),
                Ffn::Moe(m) => {
                    m.router.storage_bytes()
                        + m.experts.iter().flatten().map(mlp).sum::<usize>()
                        + m.shared.as_ref().map_or(0, mlp)
                }
            };
            let uk_t: usize = a.uk_t.iter().flatten().map(Matrix::storage_bytes).sum();
            q + a.kv_a.storage_bytes() + a.kv_b.storage_bytes() + uk_t + a.o.storage_bytes() + f
        };
        self.embed.table.storage_bytes()
            + self.lm_head.storage_bytes()
            + self.layers.iter().map(layer).sum::<usize>()
            + self
                .mtp
                .iter()
                .map(|m| layer(&m.layer) + m.eh_proj.storage_bytes())
                .sum::<usize>()
    }

    /// Bytes of one routed expert (gate + up + down) and the number of MoE layers, so a bench
    /// can count the experts a step of several tokens reads.
    pub fn routed_expert_bytes(&self) -> (usize, usize) {
        let mut per_expert = 0;
        let mut moe_layers = 0;
        for l in &self.layers {
            if let Ffn::Moe(m) = &l.ffn {
                moe_layers += 1;
                per_expert = m.experts.iter().flatten().next().map_or(0, |e| {
                    e.gate.storage_bytes() + e.up.storage_bytes() + e.down.storage_bytes()
                });
            }
        }
        (per_expert, moe_layers)
    }

    /// Bytes of weights one decode token reads: everything but the unrouted experts and all
    /// but one embedding row (the floor of decode time at a given memory bandwidth).
    pub fn decode_bytes_per_token(&self) -> usize {
        let mlp = |m: &Mlp| m.gate.storage_bytes() + m.up.storage_bytes() + m.down.storage_bytes();
        let mut total = self.lm_head.storage_bytes()
            + self.embed.table.storage_bytes() / self.embed.table.rows();
        for l in &self.layers {
            let a = &l.attn;
            total += match &a.q {
                QProj::Direct(m) => m.storage_bytes(),
                QProj::Lora { a, b, .. } => a.storage_bytes() + b.storage_bytes(),
            };
            total += a.kv_a.storage_bytes() + a.kv_b.storage_bytes() + a.o.storage_bytes();
            total += match &l.ffn {
                Ffn::Dense(m) => mlp(m),
                Ffn::Moe(m) => {
                    let per_expert = m.experts.iter().flatten().next().map_or(0, mlp);
                    m.router.storage_bytes()
                        + self.cfg.num_experts_per_tok * per_expert
                        + m.shared.as_ref().map_or(0, mlp)
                }
            };
        }
        total
    }

    /// Forwards a packed batch: writes every token's latent KV into its cache slot, attends
    /// causally within each sequence over its cache, and returns the requested logits.
    pub fn forward(
        &self,
        batch: &Batch,
        cache: &mut KvCache,
        want_hidden: bool,
    ) -> Result<ForwardOutput> {
        if self.shard.context && self.shard.ranks > 1 {
            return self
                .forward_cp(Some((batch, cache)), None, want_hidden)?
                .ok_or_else(|| {
                    ModelError::Batch("context parallel forward gave no output".into())
                });
        }
        self.forward_plain(batch, cache, want_hidden)
    }

    /// [`DeepseekV3::forward`] of this rank's batch alone.
    fn forward_plain(
        &self,
        batch: &Batch,
        cache: &mut KvCache,
        want_hidden: bool,
    ) -> Result<ForwardOutput> {
        let cfg = &self.cfg;
        self.check_cache(cache, self.layers.len())?;
        batch.validate(cache.block_size(), cache.num_blocks(), cfg.vocab_size)?;
        let step = tp::batch_digest(self.tp, batch, 0);
        let mut hidden = self
            .embed
            .lookup(self.comm.as_deref(), self.tp, step, &batch.tokens)?;
        let rope = RopeTable::new(&self.rope, &batch.positions, cfg.qk_rope_head_dim / 2);
        let block_size = cache.block_size();
        for (li, layer) in self.layers.iter().enumerate() {
            self.layer_forward(
                layer,
                &mut hidden,
                batch,
                &rope,
                cache.layer_parts_mut(li),
                block_size,
                step,
            )?;
        }
        self.head(&hidden, &self.norm, batch, want_hidden, step)
    }

    /// A forward under prefill context parallelism ([`ExpertShard::context`], executor spec
    /// §4.5). Every rank takes part: `own` is this rank's batch and cache (None for a rank
    /// whose step is over, joining from [`DeepseekV3::end_step`] with the ranks' `plans`).
    /// The prompts of all ranks' batches (sequences that start at position 0 with more than
    /// one token) are split over the ranks: prompt of length L in 2·ranks pieces of
    /// ⌈L / 2·ranks⌉, rank r computing pieces r and 2·ranks − 1 − r (zigzag, so the causal work
    /// is even). At every layer the ranks' latent rows of each prompt are gathered (a
    /// temporary full-latent cache per rank, as the seed's) so each piece attends to all rows
    /// before it, and the prompt's own rank writes them into its cache; the MoE layers
    /// dispatch every rank's rows to the experts' ranks. At the end each prompt's hidden rows
    /// go back to its rank, which computes the logits `own` asks for. The other sequences of
    /// `own` (decode, later chunks, MTP verification) run on this rank as usual, in the same
    /// layers. Returns `own`'s output.
    fn forward_cp(
        &self,
        own: Option<(&Batch, &mut KvCache)>,
        plans: Option<Vec<Vec<u8>>>,
        want_hidden: bool,
    ) -> Result<Option<ForwardOutput>> {
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let (rank, ranks) = (self.shard.rank, self.shard.ranks);
        let experts = cfg.n_routed_experts.unwrap_or(0);
        let comm = self.comm.as_deref().ok_or_else(|| {
            ModelError::Options(
                "context parallelism needs the group's communicator (set_communicator)".into(),
            )
        })?;
        let err = cp::cp_err;
        let (own_batch, mut own_cache) = match own {
            Some((b, c)) => {
                self.check_cache(c, self.layers.len())?;
                b.validate(c.block_size(), c.num_blocks(), cfg.vocab_size)?;
                (Some(b), Some(c))
            }
            None => (None, None),
        };
        let serve = |key: u32, id: usize, xs: &[f32], _ws: &[f32], n: usize| {
            self.serve_expert(key, id, xs, n)
        };
        let prompts = cp::prompts_of_step(comm, self.shard, h, experts, own_batch, plans, &serve)?;
        if prompts.is_empty() {
            return match (own_batch, own_cache) {
                (Some(b), Some(c)) => self.forward_plain(b, c, want_hidden).map(Some),
                _ => Ok(None),
            };
        }
        // This rank's rows: its batch's other sequences, then its pieces of every prompt (in a
        // scratch cache of its own: one layer, each prompt's rows in blocks of their own).
        const SCRATCH_BLOCK: usize = 64;
        let local = own_batch.map(cp::local_part).unwrap_or_default();
        let mut segs = Batch::default();
        let mut seg_of: Vec<usize> = Vec::new();
        let mut blocks = 0u32;
        // A rank's two pieces of a prompt are one sequence (positions with a gap): its keys
        // and values are up-projected once for both (the naive path).
        segs.seq_starts.push(0);
        for (j, p) in prompts.iter().enumerate() {
            let n = p.tokens.len().div_ceil(SCRATCH_BLOCK) as u32;
            let table: Vec<u32> = (blocks..blocks + n).collect();
            blocks += n;
            let pieces = cp_pieces(p.tokens.len(), rank, ranks);
            if pieces.is_empty() {
                continue;
            }
            for (a, e) in pieces {
                segs.tokens.extend_from_slice(&p.tokens[a..e]);
                segs.positions.extend(a..e);
            }
            segs.seq_starts.push(segs.tokens.len());
            segs.block_tables.push(table);
            segs.kinds.push(SeqKind::Prompt);
            seg_of.push(j);
        }
        let spec = self.cache_spec();
        let mut scratch = KvCache::new(
            CacheSpec { layers: 1, ..spec },
            SCRATCH_BLOCK,
            (blocks as usize).max(1),
        );
        let (nl, ns) = (local.num_tokens(), segs.num_tokens());
        let width = cfg.kv_lora_rank + cfg.qk_rope_head_dim;
        // Every rank's rows of every prompt, from each rank's pieces in plan order.
        let exchange = |rows: &[f32]| -> Result<cp::Gathered> {
            cp::gather_rows(comm, &prompts, rows, width, false, "latent rows")
        };
        let mut tokens = local.tokens.clone();
        tokens.extend_from_slice(&segs.tokens);
        let mut hidden = self.embed.lookup(Some(comm), self.tp, 0, &tokens)?;
        let rope_l = RopeTable::new(&self.rope, &local.positions, cfg.qk_rope_head_dim / 2);
        let rope_s = RopeTable::new(&self.rope, &segs.positions, cfg.qk_rope_head_dim / 2);
        let bs = own_cache.as_ref().map_or(SCRATCH_BLOCK, |c| c.block_size());
        let t_all = nl + ns;
        let decode = ns == 0 && local.is_decode();
        for (li, layer) in self.layers.iter().enumerate() {
            let mut x = vec![0.0f32; t_all * h];
            k::rms_norm_rows(&hidden, h, &layer.input_norm, cfg.rms_norm_eps, &mut x);
            let mut attn = Vec::with_capacity(t_all * h);
            if nl > 0 {
                let cache = own_cache
                    .as_deref_mut()
                    .ok_or_else(|| err("rows of this rank without its cache".into()))?;
                let parts = cache.layer_parts_mut(li);
                let (a, _) =
                    self.attention(&layer.attn, &x[..nl * h], &local, &rope_l, parts, bs, None)?;
                attn.extend_from_slice(&a);
            }
            let cp = CpAttend {
                of_seq: &seg_of,
                exchange: &exchange,
            };
            let full = if ns > 0 {
                let parts = scratch.layer_parts_mut(0);
                let (a, full) = self.attention(
                    &layer.attn,
                    &x[nl * h..],
                    &segs,
                    &rope_s,
                    parts,
                    SCRATCH_BLOCK,
                    Some(&cp),
                )?;
                attn.extend_from_slice(&a);
                full.ok_or_else(|| err("the attention gathered no rows".into()))?
            } else {
                exchange(&[])?
            };
            // This rank's prompts: their rows into its cache, for decoding.
            if let (Some(b), Some(c)) = (own_batch, own_cache.as_deref_mut()) {
                let mut parts = c.layer_parts_mut(li);
                for (j, p) in prompts.iter().enumerate().filter(|(_, p)| p.owner == rank) {
                    let table = &b.block_tables[p.seq];
                    for (pos, row) in full.prompt(j).chunks_exact(width).enumerate() {
                        self.store_latent(&layer.attn, &mut parts, slot_of(table, pos, bs), row);
                    }
                }
            }
            for (a, b) in hidden.iter_mut().zip(&attn) {
                *a += b;
            }
            k::rms_norm_rows(&hidden, h, &layer.post_norm, cfg.rms_norm_eps, &mut x);
            let ffn = match &layer.ffn {
                Ffn::Dense(m) => {
                    let _t = Timer::start(Phase::Dense);
                    mlp_forward(m, &x, t_all)
                }
                Ffn::Moe(m) => {
                    let _t = Timer::start(Phase::Moe);
                    // (A decode step here when this rank's rows are its own decode tokens.)
                    self.moe_forward(m, &x, t_all, decode)?
                }
            };
            for (a, b) in hidden.iter_mut().zip(&ffn) {
                *a += b;
            }
        }
        // Each prompt's hidden rows to its rank.
        let rows_at: Vec<usize> = (0..seg_of.len()).map(|q| nl + segs.seq_starts[q]).collect();
        let back = cp::send_rows_home(comm, &prompts, &seg_of, &rows_at, &hidden, h)?;
        let Some(b) = own_batch else {
            return Ok(None);
        };
        let own_hidden = cp::own_rows(&back, &prompts, rank, b, h, &hidden)?;
        self.head(&own_hidden, &self.norm, b, want_hidden, 0)
            .map(Some)
    }

    /// One step of MTP module `index` (spec §3.8): row i pairs the embedding of
    /// `batch.tokens[i]` (the token at position `batch.positions[i] + 1`) with `prev_hidden` row
    /// i (the final-normed hidden state at `batch.positions[i]` from the main model, or the
    /// previous MTP step), `eh_proj([enorm(e); hnorm(h)])`, runs the MTP decoder layer at
    /// `batch.positions[i]` with its own cache layer (`num_hidden_layers + index`), and returns
    /// logits through `shared_head.norm` and the main `lm_head`; `hidden` (when asked) is the
    /// `shared_head.norm` output, the `prev_hidden` of a chained next step.
    pub fn mtp_forward(
        &self,
        index: usize,
        batch: &Batch,
        prev_hidden: &[f32],
        cache: &mut KvCache,
        want_hidden: bool,
    ) -> Result<ForwardOutput> {
        let cfg = &self.cfg;
        let mtp = self.mtp.get(index).ok_or_else(|| {
            ModelError::Batch(format!(
                "MTP layer {index} is not loaded ({} loaded; load with load_mtp and a checkpoint \
                 with num_nextn_predict_layers > {index})",
                self.mtp.len()
            ))
        })?;
        let cache_layer = self.layers.len() + index;
        self.check_cache(cache, cache_layer + 1)?;
        batch.validate(cache.block_size(), cache.num_blocks(), cfg.vocab_size)?;
        let t_count = batch.num_tokens();
        let h = cfg.hidden_size;
        if prev_hidden.len() != t_count * h {
            return Err(ModelError::Batch(format!(
                "MTP needs one hidden state of {h} per token: got {} values for {t_count} tokens",
                prev_hidden.len()
            )));
        }
        let step = tp::batch_digest(self.tp, batch, 1 + index as u32);
        let embedded = self
            .embed
            .lookup(self.comm.as_deref(), self.tp, step, &batch.tokens)?;
        let mut both = vec![0.0f32; t_count * 2 * h];
        for (t, row) in embedded.chunks_exact(h).enumerate() {
            let (e, g) = both[t * 2 * h..(t + 1) * 2 * h].split_at_mut(h);
            k::rms_norm(row, &mtp.enorm, cfg.rms_norm_eps, e);
            k::rms_norm(
                &prev_hidden[t * h..(t + 1) * h],
                &mtp.hnorm,
                cfg.rms_norm_eps,
                g,
            );
        }
        let mut hidden = vec![0.0f32; t_count * h];
        mtp.eh_proj.matmul(&both, t_count, &mut hidden);
        let rope = RopeTable::new(&self.rope, &batch.positions, cfg.qk_rope_head_dim / 2);
        let block_size = cache.block_size();
        self.layer_forward(
            &mtp.layer,
            &mut hidden,
            batch,
            &rope,
            cache.layer_parts_mut(cache_layer),
            block_size,
            step,
        )?;
        self.head(&hidden, &mtp.shared_head_norm, batch, want_hidden, step)
    }

    fn check_cache(&self, cache: &KvCache, layers: usize) -> Result<()> {
        let spec = cache.spec();
        let want = self.cache_spec();
        if spec.width != want.width
            || spec.int8_width != want.int8_width
            || spec.float != want.float
            || spec.layers < layers
        {
            return Err(ModelError::Batch(format!(
                "cache of {spec:?} does not fit this model ({:?})",
                self.cache_spec()
            )));
        }
        Ok(())
    }

    /// Final norm of every token, then `lm_head` on the tokens whose logits are wanted.
    fn head(
        &self,
        hidden: &[f32],
        norm: &[f32],
        batch: &Batch,
        want_hidden: bool,
        step: u64,
    ) -> Result<ForwardOutput> {
        let _t = Timer::start(Phase::Head);
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let mut normed = vec![0.0f32; hidden.len()];
        k::rms_norm_rows(hidden, h, norm, cfg.rms_norm_eps, &mut normed);
        let n_out = batch.logits_indices.len();
        let mut picked = Vec::with_capacity(n_out * h);
        for &i in &batch.logits_indices {
            picked.extend_from_slice(&normed[i * h..(i + 1) * h]);
        }
        let mut logits = vec![0.0f32; n_out * self.lm_head.rows()];
        if n_out > 0 {
            self.lm_head.matmul(&picked, n_out, &mut logits);
        }
        if self.tp.ranks > 1 {
            // Each rank's share of the vocabulary: gathered into whole rows.
            let _t = Timer::start(Phase::Reduce);
            logits = tp::gather_columns(self.comm.as_deref(), self.tp, step, &logits, n_out)?;
        }
        Ok(ForwardOutput {
            logits,
            hidden: want_hidden.then_some(normed),
        })
    }

    /// Every token's embedding row, `[tokens, hidden]`. Under tensor parallelism a rank holds a
    /// share of the vocabulary: it fills the rows of its tokens, zeros the others', and the
    /// ranks' rows are added (one rank's row plus zeros: the row's own bits).
    /// `step`: the batch's digest for the ranks' partial sums ([`DeepseekV3::step_digest`]).
    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        layer: &DecoderLayer,
        hidden: &mut [f32],
        batch: &Batch,
        rope: &RopeTable,
        cache: LayerMut,
        block_size: usize,
        step: u64,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let t_count = batch.num_tokens();
        let mut x = vec![0.0f32; t_count * h];
        k::rms_norm_rows(hidden, h, &layer.input_norm, cfg.rms_norm_eps, &mut x);
        let (mut attn, _) =
            self.attention(&layer.attn, &x, batch, rope, cache, block_size, None)?;
        // Tensor parallelism: each rank's heads gave a partial o_proj product.
        if self.tp.ranks > 1 {
            let _t = Timer::start(Phase::Reduce);
            tp::reduce(self.comm.as_deref(), self.tp, step, &mut attn)?;
        }
        for (a, b) in hidden.iter_mut().zip(&attn) {
            *a += b;
        }
        k::rms_norm_rows(hidden, h, &layer.post_norm, cfg.rms_norm_eps, &mut x);
        let mut ffn = match &layer.ffn {
            Ffn::Dense(m) => {
                let _t = Timer::start(Phase::Dense);
                mlp_forward(m, &x, t_count)
            }
            Ffn::Moe(m) => {
                let _t = Timer::start(Phase::Moe);
                self.moe_forward(m, &x, t_count, batch.is_decode())?
            }
        };
        // Tensor parallelism: each rank's intermediate features gave a partial down product.
        if self.tp.ranks > 1 {
            let _t = Timer::start(Phase::Reduce);
            tp::reduce(self.comm.as_deref(), self.tp, step, &mut ffn)?;
        }
        for (a, b) in hidden.iter_mut().zip(&ffn) {
            *a += b;
        }
        Ok(())
    }

    /// MLA over `batch`'s tokens (rows of `x`): writes each token's latent row into its cache
    /// slot and attends causally over the cache. With `cp` (context parallelism, the batch's
    /// sequences being segments of prompts split over the ranks) the ranks' rows are exchanged
    /// first and every prompt's rows written; they come back, one `[len, width]` array per
    /// prompt (empty without `cp`).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        mla: &Mla,
        x: &[f32],
        batch: &Batch,
        rope: &RopeTable,
        cache: LayerMut,
        block_size: usize,
        cp: Option<&CpAttend>,
    ) -> Result<(Vec<f32>, Option<cp::Gathered>)> {
        let cfg = &self.cfg;
        let t_count = batch.num_tokens();
        let MlaDims {
            n,
            nope,
            rd,
            vd,
            kvr,
            qk,
            ..
        } = MlaDims::of(cfg, mla.heads);
        let width = kvr + rd;
        let proj = Timer::start(Phase::AttnProj);

        // Queries: [T, N, nope + rope].
        // The products of x (q_a_proj or q_proj, kv_a_proj_with_mqa) in one parallel region.
        let mut q = vec![0.0f32; t_count * n * qk];
        let mut kv = vec![0.0f32; t_count * width];
        let mut cq = match &mla.q {
            QProj::Direct(_) => Vec::new(),
            QProj::Lora { a, .. } => vec![0.0f32; t_count * a.rows()],
        };
        {
            let first = match &mla.q {
                QProj::Direct(w) => k::MatmulJob {
                    w,
                    x,
                    n_tokens: t_count,
                    out: &mut q,
                },
                QProj::Lora { a, .. } => k::MatmulJob {
                    w: a,
                    x,
                    n_tokens: t_count,
                    out: &mut cq,
                },
            };
            let kv_job = k::MatmulJob {
                w: &mla.kv_a,
                x,
                n_tokens: t_count,
                out: &mut kv,
            };
            Matrix::matmul_group(&mut [first, kv_job]);
        }
        if let QProj::Lora { a, norm, b } = &mla.q {
            let r = a.rows();
            let mut cqn = vec![0.0f32; t_count * r];
            k::rms_norm_rows(&cq, r, norm, LATENT_NORM_EPS, &mut cqn);
            b.matmul(&cqn, t_count, &mut q);
        }
        drop(proj);
        let latents_t = Timer::start(Phase::AttnLatents);
        // Latents: normalised c_kv and roped k^R, written to the cache before attending.
        let mut c = vec![0.0f32; kvr];
        for i in 0..t_count {
            let (cos, sin) = rope.get(i);
            let row = &mut kv[i * width..(i + 1) * width];
            k::rms_norm(&row[..kvr], &mla.kv_a_norm, LATENT_NORM_EPS, &mut c);
            row[..kvr].copy_from_slice(&c);
            self.rope.apply(&mut row[kvr..], cos, sin);
            if self.kv_dtype == KvCacheDtype::Bf16 {
                // C16: the values the cache will hold, for this step's own attention too.
                let float = if mla.ckv_scale.is_some() {
                    &mut row[kvr..]
                } else {
                    row
                };
                for v in float {
                    *v = k::bf16_round(*v);
                }
            }
            for hd in 0..n {
                let qr = &mut q[(i * n + hd) * qk + nope..(i * n + hd + 1) * qk];
                self.rope.apply(qr, cos, sin);
            }
        }
        let bs = block_size;
        let mut cache = cache;
        for s in 0..batch.num_seqs() {
            for i in batch.seq_starts[s]..batch.seq_starts[s + 1] {
                let slot = batch.slot(s, i, bs);
                self.store_latent(mla, &mut cache, slot, &kv[i * width..(i + 1) * width]);
            }
        }
        // Context parallelism: every rank's rows of each prompt, written where this call's
        // segments of it attend (this rank's own rows again among them: the same values).
        let full = match cp {
            Some(cp) => {
                let full = (cp.exchange)(&kv)?;
                let mut written = vec![false; full.prompts()];
                for s in 0..batch.num_seqs() {
                    let j = cp.of_seq[s];
                    if std::mem::replace(&mut written[j], true) {
                        continue;
                    }
                    for (pos, row) in full.prompt(j).chunks_exact(width).enumerate() {
                        let slot = slot_of(&batch.block_tables[s], pos, bs);
                        self.store_latent(mla, &mut cache, slot, row);
                    }
                }
                Some(full)
            }
            None => None,
        };
        let LayerMut {
            int8: cache_i8,
            f32: cache_f32,
            bf16: cache_bf16,
        } = cache;
        // The float part's width per slot: all of the row, or k^R alone under C8.
        let fw = if mla.ckv_scale.is_some() { rd } else { width };
        let (cache_i8, cache_f32, cache_bf16): (&[i8], &[f32], &[u16]) =
            (cache_i8, cache_f32, cache_bf16);
        drop(latents_t);
        let core = Timer::start(Phase::AttnCore);

        let mut o = vec![0.0f32; t_count * n * vd];
        let num_seqs = batch.num_seqs();
        let path_of = |s: usize| -> Option<AttentionPath> {
            let range = batch.seq_starts[s]..batch.seq_starts[s + 1];
            if range.is_empty() {
                return None;
            }
            // A prompt's segment takes the path the whole prompt would.
            let (tq, ctx) = match (cp, &full) {
                (Some(cp), Some(full)) => {
                    let len = full.prompt(cp.of_seq[s]).len() / width;
                    (len, len)
                }
                _ => (range.len(), batch.positions[range.end - 1] + 1),
            };
            Some(match self.attention_path {
                // Prompt positions always take the naive path, which computes each row alike
                // whatever the chunk: a prompt split over steps, or cut after the blocks a
                // prefix cache gave it, gets the bits of its whole prefill (a short chunk
                // after a long context pays the context's up-projection for it).
                AttentionPath::Auto if batch.kind(s) == SeqKind::Prompt => AttentionPath::Naive,
                // Generated positions always take the absorbed path, as their decode steps did
                // (a recompute after preemption then gives the same bits).
                AttentionPath::Auto if batch.kind(s) == SeqKind::Generated => {
                    AttentionPath::Absorbed
                }
                AttentionPath::Auto => {
                    let (tq, ctx, n, kvr) = (tq as u64, ctx as u64, n as u64, kvr as u64);
                    let (nope, rd, vd) = (nope as u64, rd as u64, vd as u64);
                    let naive = ctx * n * (nope + vd) * kvr + tq * ctx * n * (nope + rd + vd);
                    let absorbed = tq * n * (nope + vd) * kvr + tq * ctx * n * (2 * kvr + rd);
                    if naive < absorbed {
                        AttentionPath::Naive
                    } else {
                        AttentionPath::Absorbed
                    }
                }
                p => p,
            })
        };
        let paths: Vec<Option<AttentionPath>> = (0..num_seqs).map(path_of).collect();
        // C8: each sequence's latents dequantized (c8 · s) once per layer; the naive path
        // (prefill) attends to this step's own tokens un-quantized, as the seed does. A bf16
        // cache (C16) is widened whole for the naive path only: the absorbed path attends over
        // its rows as they are (`Latents::bf16_rows`).
        let float_of = |slot: usize, out: &mut [f32]| match self.kv_dtype {
            KvCacheDtype::F32 => out.copy_from_slice(&cache_f32[slot * fw..(slot + 1) * fw]),
            KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => {
                widen_bf16(&cache_bf16[slot * fw..(slot + 1) * fw], out)
            }
        };
        let dequantize = |s: usize| -> Option<Vec<f32>> {
            let path = paths[s]?;
            let c8 = mla.ckv_scale;
            // A bf16 cache is widened for the naive path, and for prompt positions on the
            // absorbed one (attended in f32: `attend_absorbed`).
            let widen = path == AttentionPath::Naive || batch.kind(s) == SeqKind::Prompt;
            if c8.is_none() && (self.kv_dtype == KvCacheDtype::F32 || !widen) {
                return None;
            }
            let range = batch.seq_starts[s]..batch.seq_starts[s + 1];
            let ctx = batch.positions[range.end - 1] + 1;
            let table = &batch.block_tables[s];
            let mut g = vec![0.0f32; ctx * width];
            for (pos, row) in g.chunks_exact_mut(width).enumerate() {
                let slot = slot_of(table, pos, bs);
                if let Some(scale) = c8 {
                    for (o, &q) in row[..kvr]
                        .iter_mut()
                        .zip(&cache_i8[slot * kvr..(slot + 1) * kvr])
                    {
                        *o = q as f32 * scale;
                    }
                }
                float_of(slot, &mut row[width - fw..]);
            }
            if path == AttentionPath::Naive {
                match (cp, &full) {
                    // Every row of the prompt is this step's.
                    (Some(cp), Some(full)) => {
                        g.copy_from_slice(&full.prompt(cp.of_seq[s])[..ctx * width]);
                    }
                    _ => {
                        for i in range {
                            let pos = batch.positions[i];
                            g[pos * width..(pos + 1) * width]
                                .copy_from_slice(&kv[i * width..(i + 1) * width]);
                        }
                    }
                }
            }
            Some(g)
        };
        let many = num_seqs >= 2 * rayon::current_num_threads();
        let materialize = mla.ckv_scale.is_some() || self.kv_dtype == KvCacheDtype::Bf16;
        let dequantized: Vec<Option<Vec<f32>>> = if !materialize {
            vec![None; num_seqs]
        } else if many {
            (0..num_seqs)
                .into_par_iter()
                .map(|s| k::serial(|| dequantize(s)))
                .collect()
        } else {
            (0..num_seqs).map(dequantize).collect()
        };
        // The one accessor both attention forms read a sequence's latents through.
        let cache = match self.kv_dtype {
            KvCacheDtype::F32 => LatentCache::F32(cache_f32),
            KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => LatentCache::Bf16(cache_bf16),
        };
        let latents: Vec<Latents> = (0..num_seqs)
            .map(|s| Latents {
                dequantized: dequantized[s].as_deref(),
                table: &batch.block_tables[s],
                cache,
                width,
                block_size: bs,
            })
            .collect();

        // Absorbed sequences (decode, short prompts): one batched absorption for all of them.
        let absorbed: Vec<AbsorbedSeq> = (0..num_seqs)
            .filter(|&s| paths[s] == Some(AttentionPath::Absorbed))
            .map(|s| {
                let tokens = batch.seq_starts[s]..batch.seq_starts[s + 1];
                AbsorbedSeq {
                    positions: &batch.positions[tokens.clone()],
                    tokens,
                    latents: &latents[s],
                    prefill: batch.kind(s) == SeqKind::Prompt,
                }
            })
            .collect();
        // (`attend_absorbed` times its own three parts.)
        drop(core);
        let absorbed_out = (!absorbed.is_empty()).then(|| self.attend_absorbed(mla, &q, &absorbed));
        let core = Timer::start(Phase::AttnCore);

        // Naive sequences (long prefill chunks): one by one, or whole sequences to the pool.
        let naive: Vec<usize> = (0..num_seqs)
            .filter(|&s| matches!(paths[s], Some(AttentionPath::Naive | AttentionPath::Auto)))
            .collect();
        let attend_naive_seq = |s: usize, o_seq: &mut [f32]| {
            let range = batch.seq_starts[s]..batch.seq_starts[s + 1];
            let ctx = batch.positions[range.end - 1] + 1;
            let q_seq = &q[range.start * n * qk..range.end * n * qk];
            let lat = &latents[s];
            let latent = |pos: usize| lat.row(pos);
            self.attend_naive(mla, q_seq, &batch.positions[range], ctx, &latent, o_seq)
        };
        // Each sequence's slice of `o` (sequences are packed in order).
        let mut o_seqs: Vec<(usize, &mut [f32])> = Vec::with_capacity(naive.len());
        let mut rest: &mut [f32] = &mut o;
        for s in 0..num_seqs {
            let len = (batch.seq_starts[s + 1] - batch.seq_starts[s]) * n * vd;
            let (mine, others) = std::mem::take(&mut rest).split_at_mut(len);
            if naive.contains(&s) {
                o_seqs.push((s, mine));
            }
            rest = others;
        }
        if o_seqs.len() >= 2 * rayon::current_num_threads() {
            o_seqs
                .into_par_iter()
                .for_each(|(s, o_seq)| k::serial(|| attend_naive_seq(s, o_seq)));
        } else {
            for (s, o_seq) in o_seqs {
                attend_naive_seq(s, o_seq);
            }
        }
        if let Some(per_head) = absorbed_out {
            // per_head[h]: [absorbed tokens, vd], the absorbed sequences' tokens in order.
            let mut j = 0;
            for seq in &absorbed {
                for i in seq.tokens.clone() {
                    for (hd, out) in per_head.iter().enumerate() {
                        o[(i * n + hd) * vd..(i * n + hd + 1) * vd]
                            .copy_from_slice(&out[j * vd..(j + 1) * vd]);
                    }
                    j += 1;
                }
            }
        }
        drop(core);
        let _t = Timer::start(Phase::AttnOut);
        let mut out = vec![0.0f32; t_count * cfg.hidden_size];
        mla.o.matmul(&o, t_count, &mut out);
        Ok((out, full))
    }

    /// One latent row into its cache slot, as the cache stores it (C8: c_kv as
    /// saturate_int8(round(c_kv / s)) and k^R as a float; else the whole row, f32 or bf16).
    fn store_latent(&self, mla: &Mla, cache: &mut LayerMut, slot: usize, row: &[f32]) {
        let width = row.len();
        let rd = self.cfg.qk_rope_head_dim;
        let kvr = width - rd;
        let fw = if mla.ckv_scale.is_some() { rd } else { width };
        if let Some(scale) = mla.ckv_scale {
            let inv = 1.0 / scale;
            for (q, &v) in cache.int8[slot * kvr..(slot + 1) * kvr]
                .iter_mut()
                .zip(&row[..kvr])
            {
                *q = quantize_static_int8(v, inv);
            }
        }
        let float = &row[width - fw..];
        match self.kv_dtype {
            KvCacheDtype::F32 => cache.f32[slot * fw..(slot + 1) * fw].copy_from_slice(float),
            // Already bf16 values: the conversion is exact.
            KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => {
                for (o, &v) in cache.bf16[slot * fw..(slot + 1) * fw].iter_mut().zip(float) {
                    *o = k::f32_to_bf16(v);
                }
            }
        }
    }

    /// Spec §3.3: up-project every cached latent to per-head keys and values.
    fn attend_naive<'c>(
        &self,
        mla: &Mla,
        q: &[f32],
        positions: &[usize],
        ctx: usize,
        latent: &(dyn Fn(usize) -> &'c [f32] + Sync),
        o: &mut [f32],
    ) {
        let cfg = &self.cfg;
        let MlaDims {
            n,
            nope,
            vd,
            kvr,
            qk,
            kvw,
            ..
        } = MlaDims::of(cfg, mla.heads);
        let mut c = Vec::with_capacity(ctx * kvr);
        for p in 0..ctx {
            c.extend_from_slice(&latent(p)[..kvr]);
        }
        let mut kvf = vec![0.0f32; ctx * n * kvw];
        mla.kv_b.matmul(&c, ctx, &mut kvf);
        let scale = self.softmax_scale;
        let tq = positions.len();
        // Per head, scores and outputs as products over blocks of queries (the tiled f32 kernels,
        // not a dot per query-key pair): S = Q Kᵀ with the keys as the matrix's rows, then each
        // query's causal softmax, then O = P V with V's rows as the transposed product's rows
        // (one FMA chain per output over the keys in order). A block reads only the keys up to
        // its last query's position (`seen`): the keys after it are masked for every query of
        // the block, and the ones a query sees are computed as with all keys present (a row
        // sub-range of the product; its chain stops before terms whose weight is zero), so the
        // output does not depend on the chunking. Within a block a query's scores past its
        // position are computed and ignored and its weights there are zero. Queries go in blocks
        // of QB so S stays small at long contexts; a whole prompt's block row reads about half
        // the keys on average.
        const QB: usize = 64;
        let per_head: Vec<Vec<f32>> = (0..n)
            .into_par_iter()
            .map(|hd| {
                k::serial(|| {
                    let mut keys = Vec::with_capacity(ctx * qk);
                    let mut values = Vec::with_capacity(ctx * vd);
                    for s in 0..ctx {
                        let row = &kvf[(s * n + hd) * kvw..(s * n + hd + 1) * kvw];
                        keys.extend_from_slice(&row[..nope]);
                        keys.extend_from_slice(&latent(s)[kvr..]);
                        values.extend_from_slice(&row[nope..]);
                    }
                    let keys = f32_matrix(ctx, qk, &keys);
                    let values = f32_matrix(ctx, vd, &values);
                    let mut out = vec![0.0f32; tq * vd];
                    let mut qb = Vec::with_capacity(QB * qk);
                    let mut sc = vec![0.0f32; tq.min(QB) * ctx];
                    let mut t0 = 0;
                    while t0 < tq {
                        let b = (tq - t0).min(QB);
                        let block = &positions[t0..t0 + b];
                        let seen = (block.iter().max().copied().unwrap_or(0) + 1).min(ctx);
                        qb.clear();
                        for t in t0..t0 + b {
                            qb.extend_from_slice(&q[(t * n + hd) * qk..(t * n + hd + 1) * qk]);
                        }
                        let sc = &mut sc[..b * seen];
                        keys.matmul_rows(0..seen, &qb, b, sc);
                        for (row, &pos) in sc.chunks_exact_mut(seen).zip(block) {
                            let (live, masked) = row.split_at_mut(pos + 1);
                            for v in live.iter_mut() {
                                *v *= scale;
                            }
                            k::softmax_in_place(live);
                            masked.fill(0.0);
                        }
                        values.matmul_t_rows(0..seen, sc, b, &mut out[t0 * vd..(t0 + b) * vd]);
                        t0 += b;
                    }
                    out
                })
            })
            .collect();
        scatter_heads(&per_head, tq, n, vd, o);
    }

    /// Spec §3.4: fold W_UK into the query and W_UV into the output; attend over the latents.
    /// All `seqs` at once: the absorption products (`W_UKᵀ q`, `W_UV ō`) run over every
    /// sequence's tokens together (one weight pass per step, not per sequence), the latent
    /// attention per sequence. Returns per head `[tokens of seqs in order, vd]`; every value is
    /// the one a call per sequence would give (the products compute each token alike whatever
    /// the batch).
    fn attend_absorbed(&self, mla: &Mla, q: &[f32], seqs: &[AbsorbedSeq]) -> Vec<Vec<f32>> {
        let cfg = &self.cfg;
        let MlaDims {
            n,
            nope,
            vd,
            kvr,
            qk,
            kvw,
            ..
        } = MlaDims::of(cfg, mla.heads);
        let scale = self.softmax_scale;
        let tokens: Vec<usize> = seqs.iter().flat_map(|s| s.tokens.clone()).collect();
        let tq = tokens.len();
        let width = kvr + (qk - nope);
        let uk = Timer::start(Phase::AttnAbsorb);
        // 1. [q~ | q^R] per (token, head): [tq, n, width], q~ = W_UK,h^T q^C by head.
        let absorbed: Vec<Vec<f32>> = (0..n)
            .into_par_iter()
            .map(|hd| {
                let mut qn = Vec::with_capacity(tq * nope);
                for &i in &tokens {
                    qn.extend_from_slice(&q[(i * n + hd) * qk..(i * n + hd) * qk + nope]);
                }
                let mut qt = vec![0.0f32; tq * kvr];
                match &mla.uk_t {
                    Some(uk) => uk[hd].matmul(&qn, tq, &mut qt),
                    None => mla
                        .kv_b
                        .matmul_t_rows(hd * kvw..hd * kvw + nope, &qn, tq, &mut qt),
                }
                qt
            })
            .collect();
        drop(uk);
        let core = Timer::start(Phase::AttnCore);
        let mut qc = vec![0.0f32; tq * n * width];
        for (t, &i) in tokens.iter().enumerate() {
            for (hd, qt) in absorbed.iter().enumerate() {
                let row = &mut qc[(t * n + hd) * width..(t * n + hd + 1) * width];
                row[..kvr].copy_from_slice(&qt[t * kvr..(t + 1) * kvr]);
                row[kvr..].copy_from_slice(&q[(i * n + hd) * qk + nope..(i * n + hd + 1) * qk]);
            }
        }
        // 2. Attention over the latent cache (MQA: a cached row is every head's key and value,
        // spec §3.4), split into work units of (token, chunk of ATTN_CHUNK positions, group of
        // heads). A unit reads each of its rows once for all its heads (`dot_rows_lanes` scores
        // them, `axpy_rows_many` adds them into ō) and keeps a chunk's softmax max and sum, so
        // chunks merge exactly as one softmax would (up to rounding). The chunking depends
        // only on the context length and heads are independent, so results do not depend on
        // the thread count or the batch; a context of ≤ ATTN_CHUNK positions is one chunk and
        // gives the single-softmax bits.
        let mut chunks: Vec<(usize, usize, Range<usize>)> = Vec::new(); // (t, seq, positions)
        let mut t = 0;
        // Per token: its sequence holds prompt positions.
        let mut prompt_token = Vec::with_capacity(tq);
        for (si, seq) in seqs.iter().enumerate() {
            for &pos in seq.positions {
                prompt_token.push(seq.prefill);
                let ctx = pos + 1;
                for c0 in (0..ctx).step_by(ATTN_CHUNK) {
                    chunks.push((t, si, c0..(c0 + ATTN_CHUNK).min(ctx)));
                }
                t += 1;
            }
        }
        let threads = rayon::current_num_threads();
        let per_group = n.div_ceil((threads / chunks.len().max(1)).clamp(1, n));
        let groups = n.div_ceil(per_group);
        // Each (token, head group)'s queries in vector lanes, once for all its chunks: f32, or
        // bf16 pairs over a bf16 cache (attended in BF16 × BF16; C8's rows are dequantized
        // to f32 instead). Prompt positions stay f32 over the widened bf16 rows, so they come
        // out as the naive path computes them (up to rounding), wherever the prompt was split
        // or a prefix cache took its first blocks.
        let head_range = |g: usize| g * per_group..((g + 1) * per_group).min(n);
        let bf16_scores = self.kv_dtype == KvCacheDtype::Bf16 && mla.ckv_scale.is_none();
        let lanes: Vec<Queries> = (0..tq * groups)
            .into_par_iter()
            .map(|i| {
                let (t, heads) = (i / groups, head_range(i % groups));
                let qrows = &qc[(t * n + heads.start) * width..(t * n + heads.end) * width];
                if bf16_scores && !prompt_token[t] {
                    Queries::Bf16(k::HeadPairs::new(qrows, heads.len()))
                } else {
                    Queries::F32(k::HeadLanes::new(qrows, heads.len()))
                }
            })
            .collect();
        let partials: Vec<ChunkPartial> = (0..chunks.len() * groups)
            .into_par_iter()
            .map(|u| {
                let (t, si, range) = &chunks[u / groups];
                let gh = head_range(u % groups).len();
                let latents = seqs[*si].latents;
                let len = range.len();
                // f32 rows for the f32 kernels, or the bf16 rows as cached for the BF16 × BF16
                // ones.
                let (rows, raw): (Vec<&[f32]>, _) = match &lanes[t * groups + u % groups] {
                    Queries::F32(_) => {
                        (range.clone().map(|s| latents.row(s)).collect(), Vec::new())
                    }
                    Queries::Bf16(_) => (Vec::new(), latents.bf16_rows(range.clone())),
                };
                let mut by_pos = vec![0.0f32; len * gh];
                match &lanes[t * groups + u % groups] {
                    Queries::F32(q) => k::dot_rows_lanes(q, &rows, &mut by_pos),
                    Queries::Bf16(q) => k::dot_rows_bf16(q, &raw, &mut by_pos),
                }
                let mut by_head = vec![0.0f32; gh * len];
                for (s, sc) in by_pos.chunks_exact(gh).enumerate() {
                    for (j, &v) in sc.iter().enumerate() {
                        by_head[j * len + s] = scale * v;
                    }
                }
                let mut max = vec![0.0f32; gh];
                let mut sum = vec![0.0f32; gh];
                for (j, sc) in by_head.chunks_exact_mut(len).enumerate() {
                    (max[j], sum[j]) = k::softmax_in_place_stats(sc);
                    for (s, &v) in sc.iter().enumerate() {
                        by_pos[s * gh + j] = v;
                    }
                }
                let mut obar = vec![0.0f32; gh * kvr];
                if raw.is_empty() {
                    let ckv: Vec<&[f32]> = rows.iter().map(|r| &r[..kvr]).collect();
                    k::axpy_rows_many(&by_pos, &ckv, &mut obar);
                } else {
                    // c_kv: the first kvr values of each row.
                    k::axpy_rows_bf16(&by_pos, &raw, &mut obar);
                }
                ChunkPartial { max, sum, obar }
            })
            .collect();
        // Merge a token's chunks in order: ō = Σ_c w_c ō_c, w_c ∝ sum_c·e^(max_c − max).
        let mut obar = vec![0.0f32; tq * n * kvr];
        let mut first = 0;
        while first < chunks.len() {
            let t = chunks[first].0;
            let end = first + chunks[first..].iter().take_while(|c| c.0 == t).count();
            for hd in 0..n {
                let (g, j) = (hd / per_group, hd % per_group);
                let part = |c: usize| &partials[c * groups + g];
                let m = (first..end).fold(f32::NEG_INFINITY, |m, c| m.max(part(c).max[j]));
                let w: Vec<f32> = (first..end)
                    .map(|c| part(c).sum[j] * (part(c).max[j] - m).exp())
                    .collect();
                let total: f32 = w.iter().sum();
                let out = &mut obar[(t * n + hd) * kvr..(t * n + hd + 1) * kvr];
                for (c, wc) in (first..end).zip(&w) {
                    k::axpy(wc / total, &part(c).obar[j * kvr..(j + 1) * kvr], out);
                }
            }
            first = end;
        }
        drop(core);
        let _t = Timer::start(Phase::AttnUv);
        // 3. o_h = W_UV,h ō: [tq, vd] per head.
        (0..n)
            .into_par_iter()
            .map(|hd| {
                let mut ob = Vec::with_capacity(tq * kvr);
                for t in 0..tq {
                    ob.extend_from_slice(&obar[(t * n + hd) * kvr..(t * n + hd + 1) * kvr]);
                }
                let mut out = vec![0.0f32; tq * vd];
                mla.kv_b
                    .matmul_rows(hd * kvw + nope..(hd + 1) * kvw, &ob, tq, &mut out);
                out
            })
            .collect()
    }

    fn moe_forward(&self, moe: &Moe, x: &[f32], t_count: usize, decode: bool) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let e = moe.experts.len();
        let mut logits = vec![0.0f32; t_count * e];
        moe.router.matmul(x, t_count, &mut logits);
        // Per expert, the (token, weight) pairs routed to it.
        let kk = cfg.num_experts_per_tok;
        let mut ids = Vec::with_capacity(t_count * kk);
        let mut ws = Vec::with_capacity(t_count * kk);
        for t in 0..t_count {
            let (i, w) = route(
                &logits[t * e..(t + 1) * e],
                &moe.bias,
                cfg.n_group,
                cfg.topk_group,
                kk,
                cfg.norm_topk_prob,
                cfg.routed_scaling_factor,
            );
            ids.extend(i);
            ws.extend(w);
        }
        let assigned =
            crate::eplb::by_expert(&mut ids, &ws, kk, e, self.force_eplb.as_ref(), decode);
        self.expert_load.record(moe.key, &assigned);
        let gather = |pairs: &[(usize, f32)]| {
            let mut xs = Vec::with_capacity(pairs.len() * h);
            for &(t, _) in pairs {
                xs.extend_from_slice(&x[t * h..(t + 1) * h]);
            }
            xs
        };
        let active: Vec<usize> = (0..e).filter(|&id| !assigned[id].is_empty()).collect();
        // The active experts held here (all of them without expert parallelism); none when the
        // tokens are dispatched to their experts' ranks (this rank's own included).
        let dispatch = self.shard.dispatch && self.shard.ranks > 1;
        let local: Vec<usize> = active
            .iter()
            .copied()
            .filter(|&id| !dispatch && self.shard.owns(moe.key, id, e))
            .collect();
        let expert = |id: usize| -> &Mlp {
            moe.experts[id]
                .as_ref()
                .expect("an expert this rank owns is loaded")
        };
        // With many experts active (a batched step, prefill), the experts go to the pool whole,
        // each one's products on one thread: one fork/join per layer instead of one per product.
        // Otherwise (decode, and steps of up to 3 tokens: an MTP verify of 2, whose 4 one-token
        // experts and 2-token shared expert balance badly over whole-expert jobs; on the
        // shipped model a verify step took 0.77 ms that way against 0.67 ms, docs/PERF.md) all
        // their products, and the shared expert's, go through `matmul_group`: two parallel
        // regions (gate+up, then down) instead of three per expert. The sums below are the
        // same either way.
        let expert_parallel = t_count > 3 && local.len() >= 2 * rayon::current_num_threads();
        let mut ys: Vec<Vec<f32>> = if expert_parallel {
            // The shared expert (every token: the largest job) goes first, so the pool starts
            // it while the routed experts are spread around it; it is last in `ys`.
            let jobs: Vec<Option<usize>> = moe
                .shared
                .as_ref()
                .map(|_| None)
                .into_iter()
                .chain(local.iter().map(|&id| Some(id)))
                .collect();
            let mut ys: Vec<Vec<f32>> = jobs
                .par_iter()
                .map(|job| match *job {
                    Some(id) => {
                        let xs = gather(&assigned[id]);
                        k::serial(|| mlp_forward(expert(id), &xs, assigned[id].len()))
                    }
                    None => {
                        let sh = moe.shared.as_ref().expect("a shared-expert job");
                        k::serial(|| mlp_forward(sh, x, t_count))
                    }
                })
                .collect();
            if moe.shared.is_some() {
                let shared = ys.remove(0);
                ys.push(shared);
            }
            ys
        } else {
            let inputs: Vec<Vec<f32>> = local.iter().map(|&id| gather(&assigned[id])).collect();
            let mut mlps: Vec<&Mlp> = local.iter().map(|&id| expert(id)).collect();
            let mut xs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            let mut counts: Vec<usize> = local.iter().map(|&id| assigned[id].len()).collect();
            if let Some(sh) = &moe.shared {
                mlps.push(sh);
                xs.push(x);
                counts.push(t_count);
            }
            mlp_forward_group(&mlps, &xs, &counts)
        };
        let shared_y = if moe.shared.is_some() { ys.pop() } else { None };
        // The experts whose outputs are summed here: all active ones (gathered from their
        // ranks under expert parallelism alone), or this rank's own when tensor parallelism
        // adds the ranks' sums after the layer.
        let summed = if self.tp.ranks > 1 { &local } else { &active };
        if dispatch {
            let turn = crate::expert_parallel::Turn::Layer {
                key: moe.key,
                x,
                active: &active,
                assigned: &assigned,
            };
            let serve = |key: u32, id: usize, xs: &[f32], _ws: &[f32], n: usize| {
                self.serve_expert(key, id, xs, n)
            };
            let comm = self.comm.as_deref();
            ys = crate::expert_parallel::dispatch_layer(comm, self.shard, h, e, turn, &serve)?;
        } else if self.shard.ranks > 1 && self.tp.ranks == 1 {
            ys = crate::expert_parallel::gather(
                self.comm.as_deref(),
                self.shard,
                moe.key,
                h,
                &active,
                &assigned,
                e,
                ys,
            )?;
        }
        let mut out = vec![0.0f32; t_count * h];
        // Experts in id order, so a token's sum has the same order whatever else is batched
        // (and whichever rank computed the expert).
        for (&id, y) in summed.iter().zip(&ys) {
            for (j, &(t, w)) in assigned[id].iter().enumerate() {
                k::axpy(w, &y[j * h..(j + 1) * h], &mut out[t * h..(t + 1) * h]);
            }
        }
        if let Some(y) = shared_y {
            for (a, b) in out.iter_mut().zip(&y) {
                *a += b;
            }
        }
        Ok(out)
    }

    /// Routed expert `id` of MoE layer `key` over `n` rows another rank (or this one)
    /// dispatched here: its unweighted outputs (the sender weighs and adds them).
    fn serve_expert(&self, key: u32, id: usize, xs: &[f32], n: usize) -> Result<Vec<f32>> {
        let experts = self
            .layers
            .iter()
            .chain(self.mtp.iter().map(|m| &m.layer))
            .find_map(|l| match &l.ffn {
                Ffn::Moe(m) if m.key == key => Some(m.experts.as_slice()),
                _ => None,
            });
        let expert = crate::expert_parallel::served_expert(experts, key, id)?;
        self.expert_load.record_served(key, n);
        Ok(mlp_forward(expert, xs, n))
    }

    /// The end of this rank's step ([`ExpertShard::dispatch`]): serves the other ranks' MoE
    /// tokens until every rank's step is over; returns whether any rank has more work (`more`:
    /// this rank's). Every rank calls it after each step, a rank without work too, until it
    /// returns false. Without dispatch it returns `more`.
    pub fn end_step(&self, more: bool) -> Result<bool> {
        if !(self.shard.dispatch && self.shard.ranks > 1) {
            return Ok(more);
        }
        let serve = |key: u32, id: usize, xs: &[f32], _ws: &[f32], n: usize| {
            self.serve_expert(key, id, xs, n)
        };
        // Another rank began a context-parallel forward: this rank's pieces of its prompts.
        let join = |plans: Vec<Vec<u8>>| -> Result<()> {
            if !self.shard.context {
                return Err(ModelError::Options(
                    "expert dispatch: a rank began a context-parallel forward and this one does \
                     not run context parallelism (the ranks were started with different \
                     layouts)"
                        .into(),
                ));
            }
            self.forward_cp(None, Some(plans), false).map(|_| ())
        };
        crate::expert_parallel::end_step(
            self.comm.as_deref(),
            self.shard,
            self.cfg.hidden_size,
            self.cfg.n_routed_experts.unwrap_or(0),
            more,
            &serve,
            &join,
        )
    }

    /// The group the routed experts are split over (expert parallelism): every rank of `comm`
    /// must hold its shard (`LoadOptions::expert_shard`) and run the same batches.
    pub fn set_communicator(&mut self, comm: Arc<dyn Communicator>) -> Result<()> {
        if self.tp.ranks > 1 {
            self.tp.check_group(comm.as_ref())?;
        } else {
            self.shard.check_group(comm.as_ref())?;
        }
        self.comm = Some(comm);
        Ok(())
    }
}

/// What [`DeepseekV3::attention`] needs under context parallelism: the prompt each of the
/// batch's sequences (segments) belongs to, and the exchange of the call's latent rows for
/// every prompt's whole rows (`[len, width]` each, in the plan's order).
type CpExchange<'a> = dyn Fn(&[f32]) -> Result<cp::Gathered> + Sync + 'a;

struct CpAttend<'a> {
    of_seq: &'a [usize],
    exchange: &'a CpExchange<'a>,
}

/// The MLA head sizes the attention code indexes with.
struct MlaDims {
    /// Heads (this rank's, under tensor parallelism).
    n: usize,
    nope: usize,
    rd: usize,
    vd: usize,
    kvr: usize,
    /// Query/key width per head: `nope + rd`.
    qk: usize,
    /// `kv_b_proj` rows per head: `nope + vd`.
    kvw: usize,
}

impl MlaDims {
    /// `heads`: the heads held here (`Mla::heads`).
    fn of(cfg: &DeepseekV3Config, heads: usize) -> MlaDims {
        let (nope, rd, vd) = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
        MlaDims {
            n: heads,
            nope,
            rd,
            vd,
            kvr: cfg.kv_lora_rank,
            qk: nope + rd,
            kvw: nope + vd,
        }
    }
}

/// One sequence's cached latents `[c_kv | k^R]` by position, for the attention.
struct Latents<'a> {
    /// The sequence's latents as f32 (`[ctx, width]`): C8's dequantized, or a bf16 cache's
    /// widened for the naive path; otherwise read from the cache.
    dequantized: Option<&'a [f32]>,
    table: &'a [u32],
    cache: LatentCache<'a>,
    width: usize,
    block_size: usize,
}

/// A layer's latent cache as stored (without C8: the whole row per slot).
#[derive(Clone, Copy)]
enum LatentCache<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl Latents<'_> {
    /// The row at `pos`: from the f32 values (materialized or cached). A bf16 cache is read
    /// through [`Latents::bf16_rows`] or materialized first (`attention` does one or the other).
    #[inline]
    fn row(&self, pos: usize) -> &[f32] {
        match (self.dequantized, self.cache) {
            (Some(g), _) => &g[pos * self.width..(pos + 1) * self.width],
            (None, LatentCache::F32(c)) => {
                let slot = slot_of(self.table, pos, self.block_size);
                &c[slot * self.width..(slot + 1) * self.width]
            }
            (None, LatentCache::Bf16(_)) => {
                unreachable!("a bf16 latent cache is read through `bf16_rows` or materialized")
            }
        }
    }

    /// The rows at `positions` of a bf16 cache, as stored (only called on one, unmaterialized).
    fn bf16_rows(&self, positions: Range<usize>) -> Vec<&[u16]> {
        let LatentCache::Bf16(c) = self.cache else {
            unreachable!("bf16 scoring is only chosen for a bf16 cache")
        };
        let w = self.width;
        positions
            .map(|pos| {
                let slot = slot_of(self.table, pos, self.block_size);
                &c[slot * w..(slot + 1) * w]
            })
            .collect()
    }
}

/// A (token, head group)'s queries as the latent scoring kernel takes them.
enum Queries {
    F32(k::HeadLanes),
    Bf16(k::HeadPairs),
}

/// bf16 bit patterns to their exact f32 values.
#[inline]
fn widen_bf16(src: &[u16], out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(src) {
        *o = k::bf16_to_f32(b);
    }
}

/// Positions per work unit of the absorbed attention: 128 latent rows (295 KB at width 576)
/// stay in L2 between the scoring and the value pass.
const ATTN_CHUNK: usize = 128;

/// One (token, chunk, head group) unit's softmax statistics and unnormalized-by-the-whole ō.
struct ChunkPartial {
    /// Per head of the group: the chunk's maximum score and Σ exp(score − max).
    max: Vec<f32>,
    sum: Vec<f32>,
    /// [heads of the group, kvr]: Σ_s softmax_chunk(s)·c_kv(s).
    obar: Vec<f32>,
}

/// A sequence of the step on the absorbed attention path: its tokens (indices into the step's
/// packed tokens), their positions, and its latents.
struct AbsorbedSeq<'a> {
    tokens: Range<usize>,
    positions: &'a [usize],
    latents: &'a Latents<'a>,
    /// Prompt positions ([`Batch::mark_prefill`]): scored in f32 over a bf16 cache too.
    prefill: bool,
}

/// [`Mla::uk_t`]: per head, the `nope` key rows of `kv_b` (`[n * (nope + vd), kvr]`, head
/// `h`'s rows at `h * (nope + vd)`) transposed, in `kv_b`'s own format: 16- or 32-bit floats (a
/// bf16 `kv_b` multiplied as BF16 × BF16 gets plain bf16: the absorption keeps f32 activations,
/// as the transposed product does) or FP8 blocks that no head straddles. None otherwise.
fn uk_transposed(kv_b: &Matrix, n: usize, nope: usize, vd: usize) -> Option<Vec<Matrix>> {
    let kvr = kv_b.cols();
    let kvw = nope + vd;
    // The head's key rows transposed, `width` bytes per value.
    let transpose = |bytes: &[u8], width: usize, hd: usize| -> Vec<u8> {
        let mut t = vec![0u8; kvr * nope * width];
        for r in 0..nope {
            let row = (hd * kvw + r) * kvr * width;
            for c in 0..kvr {
                let (src, dst) = (row + c * width, (c * nope + r) * width);
                t[dst..dst + width].copy_from_slice(&bytes[src..src + width]);
            }
        }
        t
    };
    let heads = match kv_b.data() {
        MatrixData::Bf16(b) | MatrixData::Bf16Dot(b) => (0..n)
            .map(|hd| MatrixData::Bf16(k::Bytes::from_vec(transpose(b.as_slice(), 2, hd))))
            .collect::<Vec<_>>(),
        MatrixData::F16(b) => (0..n)
            .map(|hd| MatrixData::F16(k::Bytes::from_vec(transpose(b.as_slice(), 2, hd))))
            .collect(),
        MatrixData::F32(b) => (0..n)
            .map(|hd| MatrixData::F32(k::Bytes::from_vec(transpose(b.as_slice(), 4, hd))))
            .collect(),
        // FP8 blocks transpose into FP8 blocks when no head's key rows straddle a block row in
        // part: either they are whole block rows (DeepSeek's 128 x 128 blocks with 128 + 128
        // rows per head: block (i, j) of the head becomes block (j, i)), or they lie inside
        // one block row (small heads: one block column as wide as the head). Each block keeps
        // its scale.
        MatrixData::Fp8Block {
            data,
            scale_inv,
            block_rows,
            block_cols,
        } => {
            let (br, bc) = (*block_rows, *block_cols);
            let grid_cols = kvr.div_ceil(bc);
            // Per head: (first block row, block columns of the transposed head, their width).
            let layout = |hd: usize| -> Option<(usize, usize, usize)> {
                let (start, offset) = (hd * kvw / br, hd * kvw % br);
                if offset == 0 && nope.is_multiple_of(br) {
                    Some((start, nope / br, br))
                } else if offset + nope <= br {
                    Some((start, 1, nope))
                } else {
                    None
                }
            };
            let layouts: Option<Vec<_>> = (0..n).map(layout).collect();
            layouts?
                .into_iter()
                .enumerate()
                .map(|(hd, (rb0, gc, width))| {
                    let gr = kvr.div_ceil(bc);
                    let mut s = Vec::with_capacity(gr * gc);
                    for i in 0..gr {
                        for j in 0..gc {
                            s.push(scale_inv[(rb0 + j) * grid_cols + i]);
                        }
                    }
                    MatrixData::Fp8Block {
                        data: k::Bytes::from_vec(transpose(data.as_slice(), 1, hd)),
                        scale_inv: s,
                        block_rows: bc,
                        block_cols: width,
                    }
                })
                .collect()
        }
        _ => return None,
    };
    Some(
        heads
            .into_iter()
            .map(|d| Matrix::new(kvr, nope, d).expect("a transposed head of a valid kv_b"))
            .collect(),
    )
}

/// An f32 matrix (row-major `rows x cols`) for the product kernels.
fn f32_matrix(rows: usize, cols: usize, values: &[f32]) -> Matrix {
    Matrix::new(
        rows,
        cols,
        MatrixData::F32(k::Bytes::from_vec(k::f32s_to_le_bytes(values))),
    )
    .expect("an f32 matrix of matching size")
}

fn scatter_heads(per_head: &[Vec<f32>], tq: usize, n: usize, vd: usize, o: &mut [f32]) {
    for (hd, out) in per_head.iter().enumerate() {
        for t in 0..tq {
            o[(t * n + hd) * vd..(t * n + hd + 1) * vd].copy_from_slice(&out[t * vd..(t + 1) * vd]);
        }
    }
}

/// [`mlp_forward`] of several MLPs (each on its own tokens), their products grouped so the thread
/// pool is woken twice in all; results are bit-identical to one call per MLP.
fn mlp_forward_group(mlps: &[&Mlp], xs: &[&[f32]], counts: &[usize]) -> Vec<Vec<f32>> {
    let mut g: Vec<Vec<f32>> = mlps
        .iter()
        .zip(counts)
        .map(|(m, &n)| vec![0.0f32; n * m.gate.rows()])
        .collect();
    let mut u: Vec<Vec<f32>> = g.iter().map(|v| vec![0.0f32; v.len()]).collect();
    {
        let mut jobs = Vec::with_capacity(2 * mlps.len());
        for ((((m, x), &n), gi), ui) in mlps.iter().zip(xs).zip(counts).zip(&mut g).zip(&mut u) {
            jobs.push(k::MatmulJob {
                w: &m.gate,
                x,
                n_tokens: n,
                out: gi,
            });
            jobs.push(k::MatmulJob {
                w: &m.up,
                x,
                n_tokens: n,
                out: ui,
            });
        }
        Matrix::matmul_group(&mut jobs);
    }
    let acts: Vec<Vec<f32>> = g
        .iter()
        .zip(&u)
        .map(|(gi, ui)| {
            let mut a = vec![0.0f32; gi.len()];
            k::silu_mul(gi, ui, &mut a);
            a
        })
        .collect();
    let mut outs: Vec<Vec<f32>> = mlps
        .iter()
        .zip(counts)
        .map(|(m, &n)| vec![0.0f32; n * m.down.rows()])
        .collect();
    {
        let mut jobs: Vec<k::MatmulJob> = mlps
            .iter()
            .zip(&acts)
            .zip(counts)
            .zip(&mut outs)
            .map(|(((m, a), &n), out)| k::MatmulJob {
                w: &m.down,
                x: a,
                n_tokens: n,
                out,
            })
            .collect();
        Matrix::matmul_group(&mut jobs);
    }
    outs
}

/// One MLP: gate and up in one parallel region, then down (bit-identical to three products).
fn mlp_forward(m: &Mlp, x: &[f32], t_count: usize) -> Vec<f32> {
    mlp_forward_group(&[m], &[x], &[t_count])
        .pop()
        .expect("one MLP in, one output")
}

/// noaux_tc routing, spec §3.5: sigmoid scores; the correction bias only for selection;
/// group-limited top-k (groups scored by their two best, others masked to −∞); weights from the
/// unbiased scores, renormalised (+1e-20) and scaled. Ties go to the lower index.
pub fn route(
    logits: &[f32],
    bias: &[f32],
    n_group: usize,
    topk_group: usize,
    top_k: usize,
    norm_topk_prob: bool,
    scaling: f32,
) -> (Vec<usize>, Vec<f32>) {
    let e = logits.len();
    let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let mut choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    if n_group > 1 {
        let per = e / n_group;
        let group_scores: Vec<f32> = (0..n_group)
            .map(|g| {
                let grp = &choice[g * per..(g + 1) * per];
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &v in grp {
                    if v > a {
                        b = a;
                        a = v;
                    } else if v > b {
                        b = v;
                    }
                }
                a + b
            })
            .collect();
        let keep = top_indices(&group_scores, topk_group);
        for g in 0..n_group {
            if !keep.contains(&g) {
                choice[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
            }
        }
    }
    let ids = top_indices(&choice, top_k);
    let mut weights: Vec<f32> = ids.iter().map(|&i| scores[i]).collect();
    if norm_topk_prob {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        for w in &mut weights {
            *w /= sum;
        }
    }
    for w in &mut weights {
        *w *= scaling;
    }
    (ids, weights)
}

/// Indices of the `k` largest values, largest first; ties to the lower index; NaN never wins.
pub(crate) fn top_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| {
        let (x, y) = (v[a], v[b]);
        y.partial_cmp(&x)
            .unwrap_or_else(|| x.is_nan().cmp(&y.is_nan()))
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

/// cos/sin per token of a batch, computed once per forward.
struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    fn new(rope: &Rope, positions: &[usize], half: usize) -> RopeTable {
        let mut cos = vec![0.0f32; positions.len() * half];
        let mut sin = vec![0.0f32; positions.len() * half];
        for (i, &p) in positions.iter().enumerate() {
            rope.cos_sin(
                p,
                &mut cos[i * half..(i + 1) * half],
                &mut sin[i * half..(i + 1) * half],
            );
        }
        RopeTable { half, cos, sin }
    }

    fn get(&self, i: usize) -> (&[f32], &[f32]) {
        (
            &self.cos[i * self.half..(i + 1) * self.half],
            &self.sin[i * self.half..(i + 1) * self.half],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every head's W_UKᵀ holds exactly the transposed key rows of kv_b, in bf16 and in FP8
    /// blocks (a ragged block column included; heads of whole block rows and heads inside one);
    /// FP8 blocks that heads straddle get none.
    #[test]
    fn uk_transposed_holds_the_heads_key_rows() {
        let (n, nope, vd, kvr): (usize, usize, usize, usize) = (3, 8, 8, 12);
        let rows = n * (nope + vd);
        let mut seed = 7u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (seed >> 16) as u8
        };
        let codes: Vec<u8> = (0..rows * kvr)
            .map(|_| match next() {
                b if b & 0x7f == 0x7f => b - 1,
                b => b,
            })
            .collect();
        let fp8 = |br: usize, bc: usize| {
            let grid = rows.div_ceil(br) * kvr.div_ceil(bc);
            let scale_inv = (0..grid).map(|i| 0.5 + i as f32 * 0.25).collect();
            Matrix::new(
                rows,
                kvr,
                MatrixData::Fp8Block {
                    data: k::Bytes::from_vec(codes.clone()),
                    scale_inv,
                    block_rows: br,
                    block_cols: bc,
                },
            )
            .unwrap()
        };
        let bf16 = Matrix::new(
            rows,
            kvr,
            MatrixData::Bf16(k::Bytes::from_vec(k::u16s_to_le_bytes(
                &(0..rows * kvr)
                    .map(|i| k::f32_to_bf16(i as f32 * 0.01 - 1.0))
                    .collect::<Vec<_>>(),
            ))),
        )
        .unwrap();
        // Whole block rows per head (4, 8), heads inside one block row (32: offsets 0, 16, 0).
        for kv_b in [fp8(4, 5), fp8(8, 12), fp8(32, 5), bf16] {
            let all = kv_b.to_f32_vec();
            let uk = uk_transposed(&kv_b, n, nope, vd).expect("transposable");
            assert_eq!(uk.len(), n);
            for (hd, m) in uk.iter().enumerate() {
                assert_eq!((m.rows(), m.cols()), (kvr, nope));
                let got = m.to_f32_vec();
                for c in 0..kvr {
                    for r in 0..nope {
                        let want = all[(hd * (nope + vd) + r) * kvr + c];
                        assert_eq!(
                            got[c * nope + r].to_bits(),
                            want.to_bits(),
                            "{} head {hd}",
                            kv_b.format_name()
                        );
                    }
                }
            }
        }
        // 12-row blocks: head 2's key rows (32..40) straddle the block-row boundary at 36.
        assert!(uk_transposed(&fp8(12, 4), n, nope, vd).is_none());
    }

    #[test]
    fn routing_masks_groups_with_neg_infinity() {
        // 4 groups of 2; group scores from biased values; keep 2 groups.
        let logits = [2.0, 1.9, -3.0, -3.0, 0.5, 0.4, 1.0, -5.0];
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0, 0.0];
        let (ids, ws) = route(&logits, &bias, 4, 2, 3, true, 2.5);
        // groups: g0 = s(2)+s(1.9) high; g2 = s(.5)+s(.4); g3 = s(1)-2 + s(-5) low; g1 lowest-ish
        assert_eq!(ids[..2], [0, 1]);
        assert_eq!(ids[2], 4);
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        let sum = sig(2.0) + sig(1.9) + sig(0.5);
        assert!((ws[0] - sig(2.0) / sum * 2.5).abs() < 1e-6);
        assert!((ws.iter().sum::<f32>() - 2.5).abs() < 1e-5);
    }

    #[test]
    fn routing_ties_pick_lower_index() {
        let logits = [0.0; 6];
        let bias = [0.0; 6];
        let (ids, _) = route(&logits, &bias, 1, 1, 3, true, 1.0);
        assert_eq!(ids, vec![0, 1, 2]);
    }

    #[test]
    fn bias_selects_but_does_not_weight() {
        let logits = [1.0, 0.0, 0.0];
        let bias = [0.0, 5.0, 0.0];
        let (ids, ws) = route(&logits, &bias, 1, 1, 1, false, 1.0);
        assert_eq!(ids, vec![1]);
        assert!((ws[0] - 0.5).abs() < 1e-6);
    }
}
