//! AVX-512 forward product (F/BW/VL on top of AVX2 + FMA + F16C; `SimdLevel::Avx512`), for every
//! float weight format. Every function here requires a CPU with those features and a validated
//! [`WeightsView`] (checked by `Matrix::matmul*`). The transposed product is here too
//! (`matmul_t_cols`); W4A8 and the vector kernels run the AVX2 code at this level; W8A8 has its
//! own VNNI kernel (`w8a8::avx512`).
//!
//! Bit-identical to the AVX2 kernels (`avx2.rs`), so a model gives the same tokens whichever of
//! the two levels runs it. The AVX2 product keeps, per (row, token) and column segment, two
//! 8-lane accumulators a0 (columns c..c+8 of each 16-column chunk) and a1 (c+8..c+16), then does
//! `total = fma(a0 + a1, scale·FACTOR, total)` in 8 lanes and a horizontal sum at the end. Here
//! one 16-lane accumulator holds a0 in its low and a1 in its high 256 bits: a lane-wise FMA is
//! the same operation whatever the vector width. At a segment's end the two halves are added in
//! 256 bits and the total is the same 8-lane FMA and `hsum`. Weights are decoded 16 at a time
//! into one zmm vector holding exactly the values AVX2 decodes into its two ymm vectors (the
//! same `Weights16::FACTOR`: FP8 through f16 as value·2^−8, e2m1 as 2·value, HiF8 by a 16-lane
//! gather), and ragged segment ends go through the same zero-padded copies.
//!
//! What AVX-512 buys is registers and width: 32 zmm let a tile keep 8..16 accumulator chains (8
//! rows × 1 token for decode, 4×2, 3×3, 4×4, 4×5, 4×6 for batches), each FMA doing 16 lanes. Tokens
//! go in groups of up to 6 for any batch size (no decoded f32 panel as in AVX2: slower here, see `forward`);
//! since every (row, token) pair's operations are those of AVX2's `tile`, results match AVX2's
//! tile and panel paths alike. Weight lines some row tiles ahead are prefetched into L2 in software
//! (`avx2::prefetch_tile_ahead`).
//!
//! Spec: `deepseek-v3-r1-kimi-k2.md` §2.2 (FP8 block scales) and §4 (quantized formats) for the
//! formats; the operations are those of the AVX2 module.

#![allow(clippy::needless_range_loop)] // parallel indexing of several const-size arrays

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::{
    prefetch_ahead, prefetch_tile_ahead, tile_prefetch_distance, Bf16W, Fp4W, Fp8W, Hif8W, Int4W,
    Int8W, Weights16, F16W, F32W,
};
use super::scalar::segments;
use super::{Format, OutRows, RowScales, WeightsView};
use crate::parallel::DisjointOut;
use crate::vector::avx2::hsum;

/// Decodes 16 consecutive stored weights into one 16-lane vector: lanes 0..8 are AVX2's first
/// vector, lanes 8..16 its second, bit for bit.
pub(crate) trait Weights16x512: Weights16 {
    /// # Safety
    /// `p` points at BYTES16 readable bytes; the CPU supports the `Avx512` level.
    unsafe fn load512(p: *const u8) -> __m512;
}

impl Weights16x512 for F32W {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load512(p: *const u8) -> __m512 {
        _mm512_loadu_ps(p as *const f32)
    }
}

impl Weights16x512 for Bf16W {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load512(p: *const u8) -> __m512 {
        let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
    }
}

impl Weights16x512 for F16W {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load512(p: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

impl Weights16x512 for Fp8W {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load512(p: *const u8) -> __m512 {
        // The f16 pattern ((b & 0x80) << 8) | ((b & 0x7F) << 7), as in `avx2::Fp8W`.
        let b = _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i));
        let h = _mm256_and_si256(
            _mm256_slli_epi16::<7>(b),
            _mm256_set1_epi16(0xBFFFu16 as i16),
        );
        _mm512_cvtph_ps(h)
    }
}

impl Weights16x512 for Int8W {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load512(p: *const u8) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
    }
}

/// The 16 nibbles of the 8 bytes at `p` in column order (byte k: columns 2k low, 2k+1 high).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn nibbles16(p: *const u8) -> __m128i {
    let v = _mm_loadl_epi64(p as *const __m128i);
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), mask);
    _mm_unpacklo_epi8(lo, hi)
}

impl Weights16x512 for Int4W {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load512(p: *const u8) -> __m512 {
        let q = _mm_sub_epi8(nibbles16(p), _mm_set1_epi8(8));
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))
    }
}

impl Weights16x512 for Fp4W {
    /// The 16 e2m1 codes of 8 bytes (low nibble first) as twice their values, straight from a
    /// 16-entry f32 table: each byte to two lanes (`pshufb`), widened, shifted by 0 or 4, and
    /// looked up by `vpermps`, which reads only an index's low 4 bits (4 operations against the
    /// 7 of nibble masks, a byte table and two conversions; the same values, code 8 as +0).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load512(p: *const u8) -> __m512 {
        let lut = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0,
        );
        let pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        let bytes = _mm_shuffle_epi8(_mm_loadl_epi64(p as *const __m128i), pairs);
        let shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        let idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(bytes), shifts);
        _mm512_permutexvar_ps(idx, lut)
    }
}

impl Weights16x512 for Hif8W {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load512(p: *const u8) -> __m512 {
        let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
        let table = crate::hif8::hif8_table().as_ptr();
        _mm512_i32gather_ps::<4>(idx, table)
    }
}

/// Bytes holding `n` weights (a partial byte counts: int4 tails).
#[inline]
fn bytes_of<W: Weights16>(n: usize) -> usize {
    (n * W::BYTES16).div_ceil(16)
}

/// `total + (low half + high half)·scale` in 8 lanes: AVX2's `fma(a0 + a1, scale, total)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn fold(acc: __m512, scale: __m256, total: __m256) -> __m256 {
    let lo = _mm512_castps512_ps256(acc);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
    _mm256_fmadd_ps(_mm256_add_ps(lo, hi), scale, total)
}

/// The forward product for rows `rows` (all tokens), written through `out`.
///
/// # Safety
/// See the module documentation; `out` accepts writes for every row in `rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn matmul_rows(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    out: &OutRows,
) {
    match w.format {
        Format::F32 => forward::<F32W>(w, rows, x, n_tokens, out),
        Format::Bf16 => forward::<Bf16W>(w, rows, x, n_tokens, out),
        Format::F16 => forward::<F16W>(w, rows, x, n_tokens, out),
        Format::Fp8 | Format::Mxfp8 => forward::<Fp8W>(w, rows, x, n_tokens, out),
        Format::Int8 => forward::<Int8W>(w, rows, x, n_tokens, out),
        Format::Int4 => forward::<Int4W>(w, rows, x, n_tokens, out),
        Format::Fp4 => forward::<Fp4W>(w, rows, x, n_tokens, out),
        Format::Hif8 => forward::<Hif8W>(w, rows, x, n_tokens, out),
    }
}

/// Weight bytes per row block in the forward product (as in AVX2).
const L2_BLOCK_BYTES: usize = 128 * 1024;

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn forward<W: Weights16x512>(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    out: &OutRows,
) {
    // Groups of 6 tokens (4 × 6 tiles, 24 accumulators): against groups of 4, in-process
    // alternating timings on Zen 5 gave BF16 1.18-1.32× at 512 tokens on 1536-2048-wide
    // matrices (each group's activations are re-read from L2 per row tile, and weights re-decoded
    // per group: fewer groups, less of both), FP8 and int8 0.95-1.15× (docs/PERF.md).
    // No f32 panel (AVX2's `forward_panel`) here: on Zen 5 the 4-row × 4-token tiles, decoding
    // each weight once per group of 4 tokens, measured faster at 16 and 64 tokens than a
    // decoded panel with 2-row × 8-token tiles (docs/PERF.md).
    let block_rows = (L2_BLOCK_BYTES / bytes_of::<W>(w.cols)).max(8) / 8 * 8;
    let mut r0 = rows.start;
    while r0 < rows.end {
        let block = r0..(r0 + block_rows).min(rows.end);
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(6);
            match nt {
                1 => row_tiles::<W, 8, 1>(w, block.clone(), x, t0, out),
                2 => row_tiles::<W, 4, 2>(w, block.clone(), x, t0, out),
                3 => row_tiles::<W, 3, 3>(w, block.clone(), x, t0, out),
                4 => row_tiles::<W, 4, 4>(w, block.clone(), x, t0, out),
                5 => row_tiles::<W, 4, 5>(w, block.clone(), x, t0, out),
                _ => row_tiles::<W, 4, 6>(w, block.clone(), x, t0, out),
            }
            t0 += nt;
        }
        r0 = block.end;
    }
}

/// Tokens t0..t0+NT for every row in `rows`: R rows at a time, then 2 (when R > 2), then 1.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn row_tiles<W: Weights16x512, const R: usize, const NT: usize>(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    t0: usize,
    out: &OutRows,
) {
    let mut xs = [std::ptr::null::<f32>(); NT];
    for t in 0..NT {
        xs[t] = x.as_ptr().add((t0 + t) * w.cols);
    }
    let mut r = rows.start;
    while r + R <= rows.end {
        let res = tile::<W, R, NT>(w, r, &xs);
        write_tile(out, t0, r, &res);
        r += R;
    }
    if R > 2 {
        while r + 2 <= rows.end {
            let res = tile::<W, 2, NT>(w, r, &xs);
            write_tile(out, t0, r, &res);
            r += 2;
        }
    }
    while r < rows.end {
        let res = tile::<W, 1, NT>(w, r, &xs);
        write_tile(out, t0, r, &res);
        r += 1;
    }
}

/// One bounds-checked slice per token (the tile's rows are consecutive in the output).
#[inline(always)]
unsafe fn write_tile<const R: usize, const NT: usize>(
    out: &OutRows,
    t0: usize,
    r: usize,
    res: &[[f32; NT]; R],
) {
    for t in 0..NT {
        let dst = out.rows_mut(t0 + t, r, R);
        for i in 0..R {
            dst[i] = res[i][t];
        }
    }
}

/// Rows row0..row0+R times the NT token vectors at `xs` (each `w.cols` long); the operations of
/// `avx2::tile` on each (row, token) pair.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tile<W: Weights16x512, const R: usize, const NT: usize>(
    w: &WeightsView,
    row0: usize,
    xs: &[*const f32; NT],
) -> [[f32; NT]; R] {
    let cols = w.cols;
    let row_bytes = bytes_of::<W>(cols);
    let mut wp = [std::ptr::null::<u8>(); R];
    let mut row_scales = [RowScales::F32(&[]); R];
    for i in 0..R {
        wp[i] = w.data.as_ptr().add((row0 + i) * row_bytes);
        row_scales[i] = w.scales.row(row0 + i);
    }
    // The running totals live in memory, touched once per segment: in registers beside the
    // 16 accumulators of the 4 × 4 tile they took the register file's last slots, and the
    // compiler spilled accumulators instead, storing and reloading one every 16 columns (a
    // dependent store-load chain in the inner loop). Same operations, same bits.
    let ahead = tile_prefetch_distance(R * row_bytes);
    let mut total = [[_mm256_setzero_ps(); NT]; R];
    let mut c0 = 0;
    let mut segment = 0;
    while c0 < cols {
        let c1 = (c0 + w.segment_cols).min(cols);
        let mut acc = [[_mm512_setzero_ps(); NT]; R];
        let mut c = c0;
        let mut wo = bytes_of::<W>(c0);
        while c + 16 <= c1 {
            for i in 0..R {
                if wo.is_multiple_of(64) {
                    // The same line of row i some tiles on (`avx2::prefetch_tile_ahead`).
                    prefetch_tile_ahead(wp[i], ahead + wo);
                }
                let wv = W::load512(wp[i].add(wo));
                for t in 0..NT {
                    acc[i][t] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xs[t].add(c)), acc[i][t]);
                }
            }
            c += 16;
            wo += W::BYTES16;
        }
        if c < c1 {
            // Ragged segment end: zero-padded copies, as in AVX2.
            let k = c1 - c;
            let mut xpad = [[0.0f32; 16]; NT];
            for t in 0..NT {
                std::ptr::copy_nonoverlapping(xs[t].add(c), xpad[t].as_mut_ptr(), k);
            }
            for i in 0..R {
                let mut wpad = [0u8; 64];
                std::ptr::copy_nonoverlapping(
                    wp[i].add(bytes_of::<W>(c)),
                    wpad.as_mut_ptr(),
                    bytes_of::<W>(k),
                );
                let wv = W::load512(wpad.as_ptr());
                for t in 0..NT {
                    let xv = _mm512_loadu_ps(xpad[t].as_ptr());
                    acc[i][t] = _mm512_fmadd_ps(wv, xv, acc[i][t]);
                }
            }
        }
        for i in 0..R {
            let scale = _mm256_set1_ps(row_scales[i].get(segment) * W::FACTOR);
            for t in 0..NT {
                let p = std::ptr::addr_of_mut!(total[i][t]);
                // SAFETY: `p` points at a live, aligned local.
                std::ptr::write_volatile(p, fold(acc[i][t], scale, std::ptr::read_volatile(p)));
            }
        }
        c0 = c1;
        segment += 1;
    }
    let mut res = [[0.0f32; NT]; R];
    for i in 0..R {
        for t in 0..NT {
            res[i][t] = hsum(total[i][t]);
        }
    }
    res
}

/// The transposed product `out[t, c] = Σ_i x[t, i]·W[rows.start + i, c]` for the columns `cols`
/// (all tokens), written through `out`.
///
/// Each (token, column) is one FMA chain over the rows in order from zero, with the coefficient
/// `x·(scale·FACTOR)` of AVX2's `transposed`: the same operations, so the same bits. Where AVX2
/// walks the rows 16 at a time (`T_ROW_BLOCK`), its accumulators parked in `out` between passes,
/// a chunk of up to 8 zmm columns here walks all the rows at once: weight rows are read at one
/// stride from start to end (the hardware prefetchers follow it, the software prefetch runs
/// 8 rows ahead), which is what a cold W_UK (MLA absorption in decode) is limited by.
///
/// # Safety
/// See the module documentation; `out` accepts writes for `out[t*w.cols + c]`, c in `cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn matmul_t_cols(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    cols: Range<usize>,
    out: &DisjointOut,
) {
    match w.format {
        Format::F32 => transposed::<F32W>(w, rows, x, n_tokens, cols, out),
        Format::Bf16 => transposed::<Bf16W>(w, rows, x, n_tokens, cols, out),
        Format::F16 => transposed::<F16W>(w, rows, x, n_tokens, cols, out),
        Format::Fp8 | Format::Mxfp8 => transposed::<Fp8W>(w, rows, x, n_tokens, cols, out),
        Format::Int8 => transposed::<Int8W>(w, rows, x, n_tokens, cols, out),
        Format::Int4 => transposed::<Int4W>(w, rows, x, n_tokens, cols, out),
        Format::Fp4 => transposed::<Fp4W>(w, rows, x, n_tokens, cols, out),
        Format::Hif8 => transposed::<Hif8W>(w, rows, x, n_tokens, cols, out),
    }
}

/// Rows ahead of the one being read that the transposed product prefetches.
const T_PREFETCH_ROWS: usize = 8;

/// What the transposed kernels share: the matrix, its rows, and x as `[n_tokens, rows.len()]`.
struct TArgs<'a, 'b> {
    w: &'a WeightsView<'a>,
    rows: Range<usize>,
    x: &'a [f32],
    out: &'a DisjointOut<'b>,
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn transposed<W: Weights16x512>(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    cols: Range<usize>,
    out: &DisjointOut,
) {
    let a = TArgs { w, rows, x, out };
    for (segment, seg) in segments(w, cols) {
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(4);
            // Column chunks of NC zmm: 8 accumulator chains or more in flight for any NT (wider
            // chunks for 2..4 tokens, 16-24 accumulators, measured 2-3x slower: spills).
            match nt {
                1 => t_segment::<W, 1, 8>(&a, segment, seg.clone(), t0),
                2 => t_segment::<W, 2, 4>(&a, segment, seg.clone(), t0),
                3 => t_segment::<W, 3, 4>(&a, segment, seg.clone(), t0),
                _ => t_segment::<W, 4, 4>(&a, segment, seg.clone(), t0),
            }
            t0 += nt;
        }
    }
}

/// Columns `seg` (within one scale segment) for tokens t0..t0+NT: chunks of NC·16 columns,
/// then of 16, then the ragged end.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn t_segment<W: Weights16x512, const NT: usize, const NC: usize>(
    a: &TArgs,
    segment: usize,
    seg: Range<usize>,
    t0: usize,
) {
    let mut c = seg.start;
    while c + NC * 16 <= seg.end {
        t_chunk::<W, NT, NC>(a, segment, c, 16, t0);
        c += NC * 16;
    }
    while c + 16 <= seg.end {
        t_chunk::<W, NT, 1>(a, segment, c, 16, t0);
        c += 16;
    }
    if c < seg.end {
        t_chunk::<W, NT, 1>(a, segment, c, seg.end - c, t0);
    }
}

/// Columns c..c+16·NC (or, with NC = 1, c..c+last where last < 16 is a ragged segment end,
/// read through zero-padded copies as in AVX2) for tokens t0..t0+NT, over all the rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn t_chunk<W: Weights16x512, const NT: usize, const NC: usize>(
    a: &TArgs,
    segment: usize,
    c: usize,
    last: usize,
    t0: usize,
) {
    let w = a.w;
    let m = a.rows.len();
    let row_bytes = bytes_of::<W>(w.cols);
    let chunk_bytes = NC * W::BYTES16;
    let mut p = w
        .data
        .as_ptr()
        .add(a.rows.start * row_bytes + bytes_of::<W>(c));
    let mut acc = [[_mm512_setzero_ps(); NC]; NT];
    let mut wpad = [0u8; 64];
    for i in 0..m {
        let mut off = 0;
        while off < chunk_bytes {
            prefetch_ahead(p, T_PREFETCH_ROWS * row_bytes + off);
            off += 64;
        }
        let scale = w.scales.row(a.rows.start + i).get(segment) * W::FACTOR;
        let mut coef = [_mm512_setzero_ps(); NT];
        for t in 0..NT {
            coef[t] = _mm512_set1_ps(*a.x.get_unchecked((t0 + t) * m + i) * scale);
        }
        for k in 0..NC {
            let wv = if last == 16 {
                W::load512(p.add(k * W::BYTES16))
            } else {
                std::ptr::copy_nonoverlapping(p, wpad.as_mut_ptr(), bytes_of::<W>(last));
                W::load512(wpad.as_ptr())
            };
            for t in 0..NT {
                acc[t][k] = _mm512_fmadd_ps(wv, coef[t], acc[t][k]);
            }
        }
        p = p.add(row_bytes);
    }
    for t in 0..NT {
        let dst = a.out.slice_mut((t0 + t) * w.cols + c, NC * last);
        if last == 16 {
            for k in 0..NC {
                _mm512_storeu_ps(dst.as_mut_ptr().add(k * 16), acc[t][k]);
            }
        } else {
            let mut tmp = [0.0f32; 16];
            _mm512_storeu_ps(tmp.as_mut_ptr(), acc[t][0]);
            dst.copy_from_slice(&tmp[..last]);
        }
    }
}
