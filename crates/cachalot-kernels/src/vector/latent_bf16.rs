//! Latent attention over a bf16 latent cache in BF16 × BF16 (`--kv-cache-dtype bf16` with
//! `--bf16-dot`): the seed's C16 cache used as its bf16 matmuls use it, and as llama.cpp uses its
//! f16 cache with rounded queries and probabilities. Spec: `deepseek-v3-r1-kimi-k2.md` §3.4
//! (absorbed MLA decode: scores q̃·c_kv + q^R·k^R against every cached latent row, then
//! ō = Σ_s p(s)·c_kv(s)).
//!
//! Values ([`axpy_rows_bf16`]): per (head, column) one chain over the position pairs in order,
//! `acc = (acc + p[s+1]·k[s+1][c]) + p[s]·k[s][c]` from zero, the probabilities rounded as the
//! queries are (an odd last row pairs with a zero); on AVX-512 BF16 a `vdpbf16ps` takes the two
//! rows' values of 16 columns, interleaved by `vpunpck{l,h}wd`.
//!
//! The result is defined by the operations of x86's `vdpbf16ps` with heads in lanes: per (row,
//! head) one chain over the column pairs in order,
//!
//!   acc = (acc + q[c+1]·k[c+1]) + q[c]·k[c],   c = 0, 2, 4, …
//!
//! each addition rounded to f32 (ties to even); a product of two bf16 values is exact in f32, so
//! an FMA gives the same bits. An odd last column pairs with a zero. Queries are rounded to bf16
//! ties-to-even with subnormals flushed to ±0 ([`HeadPairs`]); rows are the cache's bf16 bits.
//!
//! Levels: AVX-512 with the BF16 extension runs `vdpbf16ps` (two columns of 16 heads per
//! instruction, or of 8 in 256 bits for up to 8 heads, against one column for the f32 FMA of
//! `dot_rows_lanes`); AVX2, and AVX-512 without BF16, split each pair into its odd (`and
//! 0xFFFF0000`) and even (`<< 16`) element for two FMAs in 8 lanes, NEON the same in 4 lanes;
//! scalar follows the definition. As for `matrix::bf16dot`, `vdpbf16ps` also treats
//! subnormal row values as zero and flushes subnormal sums, the other levels do not: results
//! can differ below 2^−126 (never for RMS-normed latents; the property tests draw normal values).

use crate::matrix::bf16dot::round_activation;
use crate::simd::{simd_level, SimdLevel};

/// `heads` queries of `d` values rounded to bf16 and laid out for [`dot_rows_bf16`]: per column
/// pair p, `hp` (a multiple of 16) u32 lanes, lane h holding head h's (q\[2p\], q\[2p+1\]) bf16
/// bits (column 2p in the low half; zero past the heads and past an odd `d`).
pub struct HeadPairs {
    qp: Vec<u32>,
    heads: usize,
    d: usize,
    hp: usize,
}

impl HeadPairs {
    /// The `heads` rows of `q` (each `q.len() / heads` values), rounded to bf16.
    pub fn new(q: &[f32], heads: usize) -> HeadPairs {
        assert!(
            heads > 0 && q.len().is_multiple_of(heads),
            "HeadPairs: q ({} values) must hold {heads} rows",
            q.len()
        );
        let d = q.len() / heads;
        let hp = heads.div_ceil(16) * 16;
        let pairs = d.div_ceil(2);
        let mut qp = vec![0u32; pairs * hp];
        for h in 0..heads {
            let row = &q[h * d..(h + 1) * d];
            for p in 0..pairs {
                let lo = round_activation(row[2 * p]) as u32;
                let hi = row
                    .get(2 * p + 1)
                    .map_or(0, |&v| round_activation(v) as u32);
                qp[p * hp + h] = lo | (hi << 16);
            }
        }
        HeadPairs { qp, heads, d, hp }
    }
}

/// out\[s·H + h\] = head h's query · `rows[s]` by the `vdpbf16ps` chain of the module doc, for
/// every row s (`rows[s]`: `d` bf16 bit patterns) and head h < H.
pub fn dot_rows_bf16(q: &HeadPairs, rows: &[&[u16]], out: &mut [f32]) {
    dot_rows_bf16_at(simd_level(), q, rows, out)
}

pub(crate) fn dot_rows_bf16_at(level: SimdLevel, q: &HeadPairs, rows: &[&[u16]], out: &mut [f32]) {
    assert!(
        out.len() == rows.len() * q.heads,
        "dot_rows_bf16: out must hold rows.len() ({}) x {} heads values, got {}",
        rows.len(),
        q.heads,
        out.len()
    );
    assert!(
        rows.iter().all(|r| r.len() == q.d),
        "dot_rows_bf16: every row must hold the queries' {} values",
        q.d
    );
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` implies AVX-512 F/BW/VL, AVX2 and FMA; `supported()` checked the
        // BF16 extension; lengths were checked above.
        SimdLevel::Avx512 if crate::matrix::bf16dot::avx512::supported() => unsafe {
            avx512::dot_rows(q, rows, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: both levels have AVX2 and FMA; lengths were checked above.
        SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe { avx2::dot_rows(q, rows, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: every aarch64 CPU has NEON; lengths were checked above.
        SimdLevel::Neon => unsafe { neon::dot_rows(q, rows, out) },
        _ => scalar_dot_rows(q, rows, out),
    }
}

/// Each head's probabilities over `rows.len()` positions as bf16 pairs: `pp[sp·H + h]` holds
/// (p\[2sp\]\[h\], p\[2sp+1\]\[h\]) rounded (column 2sp low; zero past an odd count).
fn prob_pairs(p: &[f32], n: usize, heads: usize) -> Vec<u32> {
    let sp = n.div_ceil(2);
    let mut pp = vec![0u32; sp * heads];
    for s in 0..n {
        for h in 0..heads {
            let b = round_activation(p[s * heads + h]) as u32;
            pp[(s / 2) * heads + h] |= if s % 2 == 0 { b } else { b << 16 };
        }
    }
    pp
}

/// y\[h·d + c\] = Σ_s p\[s·H + h\]·rows\[s\]\[c\] for every head h < H and column c < d
/// (`d = y.len() / H`; each row holds at least d bf16 values, the rest unread), by the chain of
/// the module doc: y is overwritten, not added to.
pub fn axpy_rows_bf16(p: &[f32], rows: &[&[u16]], y: &mut [f32]) {
    axpy_rows_bf16_at(simd_level(), p, rows, y)
}

pub(crate) fn axpy_rows_bf16_at(level: SimdLevel, p: &[f32], rows: &[&[u16]], y: &mut [f32]) {
    let n = rows.len();
    if n == 0 {
        // Every chain is empty.
        y.fill(0.0);
        return;
    }
    assert!(
        p.len().is_multiple_of(n) && !p.is_empty(),
        "axpy_rows_bf16: p must hold rows.len() ({n}) x heads values, got {}",
        p.len()
    );
    let heads = p.len() / n;
    assert!(
        y.len().is_multiple_of(heads),
        "axpy_rows_bf16: y ({}) must hold {heads} heads' rows",
        y.len()
    );
    let d = y.len() / heads;
    assert!(
        rows.iter().all(|r| r.len() >= d),
        "axpy_rows_bf16: every row must hold at least y's {d} columns"
    );
    let pp = prob_pairs(p, n, heads);
    let done = match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot_rows_bf16_at`; lengths were checked above.
        SimdLevel::Avx512 if crate::matrix::bf16dot::avx512::supported() => unsafe {
            avx512::axpy_rows(&pp, heads, rows, d, y)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: both levels have AVX2 and FMA; lengths were checked above.
        SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe { avx2::axpy_rows(&pp, heads, rows, d, y) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: every aarch64 CPU has NEON; lengths were checked above.
        SimdLevel::Neon => unsafe { neon::axpy_rows(&pp, heads, rows, d, y) },
        _ => 0,
    };
    scalar_axpy_columns(&pp, heads, rows, d, done..d, y);
}

/// The definition for columns `cols` of every head.
fn scalar_axpy_columns(
    pp: &[u32],
    heads: usize,
    rows: &[&[u16]],
    d: usize,
    cols: std::ops::Range<usize>,
    y: &mut [f32],
) {
    let k = |s: usize, c: usize| {
        rows.get(s)
            .map_or(0.0, |r| f32::from_bits((r[c] as u32) << 16))
    };
    for h in 0..heads {
        for c in cols.clone() {
            let mut acc = 0.0f32;
            for sp in 0..rows.len().div_ceil(2) {
                let pv = pp[sp * heads + h];
                acc += f32::from_bits(pv & 0xFFFF_0000) * k(2 * sp + 1, c);
                acc += f32::from_bits(pv << 16) * k(2 * sp, c);
            }
            y[h * d + c] = acc;
        }
    }
}

/// The definition, one (row, head) at a time.
pub(crate) fn scalar_dot_rows(q: &HeadPairs, rows: &[&[u16]], out: &mut [f32]) {
    let pairs = q.d.div_ceil(2);
    for (s, row) in rows.iter().enumerate() {
        for h in 0..q.heads {
            let mut acc = 0.0f32;
            for p in 0..pairs {
                let qv = q.qp[p * q.hp + h];
                let k0 = row[2 * p];
                let k1 = row.get(2 * p + 1).copied().unwrap_or(0);
                acc += f32::from_bits(qv & 0xFFFF_0000) * f32::from_bits((k1 as u32) << 16);
                acc += f32::from_bits(qv << 16) * f32::from_bits((k0 as u32) << 16);
            }
            out[s * q.heads + h] = acc;
        }
    }
}

/// Per pair of rows, each head's probability of the odd row (`p1`) and of the even one (`p0`)
/// as f32, `hp` (heads rounded up to 8) per pair; heads past H are zero (their sums are not
/// stored). For the value kernels that broadcast each head's probability.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn prob_halves(pp: &[u32], heads: usize, pairs: usize) -> (Vec<f32>, Vec<f32>, usize) {
    let hp = heads.div_ceil(8) * 8;
    let mut p1 = vec![0.0f32; pairs * hp];
    let mut p0 = vec![0.0f32; pairs * hp];
    for sp in 0..pairs {
        for h in 0..heads {
            let v = pp[sp * heads + h];
            p1[sp * hp + h] = f32::from_bits(v & 0xFFFF_0000);
            p0[sp * hp + h] = f32::from_bits(v << 16);
        }
    }
    (p1, p0, hp)
}

/// Row `r`'s pair `p` as a u32 (column 2p low); an odd last column pairs with zero.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline]
fn pair(row: &[u16], p: usize) -> u32 {
    let lo = row[2 * p] as u32;
    let hi = row.get(2 * p + 1).map_or(0, |&v| v as u32);
    lo | (hi << 16)
}

/// Tiles of 8, 4 and 1 rows for every group of `lanes` heads, `tile(r0, R, hb)` doing the work.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline]
fn for_tiles(n: usize, heads: usize, lanes: usize, mut tile: impl FnMut(usize, usize, usize)) {
    let mut hb = 0;
    while hb < heads {
        let mut s0 = 0;
        while s0 < n {
            let r = match n - s0 {
                8.. => 8,
                4..=7 => 4,
                _ => 1,
            };
            tile(s0, r, hb);
            s0 += r;
        }
        hb += lanes;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    #![allow(clippy::needless_range_loop)]

    use std::arch::x86_64::*;

    use super::{for_tiles, pair, prob_halves, HeadPairs};

    /// # Safety
    /// The CPU has AVX2 and FMA; lengths as `dot_rows_bf16_at` checks them.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_rows(q: &HeadPairs, rows: &[&[u16]], out: &mut [f32]) {
        // Sixteen heads at a time where there are more than eight: a row pair's two halves,
        // split once, serve both groups of 8 (4 FMAs per split instead of 2).
        let n = rows.len();
        let mut hb = 0;
        while hb + 8 < q.heads {
            let mut s0 = 0;
            while s0 + 4 <= n {
                tile2::<4>(q, rows, s0, hb, out);
                s0 += 4;
            }
            while s0 < n {
                tile2::<1>(q, rows, s0, hb, out);
                s0 += 1;
            }
            hb += 16;
        }
        if hb < q.heads {
            for_tiles(n, q.heads - hb, 8, |s0, r, _| match r {
                // SAFETY: this function's contract.
                8 => unsafe { tile::<8>(q, rows, s0, hb, out) },
                4 => unsafe { tile::<4>(q, rows, s0, hb, out) },
                _ => unsafe { tile::<1>(q, rows, s0, hb, out) },
            });
        }
    }

    /// Rows s0..s0+R against heads hb..hb+16 (those below H written): per (row, head) the
    /// same chain as [`tile`]. (Kept apart from it: one tile generic over the number of head
    /// groups ran 31.5 against 37 GFMA/s here, `attention_throughput 16 128` at AVX2.)
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile2<const R: usize>(
        q: &HeadPairs,
        rows: &[&[u16]],
        s0: usize,
        hb: usize,
        out: &mut [f32],
    ) {
        let pairs = q.d.div_ceil(2);
        let full = q.d / 2;
        let hi_mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut rp = [std::ptr::null::<u16>(); R];
        for r in 0..R {
            rp[r] = rows[s0 + r].as_ptr();
        }
        for p in 0..pairs {
            let qa = _mm256_loadu_si256(q.qp.as_ptr().add(p * q.hp + hb) as *const __m256i);
            let qb = _mm256_loadu_si256(q.qp.as_ptr().add(p * q.hp + hb + 8) as *const __m256i);
            let q1a = _mm256_castsi256_ps(_mm256_and_si256(qa, hi_mask));
            let q0a = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(qa));
            let q1b = _mm256_castsi256_ps(_mm256_and_si256(qb, hi_mask));
            let q0b = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(qb));
            for r in 0..R {
                let k = if p < full {
                    (rp[r].add(2 * p) as *const u32).read_unaligned()
                } else {
                    pair(rows[s0 + r], p)
                };
                let kv = _mm256_set1_epi32(k as i32);
                let k1 = _mm256_castsi256_ps(_mm256_and_si256(kv, hi_mask));
                let k0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(kv));
                acc[r][0] = _mm256_fmadd_ps(q1a, k1, acc[r][0]);
                acc[r][0] = _mm256_fmadd_ps(q0a, k0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(q1b, k1, acc[r][1]);
                acc[r][1] = _mm256_fmadd_ps(q0b, k0, acc[r][1]);
            }
        }
        let nh = (q.heads - hb).min(16);
        let mut tmp = [0.0f32; 16];
        for r in 0..R {
            _mm256_storeu_ps(tmp.as_mut_ptr(), acc[r][0]);
            _mm256_storeu_ps(tmp.as_mut_ptr().add(8), acc[r][1]);
            let o = (s0 + r) * q.heads + hb;
            out[o..o + nh].copy_from_slice(&tmp[..nh]);
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize>(
        q: &HeadPairs,
        rows: &[&[u16]],
        s0: usize,
        hb: usize,
        out: &mut [f32],
    ) {
        let pairs = q.d.div_ceil(2);
        let full = q.d / 2;
        let hi_mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut rp = [std::ptr::null::<u16>(); R];
        for r in 0..R {
            rp[r] = rows[s0 + r].as_ptr();
        }
        for p in 0..pairs {
            let qv = _mm256_loadu_si256(q.qp.as_ptr().add(p * q.hp + hb) as *const __m256i);
            let q1 = _mm256_castsi256_ps(_mm256_and_si256(qv, hi_mask));
            let q0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(qv));
            for r in 0..R {
                let k = if p < full {
                    (rp[r].add(2 * p) as *const u32).read_unaligned()
                } else {
                    pair(rows[s0 + r], p)
                };
                let kv = _mm256_set1_epi32(k as i32);
                let k1 = _mm256_castsi256_ps(_mm256_and_si256(kv, hi_mask));
                let k0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(kv));
                acc[r] = _mm256_fmadd_ps(q1, k1, acc[r]);
                acc[r] = _mm256_fmadd_ps(q0, k0, acc[r]);
            }
        }
        let nh = (q.heads - hb).min(8);
        let mut tmp = [0.0f32; 8];
        for r in 0..R {
            _mm256_storeu_ps(tmp.as_mut_ptr(), acc[r]);
            let o = (s0 + r) * q.heads + hb;
            out[o..o + nh].copy_from_slice(&tmp[..nh]);
        }
    }

    /// Columns in blocks of 8 for groups of 8 heads; returns the first column not done (the
    /// rest go to the scalar definition). Each row pair's 8 columns are widened once per head
    /// group and meet each head's probabilities, split once into f32 halves and broadcast from
    /// memory: 16 FMAs per two widenings (widening them again per head, as this did before,
    /// held it to ~21 GFMA/s on one core of an AVX-512 Xeon at the AVX2 level).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; lengths as `axpy_rows_bf16_at` checks them.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy_rows(
        pp: &[u32],
        heads: usize,
        rows: &[&[u16]],
        d: usize,
        y: &mut [f32],
    ) -> usize {
        let pairs = rows.len().div_ceil(2);
        let (p1, p0, hp) = prob_halves(pp, heads, pairs);
        let widen = |p: *const u16| {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p as *const __m128i),
            )))
        };
        let full = d / 8 * 8;
        let mut c = 0;
        while c < full {
            let mut hg = 0;
            while hg < heads {
                let mut acc = [_mm256_setzero_ps(); 8];
                for sp in 0..pairs {
                    let k0 = widen(rows[2 * sp].as_ptr().add(c));
                    let k1 = match rows.get(2 * sp + 1) {
                        Some(r) => widen(r.as_ptr().add(c)),
                        None => _mm256_setzero_ps(),
                    };
                    let a1 = p1.as_ptr().add(sp * hp + hg);
                    let a0 = p0.as_ptr().add(sp * hp + hg);
                    for j in 0..8 {
                        acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*a1.add(j)), k1, acc[j]);
                        acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*a0.add(j)), k0, acc[j]);
                    }
                }
                for j in 0..(heads - hg).min(8) {
                    _mm256_storeu_ps(y.as_mut_ptr().add((hg + j) * d + c), acc[j]);
                }
                hg += 8;
            }
            c += 8;
        }
        full
    }
}

/// The AVX2 level's split of each pair into its odd (`and 0xFFFF0000`) and even (`<< 16`)
/// element, in 4-lane registers: the scores hold 4 heads in lanes, the values 4 columns; every
/// (row, head) or (head, column) chain is the module doc's, so the bits are every level's.
#[cfg(target_arch = "aarch64")]
mod neon {
    #![allow(clippy::needless_range_loop)]

    use std::arch::aarch64::*;

    use super::{for_tiles, pair, prob_halves, HeadPairs};
    use crate::vector::prefetch_rows;
    use crate::vector::{PREFETCH_L1, PREFETCH_L2};

    /// (odd, even) elements of 4 bf16 pairs as f32 lanes.
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn split(v: uint32x4_t) -> (float32x4_t, float32x4_t) {
        (
            vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xFFFF_0000))),
            vreinterpretq_f32_u32(vshlq_n_u32::<16>(v)),
        )
    }

    /// # Safety
    /// The CPU has NEON; lengths as `dot_rows_bf16_at` checks them.
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn dot_rows(q: &HeadPairs, rows: &[&[u16]], out: &mut [f32]) {
        prefetch_rows::<PREFETCH_L2, _>(rows, 0..rows.len());
        for_tiles(rows.len(), q.heads, 4, |s0, r, hb| {
            prefetch_rows::<PREFETCH_L1, _>(rows, s0 + r..s0 + 2 * r);
            match r {
                // SAFETY: this function's contract.
                8 => unsafe { tile::<8>(q, rows, s0, hb, out) },
                4 => unsafe { tile::<4>(q, rows, s0, hb, out) },
                _ => unsafe { tile::<1>(q, rows, s0, hb, out) },
            }
        });
    }

    /// Rows s0..s0+R against heads hb..hb+4 (those below H written).
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn tile<const R: usize>(
        q: &HeadPairs,
        rows: &[&[u16]],
        s0: usize,
        hb: usize,
        out: &mut [f32],
    ) {
        let pairs = q.d.div_ceil(2);
        let full = q.d / 2;
        let mut acc = [vdupq_n_f32(0.0); R];
        let mut rp = [std::ptr::null::<u16>(); R];
        for r in 0..R {
            rp[r] = rows[s0 + r].as_ptr();
        }
        for p in 0..pairs {
            let (q1, q0) = split(vld1q_u32(q.qp.as_ptr().add(p * q.hp + hb)));
            for r in 0..R {
                let k = if p < full {
                    (rp[r].add(2 * p) as *const u32).read_unaligned()
                } else {
                    pair(rows[s0 + r], p)
                };
                let (k1, k0) = split(vdupq_n_u32(k));
                acc[r] = vfmaq_f32(acc[r], q1, k1);
                acc[r] = vfmaq_f32(acc[r], q0, k0);
            }
        }
        let nh = (q.heads - hb).min(4);
        let mut tmp = [0.0f32; 4];
        for r in 0..R {
            vst1q_f32(tmp.as_mut_ptr(), acc[r]);
            let o = (s0 + r) * q.heads + hb;
            out[o..o + nh].copy_from_slice(&tmp[..nh]);
        }
    }

    /// Columns in blocks of 4 for groups of 8 heads; returns the first column not done (the
    /// rest go to the scalar definition). Each row pair's 4 columns are widened once per head
    /// group and meet each head's probabilities, split once into f32 halves.
    ///
    /// # Safety
    /// The CPU has NEON; lengths as `axpy_rows_bf16_at` checks them.
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn axpy_rows(
        pp: &[u32],
        heads: usize,
        rows: &[&[u16]],
        d: usize,
        y: &mut [f32],
    ) -> usize {
        let pairs = rows.len().div_ceil(2);
        let (p1, p0, hp) = prob_halves(pp, heads, pairs);
        let widen = |p: *const u16| vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p)));
        let full = d / 4 * 4;
        let mut c = 0;
        while c < full {
            let mut hg = 0;
            while hg < heads {
                let mut acc = [vdupq_n_f32(0.0); 8];
                for sp in 0..pairs {
                    let k0 = widen(rows[2 * sp].as_ptr().add(c));
                    let k1 = match rows.get(2 * sp + 1) {
                        Some(r) => widen(r.as_ptr().add(c)),
                        None => vdupq_n_f32(0.0),
                    };
                    let a1 = p1.as_ptr().add(sp * hp + hg);
                    let a0 = p0.as_ptr().add(sp * hp + hg);
                    for j in 0..8 {
                        acc[j] = vfmaq_f32(acc[j], vdupq_n_f32(*a1.add(j)), k1);
                        acc[j] = vfmaq_f32(acc[j], vdupq_n_f32(*a0.add(j)), k0);
                    }
                }
                for j in 0..(heads - hg).min(8) {
                    vst1q_f32(y.as_mut_ptr().add((hg + j) * d + c), acc[j]);
                }
                hg += 8;
            }
            c += 4;
        }
        full
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    #![allow(clippy::needless_range_loop)]

    use std::arch::x86_64::*;

    use super::{for_tiles, pair, HeadPairs};
    use crate::vector::prefetch_rows;

    /// # Safety
    /// The CPU has AVX-512 F/BW/VL and BF16, AVX2 and FMA; lengths as `dot_rows_bf16_at`
    /// checks them.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    pub(super) unsafe fn dot_rows(q: &HeadPairs, rows: &[&[u16]], out: &mut [f32]) {
        // Up to 8 heads fill a 256-bit vector (16 lanes would run half empty at half the
        // instruction rate); more take 512-bit ones.
        let lanes = if q.heads <= 8 { 8 } else { 16 };
        // Every row asked into L2 up front (a work unit's 128 rows of 576 are 147 KB), the
        // next tile's into L1 as each tile starts: the rows come from DRAM in a decode step
        // (the weights streamed since have evicted them), and the unit's first tiles would
        // otherwise wait for them (`attn_core` of the 1 B W8A8 model at a 512-token context,
        // three alternating rounds: 0.076 / 0.085 / 0.092 → 0.071 / 0.072 / 0.085 s). Hints
        // only.
        prefetch_rows::<_MM_HINT_T1, _>(rows, 0..rows.len());
        for_tiles(rows.len(), q.heads, lanes, |s0, r, hb| {
            // The next tile's rows (scattered over the paged cache) load while this one runs.
            prefetch_rows::<_MM_HINT_T0, _>(rows, s0 + r..s0 + 2 * r);
            // SAFETY: this function's contract.
            unsafe {
                match (lanes, r) {
                    (8, 8) => tile8::<8>(q, rows, s0, hb, out),
                    (8, 4) => tile8::<4>(q, rows, s0, hb, out),
                    (8, _) => tile8::<1>(q, rows, s0, hb, out),
                    (_, 8) => tile::<8>(q, rows, s0, hb, out),
                    (_, 4) => tile::<4>(q, rows, s0, hb, out),
                    _ => tile::<1>(q, rows, s0, hb, out),
                }
            }
        });
    }

    /// Columns in blocks of 32 for up to 8 heads at a time (16 accumulators: each head's 32
    /// columns as the two `vpunpck{l,h}wd` halves); returns the first column not done.
    ///
    /// # Safety
    /// As [`dot_rows`]; lengths as `axpy_rows_bf16_at` checks them.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    pub(super) unsafe fn axpy_rows(
        pp: &[u32],
        heads: usize,
        rows: &[&[u16]],
        d: usize,
        y: &mut [f32],
    ) -> usize {
        let full = d / 32 * 32;
        let mut h0 = 0;
        while h0 < heads {
            let nh = (heads - h0).min(8);
            let mut c = 0;
            while c < full {
                match nh {
                    8 => vblock::<8>(pp, heads, rows, d, h0, c, y),
                    4..=7 => {
                        vblock::<4>(pp, heads, rows, d, h0, c, y);
                        for h in h0 + 4..h0 + nh {
                            vblock::<1>(pp, heads, rows, d, h, c, y);
                        }
                    }
                    _ => {
                        for h in h0..h0 + nh {
                            vblock::<1>(pp, heads, rows, d, h, c, y);
                        }
                    }
                }
                c += 32;
            }
            h0 += nh;
        }
        full
    }

    /// Heads h0..h0+NH, columns c..c+32, over every row pair.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    unsafe fn vblock<const NH: usize>(
        pp: &[u32],
        heads: usize,
        rows: &[&[u16]],
        d: usize,
        h0: usize,
        c: usize,
        y: &mut [f32],
    ) {
        let n = rows.len();
        let bh = |v: __m512i| std::mem::transmute::<__m512i, __m512bh>(v);
        let mut acc = [[_mm512_setzero_ps(); 2]; NH];
        for sp in 0..n.div_ceil(2) {
            let k0 = _mm512_loadu_si512(rows[2 * sp].as_ptr().add(c) as *const __m512i);
            let k1 = match rows.get(2 * sp + 1) {
                Some(r) => _mm512_loadu_si512(r.as_ptr().add(c) as *const __m512i),
                None => _mm512_setzero_si512(),
            };
            // Per 128-bit lane L: (row 2sp, row 2sp+1) pairs of columns 8L..8L+4 (lo) and
            // 8L+4..8L+8 (hi).
            let lo = bh(_mm512_unpacklo_epi16(k0, k1));
            let hi = bh(_mm512_unpackhi_epi16(k0, k1));
            let pr = pp.as_ptr().add(sp * heads + h0);
            for j in 0..NH {
                let pv = bh(_mm512_set1_epi32(*pr.add(j) as i32));
                acc[j][0] = _mm512_dpbf16_ps(acc[j][0], lo, pv);
                acc[j][1] = _mm512_dpbf16_ps(acc[j][1], hi, pv);
            }
        }
        // Back to column order: lo holds columns {0-3, 8-11, 16-19, 24-27}, hi the others.
        let first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        let second =
            _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        for j in 0..NH {
            let o = y.as_mut_ptr().add((h0 + j) * d + c);
            _mm512_storeu_ps(o, _mm512_permutex2var_ps(acc[j][0], first, acc[j][1]));
            _mm512_storeu_ps(
                o.add(16),
                _mm512_permutex2var_ps(acc[j][0], second, acc[j][1]),
            );
        }
    }

    /// A score tile for one vector width: `$name::<R>(q, rows, s0, hb, out)` scores rows
    /// s0..s0+R against heads hb..hb+LANES (those below H written).
    macro_rules! score_tile {
        ($name:ident, $lanes:literal, $vi:ty, $vbh:ty, $vps:ty, $zero:ident, $load:ident,
         $set1:ident, $dp:ident, $store:ident) => {
            #[inline]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
            unsafe fn $name<const R: usize>(
                q: &HeadPairs,
                rows: &[&[u16]],
                s0: usize,
                hb: usize,
                out: &mut [f32],
            ) {
                let pairs = q.d.div_ceil(2);
                let full = q.d / 2;
                let mut acc: [$vps; R] = [$zero(); R];
                let mut rp = [std::ptr::null::<u16>(); R];
                for r in 0..R {
                    rp[r] = rows[s0 + r].as_ptr();
                }
                let bh = |v: $vi| std::mem::transmute::<$vi, $vbh>(v);
                for p in 0..pairs {
                    let qv = bh($load(q.qp.as_ptr().add(p * q.hp + hb) as *const $vi));
                    for r in 0..R {
                        let k = if p < full {
                            (rp[r].add(2 * p) as *const u32).read_unaligned()
                        } else {
                            pair(rows[s0 + r], p)
                        };
                        acc[r] = $dp(acc[r], qv, bh($set1(k as i32)));
                    }
                }
                let nh = (q.heads - hb).min($lanes);
                let mut tmp = [0.0f32; $lanes];
                for r in 0..R {
                    $store(tmp.as_mut_ptr(), acc[r]);
                    let o = (s0 + r) * q.heads + hb;
                    out[o..o + nh].copy_from_slice(&tmp[..nh]);
                }
            }
        };
    }

    score_tile!(
        tile,
        16,
        __m512i,
        __m512bh,
        __m512,
        _mm512_setzero_ps,
        _mm512_loadu_si512,
        _mm512_set1_epi32,
        _mm512_dpbf16_ps,
        _mm512_storeu_ps
    );
    score_tile!(
        tile8,
        8,
        __m256i,
        __m256bh,
        __m256,
        _mm256_setzero_ps,
        _mm256_loadu_si256,
        _mm256_set1_epi32,
        _mm256_dpbf16_ps,
        _mm256_storeu_ps
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f32_to_bf16;
    use proptest::prelude::*;

    /// Normal values of either sign over a few binades (no subnormals: the module doc's
    /// caveat).
    fn normal(seed: u64, i: usize) -> f32 {
        let x = (seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let m = ((x >> 40) as f32 / (1u64 << 24) as f32) * 3.0 + 0.25;
        if x & 1 == 0 {
            m
        } else {
            -m
        }
    }

    fn case(heads: usize, d: usize, n: usize, seed: u64) -> (HeadPairs, Vec<Vec<u16>>) {
        let q: Vec<f32> = (0..heads * d).map(|i| normal(seed, i)).collect();
        let rows = (0..n)
            .map(|s| {
                (0..d)
                    .map(|c| f32_to_bf16(normal(seed + 1, s * d + c)))
                    .collect()
            })
            .collect();
        (HeadPairs::new(&q, heads), rows)
    }

    /// `run(level, out)` on a NaN-filled output of `len` values at every SIMD level this CPU
    /// has.
    fn at_every_level(
        len: usize,
        run: impl Fn(SimdLevel, &mut [f32]),
    ) -> Vec<(SimdLevel, Vec<f32>)> {
        SimdLevel::ALL
            .iter()
            .copied()
            .filter(|l| *l != SimdLevel::Scalar && l.supported())
            .map(|l| {
                let mut out = vec![f32::NAN; len];
                run(l, &mut out);
                (l, out)
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Every level gives the definition's bits: heads 1..40 (one to three lane groups),
        /// even and odd widths, row counts covering the 8-, 4- and 1-row tiles.
        #[test]
        fn levels_match_the_definition(
            heads in 1usize..40, d in 1usize..90, n in 0usize..23, seed in any::<u64>()
        ) {
            let (q, rows) = case(heads, d, n, seed);
            let refs: Vec<&[u16]> = rows.iter().map(Vec::as_slice).collect();
            let mut want = vec![0.0f32; n * heads];
            scalar_dot_rows(&q, &refs, &mut want);
            for (level, got) in at_every_level(n * heads, |l, out| {
                dot_rows_bf16_at(l, &q, &refs, out)
            }) {
                prop_assert_eq!(bits(&got), bits(&want), "{:?}", level);
            }
        }
    }

    /// The definition is the dot product of the bf16-rounded values, up to f32 rounding.
    #[test]
    fn scores_are_the_rounded_dot_products() {
        let (heads, d, n) = (16, 576, 9);
        let (q, rows) = case(heads, d, n, 7);
        let refs: Vec<&[u16]> = rows.iter().map(Vec::as_slice).collect();
        let mut got = vec![0.0f32; n * heads];
        dot_rows_bf16(&q, &refs, &mut got);
        for s in 0..n {
            for h in 0..heads {
                let exact: f64 = (0..d)
                    .map(|c| {
                        let qv = q.qp[(c / 2) * q.hp + h];
                        let qb = if c % 2 == 0 {
                            qv << 16
                        } else {
                            qv & 0xFFFF_0000
                        };
                        f32::from_bits(qb) as f64 * f32::from_bits((rows[s][c] as u32) << 16) as f64
                    })
                    .sum();
                let g = got[s * heads + h] as f64;
                assert!(
                    (g - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
                    "{g} vs {exact}"
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// The value pass: every level gives the definition's bits, heads 1..20 (8-, 4- and
        /// 1-head blocks), widths with and without a ragged tail, odd and even row counts, rows
        /// longer than d.
        #[test]
        fn value_levels_match_the_definition(
            heads in 1usize..20, d in 1usize..100, extra in 0usize..3, n in 1usize..21,
            seed in any::<u64>()
        ) {
            let p: Vec<f32> = (0..n * heads).map(|i| normal(seed, i).abs() / 4.0).collect();
            // Row values over 2^-6..2^6, so partial sums need more than f32's bits and their
            // order shows in the result (with values of one scale most sums are exact).
            let rows: Vec<Vec<u16>> = (0..n)
                .map(|s| (0..d + extra).map(|c| {
                    let i = s * 131 + c;
                    let scale = 2f32.powi((i * 7919 % 13) as i32 - 6);
                    f32_to_bf16(normal(seed + 3, i) * scale)
                }).collect())
                .collect();
            let refs: Vec<&[u16]> = rows.iter().map(Vec::as_slice).collect();
            let pp = prob_pairs(&p, n, heads);
            let mut want = vec![0.0f32; heads * d];
            scalar_axpy_columns(&pp, heads, &refs, d, 0..d, &mut want);
            for (level, got) in at_every_level(heads * d, |l, out| {
                axpy_rows_bf16_at(l, &p, &refs, out)
            }) {
                prop_assert_eq!(bits(&got), bits(&want), "{:?}", level);
            }
        }
    }

    /// The value pass is Σ p·k over the bf16-rounded probabilities and rows, up to f32 rounding.
    #[test]
    fn values_are_the_rounded_weighted_sums() {
        let (heads, d, n) = (16, 512, 37);
        let p: Vec<f32> = (0..n * heads).map(|i| normal(5, i).abs() / 10.0).collect();
        let rows: Vec<Vec<u16>> = (0..n)
            .map(|s| (0..d).map(|c| f32_to_bf16(normal(9, s * d + c))).collect())
            .collect();
        let refs: Vec<&[u16]> = rows.iter().map(Vec::as_slice).collect();
        let mut got = vec![0.0f32; heads * d];
        axpy_rows_bf16(&p, &refs, &mut got);
        for h in 0..heads {
            for c in 0..d {
                let exact: f64 = (0..n)
                    .map(|s| {
                        let pb = crate::bf16_to_f32(round_activation(p[s * heads + h])) as f64;
                        pb * f32::from_bits((rows[s][c] as u32) << 16) as f64
                    })
                    .sum();
                let g = got[h * d + c] as f64;
                assert!(
                    (g - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
                    "{g} vs {exact}"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "every row must hold")]
    fn a_short_row_is_refused() {
        let (q, _) = case(4, 10, 0, 1);
        let row = [0u16; 9];
        dot_rows_bf16(&q, &[&row[..]], &mut [0.0; 4]);
    }
}
