//! Symmetric int8 quantization: the converter's per-row weight rule and the runtime's dynamic
//! per-token activation rule (spec `deepseek-v3-r1-kimi-k2.md` §4 W8A8 Linear, §5.2).

use crate::simd::simd_level;
#[cfg(target_arch = "x86_64")]
use crate::simd::SimdLevel;
use crate::{bf16_to_f32, f32_to_bf16};

/// The largest int8 magnitude either rule produces (symmetric: −128 is never produced).
pub const INT8_QMAX: f32 = 127.0;

/// Spec §5.2: one row of a bf16 weight to int8 with one scale, exactly as the seed's converter
/// does it in torch bf16 tensor arithmetic (every op computes in f32 and rounds to bf16):
/// `s = bf16(max|w| / 127)`, `t = bf16(w / s)`, `q = clamp(round_half_even(t), −127, 127)`.
/// The quotient's double rounding (f32 divide → bf16 → integer) is what makes this bit-exact:
/// [1.0, 0.09033203125, −0.5, 0.25] gives s = 0.00787353515625 and q = [127, 12, −64, 32] (the
/// exact quotient 11.47 would round to 11). Returns `s` (exactly bf16-representable; stored as
/// f32). An all-zero row gives s = 0 and q = 0 (torch's 0/0 is undefined there).
pub fn quantize_row_bf16_to_int8(row: &[u16], q: &mut [i8]) -> f32 {
    assert_eq!(row.len(), q.len(), "quantize_row: row and output lengths");
    let amax = row
        .iter()
        .map(|&b| bf16_to_f32(b).abs())
        .fold(0.0f32, f32::max);
    let s = bf16_to_f32(f32_to_bf16(amax / INT8_QMAX));
    if s == 0.0 {
        q.fill(0);
        return 0.0;
    }
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level is supported (from `simd_level`); lengths are equal (asserted).
        SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe { avx2::quantize_bf16_row(row, s, q) },
        _ => quantize_bf16_row_scalar(row, s, q),
    }
    s
}

/// `q = clamp(round_half_even(bf16(w / s)), −127, 127)` per element (NaN becomes 0, as
/// torch's float → int8 cast gives on CPU).
fn quantize_bf16_row_scalar(row: &[u16], s: f32, q: &mut [i8]) {
    for (o, &b) in q.iter_mut().zip(row) {
        *o = quantize_bf16(b, s);
    }
}

#[inline]
fn quantize_bf16(b: u16, s: f32) -> i8 {
    let t = bf16_to_f32(f32_to_bf16(bf16_to_f32(b) / s));
    t.round_ties_even().clamp(-INT8_QMAX, INT8_QMAX) as i8
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `quantize_bf16_row_scalar`, 8 at a time: the divide is IEEE in both, the bf16 rounding
    /// is the same integer rounding, so the results are identical.
    ///
    /// # Safety
    /// The CPU supports AVX2; `q.len() == row.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_bf16_row(row: &[u16], s: f32, q: &mut [i8]) {
        let n = row.len();
        let vs = _mm256_set1_ps(s);
        let (lo, hi) = (
            _mm256_set1_ps(-super::INT8_QMAX),
            _mm256_set1_ps(super::INT8_QMAX),
        );
        let mut i = 0;
        while i + 8 <= n {
            let b = _mm_loadu_si128(row.as_ptr().add(i) as *const __m128i);
            let w = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(b)));
            let d = _mm256_div_ps(w, vs);
            // Round to bf16, ties to even (finite values; NaN lanes are zeroed below).
            let bits = _mm256_castps_si256(d);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
            let r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
            let t = _mm256_castsi256_ps(_mm256_and_si256(
                r,
                _mm256_set1_epi32(0xFFFF_0000u32 as i32),
            ));
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
            let t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(d, d);
            let t = _mm256_andnot_ps(nan, t);
            let v = _mm256_cvtps_epi32(t);
            let mut out = [0i32; 8];
            _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, v);
            for (k, &x) in out.iter().enumerate() {
                q[i + k] = x as i8;
            }
            i += 8;
        }
        for k in i..n {
            q[k] = super::quantize_bf16(row[k], s);
        }
    }

    /// `quantize_activation_int8_scalar`, 8 at a time, the same bits: `max` is exact in any
    /// order and `vmaxps(|x|, m)` keeps `m` when `x` is NaN, as `f32::max` does; the product by
    /// the reciprocal is IEEE in both; rounding to nearest even is the scalar's exact
    /// `(x + 1.5·2^23) − 1.5·2^23`; NaN lanes become 0 as the scalar cast makes them.
    ///
    /// # Safety
    /// The CPU supports AVX2; `q.len() == x.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_activation(x: &[f32], q: &mut [i8]) -> f32 {
        let n = x.len();
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            let v = _mm256_andnot_ps(sign, _mm256_loadu_ps(x.as_ptr().add(i)));
            m = _mm256_max_ps(v, m);
            i += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        let mut amax = lanes.iter().fold(0.0f32, |a, &v| a.max(v));
        for &v in &x[i..] {
            amax = amax.max(v.abs());
        }
        if amax == 0.0 || !amax.is_finite() {
            q.fill(0);
            return if amax == 0.0 { 0.0 } else { f32::NAN };
        }
        let inv = super::INT8_QMAX / amax;
        let vinv = _mm256_set1_ps(inv);
        let (lo, hi) = (
            _mm256_set1_ps(-super::INT8_QMAX),
            _mm256_set1_ps(super::INT8_QMAX),
        );
        let mut i = 0;
        while i + 16 <= n {
            let mut halves = [_mm256_setzero_si256(); 2];
            for (h, half) in halves.iter_mut().enumerate() {
                let p = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i + 8 * h)), vinv);
                let t = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(p);
                let t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
                let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(p, p);
                *half = _mm256_cvtps_epi32(_mm256_andnot_ps(nan, t));
            }
            // i32 → i16 → i8 (values within ±127: no saturation), restoring lane order.
            let w = _mm256_packs_epi32(halves[0], halves[1]);
            let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(w);
            let b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w));
            _mm_storeu_si128(q.as_mut_ptr().add(i) as *mut __m128i, b);
            i += 16;
        }
        super::quantize_with(&x[i..], inv, &mut q[i..]);
        amax / super::INT8_QMAX
    }
}

/// Spec §4: dynamic per-token symmetric quantization of an f32 activation row. With
/// `amax = max|x|`, returns `sx = amax / 127` and writes `q = clamp(round_half_even(x · (127 /
/// amax)), −127, 127)` (multiplying by the reciprocal, as the NPU kernel receives it; the SIMD
/// products rely on this exact definition). A zero row gives sx = 0 and q = 0.
pub fn quantize_activation_int8(x: &[f32], q: &mut [i8]) -> f32 {
    assert_eq!(
        x.len(),
        q.len(),
        "quantize_activation: input and output lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if matches!(simd_level(), SimdLevel::Avx2 | SimdLevel::Avx512) {
        // SAFETY: the level is supported (from `simd_level`); lengths are equal (asserted).
        return unsafe { avx2::quantize_activation(x, q) };
    }
    quantize_activation_int8_scalar(x, q)
}

/// [`quantize_activation_int8`] one element at a time (the reference of the SIMD twin).
fn quantize_activation_int8_scalar(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() {
        q.fill(0);
        return if amax == 0.0 { 0.0 } else { f32::NAN };
    }
    let inv = INT8_QMAX / amax;
    quantize_with(x, inv, q);
    amax / INT8_QMAX
}

#[inline]
fn quantize_with(x: &[f32], inv: f32, q: &mut [i8]) {
    for (o, &v) in q.iter_mut().zip(x) {
        *o = round_ties_even_small(v * inv).clamp(-INT8_QMAX, INT8_QMAX) as i8;
    }
}

/// `x.round_ties_even()` for |x| < 2^22 (and NaN → NaN), without the libm `rintf` call that
/// `round_ties_even` becomes on a baseline x86-64 build: adding and subtracting 1.5·2^23 rounds
/// to an integer in the current (round-to-nearest-even) mode, exactly. Here |x| ≤ 127·(1 + ε).
#[inline]
fn round_ties_even_small(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    let r = (x + MAGIC) - MAGIC;
    // Keep the sign of a zero result like round_ties_even does (−0.4 → −0.0); it does not
    // change the i8, but the helper is exact either way.
    if r == 0.0 {
        0.0f32.copysign(x)
    } else {
        r
    }
}

/// Static per-tensor quantization with a given scale (the C8 latent cache, spec §3.4:
/// `saturate_int8(round(x · (1/s)))`, saturating to [−128, 127], ties to even).
#[inline]
pub fn quantize_static_int8(x: f32, inv_scale: f32) -> i8 {
    (x * inv_scale).round_ties_even().clamp(-128.0, 127.0) as i8
}

#[cfg(test)]
#[allow(clippy::excessive_precision)] // the spec's exact decimal expansions
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The SIMD activation quantizer gives the scalar reference's bits and scale, with
        /// zeros, NaN, infinities, ties and ragged lengths among the inputs.
        #[test]
        fn activation_quantizer_matches_the_scalar_reference(
            vals in prop::collection::vec(
                prop_oneof![
                    8 => -3.0f32..3.0,
                    1 => Just(0.0f32),
                    1 => Just(-0.0f32),
                    1 => Just(f32::NAN),
                    1 => (-20i32..20).prop_map(|k| k as f32 * 0.5),
                    1 => Just(f32::INFINITY),
                ],
                0..80,
            ),
            drop_specials in any::<bool>(),
        ) {
            let x: Vec<f32> = if drop_specials {
                vals.iter().map(|v| if v.is_finite() { *v } else { 1.0 }).collect()
            } else {
                vals
            };
            let mut want = vec![0i8; x.len()];
            let s_want = quantize_activation_int8_scalar(&x, &mut want);
            let mut got = vec![7i8; x.len()];
            let s_got = quantize_activation_int8(&x, &mut got);
            prop_assert_eq!(s_got.to_bits(), s_want.to_bits());
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn spec_double_rounding_vector() {
        let row: Vec<u16> = [1.0f32, 0.09033203125, -0.5, 0.25]
            .iter()
            .map(|&v| f32_to_bf16(v))
            .collect();
        // All four are bf16 values.
        for (&b, v) in row.iter().zip([1.0f32, 0.09033203125, -0.5, 0.25]) {
            assert_eq!(bf16_to_f32(b), v);
        }
        let mut q = [0i8; 4];
        let s = quantize_row_bf16_to_int8(&row, &mut q);
        assert_eq!(s, 0.00787353515625);
        assert_eq!(q, [127, 12, -64, 32]);
        // The intermediate t of the spec.
        let t: Vec<f32> = row
            .iter()
            .map(|&b| bf16_to_f32(f32_to_bf16(bf16_to_f32(b) / s)))
            .collect();
        assert_eq!(t, [127.0, 11.5, -63.5, 31.75]);
    }

    proptest::proptest! {
        /// The AVX2 row quantizer equals the scalar one on any bf16 bit patterns (NaN and
        /// infinities included) and any scale.
        #[test]
        fn avx2_row_quantizer_equals_scalar(row in proptest::collection::vec(proptest::prelude::any::<u16>(), 0..100),
                                            sbits in 0x3000u16..0x4800) {
            let s = bf16_to_f32(sbits);
            let mut want = vec![0i8; row.len()];
            quantize_bf16_row_scalar(&row, s, &mut want);
            #[cfg(target_arch = "x86_64")]
            if SimdLevel::Avx2.supported() {
                let mut got = vec![1i8; row.len()];
                unsafe { avx2::quantize_bf16_row(&row, s, &mut got) };
                proptest::prop_assert_eq!(got, want);
            }
        }
    }

    #[test]
    fn zero_row_and_clamp() {
        let mut q = [5i8; 3];
        assert_eq!(quantize_row_bf16_to_int8(&[0, 0x8000, 0], &mut q), 0.0);
        assert_eq!(q, [0, 0, 0]);
        // 127.5 must clamp to 127, never wrap to -128.
        let mut q = [0i8; 2];
        let x = [1.0f32, -1.0];
        let s = quantize_activation_int8(&x, &mut q);
        assert_eq!(q, [127, -127]);
        assert_eq!(s, 1.0 / 127.0);
    }

    #[test]
    fn activation_ties_to_even() {
        // amax = 127 → inv = 1: 2.5 → 2, 3.5 → 4, -0.5 → -0.
        let x = [127.0f32, 2.5, 3.5, -0.5, -1.5];
        let mut q = [0i8; 5];
        quantize_activation_int8(&x, &mut q);
        assert_eq!(q, [127, 2, 4, 0, -2]);
        assert_eq!(quantize_static_int8(300.0, 1.0), 127);
        assert_eq!(quantize_static_int8(-300.0, 1.0), -128);
        assert_eq!(quantize_static_int8(2.5, 1.0), 2);
    }

    proptest::proptest! {
        /// The magic-number rounding equals `round_ties_even` over the whole range it is used
        /// on, ties (k + 0.5) included, and on NaN.
        #[test]
        fn small_rounding_equals_round_ties_even(k in -300i32..300, frac in 0.0f32..1.0, tie in proptest::bool::ANY) {
            let x = k as f32 + if tie { 0.5 } else { frac };
            let a = round_ties_even_small(x);
            let b = x.round_ties_even();
            proptest::prop_assert_eq!(a.to_bits(), b.to_bits(), "x = {}", x);
        }

        /// Whole-row quantization equals the definition written with `round_ties_even`;
        /// outputs poisoned first.
        #[test]
        fn activation_quantization_matches_definition(xs in proptest::collection::vec(-1e3f32..1e3, 1..300)) {
            let mut q = vec![0x55u8 as i8; xs.len()];
            let s = quantize_activation_int8(&xs, &mut q);
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let inv = INT8_QMAX / amax;
            for (o, v) in q.iter().zip(&xs) {
                let want = if amax == 0.0 { 0 } else { (v * inv).round_ties_even().clamp(-INT8_QMAX, INT8_QMAX) as i8 };
                proptest::prop_assert_eq!(*o, want);
            }
            proptest::prop_assert_eq!(s, amax / INT8_QMAX);
        }
    }
}
