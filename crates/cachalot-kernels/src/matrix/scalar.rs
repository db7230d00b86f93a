//! Scalar matrix kernels: the reference for the SIMD kernels, the fallback elsewhere, and the
//! exact dequantization used by `row_to_f32` / `to_f32_vec`.
//!
//! Weights are decoded to their exact values (FP8 through the table, int8/int4 as integers) one
//! row at a time into a buffer that every token of the call then reuses. The products do the
//! SIMD kernels' operations lane by lane (AVX2's, which AVX-512 and NEON repeat), so every level
//! on every architecture gives the same bits (`matrix/tests.rs` checks it).

use std::ops::Range;

use super::{Format, OutRows, Scales, WeightsView};
use crate::fp8::e4m3_to_f32;
use crate::hif8::hif8_to_f32;
use crate::mx::e2m1_to_f32;
use crate::parallel::DisjointOut;
use crate::vector::scalar;
use crate::{bf16_to_f32, f16_to_f32};

/// The exact stored values W_stored[r, cols] (before any scale) into `out`.
pub(crate) fn decode_row(w: &WeightsView, r: usize, cols: Range<usize>, out: &mut [f32]) {
    let first = r * w.cols + cols.start;
    let n = cols.len();
    match w.format {
        Format::F32 => {
            for (o, b) in out
                .iter_mut()
                .zip(w.data[4 * first..4 * (first + n)].chunks_exact(4))
            {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Format::Bf16 => {
            for (o, b) in out
                .iter_mut()
                .zip(w.data[2 * first..2 * (first + n)].chunks_exact(2))
            {
                *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        Format::F16 => {
            for (o, b) in out
                .iter_mut()
                .zip(w.data[2 * first..2 * (first + n)].chunks_exact(2))
            {
                *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        Format::Fp8 | Format::Mxfp8 => {
            for (o, &b) in out.iter_mut().zip(&w.data[first..first + n]) {
                *o = e4m3_to_f32(b);
            }
        }
        Format::Int8 => {
            for (o, &b) in out.iter_mut().zip(&w.data[first..first + n]) {
                *o = b as i8 as f32;
            }
        }
        Format::Int4 => {
            for (j, o) in out[..n].iter_mut().enumerate() {
                let e = first + j;
                let nibble = (w.data[e / 2] >> (4 * (e % 2))) & 0x0F;
                *o = (nibble as i32 - 8) as f32;
            }
        }
        Format::Fp4 => {
            for (j, o) in out[..n].iter_mut().enumerate() {
                let e = first + j;
                *o = e2m1_to_f32(w.data[e / 2] >> (4 * (e % 2)));
            }
        }
        Format::Hif8 => {
            for (o, &b) in out.iter_mut().zip(&w.data[first..first + n]) {
                *o = hif8_to_f32(b);
            }
        }
    }
}

/// The column segments (`segment index`, columns) that intersect `cols`.
pub(crate) fn segments(
    w: &WeightsView,
    cols: Range<usize>,
) -> impl Iterator<Item = (usize, Range<usize>)> {
    let seg = w.segment_cols;
    let first = cols.start / seg;
    let last = if cols.is_empty() {
        first
    } else {
        (cols.end - 1) / seg + 1
    };
    (first..last).map(move |s| (s, (s * seg).max(cols.start)..((s + 1) * seg).min(cols.end)))
}

/// Dequantized W[r, cols] = stored value · scale, in f32.
pub(crate) fn dequantize_row(w: &WeightsView, r: usize, cols: Range<usize>, out: &mut [f32]) {
    decode_row(w, r, cols.clone(), out);
    if matches!(w.scales, Scales::One) {
        return;
    }
    let row_scales = w.scales.row(r);
    for (s, seg) in segments(w, cols.clone()) {
        let scale = row_scales.get(s);
        for v in &mut out[seg.start - cols.start..seg.end - cols.start] {
            *v *= scale;
        }
    }
}

/// The decoding's own scale, as the SIMD kernels decode (`avx2::Weights16::FACTOR`): FP8
/// through its f16 pattern is value·2^−8, e2m1 through a table 2·value; the kernels multiply
/// the factor back into the scale.
pub(crate) fn simd_factor(format: Format) -> f32 {
    match format {
        Format::Fp8 | Format::Mxfp8 => 256.0,
        Format::Fp4 => 0.5,
        _ => 1.0,
    }
}

/// The forward product for rows `rows` (all tokens), written through `out`: the SIMD kernels'
/// operations (AVX2's, which AVX-512 and NEON repeat), lane by lane, so every level gives the
/// same bits. Per (row, token) and column segment, two 8-lane accumulators of fused
/// multiply-adds over 16-column chunks from the segment's first column (a0 the chunk's first 8
/// columns, a1 its last 8; zeros past the segment's end), folded into an 8-lane total as
/// `fma(a0 + a1, scale·FACTOR, total)`, the 8 lanes summed in AVX2's `hsum` order. Weights
/// enter as the kernels decode them: the stored value divided by [`simd_factor`] (a power of
/// two, so exact).
pub(crate) fn matmul_rows(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    out: &OutRows,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has FMA (checked above).
        return unsafe { matmul_rows_fma(w, rows, x, n_tokens, out) };
    }
    matmul_rows_body(w, rows, x, n_tokens, out)
}

/// [`matmul_rows`] compiled with FMA, where `mul_add` is one instruction (and the lane loops
/// vectorize) instead of a call to libm's `fmaf`: the same operations, so the same bits.
///
/// # Safety
/// The CPU has FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn matmul_rows_fma(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    out: &OutRows,
) {
    matmul_rows_body(w, rows, x, n_tokens, out)
}

#[inline(always)]
fn matmul_rows_body(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    out: &OutRows,
) {
    let cols = w.cols;
    let factor = simd_factor(w.format);
    let mut buf = vec![0.0f32; cols];
    for r in rows {
        decode_row(w, r, 0..cols, &mut buf);
        for v in buf.iter_mut() {
            *v /= factor;
        }
        let row_scales = w.scales.row(r);
        for t in 0..n_tokens {
            let xt = &x[t * cols..(t + 1) * cols];
            let mut total = [0.0f32; 8];
            for (s, seg) in segments(w, 0..cols) {
                let (mut a0, mut a1) = ([0.0f32; 8], [0.0f32; 8]);
                let mut c = seg.start;
                while c + 16 <= seg.end {
                    for j in 0..8 {
                        a0[j] = buf[c + j].mul_add(xt[c + j], a0[j]);
                        a1[j] = buf[c + 8 + j].mul_add(xt[c + 8 + j], a1[j]);
                    }
                    c += 16;
                }
                if c < seg.end {
                    // The ragged chunk: zeros past the segment's end.
                    for j in 0..8 {
                        let (wa, xa) = lane(&buf, xt, c + j, seg.end);
                        a0[j] = wa.mul_add(xa, a0[j]);
                        let (wb, xb) = lane(&buf, xt, c + 8 + j, seg.end);
                        a1[j] = wb.mul_add(xb, a1[j]);
                    }
                }
                let scale = row_scales.get(s) * factor;
                for j in 0..8 {
                    total[j] = (a0[j] + a1[j]).mul_add(scale, total[j]);
                }
            }
            // SAFETY: row r is in this task's row range.
            unsafe { out.write(t, r, scalar::hsum8(total)) };
        }
    }
}

/// Column c's decoded weight and activation, or zeros past the segment's end `end`.
#[inline]
fn lane(w: &[f32], x: &[f32], c: usize, end: usize) -> (f32, f32) {
    if c < end {
        (w[c], x[c])
    } else {
        (0.0, 0.0)
    }
}

/// The transposed product for output columns `cols` (all tokens): out[t*w.cols + c] =
/// Σ_{r in rows} W[r,c]·x[t*rows.len() + r - rows.start], as the SIMD kernels compute it: per
/// (token, column) one chain of fused multiply-adds over the rows in order from zero, of the
/// decoded weight (value / [`simd_factor`]) and the coefficient `x·(scale·FACTOR)`.
pub(crate) fn matmul_t_cols(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    cols: Range<usize>,
    out: &DisjointOut,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has FMA (checked above).
        return unsafe { matmul_t_cols_fma(w, rows, x, n_tokens, cols, out) };
    }
    matmul_t_cols_body(w, rows, x, n_tokens, cols, out)
}

/// [`matmul_t_cols`] compiled with FMA (as [`matmul_rows_fma`]).
///
/// # Safety
/// The CPU has FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn matmul_t_cols_fma(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    cols: Range<usize>,
    out: &DisjointOut,
) {
    matmul_t_cols_body(w, rows, x, n_tokens, cols, out)
}

#[inline(always)]
fn matmul_t_cols_body(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    cols: Range<usize>,
    out: &DisjointOut,
) {
    let m = rows.len();
    let factor = simd_factor(w.format);
    let mut buf = vec![0.0f32; cols.len()];
    // SAFETY: this task owns out[t*w.cols + c] for c in `cols` (disjoint from other tasks).
    let mut outs: Vec<&mut [f32]> = (0..n_tokens)
        .map(|t| unsafe { out.slice_mut(t * w.cols + cols.start, cols.len()) })
        .collect();
    for o in outs.iter_mut() {
        o.fill(0.0);
    }
    // Row after row (what prefetchers follow); each column still sums over r in order.
    for (i, r) in rows.enumerate() {
        decode_row(w, r, cols.clone(), &mut buf);
        for v in buf.iter_mut() {
            *v /= factor;
        }
        let row_scales = w.scales.row(r);
        for (s, seg) in segments(w, cols.clone()) {
            let local = seg.start - cols.start..seg.end - cols.start;
            let scale = row_scales.get(s) * factor;
            for (t, o) in outs.iter_mut().enumerate() {
                let a = x[t * m + i] * scale;
                for (o, wv) in o[local.clone()].iter_mut().zip(&buf[local.clone()]) {
                    *o = wv.mul_add(a, *o);
                }
            }
        }
    }
}
