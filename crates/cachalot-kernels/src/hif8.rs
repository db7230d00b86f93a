//! HiF8 (Huawei HiFloat8), the `w4a8-mx-hif` weight format of DeepSeek-V4 (spec
//! `deepseek-v4.md` §4.6).
//!
//! A byte is, MSB first: the sign, a prefix-coded "dot" field giving the exponent width D
//! (`11` → 4, `10` → 3, `01` → 2, `001` → 1, `0001` → 0, `0000` → denormal), D exponent bits
//! (sign-magnitude with an implicit leading 1: the top bit is the exponent's sign, the magnitude
//! is the field with that bit replaced by 1), then the mantissa (1, 2, 3, 3, 3 bits). Normal
//! values are `(−1)^S · 2^E · (1 + m/2^M)` with |E| ≤ 15; the denormals `0000 mmm` are
//! `2^(m − 23)` for m = 1..7. `0x00` = 0, `0x80` = NaN, `S|0x6F` = ±Inf; the largest finite
//! value is `0x6E` = 32768. 253 codes are finite.
//!
//! Encoding ([`f32_to_hif8`]) rounds half away from zero ("TA") and overflows to Inf: every
//! |x| ≥ 40960 = 1.25·2^15 becomes Inf, [32768, 40960) gives 32768, values below 2^−23 give 0
//! and [2^−23, 2^−22) gives 2^−22.
//!
//! Weights ([`quantize_row_hif8`]) are quantized per output row: `scale = max|W_n| / 32768`
//! (f32) and `q = HiF8_TA(W / scale)`.

/// The largest finite HiF8 value (code 0x6E).
pub const HIF8_MAX: f32 = 32768.0;

const fn decode(c: u8) -> f32 {
    if c == 0x80 {
        return f32::NAN;
    }
    let sign = if c & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let b = c & 0x7F;
    if b == 0x6F {
        return sign * f32::INFINITY;
    }
    // (D, M, exponent field, mantissa field)
    let (d, m, ef, mf) = if b >> 5 == 0b11 {
        (4u32, 1u32, (b >> 1) & 0xF, b & 1)
    } else if b >> 5 == 0b10 {
        (3, 2, (b >> 2) & 0x7, b & 3)
    } else if b >> 5 == 0b01 {
        (2, 3, (b >> 3) & 0x3, b & 7)
    } else if b >> 4 == 0b001 {
        (1, 3, (b >> 3) & 0x1, b & 7)
    } else if b >> 3 == 0b0001 {
        (0, 3, 0, b & 7)
    } else {
        // Denormal 0000 mmm: 2^(m − 23); m = 0 is zero.
        let mm = b & 7;
        if mm == 0 {
            return 0.0;
        }
        return sign * pow2(mm as i32 - 23);
    };
    let e = if d == 0 {
        0
    } else {
        let top = 1u8 << (d - 1);
        let mag = ((ef & (top - 1)) | top) as i32;
        if ef & top != 0 {
            -mag
        } else {
            mag
        }
    };
    sign * pow2(e) * (1.0 + mf as f32 / (1u32 << m) as f32)
}

const fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

const fn build_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode(i as u8);
        i += 1;
    }
    t
}

static HIF8_TABLE: [f32; 256] = build_table();

/// The value of a HiF8 code (NaN for 0x80, ±Inf for 0x6F / 0xEF).
#[inline]
pub fn hif8_to_f32(c: u8) -> f32 {
    HIF8_TABLE[c as usize]
}

/// The 256-entry decoding table (index = code).
pub fn hif8_table() -> &'static [f32; 256] {
    &HIF8_TABLE
}

/// Mantissa bits kept for an unbiased exponent of magnitude `a` (normal range |e| ≤ 15, and
/// the power-of-two denormal range 16..22).
fn kept_bits(a: u32) -> u32 {
    match a {
        0..=3 => 3,
        4..=7 => 2,
        8..=15 => 1,
        _ => 0,
    }
}

/// Encodes `x` as HiF8 with ties away from zero (§4.6 steps 1–4).
pub fn f32_to_hif8(x: f32) -> u8 {
    if x.is_nan() {
        return 0x80;
    }
    if x == 0.0 {
        return 0x00;
    }
    let s: u8 = if x < 0.0 { 0x80 } else { 0 };
    if x.is_infinite() {
        return s | 0x6F;
    }
    let bits = x.abs().to_bits();
    let (mut e, mant) = {
        let be = (bits >> 23) as i32;
        let m = bits & 0x7F_FFFF;
        if be == 0 {
            // f32 subnormal: normalise (these are far below 2^−23 anyway).
            let lz = m.leading_zeros() - 8; // zeros within the 23-bit field, ≥ 1
            (-126 - lz as i32, (m << lz) & 0x7F_FFFF)
        } else {
            (be - 127, m)
        }
    };
    if e > 15 {
        return s | 0x6F;
    }
    if e < -23 {
        return 0x00;
    }
    let kept;
    if e == -23 {
        // Everything is discarded and [2^−23, 2^−22) is at or above the midpoint: 2^−22.
        e = -22;
        kept = 0;
    } else {
        let w = kept_bits(e.unsigned_abs());
        let rounded = mant + (1 << (22 - w));
        if rounded >> 23 != 0 {
            e += 1;
            kept = 0;
        } else {
            kept = rounded >> (23 - w);
        }
    }
    if e > 15 || (e == 15 && kept != 0) {
        return s | 0x6F;
    }
    if e <= -16 {
        return s | (e + 23) as u8;
    }
    let a = e.unsigned_abs();
    let neg = (e < 0) as u32;
    let code = match a {
        0 => 0b000_1000 | kept,
        1 => 0b001_0000 | (neg << 3) | kept,
        2..=3 => 0b010_0000 | (neg << 4) | ((a - 2) << 3) | kept,
        4..=7 => 0b100_0000 | (neg << 4) | ((a - 4) << 2) | kept,
        _ => 0b110_0000 | (neg << 4) | ((a - 8) << 1) | kept,
    };
    s | code as u8
}

/// §4.6 weights: one row of bf16 values (as f32) to HiF8 codes with one f32 scale,
/// `scale = max|w| / 32768`, `q = HiF8_TA(w / scale)`. Returns the scale. An all-zero row gives
/// scale 0 and codes 0 (the NPU kernel's 0/0 is not specified).
pub fn quantize_row_hif8(row: &[f32], q: &mut [u8]) -> f32 {
    assert_eq!(row.len(), q.len(), "quantize_row_hif8: lengths");
    let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = amax / HIF8_MAX;
    if scale == 0.0 {
        q.fill(0);
        return 0.0;
    }
    for (o, &x) in q.iter_mut().zip(row) {
        *o = f32_to_hif8(x / scale);
    }
    scale
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decoding written independently from the bit table of §4.6, in f64.
    fn spec_value(c: u8) -> Option<f64> {
        if c == 0x80 {
            return None;
        }
        let s = if c & 0x80 != 0 { -1.0 } else { 1.0 };
        let bits: Vec<u8> = (0..7).rev().map(|i| (c >> i) & 1).collect();
        let (d, rest): (usize, &[u8]) = match (bits[0], bits[1], bits[2], bits[3]) {
            (1, 1, _, _) => (4, &bits[2..]),
            (1, 0, _, _) => (3, &bits[2..]),
            (0, 1, _, _) => (2, &bits[2..]),
            (0, 0, 1, _) => (1, &bits[3..]),
            (0, 0, 0, 1) => (0, &bits[4..]),
            _ => {
                let m = (c & 7) as i32;
                return Some(if m == 0 { 0.0 } else { s * 2f64.powi(m - 23) });
            }
        };
        let e = if d == 0 {
            0
        } else {
            let mut mag = 1i32;
            for &b in &rest[1..d] {
                mag = mag * 2 + b as i32;
            }
            if rest[0] == 1 {
                -mag
            } else {
                mag
            }
        };
        let mbits = &rest[d..];
        let mut m = 0.0;
        for (i, &b) in mbits.iter().enumerate() {
            m += b as f64 * 2f64.powi(-(i as i32) - 1);
        }
        if e == 15 && m > 0.0 {
            return Some(s * f64::INFINITY);
        }
        Some(s * 2f64.powi(e) * (1.0 + m))
    }

    #[test]
    fn full_table_and_round_trip() {
        let mut finite = 0;
        let mut positive = 0;
        for c in 0..=255u8 {
            let v = hif8_to_f32(c);
            match spec_value(c) {
                None => assert!(v.is_nan(), "{c:#04x}"),
                Some(w) => assert_eq!(v as f64, w, "{c:#04x}"),
            }
            if v.is_finite() {
                finite += 1;
                if v > 0.0 {
                    positive += 1;
                }
                assert_eq!(f32_to_hif8(v), c, "round trip of {c:#04x} = {v}");
            }
        }
        assert_eq!(finite, 253);
        assert_eq!(positive, 126);
        assert_eq!(hif8_to_f32(0x6E), 32768.0);
        assert_eq!(hif8_to_f32(0x6F), f32::INFINITY);
        assert_eq!(hif8_to_f32(0xEF), f32::NEG_INFINITY);
        assert_eq!(hif8_to_f32(0x01), 2f32.powi(-22));
        assert_eq!(hif8_to_f32(0x08), 1.0);
        assert_eq!(hif8_table()[0x08], 1.0);
    }

    #[test]
    fn spec_edge_values() {
        let enc = |x: f32| hif8_to_f32(f32_to_hif8(x));
        assert_eq!(enc(1.0625), 1.125, "ties away");
        assert_eq!(enc(-1.0625), -1.125);
        assert_eq!(enc(1.0624), 1.0);
        assert_eq!(enc(40000.0), 32768.0);
        assert_eq!(enc(40959.0), 32768.0);
        assert_eq!(enc(40960.0), f32::INFINITY);
        assert_eq!(enc(-1e9), f32::NEG_INFINITY);
        assert_eq!(enc(2f32.powi(-23)), 2f32.powi(-22));
        assert_eq!(enc(2f32.powi(-23) * 1.9), 2f32.powi(-22));
        assert_eq!(f32_to_hif8(2f32.powi(-23) * 0.99), 0x00);
        assert_eq!(f32_to_hif8(-1e-30), 0x00);
        assert_eq!(f32_to_hif8(-0.0), 0x00);
        assert_eq!(f32_to_hif8(f32::NAN), 0x80);
        // 1.5·2^−20 (a tie between 2^−20 and 2^−19) → 2^−19; width changes across exponents.
        assert_eq!(enc(1.5 * 2f32.powi(-20)), 2f32.powi(-19));
        assert_eq!(enc(7.9), 8.0);
        assert_eq!(enc(7.4), 7.5);
        assert_eq!(enc(7.2), 7.0);
        assert_eq!(enc(15.9), 16.0);
    }

    /// Every value between two consecutive finite codes goes to the nearer one, ties away.
    #[test]
    fn encoding_is_round_to_nearest_ties_away() {
        let mut vals: Vec<f32> = (0..=255u8)
            .map(hif8_to_f32)
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        vals.sort_by(|a, b| a.partial_cmp(b).unwrap());
        for w in vals.windows(2) {
            let (lo, hi) = (w[0], w[1]);
            let mid = ((lo as f64 + hi as f64) / 2.0) as f32;
            assert_eq!(hif8_to_f32(f32_to_hif8(mid)), hi, "tie {lo}..{hi}");
            let below = f32::from_bits(mid.to_bits() - 1);
            assert_eq!(hif8_to_f32(f32_to_hif8(below)), lo, "below tie {lo}..{hi}");
        }
    }

    #[test]
    fn row_quantization() {
        let row = [1.0f32, -0.5, 0.0, 2.0e-3];
        let mut q = [0u8; 4];
        let s = quantize_row_hif8(&row, &mut q);
        assert_eq!(s, 1.0 / 32768.0);
        assert_eq!(hif8_to_f32(q[0]) * s, 1.0);
        assert_eq!(hif8_to_f32(q[1]) * s, -0.5);
        assert_eq!(q[2], 0);
        let mut z = [7u8; 2];
        assert_eq!(quantize_row_hif8(&[0.0, -0.0], &mut z), 0.0);
        assert_eq!(z, [0, 0]);
    }
}
