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
//! The sum is exact, so every level, tile and thread split gives the same bits, whatever order
//! the x86 kernels add in. They never put nibbles back in column order: since low nibbles are
//! the even columns and high nibbles the odd ones, each call splits the activations once into
//! even and odd columns ([`Split`]), and a step is a load, a mask, a shift and a mask per row
//! (unsigned nibbles n ∈ [0, 15]) plus two dot steps per token; 8·Σ_c xq[t, c] is subtracted
//! once per (row, token): Σ (n − 8)·x = Σ n·x − 8·Σ x. |acc| ≤ 8·127·cols stays in i32 for any
//! real width. The dot step is `vpmaddubsw` (pairs ≤ 2·15·127, no i16 saturation), `vpmaddwd`
//! and `vpaddd` on AVX2, one `vpdpbusd` with AVX-VNNI (the same kernel written once by
//! `w4a8_x86_kernel!`, AVX-VNNI taken at the AVX2 level where the CPU has it;
//! `CACHALOT_AVX_VNNI=0` keeps the plain AVX2 one), and AVX-512 has its own VNNI kernel
//! (`avx512`, 128 columns a step).

use std::ops::Range;

use super::w8a8::finish;
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

/// A call's activations (all its tokens) split by column parity, for the x86 kernels: low
/// nibbles are the even columns and high nibbles the odd ones, so instead of interleaving the
/// nibbles back into column order, token t's even columns go to `even[t·half..]` and its odd
/// ones to `odd[t·half..]` (half = cols / 2), once per call. Also 8·Σ_c x[t, c], what the −8 of
/// every nibble takes off token t's sums.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Split {
    even: Vec<i8>,
    odd: Vec<i8>,
    half: usize,
    offset: Vec<i32>,
}

#[cfg(target_arch = "x86_64")]
impl Split {
    /// The split of `xq`, made once per call (`xq.w4_split`: by `Acts::prepare` before the
    /// row tasks start, else by the first task that asks). `avx512`: the CPU supports the
    /// `Avx512` level, else AVX2 (required).
    pub(crate) fn of(xq: &QuantizedTokens, avx512: bool) -> &Split {
        // SAFETY: the callers' levels checked the features.
        xq.w4_split.get_or_init(|| unsafe {
            if avx512 {
                Split::new_avx512(xq)
            } else {
                Split::new_avx2(xq)
            }
        })
    }

    fn empty(xq: &QuantizedTokens) -> (Split, usize) {
        let n_tokens = xq.scale.len();
        let half = xq.cols / 2;
        let split = Split {
            even: vec![0i8; n_tokens * half],
            odd: vec![0i8; n_tokens * half],
            half,
            offset: Vec::with_capacity(n_tokens),
        };
        (split, n_tokens)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    unsafe fn new_avx512(xq: &QuantizedTokens) -> Split {
        use std::arch::x86_64::*;
        let (mut s, n_tokens) = Split::empty(xq);
        let half = s.half;
        let ones = _mm512_set1_epi8(1);
        for t in 0..n_tokens {
            let x = xq.token(t);
            let (e, o) = (
                s.even.as_mut_ptr().add(t * half),
                s.odd.as_mut_ptr().add(t * half),
            );
            let mut sum = _mm512_setzero_si512();
            let mut k = 0;
            while k < half {
                // 32 column pairs as u16 lanes: the low byte is the even column.
                let n = (half - k).min(32);
                let m: __mmask64 = if n == 32 { !0 } else { (1u64 << (2 * n)) - 1 };
                let v = _mm512_maskz_loadu_epi8(m, x.as_ptr().add(2 * k));
                sum = _mm512_dpbusd_epi32(sum, ones, v);
                let lanes: __mmask32 = if n == 32 { !0 } else { (1u32 << n) - 1 };
                _mm512_mask_cvtepi16_storeu_epi8(e.add(k), lanes, v);
                _mm512_mask_cvtepi16_storeu_epi8(o.add(k), lanes, _mm512_srai_epi16::<8>(v));
                k += 32;
            }
            s.offset.push(8 * _mm512_reduce_add_epi32(sum));
        }
        s
    }

    #[target_feature(enable = "avx2")]
    unsafe fn new_avx2(xq: &QuantizedTokens) -> Split {
        use std::arch::x86_64::*;
        let (mut s, n_tokens) = Split::empty(xq);
        let half = s.half;
        // Within each 128-bit lane: the 8 even bytes, then the 8 odd ones.
        let order = _mm256_setr_epi8(
            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3,
            5, 7, 9, 11, 13, 15,
        );
        for t in 0..n_tokens {
            let x = xq.token(t);
            let (e, o) = (&mut s.even[t * half..], &mut s.odd[t * half..]);
            let mut k = 0;
            while k + 16 <= half {
                let v = _mm256_loadu_si256(x.as_ptr().add(2 * k) as *const __m256i);
                // Lanes [e0 o0 | e1 o1] (8 bytes each) → [e0 e1 | o0 o1].
                let g = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(v, order));
                _mm_storeu_si128(
                    e.as_mut_ptr().add(k) as *mut __m128i,
                    _mm256_castsi256_si128(g),
                );
                _mm_storeu_si128(
                    o.as_mut_ptr().add(k) as *mut __m128i,
                    _mm256_extracti128_si256::<1>(g),
                );
                k += 16;
            }
            for j in k..half {
                e[j] = x[2 * j];
                o[j] = x[2 * j + 1];
            }
            s.offset.push(8 * x.iter().map(|&v| v as i32).sum::<i32>());
        }
        s
    }
}

/// The AVX2-width kernel, written once for two instruction sets: `$features` are the target
/// features of every function, `$dot` adds the 4-byte products of unsigned nibbles and signed
/// activations into i32 lanes (`vpmaddubsw` + `vpmaddwd` + `vpaddd` on AVX2, one `vpdpbusd` with
/// AVX-VNNI). 64 columns (32 packed bytes) per step over the [`Split`] activations: a load, two
/// masks and a shift for the weights, two dot steps per token. The ragged end goes through
/// zero-padded copies (x = 0 adds nothing).
#[cfg(target_arch = "x86_64")]
macro_rules! w4a8_x86_kernel {
    ($module:ident, $features:literal, $dot:ident) => {
        pub(crate) mod $module {
            #![allow(clippy::needless_range_loop)]

            use std::arch::x86_64::*;
            use std::ops::Range;

            use crate::matrix::w4a8::Split;
            use crate::matrix::w8a8::avx2::hsum_tile;
            use crate::matrix::w8a8::{emit_row_tiles, finish8, QuantizedTokens};
            use crate::matrix::{OutRows, Scales, WeightsView};

            /// # Safety
            /// The CPU has the module's target features; `out` accepts writes for every row in
            /// `rows`; `xq` holds `n_tokens` tokens of `w.cols` values; `w` is an int4 view with
            /// even `cols`.
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn matmul_rows(
                w: &WeightsView,
                rows: Range<usize>,
                xq: &QuantizedTokens,
                n_tokens: usize,
                out: &OutRows,
            ) {
                let x = Split::of(xq, false);
                assert!(
                    n_tokens <= x.offset.len(),
                    "W4A8: {n_tokens} tokens of {}",
                    x.offset.len()
                );
                let mut t0 = 0;
                while t0 < n_tokens {
                    let nt = (n_tokens - t0).min(4);
                    match nt {
                        1 => row_tiles_1(w, rows.clone(), xq, x, t0, out),
                        2 => row_tiles::<2, 2>(w, rows.clone(), xq, x, t0, out),
                        3 => row_tiles::<1, 3>(w, rows.clone(), xq, x, t0, out),
                        _ => row_tiles::<2, 4>(w, rows.clone(), xq, x, t0, out),
                    }
                    t0 += nt;
                }
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn row_tiles<const R: usize, const NT: usize>(
                w: &WeightsView,
                rows: Range<usize>,
                xq: &QuantizedTokens,
                x: &Split,
                t0: usize,
                out: &OutRows,
            ) {
                let offset: [i32; NT] = std::array::from_fn(|t| x.offset[t0 + t]);
                let tile_r = |r| tile::<R, NT>(w, r, x, t0);
                let single = |r| tile::<1, NT>(w, r, x, t0)[0];
                emit_row_tiles(w, rows, xq, t0, &offset, out, tile_r, single);
            }

            /// [`tile_acc`]'s sums reduced to one i32 each.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn tile<const R: usize, const NT: usize>(
                w: &WeightsView,
                row0: usize,
                x: &Split,
                t0: usize,
            ) -> [[i32; NT]; R] {
                hsum_tile(&tile_acc::<R, NT>(w, row0, x, t0))
            }

            /// One token, rows in tiles of 8 reduced together and finished as one vector
            /// (`w8a8::finish8`: the operations of `finish` in its order, the same bits).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn row_tiles_1(
                w: &WeightsView,
                rows: Range<usize>,
                xq: &QuantizedTokens,
                x: &Split,
                t0: usize,
                out: &OutRows,
            ) {
                // Past 2048 columns the per-output reduction hardly counts, and 4 rows at a
                // time stream faster (4096 columns: 5-10% in `matmul_throughput`).
                let (Scales::Row(row_scale), true) = (w.scales, w.cols <= 2048) else {
                    return row_tiles::<4, 1>(w, rows, xq, x, t0, out);
                };
                let mut r = rows.start;
                while r + 8 <= rows.end {
                    let acc = tile_acc::<8, 1>(w, r, x, t0);
                    let h: [__m256i; 8] = std::array::from_fn(|i| acc[i][0]);
                    let v = finish8(&h, x.offset[t0], &row_scale[r..r + 8], xq.scale[t0]);
                    _mm256_storeu_ps(out.rows_mut(t0, r, 8).as_mut_ptr(), v);
                    r += 8;
                }
                if r < rows.end {
                    row_tiles::<4, 1>(w, r..rows.end, xq, x, t0, out);
                }
            }

            /// Σ_c n[r, c]·x[t, c] (nibbles unsigned, before the −8) for rows row0..row0+R, tokens
            /// t0..t0+NT, spread over the 8 lanes of each accumulator.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn tile_acc<const R: usize, const NT: usize>(
                w: &WeightsView,
                row0: usize,
                x: &Split,
                t0: usize,
            ) -> [[__m256i; NT]; R] {
                let half = x.half;
                let low = _mm256_set1_epi8(0x0F);
                let mut acc = [[_mm256_setzero_si256(); NT]; R];
                let mut wp = [std::ptr::null::<u8>(); R];
                for i in 0..R {
                    wp[i] = w.data.as_ptr().add((row0 + i) * half);
                }
                let ahead = crate::matrix::avx2::tile_prefetch_distance(R * half);
                // One step: 32 packed bytes of each row against 32 even and 32 odd columns of
                // each token, read where `xe[t]`/`xo[t]` point (from memory at each use: held
                // in registers beside the accumulators they made the 2 × 4 tile spill).
                // One step: 32 packed bytes of each row (read where `wr[i]` points, when the
                // row's turn comes: eight rows' vectors loaded up front spilled the 8-row tile)
                // against 32 even and 32 odd columns of each token, read where `xe[t]`/`xo[t]`
                // point at each use (held in registers they made the 2 × 4 tile spill).
                let step = |acc: &mut [[__m256i; NT]; R],
                            wr: &[*const u8; R],
                            xe: &[*const i8; NT],
                            xo: &[*const i8; NT]| {
                    for i in 0..R {
                        let wv = _mm256_loadu_si256(wr[i] as *const __m256i);
                        let lo = _mm256_and_si256(wv, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(wv), low);
                        for t in 0..NT {
                            let e = _mm256_loadu_si256(xe[t] as *const __m256i);
                            acc[i][t] = super::$dot(acc[i][t], lo, e);
                            let o = _mm256_loadu_si256(xo[t] as *const __m256i);
                            acc[i][t] = super::$dot(acc[i][t], hi, o);
                        }
                    }
                };
                let mut k = 0;
                while k + 32 <= half {
                    let mut xe = [std::ptr::null::<i8>(); NT];
                    let mut xo = [std::ptr::null::<i8>(); NT];
                    for t in 0..NT {
                        let base = (t0 + t) * half + k;
                        xe[t] = x.even.as_ptr().add(base);
                        xo[t] = x.odd.as_ptr().add(base);
                    }
                    let mut wr = [std::ptr::null::<u8>(); R];
                    for i in 0..R {
                        if k.is_multiple_of(64) {
                            crate::matrix::avx2::prefetch_tile_ahead(wp[i], ahead + k);
                        }
                        wr[i] = wp[i].add(k);
                    }
                    step(&mut acc, &wr, &xe, &xo);
                    k += 32;
                }
                if k < half {
                    // Ragged end: zero-padded copies.
                    let n = half - k;
                    let mut pe = [[0i8; 32]; NT];
                    let mut po = [[0i8; 32]; NT];
                    let mut xe = [std::ptr::null::<i8>(); NT];
                    let mut xo = [std::ptr::null::<i8>(); NT];
                    for t in 0..NT {
                        let base = (t0 + t) * half + k;
                        pe[t][..n].copy_from_slice(&x.even[base..base + n]);
                        po[t][..n].copy_from_slice(&x.odd[base..base + n]);
                        xe[t] = pe[t].as_ptr();
                        xo[t] = po[t].as_ptr();
                    }
                    let mut pw = [[0u8; 32]; R];
                    let mut wr = [std::ptr::null::<u8>(); R];
                    for i in 0..R {
                        std::ptr::copy_nonoverlapping(wp[i].add(k), pw[i].as_mut_ptr(), n);
                        wr[i] = pw[i].as_ptr();
                    }
                    step(&mut acc, &wr, &xe, &xo);
                }
                acc
            }
        }
    };
}

/// Σ of four u8·i8 products per i32 lane, added to `acc` (AVX2: pairs into i16, never
/// saturating for nibbles ≤ 15, then widened).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(
    acc: std::arch::x86_64::__m256i,
    n: std::arch::x86_64::__m256i,
    x: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let pairs = _mm256_maddubs_epi16(n, x);
    _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

/// The same sums with AVX-VNNI's `vpdpbusd` (exact: four products of ≤ 15·127 per lane).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,avxvnni")]
unsafe fn dot_avx_vnni(
    acc: std::arch::x86_64::__m256i,
    n: std::arch::x86_64::__m256i,
    x: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    std::arch::x86_64::_mm256_dpbusd_avx_epi32(acc, n, x)
}

#[cfg(target_arch = "x86_64")]
w4a8_x86_kernel!(avx2, "avx2", dot_avx2);
#[cfg(target_arch = "x86_64")]
w4a8_x86_kernel!(avx_vnni, "avx2,avxvnni", dot_avx_vnni);

/// AVX-512 VNNI: 128 columns (64 packed bytes) per step. Low nibbles are the even columns and
/// high nibbles the odd ones, so instead of interleaving the nibbles back into column order the
/// activations are split once per call into their even and odd columns (`Split`): a step is a
/// load, two masks and a shift for the weights and two `vpdpbusd` per token, each adding four
/// nibble × activation products (n ∈ [0, 15] unsigned, x signed, as `vpdpbusd` takes them) into
/// an i32 lane. An exact integer sum in another order: the same bits. The ragged end goes
/// through masked loads (x = 0 adds nothing); 8·Σx is subtracted per (row, token).
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    #![allow(clippy::needless_range_loop)]

    use std::arch::x86_64::*;
    use std::ops::Range;

    use crate::matrix::w4a8::Split;
    use crate::matrix::w8a8::{emit_row_tiles, finish8, QuantizedTokens};
    use crate::matrix::{OutRows, Scales, WeightsView};

    /// # Safety
    /// The CPU supports the `Avx512` level (F, BW, VL, VNNI); `out` accepts writes for every row
    /// in `rows`; `xq` holds `n_tokens` tokens of `w.cols` values; `w` is an int4 view with even
    /// `cols`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    pub(crate) unsafe fn matmul_rows(
        w: &WeightsView,
        rows: Range<usize>,
        xq: &QuantizedTokens,
        n_tokens: usize,
        out: &OutRows,
    ) {
        let x = Split::of(xq, true);
        assert!(
            n_tokens <= x.offset.len(),
            "W4A8: {n_tokens} tokens of {}",
            x.offset.len()
        );
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(4);
            match nt {
                1 => row_tiles_1(w, rows.clone(), xq, x, t0, out),
                2 => row_tiles::<4, 2>(w, rows.clone(), xq, x, t0, out),
                3 => row_tiles::<2, 3>(w, rows.clone(), xq, x, t0, out),
                _ => row_tiles::<4, 4>(w, rows.clone(), xq, x, t0, out),
            }
            t0 += nt;
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    unsafe fn row_tiles<const R: usize, const NT: usize>(
        w: &WeightsView,
        rows: Range<usize>,
        xq: &QuantizedTokens,
        x: &Split,
        t0: usize,
        out: &OutRows,
    ) {
        let offset: [i32; NT] = std::array::from_fn(|t| x.offset[t0 + t]);
        let tile_r = |r| tile::<R, NT>(w, r, x, t0);
        let single = |r| tile::<1, NT>(w, r, x, t0)[0];
        emit_row_tiles(w, rows, xq, t0, &offset, out, tile_r, single);
    }

    /// [`tile_acc`]'s sums reduced to one i32 each (here, not in the caller's closures, so that
    /// the vectors never cross a call).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    unsafe fn tile<const R: usize, const NT: usize>(
        w: &WeightsView,
        row0: usize,
        x: &Split,
        t0: usize,
    ) -> [[i32; NT]; R] {
        crate::matrix::w8a8::avx512::reduce_tile(&tile_acc::<R, NT>(w, row0, x, t0))
    }

    /// Σ_c n[r, c]·x[t, c] (nibbles unsigned, before the −8) for rows row0..row0+R, tokens
    /// t0..t0+NT, spread over the 16 lanes of each accumulator.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    unsafe fn tile_acc<const R: usize, const NT: usize>(
        w: &WeightsView,
        row0: usize,
        x: &Split,
        t0: usize,
    ) -> [[__m512i; NT]; R] {
        let half = x.half;
        let low = _mm512_set1_epi8(0x0F);
        let mut acc = [[_mm512_setzero_si512(); NT]; R];
        let mut wp = [std::ptr::null::<u8>(); R];
        for i in 0..R {
            wp[i] = w.data.as_ptr().add((row0 + i) * half);
        }
        let ahead = crate::matrix::avx2::tile_prefetch_distance(R * half);
        let mut k = 0;
        while k < half {
            let mask: __mmask64 = if half - k >= 64 {
                !0
            } else {
                (1u64 << (half - k)) - 1
            };
            // Activations are read at each use (held in registers beside a 4 × 4 tile's
            // accumulators they made it spill).
            for i in 0..R {
                crate::matrix::avx2::prefetch_tile_ahead(wp[i], ahead + k);
                let v = _mm512_maskz_loadu_epi8(mask, wp[i].add(k) as *const i8);
                let lo = _mm512_and_si512(v, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                for t in 0..NT {
                    let base = (t0 + t) * half + k;
                    let e = _mm512_maskz_loadu_epi8(mask, x.even.as_ptr().add(base));
                    acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], lo, e);
                    let o = _mm512_maskz_loadu_epi8(mask, x.odd.as_ptr().add(base));
                    acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], hi, o);
                }
            }
            k += 64;
        }
        acc
    }

    /// One token, rows in tiles of 8 whose sums are reduced together and finished as one vector
    /// (as `w8a8::avx512::row_tiles_1`: [`finish`]'s operations in its order, the same bits).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    unsafe fn row_tiles_1(
        w: &WeightsView,
        rows: Range<usize>,
        xq: &QuantizedTokens,
        x: &Split,
        t0: usize,
        out: &OutRows,
    ) {
        let Scales::Row(row_scale) = w.scales else {
            return row_tiles::<8, 1>(w, rows, xq, x, t0, out);
        };
        let mut r = rows.start;
        while r + 8 <= rows.end {
            let acc = tile_acc::<8, 1>(w, r, x, t0);
            let h: [__m256i; 8] = std::array::from_fn(|i| {
                _mm256_add_epi32(
                    _mm512_castsi512_si256(acc[i][0]),
                    _mm512_extracti64x4_epi64::<1>(acc[i][0]),
                )
            });
            let v = finish8(&h, x.offset[t0], &row_scale[r..r + 8], xq.scale[t0]);
            _mm256_storeu_ps(out.rows_mut(t0, r, 8).as_mut_ptr(), v);
            r += 8;
        }
        if r < rows.end {
            row_tiles::<8, 1>(w, r..rows.end, xq, x, t0, out);
        }
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

    /// Runs one x86 kernel of this module directly (the levels take the AVX-VNNI one where the
    /// CPU has it, so the level-wide tests reach only one of the two).
    #[cfg(target_arch = "x86_64")]
    fn x86_kernel(m: &Matrix, x: &[f32], n_tokens: usize, vnni: bool) -> Vec<f32> {
        use crate::matrix::w8a8::QuantizedTokens;
        use crate::matrix::OutRows;
        use crate::parallel::DisjointOut;
        let xq = QuantizedTokens::new(x, n_tokens, m.cols());
        let view = m.view();
        let rows = m.rows();
        let mut out = vec![f32::NAN; n_tokens * rows];
        let d = DisjointOut::new(&mut out);
        let o = OutRows {
            out: &d,
            stride: rows,
            first_row: 0,
        };
        // SAFETY: AVX2 (and AVX-VNNI for `vnni`) checked by the caller; one task owns `out`;
        // int4 views have even widths.
        unsafe {
            if vnni {
                super::avx_vnni::matmul_rows(&view, 0..rows, &xq, n_tokens, &o);
            } else {
                super::avx2::matmul_rows(&view, 0..rows, &xq, n_tokens, &o);
            }
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Both x86 kernels, AVX2 and AVX2 + AVX-VNNI, equal the exact reference bit for bit
        /// (each where the CPU has it).
        #[test]
        fn avx2_and_avx_vnni_kernels_equal_the_exact_reference(
            half_rows in 1usize..20, half_cols in 1usize..150, n_tokens in 1usize..10,
            seed in any::<u64>()
        ) {
            let (rows, cols) = (2 * half_rows, 2 * half_cols);
            let (m, q, x) = case(rows, cols, n_tokens, seed);
            let want = reference(&m, &q, &x, n_tokens);
            if crate::simd::SimdLevel::Avx2.supported() {
                prop_assert_eq!(&x86_kernel(&m, &x, n_tokens, false)[..], &want[..]);
            }
            if crate::matrix::w8a8::avx_vnni::detected() {
                prop_assert_eq!(&x86_kernel(&m, &x, n_tokens, true)[..], &want[..]);
            }
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
