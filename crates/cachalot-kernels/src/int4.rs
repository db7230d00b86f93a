//! INT4 per-channel quantization with a clipping-range search, DeepSeek-V4's `w4a8-int` routed
//! experts (spec `deepseek-v4.md` §4.4), in the converter's bf16 tensor arithmetic (every op is
//! computed in f32 and rounded to bf16, [`bf16_round`]; sums accumulate in f32 and round once).
//!
//! For a row with signed maximum `mx`, candidates `c_i = bf16(f32(0.70 + 0.01·i) · mx)`,
//! i = 0..60: `s = bf16(c/7)`, `inv = bf16(1/s)`, `Q = bf16(round(bf16(clamp(W, −c, c)·inv))·s)`,
//! `loss = bf16(Σ bf16(bf16(W − Q)²))` (the sum in f32 over 8 interleaved lanes — column k
//! in lane k mod 8 — added lane 0 to 7, then the ragged tail: the order the AVX2 loop sums in,
//! so both levels give the same bits; torch's own reduction order is not reproduced, which the
//! spec allows: the search is compared with a tolerance); the first candidate with the strictly smallest loss
//! wins. Then `scale = bf16(c*/7)` and `q = clamp(round(bf16(clamp(W, −c*, c*)·bf16(1/scale))),
//! −7, 7)` (rounding half to even; `clamp(x, lo, hi)` is torch's `min(max(x, lo), hi)`). The
//! final step multiplies by the bf16 reciprocal as the seed's `per_channel_searching`
//! (`models/deepseek_v4/utils/convert_model.py`: `x.clamp(...).mul(1.0 / scales).round()`)
//! does, where the spec's formula writes `/scale`: about 1 value in 10⁴ (a quotient within
//! half a bf16 step of a .5 tie) differs between the two readings; we give the seed's.
//!
//! Storage: weight int8 `[N/2, K]` packed **along the output dim** (byte `[j, k]` holds
//! `q[2j, k]` in the low nibble and `q[2j+1, k]` in the high nibble, two's complement), scale
//! `u64 [N, 1]` (low 32 bits = the f32 bits of the scale), and the Ascend kernel's auxiliary
//! `bias = bf16(Σ_k bf16(scale·q[k])·8)` (f32 `[N]`; not a model bias).

use crate::bf16_round;
use crate::simd::{simd_level, SimdLevel};

/// The largest INT4 magnitude produced.
pub const INT4_QMAX: f32 = 7.0;

/// Number of clipping candidates: `int((1.3 − 0.7)/0.01 + 1)`.
pub const INT4_CANDIDATES: usize = 61;

/// torch's `clamp(x, lo, hi)` = min(max(x, lo), hi) (hi wins when lo > hi).
#[inline]
fn clamp(x: f32, lo: f32, hi: f32) -> f32 {
    x.max(lo).min(hi)
}

/// The result of quantizing one row.
#[derive(Clone, Debug, PartialEq)]
pub struct Int4Row {
    /// The chosen clipping bound c*.
    pub clip: f32,
    /// `bf16(c*/7)` as f32.
    pub scale: f32,
    /// The auxiliary bias term.
    pub bias: f32,
    /// The chosen candidate's loss (bf16 value).
    pub loss: f32,
}

/// §4.4: one bf16 row (as f32) to INT4 values in −7..=7 (`q`, one per column).
pub fn quantize_row_int4_search(row: &[f32], q: &mut [i8]) -> Int4Row {
    assert_eq!(row.len(), q.len(), "quantize_row_int4_search: lengths");
    let level = simd_level();
    let mx = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut best_loss = f32::INFINITY;
    let mut best_c = 0.0f32;
    for i in 0..INT4_CANDIDATES {
        let ratio = (0.7f64 + i as f64 * 0.01) as f32;
        let c = bf16_round(ratio * mx);
        let s = bf16_round(c / INT4_QMAX);
        let inv = bf16_round(1.0 / s);
        let loss = bf16_round(candidate_loss(level, row, c, s, inv));
        if loss < best_loss {
            best_loss = loss;
            best_c = c;
        }
    }
    let scale = bf16_round(best_c / INT4_QMAX);
    let inv = bf16_round(1.0 / scale);
    let mut bias_acc = 0.0f32;
    for (o, &x) in q.iter_mut().zip(row) {
        let t = bf16_round(clamp(x, -best_c, best_c) * inv).round_ties_even();
        // NaN (a zero row's 0·inf) becomes 0, as torch's float → int8 cast does on CPU.
        let v = if t.is_nan() {
            0
        } else {
            t.clamp(-INT4_QMAX, INT4_QMAX) as i8
        };
        *o = v;
        bias_acc += bf16_round(bf16_round(scale * v as f32) * 8.0);
    }
    Int4Row {
        clip: best_c,
        scale,
        bias: bf16_round(bias_acc),
        loss: best_loss,
    }
}

/// Σ_k bf16(bf16(x − Q)²) for one candidate (see the module documentation for the order).
fn candidate_loss(level: SimdLevel, row: &[f32], c: f32, s: f32, inv: f32) -> f32 {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` is supported (from `simd_level`).
        SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe { avx2::candidate_loss(row, c, s, inv) },
        _ => candidate_loss_scalar(row, c, s, inv),
    }
}

#[inline]
fn element_loss(x: f32, c: f32, s: f32, inv: f32) -> f32 {
    let t = bf16_round(clamp(x, -c, c) * inv).round_ties_even();
    let qx = bf16_round(t * s);
    let d = bf16_round(x - qx);
    bf16_round(d * d)
}

pub(crate) fn candidate_loss_scalar(row: &[f32], c: f32, s: f32, inv: f32) -> f32 {
    let full = row.len() / 8 * 8;
    let mut lanes = [0.0f32; 8];
    for chunk in row[..full].chunks_exact(8) {
        for (l, &x) in lanes.iter_mut().zip(chunk) {
            *l += element_loss(x, c, s, inv);
        }
    }
    let mut acc = lanes.iter().fold(0.0f32, |a, &l| a + l);
    for &x in &row[full..] {
        acc += element_loss(x, c, s, inv);
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Rounds each lane to bf16 (ties to even), as `bf16_round` (NaN stays NaN).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn bf16_round8(v: __m256) -> __m256 {
        let bits = _mm256_castps_si256(v);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
        let r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
        let rounded = _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF_0000u32 as i32));
        // NaN lanes keep a quiet NaN (the increment could carry a NaN into infinity).
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v);
        _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_set1_ps(f32::NAN), nan)
    }

    /// `candidate_loss_scalar`, 8 columns at a time (same lanes, same order).
    ///
    /// # Safety
    /// The CPU supports AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn candidate_loss(row: &[f32], c: f32, s: f32, inv: f32) -> f32 {
        let (vc, vnc) = (_mm256_set1_ps(c), _mm256_set1_ps(-c));
        let (vs, vinv) = (_mm256_set1_ps(s), _mm256_set1_ps(inv));
        let full = row.len() / 8 * 8;
        let p = row.as_ptr();
        let mut acc = _mm256_setzero_ps();
        let mut k = 0;
        while k < full {
            let x = _mm256_loadu_ps(p.add(k));
            // clamp = min(max(x, lo), hi); `maxps` returns its second operand when either is
            // NaN, so a NaN x becomes lo as with f32::max.
            let cl = _mm256_min_ps(_mm256_max_ps(x, vnc), vc);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                bf16_round8(_mm256_mul_ps(cl, vinv)),
            );
            let qx = bf16_round8(_mm256_mul_ps(t, vs));
            let d = bf16_round8(_mm256_sub_ps(x, qx));
            acc = _mm256_add_ps(acc, bf16_round8(_mm256_mul_ps(d, d)));
            k += 8;
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut total = lanes.iter().fold(0.0f32, |a, &l| a + l);
        for &x in &row[full..] {
            total += super::element_loss(x, c, s, inv);
        }
        total
    }
}

/// Packs int4 values `q` `[n, k]` (row-major, n even) along the output dim into `[n/2, k]`
/// bytes: byte `[j, c]` = `(q[2j, c] & 0xF) | (q[2j+1, c] << 4)`.
pub fn pack_int4_along_n(q: &[i8], n: usize, k: usize, out: &mut [u8]) {
    assert!(n.is_multiple_of(2), "pack_int4_along_n: n must be even");
    assert_eq!(q.len(), n * k, "pack_int4_along_n: q length");
    assert_eq!(out.len(), n / 2 * k, "pack_int4_along_n: out length");
    for j in 0..n / 2 {
        let (a, b) = (
            &q[2 * j * k..(2 * j + 1) * k],
            &q[(2 * j + 1) * k..(2 * j + 2) * k],
        );
        for ((o, &lo), &hi) in out[j * k..(j + 1) * k].iter_mut().zip(a).zip(b) {
            *o = ((lo as u8) & 0x0F) | ((hi as u8) << 4);
        }
    }
}

/// The int4 value of row `r`, column `c` of a matrix packed along N (`k` columns).
#[inline]
pub fn unpack_int4_along_n(packed: &[u8], k: usize, r: usize, c: usize) -> i8 {
    let b = packed[(r / 2) * k + c];
    // Shift the wanted nibble to the top, then sign-extend by an arithmetic shift.
    let v = if r.is_multiple_of(2) {
        b << 4
    } else {
        b & 0xF0
    };
    (v as i8) >> 4
}

/// The `u64 [N, 1]` scale layout: low 32 bits = the f32 bit pattern, high 32 bits zero.
#[inline]
pub fn scale_to_u64(scale: f32) -> u64 {
    scale.to_bits() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_along_n_round_trips() {
        let (n, k) = (6usize, 5usize);
        let q: Vec<i8> = (0..n * k).map(|i| (i as i32 % 15 - 7) as i8).collect();
        let mut p = vec![0u8; n / 2 * k];
        pack_int4_along_n(&q, n, k, &mut p);
        // Byte [0, 0]: q[0,0] = −7 (0x9) low, q[1,0] = q[5] = −2 (0xE) high.
        assert_eq!(p[0], 0xE9);
        for r in 0..n {
            for c in 0..k {
                assert_eq!(unpack_int4_along_n(&p, k, r, c), q[r * k + c]);
            }
        }
        assert_eq!(scale_to_u64(1.0), 0x3F80_0000);
    }

    proptest::proptest! {
        /// The AVX2 loss equals the scalar reference bit for bit (same lanes and order), for
        /// every candidate of random rows of any length, zero rows included.
        #[test]
        fn avx2_loss_equals_scalar(len in 0usize..300, seed in proptest::prelude::any::<u64>(),
                                   zero in proptest::prelude::any::<bool>()) {
            let mut st = seed | 1;
            let row: Vec<f32> = (0..len)
                .map(|_| {
                    st ^= st << 13;
                    st ^= st >> 7;
                    st ^= st << 17;
                    if zero { 0.0 } else { bf16_round(((st >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1) }
                })
                .collect();
            let mx = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            for &level in SimdLevel::ALL {
                if !level.supported() {
                    continue;
                }
                for i in 0..INT4_CANDIDATES {
                    let c = bf16_round((0.7f64 + i as f64 * 0.01) as f32 * mx);
                    let s = bf16_round(c / INT4_QMAX);
                    let inv = bf16_round(1.0 / s);
                    let want = candidate_loss_scalar(&row, c, s, inv);
                    let got = candidate_loss(level, &row, c, s, inv);
                    proptest::prop_assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "{level:?} len {len} candidate {i}: {got} vs {want}");
                }
            }
        }
    }

    /// The search in f64 arithmetic picks a candidate whose f64 loss is within bf16 rounding of
    /// the best; the chosen scale always has |q| ≤ 7 and the row's max maps to ≤ 7.
    #[test]
    fn search_is_sane() {
        let mut s = 7u64;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for _ in 0..50 {
            let row: Vec<f32> = (0..256).map(|_| bf16_round(next() * 0.02)).collect();
            let mut q = vec![0i8; 256];
            let r = quantize_row_int4_search(&row, &mut q);
            let mx = row.iter().fold(f32::MIN, |m, &v| m.max(v));
            assert!(r.clip >= 0.69 * mx && r.clip <= 1.31 * mx, "{r:?} mx {mx}");
            assert_eq!(r.scale, bf16_round(r.clip / 7.0));
            assert!(q.iter().all(|v| (-7..=7).contains(v)));
            // The chosen loss is no worse than the full-range candidate's.
            let mut q1 = vec![0i8; 256];
            let loss_at = |c: f32, q: &mut [i8]| -> f64 {
                let s = bf16_round(c / 7.0);
                row.iter()
                    .zip(q.iter_mut())
                    .map(|(&x, qv)| {
                        let t = (x.clamp(-c, c) / s).round_ties_even().clamp(-7.0, 7.0);
                        *qv = t as i8;
                        (x as f64 - t as f64 * s as f64).powi(2)
                    })
                    .sum()
            };
            let chosen = loss_at(r.clip, &mut q1);
            let full = loss_at(bf16_round(mx), &mut q1);
            assert!(chosen <= full * 1.02 + 1e-12, "{chosen} vs {full}");
            let bias: f32 = q.iter().map(|&v| v as f32 * r.scale * 8.0).sum();
            let l1: f32 = q.iter().map(|&v| (v as f32 * r.scale * 8.0).abs()).sum();
            let tol = 0.004 * (l1 + bias.abs());
            assert!((bias - r.bias).abs() <= tol, "{bias} {}", r.bias);
        }
        // Zero row: no candidate has a finite loss; q = 0.
        let mut q = vec![3i8; 4];
        let r = quantize_row_int4_search(&[0.0; 4], &mut q);
        assert_eq!(q, [0; 4]);
        assert_eq!(r.scale, 0.0);
    }
}
