//! NEON forward and transposed products for every float weight format on aarch64
//! (`SimdLevel::Neon`), bit for bit the x86 kernels' (`avx2.rs`, `avx512.rs`): a product gives
//! the same bits on an Arm server as on an x86 one (and so do the vector kernels around them,
//! `vector::neon`, so a model's logits are x86's).
//!
//! The operations are AVX2's, written in 128-bit registers: per (row, token) and column
//! segment, AVX2 keeps two 8-lane accumulators, a0 for columns c..c+8 of each 16-column chunk
//! and a1 for c+8..c+16, each a chain of fused multiply-adds; here a0 is two 4-lane registers
//! and a1 two more, and `vfmaq_f32` is the same fused operation lane by lane. At a segment's end
//! `total = fma(a0 + a1, scale·FACTOR, total)` in 8 lanes (two registers), and at the row's end
//! the 8 lanes are summed in AVX2's `hsum` order: ((t0+t4) + (t2+t6)) + ((t1+t5) + (t3+t7)).
//! Weights are decoded 16 at a time into exactly the values AVX2 decodes (the same
//! `FACTOR`s: FP8 through its f16 pattern as value·2^−8 with `fcvtl`, e2m1 as 2·value by a
//! table lookup, HiF8 through the decoding table), and a ragged segment end goes through the
//! same zero-padded copies. Tiles are AVX2's: 4 rows × 1 token, 2 × 2, 1 × 3 and 1 × 4, so a
//! token's result does not depend on the batch it came in.
//!
//! The transposed product (`matmul_t_cols`, MLA's absorption `W_UKᵀ q`) is AVX2's too: each
//! (token, column) one chain of fused multiply-adds over the rows in order.
//!
//! Checked against the scalar kernels (`scalar.rs`), which state these operations lane by lane
//! and which AVX2 and AVX-512 are checked against too (`tests.rs`); on x86-64 this file is
//! compiled and its tests run under `qemu-aarch64` (`tools/cross_aarch64.sh`). Not timed on an
//! Arm host.
//!
//! Spec: `deepseek-v3-r1-kimi-k2.md` §2.2 (FP8 block scales) and §4 (quantized formats),
//! `deepseek-v4.md` §4 (MXFP4, HiF8); the operations are those of the AVX2 module.

#![allow(clippy::needless_range_loop)] // parallel indexing of several const-size arrays

use std::arch::aarch64::*;
use std::arch::asm;
use std::ops::Range;

use super::scalar::segments;
use super::{tile_prefetch_distance, Format, OutRows, RowScales, WeightsView};
use crate::parallel::DisjointOut;

/// Decodes 16 consecutive stored weights into four 4-lane vectors (columns 0-3, 4-7, 8-11,
/// 12-15): AVX2's two 8-lane vectors, bit for bit.
trait Weights16 {
    /// Bytes holding 16 weights.
    const BYTES16: usize;
    /// Multiplied into the scale to undo the decoding's own scaling (AVX2's).
    const FACTOR: f32;
    /// # Safety
    /// `p` points at BYTES16 readable bytes.
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4];
}

struct F32W;
struct Bf16W;
struct F16W;
struct Fp8W;
struct Int8W;
struct Int4W;
struct Fp4W;
struct Hif8W;

impl Weights16 for F32W {
    const BYTES16: usize = 64;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4] {
        let p = p as *const f32;
        [
            vld1q_f32(p),
            vld1q_f32(p.add(4)),
            vld1q_f32(p.add(8)),
            vld1q_f32(p.add(12)),
        ]
    }
}

impl Weights16 for Bf16W {
    const BYTES16: usize = 32;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4] {
        let v0 = vld1q_u16(p as *const u16);
        let v1 = vld1q_u16(p.add(16) as *const u16);
        [
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(v0))),
            vreinterpretq_f32_u32(vshll_high_n_u16::<16>(v0)),
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(v1))),
            vreinterpretq_f32_u32(vshll_high_n_u16::<16>(v1)),
        ]
    }
}

/// Eight f16 patterns as f32 (exact, subnormals included), lanes 0-3 and 4-7: `fcvtl` and
/// `fcvtl2` (through `asm!`: the f16 vector types of the intrinsics are not stable Rust).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn f16x8_to_f32(h: uint16x8_t) -> [float32x4_t; 2] {
    let lo: float32x4_t;
    let hi: float32x4_t;
    // SAFETY: register-only conversions of baseline AArch64 Advanced SIMD.
    unsafe {
        asm!(
            "fcvtl {lo:v}.4s, {h:v}.4h",
            "fcvtl2 {hi:v}.4s, {h:v}.8h",
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            h = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    [lo, hi]
}

impl Weights16 for F16W {
    const BYTES16: usize = 32;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4] {
        let [a, b] = f16x8_to_f32(vld1q_u16(p as *const u16));
        let [c, d] = f16x8_to_f32(vld1q_u16(p.add(16) as *const u16));
        [a, b, c, d]
    }
}

/// Eight FP8 codes (sign-extended to 16 bits) as value · 2^−8: shifted left by 7 and bit 14
/// cleared, each is the f16 pattern ((b & 0x80) << 8) | ((b & 0x7F) << 7), as in `avx2::Fp8W`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn fp8x8_to_f32(b: int16x8_t) -> [float32x4_t; 2] {
    let h = vandq_s16(vshlq_n_s16::<7>(b), vdupq_n_s16(0xBFFFu16 as i16));
    f16x8_to_f32(vreinterpretq_u16_s16(h))
}

impl Weights16 for Fp8W {
    const BYTES16: usize = 16;
    const FACTOR: f32 = 256.0;
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4] {
        let b = vld1q_s8(p as *const i8);
        let [w0, w1] = fp8x8_to_f32(vmovl_s8(vget_low_s8(b)));
        let [w2, w3] = fp8x8_to_f32(vmovl_high_s8(b));
        [w0, w1, w2, w3]
    }
}

/// 16 signed bytes as f32, in order.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn i8x16_to_f32(q: int8x16_t) -> [float32x4_t; 4] {
    let lo = vmovl_s8(vget_low_s8(q));
    let hi = vmovl_high_s8(q);
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_high_s16(lo)),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_high_s16(hi)),
    ]
}

impl Weights16 for Int8W {
    const BYTES16: usize = 16;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4] {
        i8x16_to_f32(vld1q_s8(p as *const i8))
    }
}

/// The 16 nibbles of the 8 bytes at `p` in column order: byte k holds columns 2k (low nibble)
/// and 2k+1 (high nibble).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn nibbles16(p: *const u8) -> uint8x16_t {
    let v = vld1_u8(p);
    let lo = vand_u8(v, vdup_n_u8(0x0F));
    let hi = vshr_n_u8::<4>(v);
    vcombine_u8(vzip1_u8(lo, hi), vzip2_u8(lo, hi))
}

impl Weights16 for Int4W {
    const BYTES16: usize = 8;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4] {
        // Nibble n means n - 8.
        let q = vsubq_s8(vreinterpretq_s8_u8(nibbles16(p)), vdupq_n_s8(8));
        i8x16_to_f32(q)
    }
}

impl Weights16 for Fp4W {
    const BYTES16: usize = 8;
    const FACTOR: f32 = 0.5;
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4] {
        // Each e2m1 code to twice its value as an int8 (exact: 0, 1, ..., 12), as AVX2's table.
        const LUT: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
        let lut = vld1q_s8(LUT.as_ptr());
        i8x16_to_f32(vqtbl1q_s8(lut, nibbles16(p)))
    }
}

impl Weights16 for Hif8W {
    const BYTES16: usize = 16;
    const FACTOR: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4] {
        // The 256-entry decoding table, one lookup per weight (AVX2 gathers from it).
        let table = crate::hif8::hif8_table();
        let mut v = [0.0f32; 16];
        for (j, o) in v.iter_mut().enumerate() {
            *o = table[*p.add(j) as usize];
        }
        F32W::load16(v.as_ptr() as *const u8)
    }
}

/// Bytes holding `n` weights (a partial byte counts: int4 tails).
#[inline]
fn bytes_of<W: Weights16>(n: usize) -> usize {
    (n * W::BYTES16).div_ceil(16)
}

/// Prefetch the line at `base + offset` into L2 (as `avx2::prefetch_tile_ahead`); the address
/// may lie past the matrix.
#[inline(always)]
pub(crate) fn prefetch_tile_ahead(base: *const u8, offset: usize) {
    let p = base.wrapping_add(offset);
    // SAFETY: `prfm` has no architectural effect beyond the caches and never faults; the
    // pointer is not dereferenced.
    unsafe { asm!("prfm pldl2keep, [{0}]", in(reg) p, options(nostack, preserves_flags, readonly)) }
}

/// The forward product for rows `rows` (all tokens), written through `out`.
///
/// # Safety
/// The CPU supports NEON (every aarch64 CPU); `w` is a validated view; `out` accepts writes for
/// every row in `rows`.
#[target_feature(enable = "neon")]
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

/// Weight bytes per row block (as in AVX2).
const L2_BLOCK_BYTES: usize = 128 * 1024;

#[target_feature(enable = "neon")]
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

/// Tokens t0..t0+NT for every row in `rows`, R rows at a time (then single rows).
#[inline]
#[target_feature(enable = "neon")]
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
        for t in 0..NT {
            let dst = out.rows_mut(t0 + t, r, R);
            for i in 0..R {
                dst[i] = res[i][t];
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

/// AVX2's `hsum` of the 8 lanes (lo: 0-3, hi: 4-7): ((t0+t4) + (t2+t6)) + ((t1+t5) + (t3+t7)).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn hsum8(lo: float32x4_t, hi: float32x4_t) -> f32 {
    let s = vaddq_f32(lo, hi);
    let p = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    vget_lane_f32::<0>(p) + vget_lane_f32::<1>(p)
}

/// Rows row0..row0+R times the NT token vectors at `xs` (each `w.cols` long): AVX2's `tile`.
#[inline]
#[target_feature(enable = "neon")]
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
    let zero = vdupq_n_f32(0.0);
    // The running totals (8 lanes each) live in memory, touched once per segment, so that the
    // accumulators keep the registers (as in `avx512::tile`). Same operations, same bits.
    let mut total = [[[zero; 2]; NT]; R];
    let mut c0 = 0;
    let mut segment = 0;
    while c0 < cols {
        let c1 = (c0 + w.segment_cols).min(cols);
        // acc[..][..][0..2] is AVX2's a0 (lanes 0-3, 4-7), [2..4] its a1.
        let mut acc = [[[zero; 4]; NT]; R];
        let mut c = c0;
        let mut wo = bytes_of::<W>(c0);
        while c + 16 <= c1 {
            for i in 0..R {
                if wo.is_multiple_of(64) {
                    prefetch_tile_ahead(wp[i], ahead + wo);
                }
                let wv = W::load16(wp[i].add(wo));
                for t in 0..NT {
                    let xp = xs[t].add(c);
                    for q in 0..4 {
                        acc[i][t][q] = vfmaq_f32(acc[i][t][q], wv[q], vld1q_f32(xp.add(4 * q)));
                    }
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
                let wv = W::load16(wpad.as_ptr());
                for t in 0..NT {
                    let xp = xpad[t].as_ptr();
                    for q in 0..4 {
                        acc[i][t][q] = vfmaq_f32(acc[i][t][q], wv[q], vld1q_f32(xp.add(4 * q)));
                    }
                }
            }
        }
        for i in 0..R {
            let scale = vdupq_n_f32(row_scales[i].get(segment) * W::FACTOR);
            for t in 0..NT {
                let a = &acc[i][t];
                let p = std::ptr::addr_of_mut!(total[i][t]);
                // SAFETY: `p` points at a live, aligned local.
                let [lo, hi] = std::ptr::read_volatile(p);
                let lo = vfmaq_f32(lo, vaddq_f32(a[0], a[2]), scale);
                let hi = vfmaq_f32(hi, vaddq_f32(a[1], a[3]), scale);
                std::ptr::write_volatile(p, [lo, hi]);
            }
        }
        c0 = c1;
        segment += 1;
    }
    let mut res = [[0.0f32; NT]; R];
    for i in 0..R {
        for t in 0..NT {
            let [lo, hi] = total[i][t];
            res[i][t] = hsum8(lo, hi);
        }
    }
    res
}

/// The transposed product `out[t, c] = Σ_i x[t, i]·W[rows.start + i, c]` for the columns `cols`
/// (all tokens), written through `out`: AVX2's `transposed`, each (token, column) one chain of
/// fused multiply-adds over the rows in order from zero, with the coefficient
/// `x·(scale·FACTOR)`. Where AVX2 parks its accumulators in `out` between passes of 16 rows, a
/// chunk of up to 64 columns here walks all the rows at once (a stored f32 reloads exactly, so
/// the bits are the same).
///
/// # Safety
/// As [`matmul_rows`]; `out` accepts writes for `out[t*w.cols + c]`, c in `cols`.
#[target_feature(enable = "neon")]
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

/// Arguments shared by the transposed kernels.
struct TCtx<'a, 'b> {
    w: &'a WeightsView<'a>,
    /// The task's rows (absolute).
    rows: Range<usize>,
    /// coef[i*NT + t] = x[t0+t, i] · scale · FACTOR for the current segment.
    coef: &'a [f32],
    t0: usize,
    out: &'a DisjointOut<'b>,
}

#[target_feature(enable = "neon")]
unsafe fn transposed<W: Weights16>(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    cols: Range<usize>,
    out: &DisjointOut,
) {
    let m = rows.len();
    let mut coef = vec![0.0f32; m * 4];
    for (segment, seg) in segments(w, cols.clone()) {
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(4);
            for i in 0..m {
                let scale = w.scales.row(rows.start + i).get(segment) * W::FACTOR;
                for t in 0..nt {
                    coef[i * nt + t] = x[(t0 + t) * m + i] * scale;
                }
            }
            let ctx = TCtx {
                w,
                rows: rows.clone(),
                coef: &coef[..m * nt],
                t0,
                out,
            };
            // 16 accumulators at most: 4 chunks of 16 columns for one token, fewer for more.
            match nt {
                1 => segment_chunks::<W, 1, 4>(&ctx, seg.clone()),
                2 => segment_chunks::<W, 2, 2>(&ctx, seg.clone()),
                3 => segment_chunks::<W, 3, 1>(&ctx, seg.clone()),
                _ => segment_chunks::<W, 4, 1>(&ctx, seg.clone()),
            }
            t0 += nt;
        }
    }
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn segment_chunks<W: Weights16, const NT: usize, const NC: usize>(
    ctx: &TCtx,
    seg: Range<usize>,
) {
    let mut c = seg.start;
    while c + NC * 16 <= seg.end {
        t_chunk::<W, NT, NC>(ctx, c);
        c += NC * 16;
    }
    while c + 16 <= seg.end {
        t_chunk::<W, NT, 1>(ctx, c);
        c += 16;
    }
    if c < seg.end {
        t_ragged::<W, NT>(ctx, c, seg.end - c);
    }
}

/// Rows ahead of the current one whose lines the transposed walk prefetches.
const T_AHEAD_ROWS: usize = 8;

/// Columns c..c+16·NC for tokens t0..t0+NT over all the task's rows.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn t_chunk<W: Weights16, const NT: usize, const NC: usize>(ctx: &TCtx, c: usize) {
    let w = ctx.w;
    let row_bytes = bytes_of::<W>(w.cols);
    let zero = vdupq_n_f32(0.0);
    let mut acc = [[[zero; 4]; NC]; NT];
    let mut p = w
        .data
        .as_ptr()
        .add(ctx.rows.start * row_bytes + bytes_of::<W>(c));
    for i in 0..ctx.rows.len() {
        let mut off = 0;
        while off < NC * W::BYTES16 {
            prefetch_tile_ahead(p, T_AHEAD_ROWS * row_bytes + off);
            off += 64;
        }
        let mut a = [zero; NT];
        for t in 0..NT {
            a[t] = vdupq_n_f32(*ctx.coef.get_unchecked(i * NT + t));
        }
        for k in 0..NC {
            let wv = W::load16(p.add(k * W::BYTES16));
            for t in 0..NT {
                for q in 0..4 {
                    acc[t][k][q] = vfmaq_f32(acc[t][k][q], wv[q], a[t]);
                }
            }
        }
        p = p.add(row_bytes);
    }
    for t in 0..NT {
        let o = ctx
            .out
            .slice_mut((ctx.t0 + t) * w.cols + c, NC * 16)
            .as_mut_ptr();
        for k in 0..NC {
            for q in 0..4 {
                vst1q_f32(o.add(k * 16 + 4 * q), acc[t][k][q]);
            }
        }
    }
}

/// Columns c..c+n (n < 16) at a segment's end, through zero-padded copies.
#[target_feature(enable = "neon")]
unsafe fn t_ragged<W: Weights16, const NT: usize>(ctx: &TCtx, c: usize, n: usize) {
    let w = ctx.w;
    let row_bytes = bytes_of::<W>(w.cols);
    let zero = vdupq_n_f32(0.0);
    let mut acc = [[zero; 4]; NT];
    let mut p = w
        .data
        .as_ptr()
        .add(ctx.rows.start * row_bytes + bytes_of::<W>(c));
    let mut wpad = [0u8; 64];
    for i in 0..ctx.rows.len() {
        std::ptr::copy_nonoverlapping(p, wpad.as_mut_ptr(), bytes_of::<W>(n));
        let wv = W::load16(wpad.as_ptr());
        for t in 0..NT {
            let a = vdupq_n_f32(ctx.coef[i * NT + t]);
            for q in 0..4 {
                acc[t][q] = vfmaq_f32(acc[t][q], wv[q], a);
            }
        }
        p = p.add(row_bytes);
    }
    let mut tmp = [0.0f32; 16];
    for t in 0..NT {
        for q in 0..4 {
            vst1q_f32(tmp.as_mut_ptr().add(4 * q), acc[t][q]);
        }
        ctx.out
            .slice_mut((ctx.t0 + t) * w.cols + c, n)
            .copy_from_slice(&tmp[..n]);
    }
}
