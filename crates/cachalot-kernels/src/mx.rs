//! MX formats of DeepSeek-V4 (spec `deepseek-v4.md` §4.1, §4.5, §2.12): the E8M0 shared scale,
//! FP4 e2m1 element codes with their nibble packing, and `quantize_mx`, the converter's MXFP8
//! (e4m3 elements) / MXFP4 (e2m1 elements) quantization with one power-of-two scale per 32
//! consecutive elements of a row.
//!
//! - E8M0: `2^(b − 127)`; b = 255 is NaN.
//! - e2m1 nibble `s ee m`: codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; 8..15 the same negated
//!   (8 = −0). Packing: byte j of a row holds column 2j in its **low** nibble and 2j+1 in its
//!   high nibble (both the native V4 experts and `quantize_mx`'s output).
//! - [`quantize_mx_row`] follows §4.5 and reproduces the converter's bf16 tensor arithmetic op
//!   by op (every op computed in f32 and rounded to bf16, see [`bf16_round`]): the shared
//!   exponent is `floor(bf16(log2 amax))` plus one when `amax / 2^e > 1.75` ("round2decimal"),
//!   elements round half away from zero at the target's precision, results clamp to ±448 / ±6
//!   and a negative value that rounds to zero keeps its sign (code 0x80 / nibble 8).

use crate::bf16_round;
use crate::fp8::f32_to_e4m3;

/// The e2m1 values of codes 0..15.
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The largest e2m1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// Elements per MX scale.
pub const MX_BLOCK: usize = 32;

const fn build_e8m0() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut b = 1;
    while b < 255 {
        t[b] = f32::from_bits((b as u32) << 23);
        b += 1;
    }
    // 2^−127 is an f32 subnormal.
    t[0] = f32::from_bits(1 << 22);
    t[255] = f32::NAN;
    t
}

static E8M0_TABLE: [f32; 256] = build_e8m0();

/// The value of an E8M0 scale byte, `2^(b − 127)`; 255 is NaN.
#[inline]
pub fn e8m0_to_f32(b: u8) -> f32 {
    E8M0_TABLE[b as usize]
}

/// The value of an e2m1 nibble (the low 4 bits of `nibble`).
#[inline]
pub fn e2m1_to_f32(nibble: u8) -> f32 {
    E2M1_VALUES[(nibble & 0x0F) as usize]
}

/// Encodes `x` as e2m1, rounding to nearest with ties to the even code and saturating to ±6
/// (§2.12's FP4 round trip; exact for values on the grid). NaN encodes as 0 (e2m1 has none).
pub fn f32_to_e2m1(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 8u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return 0;
    }
    // Midpoints between consecutive magnitudes and which side a tie goes to (the even code).
    const MIDS: [(f32, bool); 7] = [
        (0.25, false), // 0 (code 0) | 0.5 (1): tie → 0
        (0.75, true),  // 0.5 (1) | 1 (2): tie → 1
        (1.25, false), // 1 (2) | 1.5 (3): tie → 1
        (1.75, true),  // 1.5 (3) | 2 (4): tie → 2
        (2.5, false),  // 2 (4) | 3 (5): tie → 2
        (3.5, true),   // 3 (5) | 4 (6): tie → 4
        (5.0, false),  // 4 (6) | 6 (7): tie → 4
    ];
    let mut code = 0u8;
    for (m, up) in MIDS {
        if a > m || (a == m && up) {
            code += 1;
        } else {
            break;
        }
    }
    sign | code
}

/// Packs e2m1 codes (one per byte, low nibble) two per byte: column 2j → low nibble of byte j.
/// `codes.len()` must be even.
pub fn pack_nibbles(codes: &[u8], out: &mut [u8]) {
    assert_eq!(codes.len(), 2 * out.len(), "pack_nibbles: lengths");
    for (o, pair) in out.iter_mut().zip(codes.chunks_exact(2)) {
        *o = (pair[0] & 0x0F) | (pair[1] << 4);
    }
}

/// The element format of an MX quantization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MxElem {
    /// FP8 e4m3fn elements (MXFP8): emax 8, emin −6, 3 mantissa bits, max 448.
    E4m3,
    /// FP4 e2m1 elements (MXFP4): emax 2, emin 0, 1 mantissa bit, max 6.
    E2m1,
}

impl MxElem {
    fn params(self) -> (i32, i32, i32, f32) {
        match self {
            MxElem::E4m3 => (8, -6, 3, 448.0),
            MxElem::E2m1 => (2, 0, 1, E2M1_MAX),
        }
    }
}

/// 2^k as f32 (exact for −149 ≤ k ≤ 127).
#[inline]
fn pow2(k: i32) -> f32 {
    if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (k + 149))
    }
}

/// floor(bf16(log2 |a|)) for a > 0: torch's `floor(log2(t))` on a bf16 tensor.
#[inline]
fn floor_log2_bf16(a: f32) -> i32 {
    bf16_round(a.log2()).floor() as i32
}

/// One block's shared exponent `se` (§4.5 steps 1–2), from its bf16 values.
fn shared_exponent(block: &[f32], elem: MxElem) -> i32 {
    let (emax, ..) = elem.params();
    let mut amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        amax = pow2(-126);
    }
    let mut e = floor_log2_bf16(amax);
    if bf16_round(amax / pow2(e)) > 1.75 {
        e += 1;
    }
    (e - emax).max(-127)
}

/// One element already divided by the shared scale: rounded to the element format (half away
/// from zero) and clamped, in the converter's bf16 arithmetic.
fn round_element(v: f32, elem: MxElem) -> f32 {
    let (_, emin, mb, max) = elem.params();
    let pe = if v == 0.0 {
        0
    } else {
        floor_log2_bf16(v.abs())
    }
    .max(emin);
    let scaled = bf16_round(bf16_round(v / pow2(pe)) * pow2(mb));
    let mag = bf16_round(scaled.abs() + 0.5).floor();
    // torch.sign(0) is +0, so ±0 gives +0; a negative value rounding to 0 gives −0.
    let r = if v > 0.0 {
        mag
    } else if v < 0.0 {
        -mag
    } else {
        0.0
    };
    bf16_round(bf16_round(r / pow2(mb)) * pow2(pe)).clamp(-max, max)
}

/// §4.5 `quantize_mx` of one row of bf16 values (given as f32): for each block of 32 (the last
/// one may be shorter; it is treated as zero-padded), writes the element values (exactly
/// representable in the element format) to `values` and the scale byte `se + 127` to
/// `scales[block]`. Dequantization is `values[k] · 2^(scales[k/32] − 127)`.
pub fn quantize_mx_row(row: &[f32], elem: MxElem, values: &mut [f32], scales: &mut [u8]) {
    assert_eq!(row.len(), values.len(), "quantize_mx_row: values length");
    assert_eq!(
        row.len().div_ceil(MX_BLOCK),
        scales.len(),
        "quantize_mx_row: one scale per 32 values"
    );
    for ((block, out), s) in row
        .chunks(MX_BLOCK)
        .zip(values.chunks_mut(MX_BLOCK))
        .zip(scales.iter_mut())
    {
        let se = shared_exponent(block, elem);
        let inv = pow2(se);
        for (o, &x) in out.iter_mut().zip(block) {
            *o = round_element(bf16_round(x / inv), elem);
        }
        *s = (se + 127) as u8;
    }
}

/// MXFP8 of one bf16 row: e4m3fn codes and scale bytes.
pub fn quantize_mxfp8_row(row: &[f32], codes: &mut [u8], scales: &mut [u8]) {
    let mut v = vec![0.0f32; row.len()];
    quantize_mx_row(row, MxElem::E4m3, &mut v, scales);
    for (c, x) in codes.iter_mut().zip(&v) {
        *c = f32_to_e4m3(*x);
    }
}

/// MXFP4 of one bf16 row (even length): packed e2m1 codes (`row.len() / 2` bytes, even column
/// in the low nibble) and scale bytes.
pub fn quantize_mxfp4_row(row: &[f32], packed: &mut [u8], scales: &mut [u8]) {
    let mut v = vec![0.0f32; row.len()];
    quantize_mx_row(row, MxElem::E2m1, &mut v, scales);
    let codes: Vec<u8> = v.iter().map(|&x| f32_to_e2m1(x)).collect();
    pack_nibbles(&codes, packed);
}

/// Dequantizes one row of packed e2m1 codes with E8M0 scales per 32 columns (§4.1):
/// `W[k] = e2m1(nibble k) · 2^(scale[k/32] − 127)`, exact in bf16.
pub fn dequantize_mxfp4_row(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    assert_eq!(out.len(), 2 * packed.len(), "dequantize_mxfp4_row: lengths");
    for (k, o) in out.iter_mut().enumerate() {
        let nib = packed[k / 2] >> (4 * (k % 2));
        *o = e2m1_to_f32(nib) * e8m0_to_f32(scales[k / MX_BLOCK]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::e4m3_to_f32;

    #[test]
    fn e8m0_decodes_every_code() {
        for b in 0..=255u8 {
            let v = e8m0_to_f32(b);
            if b == 255 {
                assert!(v.is_nan());
            } else {
                assert_eq!(v as f64, 2f64.powi(b as i32 - 127), "code {b}");
            }
        }
    }

    #[test]
    fn e2m1_codes_and_nibble_order() {
        for c in 0..16u8 {
            let want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(c & 7) as usize];
            let v = e2m1_to_f32(c);
            assert_eq!(v.abs(), want);
            assert_eq!(v.is_sign_negative(), c >= 8, "code {c}");
            assert_eq!(f32_to_e2m1(v), c, "round trip of code {c}");
        }
        // Byte 0x72: column 0 (low nibble 2) = 1.0, column 1 (high nibble 7) = 6.0.
        let mut out = [0.0f32; 4];
        dequantize_mxfp4_row(&[0x72, 0x9F], &[127], &mut out);
        assert_eq!(out, [1.0, 6.0, -6.0, -0.5]);
        let mut packed = [0u8; 2];
        pack_nibbles(&[2, 7, 15, 9], &mut packed);
        assert_eq!(packed, [0x72, 0x9F]);
        // Ties to even, saturation.
        let enc = |x: f32| e2m1_to_f32(f32_to_e2m1(x));
        assert_eq!(
            [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -5.1, 0.26].map(enc),
            [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -6.0, 0.5]
        );
    }

    /// The §4.5 rules written in f64 with exact log2 (valid away from the bf16 log2 rounding,
    /// i.e. for |exponents| < 64). One bf16 effect is kept: the converter adds the 0.5 of the
    /// half-away rounding in bf16, so a scaled magnitude just below .5 (possible where the
    /// element exponent is clamped to emin) can round up before the floor.
    fn spec_mx(row: &[f32], elem: MxElem) -> (Vec<f64>, Vec<u8>) {
        let (emax, emin, mb, max) = match elem {
            MxElem::E4m3 => (8, -6, 3, 448.0),
            MxElem::E2m1 => (2, 0, 1, 6.0),
        };
        let mut vals = Vec::new();
        let mut scales = Vec::new();
        for block in row.chunks(32) {
            let mut amax = block.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
            if amax == 0.0 {
                amax = 2f64.powi(-126);
            }
            let mut e = amax.log2().floor() as i32;
            if amax / 2f64.powi(e) > 1.75 {
                e += 1;
            }
            let se = (e - emax).max(-127);
            scales.push((se + 127) as u8);
            for &x in block {
                let v = x as f64 / 2f64.powi(se);
                let pe = if v == 0.0 {
                    0
                } else {
                    v.abs().log2().floor() as i32
                }
                .max(emin);
                let t = v.abs() / 2f64.powi(pe) * 2f64.powi(mb);
                let m = (crate::bf16_round((t + 0.5) as f32) as f64).floor();
                let q = (m / 2f64.powi(mb) * 2f64.powi(pe)).min(max);
                vals.push(if v < 0.0 { -q } else { q });
            }
        }
        (vals, scales)
    }

    #[test]
    fn quantize_mx_matches_the_spec_rules() {
        let mut s = 0x1234_5678u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for elem in [MxElem::E4m3, MxElem::E2m1] {
            for trial in 0..200 {
                let n = 64 + (trial % 3) * 32;
                let spread = (trial % 20) as i32 - 10;
                let row: Vec<f32> = (0..n)
                    .map(|i| {
                        if i % 17 == 3 {
                            return 0.0;
                        }
                        let m = (next() >> 40) as f32 / (1u64 << 24) as f32;
                        let e = (next() % 12) as i32 - 6 + spread;
                        let v = crate::bf16_round(m * 2f32.powi(e));
                        if next() & 1 == 0 {
                            v
                        } else {
                            -v
                        }
                    })
                    .collect();
                let mut v = vec![0.0f32; n];
                let mut sc = vec![0u8; n / 32];
                quantize_mx_row(&row, elem, &mut v, &mut sc);
                let (want_v, want_s) = spec_mx(&row, elem);
                assert_eq!(sc, want_s, "{elem:?} trial {trial}");
                for (k, (g, w)) in v.iter().zip(&want_v).enumerate() {
                    assert_eq!(*g as f64, *w, "{elem:?} trial {trial} k {k}: {}", row[k]);
                }
                if elem == MxElem::E4m3 {
                    let mut codes = vec![0u8; n];
                    quantize_mxfp8_row(&row, &mut codes, &mut sc);
                    for (c, x) in codes.iter().zip(&v) {
                        assert_eq!(e4m3_to_f32(*c).to_bits(), x.to_bits());
                    }
                }
            }
        }
    }

    #[test]
    fn quantize_mx_edge_cases() {
        // All-zero block: amax → 2^−126, se clamps to −127, scale byte 0, values +0.
        let mut v = [1.0f32; 32];
        let mut s = [9u8; 1];
        quantize_mx_row(&[0.0; 32], MxElem::E2m1, &mut v, &mut s);
        assert_eq!(s, [0]);
        assert!(v.iter().all(|x| x.to_bits() == 0));
        // amax 7 = 1.75·4: not > 1.75, so e = 2, se = 0; 7 → 8 → clamps to 6.
        let mut row = [0.0f32; 32];
        row[0] = 7.0;
        row[1] = -0.2; // rounds to −0 at scale 1 (pe = 0, 0.2·2 + 0.5 → 0)
        row[2] = 0.75; // 1.5 + 0.5 = 2 → 1.0 (half away from zero)
        quantize_mx_row(&row, MxElem::E2m1, &mut v, &mut s);
        assert_eq!(s, [127]);
        assert_eq!(v[0], 6.0);
        assert_eq!(v[1].to_bits(), (-0.0f32).to_bits());
        assert_eq!(v[2], 1.0);
        // amax 7.5 > 1.75·4: e = 3, se = 1; 7.5/2 = 3.75 → 4.
        row[0] = 7.5;
        quantize_mx_row(&row, MxElem::E2m1, &mut v, &mut s);
        assert_eq!(s, [128]);
        assert_eq!(v[0], 4.0);
        let mut packed = [0u8; 16];
        quantize_mxfp4_row(&row, &mut packed, &mut s);
        assert_eq!(
            packed[0], 0x86,
            "col 0 = 4.0 (code 6) low, col 1 = −0 (code 8) high"
        );
    }

    /// §4.5 property / §6.3: MXFP4 of a dequantized FP4 expert reproduces it exactly.
    #[test]
    fn mxfp4_of_dequantized_fp4_is_lossless() {
        let mut s = 99u64;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u8
        };
        for trial in 0..300 {
            let k = 128;
            let packed: Vec<u8> = (0..k / 2).map(|_| next()).collect();
            let scales: Vec<u8> = (0..k / 32).map(|_| 100 + next() % 40).collect();
            let mut w = vec![0.0f32; k];
            dequantize_mxfp4_row(&packed, &scales, &mut w);
            let mut p2 = vec![0u8; k / 2];
            let mut s2 = vec![0u8; k / 32];
            quantize_mxfp4_row(&w, &mut p2, &mut s2);
            let mut w2 = vec![0.0f32; k];
            dequantize_mxfp4_row(&p2, &s2, &mut w2);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            // −0 and +0 may trade places only where the source held −0 (torch.sign(−0) = 0).
            let norm = |v: &[f32]| bits(&v.iter().map(|x| x + 0.0).collect::<Vec<_>>());
            assert_eq!(norm(&w2), norm(&w), "trial {trial}");
        }
    }
}
