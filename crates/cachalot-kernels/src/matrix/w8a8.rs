//! W8A8 products (spec `deepseek-v3-r1-kimi-k2.md` §4): int8 weights with one scale per output
//! row times int8 activations quantized per token on entry, accumulated exactly in i32:
//!
//!   out[t, r] = f32(Σ_c xq[t, c]·wq[r, c]) · sw[r] · sx[t]
//!
//! (evaluated as `(f32(acc) · sw[r]) · sx[t]`). The integer sum is exact, so every level, tile
//! shape and thread split gives bit-identical results; the SIMD twin is checked equal to the
//! scalar reference. |acc| ≤ 127·128·cols stays in i32 for cols < 132 000.
//!
//! AVX2: `vpmaddubsw` multiplies unsigned by signed bytes, so the weight goes in as |w|
//! (`vpabsb`; −128 becomes the unsigned 128, still exact) and the activation takes the weight's
//! sign (`vpsignb(x, w)`: x·sign(w), never −128 because activations are clamped to ±127). Pairs
//! of products fit i16 (2·128·127 < 32 768); `vpmaddwd` with ones widens them to i32.
//!
//! AVX-512 VNNI: `vpdpbusd` adds four u8·i8 products into each i32 lane. AVX-512 has no
//! `vpsignb`, so instead of the sign trick the weight is offset to unsigned, u = w + 128 (an xor
//! with 0x80), and the activation stays signed: Σ u·x = Σ w·x + 128·Σ x, so the token's Σ x
//! (computed once per tile of tokens) times 128 is subtracted. All of it is i32 arithmetic
//! modulo 2^32 whose true result fits i32, so it is exact. The ragged row end goes through
//! masked loads (zeros add nothing). NEON `sdot` (signed × signed, no offset) is in `neon.rs`.
//!
//! AVX-VNNI (`avx_vnni`): at the AVX2 level, on CPUs that have the 256-bit VEX form of
//! `vpdpbusd` without AVX-512, the AVX-512 kernel's offset scheme in 256-bit lanes.

use std::ops::Range;

use super::{OutRows, WeightsView};
use crate::int8::quantize_activation_int8;

/// Activations of a call, quantized per token.
pub(crate) struct QuantizedTokens {
    pub q: Vec<i8>,
    pub scale: Vec<f32>,
    pub cols: usize,
    /// The same values as AMX tiles, where the product takes the AMX path (`amx.rs`).
    #[cfg(target_arch = "x86_64")]
    pub amx: Option<super::amx::AmxTokens>,
    /// The tokens split by column parity for the x86 W4A8 kernels, made once per call by the
    /// first task that needs them.
    #[cfg(target_arch = "x86_64")]
    pub w4_split: std::sync::OnceLock<super::w4a8::Split>,
}

impl QuantizedTokens {
    pub fn new(x: &[f32], n_tokens: usize, cols: usize) -> QuantizedTokens {
        let mut q = vec![0i8; n_tokens * cols];
        let scale = x
            .chunks_exact(cols)
            .zip(q.chunks_exact_mut(cols))
            .map(|(xt, qt)| quantize_activation_int8(xt, qt))
            .collect();
        QuantizedTokens {
            q,
            scale,
            cols,
            #[cfg(target_arch = "x86_64")]
            amx: None,
            #[cfg(target_arch = "x86_64")]
            w4_split: std::sync::OnceLock::new(),
        }
    }

    #[inline]
    pub fn token(&self, t: usize) -> &[i8] {
        &self.q[t * self.cols..(t + 1) * self.cols]
    }
}

#[inline]
pub(crate) fn weight_row<'a>(w: &'a WeightsView, r: usize) -> &'a [i8] {
    let bytes = &w.data[r * w.cols..(r + 1) * w.cols];
    // SAFETY: i8 and u8 have the same size and alignment.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const i8, bytes.len()) }
}

#[inline]
pub(crate) fn dot_i8(a: &[i8], b: &[i8]) -> i32 {
    a.iter().zip(b).map(|(&x, &y)| x as i32 * y as i32).sum()
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
            let acc = dot_i8(wr, xq.token(t));
            // SAFETY: row r is in this task's row range.
            unsafe { out.write(t, r, finish(acc, w, r, xq.scale[t])) };
        }
    }
}

/// 128·Σ_c x[t, c], what the +128 bias of the weights adds to token t's sums in the `vpdpbusd`
/// kernels (wrapping: only the final difference fits i32).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn offset_of(xq: &QuantizedTokens, t: usize) -> i32 {
    let s: i32 = xq.token(t).iter().map(|&v| v as i32).sum();
    s.wrapping_mul(128)
}

/// What every integer kernel's row loop does: the exact i32 sums of rows `rows` × tokens
/// t0..t0+NT come R rows at a time from `tile(r)` and then one row at a time from `single(r)`,
/// and each is written as `finish(sum − offset[t], ...)` (wrapping: a kernel's bias term).
///
/// # Safety
/// `out` accepts writes for every row in `rows` (the calling task's rows).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn emit_row_tiles<const R: usize, const NT: usize>(
    w: &WeightsView,
    rows: Range<usize>,
    xq: &QuantizedTokens,
    t0: usize,
    offset: &[i32; NT],
    out: &OutRows,
    mut tile: impl FnMut(usize) -> [[i32; NT]; R],
    mut single: impl FnMut(usize) -> [i32; NT],
) {
    let emit = |r: usize, acc: &[i32; NT]| {
        for t in 0..NT {
            let v = finish(acc[t].wrapping_sub(offset[t]), w, r, xq.scale[t0 + t]);
            // SAFETY: row r is one of the caller's rows.
            unsafe { out.write(t0 + t, r, v) };
        }
    };
    let mut r = rows.start;
    while r + R <= rows.end {
        let acc = tile(r);
        for (i, a) in acc.iter().enumerate() {
            emit(r + i, a);
        }
        r += R;
    }
    while r < rows.end {
        emit(r, &single(r));
        r += 1;
    }
}

/// One token's sums of eight rows, each spread over the 8 i32 lanes of `h[i]` (row r + i),
/// reduced together (pairs of rows summed pairwise twice, then the two 128-bit halves added:
/// lane i holds row r + i's sum) and finished as one vector, `((Σ − offset) as f32 · scale[i]) ·
/// sx`: the operations of [`finish`] in its order, so the same bits. Per 8 rows this replaces
/// eight lane reductions and eight scalar finishes, which on a 256-column row (a down
/// projection) cost about as much as its loads.
///
/// # Safety
/// The CPU supports AVX2; `scales` holds at least 8 values.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn finish8(
    h: &[std::arch::x86_64::__m256i; 8],
    offset: i32,
    scales: &[f32],
    sx: f32,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let p0 = _mm256_hadd_epi32(h[0], h[1]);
    let p1 = _mm256_hadd_epi32(h[2], h[3]);
    let p2 = _mm256_hadd_epi32(h[4], h[5]);
    let p3 = _mm256_hadd_epi32(h[6], h[7]);
    let q0 = _mm256_hadd_epi32(p0, p1);
    let q1 = _mm256_hadd_epi32(p2, p3);
    let sums = _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(q0, q1),
        _mm256_permute2x128_si256::<0x31>(q0, q1),
    );
    _mm256_mul_ps(
        _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_sub_epi32(sums, _mm256_set1_epi32(offset))),
            _mm256_loadu_ps(scales[..8].as_ptr()),
        ),
        _mm256_set1_ps(sx),
    )
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    #![allow(clippy::needless_range_loop)]

    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{dot_i8, emit_row_tiles, weight_row, QuantizedTokens};
    use crate::matrix::{OutRows, WeightsView};

    /// # Safety
    /// The CPU supports AVX2; `out` accepts writes for every row in `rows`; `xq` holds
    /// `n_tokens` tokens of `w.cols` values.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn matmul_rows(
        w: &WeightsView,
        rows: Range<usize>,
        xq: &QuantizedTokens,
        n_tokens: usize,
        out: &OutRows,
    ) {
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(4);
            match nt {
                1 => row_tiles::<4, 1>(w, rows.clone(), xq, t0, out),
                2 => row_tiles::<2, 2>(w, rows.clone(), xq, t0, out),
                3 => row_tiles::<1, 3>(w, rows.clone(), xq, t0, out),
                _ => row_tiles::<2, 4>(w, rows.clone(), xq, t0, out),
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
        t0: usize,
        out: &OutRows,
    ) {
        let tile_r = |r| tile::<R, NT>(w, r, xq, t0);
        let single = |r| tile::<1, NT>(w, r, xq, t0)[0];
        emit_row_tiles(w, rows, xq, t0, &[0; NT], out, tile_r, single);
    }

    /// Exact i32 dot products of rows row0..row0+R with tokens t0..t0+NT.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn tile<const R: usize, const NT: usize>(
        w: &WeightsView,
        row0: usize,
        xq: &QuantizedTokens,
        t0: usize,
    ) -> [[i32; NT]; R] {
        let cols = w.cols;
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_si256(); NT]; R];
        let mut wp = [std::ptr::null::<u8>(); R];
        for i in 0..R {
            wp[i] = w.data.as_ptr().add((row0 + i) * cols);
        }
        let ahead = crate::matrix::avx2::tile_prefetch_distance(R * cols);
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
                if c.is_multiple_of(64) {
                    crate::matrix::avx2::prefetch_tile_ahead(wp[i], ahead + c);
                }
                let wv = _mm256_loadu_si256(wp[i].add(c) as *const __m256i);
                let wabs = _mm256_abs_epi8(wv);
                for t in 0..NT {
                    let signed = _mm256_sign_epi8(xs[t], wv);
                    let pairs = _mm256_maddubs_epi16(wabs, signed);
                    acc[i][t] = _mm256_add_epi32(acc[i][t], _mm256_madd_epi16(pairs, ones));
                }
            }
            c += 32;
        }
        let mut res = [[0i32; NT]; R];
        for i in 0..R {
            let wtail = &weight_row(w, row0 + i)[full..];
            for t in 0..NT {
                res[i][t] = hsum_i32(acc[i][t]) + dot_i8(wtail, &xq.token(t0 + t)[full..]);
            }
        }
        res
    }

    /// The lane sums of a tile's 8-lane accumulators, one i32 each.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn hsum_tile<const R: usize, const NT: usize>(
        acc: &[[__m256i; NT]; R],
    ) -> [[i32; NT]; R] {
        let mut res = [[0i32; NT]; R];
        for i in 0..R {
            for t in 0..NT {
                res[i][t] = hsum_i32(acc[i][t]);
            }
        }
        res
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }
}

/// AVX2 with AVX-VNNI (`vpdpbusd` on 256 bits, VEX-encoded: Intel from Alder Lake and
/// Sapphire Rapids, AMD from Zen 5), used at the `Avx2` level where the CPU has it. One
/// instruction adds four u8·i8 products into each i32 lane, where the plain AVX2 kernel takes
/// four (`vpsignb`, `vpmaddubsw`, `vpmaddwd`, `vpaddd`); the weights go in offset to unsigned as
/// in the AVX-512 kernel (u = w + 128, and 128·Σx subtracted per token). A ragged row end goes
/// through zero-padded copies (x = 0 adds nothing). Exact i32 sums, so the same bits as every
/// other level. `CACHALOT_AVX_VNNI=0` turns it off (to compare against the plain AVX2 kernel).
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx_vnni {
    #![allow(clippy::needless_range_loop)]

    use std::arch::x86_64::*;
    use std::ops::Range;
    use std::sync::OnceLock;

    use super::avx2::hsum_tile;
    use super::{emit_row_tiles, finish8, offset_of, QuantizedTokens};
    use crate::matrix::{OutRows, WeightsView};

    /// Whether the CPU has AVX2 and AVX-VNNI and `CACHALOT_AVX_VNNI` does not say no (asked
    /// once).
    pub(crate) fn supported() -> bool {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            let off = std::env::var("CACHALOT_AVX_VNNI")
                .map(|v| matches!(v.trim(), "0" | "off" | "no" | "false"))
                .unwrap_or(false);
            !off && detected()
        })
    }

    /// Whether the CPU has AVX2 and AVX-VNNI, whatever the environment says.
    pub(crate) fn detected() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avxvnni")
    }

    /// # Safety
    /// [`detected`]; `out` accepts writes for every row in `rows`; `xq` holds `n_tokens` tokens
    /// of `w.cols` values.
    #[target_feature(enable = "avx2,avxvnni")]
    pub(crate) unsafe fn matmul_rows(
        w: &WeightsView,
        rows: Range<usize>,
        xq: &QuantizedTokens,
        n_tokens: usize,
        out: &OutRows,
    ) {
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(4);
            match nt {
                1 => row_tiles_1(w, rows.clone(), xq, t0, out),
                2 => row_tiles::<4, 2>(w, rows.clone(), xq, t0, out),
                3 => row_tiles::<3, 3>(w, rows.clone(), xq, t0, out),
                _ => row_tiles::<2, 4>(w, rows.clone(), xq, t0, out),
            }
            t0 += nt;
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn row_tiles<const R: usize, const NT: usize>(
        w: &WeightsView,
        rows: Range<usize>,
        xq: &QuantizedTokens,
        t0: usize,
        out: &OutRows,
    ) {
        let offset: [i32; NT] = std::array::from_fn(|t| offset_of(xq, t0 + t));
        let tile_r = |r| tile::<R, NT>(w, r, xq, t0);
        let single = |r| tile::<1, NT>(w, r, xq, t0)[0];
        emit_row_tiles(w, rows, xq, t0, &offset, out, tile_r, single);
    }

    /// [`tile_acc`]'s sums reduced to one i32 each (here, not in the caller's closures, so that
    /// the vectors never cross a call).
    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn tile<const R: usize, const NT: usize>(
        w: &WeightsView,
        row0: usize,
        xq: &QuantizedTokens,
        t0: usize,
    ) -> [[i32; NT]; R] {
        hsum_tile(&tile_acc::<R, NT>(w, row0, xq, t0))
    }

    /// Σ_c (w[r, c] + 128)·x[t, c] (mod 2^32) for rows row0..row0+R, tokens t0..t0+NT, spread
    /// over the 8 lanes of each accumulator.
    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn tile_acc<const R: usize, const NT: usize>(
        w: &WeightsView,
        row0: usize,
        xq: &QuantizedTokens,
        t0: usize,
    ) -> [[__m256i; NT]; R] {
        let cols = w.cols;
        let bias = _mm256_set1_epi8(0x80u8 as i8);
        let mut acc = [[_mm256_setzero_si256(); NT]; R];
        let mut wp = [std::ptr::null::<u8>(); R];
        for i in 0..R {
            wp[i] = w.data.as_ptr().add((row0 + i) * cols);
        }
        let ahead = crate::matrix::avx2::tile_prefetch_distance(R * cols);
        let mut xp = [std::ptr::null::<i8>(); NT];
        for t in 0..NT {
            xp[t] = xq.token(t0 + t).as_ptr();
        }
        let mut c = 0;
        while c + 32 <= cols {
            let mut xs = [_mm256_setzero_si256(); NT];
            for t in 0..NT {
                xs[t] = _mm256_loadu_si256(xp[t].add(c) as *const __m256i);
            }
            for i in 0..R {
                if c.is_multiple_of(64) {
                    crate::matrix::avx2::prefetch_tile_ahead(wp[i], ahead + c);
                }
                let wu = _mm256_xor_si256(_mm256_loadu_si256(wp[i].add(c) as *const __m256i), bias);
                for t in 0..NT {
                    acc[i][t] = _mm256_dpbusd_avx_epi32(acc[i][t], wu, xs[t]);
                }
            }
            c += 32;
        }
        if c < cols {
            // Ragged end: zero-padded copies (x = 0 adds nothing whatever the weight byte).
            let k = cols - c;
            let mut xs = [_mm256_setzero_si256(); NT];
            for t in 0..NT {
                let mut pad = [0i8; 32];
                std::ptr::copy_nonoverlapping(xp[t].add(c), pad.as_mut_ptr(), k);
                xs[t] = _mm256_loadu_si256(pad.as_ptr() as *const __m256i);
            }
            for i in 0..R {
                let mut pad = [0u8; 32];
                std::ptr::copy_nonoverlapping(wp[i].add(c), pad.as_mut_ptr(), k);
                let wu = _mm256_xor_si256(_mm256_loadu_si256(pad.as_ptr() as *const __m256i), bias);
                for t in 0..NT {
                    acc[i][t] = _mm256_dpbusd_avx_epi32(acc[i][t], wu, xs[t]);
                }
            }
        }
        acc
    }

    /// One token, rows in tiles of 8 reduced together and finished as one vector, as the
    /// AVX-512 kernel's `row_tiles_1` (the operations of [`finish`] in its order: same bits).
    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn row_tiles_1(
        w: &WeightsView,
        rows: Range<usize>,
        xq: &QuantizedTokens,
        t0: usize,
        out: &OutRows,
    ) {
        let crate::matrix::Scales::Row(row_scale) = w.scales else {
            return row_tiles::<4, 1>(w, rows, xq, t0, out);
        };
        let off = offset_of(xq, t0);
        let mut r = rows.start;
        while r + 8 <= rows.end {
            let acc = tile_acc::<8, 1>(w, r, xq, t0);
            let h: [__m256i; 8] = std::array::from_fn(|i| acc[i][0]);
            let v = finish8(&h, off, &row_scale[r..r + 8], xq.scale[t0]);
            _mm256_storeu_ps(out.rows_mut(t0, r, 8).as_mut_ptr(), v);
            r += 8;
        }
        if r < rows.end {
            row_tiles::<4, 1>(w, r..rows.end, xq, t0, out);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    #![allow(clippy::needless_range_loop)]

    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{emit_row_tiles, finish8, offset_of, QuantizedTokens};
    use crate::matrix::{OutRows, WeightsView};

    /// # Safety
    /// The CPU supports the `Avx512` level (F, BW, VL, VNNI); `out` accepts writes for every
    /// row in `rows`; `xq` holds `n_tokens` tokens of `w.cols` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    pub(crate) unsafe fn matmul_rows(
        w: &WeightsView,
        rows: Range<usize>,
        xq: &QuantizedTokens,
        n_tokens: usize,
        out: &OutRows,
    ) {
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(4);
            match nt {
                1 => row_tiles_1(w, rows.clone(), xq, t0, out),
                2 => row_tiles::<4, 2>(w, rows.clone(), xq, t0, out),
                3 => row_tiles::<2, 3>(w, rows.clone(), xq, t0, out),
                _ => row_tiles::<4, 4>(w, rows.clone(), xq, t0, out),
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
        t0: usize,
        out: &OutRows,
    ) {
        let offset: [i32; NT] = std::array::from_fn(|t| offset_of(xq, t0 + t));
        let tile_r = |r| tile::<R, NT>(w, r, xq, t0);
        let single = |r| tile::<1, NT>(w, r, xq, t0)[0];
        emit_row_tiles(w, rows, xq, t0, &offset, out, tile_r, single);
    }

    /// Σ_c (w[r, c] + 128)·x[t, c] (mod 2^32) for rows row0..row0+R, tokens t0..t0+NT.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    unsafe fn tile<const R: usize, const NT: usize>(
        w: &WeightsView,
        row0: usize,
        xq: &QuantizedTokens,
        t0: usize,
    ) -> [[i32; NT]; R] {
        reduce_tile(&tile_acc::<R, NT>(w, row0, xq, t0))
    }

    /// The lane sums of a tile's accumulators (at most 16), all at once: [`reduce16`] on the
    /// accumulators in (row, token) order, zeros after them.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    pub(crate) unsafe fn reduce_tile<const R: usize, const NT: usize>(
        acc: &[[__m512i; NT]; R],
    ) -> [[i32; NT]; R] {
        let mut res = [[0i32; NT]; R];
        if R * NT > 16 {
            for i in 0..R {
                for t in 0..NT {
                    res[i][t] = _mm512_reduce_add_epi32(acc[i][t]);
                }
            }
            return res;
        }
        let mut flat = [_mm512_setzero_si512(); 16];
        for i in 0..R {
            for t in 0..NT {
                flat[i * NT + t] = acc[i][t];
            }
        }
        let sums = reduce16(&flat);
        for i in 0..R {
            for t in 0..NT {
                res[i][t] = sums[i * NT + t];
            }
        }
        res
    }

    /// The lane sums of 16 vectors by a transposing tree of adds (45 instructions where 16
    /// separate reductions take about 130): halves of pairs of vectors, then quarters, then
    /// pairs of lanes, then lanes. i32 sums (mod 2^32) are exact in any order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    pub(crate) unsafe fn reduce16(v: &[__m512i; 16]) -> [i32; 16] {
        // Level 1: t[k] = [v(2k) lo + hi | v(2k+1) lo + hi] (8 partial sums each).
        let t: [__m512i; 8] = std::array::from_fn(|k| {
            let (a, b) = (v[2 * k], v[2 * k + 1]);
            _mm512_add_epi32(
                _mm512_shuffle_i64x2::<0x44>(a, b),
                _mm512_shuffle_i64x2::<0xEE>(a, b),
            )
        });
        // Level 2: s[m]'s 128-bit lane j holds 4 partial sums of v(4m + j).
        let s: [__m512i; 4] = std::array::from_fn(|m| {
            let (a, b) = (t[2 * m], t[2 * m + 1]);
            _mm512_add_epi32(
                _mm512_shuffle_i64x2::<0x88>(a, b),
                _mm512_shuffle_i64x2::<0xDD>(a, b),
            )
        });
        // Level 3: x[h]'s lane j holds 2 partial sums of v(8h + j), then 2 of v(8h + 4 + j).
        let x: [__m512i; 2] = std::array::from_fn(|h| {
            let (a, b) = (s[2 * h], s[2 * h + 1]);
            _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
        });
        // Level 4: lane j holds the sums of v(j), v(4 + j), v(8 + j), v(12 + j).
        let (a, b) = (_mm512_castsi512_ps(x[0]), _mm512_castsi512_ps(x[1]));
        let f = _mm512_add_epi32(
            _mm512_castps_si512(_mm512_shuffle_ps::<0x88>(a, b)),
            _mm512_castps_si512(_mm512_shuffle_ps::<0xDD>(a, b)),
        );
        let mut lanes = [0i32; 16];
        _mm512_storeu_si512(lanes.as_mut_ptr() as *mut __m512i, f);
        std::array::from_fn(|o| lanes[4 * (o % 4) + o / 4])
    }

    /// [`tile`]'s sums still spread over the 16 lanes of each accumulator.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    unsafe fn tile_acc<const R: usize, const NT: usize>(
        w: &WeightsView,
        row0: usize,
        xq: &QuantizedTokens,
        t0: usize,
    ) -> [[__m512i; NT]; R] {
        let cols = w.cols;
        let bias = _mm512_set1_epi8(0x80u8 as i8);
        let mut acc = [[_mm512_setzero_si512(); NT]; R];
        let mut wp = [std::ptr::null::<u8>(); R];
        for i in 0..R {
            wp[i] = w.data.as_ptr().add((row0 + i) * cols);
        }
        let ahead = crate::matrix::avx2::tile_prefetch_distance(R * cols);
        let mut xp = [std::ptr::null::<i8>(); NT];
        for t in 0..NT {
            xp[t] = xq.token(t0 + t).as_ptr();
        }
        let mut c = 0;
        while c + 64 <= cols {
            let mut xs = [_mm512_setzero_si512(); NT];
            for t in 0..NT {
                xs[t] = _mm512_loadu_si512(xp[t].add(c) as *const __m512i);
            }
            for i in 0..R {
                crate::matrix::avx2::prefetch_tile_ahead(wp[i], ahead + c);
                let wu = _mm512_xor_si512(_mm512_loadu_si512(wp[i].add(c) as *const __m512i), bias);
                for t in 0..NT {
                    acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], wu, xs[t]);
                }
            }
            c += 64;
        }
        if c < cols {
            // Masked loads: columns past the end read as x = 0 and add nothing.
            let mask: __mmask64 = (1u64 << (cols - c)) - 1;
            let mut xs = [_mm512_setzero_si512(); NT];
            for t in 0..NT {
                xs[t] = _mm512_maskz_loadu_epi8(mask, xp[t].add(c));
            }
            for i in 0..R {
                let wv = _mm512_maskz_loadu_epi8(mask, wp[i].add(c) as *const i8);
                let wu = _mm512_xor_si512(wv, bias);
                for t in 0..NT {
                    acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], wu, xs[t]);
                }
            }
        }
        acc
    }

    /// One token, rows in tiles of 8 whose sums are reduced together (a transposing tree of
    /// adds) and finished as one vector: `(Σ as f32 · row scale) · token scale`, the operations
    /// of [`finish`] in its order, so the same bits; the integer sums are exact in any order
    /// (mod 2^32). Per 8 rows this replaces eight lane reductions and eight scalar finishes,
    /// which on a 256-column row (a down projection) cost about as much as its loads.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    unsafe fn row_tiles_1(
        w: &WeightsView,
        rows: Range<usize>,
        xq: &QuantizedTokens,
        t0: usize,
        out: &OutRows,
    ) {
        let crate::matrix::Scales::Row(row_scale) = w.scales else {
            return row_tiles::<8, 1>(w, rows, xq, t0, out);
        };
        let off = offset_of(xq, t0);
        let mut r = rows.start;
        while r + 8 <= rows.end {
            let acc = tile_acc::<8, 1>(w, r, xq, t0);
            // 512 -> 256 bits per row, then pairs of rows summed pairwise twice and the two
            // 128-bit halves added: lane i holds row r + i's sum.
            let h: [__m256i; 8] = std::array::from_fn(|i| {
                _mm256_add_epi32(
                    _mm512_castsi512_si256(acc[i][0]),
                    _mm512_extracti64x4_epi64::<1>(acc[i][0]),
                )
            });
            let v = finish8(&h, off, &row_scale[r..r + 8], xq.scale[t0]);
            _mm256_storeu_ps(out.rows_mut(t0, r, 8).as_mut_ptr(), v);
            r += 8;
        }
        if r < rows.end {
            row_tiles::<8, 1>(w, r..rows.end, xq, t0, out);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use proptest::prelude::*;

    use crate::matrix::{Matrix, MatrixData};
    use crate::simd::SimdLevel;
    use crate::Bytes;

    pub(crate) fn levels() -> Vec<SimdLevel> {
        SimdLevel::ALL
            .iter()
            .copied()
            .filter(|l| l.supported())
            .collect()
    }

    /// Every supported level gives `want` bit for bit: all rows and tokens at once, a row
    /// sub-range, and one token at a time.
    pub(crate) fn every_level_gives(
        m: &Matrix,
        x: &[f32],
        n_tokens: usize,
        want: &[f32],
    ) -> Result<(), TestCaseError> {
        let (rows, cols) = (m.rows(), m.cols());
        for level in levels() {
            let mut out = vec![f32::NAN; n_tokens * rows];
            m.matmul_rows_at(level, 0..rows, x, n_tokens, &mut out);
            prop_assert_eq!(&out[..], want, "level {:?}", level);
            let sub = rows / 3..rows;
            for t in 0..n_tokens {
                let mut o = vec![f32::NAN; sub.len()];
                m.matmul_rows_at(level, sub.clone(), &x[t * cols..(t + 1) * cols], 1, &mut o);
                prop_assert_eq!(&o[..], &want[t * rows + sub.start..(t + 1) * rows]);
            }
        }
        Ok(())
    }

    /// SplitMix64 from a proptest seed.
    pub(crate) fn stream(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed;
        move || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
    }

    fn case(rows: usize, cols: usize, n_tokens: usize, seed: u64) -> (Matrix, Vec<f32>) {
        let mut next = stream(seed);
        let data: Vec<u8> = (0..rows * cols).map(|_| next() as u8).collect();
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
        let m = Matrix::new(
            rows,
            cols,
            MatrixData::W8A8 {
                data: Bytes::from_vec(data),
                scale,
            },
        )
        .unwrap();
        (m, x)
    }

    /// Independent reference: quantize each token, sum exactly in i64.
    fn reference(m: &Matrix, x: &[f32], n_tokens: usize) -> Vec<f32> {
        let MatrixData::W8A8 { data, scale } = m.data() else {
            unreachable!()
        };
        let (rows, cols) = (m.rows(), m.cols());
        let mut out = vec![0.0f32; n_tokens * rows];
        for t in 0..n_tokens {
            let xt = &x[t * cols..(t + 1) * cols];
            let amax = xt.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let inv = 127.0 / amax;
            let q: Vec<i64> = xt
                .iter()
                .map(|v| (v * inv).round_ties_even().clamp(-127.0, 127.0) as i64)
                .collect();
            for r in 0..rows {
                let w = &data.as_slice()[r * cols..(r + 1) * cols];
                let acc: i64 = w.iter().zip(&q).map(|(&b, &v)| b as i8 as i64 * v).sum();
                out[t * rows + r] = (acc as i32 as f32 * scale[r]) * (amax / 127.0);
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn every_level_equals_the_exact_reference(
            rows in 1usize..40, cols in 1usize..300, n_tokens in 1usize..10, seed in any::<u64>()
        ) {
            let (m, x) = case(rows, cols, n_tokens, seed);
            let want = reference(&m, &x, n_tokens);
            every_level_gives(&m, &x, n_tokens, &want)?;
            // Close to the f32 product of the dequantized weights: the activation rounding
            // error is at most sx/2 per element.
            let f = m.to_f32_matrix();
            let mut exact = vec![0.0f32; n_tokens * rows];
            f.matmul(&x, n_tokens, &mut exact);
            let deq = m.to_f32_vec();
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

    /// Runs one x86 kernel of this module directly: `vnni` picks the AVX-VNNI kernel, else
    /// the plain AVX2 one (the `Avx2` level takes the first where the CPU has it, so the
    /// level-wide tests reach only one of the two).
    #[cfg(target_arch = "x86_64")]
    fn avx2_kernel(
        m: &Matrix,
        x: &[f32],
        n_tokens: usize,
        rows: std::ops::Range<usize>,
        vnni: bool,
    ) -> Vec<f32> {
        use crate::matrix::OutRows;
        use crate::parallel::DisjointOut;
        let xq = super::QuantizedTokens::new(x, n_tokens, m.cols());
        let view = m.view();
        let mut out = vec![f32::NAN; n_tokens * rows.len()];
        let d = DisjointOut::new(&mut out);
        let o = OutRows {
            out: &d,
            stride: rows.len(),
            first_row: rows.start,
        };
        // SAFETY: AVX2 (and AVX-VNNI for `vnni`) checked by the caller; one task owns `out`.
        unsafe {
            if vnni {
                super::avx_vnni::matmul_rows(&view, rows, &xq, n_tokens, &o);
            } else {
                super::avx2::matmul_rows(&view, rows, &xq, n_tokens, &o);
            }
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Both AVX2 kernels, with and without AVX-VNNI, equal the exact reference bit for bit
        /// (each where the CPU has it), over all rows and a sub-range.
        #[test]
        fn avx2_and_avx_vnni_kernels_equal_the_exact_reference(
            rows in 1usize..40, cols in 1usize..300, n_tokens in 1usize..10, seed in any::<u64>()
        ) {
            let (m, x) = case(rows, cols, n_tokens, seed);
            let want = reference(&m, &x, n_tokens);
            let mut kernels = vec![];
            if SimdLevel::Avx2.supported() {
                kernels.push(false);
            }
            if super::avx_vnni::detected() {
                kernels.push(true);
            }
            for vnni in kernels {
                prop_assert_eq!(&avx2_kernel(&m, &x, n_tokens, 0..rows, vnni)[..], &want[..], "vnni {}", vnni);
                let sub = rows / 3..rows;
                let got = avx2_kernel(&m, &x, n_tokens, sub.clone(), vnni);
                for t in 0..n_tokens {
                    prop_assert_eq!(
                        &got[t * sub.len()..(t + 1) * sub.len()],
                        &want[t * rows + sub.start..(t + 1) * rows],
                        "vnni {} sub-range", vnni
                    );
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    proptest! {
        /// The transposing reduction gives each vector's wrapping lane sum in its place.
        #[test]
        fn reduce16_sums_each_vector(v in prop::collection::vec(any::<i32>(), 256)) {
            if !SimdLevel::Avx512.supported() {
                return Ok(());
            }
            use std::arch::x86_64::*;
            // SAFETY: AVX-512 checked; each load reads 16 of the 256 values.
            let got = unsafe {
                let vs: [__m512i; 16] = std::array::from_fn(|k| {
                    _mm512_loadu_si512(v[16 * k..].as_ptr() as *const __m512i)
                });
                super::avx512::reduce16(&vs)
            };
            for k in 0..16 {
                let want = v[16 * k..16 * (k + 1)].iter().fold(0i32, |a, &b| a.wrapping_add(b));
                prop_assert_eq!(got[k], want, "vector {}", k);
            }
        }
    }

    /// Worst-case magnitudes through both AVX2 kernels.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_kernels_keep_large_sums_exact() {
        let (rows, cols, n_tokens) = (11, 4096 + 7, 5);
        let data = Bytes::from_vec(vec![0x80u8; rows * cols]);
        let m = Matrix::new(
            rows,
            cols,
            MatrixData::W8A8 {
                data,
                scale: vec![1.0; rows],
            },
        )
        .unwrap();
        let x = vec![-1.0f32; n_tokens * cols];
        let acc = (128 * 127 * cols) as f32;
        for vnni in [false, true] {
            if (vnni && !super::avx_vnni::detected()) || !SimdLevel::Avx2.supported() {
                continue;
            }
            let out = avx2_kernel(&m, &x, n_tokens, 0..rows, vnni);
            assert!(out.iter().all(|&v| v == acc / 127.0), "vnni {vnni}");
        }
    }

    #[test]
    fn large_sums_stay_exact() {
        // Worst-case magnitudes (w = −128, x = ±127) over 4 096 columns.
        let cols = 4096;
        let data = Bytes::from_vec(vec![0x80u8; 2 * cols]);
        let m = Matrix::new(
            2,
            cols,
            MatrixData::W8A8 {
                data,
                scale: vec![1.0, 0.5],
            },
        )
        .unwrap();
        let x = vec![-1.0f32; cols];
        for level in levels() {
            let mut out = [f32::NAN; 2];
            m.matmul_rows_at(level, 0..2, &x, 1, &mut out);
            let acc = (128 * 127 * cols) as f32;
            assert_eq!(out, [acc / 127.0, acc * 0.5 / 127.0], "{level:?}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Products of 8 and more tokens, which take the AMX tiles where the CPU has them
        /// (16-row tiles, 64-column blocks, 16-token tiles: ragged on every side here), equal
        /// the exact reference bit for bit at every level.
        #[test]
        fn many_tokens_equal_the_exact_reference(
            rows in 1usize..72, cols in 1usize..300, n_tokens in 8usize..48, seed in any::<u64>()
        ) {
            let (m, x) = case(rows, cols, n_tokens, seed);
            let want = reference(&m, &x, n_tokens);
            every_level_gives(&m, &x, n_tokens, &want)?;
        }
    }

    /// Worst-case sums through the many-token path (AMX where present).
    #[test]
    fn large_sums_stay_exact_for_many_tokens() {
        let (rows, cols, n_tokens) = (33, 4096 + 24, 19);
        let data = Bytes::from_vec(vec![0x80u8; rows * cols]);
        let m = Matrix::new(
            rows,
            cols,
            MatrixData::W8A8 {
                data,
                scale: vec![1.0; rows],
            },
        )
        .unwrap();
        let x = vec![-1.0f32; n_tokens * cols];
        let acc = (128 * 127 * cols) as f32;
        for level in levels() {
            let mut out = vec![f32::NAN; n_tokens * rows];
            m.matmul_rows_at(level, 0..rows, &x, n_tokens, &mut out);
            assert!(out.iter().all(|&v| v == acc / 127.0), "{level:?}");
        }
    }

    /// Where the CPU and OS allow AMX, products of many tokens are prepared for it (so the
    /// tests above run the tiles), and products of few are not.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn amx_prepares_products_of_many_tokens() {
        use crate::matrix::{amx, Acts};
        let (m, x) = case(16, 64, amx::MIN_TOKENS, 7);
        let amx_level = crate::simd::simd_level() == SimdLevel::Avx512 && amx::supported();
        let Acts::Int8(many) = Acts::prepare(m.data(), &x, amx::MIN_TOKENS, 64) else {
            panic!("W8A8 activations are int8")
        };
        assert_eq!(many.amx.is_some(), amx_level);
        let Acts::Int8(few) = Acts::prepare(m.data(), &x[..64], 1, 64) else {
            panic!("W8A8 activations are int8")
        };
        assert!(few.amx.is_none());
        eprintln!("AMX tiles in use: {amx_level}");
    }
}
