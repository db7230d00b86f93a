//! DeepSeek-V4 (Flash / Pro): loading and the forward pass over a packed batch.
//!
//! Spec: `shared/specs/deepseek-v4.md` §2.1 (embedding, 4 streams), §2.2 (RMSNorm), §2.3 (mHC),
//! §2.4 (block), §2.5 (two RoPE tables), §2.6 (MQA with K = V, 128-token window, sink, inverse
//! RoPE, grouped output), §2.7 (compressor), §2.8 (lightning indexer), §2.9 (MoE with
//! sqrt-softplus, hash layers, SwiGLU clamp), §2.10 (head), §2.11 (MTP), §3 (state), §4.1
//! (checkpoint layout), §4.7 (dispatch on tensor dtypes). The maths of each rule lives in
//! [`crate::v4_ops`]; this file wires weights, cache slots and batches.
//!
//! Activations are f32 throughout; [REF]'s bf16 roundings are not reproduced (the cache's values
//! are with `set_kv_cache_dtype(Bf16)`), and its
//! activation/KV quantisation sims (§2.12) are off unless [`DeepseekV4::quant_sim`] is set (the
//! reference fixtures are float32 without them; see docs/ARCHITECTURE.md "DeepSeek-V4").
//!
//! **Cache design (position-addressable, two layouts, [`V4CacheMode`]).** Every piece of
//! per-sequence state is addressed by the position that produced it, so chunked prefill, decode,
//! batching and rollback are all "read positions": the window KV (`head_dim`), the compressor
//! inputs `A_t` and `Z_t` (ape already added; `c·head_dim` each, c = 2 for ratio 4), the
//! compressed entry emitted by a block's last token, and for ratio-4 layers the indexer
//! compressor's `A_t`/`Z_t` (`2·index_head_dim` each) and its indexer key. The window of query p
//! is positions `max(0, p−W+1)..=p`; entry j of a ratio-r layer is visible from position
//! `j·r + r − 1` on. Within a step, the step's own positions are read from its freshly computed
//! rows and written to the cache once every query has read (so a chunk never needs more cache
//! than the positions before it).
//! - **Full** ([`SlotLayout`]): all of it at the position's slot of the paged pool (entry j at
//!   the slot of `j·r + r − 1`): 6·`head_dim` + 5·`index_head_dim` f32 per token and layer for
//!   Flash (653 KB per token; half in bf16). Blocks hold everything, so prefix caching can
//!   share them.
//! - **Compact** (the default, [`RingLayout`]): only entries and indexer keys live in the paged
//!   pool, entry j spread over the slots of positions `j·r .. j·r + 4` (so 160 f32 per token and
//!   layer for Flash's shapes: 28 KB per token, 14 KB in bf16); the window KV and compressor
//!   inputs of the last
//!   `W + 16` and `c·r + 16` positions live in the sequence's state slot
//!   ([`Batch::state_slots`]), rings indexed by `position mod size`. Reads reach back at most
//!   W − 1 (window) and c·r − 1 (compressor) positions, so the 16 extra positions let a step
//!   write up to 16 positions that are later rolled back (rejected MTP drafts) without
//!   overwriting one still to be read. A sequence must run from position 0 in its slot (no prefix
//!   caching) or have its slot written from a transfer.
//!
//! Either way any split of a sequence into steps gives bit-identical results, and both layouts
//! give the same bits.
//!
//! Weights: FP8 e4m3 + F8_E8M0 128×128 scales map onto [`MatrixData::Fp8Block`] (scale_inv =
//! 2^(b−127)); routed experts (MXFP4) are dequantized to bf16 at load by
//! [`mxfp4_matrix`]: routed experts stay MXFP4 in memory (native kernel).

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

use cachalot_comm::Communicator;

use cachalot_kernels::{self as k, Matrix, MatrixData};
use rayon::prelude::*;
use safetensors::tensor::Dtype;

use crate::batch::{slot_of, Batch, CacheSpec, FloatsMut, KvCache, KvCacheDtype, LogitsWanted};
use crate::checkpoint::{Checkpoint, TensorView};
use crate::config_v4::DeepseekV4Config;
use crate::context_parallel::{self as cp, cp_pieces};
use crate::deepseek_v3::ForwardOutput;
use crate::eplb::BalancedRouting;
use crate::error::{ModelError, Result};
use crate::expert_parallel::ExpertShard;
use crate::profile::{Phase, Timer};
use crate::tensor_parallel::{self as tp, Cut, TensorShard, VocabRows};
use crate::v4_ops::{self as ops, Fp8Codec, V4Rope};

#[derive(Clone, Copy, Debug, Default)]
pub struct V4LoadOptions {
    /// Load the MTP block(s) `mtp.{j}.*` (skipped otherwise).
    pub load_mtp: bool,
    /// bf16 weights multiplied as BF16 × BF16 (`Matrix::to_bf16_dot`), the gates excepted; as
    /// `LoadOptions::bf16_dot` for V3.
    pub bf16_dot: bool,
    /// The routed experts this process holds (expert parallelism, `ExpertShard`); default all.
    pub expert_shard: ExpertShard,
    /// This process's share of the heads, output groups, intermediate features and
    /// vocabulary (tensor parallelism, `TensorShard`; see [`DeepseekV4::load_from`]).
    pub tensor_shard: TensorShard,
}

/// mHC parameters of one site (`hc_{attn,ffn}_*` or `hc_head_*`).
struct Hc {
    /// `[mix, hc·D]` f32.
    fn_: Matrix,
    base: Vec<f32>,
    scale: Vec<f32>,
}

struct Compressor {
    ratio: usize,
    /// Entry width d (head_dim or index_head_dim).
    d: usize,
    wkv: Matrix,
    wgate: Matrix,
    /// `[ratio, c·d]`.
    ape: Vec<f32>,
    norm: Vec<f32>,
}

impl Compressor {
    fn overlap(&self) -> bool {
        self.ratio == 4
    }
    fn coff(&self) -> usize {
        if self.overlap() {
            2
        } else {
            1
        }
    }
}

struct Indexer {
    wq_b: Matrix,
    weights_proj: Matrix,
    compressor: Compressor,
}

struct Attention {
    ratio: usize,
    wq_a: Matrix,
    q_norm: Vec<f32>,
    wq_b: Matrix,
    wkv: Matrix,
    kv_norm: Vec<f32>,
    wo_a: Matrix,
    wo_b: Matrix,
    sink: Vec<f32>,
    compressor: Option<Compressor>,
    indexer: Option<Indexer>,
    layout: SlotLayout,
    ring: RingLayout,
}

struct Expert {
    w1: Matrix,
    w2: Matrix,
    w3: Matrix,
}

struct Moe {
    /// The block's index (`layers.{key}`, MTP blocks after the main ones): how ranks name the
    /// layer when they dispatch tokens to its experts.
    key: u32,
    gate: Matrix,
    bias: Option<Vec<f32>>,
    /// `[vocab, k]` expert ids of hash layers.
    tid2eid: Option<Vec<u32>>,
    /// Every routed expert by id; `None` where another rank holds it (`ExpertShard`).
    experts: Vec<Option<Expert>>,
    shared: Expert,
}

struct Block {
    hc_attn: Hc,
    hc_ffn: Hc,
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    attn: Attention,
    ffn: Moe,
}

struct MtpBlock {
    e_proj: Matrix,
    h_proj: Matrix,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    norm: Vec<f32>,
    hc_head: Hc,
    block: Block,
}

/// Offsets of the per-token state within a cache slot of one layer (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLayout {
    /// Window KV at 0..head_dim.
    pub a: usize,
    pub z: usize,
    pub entry: usize,
    pub ia: usize,
    pub iz: usize,
    pub ikey: usize,
    /// Values used by this layer.
    pub width: usize,
}

impl SlotLayout {
    pub fn for_ratio(cfg: &DeepseekV4Config, ratio: usize) -> SlotLayout {
        let dh = cfg.head_dim;
        let di = cfg.index_head_dim;
        if ratio == 0 {
            return SlotLayout {
                a: dh,
                z: dh,
                entry: dh,
                ia: dh,
                iz: dh,
                ikey: dh,
                width: dh,
            };
        }
        let coff = if ratio == 4 { 2 } else { 1 };
        let a = dh;
        let z = a + coff * dh;
        let entry = z + coff * dh;
        let end = entry + dh;
        if ratio == 4 {
            let ia = end;
            let iz = ia + 2 * di;
            let ikey = iz + 2 * di;
            SlotLayout {
                a,
                z,
                entry,
                ia,
                iz,
                ikey,
                width: ikey + di,
            }
        } else {
            SlotLayout {
                a,
                z,
                entry,
                ia: end,
                iz: end,
                ikey: end,
                width: end,
            }
        }
    }
}

/// Where a V4 layer keeps each position's state (module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum V4CacheMode {
    /// Compressed entries and indexer keys in the paged pool (a few values per token); the
    /// sliding window's KV and the compressor inputs in per-sequence rings of the last
    /// positions. Bounded memory per sequence; prefix caching cannot share it.
    #[default]
    Compact,
    /// Every piece of a position's state at its own slot of the paged pool (3712 f32 per token
    /// and layer for Flash): what prefix caching shares.
    Full,
}

impl V4CacheMode {
    /// The name `--v4-cache` takes: `compact` or `full`.
    pub fn name(self) -> &'static str {
        match self {
            V4CacheMode::Compact => "compact",
            V4CacheMode::Full => "full",
        }
    }
}

impl std::str::FromStr for V4CacheMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "compact" => Ok(V4CacheMode::Compact),
            "full" => Ok(V4CacheMode::Full),
            _ => Err(format!(
                "unknown DeepSeek-V4 cache layout {s:?}: use compact (bounded per-sequence rings \
                 for the window and compressor inputs, the default) or full (every position's \
                 state in the paged pool, which prefix caching can share)"
            )),
        }
    }
}

/// Positions a per-sequence ring keeps beyond what the next step reads: a step may write up
/// to this many positions that are later rolled back (rejected MTP drafts, next_n ≤ 3) without
/// overwriting a position still to be read.
pub const RING_SLACK: usize = 16;

/// The compact cache's per-sequence rings of one layer (within a state slot: the window ring,
/// then the compressor-input ring) and where its compressed entries sit in the paged pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingLayout {
    /// Positions in the window ring (`sliding_window + RING_SLACK`): position p at `p mod win`.
    pub win: usize,
    /// Positions in the compressor-input ring (`c·ratio + RING_SLACK`; 0 without a compressor).
    pub az: usize,
    /// Values per position in the compressor-input ring.
    pub az_width: usize,
    /// Offsets within a compressor-input row: `A_t`, `Z_t` (c·head_dim each), the indexer
    /// compressor's (2·index_head_dim each, ratio 4 only).
    pub a: usize,
    pub z: usize,
    pub ia: usize,
    pub iz: usize,
    /// Token slots a compressed entry spans: entry j (then its indexer key) fills the slots of
    /// positions `j·r .. j·r + span`, contiguous in one block.
    pub span: usize,
    /// Values of an entry and its indexer key.
    pub entry_width: usize,
}

impl RingLayout {
    pub fn for_ratio(cfg: &DeepseekV4Config, ratio: usize) -> RingLayout {
        let (dh, di) = (cfg.head_dim, cfg.index_head_dim);
        let win = cfg.sliding_window + RING_SLACK;
        if ratio == 0 {
            return RingLayout {
                win,
                az: 0,
                az_width: 0,
                a: 0,
                z: 0,
                ia: 0,
                iz: 0,
                span: 1,
                entry_width: 0,
            };
        }
        let coff = if ratio == 4 { 2 } else { 1 };
        let (a, z, ia) = (0, coff * dh, 2 * coff * dh);
        let (iz, az_width, entry_width) = if ratio == 4 {
            (ia + 2 * di, ia + 4 * di, dh + di)
        } else {
            (ia, ia, dh)
        };
        let span = [4, 2, 1]
            .into_iter()
            .find(|&s| ratio.is_multiple_of(s))
            .unwrap_or(1);
        RingLayout {
            win,
            az: coff * ratio + RING_SLACK,
            az_width,
            a,
            z,
            ia,
            iz,
            span,
            entry_width,
        }
    }

    /// Values of a state slot this layer uses.
    pub fn state_width(&self, head_dim: usize) -> usize {
        self.win * head_dim + self.az * self.az_width
    }

    /// Values per token slot this layer's entries need.
    pub fn token_width(&self) -> usize {
        self.entry_width.div_ceil(self.span)
    }

    /// Bytes per token slot this layer's entries need in an fp8 cache ([`Fp8Codec`]: an
    /// entry, then for ratio 4 its indexer key, over [`RingLayout::span`] slots).
    pub fn fp8_token_bytes(&self, codec: &Fp8Codec, head_dim: usize) -> usize {
        if self.entry_width == 0 {
            return 0;
        }
        let key = if self.entry_width > head_dim {
            codec.key_bytes()
        } else {
            0
        };
        (codec.entry_bytes() + key).div_ceil(self.span)
    }
}

/// A layer's token storage as attention reads and writes it: float values (f32 or bf16), or
/// an fp8 cache's bytes (compact layout only: each compressed entry and indexer key encoded by
/// [`Fp8Codec`] where the float layout puts its values).
enum TokStore<'a> {
    Floats(FloatsMut<'a>),
    Fp8(&'a mut [i8]),
}

/// The fp8 cache's encoding for a model of these shapes.
fn fp8_codec(cfg: &DeepseekV4Config) -> Fp8Codec {
    Fp8Codec {
        nope: cfg.head_dim - cfg.qk_rope_head_dim,
        rope: cfg.qk_rope_head_dim,
        index: cfg.index_head_dim,
    }
}

pub struct DeepseekV4 {
    cfg: DeepseekV4Config,
    embed: VocabRows,
    layers: Vec<Block>,
    norm: Vec<f32>,
    head: Matrix,
    hc_head: Hc,
    mtp: Vec<MtpBlock>,
    rope_window: V4Rope,
    rope_compressed: V4Rope,
    /// Token-slot width of the full layout (the widest layer's [`SlotLayout`]).
    cache_width: usize,
    /// Token-slot and state-slot widths of the compact layout (the widest layer's).
    compact_width: usize,
    /// Bytes per token slot of the compact layout in an fp8 cache (the widest layer's).
    compact_bytes: usize,
    state_width: usize,
    /// Token slots the widest compressed entry spans in the compact layout (the block size
    /// must be a multiple of it).
    entry_span: usize,
    cache_mode: V4CacheMode,
    /// How the cache stores its values (`set_kv_cache_dtype`).
    kv_dtype: KvCacheDtype,
    /// Apply [REF]'s quantisation sims (spec §2.12): FP8 act_quant (1×128, ue8m0) on the input of
    /// every FP8/FP4 linear, FP8 round trip (1×64) of the window and compressed KV nope dims,
    /// FP4 round trip (1×32) of the indexer queries and keys. Off by default: the reference
    /// fixtures (transformers, float32) have none of them.
    pub quant_sim: bool,
    /// `force_eplb`: routed expert ids (hash layers' included) replaced by a balanced
    /// assignment (`crate::eplb`).
    force_eplb: Option<BalancedRouting>,
    /// Tokens each routed expert took, per MoE layer ([`crate::eplb::ExpertLoad`]).
    expert_load: crate::eplb::ExpertLoad,
    /// The routed experts held here, and the group that holds the others.
    shard: ExpertShard,
    /// The heads, output groups, features and vocabulary rows held here.
    tp: TensorShard,
    /// The vocabulary rows `head` holds (all, or this rank's share).
    vocab_share: std::ops::Range<usize>,
    comm: Option<Arc<dyn Communicator>>,
}

/// A routed expert's MXFP4 tensor pair as a native [`MatrixData::Mxfp4`]: e2m1 nibbles `[rows,
/// cols/2]` (I8 or U8) with F8_E8M0 (or U8) scales `[rows, cols/32]`, both used in place (the
/// mmap'd bytes; no dequantized copy). A scale byte of 255 (NaN) is refused by name.
pub fn mxfp4_matrix(w: &TensorView, s: &TensorView, rows: usize, cols: usize) -> Result<Matrix> {
    if !cols.is_multiple_of(32) {
        return Err(w.error(format!(
            "MXFP4 needs the input width ({cols}) to be a multiple of 32"
        )));
    }
    w.expect_shape(&[rows, cols / 2])?;
    s.expect_shape(&[rows, cols / 32])?;
    if !matches!(s.dtype, Dtype::F8_E8M0 | Dtype::U8) {
        return Err(s.error(format!(
            "has dtype {:?}; MXFP4 scales are F8_E8M0 (or U8 e8m0 codes)",
            s.dtype
        )));
    }
    Matrix::new(
        rows,
        cols,
        MatrixData::Mxfp4 {
            data: w.bytes.clone(),
            scale: s.bytes.clone(),
        },
    )
    .map_err(|e| s.error(e.to_string()))
}

fn e8m0_scales(s: &TensorView) -> Result<Vec<f32>> {
    if !matches!(s.dtype, Dtype::F8_E8M0 | Dtype::U8) {
        return Err(s.error(format!(
            "has dtype {:?}; block scales must be F8_E8M0 (or U8 e8m0 codes) or F32",
            s.dtype
        )));
    }
    s.bytes
        .as_slice()
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            ops::e8m0_to_f32(b).ok_or_else(|| {
                s.error(format!("scale {i} is 255 (NaN); the checkpoint is damaged"))
            })
        })
        .collect()
}

struct Loader<'a> {
    ckpt: &'a mut Checkpoint,
    block: (usize, usize),
    bf16_dot: bool,
    shard: ExpertShard,
    tp: TensorShard,
}

impl Loader<'_> {
    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>> {
        let v = self.ckpt.take(name, &format!("a vector of {len} values"))?;
        v.expect_shape(&[len])?;
        v.to_finite_f32_vec()
    }

    /// A linear weight `[rows, cols]` under `prefix`: dispatch on the stored dtype and shape
    /// (spec §4.7): BF16/F16/F32 dense; F8_E4M3 (or U8 MXFP8 codes) with `.scale` E8M0 on the
    /// 128×128 grid or per 1×32, or F32 block scales; I8/U8 `[rows, cols/2]` + `.scale` = MXFP4;
    /// I8 `[rows, cols]` + F32 `.scale [rows, 1]` = INT8 per channel.
    /// A weight `[rows, cols]` under `prefix` in any stored format, bf16 ones multiplied as
    /// BF16 × BF16 when `bf16_dot` is asked for.
    fn matrix(&mut self, prefix: &str, rows: usize, cols: usize) -> Result<Matrix> {
        self.matrix_cut(prefix, rows, cols, Cut::Whole)
    }

    /// [`Loader::matrix`], of which only `cut` is kept (tensor parallelism).
    fn matrix_cut(&mut self, prefix: &str, rows: usize, cols: usize, cut: Cut) -> Result<Matrix> {
        let m = self.matrix_f32_acts(prefix, rows, cols)?;
        let m = cut.apply(m, &format!("{prefix}.weight"), self.tp)?;
        Ok(if self.bf16_dot { m.to_bf16_dot() } else { m })
    }

    /// `f(self)` with `bf16_dot` off: what it loads keeps f32 activations.
    fn with_f32_acts<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let saved = std::mem::replace(&mut self.bf16_dot, false);
        let r = f(self);
        self.bf16_dot = saved;
        r
    }

    /// [`Loader::matrix`] with f32 activations whatever `bf16_dot` says (the MoE gates).
    fn matrix_f32_acts(&mut self, prefix: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let name = format!("{prefix}.weight");
        let w = self
            .ckpt
            .take(&name, &format!("a [{rows}, {cols}] weight"))?;
        let sname = format!("{prefix}.scale");
        let packed_k = matches!(w.dtype, Dtype::I8 | Dtype::U8) && w.shape == [rows, cols / 2];
        if packed_k {
            let s = self.ckpt.take(
                &sname,
                &format!(
                    "E8M0 scales [{rows}, {}] for the MXFP4 weight {name}",
                    cols / 32
                ),
            )?;
            return mxfp4_matrix(&w, &s, rows, cols);
        }
        // w4a8-int routed experts (spec §4.4): INT4 packed along the output dim, u64 scales; the
        // `.bias` beside them is an Ascend kernel aid, not a model bias, and is not used. They
        // run W4A8 as the seed runs them (§4.2: int8 per-token activations, int4 × int8 → i32).
        if w.dtype == Dtype::I8 && rows.is_multiple_of(2) && w.shape == [rows / 2, cols] {
            let s = self.ckpt.take(
                &sname,
                &format!("U64 per-row scales [{rows}, 1] for the INT4 weight {name}"),
            )?;
            if s.dtype != Dtype::U64 || (s.shape != [rows, 1] && s.shape != [rows]) {
                // An E8M0 scale says MXFP4: then the weight, not its scale, has the wrong shape.
                if matches!(s.dtype, Dtype::F8_E8M0 | Dtype::U8) {
                    return Err(w.error(format!(
                        "has shape {:?}, and its scale {sname} is E8M0 (MXFP4): an MXFP4 weight \
                         of this [{rows}, {cols}] projection is [{rows}, {}] (two e2m1 codes a \
                         byte); the checkpoint does not match config.json",
                        w.shape,
                        cols / 2
                    )));
                }
                return Err(s.error(format!(
                    "has dtype {:?} shape {:?}; INT4 per-channel scales are U64 [{rows}, 1]",
                    s.dtype, s.shape
                )));
            }
            self.ckpt.skip(&format!("{prefix}.bias"));
            let scale = MatrixData::scales_from_u64_bytes(s.bytes.as_slice())
                .map_err(|e| s.error(e.to_string()))?;
            let data = MatrixData::w4a8_per_channel_packed_n(rows, cols, w.bytes.as_slice(), scale)
                .map_err(|e| w.error(e.to_string()))?;
            return Matrix::new(rows, cols, data).map_err(|e| w.error(e.to_string()));
        }
        w.expect_shape(&[rows, cols])?;
        let data = match w.dtype {
            Dtype::F32 => MatrixData::F32(w.bytes.clone()),
            Dtype::BF16 => MatrixData::Bf16(w.bytes.clone()),
            Dtype::F16 => MatrixData::F16(w.bytes.clone()),
            Dtype::F8_E4M3 | Dtype::U8 => {
                let s = self
                    .ckpt
                    .take(&sname, &format!("block scales for the FP8 weight {name}"))?;
                // w4a8-mx-hif (spec §4.6): HiF8 codes with one F32 scale per row.
                if w.dtype == Dtype::U8
                    && s.dtype == Dtype::F32
                    && (s.shape == [rows, 1] || s.shape == [rows])
                {
                    let data = MatrixData::Hif8 {
                        data: w.bytes.clone(),
                        scale: s.to_f32_vec()?,
                    };
                    return Matrix::new(rows, cols, data).map_err(|e| w.error(e.to_string()));
                }
                let (br, bc) = self.block;
                let grid = [rows.div_ceil(br), cols.div_ceil(bc)];
                let mx = [rows, cols.div_ceil(32)];
                let (block_rows, block_cols) = if s.shape == grid {
                    (br, bc)
                } else if s.shape == mx {
                    (1, 32)
                } else {
                    return Err(s.error(format!(
                        "has shape {:?}; expected the {br}x{bc} grid {grid:?} or per-32 {mx:?}",
                        s.shape
                    )));
                };
                let scale_inv = if s.dtype == Dtype::F32 {
                    s.to_f32_vec()?
                } else {
                    e8m0_scales(&s)?
                };
                MatrixData::Fp8Block {
                    data: w.bytes.clone(),
                    scale_inv,
                    block_rows,
                    block_cols,
                }
            }
            Dtype::I8 => {
                let s = self.ckpt.take(
                    &sname,
                    &format!("F32 per-row scales [{rows}, 1] for the INT8 weight {name}"),
                )?;
                if (s.shape != [rows, 1] && s.shape != [rows]) || s.dtype != Dtype::F32 {
                    return Err(s.error(format!(
                        "has dtype {:?} shape {:?}; INT8 per-channel scales are F32 [{rows}, 1]",
                        s.dtype, s.shape
                    )));
                }
                // Spec §4.3: the w8a8-int/w4a8-int layers take dynamic per-token int8
                // activations; int8 × int8 products with i32 sums (the W8A8 kernels).
                MatrixData::W8A8 {
                    data: w.bytes.clone(),
                    scale: s.to_f32_vec()?,
                }
            }
            other => {
                return Err(w.error(format!(
                    "has dtype {other:?}; supported: F8_E4M3 (+ E8M0 .scale), I8/U8 packed MXFP4, \
                     U8 MXFP8, U8 HiF8 (+ F32 per-row .scale), I8 INT8, I8 INT4 packed along the \
                     output dim (+ U64 .scale), BF16, F16, F32"
                )))
            }
        };
        Matrix::new(rows, cols, data).map_err(|e| w.error(e.to_string()))
    }

    fn hc(
        &mut self,
        fn_name: &str,
        base: &str,
        scale: &str,
        mix: usize,
        width: usize,
        nscale: usize,
    ) -> Result<Hc> {
        let f = self
            .ckpt
            .take(fn_name, &format!("an F32 [{mix}, {width}] mHC matrix"))?;
        f.expect_shape(&[mix, width])?;
        let fn_ = match f.dtype {
            Dtype::F32 => Matrix::new(mix, width, MatrixData::F32(f.bytes.clone())),
            Dtype::BF16 => Matrix::new(mix, width, MatrixData::Bf16(f.bytes.clone())),
            other => return Err(f.error(format!("has dtype {other:?}; mHC parameters are F32"))),
        }
        .map_err(|e| f.error(e.to_string()))?;
        Ok(Hc {
            fn_,
            base: self.vector(base, mix)?,
            scale: self.vector(scale, nscale)?,
        })
    }

    fn compressor(
        &mut self,
        p: &str,
        cfg: &DeepseekV4Config,
        ratio: usize,
        d: usize,
    ) -> Result<Compressor> {
        let coff = if ratio == 4 { 2 } else { 1 };
        let h = cfg.hidden_size;
        let ape = self.ckpt.take(
            &format!("{p}ape"),
            &format!("F32 [{ratio}, {}] position biases", coff * d),
        )?;
        ape.expect_shape(&[ratio, coff * d])?;
        Ok(Compressor {
            ratio,
            d,
            wkv: self.matrix(&format!("{p}wkv"), coff * d, h)?,
            wgate: self.matrix(&format!("{p}wgate"), coff * d, h)?,
            ape: ape.to_f32_vec()?,
            norm: self.vector(&format!("{p}norm.weight"), d)?,
        })
    }

    /// An expert whose intermediate features `features` of `f` are held (all, or a
    /// tensor-parallel share: rows of w1/w3, columns of w2).
    fn expert(
        &mut self,
        p: &str,
        h: usize,
        f: usize,
        features: std::ops::Range<usize>,
    ) -> Result<Expert> {
        Ok(Expert {
            w1: self.matrix_cut(&format!("{p}.w1"), f, h, Cut::Rows(features.clone()))?,
            w2: self.matrix_cut(&format!("{p}.w2"), h, f, Cut::Cols(features.clone()))?,
            w3: self.matrix_cut(&format!("{p}.w3"), f, h, Cut::Rows(features))?,
        })
    }

    fn block(
        &mut self,
        cfg: &DeepseekV4Config,
        p: &str,
        ratio: usize,
        hash: bool,
        key: usize,
    ) -> Result<Block> {
        let (h, hc) = (cfg.hidden_size, cfg.hc_mult);
        let mix = (2 + hc) * hc;
        let (nh, dh) = (cfg.num_attention_heads, cfg.head_dim);
        let (ql, g, ol) = (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank);
        let a = format!("{p}attn.");
        let compressor = if ratio > 0 {
            Some(self.compressor(&format!("{a}compressor."), cfg, ratio, dh)?)
        } else {
            None
        };
        let indexer = if ratio == 4 {
            let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
            // The indexer picks the top-k compressed entries: its products keep f32
            // activations under `bf16_dot` (a flipped selection moves logits far more than
            // the rounding itself), as the MoE gates do.
            Some(self.with_f32_acts(|l| {
                Ok(Indexer {
                    wq_b: l.matrix(&format!("{a}indexer.wq_b"), hi * di, ql)?,
                    weights_proj: l.matrix(&format!("{a}indexer.weights_proj"), hi, h)?,
                    compressor: l.compressor(&format!("{a}indexer.compressor."), cfg, ratio, di)?,
                })
            })?)
        } else {
            None
        };
        // Tensor parallelism: this rank's output groups and their heads (a group's heads are
        // contiguous), the rows of wq_b and wo_a and the columns of wo_b they use.
        let (heads, groups) = (self.tp.part(nh), self.tp.part(g));
        let attn = Attention {
            ratio,
            wq_a: self.matrix(&format!("{a}wq_a"), ql, h)?,
            q_norm: self.vector(&format!("{a}q_norm.weight"), ql)?,
            wq_b: self.matrix_cut(
                &format!("{a}wq_b"),
                nh * dh,
                ql,
                Cut::Rows(heads.start * dh..heads.end * dh),
            )?,
            wkv: self.matrix(&format!("{a}wkv"), dh, h)?,
            kv_norm: self.vector(&format!("{a}kv_norm.weight"), dh)?,
            wo_a: self.matrix_cut(
                &format!("{a}wo_a"),
                g * ol,
                nh * dh / g,
                Cut::Rows(groups.start * ol..groups.end * ol),
            )?,
            wo_b: self.matrix_cut(
                &format!("{a}wo_b"),
                h,
                g * ol,
                Cut::Cols(groups.start * ol..groups.end * ol),
            )?,
            sink: self.vector(&format!("{a}attn_sink"), nh)?[heads].to_vec(),
            compressor,
            indexer,
            layout: SlotLayout::for_ratio(cfg, ratio),
            ring: RingLayout::for_ratio(cfg, ratio),
        };
        let f = format!("{p}ffn.");
        let e = cfg.n_routed_experts;
        let gate = self.matrix_f32_acts(&format!("{f}gate"), e, h)?;
        let (bias, tid2eid) = if hash {
            let name = format!("{f}gate.tid2eid");
            let kk = cfg.num_experts_per_tok;
            let t = self.ckpt.take(
                &name,
                &format!("an I64 [{}, {kk}] token → expert table", cfg.vocab_size),
            )?;
            t.expect_shape(&[cfg.vocab_size, kk])?;
            let ids = t.to_i64_vec()?;
            if let Some((i, bad)) = ids
                .iter()
                .enumerate()
                .find(|(_, &x)| x < 0 || x as usize >= e)
            {
                return Err(t.error(format!(
                    "entry {i} is expert {bad}, outside 0..{e} (n_routed_experts)"
                )));
            }
            (None, Some(ids.into_iter().map(|x| x as u32).collect()))
        } else {
            (Some(self.vector(&format!("{f}gate.bias"), e)?), None)
        };
        let fi = cfg.moe_intermediate_size;
        let experts = (0..e)
            .map(|j| {
                let name = format!("{f}experts.{j}");
                if self.shard.holds(key as u32, j, e) {
                    // Whole under expert parallelism (with or without tensor parallelism of
                    // the rest), else this rank's tensor-parallel share.
                    let features = if self.shard.ranks > 1 {
                        0..fi
                    } else {
                        self.tp.part(fi)
                    };
                    self.expert(&name, h, fi, features).map(Some)
                } else {
                    // Another rank's expert: never read.
                    self.ckpt.skip_prefix(&format!("{name}."));
                    Ok(None)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let ffn = Moe {
            key: key as u32,
            gate,
            bias,
            tid2eid,
            experts,
            shared: self.expert(&format!("{f}shared_experts"), h, fi, self.tp.part(fi))?,
        };
        Ok(Block {
            hc_attn: self.hc(
                &format!("{p}hc_attn_fn"),
                &format!("{p}hc_attn_base"),
                &format!("{p}hc_attn_scale"),
                mix,
                hc * h,
                3,
            )?,
            hc_ffn: self.hc(
                &format!("{p}hc_ffn_fn"),
                &format!("{p}hc_ffn_base"),
                &format!("{p}hc_ffn_scale"),
                mix,
                hc * h,
                3,
            )?,
            attn_norm: self.vector(&format!("{p}attn_norm.weight"), h)?,
            ffn_norm: self.vector(&format!("{p}ffn_norm.weight"), h)?,
            attn,
            ffn,
        })
    }
}

/// The state a step's tokens add to one attention layer ([`DeepseekV4::attn_rows`]), one
/// packed row per token: the window row `[dh]`, then the compressor's inputs A and Z and the
/// indexer compressor's (`[coff·d]` each, where the layer has them); widths from
/// [`DeepseekV4::row_widths`]. Packed so that context parallelism gathers them as they are.
struct StepRows {
    data: Vec<f32>,
    w: [usize; 3],
}

impl StepRows {
    fn view(&self) -> RowsView<'_> {
        RowsView {
            data: &self.data,
            w: self.w,
        }
    }
}

/// Packed step rows ([`StepRows`]) read in place: a step's own, or gathered ones.
#[derive(Clone, Copy)]
struct RowsView<'a> {
    data: &'a [f32],
    w: [usize; 3],
}

impl<'a> RowsView<'a> {
    /// Values a token's row holds.
    fn width(w: [usize; 3]) -> usize {
        w[0] + 2 * w[1] + 2 * w[2]
    }

    fn row(&self, i: usize) -> &'a [f32] {
        let tw = Self::width(self.w);
        &self.data[i * tw..(i + 1) * tw]
    }

    /// Token i's window row.
    fn kv(&self, i: usize) -> &'a [f32] {
        &self.row(i)[..self.w[0]]
    }

    /// Token i's compressor inputs (A, Z): the main compressor's, or with `indexer` the
    /// indexer's.
    fn az(&self, i: usize, indexer: bool) -> (&'a [f32], &'a [f32]) {
        let (off, cw) = if indexer {
            (self.w[0] + 2 * self.w[1], self.w[2])
        } else {
            (self.w[0], self.w[1])
        };
        let r = self.row(i);
        (&r[off..off + cw], &r[off + cw..off + 2 * cw])
    }
}

/// Queries to attend in [`DeepseekV4::attn_core`]: their rows, each one's (sequence of the
/// rows' batch, position), and the RoPE tables of the batch they came from.
type QueriesAt<'a> = (&'a Queries, &'a [(usize, usize)], &'a BatchRopes);

/// A step's queries of one attention layer ([`DeepseekV4::attn_queries`]): the heads' `[nh·dh]`
/// per token, and the indexer's queries `[hi·di]` and head weights `[hi]` where it has one.
struct Queries {
    q: Vec<f32>,
    iq: Vec<f32>,
    iw: Vec<f32>,
}

/// cos/sin of both RoPE tables for every token of a batch.
struct BatchRopes {
    half: usize,
    window: (Vec<f32>, Vec<f32>),
    compressed: (Vec<f32>, Vec<f32>),
}

impl BatchRopes {
    fn new(m: &DeepseekV4, positions: &[usize]) -> BatchRopes {
        let half = m.rope_window.half();
        let table = |r: &V4Rope| {
            let mut c = vec![0.0f32; positions.len() * half];
            let mut s = vec![0.0f32; positions.len() * half];
            for (i, &p) in positions.iter().enumerate() {
                r.cos_sin(
                    p,
                    &mut c[i * half..(i + 1) * half],
                    &mut s[i * half..(i + 1) * half],
                );
            }
            (c, s)
        };
        BatchRopes {
            half,
            window: table(&m.rope_window),
            compressed: table(&m.rope_compressed),
        }
    }

    fn get(&self, compressed: bool, i: usize) -> (&[f32], &[f32]) {
        let (c, s) = if compressed {
            &self.compressed
        } else {
            &self.window
        };
        let r = i * self.half..(i + 1) * self.half;
        (&c[r.clone()], &s[r])
    }
}

impl DeepseekV4 {
    pub fn load(dir: &Path, opts: V4LoadOptions) -> Result<DeepseekV4> {
        let cfg = DeepseekV4Config::from_dir(dir)?;
        let mut ckpt = Checkpoint::open(dir)?;
        Self::load_from(cfg, &mut ckpt, opts)
    }

    pub fn load_from(
        cfg: DeepseekV4Config,
        ckpt: &mut Checkpoint,
        opts: V4LoadOptions,
    ) -> Result<DeepseekV4> {
        let block = match &cfg.quantization {
            Some(crate::config_v4::V4Quantization::Fp8 {
                block_rows,
                block_cols,
            }) => (*block_rows, *block_cols),
            _ => (128, 128),
        };
        let shard = opts.expert_shard;
        let e = cfg.n_routed_experts;
        shard.validate(e)?;
        // Tensor parallelism (spec `deepseek-v4.md` §2.6/§2.9 split as the seed's attention and
        // MoE TP): each rank holds `num_attention_heads / ranks` heads — whole output groups,
        // so `o_groups` divides too — their rows of wq_b and wo_a, their columns of wo_b and
        // their attention sinks; a share of every expert's intermediate features (the routed
        // experts held whole with an expert shard of the same group); a share of the
        // vocabulary's rows of the embedding and head. wq_a, wkv, the norms, the compressors,
        // the indexer, the gates and the mHC parameters are whole, so the cache is the same on
        // every rank. A block's attention and MoE outputs are added over the ranks before mHC.
        let t = opts.tensor_shard;
        let mut sizes = vec![
            ("num_attention_heads", cfg.num_attention_heads),
            ("o_groups", cfg.o_groups),
            ("moe_intermediate_size", cfg.moe_intermediate_size),
        ];
        if shard.ranks > 1 && t.ranks > 1 {
            if shard.dispatch || (t.rank, t.ranks) != (shard.rank, shard.ranks) {
                return Err(ModelError::Options(format!(
                    "tensor parallelism as rank {} of {} with expert parallelism as rank {} of \
                     {}{}: both together split over one group (the same rank of the same \
                     ranks), experts gathered",
                    t.rank,
                    t.ranks,
                    shard.rank,
                    shard.ranks,
                    if shard.dispatch { " (dispatched)" } else { "" }
                )));
            }
            sizes.pop();
            sizes.push((
                "moe_intermediate_size (shared expert)",
                cfg.moe_intermediate_size,
            ));
        }
        t.check_sizes(&sizes)?;
        let mut l = Loader {
            ckpt,
            block,
            bf16_dot: opts.bf16_dot,
            shard,
            tp: t,
        };
        let (h, v, hc) = (cfg.hidden_size, cfg.vocab_size, cfg.hc_mult);
        let vocab_share = t.share(v);
        let embed = l.matrix_cut("embed", v, h, Cut::Rows(vocab_share.clone()))?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            layers.push(l.block(
                &cfg,
                &format!("layers.{i}."),
                cfg.compress_ratio(i),
                cfg.is_hash_layer(i),
                i,
            )?);
        }
        let norm = l.vector("norm.weight", h)?;
        let vocab_rows = Cut::Rows(vocab_share.clone());
        let head = if cfg.tie_word_embeddings && !l.ckpt.contains("head.weight") {
            l.matrix_cut("embed", v, h, vocab_rows)?
        } else {
            l.matrix_cut("head", v, h, vocab_rows)?
        };
        let hc_head = l.hc("hc_head_fn", "hc_head_base", "hc_head_scale", hc, hc * h, 1)?;
        let mut mtp = Vec::new();
        for j in 0..cfg.num_nextn_predict_layers {
            let p = format!("mtp.{j}.");
            if opts.load_mtp {
                let ratio = cfg.compress_ratio(cfg.num_hidden_layers + j);
                mtp.push(MtpBlock {
                    e_proj: l.matrix(&format!("{p}e_proj"), h, h)?,
                    h_proj: l.matrix(&format!("{p}h_proj"), h, h)?,
                    enorm: l.vector(&format!("{p}enorm.weight"), h)?,
                    hnorm: l.vector(&format!("{p}hnorm.weight"), h)?,
                    norm: l.vector(&format!("{p}norm.weight"), h)?,
                    hc_head: l.hc(
                        &format!("{p}hc_head_fn"),
                        &format!("{p}hc_head_base"),
                        &format!("{p}hc_head_scale"),
                        hc,
                        hc * h,
                        1,
                    )?,
                    block: l.block(&cfg, &p, ratio, false, cfg.num_hidden_layers + j)?,
                });
                // Some exports carry copies of the shared embedding / head here.
                l.ckpt.skip(&format!("{p}embed.weight"));
                l.ckpt.skip(&format!("{p}head.weight"));
            } else {
                l.ckpt.skip_prefix(&p);
            }
        }
        l.ckpt.ensure_all_used()?;
        let rd = cfg.qk_rope_head_dim;
        let rope_window = V4Rope::plain(cfg.rope_theta, rd);
        let rope_compressed = V4Rope::yarn(cfg.compress_rope_theta, rd, cfg.rope_scaling.as_ref());
        let cache_width = layers
            .iter()
            .chain(mtp.iter().map(|m| &m.block))
            .map(|b| b.attn.layout.width)
            .max()
            .unwrap_or(cfg.head_dim);
        let rings = || {
            layers
                .iter()
                .chain(mtp.iter().map(|m| &m.block))
                .map(|b| b.attn.ring)
        };
        let compact_width = rings().map(|r| r.token_width()).max().unwrap_or(0).max(1);
        let codec = fp8_codec(&cfg);
        let compact_bytes = rings()
            .map(|r| r.fp8_token_bytes(&codec, cfg.head_dim))
            .max()
            .unwrap_or(0)
            .max(1);
        let entry_span = rings().map(|r| r.span).max().unwrap_or(1);
        let state_width = rings()
            .map(|r| r.state_width(cfg.head_dim))
            .max()
            .unwrap_or(0);
        let expert_load =
            crate::eplb::ExpertLoad::new(cfg.num_hidden_layers + mtp.len(), cfg.n_routed_experts);
        Ok(DeepseekV4 {
            cfg,
            embed: VocabRows {
                table: embed,
                share: vocab_share.clone(),
            },
            layers,
            norm,
            head,
            hc_head,
            mtp,
            rope_window,
            rope_compressed,
            cache_width,
            compact_width,
            compact_bytes,
            state_width,
            entry_span,
            cache_mode: V4CacheMode::default(),
            kv_dtype: KvCacheDtype::F32,
            quant_sim: false,
            expert_load,
            force_eplb: None,
            shard: opts.expert_shard,
            tp: t,
            vocab_share,
            comm: None,
        })
    }

    /// `force_eplb` (the seed's "perfect EPLB" benchmark mode, `crate::eplb`): with `Some`,
    /// every MoE layer — hash-routed ones and the MTP blocks' included — replaces its top-k ids
    /// by the balanced assignment and keeps the gate's weights. Errors if the assignment is for
    /// another expert count.
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
            r.check_model(self.cfg.n_routed_experts)?;
        }
        self.force_eplb = routing;
        Ok(())
    }

    /// Whether `force_eplb` routes the experts (then a token's experts depend on its place in
    /// the step, so its KV depends on the batch: no prefix caching).
    pub fn forces_eplb(&self) -> bool {
        self.force_eplb.is_some()
    }

    /// Holds the output `head` in int8 (W8A8, one scale per row; see
    /// `DeepseekV3::quantize_head_int8`). Off by default (the seed keeps it in bf16).
    pub fn quantize_head_int8(&mut self) {
        self.head = self.head.to_w8a8();
    }

    pub fn config(&self) -> &DeepseekV4Config {
        &self.cfg
    }

    pub fn num_mtp_layers(&self) -> usize {
        self.mtp.len()
    }

    /// One cache layer per main layer, then one per loaded MTP block; every layer's slots are as
    /// wide as the widest layer kind needs ([`SlotLayout`] in the full layout, [`RingLayout`]'s
    /// entry share and state slot in the compact one); values as `set_kv_cache_dtype` says.
    /// In an fp8 cache (compact layout) the token slots are bytes ([`Fp8Codec`]) and the
    /// rings bf16.
    pub fn cache_spec(&self) -> CacheSpec {
        self.spec_for(self.cache_mode)
    }

    fn spec_for(&self, mode: V4CacheMode) -> CacheSpec {
        let (width, int8_width, seq_state_width) = match mode {
            V4CacheMode::Full => (self.cache_width, 0, 0),
            V4CacheMode::Compact if self.kv_dtype == KvCacheDtype::Fp8 => {
                (self.compact_bytes, self.compact_bytes, self.state_width)
            }
            V4CacheMode::Compact => (self.compact_width, 0, self.state_width),
        };
        CacheSpec {
            layers: self.layers.len() + self.mtp.len(),
            width,
            int8_width,
            float: self.kv_dtype,
            seq_state_width,
        }
    }

    /// A layer of `cache` as [`DeepseekV4::attn_core`] takes it: its token storage and its
    /// rings.
    fn layer_stores<'a>(&self, cache: &'a mut KvCache, li: usize) -> (TokStore<'a>, FloatsMut<'a>) {
        if cache.spec().float == KvCacheDtype::Fp8 {
            let (bytes, state) = cache.layer_bytes_and_state_mut(li);
            (TokStore::Fp8(bytes), state)
        } else {
            let (tok, state) = cache.layer_and_state_mut(li);
            (TokStore::Floats(tok), state)
        }
    }

    /// The cache layout ([`V4CacheMode`]; compact unless set).
    pub fn cache_mode(&self) -> V4CacheMode {
        self.cache_mode
    }

    /// Chooses the cache layout; caches made before for the other layout no longer fit.
    pub fn set_cache_mode(&mut self, mode: V4CacheMode) {
        self.cache_mode = mode;
    }

    /// How the cache stores its values: f32 (exact, the default) or bf16 (half the memory, as
    /// [REF] keeps its caches, spec §2.0). In bf16 every value the cache keeps (window rows,
    /// compressor inputs, compressed entries and indexer keys) is rounded to bf16 when it is
    /// made, before any query reads it, so a prompt gives the same bits whichever steps it was
    /// split into, in either layout. fp8 (the seed's fp8 cache, compact layout only): the
    /// rings as in bf16, and each compressed entry and indexer key stored as e4m3 codes with
    /// power-of-two block scales ([`Fp8Codec`]; with [`DeepseekV4::quant_sim`] on, the values
    /// [REF] makes are kept exactly); every query reads the stored entries, the step's own too,
    /// so splits and batching still agree bit for bit. Caches made before no longer fit.
    pub fn set_kv_cache_dtype(&mut self, dtype: KvCacheDtype) {
        self.kv_dtype = dtype;
    }

    /// The cache's value type ([`DeepseekV4::set_kv_cache_dtype`]).
    pub fn kv_cache_dtype(&self) -> KvCacheDtype {
        self.kv_dtype
    }

    /// The stored format of the routed experts (`Matrix::format_name` of layer 0's first
    /// expert): "mxfp4" natively, "w8a8_int8" / "w4a8_int4" after the integer conversions.
    pub fn routed_expert_format(&self) -> Option<&'static str> {
        let b = self.layers.first()?;
        Some(b.ffn.experts.iter().flatten().next()?.w1.format_name())
    }

    /// Bytes of weights one decode token reads (all but unrouted experts and the embedding).
    pub fn decode_bytes_per_token(&self) -> usize {
        self.head.storage_bytes()
            + self
                .layers
                .iter()
                .map(|b| self.block_bytes(b, false))
                .sum::<usize>()
    }

    /// Bytes of the weights this process holds (its shares under tensor or expert
    /// parallelism), MTP blocks included.
    pub fn weight_bytes(&self) -> usize {
        self.embed.table.storage_bytes()
            + self.head.storage_bytes()
            + self
                .layers
                .iter()
                .map(|b| self.block_bytes(b, true))
                .sum::<usize>()
            + self
                .mtp
                .iter()
                .map(|m| {
                    m.e_proj.storage_bytes()
                        + m.h_proj.storage_bytes()
                        + self.block_bytes(&m.block, true)
                })
                .sum::<usize>()
    }

    /// A block's weight bytes: with every routed expert held (`all_experts`), or with the
    /// `num_experts_per_tok` a decode token reads.
    fn block_bytes(&self, b: &Block, all_experts: bool) -> usize {
        let ex = |e: &Expert| e.w1.storage_bytes() + e.w2.storage_bytes() + e.w3.storage_bytes();
        let a = &b.attn;
        let comp = |c: &Compressor| c.wkv.storage_bytes() + c.wgate.storage_bytes();
        let routed = if all_experts {
            b.ffn.experts.iter().flatten().map(ex).sum::<usize>()
        } else {
            self.cfg.num_experts_per_tok * b.ffn.experts.iter().flatten().next().map_or(0, ex)
        };
        a.wq_a.storage_bytes()
            + a.wq_b.storage_bytes()
            + a.wkv.storage_bytes()
            + a.wo_a.storage_bytes()
            + a.wo_b.storage_bytes()
            + a.compressor.as_ref().map_or(0, comp)
            + a.indexer.as_ref().map_or(0, |i| {
                i.wq_b.storage_bytes() + i.weights_proj.storage_bytes() + comp(&i.compressor)
            })
            + b.ffn.gate.storage_bytes()
            + routed
            + ex(&b.ffn.shared)
    }

    /// Whether a cache of `block_size`-position blocks can hold this model's state: in the
    /// compact layout a compressed entry fills [`RingLayout::span`] consecutive slots of one
    /// block, so the block size must be a multiple of it (4 for ratios 4 and 128).
    pub fn check_block_size(&self, block_size: usize) -> Result<()> {
        if self.cache_mode == V4CacheMode::Full {
            if self.kv_dtype == KvCacheDtype::Fp8 {
                return Err(ModelError::Options(
                    "DeepSeek-V4's fp8 cache (--kv-cache-dtype fp8) keeps compressed entries in \
                     the compact layout only; use --v4-cache compact, or bf16 with --v4-cache \
                     full"
                        .into(),
                ));
            }
            return Ok(());
        }
        let span = self.entry_span;
        if block_size == 0 || !block_size.is_multiple_of(span) {
            return Err(ModelError::Options(format!(
                "DeepSeek-V4's compact cache needs a block_size that is a multiple of {span} \
                 (got {block_size}): a compressed entry fills {span} slots of one block; pick \
                 another block_size, or the full layout (--v4-cache full)"
            )));
        }
        Ok(())
    }

    /// Checks that `cache` is this model's (its layout, at least `layers` layers) and, in the
    /// compact layout, that the batch's sequences have state slots of their own and entries
    /// fit in one block; reserves the slots the batch uses.
    fn check_cache(&self, cache: &mut KvCache, layers: usize, batch: &Batch) -> Result<()> {
        let spec = cache.spec();
        let want = self.cache_spec();
        if spec.width != want.width
            || spec.int8_width != want.int8_width
            || spec.float != want.float
            || spec.seq_state_width != want.seq_state_width
            || spec.layers < layers
        {
            return Err(ModelError::Batch(format!(
                "cache of {spec:?} does not fit this model ({want:?}; its {} layout)",
                self.cache_mode.name()
            )));
        }
        self.check_block_size(cache.block_size())?;
        if self.cache_mode == V4CacheMode::Compact {
            // A sequence's rings are found by its slot: with several sequences, the batch
            // must say which is whose (their order may change between steps).
            if batch.num_seqs() > 1 && batch.state_slots.len() < batch.num_seqs() {
                return Err(ModelError::Batch(format!(
                    "a batch of {} sequences over DeepSeek-V4's compact cache names {} state \
                     slots: give each sequence its slot (Batch::set_state_slot), the one it \
                     has used from its first position",
                    batch.num_seqs(),
                    batch.state_slots.len()
                )));
            }
            let mut slots: Vec<usize> =
                (0..batch.num_seqs()).map(|s| batch.state_slot(s)).collect();
            slots.sort_unstable();
            if let Some(w) = slots.windows(2).find(|w| w[0] == w[1]) {
                return Err(ModelError::Batch(format!(
                    "two sequences of the batch share state slot {}: each running sequence \
                     needs its own",
                    w[0]
                )));
            }
            if let Some(&most) = slots.last() {
                cache.reserve_seq_slots(most + 1);
            }
        }
        Ok(())
    }

    /// Forwards a packed batch: writes every token's state into its cache slot (window KV,
    /// compressor inputs, emitted compressed entries), attends per sequence over its cache and
    /// returns the requested logits; `hidden` (when asked) holds every token's last-block
    /// streams `[T, hc·D]`, the MTP input.
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

    /// Every token's embedding copied into the hc streams, `[T, hc·D]`.
    fn streams(&self, rows: &[f32]) -> Vec<f32> {
        let (h, hc) = (self.cfg.hidden_size, self.cfg.hc_mult);
        let mut x = vec![0.0f32; rows.len() * hc];
        for (t, row) in rows.chunks_exact(h).enumerate() {
            for s in 0..hc {
                x[(t * hc + s) * h..(t * hc + s + 1) * h].copy_from_slice(row);
            }
        }
        x
    }

    /// [`DeepseekV4::forward`] of this rank's batch alone.
    fn forward_plain(
        &self,
        batch: &Batch,
        cache: &mut KvCache,
        want_hidden: bool,
    ) -> Result<ForwardOutput> {
        let cfg = &self.cfg;
        batch.validate(cache.block_size(), cache.num_blocks(), cfg.vocab_size)?;
        self.check_cache(cache, self.layers.len(), batch)?;
        let step = tp::batch_digest(self.tp, batch, 0);
        let rows = self
            .embed
            .lookup(self.comm.as_deref(), self.tp, step, &batch.tokens)?;
        let mut x = self.streams(&rows);
        let ropes = BatchRopes::new(self, &batch.positions);
        for (li, layer) in self.layers.iter().enumerate() {
            self.block_forward(layer, &mut x, batch, &ropes, cache, li, step)?;
        }
        self.output(&x, &self.hc_head, &self.norm, batch, want_hidden, step)
    }

    /// A forward under prefill context parallelism ([`ExpertShard::context`], executor spec
    /// §4.5, `deepseek-v4.md` §3: the seed's zig-zag prefill that all-gathers the window rows
    /// and compressed caches), as `DeepseekV3::forward_cp` (the shared parts in
    /// `context_parallel`): every rank's prompts are split over the ranks, two pieces each.
    /// At every attention layer each rank computes its pieces' rows (window K = V row,
    /// compressor and indexer-compressor inputs) and the ranks gather them, so every rank
    /// holds each prompt's whole rows: it emits the prompt's compressed entries into a scratch
    /// cache of its own (one layer; entries only, the rows are read as the step's) and its
    /// pieces' queries attend over the window and the entries exactly as one process's whole
    /// prompt would; the prompt's own rank writes the rows and entries into its cache (slots,
    /// or entries and rings in the compact layout). The MoE layers dispatch every rank's rows
    /// to the experts' ranks. At the end each prompt's streams go back to its rank, which
    /// computes the logits (and the hidden streams for MTP) `own` asks for. The rest of `own`
    /// (decode, later chunks, MTP verification) runs on this rank in the same layers. `own`
    /// None: a rank whose step is over joining from [`DeepseekV4::end_step`] with the plans.
    fn forward_cp(
        &self,
        own: Option<(&Batch, &mut KvCache)>,
        plans: Option<Vec<Vec<u8>>>,
        want_hidden: bool,
    ) -> Result<Option<ForwardOutput>> {
        // A scratch block: a multiple of 4, as the compact layout spreads an entry over 4
        // slots.
        const SCRATCH_BLOCK: usize = 64;
        let cfg = &self.cfg;
        let (h, hc) = (cfg.hidden_size, cfg.hc_mult);
        let (rank, ranks) = (self.shard.rank, self.shard.ranks);
        let comm = self.comm.as_deref().ok_or_else(|| {
            ModelError::Options(
                "context parallelism needs the group's communicator (set_communicator)".into(),
            )
        })?;
        let (own_batch, mut own_cache) = match own {
            Some((b, c)) => {
                b.validate(c.block_size(), c.num_blocks(), cfg.vocab_size)?;
                self.check_cache(c, self.layers.len(), b)?;
                (Some(b), Some(c))
            }
            None => (None, None),
        };
        let serve = |key: u32, id: usize, xs: &[f32], ws: &[f32], n: usize| {
            self.serve_expert(key, id, xs, ws, n)
        };
        let experts = cfg.n_routed_experts;
        let prompts = cp::prompts_of_step(comm, self.shard, h, experts, own_batch, plans, &serve)?;
        if prompts.is_empty() {
            return match (own_batch, own_cache) {
                (Some(b), Some(c)) => self.forward_plain(b, c, want_hidden).map(Some),
                _ => Ok(None),
            };
        }
        // This rank's rows: its batch's other sequences, then its pieces of every prompt.
        // `all`: every prompt as one sequence from position 0 over the scratch cache, whose
        // rows the ranks gather; `segs`: this rank's pieces, a sequence each (the queries).
        let local = own_batch.map(cp::local_part).unwrap_or_default();
        let nl = local.num_tokens();
        let mut all = Batch::default();
        let mut segs = Batch::default();
        let mut queries: Vec<(usize, usize)> = Vec::new();
        let (mut seg_of, mut rows_at) = (Vec::new(), Vec::new());
        let mut blocks = 0u32;
        for (j, p) in prompts.iter().enumerate() {
            let n = p.tokens.len().div_ceil(SCRATCH_BLOCK) as u32;
            all.push_seq(
                &p.tokens,
                0,
                (blocks..blocks + n).collect(),
                LogitsWanted::None,
            );
            blocks += n;
            let pieces = cp_pieces(p.tokens.len(), rank, ranks);
            if pieces.is_empty() {
                continue;
            }
            seg_of.push(j);
            rows_at.push(nl + segs.num_tokens());
            for (a, e) in pieces {
                segs.push_seq(&p.tokens[a..e], a, Vec::new(), LogitsWanted::None);
                queries.extend((a..e).map(|pos| (j, pos)));
            }
        }
        let ns = segs.num_tokens();
        // Entries only, so the compact layout whatever the model's (a full-layout scratch
        // would take every position's whole state).
        let mut scratch = KvCache::new(
            CacheSpec {
                layers: 1,
                seq_state_width: 0,
                ..self.spec_for(V4CacheMode::Compact)
            },
            SCRATCH_BLOCK,
            (blocks as usize).max(1),
        );
        let mut tokens = local.tokens.clone();
        tokens.extend_from_slice(&segs.tokens);
        let rows = self.embed.lookup(Some(comm), self.tp, 0, &tokens)?;
        let mut x = self.streams(&rows);
        let ropes_l = BatchRopes::new(self, &local.positions);
        let ropes_s = BatchRopes::new(self, &segs.positions);
        let bs = own_cache.as_ref().map_or(SCRATCH_BLOCK, |c| c.block_size());
        let decode = ns == 0 && local.is_decode();
        // This rank's prompts as the sequences of its cache they are (the owner's writes).
        let owned: Vec<(usize, Batch)> = own_batch.map_or(Vec::new(), |b| {
            prompts
                .iter()
                .enumerate()
                .filter(|(_, p)| p.owner == rank)
                .map(|(j, p)| {
                    let mut one = Batch::default();
                    one.push_seq(
                        &p.tokens,
                        0,
                        b.block_tables[p.seq].clone(),
                        LogitsWanted::None,
                    );
                    one.set_state_slot(b.state_slot(p.seq) as u32);
                    (j, one)
                })
                .collect()
        });
        for (li, layer) in self.layers.iter().enumerate() {
            let at = &layer.attn;
            let widths = self.row_widths(at);
            let mut attend = |xn: &[f32]| -> Result<Vec<f32>> {
                let mut out = Vec::with_capacity((nl + ns) * h);
                if nl > 0 {
                    let cache = own_cache
                        .as_deref_mut()
                        .ok_or_else(|| cp::cp_err("rows of this rank without its cache".into()))?;
                    out.extend(self.attention(
                        at,
                        &xn[..nl * h],
                        &local,
                        &ropes_l,
                        self.layer_stores(cache, li),
                        bs,
                    ));
                }
                let xs = &xn[nl * h..];
                let xq = self.act_in(xs, h);
                let mine = self.attn_rows(at, xs, &xq, &segs, &ropes_s);
                let full = cp::gather_rows(
                    comm,
                    &prompts,
                    &mine.data,
                    RowsView::width(widths),
                    // Rows made for a bf16 cache are bf16 values: 2 bytes each.
                    self.kv_dtype != KvCacheDtype::F32,
                    "attention rows",
                )?;
                drop(mine);
                if ns > 0 {
                    let qs = self.attn_queries(at, xs, &xq, ns, &ropes_s);
                    let o = self.attn_core(
                        at,
                        &all,
                        RowsView {
                            data: &full.data,
                            w: widths,
                        },
                        Some((&qs, &queries, &ropes_s)),
                        self.layer_stores(&mut scratch, 0),
                        SCRATCH_BLOCK,
                        V4CacheMode::Compact,
                        false,
                    );
                    out.extend(self.attn_out(at, &o, ns));
                }
                // This rank's prompts: their rows and entries into its cache, for decoding.
                if let Some(c) = own_cache.as_deref_mut() {
                    for (j, one) in &owned {
                        self.attn_core(
                            at,
                            one,
                            RowsView {
                                data: full.prompt(*j),
                                w: widths,
                            },
                            None,
                            self.layer_stores(c, li),
                            bs,
                            self.cache_mode,
                            true,
                        );
                    }
                }
                Ok(out)
            };
            self.block_with(layer, &mut x, &tokens, decode, 0, &mut attend)?;
        }
        // Each prompt's streams to its rank.
        let back = cp::send_rows_home(comm, &prompts, &seg_of, &rows_at, &x, hc * h)?;
        let Some(b) = own_batch else {
            return Ok(None);
        };
        let own_x = cp::own_rows(&back, &prompts, rank, b, hc * h, &x)?;
        self.output(&own_x, &self.hc_head, &self.norm, b, want_hidden, 0)
            .map(Some)
    }

    /// One step of MTP block `index` (spec §2.11, [REF] `MTPBlock`): row i pairs
    /// `batch.tokens[i]` (the token at position `batch.positions[i] + 1`) with `prev_streams` row
    /// i (the main model's last-block streams at `batch.positions[i]`, `[hc·D]`, from
    /// [`DeepseekV4::forward`]'s `hidden`, or a previous MTP step's), runs the block at
    /// `batch.positions[i]` with cache layer `num_hidden_layers + index`, and returns logits
    /// through the MTP hc_head and norm and the main head; `hidden` = the block's output streams.
    pub fn mtp_forward(
        &self,
        index: usize,
        batch: &Batch,
        prev_streams: &[f32],
        cache: &mut KvCache,
        want_hidden: bool,
    ) -> Result<ForwardOutput> {
        let cfg = &self.cfg;
        let mtp = self.mtp.get(index).ok_or_else(|| {
            ModelError::Batch(format!(
                "MTP block {index} is not loaded ({} loaded; load with load_mtp and a checkpoint \
                 with num_nextn_predict_layers > {index})",
                self.mtp.len()
            ))
        })?;
        let cache_layer = self.layers.len() + index;
        batch.validate(cache.block_size(), cache.num_blocks(), cfg.vocab_size)?;
        self.check_cache(cache, cache_layer + 1, batch)?;
        let (h, hc) = (cfg.hidden_size, cfg.hc_mult);
        let t_count = batch.num_tokens();
        if prev_streams.len() != t_count * hc * h {
            return Err(ModelError::Batch(format!(
                "MTP needs {hc}×{h} stream values per token: got {} values for {t_count} tokens",
                prev_streams.len()
            )));
        }
        let eps = cfg.rms_norm_eps;
        let step = tp::batch_digest(self.tp, batch, 1 + index as u32);
        let rows = self
            .embed
            .lookup(self.comm.as_deref(), self.tp, step, &batch.tokens)?;
        let mut e = vec![0.0f32; t_count * h];
        k::rms_norm_rows(&rows, h, &mtp.enorm, eps, &mut e);
        let mut ep = vec![0.0f32; t_count * h];
        mtp.e_proj.matmul(&self.act_in(&e, h), t_count, &mut ep);
        let mut hn = vec![0.0f32; t_count * hc * h];
        k::rms_norm_rows(prev_streams, h, &mtp.hnorm, eps, &mut hn);
        let mut x = vec![0.0f32; t_count * hc * h];
        mtp.h_proj
            .matmul(&self.act_in(&hn, h), t_count * hc, &mut x);
        for t in 0..t_count {
            for s in 0..hc {
                for (o, &v) in x[(t * hc + s) * h..(t * hc + s + 1) * h]
                    .iter_mut()
                    .zip(&ep[t * h..(t + 1) * h])
                {
                    *o += v;
                }
            }
        }
        let ropes = BatchRopes::new(self, &batch.positions);
        self.block_forward(&mtp.block, &mut x, batch, &ropes, cache, cache_layer, step)?;
        self.output(&x, &mtp.hc_head, &mtp.norm, batch, want_hidden, step)
    }

    /// The input of an FP8/FP4 linear as [REF] feeds it: with the sims on, each `width`-long row
    /// goes through act_quant in blocks of 128.
    fn act_in<'a>(&self, x: &'a [f32], width: usize) -> Cow<'a, [f32]> {
        if !self.quant_sim {
            return Cow::Borrowed(x);
        }
        let mut v = x.to_vec();
        for row in v.chunks_exact_mut(width) {
            ops::fp8_round_trip(row, 128);
        }
        Cow::Owned(v)
    }

    /// hc_head collapse, final norm and head for the wanted tokens (spec §2.10).
    fn output(
        &self,
        x: &[f32],
        hc_head: &Hc,
        norm: &[f32],
        batch: &Batch,
        want_hidden: bool,
        step: u64,
    ) -> Result<ForwardOutput> {
        let _t = Timer::start(Phase::Head);
        let cfg = &self.cfg;
        let (h, hc) = (cfg.hidden_size, cfg.hc_mult);
        let n_out = batch.logits_indices.len();
        let mut picked = vec![0.0f32; n_out * h];
        let mut m = vec![0.0f32; hc];
        let mut y = vec![0.0f32; h];
        for (o, &i) in batch.logits_indices.iter().enumerate() {
            let xt = &x[i * hc * h..(i + 1) * hc * h];
            hc_head.fn_.matmul(xt, 1, &mut m);
            let r = ops::rms_factor(xt, cfg.rms_norm_eps);
            for v in &mut m {
                *v *= r;
            }
            let pre = ops::hc_head_weights(&m, hc_head.scale[0], &hc_head.base, cfg.hc_eps);
            ops::hc_collapse(&pre, xt, &mut y);
            k::rms_norm(&y, norm, cfg.rms_norm_eps, &mut picked[o * h..(o + 1) * h]);
        }
        let mut logits = vec![0.0f32; n_out * self.vocab_share.len()];
        if n_out > 0 {
            self.head.matmul(&picked, n_out, &mut logits);
        }
        if self.tp.ranks > 1 {
            // Each rank's share of the vocabulary: gathered into whole rows.
            let _t = Timer::start(Phase::Reduce);
            logits = tp::gather_columns(self.comm.as_deref(), self.tp, step, &logits, n_out)?;
        }
        Ok(ForwardOutput {
            logits,
            hidden: want_hidden.then(|| x.to_vec()),
        })
    }

    /// hc_pre for every token: (collapsed input [T, D], post [T, hc], comb [T, hc·hc]).
    fn hc_pre(&self, p: &Hc, x: &[f32], t_count: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let cfg = &self.cfg;
        let (h, hc) = (cfg.hidden_size, cfg.hc_mult);
        let mix = (2 + hc) * hc;
        let mut m = vec![0.0f32; t_count * mix];
        p.fn_.matmul(x, t_count, &mut m);
        let mut y = vec![0.0f32; t_count * h];
        let mut post = vec![0.0f32; t_count * hc];
        let mut comb = vec![0.0f32; t_count * hc * hc];
        for t in 0..t_count {
            let xt = &x[t * hc * h..(t + 1) * hc * h];
            let r = ops::rms_factor(xt, cfg.rms_norm_eps);
            let mt: Vec<f32> = m[t * mix..(t + 1) * mix].iter().map(|v| v * r).collect();
            let (pre, po, co) = ops::hc_split_sinkhorn(
                &mt,
                &p.scale,
                &p.base,
                hc,
                cfg.hc_sinkhorn_iters,
                cfg.hc_eps,
            );
            ops::hc_collapse(&pre, xt, &mut y[t * h..(t + 1) * h]);
            post[t * hc..(t + 1) * hc].copy_from_slice(&po);
            comb[t * hc * hc..(t + 1) * hc * hc].copy_from_slice(&co);
        }
        (y, post, comb)
    }

    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::too_many_arguments)]
    fn block_forward(
        &self,
        b: &Block,
        x: &mut [f32],
        batch: &Batch,
        ropes: &BatchRopes,
        cache: &mut KvCache,
        li: usize,
        step: u64,
    ) -> Result<()> {
        let bs = cache.block_size();
        self.block_with(b, x, &batch.tokens, batch.is_decode(), step, &mut |xn| {
            Ok(self.attention(&b.attn, xn, batch, ropes, self.layer_stores(cache, li), bs))
        })
    }

    /// Block `b` over streams `x` of `tokens`, `attend` giving the attention output of the
    /// normed attention inputs (every token's, in order).
    fn block_with(
        &self,
        b: &Block,
        x: &mut [f32],
        tokens: &[u32],
        decode: bool,
        step: u64,
        attend: &mut dyn FnMut(&[f32]) -> Result<Vec<f32>>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let (h, hc) = (cfg.hidden_size, cfg.hc_mult);
        let t_count = tokens.len();
        let mut xn = vec![0.0f32; t_count * h];
        let (u, post, comb) = self.hc_pre(&b.hc_attn, x, t_count);
        k::rms_norm_rows(&u, h, &b.attn_norm, cfg.rms_norm_eps, &mut xn);
        let mut a = {
            let _t = Timer::start(Phase::Attention);
            attend(&xn)?
        };
        // Tensor parallelism: each rank's heads gave a partial wo_b product.
        if self.tp.ranks > 1 {
            let _t = Timer::start(Phase::Reduce);
            tp::reduce(self.comm.as_deref(), self.tp, step, &mut a)?;
        }
        for t in 0..t_count {
            ops::hc_expand(
                &a[t * h..(t + 1) * h],
                &mut x[t * hc * h..(t + 1) * hc * h],
                &post[t * hc..(t + 1) * hc],
                &comb[t * hc * hc..(t + 1) * hc * hc],
            );
        }
        let (u, post, comb) = self.hc_pre(&b.hc_ffn, x, t_count);
        k::rms_norm_rows(&u, h, &b.ffn_norm, cfg.rms_norm_eps, &mut xn);
        let mut f = {
            let _t = Timer::start(Phase::Moe);
            self.moe(&b.ffn, &xn, tokens, decode)?
        };
        // Tensor parallelism: each rank's features (or whole experts) gave a partial sum.
        if self.tp.ranks > 1 {
            let _t = Timer::start(Phase::Reduce);
            tp::reduce(self.comm.as_deref(), self.tp, step, &mut f)?;
        }
        for t in 0..t_count {
            ops::hc_expand(
                &f[t * h..(t + 1) * h],
                &mut x[t * hc * h..(t + 1) * hc * h],
                &post[t * hc..(t + 1) * hc],
                &comb[t * hc * hc..(t + 1) * hc * hc],
            );
        }
        Ok(())
    }

    /// Every token's compressor inputs (spec §2.7): `A_t = wkv·x` and `Z_t = wgate·x + ape[p mod
    /// r]`, `[T, c·d]` each.
    fn compressor_inputs(&self, c: &Compressor, x: &[f32], batch: &Batch) -> (Vec<f32>, Vec<f32>) {
        let t_count = batch.num_tokens();
        let w = c.coff() * c.d;
        let mut a = vec![0.0f32; t_count * w];
        let mut z = vec![0.0f32; t_count * w];
        c.wkv.matmul(x, t_count, &mut a);
        c.wgate.matmul(x, t_count, &mut z);
        for (i, zr) in z.chunks_exact_mut(w).enumerate() {
            let p = batch.positions[i];
            let ape = &c.ape[(p % c.ratio) * w..(p % c.ratio + 1) * w];
            for (o, &e) in zr.iter_mut().zip(ape) {
                *o += e;
            }
        }
        (a, z)
    }

    /// Compressed entry j of a sequence from its compressor inputs (spec §2.7), `rows(p)` giving
    /// position p's `A_t`, `Z_t` (c·d each): gated pooling over block j (second halves with
    /// overlap) and, with overlap and j > 0, block j−1's first halves; RMSNorm; RoPE at
    /// position j·r; Hadamard for the indexer.
    fn compress_entry<'a>(
        &self,
        c: &Compressor,
        j: usize,
        rows: impl Fn(usize) -> (Cow<'a, [f32]>, Cow<'a, [f32]>),
        rotate: bool,
        out: &mut [f32],
    ) {
        let (r, d) = (c.ratio, c.d);
        // (inputs of a position, the offset of the half it gives)
        type Held<'b> = ((Cow<'b, [f32]>, Cow<'b, [f32]>), usize);
        let mut held: Vec<Held> = Vec::with_capacity(2 * r);
        if c.overlap() && j > 0 {
            for p in (j - 1) * r..j * r {
                held.push((rows(p), 0));
            }
        }
        let off = if c.overlap() { d } else { 0 };
        for p in j * r..(j + 1) * r {
            held.push((rows(p), off));
        }
        let cands: Vec<(&[f32], &[f32])> = held
            .iter()
            .map(|((a, z), o)| (&a[*o..*o + d], &z[*o..*o + d]))
            .collect();
        let mut pooled = vec![0.0f32; d];
        ops::pool_compressed(&cands, &mut pooled);
        k::rms_norm(&pooled, &c.norm, self.cfg.rms_norm_eps, out);
        let half = self.rope_compressed.half();
        let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
        self.rope_compressed.cos_sin(j * r, &mut cos, &mut sin);
        V4Rope::apply(&mut out[d - 2 * half..], &cos, &sin, false);
        if rotate {
            ops::hadamard_in_place(out);
            if self.quant_sim {
                ops::fp4_round_trip(out, 32);
            }
        } else if self.quant_sim {
            ops::fp8_round_trip(&mut out[..d - 2 * half], 64);
        }
    }

    /// One attention layer over a batch (spec §2.6-§2.8): the step's rows, its queries, the
    /// attention over window ∪ chosen compressed entries, the grouped output.
    fn attention(
        &self,
        at: &Attention,
        x: &[f32],
        batch: &Batch,
        ropes: &BatchRopes,
        cache: (TokStore, FloatsMut),
        bs: usize,
    ) -> Vec<f32> {
        let t_count = batch.num_tokens();
        let xq = self.act_in(x, self.cfg.hidden_size);
        let rows = self.attn_rows(at, x, &xq, batch, ropes);
        let qs = self.attn_queries(at, x, &xq, t_count, ropes);
        let queries: Vec<(usize, usize)> = (0..batch.num_seqs())
            .flat_map(|s| (batch.seq_starts[s]..batch.seq_starts[s + 1]).map(move |i| (s, i)))
            .map(|(s, i)| (s, batch.positions[i]))
            .collect();
        let o = self.attn_core(
            at,
            batch,
            rows.view(),
            Some((&qs, &queries, ropes)),
            cache,
            bs,
            self.cache_mode,
            true,
        );
        self.attn_out(at, &o, t_count)
    }

    /// The state a batch's tokens add to an attention layer: the window K = V row
    /// (kv_norm(wkv x), RoPE) and the compressors' inputs (§2.7).
    fn attn_rows(
        &self,
        at: &Attention,
        x: &[f32],
        xq: &[f32],
        batch: &Batch,
        ropes: &BatchRopes,
    ) -> StepRows {
        let cfg = &self.cfg;
        let t_count = batch.num_tokens();
        let (dh, rd) = (cfg.head_dim, cfg.qk_rope_head_dim);
        let nope = dh - rd;
        let mut kvraw = vec![0.0f32; t_count * dh];
        at.wkv.matmul(xq, t_count, &mut kvraw);
        let mut kv = vec![0.0f32; t_count * dh];
        k::rms_norm_rows(&kvraw, dh, &at.kv_norm, cfg.rms_norm_eps, &mut kv);
        for (i, row) in kv.chunks_exact_mut(dh).enumerate() {
            let (cos, sin) = ropes.get(at.ratio > 0, i);
            V4Rope::apply(&mut row[nope..], cos, sin, false);
            if self.quant_sim {
                ops::fp8_round_trip(&mut row[..nope], 64);
            }
        }
        let cin = at
            .compressor
            .as_ref()
            .map(|c| self.compressor_inputs(c, x, batch));
        let icin = at
            .indexer
            .as_ref()
            .map(|ix| self.compressor_inputs(&ix.compressor, x, batch));
        let w = self.row_widths(at);
        let mut data = Vec::with_capacity(t_count * RowsView::width(w));
        for t in 0..t_count {
            data.extend_from_slice(&kv[t * dh..(t + 1) * dh]);
            for (c, cw) in [(&cin, w[1]), (&icin, w[2])] {
                if let Some((a, z)) = c {
                    data.extend_from_slice(&a[t * cw..(t + 1) * cw]);
                    data.extend_from_slice(&z[t * cw..(t + 1) * cw]);
                }
            }
        }
        if self.kv_dtype != KvCacheDtype::F32 {
            // What the cache will keep (bf16 rings), before any query reads it.
            data.iter_mut().for_each(|x| *x = k::bf16_round(*x));
        }
        StepRows { data, w }
    }

    /// The widths of one token's [`StepRows`]: window row, compressor inputs (each of A and
    /// Z), the indexer compressor's.
    fn row_widths(&self, at: &Attention) -> [usize; 3] {
        let w = |c: Option<&Compressor>| c.map_or(0, |c| c.coff() * c.d);
        [
            self.cfg.head_dim,
            w(at.compressor.as_ref()),
            w(at.indexer.as_ref().map(|ix| &ix.compressor)),
        ]
    }

    /// Query path (§2.6): c = q_norm(wq_a x); q = wq_b c; weightless per-head RMS; RoPE; and
    /// the indexer's queries and head weights (§2.8).
    fn attn_queries(
        &self,
        at: &Attention,
        x: &[f32],
        xq: &[f32],
        t_count: usize,
        ropes: &BatchRopes,
    ) -> Queries {
        let cfg = &self.cfg;
        let (nh, dh, rd) = (at.sink.len(), cfg.head_dim, cfg.qk_rope_head_dim);
        let di = cfg.index_head_dim;
        let nope = dh - rd;
        let eps = cfg.rms_norm_eps;
        let ql = cfg.q_lora_rank;
        let compressed = at.ratio > 0;
        let mut tmp = vec![0.0f32; t_count * ql];
        at.wq_a.matmul(xq, t_count, &mut tmp);
        let mut qr = vec![0.0f32; t_count * ql];
        k::rms_norm_rows(&tmp, ql, &at.q_norm, eps, &mut qr);
        let qrq = self.act_in(&qr, ql);
        let mut q = vec![0.0f32; t_count * nh * dh];
        at.wq_b.matmul(&qrq, t_count, &mut q);
        for t in 0..t_count {
            let (cos, sin) = ropes.get(compressed, t);
            for qh in q[t * nh * dh..(t + 1) * nh * dh].chunks_exact_mut(dh) {
                let r = ops::rms_factor(qh, eps);
                k::scale_in_place(qh, r);
                V4Rope::apply(&mut qh[nope..], cos, sin, false);
            }
        }
        let (mut iq, mut iw) = (Vec::new(), Vec::new());
        if let (Some(ix), true) = (&at.indexer, at.compressor.is_some()) {
            let hi = cfg.index_n_heads;
            iq = vec![0.0f32; t_count * hi * di];
            ix.wq_b.matmul(&qrq, t_count, &mut iq);
            for t in 0..t_count {
                let (cos, sin) = ropes.get(true, t);
                for qh in iq[t * hi * di..(t + 1) * hi * di].chunks_exact_mut(di) {
                    V4Rope::apply(&mut qh[di - rd..], cos, sin, false);
                    ops::hadamard_in_place(qh);
                    if self.quant_sim {
                        ops::fp4_round_trip(qh, 32);
                    }
                }
            }
            iw = vec![0.0f32; t_count * hi];
            ix.weights_proj.matmul(x, t_count, &mut iw);
            let sc = 1.0 / ((di * hi) as f32).sqrt();
            k::scale_in_place(&mut iw, sc);
        }
        Queries { q, iq, iw }
    }

    /// The attention of one layer given the step's rows: `rows` holds the state of `batch`'s
    /// positions (its sequences, block tables and state slots name where the earlier ones
    /// are); the compressed entries whose blocks end at those positions are emitted into the
    /// cache; each query `(s, p)` (a sequence of `batch`, a position: `queries` rows of `qs`,
    /// with the RoPE tables of their batch) attends over the window and the visible entries;
    /// with `write`, the rows go into the cache afterwards (every slot in the full layout, the
    /// last positions each ring keeps in the compact one). `layout`: the cache's (the model's,
    /// or compact for a context-parallel scratch). Returns each query's heads' outputs.
    #[allow(clippy::too_many_arguments)]
    fn attn_core(
        &self,
        at: &Attention,
        batch: &Batch,
        rows: RowsView<'_>,
        queries: Option<QueriesAt<'_>>,
        (store, mut state): (TokStore, FloatsMut),
        bs: usize,
        layout: V4CacheMode,
        write: bool,
    ) -> Vec<f32> {
        // An fp8 cache's bytes (compact only: `check_block_size` refuses it in the full
        // layout, whose code below reads `tok`).
        let (mut tok, mut fp8) = match store {
            TokStore::Floats(f) => (f, None),
            TokStore::Fp8(b) => (FloatsMut::F32(&mut []), Some(b)),
        };
        let codec = fp8_codec(&self.cfg);
        let is_fp8 = fp8.is_some();
        let cfg = &self.cfg;
        // The heads held here (all, or a tensor-parallel share).
        let (nh, dh, rd) = (at.sink.len(), cfg.head_dim, cfg.qk_rope_head_dim);
        let di = cfg.index_head_dim;
        let nope = dh - rd;
        let full = layout == V4CacheMode::Full;
        let width = if full {
            self.cache_width
        } else if is_fp8 {
            self.compact_bytes
        } else {
            self.compact_width
        };
        let sw = self.state_width;
        let (lay, ring) = (at.layout, at.ring);
        let compressed = at.ratio > 0;

        // A position's state: the step's own rows for its positions, the cache for earlier
        // ones (its slot in the full layout, the sequence's rings in the compact one).
        let first_pos: Vec<usize> = (0..batch.num_seqs())
            .map(|s| {
                batch
                    .positions
                    .get(batch.seq_starts[s])
                    .copied()
                    .unwrap_or(0)
            })
            .collect();
        let step_row = |s: usize, pos: usize| -> Option<usize> {
            (pos >= first_pos[s]).then(|| batch.seq_starts[s] + pos - first_pos[s])
        };
        let state_base = |s: usize| batch.state_slot(s) * sw;
        // Where entry j of sequence s sits in the token storage (the indexer key follows it
        // in the compact layout).
        let entry_at = |s: usize, j: usize| -> (usize, usize) {
            let table = &batch.block_tables[s];
            let r = at.ratio;
            if full {
                let b = slot_of(table, j * r + r - 1, bs) * width;
                (b + lay.entry, b + lay.ikey)
            } else if is_fp8 {
                let b = slot_of(table, j * r, bs) * width;
                (b, b + codec.entry_bytes())
            } else {
                let b = slot_of(table, j * r, bs) * width;
                (b, b + dh)
            }
        };

        // Compressors: emit every entry whose block ends in this step.
        if let Some(c) = &at.compressor {
            let r = c.ratio;
            let mut emitted: Vec<(usize, usize, Vec<f32>, Vec<f32>)> = Vec::new();
            {
                let store = if full { &tok } else { &state };
                // Compressor inputs of position `pos` of sequence `s` (`indexer`: the indexer's).
                let az_rows = |s: usize, pos: usize, indexer: bool| {
                    let (c, (fa, fz), (ra, rz)) = if indexer {
                        let ix = at.indexer.as_ref().expect("an indexer");
                        (&ix.compressor, (lay.ia, lay.iz), (ring.ia, ring.iz))
                    } else {
                        (
                            at.compressor.as_ref().expect("a compressor"),
                            (lay.a, lay.z),
                            (ring.a, ring.z),
                        )
                    };
                    let w = c.coff() * c.d;
                    if let Some(i) = step_row(s, pos) {
                        let (a, z) = rows.az(i, indexer);
                        return (Cow::Borrowed(a), Cow::Borrowed(z));
                    }
                    let base = if full {
                        slot_of(&batch.block_tables[s], pos, bs) * width
                    } else {
                        state_base(s) + ring.win * dh + (pos % ring.az) * ring.az_width
                    };
                    let (a, z) = if full { (fa, fz) } else { (ra, rz) };
                    (store.read(base + a, w), store.read(base + z, w))
                };
                for s in 0..batch.num_seqs() {
                    for i in batch.seq_starts[s]..batch.seq_starts[s + 1] {
                        let p = batch.positions[i];
                        if !(p + 1).is_multiple_of(r) {
                            continue;
                        }
                        let j = (p + 1) / r - 1;
                        let mut entry = vec![0.0f32; dh];
                        self.compress_entry(c, j, |pos| az_rows(s, pos, false), false, &mut entry);
                        let mut ikey = Vec::new();
                        if let Some(ix) = &at.indexer {
                            ikey = vec![0.0f32; di];
                            self.compress_entry(
                                &ix.compressor,
                                j,
                                |pos| az_rows(s, pos, true),
                                true,
                                &mut ikey,
                            );
                        }
                        emitted.push((s, j, entry, ikey));
                    }
                }
            }
            for (s, j, entry, ikey) in emitted {
                let (e, ik) = entry_at(s, j);
                if let Some(bytes) = fp8.as_deref_mut() {
                    codec.encode_entry(&entry, &mut bytes[e..e + codec.entry_bytes()]);
                    if !ikey.is_empty() {
                        codec.encode_key(&ikey, &mut bytes[ik..ik + codec.key_bytes()]);
                    }
                } else {
                    tok.write(e, &entry);
                    tok.write(ik, &ikey);
                }
            }
        }

        // Attention per query token over window ∪ visible compressed entries.
        let o: Vec<f32> = match queries {
            None => Vec::new(),
            Some((qs, queries, ropes)) => {
                let Queries { q, iq, iw } = qs;
                let (tok_r, state_r) = (&tok, &state);
                let fp8_r = fp8.as_deref();
                // Entry j's values (`key`: its indexer key), decoded in an fp8 cache.
                let stored = |off: usize, key: bool| -> Cow<[f32]> {
                    match fp8_r {
                        Some(bytes) if key => {
                            let mut v = vec![0.0f32; di];
                            codec.decode_key(&bytes[off..off + codec.key_bytes()], &mut v);
                            Cow::Owned(v)
                        }
                        Some(bytes) => {
                            let mut v = vec![0.0f32; dh];
                            codec.decode_entry(&bytes[off..off + codec.entry_bytes()], &mut v);
                            Cow::Owned(v)
                        }
                        None => tok_r.read(off, if key { di } else { dh }),
                    }
                };
                let win_row = |s: usize, pos: usize| -> Cow<[f32]> {
                    if let Some(i) = step_row(s, pos) {
                        Cow::Borrowed(rows.kv(i))
                    } else if full {
                        tok_r.read(slot_of(&batch.block_tables[s], pos, bs) * width, dh)
                    } else {
                        state_r.read(state_base(s) + (pos % ring.win) * dh, dh)
                    }
                };
                let win = cfg.sliding_window;
                let scale = 1.0 / (dh as f32).sqrt();
                (0..queries.len())
                    .into_par_iter()
                    .flat_map_iter(|i| {
                        let (s, p) = queries[i];
                        let mut keys: Vec<Cow<[f32]>> = Vec::with_capacity((p + 1).min(win) + 64);
                        for pos in (p + 1).saturating_sub(win)..=p {
                            keys.push(win_row(s, pos));
                        }
                        if compressed {
                            let r = at.ratio;
                            let nc = (p + 1) / r;
                            let chosen: Vec<usize> = if at.indexer.is_some() {
                                let hi = cfg.index_n_heads;
                                let scores: Vec<f32> = (0..nc)
                                    .map(|j| {
                                        let (_, ik) = entry_at(s, j);
                                        let key = stored(ik, true);
                                        (0..hi)
                                            .map(|hh| {
                                                let qh =
                                                    &iq[(i * hi + hh) * di..(i * hi + hh + 1) * di];
                                                iw[i * hi + hh] * k::dot(qh, &key).max(0.0)
                                            })
                                            .sum()
                                    })
                                    .collect();
                                let mut ids = crate::deepseek_v3::top_indices(
                                    &scores,
                                    cfg.index_topk.min(nc),
                                );
                                ids.sort_unstable();
                                ids
                            } else {
                                (0..nc).collect()
                            };
                            for j in chosen {
                                let (e, _) = entry_at(s, j);
                                keys.push(stored(e, false));
                            }
                        }
                        let (cos, sin) = ropes.get(compressed, i);
                        let mut out = vec![0.0f32; nh * dh];
                        let keys: Vec<&[f32]> = keys.iter().map(|k| &k[..]).collect();
                        let mut scratch = Vec::with_capacity(keys.len());
                        for (hh, oh) in out.chunks_exact_mut(dh).enumerate() {
                            let qh = &q[(i * nh + hh) * dh..(i * nh + hh + 1) * dh];
                            ops::attend_with_sink(qh, &keys, at.sink[hh], scale, &mut scratch, oh);
                            V4Rope::apply(&mut oh[nope..], cos, sin, true);
                        }
                        out
                    })
                    .collect()
            }
        };
        if !write {
            return o;
        }

        // The step's positions into the cache, now that every query of the step has read
        // what it needs: every slot in the full layout; in the compact one the last positions
        // each ring keeps.
        // Token i's compressor inputs (main, then the indexer's) at `base` + the offsets given.
        let put_az = |dst: &mut FloatsMut, base: usize, i: usize, offs: [usize; 4]| {
            let has = [at.compressor.is_some(), at.indexer.is_some()];
            for (k, &here) in has.iter().enumerate() {
                if here {
                    let (a, z) = rows.az(i, k == 1);
                    dst.write(base + offs[2 * k], a);
                    dst.write(base + offs[2 * k + 1], z);
                }
            }
        };
        for s in 0..batch.num_seqs() {
            let (lo, hi) = (batch.seq_starts[s], batch.seq_starts[s + 1]);
            for i in lo..hi {
                let p = batch.positions[i];
                let row = rows.kv(i);
                if full {
                    let b = slot_of(&batch.block_tables[s], p, bs) * width;
                    tok.write(b, row);
                    put_az(&mut tok, b, i, [lay.a, lay.z, lay.ia, lay.iz]);
                    continue;
                }
                let base = state_base(s);
                if hi - i <= ring.win {
                    state.write(base + (p % ring.win) * dh, row);
                }
                if hi - i <= ring.az {
                    let b = base + ring.win * dh + (p % ring.az) * ring.az_width;
                    put_az(&mut state, b, i, [ring.a, ring.z, ring.ia, ring.iz]);
                }
            }
        }
        o
    }

    /// Grouped output (§2.6): z_g = wo_a[g] · o_g, then wo_b (this rank's groups).
    fn attn_out(&self, at: &Attention, o: &[f32], t_count: usize) -> Vec<f32> {
        let cfg = &self.cfg;
        let (nh, dh) = (at.sink.len(), cfg.head_dim);
        let ol = cfg.o_lora_rank;
        let g = at.wo_a.rows() / ol;
        let gw = nh * dh / g;
        let mut z = vec![0.0f32; t_count * g * ol];
        let mut og = vec![0.0f32; t_count * gw];
        let mut zg = vec![0.0f32; t_count * ol];
        for gi in 0..g {
            for t in 0..t_count {
                og[t * gw..(t + 1) * gw]
                    .copy_from_slice(&o[t * nh * dh + gi * gw..t * nh * dh + (gi + 1) * gw]);
            }
            at.wo_a
                .matmul_rows(gi * ol..(gi + 1) * ol, &og, t_count, &mut zg);
            for t in 0..t_count {
                z[t * g * ol + gi * ol..t * g * ol + (gi + 1) * ol]
                    .copy_from_slice(&zg[t * ol..(t + 1) * ol]);
            }
        }
        let mut out = vec![0.0f32; t_count * cfg.hidden_size];
        at.wo_b.matmul(&self.act_in(&z, g * ol), t_count, &mut out);
        out
    }

    fn expert_forward(&self, e: &Expert, x: &[f32], n: usize, weights: Option<&[f32]>) -> Vec<f32> {
        let f = e.w1.rows();
        let mut g = vec![0.0f32; n * f];
        let mut u = vec![0.0f32; n * f];
        let xq = self.act_in(x, e.w1.cols());
        e.w1.matmul(&xq, n, &mut g);
        e.w3.matmul(&xq, n, &mut u);
        let mut hid = vec![0.0f32; n * f];
        ops::swiglu_clamped(&mut g, &mut u, self.cfg.swiglu_limit, &mut hid);
        if let Some(w) = weights {
            for (row, &wt) in hid.chunks_exact_mut(f).zip(w) {
                k::scale_in_place(row, wt);
            }
        }
        let mut y = vec![0.0f32; n * e.w2.rows()];
        e.w2.matmul(&self.act_in(&hid, f), n, &mut y);
        y
    }

    fn moe(&self, m: &Moe, x: &[f32], tokens: &[u32], decode: bool) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let t_count = tokens.len();
        let e = m.experts.len();
        let kk = cfg.num_experts_per_tok;
        let mut logits = vec![0.0f32; t_count * e];
        m.gate.matmul(x, t_count, &mut logits);
        let mut ids = Vec::with_capacity(t_count * kk);
        let mut ws = Vec::with_capacity(t_count * kk);
        for (t, &tok) in tokens.iter().enumerate() {
            let hash = m
                .tid2eid
                .as_ref()
                .map(|tab| &tab[tok as usize * kk..(tok as usize + 1) * kk]);
            let (i, w) = ops::route_v4(
                &logits[t * e..(t + 1) * e],
                m.bias.as_deref(),
                hash,
                kk,
                cfg.scoring_func,
                cfg.routed_scaling_factor,
            );
            ids.extend(i);
            ws.extend(w);
        }
        let assigned =
            crate::eplb::by_expert(&mut ids, &ws, kk, e, self.force_eplb.as_ref(), decode);
        self.expert_load.record(m.key, &assigned);
        // Each active expert's output added to its tokens in id order: at once in one process;
        // under expert parallelism the outputs held here are gathered with the other ranks'
        // first (the same order, so the same sums).
        let add = |out: &mut [f32], pairs: &[(usize, f32)], y: &[f32]| {
            for (j, &(t, _)) in pairs.iter().enumerate() {
                for (o, v) in out[t * h..(t + 1) * h]
                    .iter_mut()
                    .zip(&y[j * h..(j + 1) * h])
                {
                    *o += v;
                }
            }
        };
        // Under tensor parallelism the experts held here give a partial sum that the block adds
        // over the ranks; otherwise the other ranks' experts are gathered or dispatched to.
        let sharded = self.shard.ranks > 1 && self.tp.ranks == 1;
        // Dispatched to the experts' ranks (this rank's own included): nothing computed here.
        let dispatch = sharded && self.shard.dispatch;
        let active: Vec<usize> = (0..e).filter(|&id| !assigned[id].is_empty()).collect();
        let mut out = vec![0.0f32; t_count * h];
        let mut mine = Vec::new();
        for &id in active
            .iter()
            .filter(|&&id| !dispatch && self.shard.owns(m.key, id, e))
        {
            let pairs = &assigned[id];
            let mut xs = Vec::with_capacity(pairs.len() * h);
            for &(t, _) in pairs {
                xs.extend_from_slice(&x[t * h..(t + 1) * h]);
            }
            let ws: Vec<f32> = pairs.iter().map(|p| p.1).collect();
            let expert = m.experts[id]
                .as_ref()
                .expect("an expert this rank owns is loaded");
            let y = self.expert_forward(expert, &xs, pairs.len(), Some(&ws));
            if sharded {
                mine.push(y);
            } else {
                add(&mut out, pairs, &y);
            }
        }
        if dispatch {
            let turn = crate::expert_parallel::Turn::Layer {
                key: m.key,
                x,
                active: &active,
                assigned: &assigned,
            };
            let serve = |key: u32, id: usize, xs: &[f32], ws: &[f32], n: usize| {
                self.serve_expert(key, id, xs, ws, n)
            };
            let comm = self.comm.as_deref();
            let ys = crate::expert_parallel::dispatch_layer(comm, self.shard, h, e, turn, &serve)?;
            for (&id, y) in active.iter().zip(&ys) {
                add(&mut out, &assigned[id], y);
            }
        } else if sharded {
            let ys = crate::expert_parallel::gather(
                self.comm.as_deref(),
                self.shard,
                m.key,
                h,
                &active,
                &assigned,
                e,
                mine,
            )?;
            for (&id, y) in active.iter().zip(&ys) {
                add(&mut out, &assigned[id], y);
            }
        }
        let y = self.expert_forward(&m.shared, x, t_count, None);
        for (a, b) in out.iter_mut().zip(&y) {
            *a += b;
        }
        Ok(out)
    }

    /// Routed expert `id` of MoE layer `key` over `n` rows a rank dispatched here, weighted by
    /// `ws` inside (the SwiGLU output, as in one process).
    fn serve_expert(
        &self,
        key: u32,
        id: usize,
        xs: &[f32],
        ws: &[f32],
        n: usize,
    ) -> Result<Vec<f32>> {
        let experts = self
            .layers
            .iter()
            .chain(self.mtp.iter().map(|m| &m.block))
            .map(|b| &b.ffn)
            .find(|m| m.key == key)
            .map(|m| m.experts.as_slice());
        let expert = crate::expert_parallel::served_expert(experts, key, id)?;
        self.expert_load.record_served(key, n);
        Ok(self.expert_forward(expert, xs, n, Some(ws)))
    }

    /// The end of this rank's step under dispatched expert parallelism; as
    /// [`crate::DeepseekV3::end_step`].
    pub fn end_step(&self, more: bool) -> Result<bool> {
        if !(self.shard.dispatch && self.shard.ranks > 1) {
            return Ok(more);
        }
        let serve = |key: u32, id: usize, xs: &[f32], ws: &[f32], n: usize| {
            self.serve_expert(key, id, xs, ws, n)
        };
        crate::expert_parallel::end_step(
            self.comm.as_deref(),
            self.shard,
            self.cfg.hidden_size,
            self.cfg.n_routed_experts,
            more,
            &serve,
            &|plans| {
                if !self.shard.context {
                    return Err(ModelError::Options(
                        "expert dispatch: a rank began a context-parallel forward and this one \
                         does not run context parallelism (the ranks were started with \
                         different layouts)"
                            .into(),
                    ));
                }
                self.forward_cp(None, Some(plans), false).map(|_| ())
            },
        )
    }

    /// The group the routed experts are split over (expert parallelism): every rank of `comm`
    /// must hold its shard (`V4LoadOptions::expert_shard`) and run the same batches.
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
