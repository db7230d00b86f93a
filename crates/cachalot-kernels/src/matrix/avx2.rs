//! AVX2 + FMA + F16C matrix kernels. Every function here requires a CPU with those features
//! (`SimdLevel::Avx2.supported()`) and a validated [`WeightsView`] with in-range rows, columns
//! and consistent slice lengths (checked by `Matrix::matmul*`).
//!
//! Stored weights are decoded 16 at a time into two 8-lane f32 vectors:
//! - f32: two unaligned loads;
//! - bf16: zero-extend to 32 bits and shift left by 16;
//! - f16: `vcvtph2ps`;
//! - int8: sign-extend to 32 bits and convert; the row scale is applied per row at the end;
//! - int4: split the nibbles, interleave them back into column order, subtract 8, convert;
//! - e2m1 (MXFP4): the same nibble split, then a `vpshufb` table lookup giving 2·value as int8
//!   (exact), convert; the ½ is folded into the E8M0 scale;
//! - HiF8: two `vgatherdps` from the 256-entry table;
//! - FP8 e4m3fn without gathers: widen each byte b to 16 bits, form the f16 bit pattern
//!   ((b & 0x80) << 8) | ((b & 0x7F) << 7) and convert with `vcvtph2ps`. That is exactly
//!   value · 2^−8 for every finite code, subnormals included (see `fp8.rs`); the 2^8 is
//!   multiplied into the block scale. (0x7F/0xFF, NaN in e4m3fn, decode as ±480 here; real
//!   checkpoints never hold them.)
//!
//! Forward product: tokens go in groups of up to 4 and rows in tiles (4 rows for one token,
//! 2×2, 1×3, 1×4), so each decoded weight vector feeds several FMAs and every tile keeps 8
//! independent accumulator chains. Each (row, token) pair owns two 8-lane accumulators per
//! column segment, so its result does not depend on the tile it was computed in. Rows go in
//! blocks of about 128 KB so that with many tokens each block is reused from cache.
//!
//! Transposed product (axpy form): for each row r, out[t, c..] += W[r, c..]·(x[t, r]·scale),
//! in passes of 16 rows over all of the task's columns, with a chunk of columns (64 for one
//! token, 32 for two, 16 for three or four) accumulated in registers during a pass. Every
//! column sums over r in order, whatever the chunk, pass or task.

#![allow(clippy::needless_range_loop)] // parallel indexing of several const-size arrays

use std::arch::x86_64::*;
use std::ops::Range;

use super::scalar::segments;
use super::{Format, OutRows, RowScales, WeightsView, CHUNK};
use crate::parallel::DisjointOut;
use crate::vector::avx2::hsum;

/// Decodes 16 consecutive stored weights at `p` (unaligned) into two vectors holding
/// value / FACTOR each.
pub(crate) trait Weights16 {
    /// Bytes holding 16 weights.
    const BYTES16: usize;
    /// Multiplied into the scale to undo the decoding's own scaling.
    const FACTOR: f32;
    /// # Safety
    /// `p` points at BYTES16 readable bytes; the CPU supports avx2, fma and f16c.
    unsafe fn load16(p: *const u8) -> (__m256, __m256);
}

/// Bytes holding `n` weights (a partial byte counts: int4 tails).
#[inline]
fn bytes_of<W: Weights16>(n: usize) -> usize {
    (n * W::BYTES16).div_ceil(16)
}

/// Software prefetch of `base + offset` into all cache levels. The transposed products call it
/// for the columns the next pass over the rows will read (a short distance ahead). A prefetch
/// never faults; the address may lie past the matrix.
#[inline(always)]
pub(crate) fn prefetch_ahead(base: *const u8, offset: usize) {
    // SAFETY: `prefetcht0` has no architectural effect beyond the cache and never faults;
    // the pointer is not dereferenced (wrapping arithmetic, any address is fine).
    unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(offset) as *const i8) }
}

/// Software prefetch of `base + offset` into L2 and the outer levels (not L1). The forward,
/// W8A8 and BF16-dot products call it, while a tile of `R` rows runs, for the same line of a row
/// [`tile_prefetch_distance`] bytes further on (whole row tiles ahead): a decode step's rows are
/// a few KB or less each, so the hardware prefetchers, which stop at 4 KB page ends, restart
/// cold on every tile. Into L2 only, because the lines ahead do not fit in L1 beside the tile
/// being read (`prefetcht0` evicted the current tile's lines). On Zen 5, 2 threads, a 1-token
/// BF16 product of 2048-wide rows streams 1.1-1.3× faster with `prefetcht1` than with
/// `prefetcht0` one tile ahead, 256-wide rows 2.2× (docs/PERF.md, session 19). The address may
/// lie past the matrix.
#[inline(always)]
pub(crate) fn prefetch_tile_ahead(base: *const u8, offset: usize) {
    // SAFETY: as `prefetch_ahead`: a hint that never faults; the pointer is not dereferenced.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(offset) as *const i8) }
}

pub(crate) use super::tile_prefetch_distance;

pub(crate) struct F32W;
pub(crate) struct Bf16W;
pub(crate) struct F16W;
pub(crate) struct Fp8W;
pub(crate) struct Int8W;
pub(crate) struct Int4W;
pub(crate) struct Fp4W;
pub(crate) struct Hif8W;

impl Weights16 for F32W {
    const BYTES16: usize = 64;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        let p = p as *const f32;
        (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }
}

impl Weights16 for Bf16W {
    const BYTES16: usize = 32;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        let v = _mm256_loadu_si256(p as *const __m256i);
        let lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(v));
        let hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256::<1>(v));
        (
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(lo)),
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(hi)),
        )
    }
}

impl Weights16 for F16W {
    const BYTES16: usize = 32;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        (
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)),
        )
    }
}

impl Weights16 for Fp8W {
    const BYTES16: usize = 16;
    const FACTOR: f32 = 256.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        (fp8_to_f16_to_f32(p), fp8_to_f16_to_f32(p.add(8)))
    }
}

/// 8 FP8 codes at `p` as value · 2^−8. Sign-extending b to 16 bits and shifting left by 7 puts
/// eeeemmm at bits 7..13 and the sign at bits 14 and 15; clearing bit 14 leaves the f16
/// pattern ((b & 0x80) << 8) | ((b & 0x7F) << 7). The preparation stays in 128-bit registers
/// (on Zen 2 `vcvtph2ps` is the bottleneck and this is measurably faster than widening to
/// 256 bits and extracting halves).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fp8_to_f16_to_f32(p: *const u8) -> __m256 {
    let b = _mm_cvtepi8_epi16(_mm_loadl_epi64(p as *const __m128i));
    let h = _mm_and_si128(_mm_slli_epi16::<7>(b), _mm_set1_epi16(0xBFFFu16 as i16));
    _mm256_cvtph_ps(h)
}

impl Weights16 for Int8W {
    const BYTES16: usize = 16;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        i8x16_to_f32(_mm_loadu_si128(p as *const __m128i))
    }
}

impl Weights16 for Int4W {
    const BYTES16: usize = 8;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        // Nibble n means n - 8.
        i8x16_to_f32(_mm_sub_epi8(nibbles16(p), _mm_set1_epi8(8)))
    }
}

/// The 16 nibbles of the 8 bytes at `p` in column order: byte k holds columns 2k (low nibble)
/// and 2k+1 (high nibble).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles16(p: *const u8) -> __m128i {
    let v = _mm_loadl_epi64(p as *const __m128i);
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), mask);
    _mm_unpacklo_epi8(lo, hi)
}

/// 16 signed bytes as two 8-lane f32 vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn i8x16_to_f32(q: __m128i) -> (__m256, __m256) {
    (
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(q))),
    )
}

impl Weights16 for Fp4W {
    const BYTES16: usize = 8;
    const FACTOR: f32 = 0.5;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        // A 16-entry table lookup (`vpshufb`) maps each e2m1 code to twice its value as an int8
        // (exact: 0, 1, ..., 12).
        let lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
        i8x16_to_f32(_mm_shuffle_epi8(lut, nibbles16(p)))
    }
}

impl Weights16 for Hif8W {
    const BYTES16: usize = 16;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        // Two 8-lane gathers from the 256-entry decoding table.
        let v = _mm_loadu_si128(p as *const __m128i);
        let table = crate::hif8::hif8_table().as_ptr();
        (
            _mm256_i32gather_ps::<4>(table, _mm256_cvtepu8_epi32(v)),
            _mm256_i32gather_ps::<4>(table, _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v))),
        )
    }
}

/// The FP8 decoding of 16 codes, times 2^8 (for tests against the table).
#[cfg(test)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn fp8_decode16(codes: &[u8; 16]) -> [f32; 16] {
    let (lo, hi) = Fp8W::load16(codes.as_ptr());
    let f = _mm256_set1_ps(Fp8W::FACTOR);
    let mut out = [0.0f32; 16];
    _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(lo, f));
    _mm256_storeu_ps(out.as_mut_ptr().add(8), _mm256_mul_ps(hi, f));
    out
}

/// The forward product for rows `rows` (all tokens), written through `out`.
///
/// # Safety
/// See the module documentation; `out` accepts writes for every row in `rows`.
#[target_feature(enable = "avx2,fma,f16c")]
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

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn forward<W: Weights16>(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    out: &OutRows,
) {
    // Rows in blocks of about L2_BLOCK_BYTES of weights, so that with many tokens (prefill)
    // each block stays in cache while every token group passes over it.
    let block_rows = (L2_BLOCK_BYTES / bytes_of::<W>(w.cols)).max(4) / 4 * 4;
    let mut r0 = rows.start;
    while r0 < rows.end {
        let block = r0..(r0 + block_rows).min(rows.end);
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(4);
            match nt {
                1 => row_tiles::<W, 4, 1>(w, block.clone(), x, t0, out),
                2 => row_tiles::<W, 2, 2>(w, block.clone(), x, t0, out),
                3 => row_tiles::<W, 1, 3>(w, block.clone(), x, t0, out),
                _ => row_tiles::<W, 1, 4>(w, block.clone(), x, t0, out),
            }
            t0 += nt;
        }
        r0 = block.end;
    }
}

/// Weight bytes per row block in the forward product (half a typical 256 KB-1 MB L2).
const L2_BLOCK_BYTES: usize = 128 * 1024;

/// Tokens t0..t0+NT for every row in `rows`, R rows at a time (then single rows).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_tiles<W: Weights16, const R: usize, const NT: usize>(
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
        for i in 0..R {
            for t in 0..NT {
                out.write(t0 + t, r + i, res[i][t]);
            }
        }
        r += R;
    }
    while r < rows.end {
        let res = tile::<W, 1, NT>(w, r, &xs);
        for t in 0..NT {
            out.write(t0 + t, r, res[0][t]);
        }
        r += 1;
    }
}

/// Rows row0..row0+R times the NT token vectors at `xs` (each `w.cols` long).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<W: Weights16, const R: usize, const NT: usize>(
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
    let ahead = tile_prefetch_distance(R * row_bytes);
    let zero = _mm256_setzero_ps();
    let mut total = [[zero; NT]; R];
    let mut c0 = 0;
    let mut segment = 0;
    while c0 < cols {
        let c1 = (c0 + w.segment_cols).min(cols);
        let mut a0 = [[zero; NT]; R];
        let mut a1 = [[zero; NT]; R];
        let mut c = c0;
        let mut wo = bytes_of::<W>(c0);
        while c + 16 <= c1 {
            for i in 0..R {
                if wo.is_multiple_of(64) {
                    // The same line of row i some tiles on (see `prefetch_tile_ahead`).
                    prefetch_tile_ahead(wp[i], ahead + wo);
                }
                let (w0, w1) = W::load16(wp[i].add(wo));
                for t in 0..NT {
                    a0[i][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs[t].add(c)), a0[i][t]);
                    a1[i][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs[t].add(c + 8)), a1[i][t]);
                }
            }
            c += 16;
            wo += W::BYTES16;
        }
        if c < c1 {
            // Ragged segment end: zero-padded copies through the same operations.
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
                let (w0, w1) = W::load16(wpad.as_ptr());
                for t in 0..NT {
                    let xp = xpad[t].as_ptr();
                    a0[i][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp), a0[i][t]);
                    a1[i][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp.add(8)), a1[i][t]);
                }
            }
        }
        for i in 0..R {
            let scale = _mm256_set1_ps(row_scales[i].get(segment) * W::FACTOR);
            for t in 0..NT {
                let partial = _mm256_add_ps(a0[i][t], a1[i][t]);
                total[i][t] = _mm256_fmadd_ps(partial, scale, total[i][t]);
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

/// The transposed product for output columns `cols` (all tokens): out[t*w.cols + c] =
/// Σ_{r in rows} W[r,c]·x[t*rows.len() + r - rows.start], accumulated over r in order.
///
/// # Safety
/// See the module documentation; the caller owns out[t*w.cols + c] for c in `cols`, and `cols`
/// starts on the 16-column chunk grid of its segment.
#[target_feature(enable = "avx2,fma,f16c")]
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

/// Rows per pass of the transposed product. A pass covers all the task's columns for these
/// rows, so weights are read row after row (what hardware prefetchers follow); a chunk's
/// accumulators live in registers during a pass and in `out` between passes.
const T_ROW_BLOCK: usize = 16;

/// Arguments shared by the transposed kernels.
struct TCtx<'a, 'b> {
    w: &'a WeightsView<'a>,
    /// The rows of this pass (absolute).
    rows: Range<usize>,
    /// coef[i*NT + t] = x[t0+t, rows.start + i - first row] · scale · FACTOR.
    coef: &'a [f32],
    t0: usize,
    /// The first pass starts the sums from zero; later passes continue from `out`.
    first: bool,
    out: &'a DisjointOut<'b>,
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transposed<W: Weights16>(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    cols: Range<usize>,
    out: &DisjointOut,
) {
    let m = rows.len();
    let mut coef = [0.0f32; T_ROW_BLOCK * 4];
    let mut row_scales = [RowScales::F32(&[]); T_ROW_BLOCK];
    let mut b0 = 0;
    while b0 < m {
        let b1 = (b0 + T_ROW_BLOCK).min(m);
        for i in b0..b1 {
            row_scales[i - b0] = w.scales.row(rows.start + i);
        }
        for (segment, seg) in segments(w, cols.clone()) {
            let mut t0 = 0;
            while t0 < n_tokens {
                let nt = (n_tokens - t0).min(4);
                let coef = &mut coef[..(b1 - b0) * nt];
                for i in b0..b1 {
                    let scale = row_scales[i - b0].get(segment) * W::FACTOR;
                    for t in 0..nt {
                        coef[(i - b0) * nt + t] = x[(t0 + t) * m + i] * scale;
                    }
                }
                let ctx = TCtx {
                    w,
                    rows: rows.start + b0..rows.start + b1,
                    coef,
                    t0,
                    first: b0 == 0,
                    out,
                };
                // Wider column chunks for fewer tokens keep 8 accumulator chains in flight; a
                // column's operations are the same whatever the chunk width.
                match nt {
                    1 => segment_chunks::<W, 1, 4>(&ctx, seg.clone()),
                    2 => segment_chunks::<W, 2, 2>(&ctx, seg.clone()),
                    3 => segment_chunks::<W, 3, 1>(&ctx, seg.clone()),
                    _ => segment_chunks::<W, 4, 1>(&ctx, seg.clone()),
                }
                t0 += nt;
            }
        }
        b0 = b1;
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn segment_chunks<W: Weights16, const NT: usize, const NC: usize>(
    ctx: &TCtx,
    seg: Range<usize>,
) {
    let mut c = seg.start;
    while c + NC * CHUNK <= seg.end {
        chunk::<W, NT, NC>(ctx, c);
        c += NC * CHUNK;
    }
    while c + CHUNK <= seg.end {
        chunk::<W, NT, 1>(ctx, c);
        c += CHUNK;
    }
    if c < seg.end {
        ragged_chunk::<W, NT>(ctx, c, seg.end - c);
    }
}

/// Columns c..c+16·NC for tokens t0..t0+NT over the pass's rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk<W: Weights16, const NT: usize, const NC: usize>(ctx: &TCtx, c: usize) {
    let w = ctx.w;
    let row_bytes = bytes_of::<W>(w.cols);
    let mut outs = [std::ptr::null_mut::<f32>(); NT];
    let zero = _mm256_setzero_ps();
    let mut acc = [[[zero; 2]; NC]; NT];
    for t in 0..NT {
        outs[t] = ctx
            .out
            .slice_mut((ctx.t0 + t) * w.cols + c, NC * CHUNK)
            .as_mut_ptr();
        if !ctx.first {
            for k in 0..NC {
                acc[t][k][0] = _mm256_loadu_ps(outs[t].add(k * CHUNK));
                acc[t][k][1] = _mm256_loadu_ps(outs[t].add(k * CHUNK + 8));
            }
        }
    }
    let mut p = w
        .data
        .as_ptr()
        .add(ctx.rows.start * row_bytes + bytes_of::<W>(c));
    debug_assert_eq!(ctx.coef.len(), ctx.rows.len() * NT);
    for i in 0..ctx.rows.len() {
        // The same columns of the row one pass further on: passes walk the rows in blocks of
        // T_ROW_BLOCK, so this is the data the next pass needs (hardware prefetchers follow
        // neither the column chunks across rows nor a pass's jump back to its first column).
        let mut off = 0;
        while off < NC * W::BYTES16 {
            prefetch_ahead(p, T_ROW_BLOCK * row_bytes + off);
            off += 64;
        }
        let mut a = [zero; NT];
        for t in 0..NT {
            a[t] = _mm256_set1_ps(*ctx.coef.get_unchecked(i * NT + t));
        }
        for k in 0..NC {
            let (w0, w1) = W::load16(p.add(k * W::BYTES16));
            for t in 0..NT {
                acc[t][k][0] = _mm256_fmadd_ps(w0, a[t], acc[t][k][0]);
                acc[t][k][1] = _mm256_fmadd_ps(w1, a[t], acc[t][k][1]);
            }
        }
        p = p.add(row_bytes);
    }
    for t in 0..NT {
        for k in 0..NC {
            _mm256_storeu_ps(outs[t].add(k * CHUNK), acc[t][k][0]);
            _mm256_storeu_ps(outs[t].add(k * CHUNK + 8), acc[t][k][1]);
        }
    }
}

/// Columns c..c+n (n < 16) at a segment's end, through zero-padded copies.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn ragged_chunk<W: Weights16, const NT: usize>(ctx: &TCtx, c: usize, n: usize) {
    let w = ctx.w;
    let row_bytes = bytes_of::<W>(w.cols);
    let zero = _mm256_setzero_ps();
    let mut acc = [[zero; 2]; NT];
    let mut tmp = [0.0f32; 16];
    if !ctx.first {
        for t in 0..NT {
            tmp[..n].copy_from_slice(ctx.out.slice_mut((ctx.t0 + t) * w.cols + c, n));
            acc[t][0] = _mm256_loadu_ps(tmp.as_ptr());
            acc[t][1] = _mm256_loadu_ps(tmp.as_ptr().add(8));
        }
    }
    let mut p = w
        .data
        .as_ptr()
        .add(ctx.rows.start * row_bytes + bytes_of::<W>(c));
    let mut wpad = [0u8; 64];
    for i in 0..ctx.rows.len() {
        std::ptr::copy_nonoverlapping(p, wpad.as_mut_ptr(), bytes_of::<W>(n));
        let (w0, w1) = W::load16(wpad.as_ptr());
        for t in 0..NT {
            let a = _mm256_set1_ps(ctx.coef[i * NT + t]);
            acc[t][0] = _mm256_fmadd_ps(w0, a, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w1, a, acc[t][1]);
        }
        p = p.add(row_bytes);
    }
    for t in 0..NT {
        _mm256_storeu_ps(tmp.as_mut_ptr(), acc[t][0]);
        _mm256_storeu_ps(tmp.as_mut_ptr().add(8), acc[t][1]);
        ctx.out
            .slice_mut((ctx.t0 + t) * w.cols + c, n)
            .copy_from_slice(&tmp[..n]);
    }
}

#[cfg(test)]
mod prefetch_tests {
    use super::tile_prefetch_distance;

    #[test]
    fn prefetch_distance_is_whole_tiles_of_at_least_16_kib() {
        for tile in [1usize, 256, 2048, 4096, 5000, 16 * 1024, 32 * 1024, 100_000] {
            let d = tile_prefetch_distance(tile);
            assert_eq!(d % tile, 0, "tile {tile}: {d} is not whole tiles");
            assert!(d >= 16 * 1024, "tile {tile}: {d} is under 16 KiB");
            assert!(
                d - tile < 16 * 1024,
                "tile {tile}: {d} is a tile more than needed"
            );
        }
        assert_eq!(tile_prefetch_distance(0), 16 * 1024);
        assert_eq!(tile_prefetch_distance(32 * 1024), 32 * 1024);
        assert_eq!(tile_prefetch_distance(4096), 16 * 1024);
    }
}
