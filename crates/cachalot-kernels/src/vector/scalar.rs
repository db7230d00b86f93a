//! Scalar twins of the vector kernels: the reference in tests and the fallback on CPUs without a
//! vector level (`CACHALOT_SIMD=scalar`, x86-64 without AVX2).
//!
//! Each twin does the AVX2 kernel's operations lane by lane (8 lanes: lane j takes the elements
//! ≡ j mod 8 of the full chunks, fused multiply-adds where AVX2 fuses, lanes added in AVX2's
//! `hsum` order, AVX2's Cephes `exp`), so every level gives the same bits; the tests check it.
//! Compilers vectorize some lane loops (where the CPU has FMA, `mul_add` is one instruction).

const LANES: usize = 8;

/// AVX2's `hsum` of 8 lanes: ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7)).
pub(crate) fn hsum8(v: [f32; LANES]) -> f32 {
    ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
}

/// x86 `maxps`: `a > b ? a : b` (the second operand when either is NaN).
fn max_ps(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// AVX2's `hmax` of 8 lanes, in its order.
fn hmax8(v: [f32; LANES]) -> f32 {
    let m = [
        max_ps(v[0], v[4]),
        max_ps(v[1], v[5]),
        max_ps(v[2], v[6]),
        max_ps(v[3], v[7]),
    ];
    max_ps(max_ps(m[0], m[2]), max_ps(m[1], m[3]))
}

/// e^x as `avx2::exp` computes one lane (Cephes `expf`: range reduction by ln 2 in two parts,
/// degree-6 polynomial; within 2 ulp of the correctly rounded result). 0 below ln(2^−126),
/// +inf above ln(f32::MAX), NaN for NaN.
pub(crate) fn exp(x: f32) -> f32 {
    const LO: f32 = -87.336_55;
    const HI: f32 = 88.722_83;
    let xc = max_ps(x, LO);
    let xc = if xc < HI { xc } else { HI };
    let n = (xc * std::f32::consts::LOG2_E).round_ties_even();
    let n = max_ps(n, -126.0);
    let n = if n < 127.0 { n } else { 127.0 };
    let r = (-n).mul_add(0.693_359_4, xc);
    let r = (-n).mul_add(-2.121_944_4e-4, r);
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_2e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = p.mul_add(r * r, r) + 1.0;
    let pow2 = f32::from_bits(((n as i32 + 127) as u32) << 23);
    let mut e = y * pow2;
    if x < LO {
        e = 0.0;
    }
    if x > HI {
        e = f32::INFINITY;
    }
    if x.is_nan() {
        e = x;
    }
    e
}

/// Σ a\[i\]·b\[i\] as `avx2::dot`: four 8-lane accumulators over 32-element chunks, then 8-element
/// chunks into the first, the four added pairwise, `hsum`, and the tail fused in order.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let mut acc = [[0.0f32; LANES]; 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            let o = i + 8 * k;
            for j in 0..LANES {
                acc[j] = a[o + j].mul_add(b[o + j], acc[j]);
            }
        }
        i += 32;
    }
    while i + 8 <= n {
        for j in 0..LANES {
            acc[0][j] = a[i + j].mul_add(b[i + j], acc[0][j]);
        }
        i += 8;
    }
    let v: [f32; LANES] =
        std::array::from_fn(|j| (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]));
    let mut s = hsum8(v);
    while i < n {
        s = a[i].mul_add(b[i], s);
        i += 1;
    }
    s
}

/// One row of `dot_rows`: lane j accumulates the columns ≡ j mod 8 of the full chunks with
/// fused multiply-adds (as the AVX2 kernel), lanes added in the AVX2 `hsum` order, then the tail columns fused into the sum in order — bit-identical across levels.
fn dot_row(q: &[f32], l: &[f32]) -> f32 {
    let full = l.len() / LANES * LANES;
    let mut acc = [0.0f32; LANES];
    for (x, y) in q[..full]
        .chunks_exact(LANES)
        .zip(l[..full].chunks_exact(LANES))
    {
        for j in 0..LANES {
            acc[j] = x[j].mul_add(y[j], acc[j]);
        }
    }
    let mut s = hsum8(acc);
    for c in full..l.len() {
        s = q[c].mul_add(l[c], s);
    }
    s
}

pub fn dot_rows(q: &[f32], l: &[f32], out: &mut [f32]) {
    let d = l.len();
    for (h, o) in out.iter_mut().enumerate() {
        *o = dot_row(&q[h * d..(h + 1) * d], l);
    }
}

/// `dot_rows_many` from the queries in lanes (`HeadLanes`: `qt[c·hp + h]`), the same chains.
pub fn dot_rows_lanes(qt: &[f32], hp: usize, d: usize, ls: &[&[f32]], out: &mut [f32]) {
    let heads = out.len() / ls.len().max(1);
    for (l, o) in ls.iter().zip(out.chunks_exact_mut(heads.max(1))) {
        for (h, o) in o.iter_mut().enumerate() {
            *o = (0..d).fold(0.0f32, |v, c| qt[c * hp + h].mul_add(l[c], v));
        }
    }
}

/// The tests' reference for `dot_rows_many`:
/// out[s·H + h] = Σ_c q[h·d + c]·ls[s][c] as one chain of fused multiply-adds over the columns
/// in order, from 0 (the SIMD kernels put heads in lanes, so every level runs this chain).
#[cfg(test)]
pub fn dot_rows_many(q: &[f32], ls: &[&[f32]], out: &mut [f32]) {
    let heads = out.len() / ls.len().max(1);
    let d = q.len() / heads.max(1);
    for (l, o) in ls.iter().zip(out.chunks_exact_mut(heads.max(1))) {
        for (h, o) in o.iter_mut().enumerate() {
            let qh = &q[h * d..(h + 1) * d];
            *o = qh
                .iter()
                .zip(*l)
                .fold(0.0f32, |v, (&a, &b)| a.mul_add(b, v));
        }
    }
}

/// `axpy_rows` for each of the rows `xs` in order, with the weights p[s·H..(s+1)·H].
pub fn axpy_rows_many(p: &[f32], xs: &[&[f32]], y: &mut [f32]) {
    let heads = p.len() / xs.len().max(1);
    for (x, ps) in xs.iter().zip(p.chunks_exact(heads.max(1))) {
        axpy_rows(ps, x, y);
    }
}

pub fn axpy_rows(p: &[f32], x: &[f32], y: &mut [f32]) {
    let d = x.len();
    for (h, &a) in p.iter().enumerate() {
        axpy(a, x, &mut y[h * d..(h + 1) * d]);
    }
}

pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = alpha.mul_add(*xi, *yi);
    }
}

pub fn scale_in_place(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}

pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let inv = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    for ((o, xi), w) in out.iter_mut().zip(x).zip(weight) {
        *o = (xi * inv) * w;
    }
}

pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(0.0 - g)) * u;
    }
}

pub fn softmax_in_place(x: &mut [f32]) -> (f32, f32) {
    let n = x.len();
    let full = n / LANES * LANES;
    let mut vmax = [f32::NEG_INFINITY; LANES];
    for chunk in x[..full].chunks_exact(LANES) {
        for j in 0..LANES {
            vmax[j] = max_ps(vmax[j], chunk[j]);
        }
    }
    let mut max = hmax8(vmax);
    for &v in &x[full..] {
        // One rule on every architecture (`f32::max` leaves ±0 to the target: aarch64's
        // `fmaxnm` gives +0): NaN never wins, a tie keeps the first.
        max = if max.is_nan() || v > max { v } else { max };
    }
    let mut sum = [0.0f32; LANES];
    for chunk in x[..full].chunks_exact_mut(LANES) {
        for j in 0..LANES {
            chunk[j] = exp(chunk[j] - max);
            sum[j] += chunk[j];
        }
    }
    if full < n {
        // As AVX2: the tail padded with −inf, whose lanes add exp(−inf) = 0.
        for j in 0..LANES {
            let e = exp(x.get(full + j).copied().unwrap_or(f32::NEG_INFINITY) - max);
            if full + j < n {
                x[full + j] = e;
            }
            sum[j] += e;
        }
    }
    let sum = hsum8(sum);
    scale_in_place(x, 1.0 / sum);
    (max, sum)
}

pub fn rope_deinterleave_in_place(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let (mut stack, mut heap) = ([0.0f32; 256], Vec::new());
    let copy = input_copy(x, &mut stack, &mut heap);
    rope_pairs(copy, x, cos, sin, 0);
}

/// A copy of `x` to read RoPE's pairs from (its outputs overwrite inputs that later pairs still
/// need): in `stack` for the usual head sizes (DeepSeek's rope dim is 64), else in `heap`.
pub(crate) fn input_copy<'a>(
    x: &[f32],
    stack: &'a mut [f32; 256],
    heap: &'a mut Vec<f32>,
) -> &'a [f32] {
    if x.len() <= stack.len() {
        stack[..x.len()].copy_from_slice(x);
        &stack[..x.len()]
    } else {
        heap.extend_from_slice(x);
        heap
    }
}

/// RoPE's pairs `from..cos.len()` from `copy` (the input) into `x`, as the SIMD kernels compute
/// each lane: AVX2's `fmsub(even, c, odd·s)` and `fmadd(odd, c, even·s)`. The SIMD kernels
/// finish their ragged tails here.
pub(crate) fn rope_pairs(copy: &[f32], x: &mut [f32], cos: &[f32], sin: &[f32], from: usize) {
    let half = cos.len();
    for i in from..half {
        let (e, o) = (copy[2 * i], copy[2 * i + 1]);
        x[i] = e.mul_add(cos[i], -(o * sin[i]));
        x[half + i] = o.mul_add(cos[i], e * sin[i]);
    }
}
