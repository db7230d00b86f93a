//! AVX2 + FMA vector kernels. Callers guarantee the CPU supports `avx2,fma,f16c`
//! (`SimdLevel::Avx2.supported()`) and that slice lengths are consistent (checked by the
//! dispatching wrappers in `vector/mod.rs`).

use std::arch::x86_64::*;

/// Sum of the 8 lanes in a fixed order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hmax(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_max_ps(lo, hi);
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// e^x for 8 lanes (Cephes `expf`: range reduction by ln 2 in two parts, degree-6 polynomial;
/// within 2 ulp of the correctly rounded result). Underflows to 0 below ln(2^−126), overflows
/// to +inf above ln(f32::MAX), and propagates NaN.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn exp(x: __m256) -> __m256 {
    const LO: f32 = -87.336_55; // ln(2^-126): below it the result would be subnormal
    const HI: f32 = 88.722_83; // ln(f32::MAX)
    let xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        xc,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let n = _mm256_min_ps(
        _mm256_max_ps(n, _mm256_set1_ps(-126.0)),
        _mm256_set1_ps(127.0),
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), xc);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_2e-3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666_666_5e-1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
    let r2 = _mm256_mul_ps(r, r);
    let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    let mut e = _mm256_mul_ps(y, pow2);
    e = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(LO)), e);
    e = _mm256_blendv_ps(
        e,
        _mm256_set1_ps(f32::INFINITY),
        _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(HI)),
    );
    _mm256_blendv_ps(e, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            let o = i + 8 * k;
            *acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(o)), _mm256_loadu_ps(pb.add(o)), *acc);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i)),
            _mm256_loadu_ps(pb.add(i)),
            acc[0],
        );
        i += 8;
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut s = hsum(v);
    while i < n {
        s = a[i].mul_add(b[i], s);
        i += 1;
    }
    s
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let va = _mm256_set1_ps(alpha);
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
        _mm256_storeu_ps(py.add(i), v);
        i += 8;
    }
    while i < n {
        y[i] = alpha.mul_add(x[i], y[i]);
        i += 1;
    }
}

/// `scalar::dot_rows`, four rows at a time sharing each load of `l`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_rows(q: &[f32], l: &[f32], out: &mut [f32]) {
    let d = l.len();
    let full = d / 8 * 8;
    let (pq, pl) = (q.as_ptr(), l.as_ptr());
    let rows = out.len();
    let mut h = 0;
    while h < rows {
        let g = (rows - h).min(4);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut c = 0;
        while c < full {
            let lv = _mm256_loadu_ps(pl.add(c));
            for (k, a) in acc.iter_mut().enumerate().take(g) {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add((h + k) * d + c)), lv, *a);
            }
            c += 8;
        }
        for k in 0..g {
            let mut s = hsum(acc[k]);
            for c in full..d {
                s = q[(h + k) * d + c].mul_add(l[c], s);
            }
            out[h + k] = s;
        }
        h += g;
    }
}

/// `scalar::axpy_rows`: each 8-column chunk of `x` loaded once for all rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_rows(p: &[f32], x: &[f32], y: &mut [f32]) {
    let d = x.len();
    let full = d / 8 * 8;
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let mut c = 0;
    while c < full {
        let xv = _mm256_loadu_ps(px.add(c));
        for (h, &a) in p.iter().enumerate() {
            let yp = py.add(h * d + c);
            _mm256_storeu_ps(
                yp,
                _mm256_fmadd_ps(_mm256_set1_ps(a), xv, _mm256_loadu_ps(yp)),
            );
        }
        c += 8;
    }
    for (h, &a) in p.iter().enumerate() {
        for c in full..d {
            y[h * d + c] = a.mul_add(x[c], y[h * d + c]);
        }
    }
}

crate::vector::latent::latent_kernels!(
    "avx2,fma,f16c",
    __m256,
    8,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    _mm256_storeu_ps,
    _mm256_fmadd_ps,
    _mm256_set1_ps
);

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scale_in_place(x: &mut [f32], s: f32) {
    let n = x.len();
    let p = x.as_mut_ptr();
    let vs = _mm256_set1_ps(s);
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), vs));
        i += 8;
    }
    while i < n {
        x[i] *= s;
        i += 1;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let inv = 1.0 / (dot(x, x) / n as f32 + eps).sqrt();
    let vinv = _mm256_set1_ps(inv);
    let (px, pw, po) = (x.as_ptr(), weight.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_mul_ps(_mm256_loadu_ps(px.add(i)), vinv);
        _mm256_storeu_ps(po.add(i), _mm256_mul_ps(v, _mm256_loadu_ps(pw.add(i))));
        i += 8;
    }
    while i < n {
        out[i] = (x[i] * inv) * weight[i];
        i += 1;
    }
}

/// silu(g)·u for 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn silu_mul8(g: __m256, u: __m256) -> __m256 {
    let neg = _mm256_sub_ps(_mm256_setzero_ps(), g);
    let den = _mm256_add_ps(_mm256_set1_ps(1.0), exp(neg));
    _mm256_mul_ps(_mm256_div_ps(g, den), u)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = gate.len();
    let (pg, pu, po) = (gate.as_ptr(), up.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        let v = silu_mul8(_mm256_loadu_ps(pg.add(i)), _mm256_loadu_ps(pu.add(i)));
        _mm256_storeu_ps(po.add(i), v);
        i += 8;
    }
    if i < n {
        let k = n - i;
        let (mut g, mut u, mut o) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
        g[..k].copy_from_slice(&gate[i..]);
        u[..k].copy_from_slice(&up[i..]);
        _mm256_storeu_ps(
            o.as_mut_ptr(),
            silu_mul8(_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr())),
        );
        out[i..].copy_from_slice(&o[..k]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn softmax_in_place(x: &mut [f32]) -> (f32, f32) {
    let n = x.len();
    let p = x.as_mut_ptr();
    let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 8 <= n {
        vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p.add(i)));
        i += 8;
    }
    let mut max = hmax(vmax);
    for &v in &x[i..] {
        // One rule on every architecture (`f32::max` leaves ±0 to the target: aarch64's
        // `fmaxnm` gives +0): NaN never wins, a tie keeps the first.
        max = if max.is_nan() || v > max { v } else { max };
    }
    let vm = _mm256_set1_ps(max);
    let mut vsum = _mm256_setzero_ps();
    i = 0;
    while i + 8 <= n {
        let e = exp(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vm));
        _mm256_storeu_ps(p.add(i), e);
        vsum = _mm256_add_ps(vsum, e);
        i += 8;
    }
    if i < n {
        // Pad with −inf: those lanes become exp(−inf) = 0 and add nothing to the sum.
        let k = n - i;
        let mut t = [f32::NEG_INFINITY; 8];
        t[..k].copy_from_slice(&x[i..]);
        let e = exp(_mm256_sub_ps(_mm256_loadu_ps(t.as_ptr()), vm));
        _mm256_storeu_ps(t.as_mut_ptr(), e);
        vsum = _mm256_add_ps(vsum, e);
        x[i..].copy_from_slice(&t[..k]);
    }
    let sum = hsum(vsum);
    scale_in_place(x, 1.0 / sum);
    (max, sum)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rope_deinterleave_in_place(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (mut stack, mut heap) = ([0.0f32; 256], Vec::new());
    let copy = super::scalar::input_copy(x, &mut stack, &mut heap);
    let (pc, ps, pin, po) = (cos.as_ptr(), sin.as_ptr(), copy.as_ptr(), x.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= half {
        let a = _mm256_loadu_ps(pin.add(2 * i));
        let b = _mm256_loadu_ps(pin.add(2 * i + 8));
        // shuffle_ps works within 128-bit lanes: [a0 a2 b0 b2 | a4 a6 b4 b6], then
        // permute 64-bit quarters (0, 2, 1, 3) to get [a0 a2 a4 a6 b0 b2 b4 b6].
        let even = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(
            _mm256_shuffle_ps::<0b10_00_10_00>(a, b),
        )));
        let odd = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(
            _mm256_shuffle_ps::<0b11_01_11_01>(a, b),
        )));
        let c = _mm256_loadu_ps(pc.add(i));
        let s = _mm256_loadu_ps(ps.add(i));
        let lo = _mm256_fmsub_ps(even, c, _mm256_mul_ps(odd, s));
        let hi = _mm256_fmadd_ps(odd, c, _mm256_mul_ps(even, s));
        _mm256_storeu_ps(po.add(i), lo);
        _mm256_storeu_ps(po.add(half + i), hi);
        i += 8;
    }
    super::scalar::rope_pairs(copy, x, cos, sin, i);
}
