//! NEON twins of the AVX2 vector kernels (`vector/avx2.rs`) on aarch64 (`SimdLevel::Neon`):
//! dot, axpy, their many-row forms, scaling, RMSNorm, SwiGLU, softmax and the de-interleaving
//! RoPE, plus the latent-attention kernels (`vector::latent`, expanded here for 4 lanes).
//!
//! Every kernel gives AVX2's bits, so a model's logits on an Arm server are x86's: AVX2's 8-lane
//! vectors are two 4-lane registers here ([`V8`]: lanes 0-3 and 4-7), `vfmaq_f32` is the same
//! fused multiply-add lane by lane, horizontal sums and maxima run in AVX2's order, x86's
//! `maxps` (`a > b ? a : b`, the second operand when either is NaN) is a compare and select
//! where its NaN and ±0 rule shows, and `exp` is AVX2's Cephes polynomial step for step. The
//! latent-attention sums do not depend on the vector width at all (`vector::latent`).
//!
//! Checked against the scalar twins (`scalar.rs`, which state AVX2's operations lane by lane) by
//! the property tests of `vector/tests.rs`, run under `qemu-aarch64` on x86-64 hosts
//! (`tools/cross_aarch64.sh`, which also compares a model's log-probabilities with x86's bit
//! for bit). Not timed on an Arm host. Callers guarantee NEON (every AArch64 CPU has it) and
//! consistent lengths (checked by the dispatching wrappers in `vector/mod.rs`).
//!
//! Spec: `deepseek-v3-r1-kimi-k2.md` §3.1 (RMSNorm), §3.2 (RoPE, interleaved layout), §3.4
//! (absorbed MLA decode), §3.6 (SwiGLU), §3.7 (logits).

use std::arch::aarch64::*;

/// One of AVX2's 8-lane vectors: lanes 0-3 and 4-7.
#[derive(Clone, Copy)]
struct V8(float32x4_t, float32x4_t);

#[inline]
#[target_feature(enable = "neon")]
unsafe fn load8(p: *const f32) -> V8 {
    V8(vld1q_f32(p), vld1q_f32(p.add(4)))
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn store8(p: *mut f32, v: V8) {
    vst1q_f32(p, v.0);
    vst1q_f32(p.add(4), v.1);
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn splat8(x: f32) -> V8 {
    V8(vdupq_n_f32(x), vdupq_n_f32(x))
}

/// a·b + c, fused (AVX2's `fmadd(a, b, c)`).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn fma8(a: V8, b: V8, c: V8) -> V8 {
    V8(vfmaq_f32(c.0, a.0, b.0), vfmaq_f32(c.1, a.1, b.1))
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn add8(a: V8, b: V8) -> V8 {
    V8(vaddq_f32(a.0, b.0), vaddq_f32(a.1, b.1))
}

/// x86 `maxps` per lane: `a > b ? a : b` (so `b` when either is NaN, and `b` for ±0 against
/// ±0), which NEON's `fmax` is not.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn max_ps(a: float32x4_t, b: float32x4_t) -> float32x4_t {
    vbslq_f32(vcgtq_f32(a, b), a, b)
}

/// AVX2's `hsum`: ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7)).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn hsum(v: V8) -> f32 {
    let s = vaddq_f32(v.0, v.1);
    let p = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    vget_lane_f32::<0>(p) + vget_lane_f32::<1>(p)
}

/// AVX2's `hmax`, in its order: max(max(m0, m2), max(m1, m3)) with m_j = max(v_j, v_{j+4}),
/// each x86's `maxps`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn hmax(v: V8) -> f32 {
    let m = max_ps(v.0, v.1);
    let p = max_ps(m, vcombine_f32(vget_high_f32(m), vget_high_f32(m)));
    let (a, b) = (vgetq_lane_f32::<0>(p), vgetq_lane_f32::<1>(p));
    if a > b {
        a
    } else {
        b
    }
}

/// e^x for 4 lanes: `avx2::exp` step for step (Cephes `expf`; 0 below ln(2^−126), +inf above
/// ln(f32::MAX), NaN for NaN). Where x is NaN the clamps below give NaN too (NEON's `fmax`
/// propagates it, x86's `maxps` would give the bound); that lane is x at the end either way.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn exp4(x: float32x4_t) -> float32x4_t {
    const LO: f32 = -87.336_55;
    const HI: f32 = 88.722_83;
    let xc = vminq_f32(vmaxq_f32(x, vdupq_n_f32(LO)), vdupq_n_f32(HI));
    let n = vrndnq_f32(vmulq_f32(xc, vdupq_n_f32(std::f32::consts::LOG2_E)));
    let n = vminq_f32(vmaxq_f32(n, vdupq_n_f32(-126.0)), vdupq_n_f32(127.0));
    // x86's fnmadd(n, c, r) = −(n·c) + r, one rounding: NEON's fms r − n·c.
    let r = vfmsq_f32(xc, n, vdupq_n_f32(0.693_359_4));
    let r = vfmsq_f32(r, n, vdupq_n_f32(-2.121_944_4e-4));
    let mut p = vdupq_n_f32(1.987_569_1e-4);
    p = vfmaq_f32(vdupq_n_f32(1.398_2e-3), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.333_452e-3), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.166_579_6e-2), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.666_666_5e-1), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5), p, r);
    let r2 = vmulq_f32(r, r);
    let y = vaddq_f32(vfmaq_f32(r, p, r2), vdupq_n_f32(1.0));
    // n is integral and within [−126, 127], so truncation converts it exactly.
    let pow2 = vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(
        vcvtq_s32_f32(n),
        vdupq_n_s32(127),
    )));
    let mut e = vmulq_f32(y, pow2);
    e = vbslq_f32(vcltq_f32(x, vdupq_n_f32(LO)), vdupq_n_f32(0.0), e);
    e = vbslq_f32(vcgtq_f32(x, vdupq_n_f32(HI)), vdupq_n_f32(f32::INFINITY), e);
    vbslq_f32(vceqq_f32(x, x), e, x)
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn exp8(x: V8) -> V8 {
    V8(exp4(x.0), exp4(x.1))
}

/// e^x per lane (for the tests: AVX2's `exp` against this).
#[cfg(test)]
pub(crate) fn exp_lanes(x: [f32; 4]) -> [f32; 4] {
    let mut out = [0.0f32; 4];
    // SAFETY: NEON is baseline on aarch64; both pointers address 4 values.
    unsafe { vst1q_f32(out.as_mut_ptr(), exp4(vld1q_f32(x.as_ptr()))) };
    out
}

#[target_feature(enable = "neon")]
pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [splat8(0.0); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            let o = i + 8 * k;
            *acc = fma8(load8(pa.add(o)), load8(pb.add(o)), *acc);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = fma8(load8(pa.add(i)), load8(pb.add(i)), acc[0]);
        i += 8;
    }
    let v = add8(add8(acc[0], acc[1]), add8(acc[2], acc[3]));
    let mut s = hsum(v);
    while i < n {
        s = a[i].mul_add(b[i], s);
        i += 1;
    }
    s
}

#[target_feature(enable = "neon")]
pub unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let va = vdupq_n_f32(alpha);
    let mut i = 0;
    while i + 4 <= n {
        vst1q_f32(
            py.add(i),
            vfmaq_f32(vld1q_f32(py.add(i)), va, vld1q_f32(px.add(i))),
        );
        i += 4;
    }
    while i < n {
        y[i] = alpha.mul_add(x[i], y[i]);
        i += 1;
    }
}

/// `scalar::dot_rows`, four rows at a time sharing each load of `l` (as `avx2::dot_rows`).
#[target_feature(enable = "neon")]
pub unsafe fn dot_rows(q: &[f32], l: &[f32], out: &mut [f32]) {
    let d = l.len();
    let full = d / 8 * 8;
    let (pq, pl) = (q.as_ptr(), l.as_ptr());
    let rows = out.len();
    let mut h = 0;
    while h < rows {
        let g = (rows - h).min(4);
        let mut acc = [splat8(0.0); 4];
        let mut c = 0;
        while c < full {
            let lv = load8(pl.add(c));
            for (k, a) in acc.iter_mut().enumerate().take(g) {
                *a = fma8(load8(pq.add((h + k) * d + c)), lv, *a);
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

/// `scalar::axpy_rows`: each 4-column chunk of `x` loaded once for all rows.
#[target_feature(enable = "neon")]
pub unsafe fn axpy_rows(p: &[f32], x: &[f32], y: &mut [f32]) {
    let d = x.len();
    let full = d / 4 * 4;
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let mut c = 0;
    while c < full {
        let xv = vld1q_f32(px.add(c));
        for (h, &a) in p.iter().enumerate() {
            let yp = py.add(h * d + c);
            vst1q_f32(yp, vfmaq_f32(vld1q_f32(yp), vdupq_n_f32(a), xv));
        }
        c += 4;
    }
    for (h, &a) in p.iter().enumerate() {
        for c in full..d {
            y[h * d + c] = a.mul_add(x[c], y[h * d + c]);
        }
    }
}

/// `latent_kernels!`'s zero.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn zero4() -> float32x4_t {
    vdupq_n_f32(0.0)
}

/// `latent_kernels!`'s FMA, a·b + c in AVX2's argument order.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn fma4(a: float32x4_t, b: float32x4_t, c: float32x4_t) -> float32x4_t {
    vfmaq_f32(c, a, b)
}

crate::vector::latent::latent_kernels!(
    "neon",
    float32x4_t,
    4,
    zero4,
    vld1q_f32,
    vst1q_f32,
    fma4,
    vdupq_n_f32
);

#[target_feature(enable = "neon")]
pub unsafe fn scale_in_place(x: &mut [f32], s: f32) {
    let n = x.len();
    let p = x.as_mut_ptr();
    let vs = vdupq_n_f32(s);
    let mut i = 0;
    while i + 4 <= n {
        vst1q_f32(p.add(i), vmulq_f32(vld1q_f32(p.add(i)), vs));
        i += 4;
    }
    while i < n {
        x[i] *= s;
        i += 1;
    }
}

#[target_feature(enable = "neon")]
pub unsafe fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let inv = 1.0 / (dot(x, x) / n as f32 + eps).sqrt();
    let vinv = vdupq_n_f32(inv);
    let (px, pw, po) = (x.as_ptr(), weight.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 4 <= n {
        let v = vmulq_f32(vld1q_f32(px.add(i)), vinv);
        vst1q_f32(po.add(i), vmulq_f32(v, vld1q_f32(pw.add(i))));
        i += 4;
    }
    while i < n {
        out[i] = (x[i] * inv) * weight[i];
        i += 1;
    }
}

/// silu(g)·u for 4 lanes: g / (1 + e^(0 − g)) · u.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn silu_mul4(g: float32x4_t, u: float32x4_t) -> float32x4_t {
    let neg = vsubq_f32(vdupq_n_f32(0.0), g);
    let den = vaddq_f32(vdupq_n_f32(1.0), exp4(neg));
    vmulq_f32(vdivq_f32(g, den), u)
}

#[target_feature(enable = "neon")]
pub unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = gate.len();
    let (pg, pu, po) = (gate.as_ptr(), up.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 4 <= n {
        let v = silu_mul4(vld1q_f32(pg.add(i)), vld1q_f32(pu.add(i)));
        vst1q_f32(po.add(i), v);
        i += 4;
    }
    if i < n {
        let k = n - i;
        let (mut g, mut u, mut o) = ([0.0f32; 4], [0.0f32; 4], [0.0f32; 4]);
        g[..k].copy_from_slice(&gate[i..]);
        u[..k].copy_from_slice(&up[i..]);
        vst1q_f32(
            o.as_mut_ptr(),
            silu_mul4(vld1q_f32(g.as_ptr()), vld1q_f32(u.as_ptr())),
        );
        out[i..].copy_from_slice(&o[..k]);
    }
}

#[target_feature(enable = "neon")]
pub unsafe fn softmax_in_place(x: &mut [f32]) -> (f32, f32) {
    let n = x.len();
    let p = x.as_mut_ptr();
    let mut vmax = splat8(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 8 <= n {
        let v = load8(p.add(i));
        vmax = V8(max_ps(vmax.0, v.0), max_ps(vmax.1, v.1));
        i += 8;
    }
    let mut max = hmax(vmax);
    for &v in &x[i..] {
        // One rule on every architecture (`f32::max` leaves ±0 to the target: aarch64's
        // `fmaxnm` gives +0): NaN never wins, a tie keeps the first.
        max = if max.is_nan() || v > max { v } else { max };
    }
    let vm = splat8(max);
    let mut vsum = splat8(0.0);
    i = 0;
    while i + 8 <= n {
        let v = load8(p.add(i));
        let e = exp8(V8(vsubq_f32(v.0, vm.0), vsubq_f32(v.1, vm.1)));
        store8(p.add(i), e);
        vsum = add8(vsum, e);
        i += 8;
    }
    if i < n {
        // Padded with −inf as AVX2: those lanes become exp(−inf) = 0 and add nothing.
        let k = n - i;
        let mut t = [f32::NEG_INFINITY; 8];
        t[..k].copy_from_slice(&x[i..]);
        let v = load8(t.as_ptr());
        let e = exp8(V8(vsubq_f32(v.0, vm.0), vsubq_f32(v.1, vm.1)));
        store8(t.as_mut_ptr(), e);
        vsum = add8(vsum, e);
        x[i..].copy_from_slice(&t[..k]);
    }
    let sum = hsum(vsum);
    scale_in_place(x, 1.0 / sum);
    (max, sum)
}

#[target_feature(enable = "neon")]
pub unsafe fn rope_deinterleave_in_place(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (mut stack, mut heap) = ([0.0f32; 256], Vec::new());
    let copy = super::scalar::input_copy(x, &mut stack, &mut heap);
    let (pc, ps, pin, po) = (cos.as_ptr(), sin.as_ptr(), copy.as_ptr(), x.as_mut_ptr());
    let mut i = 0;
    while i + 4 <= half {
        // `ld2` de-interleaves: the even elements of 8 values, and the odd ones.
        let pair = vld2q_f32(pin.add(2 * i));
        let (even, odd) = (pair.0, pair.1);
        let c = vld1q_f32(pc.add(i));
        let s = vld1q_f32(ps.add(i));
        // AVX2's fmsub(even, c, odd·s) and fmadd(odd, c, even·s), one rounding each.
        let lo = vfmaq_f32(vnegq_f32(vmulq_f32(odd, s)), even, c);
        let hi = vfmaq_f32(vmulq_f32(even, s), odd, c);
        vst1q_f32(po.add(i), lo);
        vst1q_f32(po.add(half + i), hi);
        i += 4;
    }
    super::scalar::rope_pairs(copy, x, cos, sin, i);
}
