//! NEON integer products for aarch64 with the dot-product extension (`SimdLevel::Neon`; the
//! float formats' products are in `neon_float.rs`): the
//! W8A8 sum of `w8a8.rs` and the W4A8 sum of `w4a8.rs` (spec `deepseek-v3-r1-kimi-k2.md` §4,
//! `deepseek-v4.md` §4.2/§4.4), with `sdot`, which adds four i8·i8 products into each i32 lane.
//!
//! `sdot` multiplies signed by signed bytes, so neither AVX2's sign trick nor VNNI's +128
//! offset is needed: W8A8 feeds the stored bytes as they are. W4A8 splits 16 packed bytes into
//! 32 nibbles in column order (`and` / `ushr` / `zip1`, `zip2`: even columns are low nibbles)
//! and subtracts 8 from each, which leaves q ∈ [−8, 7] as a signed byte and no correction sum.
//! Each lane adds at most 4·128·127 per instruction, so |acc| stays in i32 for any real width,
//! and the sums are exact: every tile and thread split gives the scalar reference's bits (the
//! proptests in `w8a8.rs`, `w4a8.rs` and `tests.rs` run every supported level; on x86-64 this
//! file is checked by cross-compiling and running those tests under `qemu-aarch64`, see
//! `.ci/run`).
//!
//! `sdot` goes through `asm!` (its intrinsic `vdotq_s32` is not stable Rust yet); `prfm`
//! prefetches into L1 one row tile ahead (the x86 kernels now prefetch into L2 at least 16 KiB
//! ahead, `avx2::prefetch_tile_ahead`; not measured on aarch64, so this one is unchanged).

#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;
use std::arch::asm;
use std::ops::Range;

use super::w8a8::QuantizedTokens;
use super::{w4a8, w8a8, OutRows, WeightsView};

/// acc + Σ of each lane's four byte products.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: a register-only instruction of the dot-product extension, enabled here.
    unsafe {
        asm!(
            "sdot {0:v}.4s, {1:v}.16b, {2:v}.16b",
            inout(vreg) acc,
            in(vreg) a,
            in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// Prefetch the line at `base + offset` into L1; the address may lie past the matrix.
#[inline(always)]
fn prefetch_ahead(base: *const u8, offset: usize) {
    let p = base.wrapping_add(offset);
    // SAFETY: `prfm` has no architectural effect beyond the caches and never faults; the
    // pointer is not dereferenced.
    unsafe { asm!("prfm pldl1keep, [{0}]", in(reg) p, options(nostack, preserves_flags, readonly)) }
}

/// Which integer weight format a tile reads.
trait IntWeights {
    /// Columns one step of the vector loop covers (16 stored bytes in both formats).
    const STEP: usize;
    /// Bytes of one stored row of `cols` columns.
    fn row_bytes(cols: usize) -> usize;
    /// acc[t] += Σ over the STEP columns at `c` of q[c]·x[t, c].
    ///
    /// # Safety
    /// NEON + dotprod; `row` points at a stored row with columns c..c+STEP present; `x[t]`
    /// point at tokens with those columns.
    unsafe fn step<const NT: usize>(
        row: *const u8,
        c: usize,
        x: &[*const i8; NT],
        acc: &mut [int32x4_t; NT],
    );
    /// Exact Σ over columns `cols` of q·x for the vector loop's remainder.
    fn tail(w: &WeightsView, r: usize, x: &[i8], cols: Range<usize>) -> i32;
}

struct Int8;
struct Int4;

impl IntWeights for Int8 {
    const STEP: usize = 16;
    fn row_bytes(cols: usize) -> usize {
        cols
    }
    #[inline]
    #[target_feature(enable = "neon,dotprod")]
    unsafe fn step<const NT: usize>(
        row: *const u8,
        c: usize,
        x: &[*const i8; NT],
        acc: &mut [int32x4_t; NT],
    ) {
        // SAFETY: the caller's contract covers the loads.
        unsafe {
            let wv = vld1q_s8(row.add(c) as *const i8);
            for t in 0..NT {
                acc[t] = sdot(acc[t], wv, vld1q_s8(x[t].add(c)));
            }
        }
    }
    fn tail(w: &WeightsView, r: usize, x: &[i8], cols: Range<usize>) -> i32 {
        w8a8::dot_i8(&w8a8::weight_row(w, r)[cols.clone()], &x[cols])
    }
}

impl IntWeights for Int4 {
    const STEP: usize = 32;
    fn row_bytes(cols: usize) -> usize {
        cols / 2
    }
    #[inline]
    #[target_feature(enable = "neon,dotprod")]
    unsafe fn step<const NT: usize>(
        row: *const u8,
        c: usize,
        x: &[*const i8; NT],
        acc: &mut [int32x4_t; NT],
    ) {
        // SAFETY: the caller's contract covers the loads (16 bytes hold the 32 columns).
        unsafe {
            let b = vld1q_u8(row.add(c / 2));
            let lo = vandq_u8(b, vdupq_n_u8(0x0F));
            let hi = vshrq_n_u8::<4>(b);
            let eight = vdupq_n_s8(8);
            let q0 = vsubq_s8(vreinterpretq_s8_u8(vzip1q_u8(lo, hi)), eight);
            let q1 = vsubq_s8(vreinterpretq_s8_u8(vzip2q_u8(lo, hi)), eight);
            for t in 0..NT {
                let a = sdot(acc[t], q0, vld1q_s8(x[t].add(c)));
                acc[t] = sdot(a, q1, vld1q_s8(x[t].add(c + 16)));
            }
        }
    }
    fn tail(w: &WeightsView, r: usize, x: &[i8], cols: Range<usize>) -> i32 {
        w4a8::dot_w4(w4a8::weight_row(w, r), x, cols)
    }
}

/// W8A8 rows `rows`, all tokens.
///
/// # Safety
/// The CPU supports `SimdLevel::Neon`; `out` accepts writes for every row in `rows`; `xq`
/// holds `n_tokens` tokens of `w.cols` values; `w` is an int8 view.
#[target_feature(enable = "neon,dotprod")]
pub(crate) unsafe fn matmul_rows_w8a8(
    w: &WeightsView,
    rows: Range<usize>,
    xq: &QuantizedTokens,
    n_tokens: usize,
    out: &OutRows,
) {
    // SAFETY: forwarded contract.
    unsafe { matmul_rows::<Int8>(w, rows, xq, n_tokens, out) }
}

/// W4A8 rows `rows`, all tokens.
///
/// # Safety
/// As [`matmul_rows_w8a8`], for an int4 view with even `cols`.
#[target_feature(enable = "neon,dotprod")]
pub(crate) unsafe fn matmul_rows_w4a8(
    w: &WeightsView,
    rows: Range<usize>,
    xq: &QuantizedTokens,
    n_tokens: usize,
    out: &OutRows,
) {
    // SAFETY: forwarded contract.
    unsafe { matmul_rows::<Int4>(w, rows, xq, n_tokens, out) }
}

#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn matmul_rows<K: IntWeights>(
    w: &WeightsView,
    rows: Range<usize>,
    xq: &QuantizedTokens,
    n_tokens: usize,
    out: &OutRows,
) {
    let mut t0 = 0;
    while t0 < n_tokens {
        let nt = (n_tokens - t0).min(4);
        // SAFETY: forwarded contract; tokens t0..t0+nt exist.
        unsafe {
            match nt {
                1 => row_tiles::<K, 4, 1>(w, rows.clone(), xq, t0, out),
                2 => row_tiles::<K, 4, 2>(w, rows.clone(), xq, t0, out),
                3 => row_tiles::<K, 2, 3>(w, rows.clone(), xq, t0, out),
                _ => row_tiles::<K, 4, 4>(w, rows.clone(), xq, t0, out),
            }
        }
        t0 += nt;
    }
}

#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn row_tiles<K: IntWeights, const R: usize, const NT: usize>(
    w: &WeightsView,
    rows: Range<usize>,
    xq: &QuantizedTokens,
    t0: usize,
    out: &OutRows,
) {
    // SAFETY (both closures): rows r..r+R and row r exist; the caller's contract covers out.
    let tile_r = |r| unsafe { tile::<K, R, NT>(w, r, xq, t0) };
    let single = |r| unsafe { tile::<K, 1, NT>(w, r, xq, t0)[0] };
    // SAFETY: forwarded contract (rows are this task's).
    unsafe { w8a8::emit_row_tiles(w, rows, xq, t0, &[0; NT], out, tile_r, single) }
}

/// Exact i32 dot products of rows row0..row0+R with tokens t0..t0+NT.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn tile<K: IntWeights, const R: usize, const NT: usize>(
    w: &WeightsView,
    row0: usize,
    xq: &QuantizedTokens,
    t0: usize,
) -> [[i32; NT]; R] {
    let cols = w.cols;
    let rb = K::row_bytes(cols);
    let mut acc = [[vdupq_n_s32(0); NT]; R];
    let mut wp = [std::ptr::null::<u8>(); R];
    for i in 0..R {
        wp[i] = w.data[(row0 + i) * rb..].as_ptr();
    }
    let mut xp = [std::ptr::null::<i8>(); NT];
    for t in 0..NT {
        xp[t] = xq.token(t0 + t).as_ptr();
    }
    let full = cols / K::STEP * K::STEP;
    let mut c = 0;
    while c < full {
        for i in 0..R {
            let byte = c / K::STEP * 16;
            if byte.is_multiple_of(64) {
                prefetch_ahead(wp[i], R * rb + byte);
            }
            // SAFETY: columns c..c+STEP ≤ full of row row0+i and of every token exist.
            unsafe { K::step::<NT>(wp[i], c, &xp, &mut acc[i]) };
        }
        c += K::STEP;
    }
    let mut res = [[0i32; NT]; R];
    for i in 0..R {
        for t in 0..NT {
            res[i][t] = vaddvq_s32(acc[i][t]) + K::tail(w, row0 + i, xq.token(t0 + t), full..cols);
        }
    }
    res
}
