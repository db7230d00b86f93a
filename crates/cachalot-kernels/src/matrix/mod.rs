//! Weight matrices in their stored formats and their products with f32 activations.
//!
//! Formats (spec `deepseek-v3-r1-kimi-k2.md`):
//! - f32, bf16, f16: dense (bf16 is the checkpoints' dtype for norms, embeddings, `lm_head`,
//!   and for everything after the bf16 conversion of §5.1).
//! - FP8 e4m3fn with one f32 `scale_inv` per 128×128 block (§2.2): W[r,c] = f32(fp8[r,c]) ·
//!   scale_inv[r div br][c div bc]; the grid is ceil(rows/br)×ceil(cols/bc) and edge blocks are
//!   partial (kv_a_proj's last row block covers rows 512..575).
//! - int8 with one f32 scale per output row (§5.2 the converter's layout: `weight` int8
//!   [out, in], `weight_scale` f32 [out, 1]), in two modes: `Int8Row` multiplies f32
//!   activations (W8A16), `W8A8` quantizes the activations per token to int8 on entry and
//!   multiplies int8 × int8 → i32 (§4, the seed's W8A8 Linear; see `w8a8.rs`). The transposed
//!   product and dequantization treat both alike (f32 activations).
//! - int4 with one scale per group of columns (§2.3, Kimi-K2-Thinking's routed experts, run
//!   W4A16 as the seed does: the activation stays in floating point).
//!
//! DeepSeek-V4 formats (spec `deepseek-v4.md` §4.1, §4.4–§4.6):
//! - MXFP4: e2m1 nibbles packed along the input dim (low nibble = even column) with one E8M0
//!   scale byte per 32 columns — the native routed experts and `w4a8-mx`'s output. Built straight
//!   from the checkpoint's bytes (`weight` I8/U8 `[out, in/2]`, `scale` F8_E8M0/U8 `[out, in/32]`).
//! - MXFP8: e4m3fn with one E8M0 scale byte per 32 columns (`w4a8-mx`).
//! - HiF8 with one f32 scale per row (`w4a8-mx-hif`).
//! - INT4 per channel packed along the output dim (`w4a8-int` experts): repacked at load into
//!   `W4A8` ([`MatrixData::w4a8_per_channel_packed_n`]; int8 token activations and int4 × int8
//!   → i32 products, as the seed runs them, `w4a8.rs`) — or `Int4Group` with one group per
//!   row for f32 activations (W4A16). INT8 per channel (`w8a8-int`/`w4a8-int`) is `W8A8`.
//!
//! Products keep the weights in their stored format and convert on the fly, so a decode step
//! streams each weight byte once per group of up to 4 tokens (6 with AVX-512). Accumulation is f32. For one
//! output row the columns are cut into segments (the FP8 column blocks, the int4 groups; the
//! whole row otherwise); a segment's dot product is summed in registers, multiplied by its scale and added
//! to the row total.
//!
//! Determinism: every output element is computed by the same sequence of operations whatever
//! the number of tokens in the call, the row or column sub-range, and the thread count (token
//! groups and row tiles share no accumulators; task boundaries fall on the same column chunk
//! grid). Only the SIMD level changes results, and AVX2 and AVX-512 give the same bits
//! (`avx512.rs`); scalar differs in rounding.

#[cfg(target_arch = "x86_64")]
mod amx;
pub(crate) mod bf16dot;
pub(crate) mod scalar;
mod slice;
mod w4a8;
mod w8a8;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "aarch64")]
mod neon_float;

#[cfg(test)]
mod tests;

/// How far ahead the forward products' software prefetch (`avx2::prefetch_tile_ahead`, NEON's
/// `prfm`) reaches from a tile of `tile_bytes` (its rows' bytes):
/// whole tiles, at least 16 KiB. One tile ahead is too close for narrow rows (8 rows of 512
/// bytes: a down projection of 256 columns): the line arrives late. At 2 threads, 256-wide BF16
/// rows streamed at 27 GB/s one tile ahead, 36 GB/s 16-32 KiB ahead; 2048-wide rows (one tile
/// = 32 KiB) the same either way.
#[inline(always)]
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
pub(crate) fn tile_prefetch_distance(tile_bytes: usize) -> usize {
    const MIN_AHEAD: usize = 16 * 1024;
    let t = tile_bytes.max(1);
    t * MIN_AHEAD.div_ceil(t)
}

/// Whether this aarch64 CPU has the dot-product extension (`sdot`), which the NEON W8A8 and
/// W4A8 products need (without it they run scalar, with the same bits).
#[cfg(target_arch = "aarch64")]
pub(crate) fn neon_dotprod_supported() -> bool {
    // std caches the detection.
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// Whether W8A8/W4A8 products of many tokens take AMX tiles in this process.
#[cfg(target_arch = "x86_64")]
pub(crate) fn amx_supported() -> bool {
    amx::supported()
}

/// Whether the AVX2 level's integer products use AVX-VNNI in this process.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx_vnni_supported() -> bool {
    w8a8::avx_vnni::supported()
}

use std::ops::Range;

use crate::bytes::{f32s_to_le_bytes, Bytes};
use crate::mx::{e8m0_to_f32, MX_BLOCK};
use crate::parallel::{for_each_task, DisjointOut, Split};
use crate::simd::{simd_level, SimdLevel};
use crate::KernelError;

/// A weight matrix's stored values. More formats will come (MXFP4, ...), so matches on it need a
/// wildcard arm.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum MatrixData {
    /// Little-endian f32.
    F32(Bytes),
    /// Little-endian bf16.
    Bf16(Bytes),
    /// Little-endian bf16, multiplied as BF16 × BF16: `matmul`/`matmul_rows` round each
    /// activation to bf16 and sum as x86's `vdpbf16ps` defines (`bf16dot.rs`), llama.cpp's way
    /// with BF16 weights; `matmul_t_rows` and dequantization are those of `Bf16`. Made by
    /// [`Matrix::to_bf16_dot`].
    Bf16Dot(Bytes),
    /// Little-endian IEEE f16.
    F16(Bytes),
    /// FP8 e4m3fn with one f32 scale_inv per (block_rows x block_cols) block; grid
    /// ceil(rows/br) x ceil(cols/bc), row-major; edge blocks are partial.
    Fp8Block {
        data: Bytes,
        scale_inv: Vec<f32>,
        block_rows: usize,
        block_cols: usize,
    },
    /// int8 with one f32 scale per output row (the W8A8 converter's layout: weight int8
    /// `[out,in]`, weight_scale f32 `[out,1]`).
    Int8Row { data: Bytes, scale: Vec<f32> },
    /// The same int8 layout, multiplied as W8A8: `matmul`/`matmul_rows` quantize each token's
    /// activations to int8 (dynamic, symmetric, sx = max|x|/127, ties to even) and accumulate
    /// int8 × int8 products in i32, scaled by sw[r]·sx[t]. `matmul_t_rows` and dequantization
    /// are those of `Int8Row`.
    W8A8 { data: Bytes, scale: Vec<f32> },
    /// Signed 4-bit integers with one f32 scale per `group_size` consecutive columns of a row
    /// (Kimi-K2-Thinking's compressed-tensors `pack-quantized`, §2.3): column c of a row is the
    /// low (c even) or high (c odd) nibble of the row's byte c/2 — the little-endian bytes of
    /// the checkpoint's int32 `weight_packed` words, low nibble first — and a stored nibble n
    /// means q = n − 8. `W[r,c] = q · scale[r·ceil(cols/group_size) + c/group_size]`. The
    /// checkpoint's bf16 `weight_scale` `[out, in/group]` converts to f32 exactly. `cols` and
    /// `group_size` must be even.
    Int4Group {
        data: Bytes,
        scale: Vec<f32>,
        group_size: usize,
    },
    /// Int4 weights with one f32 scale per output row, multiplied as W4A8 (V4 `w4a8-int`
    /// routed experts, §4.2/§4.4): the nibble layout of `Int4Group` with one group per row
    /// (column c in the low (c even) or high nibble of byte c/2, nibble n meaning n − 8);
    /// `matmul`/`matmul_rows` quantize each token's activations to int8 as `W8A8` does and
    /// accumulate int4 × int8 in i32 (`w4a8.rs`). `matmul_t_rows` and dequantization use f32
    /// activations. `cols` must be even.
    W4A8 { data: Bytes, scale: Vec<f32> },
    /// MXFP4 (V4 §4.1/§4.5): e2m1 codes, two per byte along a row (column 2j in the low nibble
    /// of byte j), and one E8M0 scale byte per 32 columns (`rows x ceil(cols/32)`, row-major):
    /// `W[r,c] = e2m1(nibble) · 2^(scale[r, c/32] − 127)`. `cols` must be even. Both buffers
    /// are the checkpoint's bytes as stored (windows into the mmap'd shard; no copy).
    Mxfp4 { data: Bytes, scale: Bytes },
    /// MXFP8 (V4 §4.5): e4m3fn codes `[rows, cols]` and one E8M0 scale byte per 32 columns.
    Mxfp8 { data: Bytes, scale: Bytes },
    /// HiF8 (V4 §4.6) codes `[rows, cols]` with one f32 scale per row: `W = hif8(q) · scale[r]`.
    Hif8 { data: Bytes, scale: Vec<f32> },
}

impl MatrixData {
    /// V4 §4.4's INT4 per-channel layout — `packed` int8 `[rows/2, cols]` packed along the
    /// output dim (byte `[j, c]` = q[2j, c] low nibble, q[2j+1, c] high nibble, two's
    /// complement), one scale per row — repacked into [`MatrixData::Int4Group`] with one group
    /// per row, the layout the int4 kernels stream (two columns of one row per byte). The
    /// checkpoint's `u64 [rows, 1]` scales are [`crate::int4::scale_to_u64`] patterns: pass
    /// their low 32 bits as f32 (see [`MatrixData::scales_from_u64_bytes`]).
    pub fn int4_per_channel_packed_n(
        rows: usize,
        cols: usize,
        packed: &[u8],
        scale: Vec<f32>,
    ) -> Result<MatrixData, KernelError> {
        if !rows.is_multiple_of(2) || !cols.is_multiple_of(2) || rows == 0 || cols == 0 {
            return Err(KernelError::Int4Layout {
                rows,
                cols,
                group_size: cols,
            });
        }
        let expected = rows / 2 * cols;
        if packed.len() != expected {
            return Err(KernelError::ByteLength {
                format: "int4_channel_packed_n",
                rows,
                cols,
                expected,
                actual: packed.len(),
            });
        }
        let mut out = vec![0u8; rows * cols / 2];
        for (r, orow) in out.chunks_exact_mut(cols / 2).enumerate() {
            let src = &packed[(r / 2) * cols..(r / 2 + 1) * cols];
            let shift = 4 * (r % 2) as u32;
            // Two's-complement nibble q → stored nibble q + 8 (Int4Group's offset binary).
            let nib = |b: u8| ((b >> shift) & 0x0F) ^ 0x08;
            for (o, pair) in orow.iter_mut().zip(src.chunks_exact(2)) {
                *o = nib(pair[0]) | (nib(pair[1]) << 4);
            }
        }
        Ok(MatrixData::Int4Group {
            data: Bytes::from_vec(out),
            scale,
            group_size: cols,
        })
    }

    /// V4 §4.4's INT4 per-channel layout (as [`MatrixData::int4_per_channel_packed_n`] reads
    /// it) as [`MatrixData::W4A8`]: the seed's W4A8 execution, int8 token activations.
    pub fn w4a8_per_channel_packed_n(
        rows: usize,
        cols: usize,
        packed: &[u8],
        scale: Vec<f32>,
    ) -> Result<MatrixData, KernelError> {
        match MatrixData::int4_per_channel_packed_n(rows, cols, packed, scale)? {
            MatrixData::Int4Group { data, scale, .. } => Ok(MatrixData::W4A8 { data, scale }),
            _ => unreachable!("int4_per_channel_packed_n returns Int4Group"),
        }
    }

    /// The f32 scales of a `u64 [N, 1]` scale tensor's little-endian bytes (low 32 bits of each
    /// word = the f32 bits). Errors if the length is not a multiple of 8 or a high word is set.
    pub fn scales_from_u64_bytes(bytes: &[u8]) -> Result<Vec<f32>, KernelError> {
        if !bytes.len().is_multiple_of(8) {
            return Err(KernelError::U64Scales {
                why: format!("{} bytes is not a whole number of u64 words", bytes.len()),
            });
        }
        bytes
            .chunks_exact(8)
            .enumerate()
            .map(|(i, w)| {
                let v = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
                if v >> 32 != 0 {
                    return Err(KernelError::U64Scales {
                        why: format!("word #{i} is {v:#x}; the high 32 bits must be zero"),
                    });
                }
                Ok(f32::from_bits(v as u32))
            })
            .collect()
    }
}

/// How a format's elements are stored, for the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    F32,
    Bf16,
    F16,
    Fp8,
    Int8,
    Int4,
    /// e2m1 nibbles, two per byte along a row.
    Fp4,
    /// e4m3fn decoded as `Fp8`, with E8M0 scales.
    Mxfp8,
    Hif8,
}

impl Format {
    /// Bytes of a rows x cols matrix (cols even for int4), or None on overflow.
    pub fn data_bytes(self, rows: usize, cols: usize) -> Option<usize> {
        let n = rows.checked_mul(cols)?;
        match self {
            Format::F32 => n.checked_mul(4),
            Format::Bf16 | Format::F16 => n.checked_mul(2),
            Format::Fp8 | Format::Mxfp8 | Format::Int8 | Format::Hif8 => Some(n),
            Format::Int4 | Format::Fp4 => Some(n / 2),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::Bf16 => "bf16",
            Format::F16 => "f16",
            Format::Fp8 => "fp8_e4m3_block",
            Format::Int8 => "int8_row",
            Format::Int4 => "int4_group",
            Format::Fp4 => "mxfp4",
            Format::Mxfp8 => "mxfp8",
            Format::Hif8 => "hif8_row",
        }
    }
}

/// Where a weight's scale comes from, per (row, column segment).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Scales<'a> {
    /// Dense formats: no scale.
    One,
    /// One scale per row (int8).
    Row(&'a [f32]),
    /// One scale per block; `grid_cols` blocks per block row.
    Block {
        scale: &'a [f32],
        block_rows: usize,
        grid_cols: usize,
    },
    /// One E8M0 byte per (row, column segment); `grid_cols` per row (MX formats).
    E8m0 { scale: &'a [u8], grid_cols: usize },
}

/// One row's scales, indexed by column segment.
#[derive(Clone, Copy, Debug)]
pub(crate) enum RowScales<'a> {
    F32(&'a [f32]),
    E8m0(&'a [u8]),
}

impl RowScales<'_> {
    /// The scale of column segment `s`.
    #[inline]
    pub fn get(&self, s: usize) -> f32 {
        match *self {
            RowScales::F32(v) => v[s],
            RowScales::E8m0(b) => e8m0_to_f32(b[s]),
        }
    }
}

impl<'a> Scales<'a> {
    /// Row `r`'s scales, indexed by column segment (dense formats and int8 have one segment).
    #[inline]
    pub fn row(&self, r: usize) -> RowScales<'a> {
        match *self {
            Scales::One => RowScales::F32(&[1.0]),
            Scales::Row(s) => RowScales::F32(std::slice::from_ref(&s[r])),
            Scales::Block {
                scale,
                block_rows,
                grid_cols,
            } => {
                let start = (r / block_rows) * grid_cols;
                RowScales::F32(&scale[start..start + grid_cols])
            }
            Scales::E8m0 { scale, grid_cols } => {
                RowScales::E8m0(&scale[r * grid_cols..(r + 1) * grid_cols])
            }
        }
    }
}

/// A borrowed, validated description of a matrix for the kernels.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WeightsView<'a> {
    pub format: Format,
    pub data: &'a [u8],
    pub cols: usize,
    /// Width of a column segment: columns `s*segment_cols..` share the scale of segment `s`.
    pub segment_cols: usize,
    pub scales: Scales<'a>,
}

impl WeightsView<'_> {
    /// Column chunks of 16 start at each segment's first column; in the transposed product a
    /// task or column block boundary must fall on that grid, so that a column is computed the
    /// same way whatever the split. Boundaries at multiples of this are on the grid.
    pub fn column_align(&self) -> usize {
        if self.segment_cols.is_multiple_of(CHUNK) || self.segment_cols >= self.cols {
            CHUNK
        } else {
            self.segment_cols
        }
    }
}

/// A weight matrix W [rows = out, cols = in] (PyTorch Linear convention, y = W x), in its stored
/// format.
#[derive(Clone, Debug)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: MatrixData,
    /// Whether the weights hold e4m3fn NaN codes (0x7F/0xFF), which the vector decoders read
    /// as ±480: found on the first product (a scan of the matrix's bytes, once), so a damaged
    /// checkpoint's products come out NaN as the f32 path's do, without reading every weight
    /// at load.
    nan_codes: std::sync::OnceLock<bool>,
}

impl Matrix {
    /// Validates byte lengths, scale grid sizes, positive dimensions and block sizes, and finite
    /// scales.
    pub fn new(rows: usize, cols: usize, data: MatrixData) -> Result<Matrix, KernelError> {
        let format = format_of(&data);
        let name = name_of(&data);
        if rows == 0 || cols == 0 {
            return Err(KernelError::ZeroDimension {
                format: name,
                rows,
                cols,
            });
        }
        if let MatrixData::Int4Group { group_size, .. } = &data {
            if !cols.is_multiple_of(2) || *group_size == 0 || !group_size.is_multiple_of(2) {
                return Err(KernelError::Int4Layout {
                    rows,
                    cols,
                    group_size: *group_size,
                });
            }
        }
        if matches!(data, MatrixData::Mxfp4 { .. } | MatrixData::W4A8 { .. })
            && !cols.is_multiple_of(2)
        {
            return Err(KernelError::OddPackedCols {
                format: name,
                rows,
                cols,
            });
        }
        let expected = format
            .data_bytes(rows, cols)
            .ok_or(KernelError::ShapeOverflow {
                format: name,
                rows,
                cols,
            })?;
        let bytes = data_bytes_of(&data);
        if bytes.len() != expected {
            return Err(KernelError::ByteLength {
                format: name,
                rows,
                cols,
                expected,
                actual: bytes.len(),
            });
        }
        let (scales, grid) = match &data {
            MatrixData::Fp8Block {
                scale_inv,
                block_rows,
                block_cols,
                ..
            } => {
                if *block_rows == 0 || *block_cols == 0 {
                    return Err(KernelError::ZeroBlockSize {
                        format: name,
                        block_rows: *block_rows,
                        block_cols: *block_cols,
                    });
                }
                let (gr, gc) = (rows.div_ceil(*block_rows), cols.div_ceil(*block_cols));
                let grid = format!("a {gr}x{gc} grid of {block_rows}x{block_cols} blocks");
                (Some((scale_inv, gr * gc)), grid)
            }
            MatrixData::Int8Row { scale, .. }
            | MatrixData::W8A8 { scale, .. }
            | MatrixData::W4A8 { scale, .. }
            | MatrixData::Hif8 { scale, .. } => (Some((scale, rows)), "one per row".to_string()),
            MatrixData::Mxfp4 { scale, .. } | MatrixData::Mxfp8 { scale, .. } => {
                check_e8m0_scales(name, rows, cols, scale.as_slice(), format == Format::Mxfp8)?;
                (None, String::new())
            }
            MatrixData::Int4Group {
                scale, group_size, ..
            } => {
                let groups = cols.div_ceil(*group_size);
                let grid = format!("{groups} groups of {group_size} columns per row");
                (Some((scale, rows * groups)), grid)
            }
            _ => (None, String::new()),
        };
        if let Some((scales, expected)) = scales {
            if scales.len() != expected {
                return Err(KernelError::ScaleCount {
                    format: name,
                    rows,
                    cols,
                    grid,
                    expected,
                    actual: scales.len(),
                });
            }
            if let Some((index, &value)) = scales.iter().enumerate().find(|(_, s)| !s.is_finite()) {
                return Err(KernelError::NonFiniteScale {
                    format: name,
                    index,
                    value,
                });
            }
        }
        Ok(Matrix {
            rows,
            cols,
            data,
            nan_codes: Default::default(),
        })
    }

    /// Whether the weights hold e4m3fn NaN codes (FP8 and MXFP8 formats; scanned once, on the
    /// first call): a product with such a matrix is all NaN, as the exact decode makes it.
    pub fn holds_nan_codes(&self) -> bool {
        *self.nan_codes.get_or_init(|| match &self.data {
            MatrixData::Fp8Block { data, .. } | MatrixData::Mxfp8 { data, .. } => {
                crate::fp8::has_e4m3_nan(data.as_slice())
            }
            _ => false,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn data(&self) -> &MatrixData {
        &self.data
    }

    /// "f32", "bf16", "bf16_dot", "f16", "fp8_e4m3_block", "int8_row", "w8a8_int8", "int4_group",
    /// "w4a8_int4", "mxfp4", "mxfp8" or "hif8_row".
    pub fn format_name(&self) -> &'static str {
        name_of(&self.data)
    }

    /// Bytes of weights plus scales.
    pub fn storage_bytes(&self) -> usize {
        let scales = match &self.data {
            MatrixData::F32(_)
            | MatrixData::Bf16(_)
            | MatrixData::Bf16Dot(_)
            | MatrixData::F16(_) => 0,
            MatrixData::Fp8Block { scale_inv, .. } => scale_inv.len(),
            MatrixData::Int8Row { scale, .. }
            | MatrixData::W8A8 { scale, .. }
            | MatrixData::W4A8 { scale, .. }
            | MatrixData::Hif8 { scale, .. }
            | MatrixData::Int4Group { scale, .. } => scale.len(),
            // One byte each.
            MatrixData::Mxfp4 { scale, .. } | MatrixData::Mxfp8 { scale, .. } => {
                return data_bytes_of(&self.data).len() + scale.len()
            }
        };
        data_bytes_of(&self.data).len() + 4 * scales
    }

    pub(crate) fn view(&self) -> WeightsView<'_> {
        let format = format_of(&self.data);
        let (data, segment_cols, scales) = match &self.data {
            MatrixData::F32(b)
            | MatrixData::Bf16(b)
            | MatrixData::Bf16Dot(b)
            | MatrixData::F16(b) => (b.as_slice(), self.cols, Scales::One),
            MatrixData::Fp8Block {
                data,
                scale_inv,
                block_rows,
                block_cols,
            } => (
                data.as_slice(),
                *block_cols,
                Scales::Block {
                    scale: scale_inv,
                    block_rows: *block_rows,
                    grid_cols: self.cols.div_ceil(*block_cols),
                },
            ),
            MatrixData::Int8Row { data, scale }
            | MatrixData::W8A8 { data, scale }
            | MatrixData::W4A8 { data, scale }
            | MatrixData::Hif8 { data, scale } => (data.as_slice(), self.cols, Scales::Row(scale)),
            MatrixData::Mxfp4 { data, scale } | MatrixData::Mxfp8 { data, scale } => (
                data.as_slice(),
                MX_BLOCK,
                Scales::E8m0 {
                    scale: scale.as_slice(),
                    grid_cols: self.cols.div_ceil(MX_BLOCK),
                },
            ),
            MatrixData::Int4Group {
                data,
                scale,
                group_size,
            } => (
                data.as_slice(),
                *group_size,
                Scales::Block {
                    scale,
                    block_rows: 1,
                    grid_cols: self.cols.div_ceil(*group_size),
                },
            ),
        };
        WeightsView {
            format,
            data,
            cols: self.cols,
            segment_cols,
            scales,
        }
    }

    /// out[t*rows + r] = Σ_c W[r,c]·x[t*cols + c] for t in 0..n_tokens. x: [n_tokens, cols]
    /// row-major, out: [n_tokens, rows]. Multithreaded over rows when the work is large enough;
    /// deterministic (see the module documentation); f32 accumulation.
    pub fn matmul(&self, x: &[f32], n_tokens: usize, out: &mut [f32]) {
        self.matmul_rows(0..self.rows, x, n_tokens, out)
    }

    /// Same as [`Matrix::matmul`], but only for output rows `rows`; out: [n_tokens, rows.len()].
    pub fn matmul_rows(&self, rows: Range<usize>, x: &[f32], n_tokens: usize, out: &mut [f32]) {
        self.matmul_rows_at(simd_level(), rows, x, n_tokens, out)
    }

    pub(crate) fn matmul_rows_at(
        &self,
        level: SimdLevel,
        rows: Range<usize>,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) {
        assert!(
            rows.start <= rows.end && rows.end <= self.rows,
            "matmul_rows: row range {rows:?} is outside 0..{}",
            self.rows
        );
        assert!(
            n_tokens.checked_mul(self.cols) == Some(x.len()),
            "matmul: x must hold n_tokens ({n_tokens}) x cols ({}) values, got {}",
            self.cols,
            x.len()
        );
        assert!(
            n_tokens.checked_mul(rows.len()) == Some(out.len()),
            "matmul: out must hold n_tokens ({n_tokens}) x rows ({}) values, got {}",
            rows.len(),
            out.len()
        );
        debug_assert!(level.supported());
        if n_tokens == 0 || rows.is_empty() {
            return;
        }
        if self.holds_nan_codes() {
            out.fill(f32::NAN);
            return;
        }
        let view = self.view();
        let m = rows.len();
        let first = rows.start;
        let out = DisjointOut::new(out);
        let acts = Acts::prepare(&self.data, x, n_tokens, self.cols);
        let split = Split {
            align: acts.row_align(),
            min_task: 16,
            max_task: max_task_rows(self.cols, n_tokens),
        };
        for_each_task(m, m * self.cols * n_tokens, split, |task| {
            let task_rows = first + task.start..first + task.end;
            let out = OutRows {
                out: &out,
                stride: m,
                first_row: first,
            };
            // SAFETY: the task writes only its own rows of `out`; tasks' ranges are disjoint.
            unsafe { rows_task(level, &view, &acts, task_rows, x, n_tokens, &out) };
        });
    }

    /// Several products in one parallel region: `jobs[i].out = jobs[i].w · jobs[i].x`, each
    /// exactly as [`Matrix::matmul`] computes it (bit for bit), but with the rows of all jobs
    /// cut into one set of tasks, so a step of many small products (a decode step's experts)
    /// wakes the thread pool once instead of once per matrix. Jobs whose `x` is the same slice
    /// share one W8A8 activation quantization.
    pub fn matmul_group(jobs: &mut [MatmulJob<'_>]) {
        matmul_group_at(simd_level(), jobs)
    }

    /// Transposed product over a row sub-range: out[t*cols + c] = Σ_{r in rows} W[r,c]·
    /// x[t*rows.len() + (r - rows.start)]. out: [n_tokens, cols] (overwritten). Used for MLA
    /// weight absorption (q̃ = W_UKᵀ q, §3.4).
    pub fn matmul_t_rows(&self, rows: Range<usize>, x: &[f32], n_tokens: usize, out: &mut [f32]) {
        self.matmul_t_rows_at(simd_level(), rows, x, n_tokens, out)
    }

    pub(crate) fn matmul_t_rows_at(
        &self,
        level: SimdLevel,
        rows: Range<usize>,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) {
        assert!(
            rows.start <= rows.end && rows.end <= self.rows,
            "matmul_t_rows: row range {rows:?} is outside 0..{}",
            self.rows
        );
        assert!(
            n_tokens.checked_mul(rows.len()) == Some(x.len()),
            "matmul_t_rows: x must hold n_tokens ({n_tokens}) x rows ({}) values, got {}",
            rows.len(),
            x.len()
        );
        assert!(
            n_tokens.checked_mul(self.cols) == Some(out.len()),
            "matmul_t_rows: out must hold n_tokens ({n_tokens}) x cols ({}) values, got {}",
            self.cols,
            out.len()
        );
        debug_assert!(level.supported());
        if rows.is_empty() || n_tokens == 0 {
            out.fill(0.0);
            return;
        }
        if self.holds_nan_codes() {
            out.fill(f32::NAN);
            return;
        }
        let view = self.view();
        let split = Split {
            align: view.column_align(),
            min_task: 64,
            max_task: 512,
        };
        let work = rows.len() * self.cols * n_tokens;
        let out = DisjointOut::new(out);
        for_each_task(self.cols, work, split, |cols| {
            match level {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `Avx2` is only used where the CPU supports it; the task writes only
                // out[t*cols + c] for c in its own column range, and tasks' ranges are disjoint.
                SimdLevel::Avx2 => unsafe {
                    avx2::matmul_t_cols(&view, rows.clone(), x, n_tokens, cols, &out)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above, for `Avx512`.
                SimdLevel::Avx512 => unsafe {
                    avx512::matmul_t_cols(&view, rows.clone(), x, n_tokens, cols, &out)
                },
                #[cfg(target_arch = "aarch64")]
                // SAFETY: as above, for `Neon` (NEON is baseline on aarch64).
                SimdLevel::Neon => unsafe {
                    neon_float::matmul_t_cols(&view, rows.clone(), x, n_tokens, cols, &out)
                },
                _ => scalar::matmul_t_cols(&view, rows.clone(), x, n_tokens, cols, &out),
            }
        });
    }

    /// Dequantized row r into out[..cols] (embedding lookup): W[r,c] = value · scale in f32.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        assert!(
            r < self.rows,
            "row_to_f32: row {r} is outside 0..{}",
            self.rows
        );
        assert!(
            out.len() >= self.cols,
            "row_to_f32: out holds {} values, the row has {}",
            out.len(),
            self.cols
        );
        scalar::dequantize_row(&self.view(), r, 0..self.cols, &mut out[..self.cols]);
    }

    /// Full dequantization, row-major [rows, cols].
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.row_to_f32(r, row);
        }
        out
    }

    /// This matrix multiplied as BF16 × BF16 ([`MatrixData::Bf16Dot`]) when it holds bf16
    /// weights (same bytes, no copy); any other format comes back unchanged.
    pub fn to_bf16_dot(&self) -> Matrix {
        match &self.data {
            MatrixData::Bf16(b) => Matrix {
                rows: self.rows,
                cols: self.cols,
                data: MatrixData::Bf16Dot(b.clone()),
                nan_codes: Default::default(),
            },
            _ => self.clone(),
        }
    }

    /// This matrix as W8A8 (int8 weights with one scale per row, int8 token activations; see
    /// [`MatrixData::W8A8`]), for a runtime choice to hold a bf16/f16/f32 weight in int8 (the
    /// output head). Rows are quantized by the converter's rule: bf16 rows exactly as spec §5.2
    /// (`crate::int8::quantize_row_bf16_to_int8`), other rows from their f32 values with
    /// `s = max|w| / 127`, `q = round_half_even(w / s)`. Integer formats come back unchanged
    /// (already int8/int4); FP8 and the MX formats are quantized from their f32 values too.
    pub fn to_w8a8(&self) -> Matrix {
        let data = match &self.data {
            MatrixData::Int8Row { data, scale } => MatrixData::W8A8 {
                data: data.clone(),
                scale: scale.clone(),
            },
            MatrixData::W8A8 { .. } | MatrixData::W4A8 { .. } => return self.clone(),
            MatrixData::Bf16(b) | MatrixData::Bf16Dot(b) => {
                let bytes = b.as_slice();
                let mut q = vec![0i8; self.rows * self.cols];
                let mut row = vec![0u16; self.cols];
                let scale: Vec<f32> = q
                    .chunks_exact_mut(self.cols)
                    .enumerate()
                    .map(|(r, qr)| {
                        let src = &bytes[r * self.cols * 2..(r + 1) * self.cols * 2];
                        for (v, c) in row.iter_mut().zip(src.chunks_exact(2)) {
                            *v = u16::from_le_bytes([c[0], c[1]]);
                        }
                        crate::int8::quantize_row_bf16_to_int8(&row, qr)
                    })
                    .collect();
                MatrixData::W8A8 {
                    data: Bytes::from_vec(q.into_iter().map(|v| v as u8).collect()),
                    scale,
                }
            }
            _ => {
                let mut q = vec![0i8; self.rows * self.cols];
                let mut row = vec![0.0f32; self.cols];
                let scale: Vec<f32> = q
                    .chunks_exact_mut(self.cols)
                    .enumerate()
                    .map(|(r, qr)| {
                        self.row_to_f32(r, &mut row);
                        let s = crate::int8::quantize_activation_int8(&row, qr);
                        if s.is_finite() {
                            s
                        } else {
                            qr.fill(0);
                            0.0
                        }
                    })
                    .collect();
                MatrixData::W8A8 {
                    data: Bytes::from_vec(q.into_iter().map(|v| v as u8).collect()),
                    scale,
                }
            }
        };
        // Quantizing reads a NaN code as 0: the copy keeps the source's NaN products.
        let nan_codes = if self.holds_nan_codes() {
            std::sync::OnceLock::from(true)
        } else {
            Default::default()
        };
        Matrix {
            rows: self.rows,
            cols: self.cols,
            data,
            nan_codes,
        }
    }

    /// An f32 matrix holding exactly the dequantized values.
    pub fn to_f32_matrix(&self) -> Matrix {
        let bytes = Bytes::from_vec(f32s_to_le_bytes(&self.to_f32_vec()));
        Matrix {
            rows: self.rows,
            cols: self.cols,
            data: MatrixData::F32(bytes),
            nan_codes: Default::default(),
        }
    }
}

/// Column chunk width of the transposed product (two 8-lane vectors).
pub(crate) const CHUNK: usize = 16;

fn format_of(data: &MatrixData) -> Format {
    match data {
        MatrixData::F32(_) => Format::F32,
        MatrixData::Bf16(_) | MatrixData::Bf16Dot(_) => Format::Bf16,
        MatrixData::F16(_) => Format::F16,
        MatrixData::Fp8Block { .. } => Format::Fp8,
        MatrixData::Int8Row { .. } | MatrixData::W8A8 { .. } => Format::Int8,
        MatrixData::Int4Group { .. } | MatrixData::W4A8 { .. } => Format::Int4,
        MatrixData::Mxfp4 { .. } => Format::Fp4,
        MatrixData::Mxfp8 { .. } => Format::Mxfp8,
        MatrixData::Hif8 { .. } => Format::Hif8,
    }
}

/// One product of [`Matrix::matmul_group`]: out [n_tokens, w.rows()] = x [n_tokens, w.cols()]
/// times wᵀ.
pub struct MatmulJob<'a> {
    pub w: &'a Matrix,
    pub x: &'a [f32],
    pub n_tokens: usize,
    pub out: &'a mut [f32],
}

/// Rows `task_rows` of one product, at `level`.
///
/// # Safety
/// `out` accepts writes for every row in `task_rows` (no other task writes them); `level` is
/// supported; `acts` is `x` prepared for the matrix ([`Acts::prepare`]).
unsafe fn rows_task(
    level: SimdLevel,
    view: &WeightsView,
    acts: &Acts,
    task_rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    out: &OutRows,
) {
    if let Acts::Bf16(xb) = acts {
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as below; `vdpbf16ps` checked by `bf16dot::avx512::supported`.
            SimdLevel::Avx512 if bf16dot::avx512::supported() => unsafe {
                bf16dot::avx512::matmul_rows(view, task_rows, xb, n_tokens, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as below.
            SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe {
                bf16dot::avx2::matmul_rows(view, task_rows, xb, n_tokens, out)
            },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as below.
            SimdLevel::Neon => unsafe {
                bf16dot::neon::matmul_rows(view, task_rows, xb, n_tokens, out)
            },
            _ => bf16dot::matmul_rows_scalar(view, task_rows, xb, n_tokens, out),
        }
        return;
    }
    if let Acts::Int8(xq) = acts {
        // Integer activations: W8A8 (int8 weights) or W4A8 (int4 weights).
        let int4 = view.format == Format::Int4;
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as below; the tiles exist only where `amx::supported()` said yes.
            SimdLevel::Avx512 if xq.amx.is_some() => unsafe {
                let packed = xq.amx.as_ref().expect("checked");
                let stored = if int4 {
                    amx::Stored::Int4
                } else {
                    amx::Stored::Int8
                };
                amx::matmul_rows(view, task_rows, xq, packed, n_tokens, out, stored)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as below.
            SimdLevel::Avx512 if int4 => unsafe {
                w4a8::avx512::matmul_rows(view, task_rows, xq, n_tokens, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as below; `supported` checked AVX2 and AVX-VNNI.
            SimdLevel::Avx2 if int4 && w8a8::avx_vnni::supported() => unsafe {
                w4a8::avx_vnni::matmul_rows(view, task_rows, xq, n_tokens, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as below.
            SimdLevel::Avx2 if int4 => unsafe {
                w4a8::avx2::matmul_rows(view, task_rows, xq, n_tokens, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as below; `supported` checked AVX2 and AVX-VNNI.
            SimdLevel::Avx2 if w8a8::avx_vnni::supported() => unsafe {
                w8a8::avx_vnni::matmul_rows(view, task_rows, xq, n_tokens, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as below.
            SimdLevel::Avx2 => unsafe {
                w8a8::avx2::matmul_rows(view, task_rows, xq, n_tokens, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as below.
            SimdLevel::Avx512 => unsafe {
                w8a8::avx512::matmul_rows(view, task_rows, xq, n_tokens, out)
            },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as below, for `Neon`; `neon_dotprod_supported` checked `sdot`.
            SimdLevel::Neon if int4 && neon_dotprod_supported() => unsafe {
                neon::matmul_rows_w4a8(view, task_rows, xq, n_tokens, out)
            },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as below, for `Neon`; `neon_dotprod_supported` checked `sdot`.
            SimdLevel::Neon if neon_dotprod_supported() => unsafe {
                neon::matmul_rows_w8a8(view, task_rows, xq, n_tokens, out)
            },
            _ if int4 => w4a8::matmul_rows_scalar(view, task_rows, xq, n_tokens, out),
            _ => w8a8::matmul_rows_scalar(view, task_rows, xq, n_tokens, out),
        }
        return;
    }
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is only used where the CPU supports it; the task writes only its own
        // rows of `out` (`OutRows`), and tasks' row ranges are disjoint.
        SimdLevel::Avx2 => unsafe { avx2::matmul_rows(view, task_rows, x, n_tokens, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for `Avx512`.
        SimdLevel::Avx512 => unsafe { avx512::matmul_rows(view, task_rows, x, n_tokens, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above; `Neon` is only used where the CPU has NEON (every aarch64 CPU).
        SimdLevel::Neon => unsafe { neon_float::matmul_rows(view, task_rows, x, n_tokens, out) },
        _ => scalar::matmul_rows(view, task_rows, x, n_tokens, out),
    }
}

/// The largest task of a forward product, in rows: 64, or more where rows are narrow, so that a
/// task does at least 64K multiply-adds. A 1-token task of 64 rows × 256 columns (a down
/// projection's) is 16-32 KB of weights, a microsecond or two: the pool's hand-off and the
/// prefetch restarting at each task boundary cost a good part of that.
fn max_task_rows(cols: usize, n_tokens: usize) -> usize {
    const MIN_TASK_WORK: usize = 1 << 16;
    (MIN_TASK_WORK / cols.saturating_mul(n_tokens).max(1)).max(64)
}

pub(crate) fn matmul_group_at(level: SimdLevel, jobs: &mut [MatmulJob<'_>]) {
    use rayon::prelude::*;
    debug_assert!(level.supported());
    for (i, j) in jobs.iter().enumerate() {
        assert!(
            j.n_tokens.checked_mul(j.w.cols) == Some(j.x.len()),
            "matmul_group: job {i}: x must hold n_tokens ({}) x cols ({}) values, got {}",
            j.n_tokens,
            j.w.cols,
            j.x.len()
        );
        assert!(
            j.n_tokens.checked_mul(j.w.rows) == Some(j.out.len()),
            "matmul_group: job {i}: out must hold n_tokens ({}) x rows ({}) values, got {}",
            j.n_tokens,
            j.w.rows,
            j.out.len()
        );
    }
    // One activation preparation per distinct (x, kind) among the jobs that need one.
    let mut xqs: Vec<(usize, usize, ActKind, Acts)> = vec![(0, 0, ActKind::F32, Acts::F32)];
    // Keyed by the slice and the matrix width too: the same slice read as tokens of another
    // width is another preparation (int8 scales are per token).
    let mut xq_of: Vec<usize> = Vec::with_capacity(jobs.len());
    for j in jobs.iter() {
        let kind = ActKind::of(&j.w.data);
        if kind == ActKind::F32 || j.n_tokens == 0 {
            xq_of.push(0);
            continue;
        }
        let key = (j.x.as_ptr() as usize, j.x.len());
        let found = xqs.iter().position(|(p, l, k, a)| {
            (*p, *l, *k) == (key.0, key.1, kind) && a.cols() == Some(j.w.cols)
        });
        xq_of.push(found.unwrap_or_else(|| {
            let acts = Acts::prepare(&j.w.data, j.x, j.n_tokens, j.w.cols);
            xqs.push((key.0, key.1, kind, acts));
            xqs.len() - 1
        }));
    }
    let work: usize = jobs.iter().map(|j| j.w.rows * j.w.cols * j.n_tokens).sum();
    let threads = rayon::current_num_threads();
    // Inside `serial`, on one thread or for little work: everything on the calling thread.
    let fork =
        threads > 1 && work >= crate::parallel::min_parallel_work() && crate::parallel::may_fork();
    // About four tasks per thread over all jobs, each 16 rows to `max_task_rows` (a multiple of
    // the job's row alignment: 4, or 16 for AMX tiles).
    let rows_per_task =
        |rows: usize, job_work: usize, cols: usize, n_tokens: usize, align: usize| -> usize {
            if !fork {
                return rows.max(1);
            }
            let share = (threads * 4 * job_work).div_ceil(work.max(1)).max(1);
            rows.div_ceil(share)
                .clamp(16, max_task_rows(cols, n_tokens))
                .div_ceil(align)
                * align
        };
    let mut tasks: Vec<(usize, Range<usize>)> = Vec::new();
    for (i, j) in jobs.iter().enumerate() {
        if j.n_tokens == 0 {
            continue;
        }
        let step = rows_per_task(
            j.w.rows,
            j.w.rows * j.w.cols * j.n_tokens,
            j.w.cols,
            j.n_tokens,
            xqs[xq_of[i]].3.row_align(),
        );
        let mut r = 0;
        while r < j.w.rows {
            tasks.push((i, r..(r + step).min(j.w.rows)));
            r += step;
        }
    }
    let views: Vec<WeightsView> = jobs.iter().map(|j| j.w.view()).collect();
    let meta: Vec<(&[f32], usize, usize)> =
        jobs.iter().map(|j| (j.x, j.n_tokens, j.w.rows)).collect();
    let outs: Vec<DisjointOut> = jobs
        .iter_mut()
        .map(|j| DisjointOut::new(&mut *j.out))
        .collect();
    let run = |(i, rows): &(usize, Range<usize>)| {
        let (x, n_tokens, m) = meta[*i];
        let out = OutRows {
            out: &outs[*i],
            stride: m,
            first_row: 0,
        };
        let acts = &xqs[xq_of[*i]].3;
        // SAFETY: tasks of one job cover disjoint row ranges, and each job has its own output.
        unsafe { rows_task(level, &views[*i], acts, rows.clone(), x, n_tokens, &out) };
    };
    if tasks.len() <= 1 || !fork {
        tasks.iter().for_each(run);
    } else {
        tasks.par_iter().for_each(run);
    }
    drop(outs);
    // Weights holding NaN codes give NaN, as in [`Matrix::matmul`].
    for j in jobs
        .iter_mut()
        .filter(|j| j.n_tokens > 0 && j.w.holds_nan_codes())
    {
        j.out.fill(f32::NAN);
    }
}

/// What a product does with its f32 activations before multiplying.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ActKind {
    /// Used as they are.
    F32,
    /// Quantized to int8 per token (W8A8, W4A8).
    Int8,
    /// Rounded to bf16 (`Bf16Dot`).
    Bf16,
}

impl ActKind {
    fn of(data: &MatrixData) -> ActKind {
        match data {
            MatrixData::W8A8 { .. } | MatrixData::W4A8 { .. } => ActKind::Int8,
            MatrixData::Bf16Dot(_) => ActKind::Bf16,
            _ => ActKind::F32,
        }
    }
}

/// A call's activations as its matrix multiplies them (prepared once per call, shared by the
/// row tasks).
pub(crate) enum Acts {
    F32,
    Int8(w8a8::QuantizedTokens),
    Bf16(bf16dot::Bf16Tokens),
}

impl Acts {
    /// Row alignment of a product's tasks: 16 where the AMX tiles (16 rows) run it.
    fn row_align(&self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Acts::Int8(q) if q.amx.is_some() => 16,
            _ => 4,
        }
    }

    /// The width the activations were prepared for (None for f32, used as given).
    fn cols(&self) -> Option<usize> {
        match self {
            Acts::F32 => None,
            Acts::Int8(q) => Some(q.cols),
            Acts::Bf16(b) => Some(b.cols),
        }
    }

    fn prepare(data: &MatrixData, x: &[f32], n_tokens: usize, cols: usize) -> Acts {
        match ActKind::of(data) {
            ActKind::F32 => Acts::F32,
            ActKind::Int8 => {
                #[allow(unused_mut)]
                let mut xq = w8a8::QuantizedTokens::new(x, n_tokens, cols);
                #[cfg(target_arch = "x86_64")]
                if matches!(data, MatrixData::W8A8 { .. } | MatrixData::W4A8 { .. })
                    && n_tokens >= amx::MIN_TOKENS
                    && simd_level() == SimdLevel::Avx512
                    && amx::supported()
                {
                    xq.amx = Some(amx::AmxTokens::new(&xq, n_tokens));
                }
                // The x86 W4A8 kernels' split activations, made here once rather than by the
                // first row task while the others wait on it.
                #[cfg(target_arch = "x86_64")]
                if matches!(data, MatrixData::W4A8 { .. }) && SimdLevel::Avx2.supported() {
                    w4a8::Split::of(&xq, simd_level() == SimdLevel::Avx512);
                }
                Acts::Int8(xq)
            }
            ActKind::Bf16 => Acts::Bf16(bf16dot::Bf16Tokens::new(x, cols)),
        }
    }
}

/// The format's name in messages and [`Matrix::format_name`].
fn name_of(data: &MatrixData) -> &'static str {
    match data {
        MatrixData::W8A8 { .. } => "w8a8_int8",
        MatrixData::W4A8 { .. } => "w4a8_int4",
        MatrixData::Bf16Dot(_) => "bf16_dot",
        _ => format_of(data).name(),
    }
}

/// MX scales: `rows x ceil(cols/32)` E8M0 bytes, none of them 255 (NaN). For MXFP8 the SIMD
/// decoding multiplies the scale by 2^8 (see `avx2.rs`), so bytes above 246 (2^119) are refused.
fn check_e8m0_scales(
    format: &'static str,
    rows: usize,
    cols: usize,
    scale: &[u8],
    fp8: bool,
) -> Result<(), KernelError> {
    let groups = cols.div_ceil(MX_BLOCK);
    let expected = rows * groups;
    if scale.len() != expected {
        return Err(KernelError::ScaleCount {
            format,
            rows,
            cols,
            grid: format!("{groups} E8M0 bytes of 32 columns per row"),
            expected,
            actual: scale.len(),
        });
    }
    let limit = if fp8 { 246 } else { 254 };
    if let Some((index, &b)) = scale.iter().enumerate().find(|(_, &b)| b > limit) {
        return Err(KernelError::E8m0Scale {
            format,
            index,
            byte: b,
            limit,
        });
    }
    Ok(())
}

fn data_bytes_of(data: &MatrixData) -> &Bytes {
    match data {
        MatrixData::F32(b) | MatrixData::Bf16(b) | MatrixData::Bf16Dot(b) | MatrixData::F16(b) => b,
        MatrixData::Fp8Block { data, .. }
        | MatrixData::Int8Row { data, .. }
        | MatrixData::W8A8 { data, .. }
        | MatrixData::W4A8 { data, .. }
        | MatrixData::Int4Group { data, .. }
        | MatrixData::Mxfp4 { data, .. }
        | MatrixData::Mxfp8 { data, .. }
        | MatrixData::Hif8 { data, .. } => data,
    }
}

/// Where the forward kernels put their results: out[t*stride + (r - first_row)].
pub(crate) struct OutRows<'a, 'b> {
    pub out: &'a DisjointOut<'b>,
    pub stride: usize,
    pub first_row: usize,
}

impl OutRows<'_, '_> {
    /// Stores the result for row `r`, token `t`.
    ///
    /// # Safety
    /// Row `r` belongs to the calling task (see [`DisjointOut`]).
    #[inline]
    pub unsafe fn write(&self, t: usize, r: usize, v: f32) {
        self.out.write(t * self.stride + (r - self.first_row), v);
    }

    /// The results of rows `r..r + n` for token `t`.
    ///
    /// # Safety
    /// Rows `r..r + n` belong to the calling task (see [`DisjointOut`]).
    #[inline]
    #[allow(clippy::mut_from_ref)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the AVX-512 tiles' writer
    pub unsafe fn rows_mut(&self, t: usize, r: usize, n: usize) -> &mut [f32] {
        self.out
            .slice_mut(t * self.stride + (r - self.first_row), n)
    }
}
