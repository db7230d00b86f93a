//! BF16 × BF16 products (`MatrixData::Bf16Dot`): bf16 weights times activations rounded to bf16
//! on entry, the way llama.cpp multiplies BF16 weights on CPUs with AVX-512 BF16 (its
//! `vec_dot_type` for BF16 is BF16). Opt-in (`--bf16-dot`): the default BF16 product
//! (`MatrixData::Bf16`) keeps f32 activations.
//!
//! The result is defined by the operations of x86's `vdpbf16ps`, so every level gives the same
//! bits: per (row, token), 16 f32 lanes; for each chunk of 32 columns (zero-padded at the row
//! end), lane j adds the product of columns 32k+2j+1 and then that of column 32k+2j:
//!
//!   lane[j] = (lane[j] + w[c+1]·x[c+1]) + w[c]·x[c],   c = 32k + 2j
//!
//! each addition rounded to f32 (ties to even). A product of two bf16 values (8 significant
//! bits each) is exact in f32, so an FMA and a multiply-then-add give the same bits. The lanes
//! are then summed as AVX2's `hsum` sums a vector: s[i] = lane[i] + lane[i+8] (8 values), then
//! `hsum(s)`. Activations are rounded to bf16 ties-to-even, subnormal results flushed to ±0
//! (`vdpbf16ps` treats subnormal inputs as zero).
//!
//! Levels: AVX-512 with the BF16 extension (`avx512bf16`: Zen 4/5, Sapphire Rapids on) runs
//! `vdpbf16ps`, 32 products per instruction against 16 for the f32 FMA on decoded weights; the
//! AVX2 level (and AVX-512 CPUs without BF16) splits each 32-bit pair into its odd (`and
//! 0xFFFF0000`) and even (`<< 16`) element and does the same two FMAs per lane; NEON (aarch64)
//! does AVX2's operations in 4-lane registers; scalar follows the definition. One caveat:
//! `vdpbf16ps` also treats subnormal weights as zero and flushes subnormal sums to zero, the
//! other levels do not, so results can differ where a weight, a product or a partial sum falls
//! below 2^−126 (never in a trained network's useful range; the property tests draw normal
//! values).
//!
//! Spec: `deepseek-v3-r1-kimi-k2.md` §4 lists BF16 as a stored format; this is a runtime choice
//! of how to multiply it, as `--int8-head` is for the head.

use std::ops::Range;

use super::{OutRows, WeightsView};
use crate::{bf16_to_f32, f32_to_bf16};

/// Columns per chunk: one `vdpbf16ps` over 32 bf16 values.
const CHUNK: usize = 32;

/// Activations of a call, rounded to bf16 per element.
pub(crate) struct Bf16Tokens {
    pub x: Vec<u16>,
    pub cols: usize,
}

impl Bf16Tokens {
    pub fn new(x: &[f32], cols: usize) -> Bf16Tokens {
        let x = x.iter().map(|&v| round_activation(v)).collect();
        Bf16Tokens { x, cols }
    }

    #[inline]
    pub fn token(&self, t: usize) -> &[u16] {
        &self.x[t * self.cols..(t + 1) * self.cols]
    }
}

/// bf16 ties-to-even, subnormals flushed to a signed zero.
#[inline]
pub(crate) fn round_activation(v: f32) -> u16 {
    let b = f32_to_bf16(v);
    if b & 0x7F80 == 0 {
        b & 0x8000
    } else {
        b
    }
}

#[inline]
fn weight_row<'a>(w: &'a WeightsView, r: usize) -> &'a [u8] {
    &w.data[r * w.cols * 2..(r + 1) * w.cols * 2]
}

#[inline]
fn bf16_at(bytes: &[u8], c: usize) -> f32 {
    bf16_to_f32(u16::from_le_bytes([bytes[2 * c], bytes[2 * c + 1]]))
}

/// The 16 lanes summed as `avx2::hsum(lo + hi)` sums them.
#[inline]
pub(crate) fn reduce16(l: &[f32; 16]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|i| l[i] + l[i + 8]);
    let s4: [f32; 4] = std::array::from_fn(|i| s8[i] + s8[i + 4]);
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

/// The definition, for one row and one token.
pub(crate) fn dot_scalar(w: &[u8], x: &[u16], cols: usize) -> f32 {
    let mut lane = [0.0f32; 16];
    let xv = |c: usize| if c < cols { bf16_to_f32(x[c]) } else { 0.0 };
    let wv = |c: usize| if c < cols { bf16_at(w, c) } else { 0.0 };
    for k in 0..cols.div_ceil(CHUNK) {
        for (j, l) in lane.iter_mut().enumerate() {
            let c = k * CHUNK + 2 * j;
            *l += wv(c + 1) * xv(c + 1);
            *l += wv(c) * xv(c);
        }
    }
    reduce16(&lane)
}

/// Scalar reference for rows `rows`, all tokens.
pub(crate) fn matmul_rows_scalar(
    w: &WeightsView,
    rows: Range<usize>,
    xb: &Bf16Tokens,
    n_tokens: usize,
    out: &OutRows,
) {
    for r in rows {
        let wr = weight_row(w, r);
        for t in 0..n_tokens {
            // SAFETY: row r is in this task's row range.
            unsafe { out.write(t, r, dot_scalar(wr, xb.token(t), w.cols)) };
        }
    }
}

/// Weight bytes per row block: a block stays in L2 while every group of tokens passes over it.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const L2_BLOCK_BYTES: usize = 128 * 1024;

/// Rows `rows` × all tokens in tiles: L2-sized row blocks (a multiple of 8 rows), tokens in
/// groups of at most 4, and within a block `tile(row0, rows_in_tile, t0, nt)` for R rows at a
/// time (`r_of(nt)`) and then single rows; each tile's sums go to `out`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
fn drive<F>(cols: usize, rows: Range<usize>, n_tokens: usize, r_of: fn(usize) -> usize, mut tile: F)
where
    F: FnMut(usize, usize, usize, usize),
{
    let step = (L2_BLOCK_BYTES / (2 * cols).max(1)).max(8) / 8 * 8;
    let mut r0 = rows.start;
    while r0 < rows.end {
        let end = (r0 + step).min(rows.end);
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(4);
            let big = r_of(nt);
            let mut r = r0;
            while r + big <= end {
                tile(r, big, t0, nt);
                r += big;
            }
            while r < end {
                tile(r, 1, t0, nt);
                r += 1;
            }
            t0 += nt;
        }
        r0 = end;
    }
}

/// Writes a tile's sums (rows r.., tokens t0..).
///
/// # Safety
/// The rows are in the calling task's rows.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn write<const R: usize, const NT: usize>(
    out: &OutRows,
    r: usize,
    t0: usize,
    res: &[[f32; NT]; R],
) {
    for (i, row) in res.iter().enumerate() {
        for (t, &v) in row.iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { out.write(t0 + t, r + i, v) };
        }
    }
}

/// Rows `rows` × all tokens through the level's `tile::<R, NT>` in AVX2's tiles: 4 rows × 1
/// token, 2 × 2, then one row at a time.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! avx2_tiles {
    ($tile:ident, $w:expr, $rows:expr, $xb:expr, $n_tokens:expr, $out:expr) => {{
        let (w, xb, out) = ($w, $xb, $out);
        let r_of = |nt: usize| [4, 2, 1, 1][nt - 1];
        drive(w.cols, $rows, $n_tokens, r_of, |r, big, t0, nt| {
            // SAFETY: the tile's rows and tokens exist and are this task's (from `drive`).
            unsafe {
                match (big, nt) {
                    (4, _) => write(out, r, t0, &$tile::<4, 1>(w, r, xb, t0)),
                    (2, _) => write(out, r, t0, &$tile::<2, 2>(w, r, xb, t0)),
                    _ => one_row!($tile, w, xb, out, r, t0, nt),
                }
            }
        })
    }};
}

/// A one-row tile of `nt` (1..=4) tokens through the level's `tile` function.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! one_row {
    ($tile:ident, $w:expr, $xb:expr, $out:expr, $r:expr, $t0:expr, $nt:expr) => {
        match $nt {
            1 => write($out, $r, $t0, &$tile::<1, 1>($w, $r, $xb, $t0)),
            2 => write($out, $r, $t0, &$tile::<1, 2>($w, $r, $xb, $t0)),
            3 => write($out, $r, $t0, &$tile::<1, 3>($w, $r, $xb, $t0)),
            _ => write($out, $r, $t0, &$tile::<1, 4>($w, $r, $xb, $t0)),
        }
    };
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    #![allow(clippy::needless_range_loop)]

    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{drive, write, Bf16Tokens, CHUNK};
    use crate::matrix::avx2::{prefetch_tile_ahead, tile_prefetch_distance};
    use crate::matrix::{OutRows, WeightsView};
    use crate::vector::avx2::hsum;

    /// # Safety
    /// The CPU supports AVX2 + FMA; `out` accepts writes for every row in `rows`; `xb` holds
    /// `n_tokens` tokens of `w.cols` values; `w` is a bf16 view.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn matmul_rows(
        w: &WeightsView,
        rows: Range<usize>,
        xb: &Bf16Tokens,
        n_tokens: usize,
        out: &OutRows,
    ) {
        // Two 8-lane accumulators per (row, token).
        avx2_tiles!(tile, w, rows, xb, n_tokens, out)
    }

    /// (odd, even) elements of the 8 bf16 pairs at `p` as f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn split(p: *const u8) -> (__m256, __m256) {
        let v = _mm256_loadu_si256(p as *const __m256i);
        let odd = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF_0000u32 as i32));
        let even = _mm256_slli_epi32::<16>(v);
        (_mm256_castsi256_ps(odd), _mm256_castsi256_ps(even))
    }

    /// lanes 0..8 (`lo`) and 8..16 (`hi`) of one 32-column chunk at byte offset `o` of the
    /// weight row `wp` and the token `xp`: `vdpbf16ps`'s two FMAs per lane.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn chunk(acc: &mut (__m256, __m256), wv: &[(__m256, __m256); 2], xp: *const u8) {
        let x0 = split(xp);
        let x1 = split(xp.add(32));
        acc.0 = _mm256_fmadd_ps(wv[0].0, x0.0, acc.0);
        acc.0 = _mm256_fmadd_ps(wv[0].1, x0.1, acc.0);
        acc.1 = _mm256_fmadd_ps(wv[1].0, x1.0, acc.1);
        acc.1 = _mm256_fmadd_ps(wv[1].1, x1.1, acc.1);
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const NT: usize>(
        w: &WeightsView,
        row0: usize,
        xb: &Bf16Tokens,
        t0: usize,
    ) -> [[f32; NT]; R] {
        let cols = w.cols;
        let rb = 2 * cols;
        let z = _mm256_setzero_ps();
        let mut acc = [[(z, z); NT]; R];
        let mut wp = [std::ptr::null::<u8>(); R];
        for i in 0..R {
            wp[i] = w.data.as_ptr().add((row0 + i) * rb);
        }
        let ahead = tile_prefetch_distance(R * rb);
        let mut xp = [std::ptr::null::<u8>(); NT];
        for t in 0..NT {
            xp[t] = xb.token(t0 + t).as_ptr() as *const u8;
        }
        let full = cols / CHUNK * CHUNK;
        let mut c = 0;
        while c < full {
            for i in 0..R {
                prefetch_tile_ahead(wp[i], ahead + 2 * c);
                let wv = [split(wp[i].add(2 * c)), split(wp[i].add(2 * c + 32))];
                for t in 0..NT {
                    chunk(&mut acc[i][t], &wv, xp[t].add(2 * c));
                }
            }
            c += CHUNK;
        }
        if c < cols {
            let k = 2 * (cols - c);
            let mut xpad = [[0u8; 64]; NT];
            for t in 0..NT {
                std::ptr::copy_nonoverlapping(xp[t].add(2 * c), xpad[t].as_mut_ptr(), k);
            }
            for i in 0..R {
                let mut wpad = [0u8; 64];
                std::ptr::copy_nonoverlapping(wp[i].add(2 * c), wpad.as_mut_ptr(), k);
                let wv = [split(wpad.as_ptr()), split(wpad.as_ptr().add(32))];
                for t in 0..NT {
                    chunk(&mut acc[i][t], &wv, xpad[t].as_ptr());
                }
            }
        }
        let mut res = [[0.0f32; NT]; R];
        for i in 0..R {
            for t in 0..NT {
                res[i][t] = hsum(_mm256_add_ps(acc[i][t].0, acc[i][t].1));
            }
        }
        res
    }
}

/// AVX2's kernel in 128-bit registers: a (row, token)'s 16 lanes are four 4-lane accumulators
/// (lanes 0-3 and 4-7 take the chunk's first 8 column pairs, 8-11 and 12-15 the next 8), each
/// pair split into its odd (`and 0xFFFF0000`) and even (`<< 16`) element for two fused
/// multiply-adds, odd first; the lanes are summed as AVX2 sums them (`hsum(lo + hi)`).
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon {
    #![allow(clippy::needless_range_loop)]

    use std::arch::aarch64::*;
    use std::ops::Range;

    use super::{drive, write, Bf16Tokens, CHUNK};
    use crate::matrix::neon_float::prefetch_tile_ahead;
    use crate::matrix::{tile_prefetch_distance, OutRows, WeightsView};

    /// # Safety
    /// The CPU supports NEON (every aarch64 CPU); `out` accepts writes for every row in `rows`;
    /// `xb` holds `n_tokens` tokens of `w.cols` values; `w` is a bf16 view.
    #[target_feature(enable = "neon")]
    pub(crate) unsafe fn matmul_rows(
        w: &WeightsView,
        rows: Range<usize>,
        xb: &Bf16Tokens,
        n_tokens: usize,
        out: &OutRows,
    ) {
        // Four 4-lane accumulators per (row, token).
        avx2_tiles!(tile, w, rows, xb, n_tokens, out)
    }

    /// (odd, even) elements of the 4 bf16 pairs at `p` as f32 lanes.
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn split(p: *const u8) -> (float32x4_t, float32x4_t) {
        let v = vld1q_u32(p as *const u32);
        let odd = vandq_u32(v, vdupq_n_u32(0xFFFF_0000));
        let even = vshlq_n_u32::<16>(v);
        (vreinterpretq_f32_u32(odd), vreinterpretq_f32_u32(even))
    }

    /// The four 4-lane weight vectors of one 32-column chunk at `p`.
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn split_chunk(p: *const u8) -> [(float32x4_t, float32x4_t); 4] {
        [
            split(p),
            split(p.add(16)),
            split(p.add(32)),
            split(p.add(48)),
        ]
    }

    /// One 32-column chunk of a token at `xp` into a (row, token)'s 16 lanes.
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn chunk(
        acc: &mut [float32x4_t; 4],
        wv: &[(float32x4_t, float32x4_t); 4],
        xp: *const u8,
    ) {
        for q in 0..4 {
            let x = split(xp.add(16 * q));
            acc[q] = vfmaq_f32(acc[q], wv[q].0, x.0);
            acc[q] = vfmaq_f32(acc[q], wv[q].1, x.1);
        }
    }

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn tile<const R: usize, const NT: usize>(
        w: &WeightsView,
        row0: usize,
        xb: &Bf16Tokens,
        t0: usize,
    ) -> [[f32; NT]; R] {
        let cols = w.cols;
        let rb = 2 * cols;
        let z = vdupq_n_f32(0.0);
        let mut acc = [[[z; 4]; NT]; R];
        let mut wp = [std::ptr::null::<u8>(); R];
        for i in 0..R {
            wp[i] = w.data.as_ptr().add((row0 + i) * rb);
        }
        let ahead = tile_prefetch_distance(R * rb);
        let mut xp = [std::ptr::null::<u8>(); NT];
        for t in 0..NT {
            xp[t] = xb.token(t0 + t).as_ptr() as *const u8;
        }
        let full = cols / CHUNK * CHUNK;
        let mut c = 0;
        while c < full {
            for i in 0..R {
                prefetch_tile_ahead(wp[i], ahead + 2 * c);
                let wv = split_chunk(wp[i].add(2 * c));
                for t in 0..NT {
                    chunk(&mut acc[i][t], &wv, xp[t].add(2 * c));
                }
            }
            c += CHUNK;
        }
        if c < cols {
            let k = 2 * (cols - c);
            let mut xpad = [[0u8; 64]; NT];
            for t in 0..NT {
                std::ptr::copy_nonoverlapping(xp[t].add(2 * c), xpad[t].as_mut_ptr(), k);
            }
            for i in 0..R {
                let mut wpad = [0u8; 64];
                std::ptr::copy_nonoverlapping(wp[i].add(2 * c), wpad.as_mut_ptr(), k);
                let wv = split_chunk(wpad.as_ptr());
                for t in 0..NT {
                    chunk(&mut acc[i][t], &wv, xpad[t].as_ptr());
                }
            }
        }
        let mut res = [[0.0f32; NT]; R];
        for i in 0..R {
            for t in 0..NT {
                let a = &acc[i][t];
                // AVX2's lo + hi (lanes i and i + 8), then its `hsum`.
                let (lo, hi) = (vaddq_f32(a[0], a[2]), vaddq_f32(a[1], a[3]));
                let s = vaddq_f32(lo, hi);
                let p = vadd_f32(vget_low_f32(s), vget_high_f32(s));
                res[i][t] = vget_lane_f32::<0>(p) + vget_lane_f32::<1>(p);
            }
        }
        res
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    #![allow(clippy::needless_range_loop)]

    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{drive, write, Bf16Tokens, CHUNK};
    use crate::matrix::avx2::{prefetch_tile_ahead, tile_prefetch_distance};
    use crate::matrix::{OutRows, WeightsView};
    use crate::vector::avx2::hsum;

    /// Whether this CPU has `vdpbf16ps` (checked once).
    pub(crate) fn supported() -> bool {
        static BF16: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *BF16.get_or_init(|| is_x86_feature_detected!("avx512bf16"))
    }

    /// # Safety
    /// The CPU supports the `Avx512` level and `avx512bf16` ([`supported`]); otherwise as
    /// [`super::avx2::matmul_rows`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    pub(crate) unsafe fn matmul_rows(
        w: &WeightsView,
        rows: Range<usize>,
        xb: &Bf16Tokens,
        n_tokens: usize,
        out: &OutRows,
    ) {
        // One 16-lane accumulator per (row, token): 8×1 in decode, 4×2, 4×3, 4×4.
        let r_of = |nt: usize| if nt == 1 { 8 } else { 4 };
        drive(w.cols, rows, n_tokens, r_of, |r, big, t0, nt| {
            // SAFETY: the tile's rows and tokens exist and are this task's (from `drive`), and
            // the CPU has the features (this function's contract).
            unsafe {
                match (big, nt) {
                    (8, _) => write(out, r, t0, &tile::<8, 1>(w, r, xb, t0)),
                    (4, 2) => write(out, r, t0, &tile::<4, 2>(w, r, xb, t0)),
                    (4, 3) => write(out, r, t0, &tile::<4, 3>(w, r, xb, t0)),
                    (4, _) => write(out, r, t0, &tile::<4, 4>(w, r, xb, t0)),
                    _ => one_row!(tile, w, xb, out, r, t0, nt),
                }
            }
        })
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    unsafe fn load_bh(p: *const u8) -> __m512bh {
        std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const __m512i))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    unsafe fn tile<const R: usize, const NT: usize>(
        w: &WeightsView,
        row0: usize,
        xb: &Bf16Tokens,
        t0: usize,
    ) -> [[f32; NT]; R] {
        let cols = w.cols;
        let rb = 2 * cols;
        let mut acc = [[_mm512_setzero_ps(); NT]; R];
        let mut wp = [std::ptr::null::<u8>(); R];
        for i in 0..R {
            wp[i] = w.data.as_ptr().add((row0 + i) * rb);
        }
        let ahead = tile_prefetch_distance(R * rb);
        let mut xp = [std::ptr::null::<u8>(); NT];
        for t in 0..NT {
            xp[t] = xb.token(t0 + t).as_ptr() as *const u8;
        }
        let full = cols / CHUNK * CHUNK;
        let mut c = 0;
        while c < full {
            let mut xs = [load_bh(xp[0].add(2 * c)); NT];
            for t in 1..NT {
                xs[t] = load_bh(xp[t].add(2 * c));
            }
            for i in 0..R {
                prefetch_tile_ahead(wp[i], ahead + 2 * c);
                let wv = load_bh(wp[i].add(2 * c));
                for t in 0..NT {
                    acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv, xs[t]);
                }
            }
            c += CHUNK;
        }
        if c < cols {
            let k = 2 * (cols - c);
            let mut xpad = [[0u8; 64]; NT];
            for t in 0..NT {
                std::ptr::copy_nonoverlapping(xp[t].add(2 * c), xpad[t].as_mut_ptr(), k);
            }
            for i in 0..R {
                let mut wpad = [0u8; 64];
                std::ptr::copy_nonoverlapping(wp[i].add(2 * c), wpad.as_mut_ptr(), k);
                let wv = load_bh(wpad.as_ptr());
                for t in 0..NT {
                    acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv, load_bh(xpad[t].as_ptr()));
                }
            }
        }
        let mut res = [[0.0f32; NT]; R];
        for i in 0..R {
            for t in 0..NT {
                let lo = _mm512_castps512_ps256(acc[i][t]);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[i][t])));
                res[i][t] = hsum(_mm256_add_ps(lo, hi));
            }
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use crate::matrix::w8a8::tests::{every_level_gives, levels, stream};
    use crate::matrix::{MatmulJob, Matrix, MatrixData};
    use crate::{bf16_to_f32, f32_to_bf16, Bytes};

    /// Normal-range bf16 weights and f32 activations (|v| in [2^-8, 2)).
    fn case(rows: usize, cols: usize, n_tokens: usize, seed: u64) -> (Matrix, Vec<f32>) {
        let mut next = stream(seed);
        let mut value = move || {
            let m = 1.0 + (next() >> 40) as f32 / (1u64 << 24) as f32;
            let e = (next() % 9) as i32 - 8;
            let v = m * 2f32.powi(e);
            if next() & 1 == 0 {
                v
            } else {
                -v
            }
        };
        let w: Vec<u16> = (0..rows * cols).map(|_| f32_to_bf16(value())).collect();
        let x: Vec<f32> = (0..n_tokens * cols).map(|_| value()).collect();
        let bytes = Bytes::from_vec(w.iter().flat_map(|v| v.to_le_bytes()).collect());
        let m = Matrix::new(rows, cols, MatrixData::Bf16(bytes)).unwrap();
        (m.to_bf16_dot(), x)
    }

    /// The module's definition, written out independently: per lane, odd column then even.
    fn reference(m: &Matrix, x: &[f32], n_tokens: usize) -> Vec<f32> {
        let (rows, cols) = (m.rows(), m.cols());
        let w = m.to_f32_vec();
        let mut out = vec![0.0f32; n_tokens * rows];
        for t in 0..n_tokens {
            let xr = |c: usize| {
                if c < cols {
                    bf16_to_f32(f32_to_bf16(x[t * cols + c]))
                } else {
                    0.0
                }
            };
            for r in 0..rows {
                let wr = |c: usize| if c < cols { w[r * cols + c] } else { 0.0 };
                let mut lane = [0.0f32; 16];
                for k in 0..cols.div_ceil(32) {
                    for (j, l) in lane.iter_mut().enumerate() {
                        let c = 32 * k + 2 * j;
                        *l = wr(c + 1).mul_add(xr(c + 1), *l);
                        *l = wr(c).mul_add(xr(c), *l);
                    }
                }
                let s: Vec<f32> = (0..8).map(|i| lane[i] + lane[i + 8]).collect();
                let s: Vec<f32> = (0..4).map(|i| s[i] + s[i + 4]).collect();
                out[t * rows + r] = (s[0] + s[2]) + (s[1] + s[3]);
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn every_level_equals_the_definition(
            rows in 1usize..40, cols in 1usize..300, n_tokens in 1usize..10, seed in any::<u64>()
        ) {
            let (m, x) = case(rows, cols, n_tokens, seed);
            prop_assert_eq!(m.format_name(), "bf16_dot");
            let want = reference(&m, &x, n_tokens);
            every_level_gives(&m, &x, n_tokens, &want)?;
            // Inside a group (one preparation shared with a plain bf16 job on the same x).
            let plain = Matrix::new(rows, cols, MatrixData::Bf16(match m.data() {
                MatrixData::Bf16Dot(b) => b.clone(),
                _ => unreachable!(),
            })).unwrap();
            let mut a = vec![f32::NAN; n_tokens * rows];
            let mut b = vec![f32::NAN; n_tokens * rows];
            Matrix::matmul_group(&mut [
                MatmulJob { w: &m, x: &x, n_tokens, out: &mut a },
                MatmulJob { w: &plain, x: &x, n_tokens, out: &mut b },
            ]);
            prop_assert_eq!(&a, &want);
            let mut b_alone = vec![f32::NAN; n_tokens * rows];
            plain.matmul(&x, n_tokens, &mut b_alone);
            prop_assert_eq!(&b, &b_alone);
            // Close to the f32 product: the activations' bf16 rounding (≤ 2^-8 relative) plus
            // f32 accumulation.
            let w = m.to_f32_vec();
            for t in 0..n_tokens {
                for r in 0..rows {
                    let (mut exact, mut l1) = (0.0f64, 0.0f64);
                    for c in 0..cols {
                        let p = w[r * cols + c] as f64 * x[t * cols + c] as f64;
                        exact += p;
                        l1 += p.abs();
                    }
                    let d = (want[t * rows + r] as f64 - exact).abs();
                    prop_assert!(d <= l1 * (2f64.powi(-8) + cols as f64 * 2f64.powi(-23)) + 1e-30,
                        "t {} r {}: {} vs {}", t, r, want[t * rows + r], exact);
                }
            }
        }
    }

    /// Lane 0 of the second chunk adds column 33's product before column 32's (`vdpbf16ps`'s
    /// order): (1 + −1) + 2^-24 = 2^-24, where the other order would give (1 + 2^-24) − 1 = 0.
    #[test]
    fn odd_column_first_within_a_pair() {
        let cols = 34;
        let mut w = vec![0.0f32; cols];
        let mut x = vec![0.0f32; cols];
        (w[1], x[1]) = (1.0, 1.0);
        (w[33], x[33]) = (-1.0, 1.0);
        (w[32], x[32]) = (2f32.powi(-12), 2f32.powi(-12));
        let bytes = Bytes::from_vec(
            w.iter()
                .flat_map(|&v| f32_to_bf16(v).to_le_bytes())
                .collect(),
        );
        let m = Matrix::new(1, cols, MatrixData::Bf16(bytes))
            .unwrap()
            .to_bf16_dot();
        for level in levels() {
            let mut out = [f32::NAN];
            m.matmul_rows_at(level, 0..1, &x, 1, &mut out);
            assert_eq!(out[0], 2f32.powi(-24), "{level:?}");
        }
        // Subnormal activations count as zero; others are rounded to bf16 (1 + 2^-9 → 1).
        let x2: Vec<f32> = (0..cols)
            .map(|c| match c {
                1 => 1.0 + 2f32.powi(-9),
                33 => 1e-39,
                _ => 0.0,
            })
            .collect();
        for level in levels() {
            let mut out = [f32::NAN];
            m.matmul_rows_at(level, 0..1, &x2, 1, &mut out);
            assert_eq!(out[0], 1.0, "{level:?}");
        }
    }
}
