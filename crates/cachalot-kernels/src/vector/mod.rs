//! Vector kernels: dot, axpy, scaling, RMSNorm, SwiGLU, softmax, log-softmax, argmax and the
//! de-interleaving RoPE rotation (spec `deepseek-v3-r1-kimi-k2.md` §3.1 RMSNorm, §3.2 RoPE with
//! DeepSeek's interleaved checkpoint layout, §3.6 SwiGLU experts, §3.7 logits).
//!
//! Each public function checks its slice lengths (a mismatch is a programmer error and panics
//! with a message) and dispatches on [`simd_level`] to an AVX2 kernel (also at the AVX-512 level,
//! except the latent-attention kernels, which have 16-lane twins: `vector::latent`), a NEON
//! kernel on aarch64 (`vector::neon`, AVX2's operations in 4-lane registers), or its scalar
//! twin; every level gives the scalar twin's bits.
//! `argmax` and `log_softmax_at` run once per sequence per step and stay scalar.

pub(crate) mod scalar;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod latent;

mod latent_bf16;
pub use latent_bf16::{axpy_rows_bf16, dot_rows_bf16, HeadPairs};

/// [`prefetch_rows`]' hint for L1.
#[cfg(target_arch = "x86_64")]
pub(crate) const PREFETCH_L1: i32 = std::arch::x86_64::_MM_HINT_T0;
/// [`prefetch_rows`]' hint for L2.
#[cfg(target_arch = "x86_64")]
pub(crate) const PREFETCH_L2: i32 = std::arch::x86_64::_MM_HINT_T1;
/// [`prefetch_rows`]' hint for L1 (`prfm pldl1keep`).
#[cfg(target_arch = "aarch64")]
pub(crate) const PREFETCH_L1: i32 = 1;
/// [`prefetch_rows`]' hint for L2 (`prfm pldl2keep`).
#[cfg(target_arch = "aarch64")]
pub(crate) const PREFETCH_L2: i32 = 2;

/// Asks for every cache line of rows `range` (those that exist) to be brought toward the core
/// (`HINT`: [`PREFETCH_L1`] or [`PREFETCH_L2`]): a hint, nothing is read. The latent attention
/// kernels use it because rows of the paged cache are scattered, so the hardware prefetcher
/// does not see them coming.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline]
pub(crate) fn prefetch_rows<const HINT: i32, T>(rows: &[&[T]], range: std::ops::Range<usize>) {
    let end = range.end.min(rows.len());
    for row in &rows[range.start.min(end)..end] {
        let p = row.as_ptr() as *const i8;
        let bytes = std::mem::size_of_val(*row);
        let mut o = 0;
        while o < bytes {
            prefetch_line::<HINT>(p.wrapping_add(o));
            o += 64;
        }
        if bytes > 0 {
            // The line of the last value (a row need not start on a line).
            prefetch_line::<HINT>(p.wrapping_add(bytes - 1));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_line<const HINT: i32>(p: *const i8) {
    // SAFETY: a prefetch reads nothing; the address is only a hint.
    unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(p) }
}

#[cfg(target_arch = "aarch64")]
#[inline(always)]
fn prefetch_line<const HINT: i32>(p: *const i8) {
    // SAFETY: `prfm` has no architectural effect beyond the caches and never faults; the
    // pointer is not dereferenced.
    unsafe {
        if HINT == PREFETCH_L1 {
            std::arch::asm!("prfm pldl1keep, [{0}]", in(reg) p, options(nostack, preserves_flags, readonly));
        } else {
            std::arch::asm!("prfm pldl2keep, [{0}]", in(reg) p, options(nostack, preserves_flags, readonly));
        }
    }
}

#[cfg(test)]
mod tests;

use rayon::prelude::*;

use crate::simd::{simd_level, SimdLevel};

/// Runs the scalar twin `scalar::$name` or, on an AVX2 or AVX-512 level, `avx2::$name`, on
/// NEON `neon::$name` (`unsafe` kernels with the scalar twin's bits).
macro_rules! dispatch {
    ($level:expr, $name:ident ( $($arg:expr),* )) => {{
        let level: SimdLevel = $level;
        debug_assert!(level.supported());
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a level is only ever `Avx2` or `Avx512` when the CPU supports avx2, fma
            // and f16c (`simd_level` and the tests check `supported()`; `Avx512` implies
            // them); lengths were checked above. `Avx512` runs the AVX2 vector kernels.
            SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe { avx2::$name($($arg),*) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: a level is only ever `Neon` when the CPU has Advanced SIMD (every
            // AArch64 CPU); lengths were checked above.
            SimdLevel::Neon => unsafe { neon::$name($($arg),*) },
            _ => scalar::$name($($arg),*),
        }
    }};
}

/// Σ a\[i\]·b\[i\], f32.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_at(simd_level(), a, b)
}

pub(crate) fn dot_at(level: SimdLevel, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: lengths differ");
    dispatch!(level, dot(a, b))
}

/// y += alpha·x.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    axpy_at(simd_level(), alpha, x, y)
}

pub(crate) fn axpy_at(level: SimdLevel, alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: x and y lengths differ");
    dispatch!(level, axpy(alpha, x, y))
}

/// out\[h\] = Σ_c q\[h·d + c\]·l\[c\] for every row h of `q` (`d = l.len()`): one vector scored
/// against many (attention: one cached latent row against every head's query). Each row's sum
/// runs over 8 lanes (column c in lane c mod 8), added in [`dot`]'s fixed lane order, then the
/// ragged tail in order — the same on every level but not bit-identical to [`dot`].
pub fn dot_rows(q: &[f32], l: &[f32], out: &mut [f32]) {
    dot_rows_at(simd_level(), q, l, out)
}

pub(crate) fn dot_rows_at(level: SimdLevel, q: &[f32], l: &[f32], out: &mut [f32]) {
    assert_eq!(
        q.len(),
        l.len() * out.len(),
        "dot_rows: q must hold out.len() rows of l.len() values"
    );
    dispatch!(level, dot_rows(q, l, out))
}

/// y\[h·d + c\] += p\[h\]·x\[c\] for every row h (`d = x.len()`): [`axpy`] of one vector into
/// many rows, each row bit-identical to `axpy(p[h], x, row)`.
pub fn axpy_rows(p: &[f32], x: &[f32], y: &mut [f32]) {
    axpy_rows_at(simd_level(), p, x, y)
}

pub(crate) fn axpy_rows_at(level: SimdLevel, p: &[f32], x: &[f32], y: &mut [f32]) {
    assert_eq!(
        y.len(),
        x.len() * p.len(),
        "axpy_rows: y must hold p.len() rows of x.len() values"
    );
    dispatch!(level, axpy_rows(p, x, y))
}

/// Every query row against each of several rows: out\[s·H + h\] = Σ_c q\[h·d + c\]·ls\[s\]\[c\]
/// (H = `out.len() / ls.len()` query rows of d = `q.len() / H` values), each sum one chain of
/// fused multiply-adds over the columns in order (not [`dot_rows`]' lane order: the SIMD
/// kernels hold heads in lanes, so every level and width gives the same bits). Attention over a
/// sequence's cached latent rows: each row value is loaded once for 4, 8 or 16 heads.
pub fn dot_rows_many(q: &[f32], ls: &[&[f32]], out: &mut [f32]) {
    dot_rows_many_at(simd_level(), q, ls, out)
}

pub(crate) fn dot_rows_many_at(level: SimdLevel, q: &[f32], ls: &[&[f32]], out: &mut [f32]) {
    let heads = out.len().checked_div(ls.len()).unwrap_or(0);
    if ls.is_empty() {
        assert!(
            out.is_empty(),
            "dot_rows_many: no rows, but out holds {}",
            out.len()
        );
        return;
    }
    dot_rows_lanes_at(level, &HeadLanes::new(q, heads), ls, out)
}

/// Query rows held for [`dot_rows_lanes`]: column-major, `hp` (a multiple of 16 ≥ heads) lanes
/// per column, the padding lanes zero (`t[c·hp + h] = q[h·d + c]`). Built once per query and
/// scored against any number of row sets (the chunks of an attention context).
pub struct HeadLanes {
    t: Vec<f32>,
    heads: usize,
    d: usize,
    hp: usize,
}

impl HeadLanes {
    /// The `heads` rows of `q` (each `q.len() / heads` values).
    pub fn new(q: &[f32], heads: usize) -> HeadLanes {
        assert!(
            heads > 0 && q.len().is_multiple_of(heads),
            "HeadLanes: q ({} values) must hold {heads} rows",
            q.len()
        );
        let d = q.len() / heads;
        let hp = heads.div_ceil(16) * 16;
        let mut t = vec![0.0f32; d * hp];
        for (c, col) in t.chunks_exact_mut(hp).enumerate() {
            for (h, v) in col[..heads].iter_mut().enumerate() {
                *v = q[h * d + c];
            }
        }
        HeadLanes { t, heads, d, hp }
    }
}

/// [`dot_rows_many`] from queries already in lanes: out\[s·H + h\] = Σ_c q\[h·d + c\]·ls\[s\]\[c\],
/// the same bits as `dot_rows_many` on the row-major queries.
pub fn dot_rows_lanes(q: &HeadLanes, ls: &[&[f32]], out: &mut [f32]) {
    dot_rows_lanes_at(simd_level(), q, ls, out)
}

pub(crate) fn dot_rows_lanes_at(level: SimdLevel, q: &HeadLanes, ls: &[&[f32]], out: &mut [f32]) {
    let (heads, d, hp) = (q.heads, q.d, q.hp);
    assert!(
        out.len() == ls.len() * heads,
        "dot_rows_lanes: out must hold ls.len() ({}) x {heads} heads values, got {}",
        ls.len(),
        out.len()
    );
    assert!(
        ls.iter().all(|l| l.len() == d),
        "dot_rows_lanes: every row must hold the queries' {d} values"
    );
    if ls.is_empty() {
        return;
    }
    let qt = &q.t[..];
    match level {
        // SAFETY: as in `dispatch!`; `Avx512` implies AVX-512 F (lengths checked above;
        // `qt` holds d·hp values, hp a multiple of 16).
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 if heads > 8 => unsafe { avx512::dot_rows_lanes(qt, hp, d, ls, out) },
        _ => dispatch!(level, dot_rows_lanes(qt, hp, d, ls, out)),
    }
}

/// [`axpy_rows`] of several rows in order: y\[h·d + c\] += Σ_s p\[s·H + h\]·xs\[s\]\[c\],
/// bit-identical to calling `axpy_rows(&p[s·H..(s+1)·H], xs[s], y)` for s = 0, 1, ….
pub fn axpy_rows_many(p: &[f32], xs: &[&[f32]], y: &mut [f32]) {
    axpy_rows_many_at(simd_level(), p, xs, y)
}

pub(crate) fn axpy_rows_many_at(level: SimdLevel, p: &[f32], xs: &[&[f32]], y: &mut [f32]) {
    let heads = p.len().checked_div(xs.len()).unwrap_or(0);
    assert!(
        heads * xs.len() == p.len() && heads > 0 || xs.is_empty() && p.is_empty(),
        "axpy_rows_many: p must hold xs.len() ({}) x heads values, got {}",
        xs.len(),
        p.len()
    );
    if xs.is_empty() {
        return;
    }
    let d = y.len() / heads;
    assert!(
        d * heads == y.len() && xs.iter().all(|x| x.len() == d),
        "axpy_rows_many: y must hold {heads} rows of each x's length"
    );
    match level {
        // SAFETY: as in `dispatch!`; `Avx512` implies AVX-512 F (lengths checked above).
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => unsafe { avx512::axpy_rows_many(p, xs, y) },
        _ => dispatch!(level, axpy_rows_many(p, xs, y)),
    }
}

/// x *= s.
pub fn scale_in_place(x: &mut [f32], s: f32) {
    scale_in_place_at(simd_level(), x, s)
}

pub(crate) fn scale_in_place_at(level: SimdLevel, x: &mut [f32], s: f32) {
    dispatch!(level, scale_in_place(x, s))
}

/// One row of RMSNorm (§3.1): out = x / sqrt(mean(x²) + eps) · weight, in f32, with the
/// product taken in HF's order (x·rsqrt first, then the weight).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_at(simd_level(), x, weight, eps, out)
}

pub(crate) fn rms_norm_at(level: SimdLevel, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(
        x.len(),
        weight.len(),
        "rms_norm: x and weight lengths differ"
    );
    assert_eq!(x.len(), out.len(), "rms_norm: x and out lengths differ");
    if x.is_empty() {
        return;
    }
    dispatch!(level, rms_norm(x, weight, eps, out))
}

/// RMSNorm of each `dim`-long row of `x` into the same row of `out` (rows in parallel when
/// there are many).
pub fn rms_norm_rows(x: &[f32], dim: usize, weight: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_rows_at(simd_level(), x, dim, weight, eps, out)
}

pub(crate) fn rms_norm_rows_at(
    level: SimdLevel,
    x: &[f32],
    dim: usize,
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    assert!(dim > 0, "rms_norm_rows: dim must be positive");
    assert_eq!(
        x.len() % dim,
        0,
        "rms_norm_rows: x length is not a multiple of dim"
    );
    assert_eq!(
        x.len(),
        out.len(),
        "rms_norm_rows: x and out lengths differ"
    );
    assert_eq!(
        weight.len(),
        dim,
        "rms_norm_rows: weight length differs from dim"
    );
    const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;
    if x.len() >= PARALLEL_MIN_ELEMENTS && x.len() / dim > 1 && crate::parallel::may_fork() {
        out.par_chunks_mut(dim)
            .zip(x.par_chunks(dim))
            .for_each(|(o, r)| rms_norm_at(level, r, weight, eps, o));
    } else {
        for (o, r) in out.chunks_mut(dim).zip(x.chunks(dim)) {
            rms_norm_at(level, r, weight, eps, o);
        }
    }
}

/// out = silu(gate)·up with silu(z) = z / (1 + e^−z) (the SwiGLU of §3.6).
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_at(simd_level(), gate, up, out)
}

pub(crate) fn silu_mul_at(level: SimdLevel, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: gate and up lengths differ");
    assert_eq!(
        gate.len(),
        out.len(),
        "silu_mul: gate and out lengths differ"
    );
    dispatch!(level, silu_mul(gate, up, out))
}

/// Softmax in place, numerically stable (the maximum is subtracted first), f32. An empty slice
/// is left alone; a slice that is all −inf (or holds NaN) becomes NaN, as in torch.
pub fn softmax_in_place(x: &mut [f32]) {
    softmax_in_place_at(simd_level(), x);
}

/// [`softmax_in_place`] (the same bits), returning the maximum m and the sum Σ exp(x − m) it
/// divided by, so partial softmaxes over chunks of a row can be merged (attention split over
/// chunks of positions). An empty slice gives (−inf, 0).
pub fn softmax_in_place_stats(x: &mut [f32]) -> (f32, f32) {
    softmax_in_place_at(simd_level(), x)
}

pub(crate) fn softmax_in_place_at(level: SimdLevel, x: &mut [f32]) -> (f32, f32) {
    if x.is_empty() {
        return (f32::NEG_INFINITY, 0.0);
    }
    dispatch!(level, softmax_in_place(x))
}

/// log p(index) under softmax(logits), computed stably in f64 (for perplexity).
pub fn log_softmax_at(logits: &[f32], index: usize) -> f32 {
    assert!(
        index < logits.len(),
        "log_softmax_at: index {index} is out of range for {} logits",
        logits.len()
    );
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut sum = 0.0f64;
    for &v in logits {
        sum += (v as f64 - max).exp();
    }
    (logits[index] as f64 - max - sum.ln()) as f32
}

/// The index of the largest element; ties go to the lowest index and NaN never wins. Returns 0
/// for an empty slice or one that is all NaN.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_value = f32::NAN;
    for (i, &v) in x.iter().enumerate() {
        if v > best_value || (best_value.is_nan() && !v.is_nan()) {
            best = i;
            best_value = v;
        }
    }
    best
}

/// The RoPE rotation for DeepSeek's interleaved layout (HF `rope_interleave=True`, §3.2): for
/// i < d/2, y[i] = x[2i]·cos[i] − x[2i+1]·sin[i] and y[d/2+i] = x[2i+1]·cos[i] + x[2i]·sin[i],
/// in place over x (len d = 2·cos.len()).
pub fn rope_deinterleave_in_place(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    rope_deinterleave_in_place_at(simd_level(), x, cos, sin)
}

pub(crate) fn rope_deinterleave_in_place_at(
    level: SimdLevel,
    x: &mut [f32],
    cos: &[f32],
    sin: &[f32],
) {
    assert_eq!(cos.len(), sin.len(), "rope: cos and sin lengths differ");
    assert_eq!(x.len(), 2 * cos.len(), "rope: x length must be 2·cos.len()");
    dispatch!(level, rope_deinterleave_in_place(x, cos, sin))
}
