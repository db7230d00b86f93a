//! bf16 and f16 scalar conversions (spec `deepseek-v3-r1-kimi-k2.md` §2.2: bf16 is the
//! checkpoints' dense dtype and the converter's rounding target; §5.2 reproduces its
//! round-to-nearest-even exactly).

/// The exact f32 value of a bf16 bit pattern.
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Rounds to bf16 with ties to even (as torch's `.to(torch.bfloat16)`); NaN stays a quiet NaN.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// `x` rounded to the nearest bf16 value (ties to even), as an f32: one bf16 tensor op of torch,
/// which computes in f32 and rounds the result (the converters' "bf16 per op" arithmetic).
#[inline]
pub fn bf16_round(x: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(x))
}

/// The exact f32 value of an IEEE f16 bit pattern.
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Rounds to IEEE f16 with ties to even.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_rounding() {
        for bits in [0u16, 0x8000, 0x3F80, 0xBF80, 0x7F7F, 0x0001, 0x7F80, 0xFF80] {
            assert_eq!(f32_to_bf16(bf16_to_f32(bits)), bits);
        }
        assert_eq!(bf16_to_f32(0x3F80), 1.0);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3F80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: goes up to even.
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3F82);
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0 + 1e-6), 0x3F81);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        // Overflow rounds to infinity as in IEEE.
        assert_eq!(f32_to_bf16(f32::MAX), 0x7F80);
        // Agrees with the `half` crate everywhere on a sweep.
        let mut x = 1.0e-30f32;
        while x < 1.0e30 {
            for v in [x, -x, x * 1.000_001] {
                assert_eq!(f32_to_bf16(v), half::bf16::from_f32(v).to_bits(), "{v}");
            }
            x *= 1.37;
        }
    }

    #[test]
    fn f16_round_trip() {
        for bits in [0u16, 0x8000, 0x3C00, 0x0001, 0x7BFF, 0xFBFF] {
            assert_eq!(f32_to_f16(f16_to_f32(bits)), bits);
        }
    }
}
