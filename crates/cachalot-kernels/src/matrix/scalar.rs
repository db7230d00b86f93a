//! Scalar matrix kernels: the reference for the SIMD kernels, the fallback elsewhere, and the
//! exact dequantization used by `row_to_f32` / `to_f32_vec`.
//!
//! Weights are decoded to their exact values (FP8 through the table, int8/int4 as integers) one
//! row at a time into a buffer that every token of the call then reuses; scales are applied per
//! column segment, as in the SIMD kernels.

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

/// The forward product for rows `rows` (all tokens), written through `out`.
pub(crate) fn matmul_rows(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    out: &OutRows,
) {
    let mut buf = vec![0.0f32; w.cols];
    for r in rows {
        decode_row(w, r, 0..w.cols, &mut buf);
        let row_scales = w.scales.row(r);
        for t in 0..n_tokens {
            let xt = &x[t * w.cols..(t + 1) * w.cols];
            let mut total = 0.0f32;
            for (s, seg) in segments(w, 0..w.cols) {
                let partial = scalar::dot(&buf[seg.clone()], &xt[seg]);
                total += partial * row_scales.get(s);
            }
            // SAFETY: row r is in this task's row range.
            unsafe { out.write(t, r, total) };
        }
    }
}

/// The transposed product for output columns `cols` (all tokens): out[t*w.cols + c] =
/// Σ_{r in rows} W[r,c]·x[t*rows.len() + r - rows.start], accumulated over r in order.
pub(crate) fn matmul_t_cols(
    w: &WeightsView,
    rows: Range<usize>,
    x: &[f32],
    n_tokens: usize,
    cols: Range<usize>,
    out: &DisjointOut,
) {
    let m = rows.len();
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
        let row_scales = w.scales.row(r);
        for (s, seg) in segments(w, cols.clone()) {
            let local = seg.start - cols.start..seg.end - cols.start;
            for (t, o) in outs.iter_mut().enumerate() {
                let a = x[t * m + i] * row_scales.get(s);
                for (o, wv) in o[local.clone()].iter_mut().zip(&buf[local.clone()]) {
                    *o += wv * a;
                }
            }
        }
    }
}
