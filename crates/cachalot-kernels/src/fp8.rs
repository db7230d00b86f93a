//! FP8 e4m3fn (spec `deepseek-v3-r1-kimi-k2.md` §2.2).
//!
//! Bits `s eeee mmm`, exponent bias 7. e = 0 is subnormal: (−1)^s·2^−6·(m/8); otherwise
//! (−1)^s·2^(e−7)·(1 + m/8). No infinities; 0x7F and 0xFF are NaN; the largest finite value is
//! 448. Decoding goes through a 256-entry table built at compile time.
//!
//! The SIMD matmul decodes without the table (see `matrix::avx2`): placing the 7 magnitude bits
//! at bits 7..13 of an f16 gives exactly value·2^−8 for every finite code, subnormals included,
//! because f16's exponent bias (15) exceeds e4m3's (7) by 8 and f16's subnormal step 2^−24 is
//! 2^−8 times e4m3's 2^−9·… step. The 2^8 is folded into the block scale.

/// The exact value of an e4m3fn code.
const fn decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let e = (b >> 3) & 0x0F;
    let m = b & 0x07;
    if e == 0x0F && m == 0x07 {
        return f32::NAN;
    }
    if e == 0 {
        // m · 2^−9, exact.
        sign * (m as f32) * (1.0 / 512.0)
    } else {
        // (8 + m) · 2^(e−10): build 2^(e−7) from its bits, exact.
        let pow2 = f32::from_bits(((e as u32) + 127 - 7) << 23);
        sign * pow2 * (1.0 + (m as f32) / 8.0)
    }
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

static E4M3_TABLE: [f32; 256] = build_table();

/// Whether `codes` hold an e4m3fn NaN (0x7F or 0xFF): a pass the compiler vectorizes, over
/// the thread pool for large inputs (a first product's scan of a big matrix).
pub fn has_e4m3_nan(codes: &[u8]) -> bool {
    use rayon::prelude::*;
    let chunk = |c: &[u8]| {
        c.iter()
            .fold(0u8, |acc, &b| acc | u8::from(b & 0x7F == 0x7F))
            != 0
    };
    if codes.len() >= 1 << 22 && crate::parallel::may_fork() {
        codes.par_chunks(1 << 16).any(chunk)
    } else {
        codes.chunks(256).any(chunk)
    }
}

/// The exact value of an e4m3fn code; 0x7F and 0xFF are NaN.
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3_TABLE[b as usize]
}

/// The 256-entry decoding table (index = code).
pub fn e4m3_table() -> &'static [f32; 256] {
    &E4M3_TABLE
}

/// The largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// Encodes `x` as e4m3fn, rounding to nearest with ties to even and saturating to ±448
/// (infinities too). NaN becomes 0x7F (or 0xFF with the sign bit). For tests and tools.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    if a < 1.0 / 64.0 {
        // Subnormal range (below 2^−6): the code is round(a / 2^−9), and 8 lands exactly on the
        // smallest normal code 0x08. Scaling by a power of two is exact.
        let m = (a * 512.0).round_ties_even() as u8;
        return sign | m;
    }
    let bits = a.to_bits();
    let mut exp = ((bits >> 23) as i32) - 127; // -6..=8
    let mant = bits & 0x7F_FFFF;
    let mut m = mant >> 20;
    let rest = mant & 0xF_FFFF;
    let half = 0x8_0000;
    if rest > half || (rest == half && m & 1 == 1) {
        m += 1;
        if m == 8 {
            m = 0;
            exp += 1;
        }
    }
    // a < 448 rounds at most to 448 = 0x7E, so the code never reaches the NaN pattern.
    let code = (((exp + 7) as u32) << 3) | m;
    sign | code.min(0x7E) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// §2.2's definition written as directly as possible, in f64.
    fn spec_value(b: u8) -> f64 {
        let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((b >> 3) & 0xF) as i32;
        let m = (b & 7) as f64;
        if e == 0 {
            s * 2f64.powi(-6) * (m / 8.0)
        } else {
            s * 2f64.powi(e - 7) * (1.0 + m / 8.0)
        }
    }

    #[test]
    fn all_codes_match_the_definition() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if b & 0x7F == 0x7F {
                assert!(v.is_nan(), "code {b:#04x} must be NaN");
            } else {
                assert_eq!(v as f64, spec_value(b), "code {b:#04x}");
                assert_eq!(e4m3_table()[b as usize].to_bits(), v.to_bits());
            }
        }
    }

    #[test]
    fn spec_test_vectors() {
        assert_eq!(e4m3_to_f32(0x01), 0.001953125);
        assert_eq!(e4m3_to_f32(0x08), 0.015625);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x40), 2.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert!(e4m3_to_f32(0x7F).is_nan());
        // The scan for NaN codes finds exactly those two, anywhere.
        let mut codes = vec![0x7Eu8; 1000];
        codes.extend((0..=255u8).filter(|b| b & 0x7F != 0x7F));
        assert!(!has_e4m3_nan(&codes));
        for (at, nan) in [(0, 0x7F), (999, 0xFF), (1100, 0x7F)] {
            let mut c = codes.clone();
            c[at] = nan;
            assert!(has_e4m3_nan(&c), "{at}");
        }
        assert!(e4m3_to_f32(0xFF).is_nan());
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn encode_round_trips_every_finite_code() {
        for b in 0..=255u8 {
            if b & 0x7F == 0x7F {
                continue;
            }
            assert_eq!(f32_to_e4m3(e4m3_to_f32(b)), b, "code {b:#04x}");
        }
    }

    #[test]
    fn encode_rounds_to_nearest_even_and_saturates() {
        // Between consecutive codes: midpoints go to the even code, others to the nearest.
        for b in 0..0x7Eu8 {
            let lo = e4m3_to_f32(b);
            let hi = e4m3_to_f32(b + 1);
            let mid = (lo as f64 + hi as f64) / 2.0;
            let mid = mid as f32;
            assert_eq!(
                mid as f64,
                (lo as f64 + hi as f64) / 2.0,
                "midpoint exact in f32"
            );
            let even = if b & 1 == 0 { b } else { b + 1 };
            assert_eq!(
                f32_to_e4m3(mid),
                even,
                "tie between {b:#04x} and {:#04x}",
                b + 1
            );
            assert_eq!(f32_to_e4m3(-mid), even | 0x80);
            let just_below = f32::from_bits(mid.to_bits() - 1);
            let just_above = f32::from_bits(mid.to_bits() + 1);
            assert_eq!(f32_to_e4m3(just_below), b);
            assert_eq!(f32_to_e4m3(just_above), b + 1);
        }
        assert_eq!(f32_to_e4m3(460.0), 0x7E);
        assert_eq!(f32_to_e4m3(1e9), 0x7E);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7E);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xFE);
        assert_eq!(f32_to_e4m3(f32::NAN) & 0x7F, 0x7F);
        assert_eq!(f32_to_e4m3(1e-30), 0x00);
        assert_eq!(f32_to_e4m3(-1e-30), 0x80);
    }
}
