//! Every vector kernel at every supported level against an f64 reference (which also checks the
//! scalar twin), on random non-zero inputs, with outputs poisoned by NaN first.

use proptest::prelude::*;

use super::*;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn levels() -> Vec<SimdLevel> {
    SimdLevel::ALL
        .iter()
        .copied()
        .filter(|l| l.supported())
        .collect()
}

/// Non-zero values with magnitudes in [lo, hi] and random signs.
fn values(
    len: impl Into<proptest::sample::SizeRange>,
    lo: f32,
    hi: f32,
) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec((lo..hi, any::<bool>()), len).prop_map(|v| {
        v.into_iter()
            .map(|(m, neg)| if neg { -m } else { m })
            .collect()
    })
}

/// Values in [−1, 1) from an xorshift stream seeded by `seed`.
fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut st = seed | 1;
    move || {
        st ^= st << 13;
        st ^= st >> 7;
        st ^= st << 17;
        (st >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn close(got: f32, want: f64, rel: f64, scale: f64) -> bool {
    (got as f64 - want).abs() <= rel * scale + 1e-30
}

proptest! {
    /// dot_rows: every level gives the scalar twin's bits, close to the f64 sums; axpy_rows
    /// equals axpy row by row, bit for bit.
    #[test]
    fn dot_rows_and_axpy_rows((d, rows) in (1usize..90, 1usize..11), seed in any::<u64>()) {
        let mut next = uniform(seed);
        let q: Vec<f32> = (0..rows * d).map(|_| next()).collect();
        let l: Vec<f32> = (0..d).map(|_| next()).collect();
        let p: Vec<f32> = (0..rows).map(|_| next()).collect();
        let y0: Vec<f32> = (0..rows * d).map(|_| next()).collect();
        let mut want = vec![0.0f32; rows];
        crate::vector::scalar::dot_rows(&q, &l, &mut want);
        for level in levels() {
            let mut out = vec![f32::NAN; rows];
            dot_rows_at(level, &q, &l, &mut out);
            prop_assert_eq!(bits(&out), bits(&want), "{:?}", level);
            for h in 0..rows {
                let exact: f64 = (0..d).map(|c| q[h * d + c] as f64 * l[c] as f64).sum();
                let scale: f64 = (0..d).map(|c| (q[h * d + c] as f64 * l[c] as f64).abs()).sum();
                prop_assert!(close(out[h], exact, 1e-5, scale), "{} vs {}", out[h], exact);
            }
            let mut y = y0.clone();
            axpy_rows_at(level, &p, &l, &mut y);
            for h in 0..rows {
                let mut row = y0[h * d..(h + 1) * d].to_vec();
                axpy_at(level, p[h], &l, &mut row);
                prop_assert_eq!(bits(&y[h * d..(h + 1) * d]), bits(&row), "{:?} row {}", level, h);
            }
        }
    }

    /// softmax_in_place_stats: the same bits as softmax_in_place, with the maximum and the
    /// sum it divided by.
    #[test]
    fn softmax_stats_are_the_divisor(x in values(1..60usize, 0.01, 8.0)) {
        for level in levels() {
            let mut a = x.clone();
            softmax_in_place_at(level, &mut a);
            let mut b = x.clone();
            let (m, sum) = softmax_in_place_at(level, &mut b);
            prop_assert_eq!(bits(&a), bits(&b));
            prop_assert_eq!(m, x.iter().copied().fold(f32::NEG_INFINITY, f32::max));
            let want: f64 = x.iter().map(|&v| ((v - m) as f64).exp()).sum();
            prop_assert!(close(sum, want, 1e-5, want), "{} vs {}", sum, want);
        }
    }

    /// The many-row forms: `dot_rows_many` gives the scalar chain's bits at every level (heads in
    /// lanes, so widths 8 and 16 with partial head blocks), close to the f64 sums;
    /// `axpy_rows_many` gives the bits of `axpy_rows` row by row.
    #[test]
    fn many_row_forms((d, heads, n) in (1usize..90, 1usize..40, 0usize..20),
                      seed in any::<u64>()) {
        let mut next = uniform(seed);
        let q: Vec<f32> = (0..heads * d).map(|_| next()).collect();
        let rows: Vec<Vec<f32>> = (0..n).map(|_| (0..d).map(|_| next()).collect()).collect();
        let ls: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
        let p: Vec<f32> = (0..n * heads).map(|_| next()).collect();
        let y0: Vec<f32> = (0..heads * d).map(|_| next()).collect();
        let mut want = vec![f32::NAN; n * heads];
        crate::vector::scalar::dot_rows_many(&q, &ls, &mut want);
        for (s, l) in ls.iter().enumerate() {
            for h in 0..heads {
                let qh = &q[h * d..(h + 1) * d];
                let exact: f64 = qh.iter().zip(*l).map(|(&a, &b)| a as f64 * b as f64).sum();
                let scale: f64 = qh.iter().zip(*l).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                let got = want[s * heads + h];
                prop_assert!(close(got, exact, 1e-5, scale), "{} vs {}", got, exact);
            }
        }
        for level in levels() {
            let mut out = vec![f32::NAN; n * heads];
            dot_rows_many_at(level, &q, &ls, &mut out);
            prop_assert_eq!(bits(&out), bits(&want), "{:?}", level);
            let mut y = y0.clone();
            axpy_rows_many_at(level, &p, &ls, &mut y);
            let mut y_want = y0.clone();
            for (s, l) in ls.iter().enumerate() {
                axpy_rows_at(level, &p[s * heads..(s + 1) * heads], l, &mut y_want);
            }
            prop_assert_eq!(bits(&y), bits(&y_want), "{:?}", level);
        }
    }

    #[test]
    fn dot_matches_f64((a, b) in (1usize..300).prop_flat_map(|n| (values(n, 0.01, 4.0), values(n, 0.01, 4.0)))) {
        let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let bound: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum();
        for level in levels() {
            let got = dot_at(level, &a, &b);
            prop_assert!(close(got, want, 1e-6, bound), "{level:?}: {got} vs {want}");
        }
    }

    #[test]
    fn axpy_matches_f64((x, y) in (1usize..300).prop_flat_map(|n| (values(n, 0.01, 4.0), values(n, 0.01, 4.0))), alpha in -3.0f32..3.0) {
        for level in levels() {
            let mut out = y.clone();
            axpy_at(level, alpha, &x, &mut out);
            for i in 0..x.len() {
                let want = y[i] as f64 + alpha as f64 * x[i] as f64;
                let scale = (y[i] as f64).abs() + (alpha as f64 * x[i] as f64).abs();
                prop_assert!(close(out[i], want, 2e-7, scale), "{level:?} [{i}]: {} vs {want}", out[i]);
            }
        }
    }

    #[test]
    fn scale_is_exact_per_element(x in values(1..300, 0.01, 4.0), s in 0.1f32..3.0) {
        for level in levels() {
            let mut out = x.clone();
            scale_in_place_at(level, &mut out, s);
            for i in 0..x.len() {
                prop_assert_eq!(out[i].to_bits(), (x[i] * s).to_bits());
            }
        }
    }

    #[test]
    fn rms_norm_matches_f64((x, w) in (1usize..300).prop_flat_map(|n| (values(n, 0.01, 4.0), values(n, 0.1, 2.0))), eps in 1e-6f32..1e-3) {
        let n = x.len() as f64;
        let ms: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for level in levels() {
            let mut out = vec![f32::NAN; x.len()];
            rms_norm_at(level, &x, &w, eps, &mut out);
            for i in 0..x.len() {
                let want = x[i] as f64 * inv * w[i] as f64;
                prop_assert!(close(out[i], want, 1e-5, want.abs()), "{level:?} [{i}]: {} vs {want}", out[i]);
            }
        }
    }

    #[test]
    fn rms_norm_rows_equals_per_row((dim, rows) in (1usize..100, 1usize..6), seed in any::<u64>()) {
        let mut rng = seed | 1;
        let mut next = || { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; (rng % 2000) as f32 / 500.0 - 2.001 };
        let x: Vec<f32> = (0..dim * rows).map(|_| next()).collect();
        let w: Vec<f32> = (0..dim).map(|_| next()).collect();
        for level in levels() {
            let mut out = vec![f32::NAN; x.len()];
            rms_norm_rows_at(level, &x, dim, &w, 1e-6, &mut out);
            for r in 0..rows {
                let mut one = vec![f32::NAN; dim];
                rms_norm_at(level, &x[r * dim..(r + 1) * dim], &w, 1e-6, &mut one);
                prop_assert_eq!(&out[r * dim..(r + 1) * dim], &one[..]);
            }
        }
    }

    #[test]
    fn silu_mul_matches_f64((g, u) in (1usize..300).prop_flat_map(|n| (values(n, 0.01, 100.0), values(n, 0.01, 4.0)))) {
        for level in levels() {
            let mut out = vec![f32::NAN; g.len()];
            silu_mul_at(level, &g, &u, &mut out);
            for i in 0..g.len() {
                let z = g[i] as f64;
                let want = z / (1.0 + (-z).exp()) * u[i] as f64;
                prop_assert!(close(out[i], want, 1e-6, want.abs()), "{level:?} [{i}] g={}: {} vs {want}", g[i], out[i]);
            }
        }
    }

    #[test]
    fn softmax_matches_f64(x in values(1..300, 0.01, 60.0)) {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let sum: f64 = x.iter().map(|v| (*v as f64 - max).exp()).sum();
        for level in levels() {
            let mut out = x.clone();
            softmax_in_place_at(level, &mut out);
            let mut total = 0.0f64;
            for i in 0..x.len() {
                let want = (x[i] as f64 - max).exp() / sum;
                total += out[i] as f64;
                prop_assert!(close(out[i], want, 1e-5, want) || (want < 1e-37 && out[i].abs() < 1e-37),
                    "{level:?} [{i}]: {} vs {want}", out[i]);
            }
            prop_assert!((total - 1.0).abs() < 1e-5);
        }
    }

    #[test]
    fn rope_matches_f64((x, angles) in (1usize..80).prop_flat_map(|h| (values(2 * h, 0.01, 4.0), values(h, 0.0, 6.3)))) {
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        let h = cos.len();
        for level in levels() {
            let mut y = x.clone();
            rope_deinterleave_in_place_at(level, &mut y, &cos, &sin);
            for i in 0..h {
                let (e, o, c, s) = (x[2 * i] as f64, x[2 * i + 1] as f64, cos[i] as f64, sin[i] as f64);
                let scale = e.abs() + o.abs();
                prop_assert!(close(y[i], e * c - o * s, 1e-6, scale), "{level:?} lo[{i}]");
                prop_assert!(close(y[h + i], o * c + e * s, 1e-6, scale), "{level:?} hi[{i}]");
            }
        }
    }

    #[test]
    fn log_softmax_matches_f64(x in values(1..300, 0.01, 60.0), pick in any::<prop::sample::Index>()) {
        let i = pick.index(x.len());
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max + x.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln();
        let want = x[i] as f64 - lse;
        let got = log_softmax_at(&x, i);
        prop_assert!(close(got, want, 1e-6, want.abs().max(1.0)));
    }
}

proptest! {
    /// dot, axpy, RMSNorm, SwiGLU, softmax and RoPE give the scalar twin's bits at every level
    /// (the twins do AVX2's operations lane by lane, its `exp` included): one model, the same
    /// bits on every CPU. Gates reach ±100 so that `exp` meets its clamps.
    #[test]
    fn every_level_gives_the_scalar_bits((a, b) in (1usize..300).prop_flat_map(|n| (values(n, 0.01, 100.0), values(n, 0.01, 4.0))), alpha in -3.0f32..3.0) {
        let n = a.len();
        let h = n / 2;
        let angles: Vec<f32> = b[..h].iter().map(|v| v * 1.5).collect();
        let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
        let run = |level: SimdLevel| {
            let d = dot_at(level, &a, &b);
            let mut y = b.clone();
            axpy_at(level, alpha, &a, &mut y);
            let mut norm = vec![f32::NAN; n];
            rms_norm_at(level, &a, &b, 1e-6, &mut norm);
            let mut silu = vec![f32::NAN; n];
            silu_mul_at(level, &a, &b, &mut silu);
            let mut soft = a.clone();
            let stats = softmax_in_place_at(level, &mut soft);
            let mut rope = a[..2 * h].to_vec();
            rope_deinterleave_in_place_at(level, &mut rope, &cos, &sin);
            let mut all = vec![d, stats.0, stats.1];
            for v in [y, norm, silu, soft, rope] {
                all.extend(v);
            }
            bits(&all)
        };
        let want = run(SimdLevel::Scalar);
        for level in levels() {
            prop_assert_eq!(run(level), want.clone(), "{:?}", level);
        }
    }
}

#[test]
fn scalar_exp_is_accurate_and_handles_limits() {
    let mut worst = 0.0f64;
    let mut v = -87.0f32;
    while v < 88.7 {
        let want = (v as f64).exp();
        let err = ((scalar::exp(v) as f64 - want) / want).abs() / f32::EPSILON as f64;
        worst = worst.max(err);
        v += 0.0137;
    }
    assert!(worst < 4.0, "worst relative error {worst} eps");
    assert_eq!(scalar::exp(-100.0), 0.0);
    assert_eq!(scalar::exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(scalar::exp(100.0), f32::INFINITY);
    assert!(scalar::exp(f32::NAN).is_nan());
    assert_eq!(scalar::exp(0.0), 1.0);
}

#[test]
fn rope_long_vectors_use_the_heap_copy() {
    // Longer than the 256-element stack copy, where overwriting would corrupt later pairs.
    let h = 300;
    let x: Vec<f32> = (0..2 * h).map(|i| (i as f32 * 0.37).sin() + 1.5).collect();
    let cos: Vec<f32> = (0..h).map(|i| (i as f32 * 0.1).cos()).collect();
    let sin: Vec<f32> = (0..h).map(|i| (i as f32 * 0.1).sin()).collect();
    for level in levels() {
        let mut y = x.clone();
        rope_deinterleave_in_place_at(level, &mut y, &cos, &sin);
        for i in 0..h {
            let want = x[2 * i] as f64 * cos[i] as f64 - x[2 * i + 1] as f64 * sin[i] as f64;
            assert!((y[i] as f64 - want).abs() < 1e-5, "{level:?} [{i}]");
        }
    }
}

#[test]
fn argmax_ties_and_nan() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN, 5.0, 5.0]), 3);
    assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    assert_eq!(argmax(&[]), 0);
    assert_eq!(argmax(&[f32::NEG_INFINITY, -1e30]), 1);
    assert_eq!(argmax(&[-2.0, f32::NAN, -1.0]), 2);
}

#[test]
fn softmax_edge_cases() {
    for level in levels() {
        let mut empty: [f32; 0] = [];
        softmax_in_place_at(level, &mut empty);
        let mut x = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 1.0, -200.0];
        softmax_in_place_at(level, &mut x);
        assert_eq!(x[0], 0.0);
        assert_eq!(x[2], 0.0);
        assert!(
            (x[1] + x[3] - 1.0).abs() < 1e-6 && x[4] < 1e-37,
            "{level:?} {x:?}"
        );
    }
}

#[test]
fn log_softmax_is_stable_for_large_logits() {
    let x = [1000.0f32, 1000.0, -1000.0];
    assert!((log_softmax_at(&x, 0) - (-std::f32::consts::LN_2)).abs() < 1e-6);
    assert!(log_softmax_at(&x, 2) < -1999.0);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_exp_is_accurate_and_handles_limits() {
    use std::arch::x86_64::*;
    if !SimdLevel::Avx2.supported() {
        return;
    }
    let eval = |v: f32| -> f32 {
        // SAFETY: AVX2 support checked above.
        unsafe {
            let mut out = [0.0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), avx2::exp(_mm256_set1_ps(v)));
            out[0]
        }
    };
    let mut worst = 0.0f64;
    let mut v = -87.0f32;
    while v < 88.7 {
        let want = (v as f64).exp();
        let err = ((eval(v) as f64 - want) / want).abs() / f32::EPSILON as f64;
        worst = worst.max(err);
        v += 0.0137;
    }
    assert!(worst < 4.0, "worst relative error {worst} eps");
    assert_eq!(eval(-100.0), 0.0);
    assert_eq!(eval(f32::NEG_INFINITY), 0.0);
    assert_eq!(eval(100.0), f32::INFINITY);
    assert!(eval(f32::NAN).is_nan());
    assert_eq!(eval(0.0), 1.0);
}

#[cfg(target_arch = "aarch64")]
#[test]
fn neon_exp_gives_the_scalar_bits_everywhere() {
    let mut args = vec![
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::MIN_POSITIVE,
        -87.336_55,
        88.722_83,
        f32::from_bits(88.722_83f32.to_bits() + 1),
        f32::from_bits((-87.336_55f32).to_bits() + 1),
        f32::MAX,
        f32::MIN,
    ];
    let mut v = -120.0f32;
    while v < 120.0 {
        args.push(v);
        v += 0.0173;
    }
    for chunk in args.chunks(4) {
        let mut x = [0.5f32; 4];
        x[..chunk.len()].copy_from_slice(chunk);
        let got = neon::exp_lanes(x);
        for (g, &a) in got.iter().zip(&x) {
            let want = scalar::exp(a);
            assert!(
                g.to_bits() == want.to_bits() || g.is_nan() && want.is_nan(),
                "exp({a:e}): neon {g:e} vs scalar {want:e}"
            );
        }
    }
}

/// x86's `maxps` keeps its second operand for ±0 against ±0: the softmax maximum (and so the
/// returned statistics) has the scalar twin's sign on every level, in full chunks and the tail.
#[test]
fn softmax_maximum_of_signed_zeros_has_the_scalar_bits() {
    for n in [3usize, 8, 11, 16, 19] {
        for pattern in 0..4u32 {
            let x: Vec<f32> = (0..n)
                .map(|i| match (i as u32 + pattern) % 3 {
                    0 => -0.0,
                    1 => 0.0,
                    _ => -1.5,
                })
                .collect();
            let mut want = x.clone();
            let ws = scalar::softmax_in_place(&mut want);
            for level in levels() {
                let mut got = x.clone();
                let gs = softmax_in_place_at(level, &mut got);
                assert_eq!(bits(&got), bits(&want), "{level:?} n={n} pattern={pattern}");
                assert_eq!(
                    (gs.0.to_bits(), gs.1.to_bits()),
                    (ws.0.to_bits(), ws.1.to_bits()),
                    "{level:?} n={n} pattern={pattern}"
                );
            }
        }
    }
}
