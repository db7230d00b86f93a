//! Scalar twins of the vector kernels: the reference in tests and the fallback elsewhere.
//!
//! Reductions keep 8 independent partial sums (lane j takes the elements ≡ j mod 8), which
//! compilers vectorize on any target and which mirrors the SIMD kernels' summation shape.

const LANES: usize = 8;

fn sum_lanes(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    for j in 0..ra.len() {
        acc[j] += ra[j] * rb[j];
    }
    sum_lanes(acc)
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
    // The AVX2 `hsum` order.
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
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
        *yi += alpha * xi;
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
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

pub fn softmax_in_place(x: &mut [f32]) -> (f32, f32) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut acc = [0.0f32; LANES];
    for (i, v) in x.iter_mut().enumerate() {
        *v = (*v - max).exp();
        acc[i % LANES] += *v;
    }
    let sum = sum_lanes(acc);
    scale_in_place(x, 1.0 / sum);
    (max, sum)
}

pub fn rope_deinterleave_in_place(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    // Outputs overwrite inputs that later pairs still need, so read the pairs first (on the
    // stack for the usual head sizes: DeepSeek's rope dim is 64).
    let mut stack = [0.0f32; 256];
    let mut heap = Vec::new();
    let copy: &[f32] = if x.len() <= stack.len() {
        stack[..x.len()].copy_from_slice(x);
        &stack[..x.len()]
    } else {
        heap.extend_from_slice(x);
        &heap
    };
    for i in 0..half {
        let (e, o) = (copy[2 * i], copy[2 * i + 1]);
        x[i] = e * cos[i] - o * sin[i];
        x[half + i] = o * cos[i] + e * sin[i];
    }
}
