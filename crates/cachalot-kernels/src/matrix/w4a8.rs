//! W4A8 products (spec `deepseek-v4.md` §4.2 `w4a8-int`: "int4 weights `channel`, int8 `token`
//! activations", §4.4 the INT4 per-channel layout): 4-bit weights with one scale per output row
//! times int8 activations quantized per token on entry (the same dynamic symmetric quantization
//! as W8A8, `w8a8.rs`), accumulated exactly in i32:
//!
//!   out[t, r] = f32(Σ_c xq[t, c]·q[r, c]) · sw[r] · sx[t],  q = nibble − 8 ∈ [−8, 7]
//!
//! (evaluated as `(f32(acc) · sw[r]) · sx[t]`, W8A8's order). Weights are stored as
//! [`super::MatrixData::Int4Group`] stores them with one group per row: column c is the low
//! (even c) or high (odd c) nibble of byte c/2, offset binary.
//!
//! The sum is exact, so every level, tile and thread split gives the same bits. AVX2 splits 16
//! bytes into 32 nibbles in column order (mask, shift, `vpunpck{l,h}bw`), multiplies the
//! unsigned nibbles n ∈ [0, 15] by the signed activations with `vpmaddubsw` (pairs ≤ 2·15·127,
//! no i16 saturation), widens with `vpmaddwd`, and subtracts 8·Σ_c xq[t, c] once per (row,
//! token): Σ (n − 8)·x = Σ n·x − 8·Σ x. |acc| ≤ 8·127·cols stays in i32 for any real width.

use std::ops::Range;

use super::w8a8::QuantizedTokens;
use super::{OutRows, WeightsView};

/// q = nibble − 8 of column c of a packed row.
#[inline]
pub(crate) fn q_at(row: &[u8], c: usize) -> i32 {
    ((row[c / 2] >> (4 * (c % 2))) & 0x0F) as i32 - 8
}

#[inline]
pub(crate) fn weight_row<'a>(w: &'a WeightsView, r: usize) -> &'a [u8] {
    let rb = w.cols / 2;
    &w.data[r * rb..(r + 1) * rb]
}

/// `(f32(acc) · sw[r]) · sx`. Called once per output element, so forced inline (it was a
/// separate call of 3% of W8A8 decode time in a profile).
#[inline(always)]
pub(crate) fn finish(acc: i32, w: &WeightsView, r: usize, sx: f32) -> f32 {
    let sw = match w.scales {
        super::Scales::Row(s) => s[r],
        other => other.row(r).get(0),
    };
    (acc as f32 * sw) * sx
}

/// Exact Σ_{c in cols} q[c]·x[c].
#[inline]
pub(crate) fn dot_w4(row: &[u8], x: &[i8], cols: Range<usize>) -> i32 {
    cols.map(|c| q_at(row, c) * x[c] as i32).sum()
}

/// Scalar reference for rows `rows`, all tokens.
pub(crate) fn matmul_rows_scalar(
    w: &WeightsView,
    rows: Range<usize>,
    xq: &QuantizedTokens,
    n_tokens: usize,
    out: &OutRows,
) {
    for r in rows {
        let wr = weight_row(w, r);
        for t in 0..n_tokens {
            let acc = dot_w4(wr, xq.token(t), 0..w.cols);
            // SAFETY: row r is in this task's row range.
            unsafe { out.write(t, r, finish(acc, w, r, xq.scale[t])) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    #![allow(clippy::needless_range_loop)]

    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{dot_w4, finish, weight_row, QuantizedTokens};
    use crate::matrix::w8a8::avx2::hsum_i32;
    use crate::matrix::{OutRows, WeightsView};

    /// # Safety
    /// The CPU supports AVX2; `out` accepts writes for every row in `rows`; `xq` holds
    /// `n_tokens` tokens of `w.cols` values; `w` is an int4 view with even `cols`.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn matmul_rows(
        w: &WeightsView,
        rows: Range<usize>,
        xq: &QuantizedTokens,
        n_tokens: usize,
        out: &OutRows,
    ) {
        // Σ_c xq[t, c] over the columns the vector loop covers, per token.
        let full = w.cols / 32 * 32;
        let sums: Vec<i32> = (0..n_tokens)
            .map(|t| xq.token(t)[..full].iter().map(|&v| v as i32).sum())
            .collect();
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(4);
            match nt {
                1 => row_tiles::<4, 1>(w, rows.clone(), xq, &sums, t0, out),
                2 => row_tiles::<2, 2>(w, rows.clone(), xq, &sums, t0, out),
                3 => row_tiles::<1, 3>(w, rows.clone(), xq, &sums, t0, out),
                _ => row_tiles::<2, 4>(w, rows.clone(), xq, &sums, t0, out),
            }
            t0 += nt;
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn row_tiles<const R: usize, const NT: usize>(
        w: &WeightsView,
        rows: Range<usize>,
        xq: &QuantizedTokens,
        sums: &[i32],
        t0: usize,
        out: &OutRows,
    ) {
        let mut r = rows.start;
        while r + R <= rows.end {
            let acc = tile::<R, NT>(w, r, xq, sums, t0);
            for i in 0..R {
                for t in 0..NT {
                    let v = finish(acc[i][t], w, r + i, xq.scale[t0 + t]);
                    out.write(t0 + t, r + i, v);
                }
            }
            r += R;
        }
        while r < rows.end {
            let acc = tile::<1, NT>(w, r, xq, sums, t0);
            for t in 0..NT {
                out.write(t0 + t, r, finish(acc[0][t], w, r, xq.scale[t0 + t]));
            }
            r += 1;
        }
    }

    /// The 32 nibbles of the 16 bytes at `p` in column order, as unsigned bytes 0..=15.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles32(p: *const u8) -> __m256i {
        let v = _mm_loadu_si128(p as *const __m128i);
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(v, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), mask);
        _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi))
    }

    /// Exact i32 dot products of rows row0..row0+R with tokens t0..t0+NT.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn tile<const R: usize, const NT: usize>(
        w: &WeightsView,
        row0: usize,
        xq: &QuantizedTokens,
        sums: &[i32],
        t0: usize,
    ) -> [[i32; NT]; R] {
        let cols = w.cols;
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_si256(); NT]; R];
        let mut wp = [std::ptr::null::<u8>(); R];
        for i in 0..R {
            wp[i] = w.data.as_ptr().add((row0 + i) * (cols / 2));
        }
        let mut xp = [std::ptr::null::<i8>(); NT];
        for t in 0..NT {
            xp[t] = xq.token(t0 + t).as_ptr();
        }
        let full = cols / 32 * 32;
        let mut c = 0;
        while c < full {
            let mut xs = [_mm256_setzero_si256(); NT];
            for t in 0..NT {
                xs[t] = _mm256_loadu_si256(xp[t].add(c) as *const __m256i);
            }
            for i in 0..R {
                let n = nibbles32(wp[i].add(c / 2));
                for t in 0..NT {
                    let pairs = _mm256_maddubs_epi16(n, xs[t]);
                    acc[i][t] = _mm256_add_epi32(acc[i][t], _mm256_madd_epi16(pairs, ones));
                }
            }
            c += 32;
        }
        let mut res = [[0i32; NT]; R];
        for i in 0..R {
            let row = weight_row(w, row0 + i);
            for t in 0..NT {
                let x = xq.token(t0 + t);
                res[i][t] = hsum_i32(acc[i][t]) - 8 * sums[t0 + t] + dot_w4(row, x, full..cols);
            }
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use crate::matrix::w8a8::tests::{every_level_gives, levels, stream};
    use crate::matrix::{Matrix, MatrixData};

    /// A W4A8 matrix built from V4's INT4 layout (packed along N, two's complement), the int4
    /// values it holds (row-major), and activations.
    fn case(rows: usize, cols: usize, n_tokens: usize, seed: u64) -> (Matrix, Vec<i8>, Vec<f32>) {
        let mut next = stream(seed);
        let q: Vec<i8> = (0..rows * cols).map(|_| (next() % 16) as i8 - 8).collect();
        let mut packed = vec![0u8; rows / 2 * cols];
        for j in 0..rows / 2 {
            for c in 0..cols {
                let lo = q[2 * j * cols + c] as u8 & 0x0F;
                let hi = q[(2 * j + 1) * cols + c] as u8 & 0x0F;
                packed[j * cols + c] = lo | (hi << 4);
            }
        }
        let scale: Vec<f32> = (0..rows)
            .map(|_| 1e-3 + (next() >> 40) as f32 / (1u64 << 24) as f32 * 1e-2)
            .collect();
        let x: Vec<f32> = (0..n_tokens * cols)
            .map(|_| {
                let m = 0.05 + (next() >> 40) as f32 / (1u64 << 24) as f32;
                if next() & 1 == 0 {
                    m
                } else {
                    -m
                }
            })
            .collect();
        let data = MatrixData::w4a8_per_channel_packed_n(rows, cols, &packed, scale).unwrap();
        (Matrix::new(rows, cols, data).unwrap(), q, x)
    }

    /// Independent reference: quantize each token, sum exactly in i64.
    fn reference(m: &Matrix, q: &[i8], x: &[f32], n_tokens: usize) -> Vec<f32> {
        let MatrixData::W4A8 { scale, .. } = m.data() else {
            unreachable!()
        };
        let (rows, cols) = (m.rows(), m.cols());
        let mut out = vec![0.0f32; n_tokens * rows];
        for t in 0..n_tokens {
            let xt = &x[t * cols..(t + 1) * cols];
            let amax = xt.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let inv = 127.0 / amax;
            let xq: Vec<i64> = xt
                .iter()
                .map(|v| (v * inv).round_ties_even().clamp(-127.0, 127.0) as i64)
                .collect();
            for r in 0..rows {
                let w = &q[r * cols..(r + 1) * cols];
                let acc: i64 = w.iter().zip(&xq).map(|(&b, &v)| b as i64 * v).sum();
                out[t * rows + r] = (acc as i32 as f32 * scale[r]) * (amax / 127.0);
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn every_level_equals_the_exact_reference(
            half_rows in 1usize..20, half_cols in 1usize..150, n_tokens in 1usize..10,
            seed in any::<u64>()
        ) {
            let (rows, cols) = (2 * half_rows, 2 * half_cols);
            let (m, q, x) = case(rows, cols, n_tokens, seed);
            let want = reference(&m, &q, &x, n_tokens);
            every_level_gives(&m, &x, n_tokens, &want)?;
            // Dequantization: q · scale.
            let MatrixData::W4A8 { scale, .. } = m.data() else { unreachable!() };
            let deq = m.to_f32_vec();
            for (i, v) in deq.iter().enumerate() {
                prop_assert_eq!(v.to_bits(), (q[i] as f32 * scale[i / cols]).to_bits());
            }
            // Close to the f32 product of the dequantized weights: the activation rounding
            // error is at most sx/2 per element.
            let f = m.to_f32_matrix();
            let mut exact = vec![0.0f32; n_tokens * rows];
            f.matmul(&x, n_tokens, &mut exact);
            for t in 0..n_tokens {
                let xt = &x[t * cols..(t + 1) * cols];
                let sx = xt.iter().fold(0.0f32, |a, v| a.max(v.abs())) / 127.0;
                for r in 0..rows {
                    let l1: f32 = deq[r * cols..(r + 1) * cols].iter().map(|v| v.abs()).sum();
                    let bound = 0.5 * sx * l1 * 1.001 + 1e-5;
                    let d = (want[t * rows + r] - exact[t * rows + r]).abs();
                    prop_assert!(d <= bound, "t {} r {}: {} vs {} (bound {})", t, r,
                        want[t * rows + r], exact[t * rows + r], bound);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Products of 8 and more tokens, which take the AMX tiles where the CPU has them
        /// (nibbles unpacked to int8 tiles; ragged rows, columns and tokens), equal the exact
        /// reference bit for bit at every level.
        #[test]
        fn many_tokens_equal_the_exact_reference(
            half_rows in 1usize..36, half_cols in 1usize..150, n_tokens in 8usize..40,
            seed in any::<u64>()
        ) {
            let (rows, cols) = (2 * half_rows, 2 * half_cols);
            let (m, q, x) = case(rows, cols, n_tokens, seed);
            let want = reference(&m, &q, &x, n_tokens);
            every_level_gives(&m, &x, n_tokens, &want)?;
        }
    }

    #[test]
    fn extreme_values_stay_exact() {
        // q = −8 everywhere, x = ±127 over 4 096 columns (two rows).
        let (rows, cols) = (2, 4096);
        let packed = vec![0x88u8; cols];
        let data =
            MatrixData::w4a8_per_channel_packed_n(rows, cols, &packed, vec![1.0, 0.5]).unwrap();
        let m = Matrix::new(rows, cols, data).unwrap();
        let x = vec![-1.0f32; cols];
        for level in levels() {
            let mut out = [f32::NAN; 2];
            m.matmul_rows_at(level, 0..2, &x, 1, &mut out);
            let acc = (8 * 127 * cols) as f32;
            assert_eq!(out, [acc / 127.0, acc * 0.5 / 127.0], "{level:?}");
        }
    }
}
