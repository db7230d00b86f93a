//! AMX (Intel Advanced Matrix Extensions, AMX-TILE + AMX-INT8: Sapphire Rapids and later) for
//! the W8A8 product of many tokens (prefill, batched decode): the same exact integer sums as
//! the VNNI kernel (`w8a8.rs`, spec `deepseek-v3-r1-kimi-k2.md` §4), so the same bits whatever
//! the path:
//!
//!   out[t, r] = (f32(Σ_c xq[t, c]·wq[r, c]) · sw[r]) · sx[t]
//!
//! `tdpbssd` multiplies signed bytes by signed bytes (no +128 offset as with `vpdpbusd`) and adds
//! groups of four products into i32: C[16 × 16] += A[16 × 64 bytes] · B[16 × 64 bytes] with
//! C[i][j] = Σ_k Σ_{q<4} A[i][4k+q]·B[k][4j+q]. Here A is 16 weight rows × 64 columns, loaded
//! straight from the row-major `[out, in]` int8 weights with the row length as stride, and B is
//! 64 columns × 16 tokens of activations repacked once per call ([`AmxTokens`]: row k holds
//! columns 4k..4k+4 of each of the 16 tokens). A tile of 16 rows × 16 tokens accumulates
//! 1 024 products per byte of column: 16 384 multiply-adds per instruction.
//!
//! Tiles: C in tmm0..tmm3 (2 row tiles × 2 token tiles), A in tmm4/tmm5, B in tmm6/tmm7; each
//! weight tile is loaded once per pair of token tiles. Columns past the row end: the activation
//! tiles are zero there, so whatever the weight tile holds adds nothing; the last, partial
//! column block of a row tile is copied into a zeroed buffer so no load reads past the matrix.
//! Rows past the last multiple of 16 of a task go through the VNNI kernel.
//!
//! The kernel needs the OS's permission to use the tile state (Linux ≥ 5.16:
//! `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), asked once per process by
//! [`supported`]. `CACHALOT_AMX=0` turns the path off (for comparisons). Tile instructions are
//! written as inline assembly (the compiler never uses the tile registers, so their contents
//! live from one `asm!` block to the next within a task; each task loads its configuration and
//! releases the tiles at its end).

use std::arch::asm;
use std::ops::Range;
use std::sync::OnceLock;

use super::w8a8::{finish, QuantizedTokens};
use super::{OutRows, WeightsView};

/// Fewest tokens for which a product takes the AMX path: below, most of each 16-token tile
/// would be padding and the VNNI kernel, which streams the weights once for up to 4 tokens, is
/// as fast (docs/PERF.md, `matmul_throughput`).
pub(crate) const MIN_TOKENS: usize = 8;

/// Whether this CPU and OS let this process use AMX-INT8 (asked once; `CACHALOT_AMX=0` says
/// no).
pub(crate) fn supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let off = std::env::var("CACHALOT_AMX")
            .map(|v| matches!(v.trim(), "0" | "off" | "no" | "false"))
            .unwrap_or(false);
        // SAFETY: cpuid and xgetbv are checked for before use (`detect`); the syscall only
        // changes this process's permissions.
        !off && unsafe { detect() && request_permission() }
    })
}

/// CPUID: AMX-TILE (leaf 7 EDX bit 24) and AMX-INT8 (bit 25); XCR0 bits 17 and 18 (tile
/// configuration and data state enabled by the OS).
unsafe fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    if __cpuid_count(0, 0).eax < 7 {
        return false;
    }
    let osxsave = __cpuid_count(1, 0).ecx & (1 << 27) != 0;
    let leaf7 = __cpuid_count(7, 0).edx;
    if !osxsave || leaf7 & (1 << 24) == 0 || leaf7 & (1 << 25) == 0 {
        return false;
    }
    let (lo, _hi): (u32, u32);
    asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") _hi, options(nomem, nostack));
    lo & (1 << 17) != 0 && lo & (1 << 18) != 0
}

#[cfg(target_os = "linux")]
unsafe fn request_permission() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    asm!(
        "syscall",
        inlateout("rax") SYS_ARCH_PRCTL => ret,
        in("rdi") ARCH_REQ_XCOMP_PERM,
        in("rsi") XFEATURE_XTILEDATA,
        lateout("rcx") _,
        lateout("r11") _,
        options(nostack),
    );
    ret == 0
}

#[cfg(not(target_os = "linux"))]
unsafe fn request_permission() -> bool {
    false
}

/// Bytes in one tile (16 rows of 64 bytes).
const TILE: usize = 1024;

/// A call's int8 activations as AMX B tiles: for token tile `tt` (tokens 16·tt..16·tt+16) and
/// column block `b` (columns 64·b..64·b+64), 16 rows of 64 bytes, row k holding columns
/// 64·b+4k..64·b+4k+4 of each token in turn; tokens and columns past the end are zero.
pub(crate) struct AmxTokens {
    data: Vec<u8>,
    token_tiles: usize,
    blocks: usize,
}

impl AmxTokens {
    pub(crate) fn new(xq: &QuantizedTokens, n_tokens: usize) -> AmxTokens {
        let cols = xq.cols;
        let token_tiles = n_tokens.div_ceil(16);
        let blocks = cols.div_ceil(64);
        let mut data = vec![0u8; token_tiles * blocks * TILE];
        for t in 0..n_tokens {
            let (tt, m) = (t / 16, t % 16);
            let row = xq.token(t);
            let whole = cols / 4 * 4;
            // Column quads in turn: quad k of block b goes to row k of tile (tt, b).
            for (k, quad) in row[..whole].chunks_exact(4).enumerate() {
                let at = (tt * blocks + k / 16) * TILE + (k % 16) * 64 + m * 4;
                data[at..at + 4].copy_from_slice(&[
                    quad[0] as u8,
                    quad[1] as u8,
                    quad[2] as u8,
                    quad[3] as u8,
                ]);
            }
            for (c, &v) in row.iter().enumerate().skip(whole) {
                let k = c / 4;
                data[(tt * blocks + k / 16) * TILE + (k % 16) * 64 + m * 4 + c % 4] = v as u8;
            }
        }
        AmxTokens {
            data,
            token_tiles,
            blocks,
        }
    }

    #[inline]
    fn tile(&self, tt: usize, b: usize) -> *const u8 {
        self.data[(tt * self.blocks + b) * TILE..].as_ptr()
    }
}

/// The tile configuration (palette 1): eight tiles of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    fn all_16x64() -> TileConfig {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for i in 0..8 {
            c.colsb[i] = 64;
            c.rows[i] = 16;
        }
        c
    }
}

#[repr(C, align(64))]
struct Block([u8; TILE]);

#[repr(C, align(64))]
struct Sums([i32; 256]);

macro_rules! tileload {
    ($tmm:literal, $ptr:expr, $stride:expr) => {
        asm!(
            concat!("tileloadd ", $tmm, ", [{p} + {s} * 1]"),
            p = in(reg) $ptr,
            s = in(reg) $stride,
            options(nostack, readonly, preserves_flags),
        )
    };
}

macro_rules! tilestore {
    ($tmm:literal, $ptr:expr) => {
        asm!(
            concat!("tilestored [{p} + {s} * 1], ", $tmm),
            p = in(reg) $ptr,
            s = in(reg) 64usize,
            options(nostack, preserves_flags),
        )
    };
}

macro_rules! tdp {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbssd ", $c, ", ", $a, ", ", $b),
            options(nomem, nostack, preserves_flags),
        )
    };
}

/// Rows `rows`, all tokens: AMX for the whole 16-row tiles, VNNI for the rows after them.
///
/// # Safety
/// [`supported`] returned true; the CPU supports the `Avx512` level; `out` accepts writes for
/// every row in `rows`; `xq` and `packed` hold `n_tokens` tokens of `w.cols` values; `w` is an
/// int8 (`W8A8`, `weights` Int8) or int4 (`W4A8`, Int4) matrix with valid row scales.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_rows(
    w: &WeightsView,
    rows: Range<usize>,
    xq: &QuantizedTokens,
    packed: &AmxTokens,
    n_tokens: usize,
    out: &OutRows,
    weights: Stored,
) {
    let tiled_end = rows.start + rows.len() / 16 * 16;
    if tiled_end > rows.start {
        tiles(w, rows.start..tiled_end, xq, packed, n_tokens, out, weights);
    }
    if tiled_end < rows.end {
        let rest = tiled_end..rows.end;
        match weights {
            Stored::Int8 => super::w8a8::avx512::matmul_rows(w, rest, xq, n_tokens, out),
            Stored::Int4 => super::w4a8::avx512::matmul_rows(w, rest, xq, n_tokens, out),
        }
    }
}

/// How the weights are stored: int8 (`W8A8`, loaded into tiles as they are) or int4 nibbles
/// (`W4A8`, unpacked to int8 once per pair of row tiles, for all tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stored {
    Int8,
    Int4,
}

/// Rows `row0..row0 + n_rows` (at most 32) of a W4A8 matrix as int8 A tiles: tile (h, b) at
/// `(h·blocks + b)·TILE`, row i of it at `+ i·64` holding q = nibble − 8 of columns
/// 64·b..64·b + 64 (zero past the row's end).
#[target_feature(enable = "avx2")]
unsafe fn unpack_int4(
    w: &WeightsView,
    row0: usize,
    n_rows: usize,
    blocks: usize,
    panel: &mut [u8],
) {
    use std::arch::x86_64::*;
    let rb = w.cols / 2;
    let full = w.cols / 64;
    let mask = _mm256_set1_epi8(0x0F);
    let eight = _mm256_set1_epi8(8);
    for hi_row in 0..n_rows {
        let (h, i) = (hi_row / 16, hi_row % 16);
        let src = &w.data[(row0 + hi_row) * rb..][..rb];
        for b in 0..full {
            // 32 bytes = 64 nibbles; low nibble first within a byte.
            let v = _mm256_loadu_si256(src.as_ptr().add(b * 32) as *const __m256i);
            let lo = _mm256_and_si256(v, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
            let ul = _mm256_unpacklo_epi8(lo, hi);
            let uh = _mm256_unpackhi_epi8(lo, hi);
            let first = _mm256_sub_epi8(_mm256_permute2x128_si256::<0x20>(ul, uh), eight);
            let second = _mm256_sub_epi8(_mm256_permute2x128_si256::<0x31>(ul, uh), eight);
            let dst = panel.as_mut_ptr().add((h * blocks + b) * TILE + i * 64);
            _mm256_storeu_si256(dst as *mut __m256i, first);
            _mm256_storeu_si256(dst.add(32) as *mut __m256i, second);
        }
        if full < blocks {
            let dst = &mut panel[(h * blocks + full) * TILE + i * 64..][..64];
            dst.fill(0);
            for c in full * 64..w.cols {
                dst[c - full * 64] = super::w4a8::q_at(src, c) as i8 as u8;
            }
        }
    }
}

/// Rows `rows` (a multiple of 16 of them), all tokens.
#[allow(clippy::too_many_arguments)]
unsafe fn tiles(
    w: &WeightsView,
    rows: Range<usize>,
    xq: &QuantizedTokens,
    packed: &AmxTokens,
    n_tokens: usize,
    out: &OutRows,
    weights: Stored,
) {
    let cols = w.cols;
    let base = w.data.as_ptr();
    let full = cols / 64;
    let blocks = packed.blocks;
    let int4 = weights == Stored::Int4;
    let mut panel = vec![0u8; if int4 { 2 * blocks * TILE } else { 0 }];
    let cfg = TileConfig::all_16x64();
    asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileConfig, options(nostack, readonly));
    // The partial last column block of each of the (up to) two row tiles, zero-padded.
    let mut tail = [Block([0; TILE]), Block([0; TILE])];
    let mut sums = [
        Sums([0; 256]),
        Sums([0; 256]),
        Sums([0; 256]),
        Sums([0; 256]),
    ];
    let mut r = rows.start;
    while r < rows.end {
        let two_r = r + 32 <= rows.end;
        let n_rt = if two_r { 2 } else { 1 };
        if int4 {
            unpack_int4(w, r, n_rt * 16, blocks, &mut panel);
        } else if full < blocks {
            let width = cols - full * 64;
            for (h, t) in tail.iter_mut().enumerate().take(n_rt) {
                for i in 0..16 {
                    let src = &w.data[(r + h * 16 + i) * cols + full * 64..][..width];
                    t.0[i * 64..i * 64 + width].copy_from_slice(src);
                }
            }
        }
        // Weight tile `h` of column block `b`: pointer and stride.
        let a = |h: usize, b: usize| -> (*const u8, usize) {
            if int4 {
                (panel.as_ptr().add((h * blocks + b) * TILE), 64)
            } else if b < full {
                (base.add((r + h * 16) * cols + b * 64), cols)
            } else {
                (tail[h].0.as_ptr(), 64)
            }
        };
        let mut tt = 0;
        while tt < packed.token_tiles {
            let two_t = tt + 2 <= packed.token_tiles;
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nomem, nostack, preserves_flags)
            );
            for b in 0..blocks {
                let (p0, s0) = a(0, b);
                tileload!("tmm4", p0, s0);
                tileload!("tmm6", packed.tile(tt, b), 64usize);
                tdp!("tmm0", "tmm4", "tmm6");
                if two_t {
                    tileload!("tmm7", packed.tile(tt + 1, b), 64usize);
                    tdp!("tmm1", "tmm4", "tmm7");
                }
                if two_r {
                    let (p1, s1) = a(1, b);
                    tileload!("tmm5", p1, s1);
                    tdp!("tmm2", "tmm5", "tmm6");
                    if two_t {
                        tdp!("tmm3", "tmm5", "tmm7");
                    }
                }
            }
            tilestore!("tmm0", sums[0].0.as_mut_ptr());
            tilestore!("tmm1", sums[1].0.as_mut_ptr());
            tilestore!("tmm2", sums[2].0.as_mut_ptr());
            tilestore!("tmm3", sums[3].0.as_mut_ptr());
            let n_tt = if two_t { 2 } else { 1 };
            for h in 0..n_rt {
                for j in 0..n_tt {
                    let t0 = (tt + j) * 16;
                    let nt = 16.min(n_tokens - t0);
                    emit(&sums[h * 2 + j], w, r + h * 16, xq, t0, nt, out);
                }
            }
            tt += n_tt;
        }
        r += n_rt * 16;
    }
    asm!("tilerelease", options(nomem, nostack, preserves_flags));
}

/// Writes one tile of sums, `s[i·16 + m]` for row `row0 + i` and token `t0 + m` (`nt` tokens
/// valid): `(f32(sum) · sw) · sx` as [`finish`] computes it, 16 tokens per vector; the results
/// are transposed in registers so each token's 16 rows go out as one store.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn emit(
    s: &Sums,
    w: &WeightsView,
    row0: usize,
    xq: &QuantizedTokens,
    t0: usize,
    nt: usize,
    out: &OutRows,
) {
    use std::arch::x86_64::*;
    let super::Scales::Row(row_scale) = w.scales else {
        for m in 0..nt {
            for i in 0..16 {
                let row = row0 + i;
                out.write(
                    t0 + m,
                    row,
                    finish(s.0[i * 16 + m], w, row, xq.scale[t0 + m]),
                );
            }
        }
        return;
    };
    let mut sx = [0f32; 16];
    sx[..nt].copy_from_slice(&xq.scale[t0..t0 + nt]);
    let sx = _mm512_loadu_ps(sx.as_ptr());
    let mut v: [__m512; 16] = std::array::from_fn(|i| {
        let acc = _mm512_cvtepi32_ps(_mm512_load_si512(s.0[i * 16..].as_ptr() as *const _));
        _mm512_mul_ps(_mm512_mul_ps(acc, _mm512_set1_ps(row_scale[row0 + i])), sx)
    });
    // Transpose in registers, by halves, quarters, eighths and sixteenths: at step s, rows i
    // and i + s (i without bit s) swap the blocks that lie off the diagonal of their 2s × 2s
    // squares. Then v[m] holds token m's 16 rows.
    for step in [8usize, 4, 2, 1] {
        let index = |hi: bool| -> __m512i {
            let idx: [i32; 16] = std::array::from_fn(|j| {
                let own = j & step == 0;
                (match (hi, own) {
                    (false, true) => j,
                    (false, false) => 16 + j - step,
                    (true, true) => j + step,
                    (true, false) => 16 + j,
                }) as i32
            });
            _mm512_loadu_si512(idx.as_ptr() as *const _)
        };
        let (lo, hi) = (index(false), index(true));
        for i in (0..16).filter(|i| i & step == 0) {
            let (a, b) = (v[i], v[i + step]);
            v[i] = _mm512_permutex2var_ps(a, lo, b);
            v[i + step] = _mm512_permutex2var_ps(a, hi, b);
        }
    }
    for (m, row) in v.iter().enumerate().take(nt) {
        _mm512_storeu_ps(out.rows_mut(t0 + m, row0, 16).as_mut_ptr(), *row);
    }
}
