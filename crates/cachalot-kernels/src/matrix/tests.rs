//! Matrix kernels at every supported level against an f64 product of the exactly dequantized
//! weights, for every format, odd shapes, 1..=9 tokens and row sub-ranges; bit-exact batch,
//! sub-range and thread-count invariance; FP8 block dequantization with ragged edges.

use proptest::prelude::*;

use super::*;
use crate::fp8::e4m3_to_f32;
use crate::{f32_to_bf16, f32_to_f16, u16s_to_le_bytes};

fn levels() -> Vec<SimdLevel> {
    SimdLevel::ALL
        .iter()
        .copied()
        .filter(|l| l.supported())
        .collect()
}

/// SplitMix64: deterministic data from a proptest-chosen seed.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }
    /// Non-zero, magnitude in [0.05, 1), random sign.
    fn value(&mut self) -> f32 {
        let m = self.uniform(0.05, 1.0);
        if self.next_u64() & 1 == 0 {
            m
        } else {
            -m
        }
    }
    /// A finite e4m3 code (never 0x7F/0xFF).
    fn fp8(&mut self) -> u8 {
        let b = self.next_u64() as u8;
        if b & 0x7F == 0x7F {
            b - 1
        } else {
            b
        }
    }
}

const FORMATS: [Format; 9] = [
    Format::F32,
    Format::Bf16,
    Format::F16,
    Format::Fp8,
    Format::Int8,
    Format::Int4,
    Format::Fp4,
    Format::Mxfp8,
    Format::Hif8,
];

/// A random E8M0 byte giving scales in 2^−12..2^−4.
fn e8m0(rng: &mut Rng) -> u8 {
    115 + (rng.next_u64() % 9) as u8
}

/// A finite HiF8 code (never 0x80 or ±0x6F).
fn hif8(rng: &mut Rng) -> u8 {
    let b = rng.next_u64() as u8;
    if b == 0x80 || b & 0x7F == 0x6F {
        b ^ 1
    } else {
        b
    }
}

fn random_matrix(
    format: Format,
    rows: usize,
    cols: usize,
    block: (usize, usize),
    rng: &mut Rng,
) -> Matrix {
    let n = rows * cols;
    let data = match format {
        Format::F32 => MatrixData::F32(Bytes::from_vec(f32s_to_le_bytes(
            &(0..n).map(|_| rng.value()).collect::<Vec<_>>(),
        ))),
        Format::Bf16 => MatrixData::Bf16(Bytes::from_vec(u16s_to_le_bytes(
            &(0..n).map(|_| f32_to_bf16(rng.value())).collect::<Vec<_>>(),
        ))),
        Format::F16 => MatrixData::F16(Bytes::from_vec(u16s_to_le_bytes(
            &(0..n).map(|_| f32_to_f16(rng.value())).collect::<Vec<_>>(),
        ))),
        Format::Fp8 => {
            let (br, bc) = block;
            let grid = rows.div_ceil(br) * cols.div_ceil(bc);
            MatrixData::Fp8Block {
                data: Bytes::from_vec((0..n).map(|_| rng.fp8()).collect()),
                scale_inv: (0..grid).map(|_| rng.uniform(2e-4, 4e-3)).collect(),
                block_rows: br,
                block_cols: bc,
            }
        }
        Format::Int8 => MatrixData::Int8Row {
            data: Bytes::from_vec((0..n).map(|_| rng.next_u64() as u8).collect()),
            scale: (0..rows).map(|_| rng.uniform(1e-3, 1e-2)).collect(),
        },
        Format::Int4 => {
            // Groups along the columns; `block.1` (even) is the group size.
            let group = block.1;
            MatrixData::Int4Group {
                data: Bytes::from_vec((0..n / 2).map(|_| rng.next_u64() as u8).collect()),
                scale: (0..rows * cols.div_ceil(group))
                    .map(|_| rng.uniform(1e-3, 1e-2))
                    .collect(),
                group_size: group,
            }
        }
        Format::Fp4 => MatrixData::Mxfp4 {
            data: Bytes::from_vec((0..n / 2).map(|_| rng.next_u64() as u8).collect()),
            scale: Bytes::from_vec((0..rows * cols.div_ceil(32)).map(|_| e8m0(rng)).collect()),
        },
        Format::Mxfp8 => MatrixData::Mxfp8 {
            data: Bytes::from_vec((0..n).map(|_| rng.fp8()).collect()),
            scale: Bytes::from_vec((0..rows * cols.div_ceil(32)).map(|_| e8m0(rng)).collect()),
        },
        Format::Hif8 => MatrixData::Hif8 {
            data: Bytes::from_vec((0..n).map(|_| hif8(rng)).collect()),
            scale: (0..rows).map(|_| rng.uniform(1e-5, 1e-4)).collect(),
        },
    };
    Matrix::new(rows, cols, data).expect("valid random matrix")
}

/// (format, rows, cols, n_tokens, fp8 block shape, seed). Block shapes: DeepSeek's 128x128 (a
/// single partial block at these sizes), or small ones for many ragged edges.
fn case() -> impl Strategy<Value = (Format, usize, usize, usize, (usize, usize), u64)> {
    let block = prop_oneof![
        Just((128usize, 128usize)),
        Just((1usize, 32usize)),
        (1usize..40, 1usize..70)
    ];
    (
        0usize..FORMATS.len(),
        1usize..40,
        1usize..300,
        1usize..=9,
        block,
        any::<u64>(),
    )
        .prop_map(|(f, r, c, t, b, s)| {
            let format = FORMATS[f];
            if matches!(format, Format::Int4 | Format::Fp4) {
                // Two columns per byte: even column counts and group sizes.
                (format, r, c + c % 2, t, (b.0, b.1 + b.1 % 2), s)
            } else {
                (format, r, c, t, b, s)
            }
        })
}

/// (Σ W x in f64, Σ |W x|) for output row r and token vector x.
fn reference_dot(w: &[f32], cols: usize, r: usize, x: &[f32]) -> (f64, f64) {
    let row = &w[r * cols..(r + 1) * cols];
    let mut s = 0.0f64;
    let mut b = 0.0f64;
    for (a, v) in row.iter().zip(x) {
        let p = *a as f64 * *v as f64;
        s += p;
        b += p.abs();
    }
    (s, b)
}

const REL: f64 = 1e-5;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn matmul_rows_matches_reference((format, rows, cols, nt, block, seed) in case(), sub in any::<(prop::sample::Index, prop::sample::Index)>()) {
        let mut rng = Rng(seed);
        let m = random_matrix(format, rows, cols, block, &mut rng);
        let w = m.to_f32_vec();
        let x: Vec<f32> = (0..nt * cols).map(|_| rng.value()).collect();
        let (a, b) = (sub.0.index(rows + 1), sub.1.index(rows + 1));
        let range = a.min(b)..a.max(b);
        for level in levels() {
            let mut out = vec![f32::NAN; nt * range.len()];
            m.matmul_rows_at(level, range.clone(), &x, nt, &mut out);
            for t in 0..nt {
                for (j, r) in range.clone().enumerate() {
                    let (want, bound) = reference_dot(&w, cols, r, &x[t * cols..(t + 1) * cols]);
                    let got = out[t * range.len() + j];
                    prop_assert!((got as f64 - want).abs() <= REL * bound + 1e-30,
                        "{level:?} {format:?} {rows}x{cols} block {block:?} t={t} r={r}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn matmul_t_rows_matches_reference((format, rows, cols, nt, block, seed) in case(), sub in any::<(prop::sample::Index, prop::sample::Index)>()) {
        let mut rng = Rng(seed);
        let m = random_matrix(format, rows, cols, block, &mut rng);
        let w = m.to_f32_vec();
        let (a, b) = (sub.0.index(rows + 1), sub.1.index(rows + 1));
        let range = a.min(b)..a.max(b);
        let k = range.len();
        let x: Vec<f32> = (0..nt * k).map(|_| rng.value()).collect();
        for level in levels() {
            let mut out = vec![f32::NAN; nt * cols];
            m.matmul_t_rows_at(level, range.clone(), &x, nt, &mut out);
            for t in 0..nt {
                for c in 0..cols {
                    let (mut want, mut bound) = (0.0f64, 0.0f64);
                    for (i, r) in range.clone().enumerate() {
                        let p = w[r * cols + c] as f64 * x[t * k + i] as f64;
                        want += p;
                        bound += p.abs();
                    }
                    let got = out[t * cols + c];
                    prop_assert!((got as f64 - want).abs() <= REL * bound + 1e-30,
                        "{level:?} {format:?} {rows}x{cols} block {block:?} rows {range:?} t={t} c={c}: {got} vs {want}");
                }
            }
        }
    }

    /// A token's result is bit-identical alone, inside any batch, and within any row sub-range.
    #[test]
    fn results_do_not_depend_on_batching((format, rows, cols, nt, block, seed) in case(), sub in any::<(prop::sample::Index, prop::sample::Index)>()) {
        let mut rng = Rng(seed);
        let m = random_matrix(format, rows, cols, block, &mut rng);
        let x: Vec<f32> = (0..nt * cols).map(|_| rng.value()).collect();
        let (a, b) = (sub.0.index(rows + 1), sub.1.index(rows + 1));
        let range = a.min(b)..a.max(b);
        for level in levels() {
            let mut batch = vec![f32::NAN; nt * rows];
            m.matmul_rows_at(level, 0..rows, &x, nt, &mut batch);
            let mut part = vec![f32::NAN; nt * range.len()];
            m.matmul_rows_at(level, range.clone(), &x, nt, &mut part);
            for t in 0..nt {
                let mut one = vec![f32::NAN; rows];
                m.matmul_rows_at(level, 0..rows, &x[t * cols..(t + 1) * cols], 1, &mut one);
                let got = &batch[t * rows..(t + 1) * rows];
                prop_assert!(got.iter().zip(&one).all(|(p, q)| p.to_bits() == q.to_bits()), "{level:?} token {t}");
                let got = &part[t * range.len()..(t + 1) * range.len()];
                prop_assert!(got.iter().zip(&one[range.clone()]).all(|(p, q)| p.to_bits() == q.to_bits()), "{level:?} sub-range");
            }
            // Transposed: each token alone equals the batch.
            let k = range.len();
            let xt: Vec<f32> = (0..nt * k).map(|_| rng.value()).collect();
            let mut batch = vec![f32::NAN; nt * cols];
            m.matmul_t_rows_at(level, range.clone(), &xt, nt, &mut batch);
            for t in 0..nt {
                let mut one = vec![f32::NAN; cols];
                m.matmul_t_rows_at(level, range.clone(), &xt[t * k..(t + 1) * k], 1, &mut one);
                prop_assert!(batch[t * cols..(t + 1) * cols].iter().zip(&one).all(|(p, q)| p.to_bits() == q.to_bits()), "{level:?} transposed token {t}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// AVX-512 and AVX2 forward products agree bit for bit for every format, token count (both
    /// tile paths and the panel) and row sub-range. Skipped where the CPU lacks AVX-512.
    #[test]
    fn avx512_forward_is_bit_identical_to_avx2((format, rows, cols, _nt, block, seed) in case(), nt in 1usize..=20, sub in any::<(prop::sample::Index, prop::sample::Index)>()) {
        if !SimdLevel::Avx512.supported() {
            return Ok(());
        }
        let mut rng = Rng(seed);
        let m = random_matrix(format, rows, cols, block, &mut rng);
        let x: Vec<f32> = (0..nt * cols).map(|_| rng.value()).collect();
        let (a, b) = (sub.0.index(rows + 1), sub.1.index(rows + 1));
        let range = a.min(b)..a.max(b);
        let mut want = vec![f32::NAN; nt * range.len()];
        m.matmul_rows_at(SimdLevel::Avx2, range.clone(), &x, nt, &mut want);
        let mut got = vec![f32::NAN; nt * range.len()];
        m.matmul_rows_at(SimdLevel::Avx512, range.clone(), &x, nt, &mut got);
        prop_assert_eq!(bits(&got), bits(&want), "{:?} {}x{} block {:?} nt {} rows {:?}", format, rows, cols, block, nt, range);
    }

    /// AVX-512 and AVX2 transposed products agree bit for bit for every format, token count
    /// and row sub-range (one FMA chain per column over the rows in order, either way).
    #[test]
    fn avx512_transposed_is_bit_identical_to_avx2((format, rows, cols, _nt, block, seed) in case(), nt in 1usize..=9, sub in any::<(prop::sample::Index, prop::sample::Index)>()) {
        if !SimdLevel::Avx512.supported() {
            return Ok(());
        }
        let mut rng = Rng(seed);
        let m = random_matrix(format, rows, cols, block, &mut rng);
        let (a, b) = (sub.0.index(rows + 1), sub.1.index(rows + 1));
        let range = a.min(b)..a.max(b);
        let x: Vec<f32> = (0..nt * range.len()).map(|_| rng.value()).collect();
        let mut want = vec![f32::NAN; nt * cols];
        m.matmul_t_rows_at(SimdLevel::Avx2, range.clone(), &x, nt, &mut want);
        let mut got = vec![f32::NAN; nt * cols];
        m.matmul_t_rows_at(SimdLevel::Avx512, range.clone(), &x, nt, &mut got);
        prop_assert_eq!(bits(&got), bits(&want), "{:?} {}x{} block {:?} nt {} rows {:?}", format, rows, cols, block, nt, range);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Every level's forward product (AVX2 and AVX-512 on x86-64, NEON on aarch64) gives the
    /// scalar kernel's bits (the SIMD operations stated lane by lane), for every format, token
    /// count (every tile shape) and row sub-range: one model, the same bits on every CPU.
    #[test]
    fn forward_gives_the_scalar_bits_at_every_level((format, rows, cols, _nt, block, seed) in case(), nt in 1usize..=20, sub in any::<(prop::sample::Index, prop::sample::Index)>()) {
        let mut rng = Rng(seed);
        let m = random_matrix(format, rows, cols, block, &mut rng);
        let x: Vec<f32> = (0..nt * cols).map(|_| rng.value()).collect();
        let (a, b) = (sub.0.index(rows + 1), sub.1.index(rows + 1));
        let range = a.min(b)..a.max(b);
        let mut want = vec![f32::NAN; nt * range.len()];
        m.matmul_rows_at(SimdLevel::Scalar, range.clone(), &x, nt, &mut want);
        for level in levels() {
            let mut got = vec![f32::NAN; nt * range.len()];
            m.matmul_rows_at(level, range.clone(), &x, nt, &mut got);
            prop_assert_eq!(bits(&got), bits(&want), "{:?} {:?} {}x{} block {:?} nt {} rows {:?}", level, format, rows, cols, block, nt, range);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Every level's transposed product gives the scalar kernel's bits, for every format, token
    /// count and row sub-range.
    #[test]
    fn transposed_gives_the_scalar_bits_at_every_level((format, rows, cols, _nt, block, seed) in case(), nt in 1usize..=9, sub in any::<(prop::sample::Index, prop::sample::Index)>()) {
        let mut rng = Rng(seed);
        let m = random_matrix(format, rows, cols, block, &mut rng);
        let (a, b) = (sub.0.index(rows + 1), sub.1.index(rows + 1));
        let range = a.min(b)..a.max(b);
        let x: Vec<f32> = (0..nt * range.len()).map(|_| rng.value()).collect();
        let mut want = vec![f32::NAN; nt * cols];
        m.matmul_t_rows_at(SimdLevel::Scalar, range.clone(), &x, nt, &mut want);
        for level in levels() {
            let mut got = vec![f32::NAN; nt * cols];
            m.matmul_t_rows_at(level, range.clone(), &x, nt, &mut got);
            prop_assert_eq!(bits(&got), bits(&want), "{:?} {:?} {}x{} block {:?} nt {} rows {:?}", level, format, rows, cols, block, nt, range);
        }
    }
}

#[test]
fn forward_gives_the_scalar_bits_on_wide_rows() {
    // DeepSeek's 128 x 128 FP8 blocks over long rows, and magnitudes far apart, so that any
    // change in the order of operations shows; segments wider than a decoded panel (700
    // columns, ragged at its end) and token counts over a panel's group of 16.
    for (k, &format) in FORMATS.iter().enumerate() {
        for block in [(128, 128), (1, 700)] {
            let mut rng = Rng(0x5EED + k as u64);
            let (rows, cols) = (13, 1000);
            let m = random_matrix(format, rows, cols, block, &mut rng);
            for nt in [1, 2, 3, 4, 5, 7, 8, 17, 35] {
                let x: Vec<f32> = (0..nt * cols)
                    .map(|i| rng.value() * if i % 7 == 0 { 1e4 } else { 1e-3 })
                    .collect();
                let mut want = vec![f32::NAN; nt * rows];
                m.matmul_rows_at(SimdLevel::Scalar, 0..rows, &x, nt, &mut want);
                for level in levels() {
                    let mut got = vec![f32::NAN; nt * rows];
                    m.matmul_rows_at(level, 0..rows, &x, nt, &mut got);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{level:?} {format:?} {block:?} nt {nt}"
                    );
                }
            }
        }
    }
}

#[test]
fn avx512_forward_is_bit_identical_to_avx2_on_wide_rows() {
    // Long rows (many chunks per segment, DeepSeek's 128x128 FP8 blocks) and awkward values:
    // large and tiny magnitudes so that any change in the order of operations shows.
    if !SimdLevel::Avx512.supported() {
        return;
    }
    for (k, &format) in FORMATS.iter().enumerate() {
        let mut rng = Rng(0xA512 + k as u64);
        let (rows, cols) = (37, 1000);
        let m = random_matrix(format, rows, cols, (128, 128), &mut rng);
        for nt in [1, 2, 3, 4, 5, 8, 9, 17] {
            let x: Vec<f32> = (0..nt * cols)
                .map(|i| rng.value() * if i % 7 == 0 { 1e4 } else { 1e-3 })
                .collect();
            let mut want = vec![f32::NAN; nt * rows];
            m.matmul_rows_at(SimdLevel::Avx2, 0..rows, &x, nt, &mut want);
            let mut got = vec![f32::NAN; nt * rows];
            m.matmul_rows_at(SimdLevel::Avx512, 0..rows, &x, nt, &mut got);
            assert_eq!(bits(&got), bits(&want), "{format:?} nt {nt}");
        }
    }
}

#[test]
fn avx512_transposed_is_bit_identical_to_avx2_on_tall_matrices() {
    // Many rows (several of AVX2's 16-row passes), long rows (several chunk widths and 128-wide
    // FP8 blocks, a ragged end) and awkward magnitudes, so any reordering shows.
    if !SimdLevel::Avx512.supported() {
        return;
    }
    for (k, &format) in FORMATS.iter().enumerate() {
        let mut rng = Rng(0x7A51 + k as u64);
        let (rows, cols) = (150, 1000);
        let m = random_matrix(format, rows, cols, (128, 128), &mut rng);
        for nt in [1, 2, 3, 4, 5, 8] {
            for range in [0..rows, 3..131, 17..18] {
                let x: Vec<f32> = (0..nt * range.len())
                    .map(|i| rng.value() * if i % 7 == 0 { 1e4 } else { 1e-3 })
                    .collect();
                let mut want = vec![f32::NAN; nt * cols];
                m.matmul_t_rows_at(SimdLevel::Avx2, range.clone(), &x, nt, &mut want);
                let mut got = vec![f32::NAN; nt * cols];
                m.matmul_t_rows_at(SimdLevel::Avx512, range.clone(), &x, nt, &mut got);
                assert_eq!(bits(&got), bits(&want), "{format:?} nt {nt} rows {range:?}");
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn results_do_not_depend_on_thread_count() {
    // Large enough to be split into tasks; odd sizes and ragged FP8 blocks.
    let mut rng = Rng(7);
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let three = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for format in FORMATS {
        for block in [(128, 128), (5, 24), (7, 13)] {
            let block = if matches!(format, Format::Int4 | Format::Fp4) {
                (block.0, block.1 + block.1 % 2)
            } else {
                block
            };
            let (rows, cols, nt) = (301, 458, 5);
            let m = random_matrix(format, rows, cols, block, &mut rng);
            let x: Vec<f32> = (0..nt * cols).map(|_| rng.value()).collect();
            let xt: Vec<f32> = (0..nt * 250).map(|_| rng.value()).collect();
            for level in levels() {
                let run = |pool: &rayon::ThreadPool| {
                    pool.install(|| {
                        let mut out = vec![f32::NAN; nt * rows];
                        m.matmul_rows_at(level, 0..rows, &x, nt, &mut out);
                        let mut out_t = vec![f32::NAN; nt * cols];
                        m.matmul_t_rows_at(level, 40..290, &xt, nt, &mut out_t);
                        (bits(&out), bits(&out_t))
                    })
                };
                assert_eq!(run(&one), run(&three), "{level:?} {format:?} {block:?}");
            }
        }
    }
}

/// §2.2's dequantization written out directly.
fn reference_dequant(
    codes: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    br: usize,
    bc: usize,
) -> Vec<f32> {
    let gc = cols.div_ceil(bc);
    let mut w = vec![0.0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            w[r * cols + c] = e4m3_to_f32(codes[r * cols + c]) * scales[(r / br) * gc + c / bc];
        }
    }
    w
}

#[test]
fn fp8_block_dequant_with_ragged_edges() {
    // 200x300 with 128x128 blocks: a 2x3 grid with partial last row and column blocks; 80 rows:
    // one partial block row; 576 rows: kv_a_proj's last block covers rows 512..575.
    let mut rng = Rng(11);
    for (rows, cols, br, bc) in [
        (200usize, 300usize, 128usize, 128usize),
        (80, 300, 128, 128),
        (576, 200, 128, 128),
        (9, 10, 4, 3),
    ] {
        let codes: Vec<u8> = (0..rows * cols).map(|_| rng.fp8()).collect();
        let grid = rows.div_ceil(br) * cols.div_ceil(bc);
        let scales: Vec<f32> = (0..grid).map(|_| rng.uniform(1e-4, 1e-2)).collect();
        let m = Matrix::new(
            rows,
            cols,
            MatrixData::Fp8Block {
                data: Bytes::from_vec(codes.clone()),
                scale_inv: scales.clone(),
                block_rows: br,
                block_cols: bc,
            },
        )
        .unwrap();
        let want = reference_dequant(&codes, &scales, rows, cols, br, bc);
        assert_eq!(bits(&m.to_f32_vec()), bits(&want), "{rows}x{cols}");
        let mut row = vec![f32::NAN; cols + 3];
        m.row_to_f32(rows - 1, &mut row);
        assert_eq!(bits(&row[..cols]), bits(&want[(rows - 1) * cols..]));
        assert!(
            row[cols..].iter().all(|v| v.is_nan()),
            "row_to_f32 writes only cols values"
        );
        let f = m.to_f32_matrix();
        assert_eq!(f.format_name(), "f32");
        assert_eq!(bits(&f.to_f32_vec()), bits(&want));
    }
}

/// A weight holding an e4m3fn NaN code (which the vector decoders would read as ±480) makes
/// every product with its matrix NaN, at every level, as the exact (f32) decode does; a clean
/// matrix is untouched.
#[test]
fn fp8_nan_codes_make_the_products_nan() {
    let (rows, cols, n_tokens) = (40, 64, 3);
    let mut codes = vec![0x38u8; rows * cols];
    let clean = Matrix::new(
        rows,
        cols,
        MatrixData::Fp8Block {
            data: Bytes::from_vec(codes.clone()),
            scale_inv: vec![1.0],
            block_rows: 128,
            block_cols: 128,
        },
    )
    .unwrap();
    codes[rows * cols - 5] = 0xFF;
    let bad = Matrix::new(
        rows,
        cols,
        MatrixData::Fp8Block {
            data: Bytes::from_vec(codes),
            scale_inv: vec![1.0],
            block_rows: 128,
            block_cols: 128,
        },
    )
    .unwrap();
    assert!(bad.holds_nan_codes() && !clean.holds_nan_codes());
    let x = vec![0.5f32; n_tokens * cols];
    for level in levels() {
        let mut out = vec![0.0f32; n_tokens * rows];
        bad.matmul_rows_at(level, 0..rows, &x, n_tokens, &mut out);
        assert!(out.iter().all(|v| v.is_nan()), "{level:?}");
        clean.matmul_rows_at(level, 0..rows, &x, n_tokens, &mut out);
        assert!(out.iter().all(|v| *v == 32.0), "{level:?}");
        let xt = vec![0.5f32; n_tokens * rows];
        let mut out_t = vec![0.0f32; n_tokens * cols];
        bad.matmul_t_rows_at(level, 0..rows, &xt, n_tokens, &mut out_t);
        assert!(out_t.iter().all(|v| v.is_nan()), "{level:?}");
        let (mut a, mut b) = (vec![0.0f32; n_tokens * rows], vec![0.0f32; n_tokens * rows]);
        let mut jobs = [
            MatmulJob {
                w: &clean,
                x: &x,
                n_tokens,
                out: &mut a,
            },
            MatmulJob {
                w: &bad,
                x: &x,
                n_tokens,
                out: &mut b,
            },
        ];
        matmul_group_at(level, &mut jobs);
        assert!(a.iter().all(|v| *v == 32.0) && b.iter().all(|v| v.is_nan()));
    }
}

#[test]
fn fp8_scale_grid_shapes() {
    let m = |rows, cols, br, bc, n| {
        Matrix::new(
            rows,
            cols,
            MatrixData::Fp8Block {
                data: Bytes::from_vec(vec![0x38; rows * cols]),
                scale_inv: vec![1.0; n],
                block_rows: br,
                block_cols: bc,
            },
        )
    };
    assert!(m(200, 300, 128, 128, 6).is_ok());
    assert!(m(80, 300, 128, 128, 3).is_ok());
    assert!(m(576, 7168, 128, 128, 5 * 56).is_ok());
    assert!(m(128, 128, 128, 128, 1).is_ok());
    assert!(m(129, 128, 128, 128, 2).is_ok());
    let e = m(200, 300, 128, 128, 4).unwrap_err().to_string();
    assert!(
        e.contains("needs 6 scales")
            && e.contains("2x3 grid of 128x128 blocks")
            && e.contains("got 4"),
        "{e}"
    );
}

#[test]
fn int8_dequant_is_value_times_row_scale() {
    let codes = [127u8, 12, 0xC0, 32, 0x81, 1];
    let m = Matrix::new(
        2,
        3,
        MatrixData::Int8Row {
            data: Bytes::from_vec(codes.to_vec()),
            scale: vec![0.007_873_535, 0.5],
        },
    )
    .unwrap();
    let w = m.to_f32_vec();
    let want = [
        127.0 * 0.007_873_535f32,
        12.0 * 0.007_873_535,
        -64.0 * 0.007_873_535,
        32.0 * 0.5,
        -127.0 * 0.5,
        0.5,
    ];
    assert_eq!(bits(&w), bits(&want));
    assert_eq!(m.storage_bytes(), 6 + 8);
    assert_eq!(m.format_name(), "int8_row");
}

/// §2.3: int32 words hold 8 columns each, low nibble first, offset by 8; scale per group of 32.
#[test]
fn int4_dequant_follows_the_packed_word_layout() {
    let (rows, cols, group) = (3usize, 72usize, 32usize);
    let q: Vec<i32> = (0..rows * cols).map(|i| (i * 5 % 16) as i32 - 8).collect();
    let mut words = Vec::new();
    for row in q.chunks(cols) {
        for eight in row.chunks(8) {
            let word = eight
                .iter()
                .enumerate()
                .fold(0u32, |w, (i, v)| w | (((v + 8) as u32) << (4 * i)));
            words.push(word);
        }
    }
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let groups = cols.div_ceil(group);
    let scale: Vec<f32> = (0..rows * groups).map(|i| 0.01 * (i + 1) as f32).collect();
    let m = Matrix::new(
        rows,
        cols,
        MatrixData::Int4Group {
            data: Bytes::from_vec(bytes),
            scale: scale.clone(),
            group_size: group,
        },
    )
    .unwrap();
    let w = m.to_f32_vec();
    for r in 0..rows {
        for c in 0..cols {
            let want = q[r * cols + c] as f32 * scale[r * groups + c / group];
            assert_eq!(w[r * cols + c].to_bits(), want.to_bits(), "r={r} c={c}");
        }
    }
    let e = Matrix::new(
        2,
        5,
        MatrixData::Int4Group {
            data: Bytes::from_vec(vec![0; 5]),
            scale: vec![1.0; 2],
            group_size: 32,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("must be even"), "{e}");
    let e = Matrix::new(
        2,
        64,
        MatrixData::Int4Group {
            data: Bytes::from_vec(vec![0; 64]),
            scale: vec![1.0; 3],
            group_size: 32,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("needs 4 scales (2 groups of 32 columns per row), got 3"),
        "{e}"
    );
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_fp8_decode_matches_the_table_for_all_finite_codes() {
    if !SimdLevel::Avx2.supported() {
        return;
    }
    for base in (0..256).step_by(16) {
        let codes: [u8; 16] = std::array::from_fn(|i| (base + i) as u8);
        // SAFETY: AVX2 support checked above.
        let got = unsafe { avx2::fp8_decode16(&codes) };
        for (i, &c) in codes.iter().enumerate() {
            if c & 0x7F == 0x7F {
                continue;
            }
            assert_eq!(
                got[i].to_bits(),
                crate::fp8::e4m3_table()[c as usize].to_bits(),
                "code {c:#04x}"
            );
        }
    }
}

#[test]
fn constructors_reject_malformed_inputs() {
    let err = |rows, cols, data| Matrix::new(rows, cols, data).unwrap_err().to_string();
    let b = |n| Bytes::from_vec(vec![1u8; n]);
    let e = err(3, 4, MatrixData::F32(b(47)));
    assert!(
        e.contains("f32 matrix of 3x4 needs 48 bytes") && e.contains("got 47"),
        "{e}"
    );
    let e = err(3, 4, MatrixData::Bf16(b(48)));
    assert!(e.contains("bf16") && e.contains("needs 24 bytes"), "{e}");
    let e = err(3, 4, MatrixData::F16(b(23)));
    assert!(e.contains("f16") && e.contains("needs 24 bytes"), "{e}");
    let e = err(
        3,
        4,
        MatrixData::Int8Row {
            data: b(12),
            scale: vec![1.0; 2],
        },
    );
    assert!(e.contains("needs 3 scales (one per row), got 2"), "{e}");
    let e = err(
        3,
        4,
        MatrixData::Int8Row {
            data: b(13),
            scale: vec![1.0; 3],
        },
    );
    assert!(e.contains("needs 12 bytes"), "{e}");
    let fp8 = |n, s: Vec<f32>, br, bc| MatrixData::Fp8Block {
        data: b(n),
        scale_inv: s,
        block_rows: br,
        block_cols: bc,
    };
    let e = err(3, 4, fp8(12, vec![1.0], 0, 128));
    assert!(e.contains("block size must be positive, got 0x128"), "{e}");
    let e = err(3, 4, fp8(11, vec![1.0], 128, 128));
    assert!(e.contains("needs 12 bytes"), "{e}");
    let e = err(3, 4, fp8(12, vec![1.0, 2.0], 128, 128));
    assert!(e.contains("needs 1 scales"), "{e}");
    let e = err(3, 4, fp8(12, vec![f32::NAN], 128, 128));
    assert!(e.contains("scale #0 is NaN"), "{e}");
    let e = err(0, 4, MatrixData::F32(b(0)));
    assert!(e.contains("zero dimension"), "{e}");
    let e = err(usize::MAX, 4, MatrixData::F32(b(0)));
    assert!(e.contains("too large"), "{e}");
}

#[test]
fn names_and_storage() {
    let mut rng = Rng(3);
    let names: Vec<_> = FORMATS
        .iter()
        .map(|&f| random_matrix(f, 3, 6, (2, 2), &mut rng))
        .map(|m| (m.format_name(), m.storage_bytes()))
        .collect();
    assert_eq!(
        names,
        [
            ("f32", 72),
            ("bf16", 36),
            ("f16", 36),
            ("fp8_e4m3_block", 18 + 4 * 6),
            ("int8_row", 18 + 12),
            ("int4_group", 9 + 4 * 9),
            ("mxfp4", 9 + 3),
            ("mxfp8", 18 + 3),
            ("hif8_row", 18 + 4 * 3),
        ]
    );
}

#[test]
fn empty_token_batches_and_row_ranges() {
    let mut rng = Rng(5);
    let m = random_matrix(Format::Fp8, 10, 20, (4, 8), &mut rng);
    for level in levels() {
        m.matmul_rows_at(level, 0..10, &[], 0, &mut []);
        m.matmul_rows_at(level, 3..3, &[1.0; 40], 2, &mut []);
        let mut out = vec![f32::NAN; 40];
        m.matmul_t_rows_at(level, 3..3, &[], 2, &mut out);
        assert!(out.iter().all(|v| *v == 0.0));
    }
}

#[test]
#[should_panic(expected = "x must hold n_tokens (2) x cols (20) values")]
fn matmul_panics_on_length_mismatch() {
    let mut rng = Rng(5);
    let m = random_matrix(Format::F32, 10, 20, (1, 1), &mut rng);
    let mut out = vec![0.0; 20];
    m.matmul(&[1.0; 39], 2, &mut out);
}

fn random_w8a8(rows: usize, cols: usize, rng: &mut Rng) -> Matrix {
    let data = MatrixData::W8A8 {
        data: Bytes::from_vec((0..rows * cols).map(|_| rng.next_u64() as u8).collect()),
        scale: (0..rows).map(|_| rng.uniform(1e-3, 1e-2)).collect(),
    };
    Matrix::new(rows, cols, data).expect("valid W8A8 matrix")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// A group of products (mixed formats, W8A8 jobs sharing an activation, sizes on both sides
    /// of the parallel threshold) equals each product computed alone, bit for bit, on 1 and 3
    /// threads; outputs are poisoned with NaN first.
    #[test]
    fn matmul_group_equals_separate_products(
        n_jobs in 1usize..6,
        // 9 and 17 tokens take W8A8's AMX tiles where the CPU has them.
        nt in prop_oneof![1usize..=4, Just(9usize), Just(17usize)],
        seed in any::<u64>(),
        big in any::<bool>(),
    ) {
        let mut rng = Rng(seed);
        let cols = if big { 512 + (seed % 200) as usize } else { 3 + (seed % 60) as usize };
        let cols = cols + cols % 2;
        let shared_x: Vec<f32> = (0..nt * cols).map(|_| rng.value()).collect();
        let mut mats = Vec::new();
        let mut xs = Vec::new();
        for j in 0..n_jobs {
            let rows = 1 + (rng.next_u64() % if big { 200 } else { 20 }) as usize;
            let pick = rng.next_u64() as usize % (FORMATS.len() + 2);
            let m = if pick >= FORMATS.len() {
                random_w8a8(rows, cols, &mut rng)
            } else {
                random_matrix(FORMATS[pick], rows, cols, (5, 24), &mut rng)
            };
            mats.push(m);
            // Every other job reads the shared activation.
            xs.push(if j % 2 == 0 { None } else { Some((0..nt * cols).map(|_| rng.value()).collect::<Vec<f32>>()) });
        }
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for level in levels() {
                let (grouped, alone) = pool.install(|| {
                    let mut outs: Vec<Vec<f32>> = mats.iter().map(|m| vec![f32::NAN; nt * m.rows()]).collect();
                    let mut jobs: Vec<MatmulJob> = mats
                        .iter()
                        .zip(&xs)
                        .zip(outs.iter_mut())
                        .map(|((m, x), out)| MatmulJob { w: m, x: x.as_deref().unwrap_or(&shared_x), n_tokens: nt, out })
                        .collect();
                    matmul_group_at(level, &mut jobs);
                    let grouped: Vec<Vec<u32>> = outs.iter().map(|o| bits(o)).collect();
                    let alone: Vec<Vec<u32>> = mats
                        .iter()
                        .zip(&xs)
                        .map(|(m, x)| {
                            let mut out = vec![f32::NAN; nt * m.rows()];
                            m.matmul_rows_at(level, 0..m.rows(), x.as_deref().unwrap_or(&shared_x), nt, &mut out);
                            bits(&out)
                        })
                        .collect();
                    (grouped, alone)
                });
                for (g, a) in grouped.iter().zip(&alone) {
                    prop_assert!(g.iter().all(|b| !f32::from_bits(*b).is_nan()), "an output was not written");
                    prop_assert_eq!(g, a);
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "matmul_group: job 0")]
fn matmul_group_panics_on_length_mismatch() {
    let mut rng = Rng(3);
    let m = random_w8a8(4, 8, &mut rng);
    let x = vec![0.0f32; 7];
    let mut out = vec![0.0f32; 4];
    Matrix::matmul_group(&mut [MatmulJob {
        w: &m,
        x: &x,
        n_tokens: 1,
        out: &mut out,
    }]);
}

/// V4 §4.1: MXFP4 dequantization is e2m1(nibble, low = even column) · 2^(scale − 127), from the
/// checkpoint's bytes as stored; MXFP8 and HiF8 likewise through their tables.
#[test]
fn v4_formats_dequantize_exactly() {
    use crate::hif8::hif8_to_f32;
    use crate::mx::{dequantize_mxfp4_row, e8m0_to_f32};
    let mut rng = Rng(21);
    let (rows, cols) = (5usize, 96usize);
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next_u64() as u8).collect();
    let scales: Vec<u8> = (0..rows * 3).map(|_| e8m0(&mut rng)).collect();
    let m = Matrix::new(
        rows,
        cols,
        MatrixData::Mxfp4 {
            data: Bytes::from_vec(packed.clone()),
            scale: Bytes::from_vec(scales.clone()),
        },
    )
    .unwrap();
    let got = m.to_f32_vec();
    for r in 0..rows {
        let mut want = vec![0.0f32; cols];
        dequantize_mxfp4_row(
            &packed[r * cols / 2..(r + 1) * cols / 2],
            &scales[r * 3..(r + 1) * 3],
            &mut want,
        );
        assert_eq!(bits(&got[r * cols..(r + 1) * cols]), bits(&want), "row {r}");
    }
    // Nibble order: byte 0x71 = column 0 → 0.5, column 1 → 6.
    let one = Matrix::new(
        1,
        2,
        MatrixData::Mxfp4 {
            data: Bytes::from_vec(vec![0x71]),
            scale: Bytes::from_vec(vec![128]),
        },
    )
    .unwrap();
    assert_eq!(one.to_f32_vec(), [1.0, 12.0]);

    let codes: Vec<u8> = (0..rows * cols).map(|_| rng.fp8()).collect();
    let m = Matrix::new(
        rows,
        cols,
        MatrixData::Mxfp8 {
            data: Bytes::from_vec(codes.clone()),
            scale: Bytes::from_vec(scales.clone()),
        },
    )
    .unwrap();
    let got = m.to_f32_vec();
    for (i, v) in got.iter().enumerate() {
        let (r, c) = (i / cols, i % cols);
        let want = e4m3_to_f32(codes[i]) * e8m0_to_f32(scales[r * 3 + c / 32]);
        assert_eq!(v.to_bits(), want.to_bits());
    }

    let codes: Vec<u8> = (0..rows * cols).map(|_| hif8(&mut rng)).collect();
    let s: Vec<f32> = (0..rows).map(|_| rng.uniform(1e-5, 1e-4)).collect();
    let m = Matrix::new(
        rows,
        cols,
        MatrixData::Hif8 {
            data: Bytes::from_vec(codes.clone()),
            scale: s.clone(),
        },
    )
    .unwrap();
    for (i, v) in m.to_f32_vec().iter().enumerate() {
        assert_eq!(v.to_bits(), (hif8_to_f32(codes[i]) * s[i / cols]).to_bits());
    }
}

/// V4 §4.4: the INT4 layout packed along N, repacked at load, dequantizes to q · scale[row].
#[test]
fn int4_per_channel_repack() {
    use crate::int4::{pack_int4_along_n, scale_to_u64};
    let mut rng = Rng(31);
    let (rows, cols) = (6usize, 40usize);
    let q: Vec<i8> = (0..rows * cols)
        .map(|_| (rng.next_u64() % 15) as i8 - 7)
        .collect();
    let mut packed = vec![0u8; rows / 2 * cols];
    pack_int4_along_n(&q, rows, cols, &mut packed);
    let scale: Vec<f32> = (0..rows).map(|_| rng.uniform(1e-3, 1e-2)).collect();
    let u64s: Vec<u8> = scale
        .iter()
        .flat_map(|s| scale_to_u64(*s).to_le_bytes())
        .collect();
    let s = MatrixData::scales_from_u64_bytes(&u64s).unwrap();
    assert_eq!(bits(&s), bits(&scale));
    let data = MatrixData::int4_per_channel_packed_n(rows, cols, &packed, s).unwrap();
    let m = Matrix::new(rows, cols, data).unwrap();
    for (i, v) in m.to_f32_vec().iter().enumerate() {
        assert_eq!(
            v.to_bits(),
            (q[i] as f32 * scale[i / cols]).to_bits(),
            "{i}"
        );
    }
    assert!(MatrixData::int4_per_channel_packed_n(5, cols, &packed, vec![1.0; 5]).is_err());
    assert!(MatrixData::int4_per_channel_packed_n(rows, cols, &packed[1..], scale).is_err());
    let mut bad = u64s.clone();
    bad[7] = 1;
    let e = MatrixData::scales_from_u64_bytes(&bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("high 32 bits"), "{e}");
}

#[test]
fn v4_constructors_reject_malformed_inputs() {
    let b = |n| Bytes::from_vec(vec![0x11u8; n]);
    let err = |rows, cols, data| Matrix::new(rows, cols, data).unwrap_err().to_string();
    let e = err(
        2,
        64,
        MatrixData::Mxfp4 {
            data: b(64),
            scale: b(3),
        },
    );
    assert!(e.contains("mxfp4") && e.contains("needs 4 scales"), "{e}");
    let e = err(
        2,
        3,
        MatrixData::Mxfp4 {
            data: b(3),
            scale: b(2),
        },
    );
    assert!(e.contains("cols must be even"), "{e}");
    let e = err(
        2,
        64,
        MatrixData::Mxfp4 {
            data: b(63),
            scale: b(4),
        },
    );
    assert!(e.contains("needs 64 bytes"), "{e}");
    let mut s = vec![127u8; 4];
    s[2] = 255;
    let e = err(
        2,
        64,
        MatrixData::Mxfp8 {
            data: b(128),
            scale: Bytes::from_vec(s),
        },
    );
    assert!(e.contains("mxfp8 E8M0 scale byte #2 is 255"), "{e}");
    let e = err(
        2,
        64,
        MatrixData::Hif8 {
            data: b(128),
            scale: vec![1.0],
        },
    );
    assert!(
        e.contains("hif8_row") && e.contains("needs 2 scales"),
        "{e}"
    );
}

/// `to_w8a8`: each row's int8 values and scale follow the converter's rule (bf16 rows: spec
/// §5.2 bit for bit; f32/FP8 rows: `max|w|/127`), every weight within half a step of its value,
/// and the product is the W8A8 product of those values.
#[test]
fn to_w8a8_quantizes_rows_by_the_converters_rule() {
    let mut rng = Rng(77);
    for format in [Format::Bf16, Format::F32, Format::Fp8, Format::Int8] {
        let m = random_matrix(format, 37, 70, (16, 16), &mut rng);
        let q = m.to_w8a8();
        assert_eq!(q.format_name(), "w8a8_int8", "{format:?}");
        let MatrixData::W8A8 { data, scale } = q.data() else {
            panic!("{format:?}: not W8A8")
        };
        let w = m.to_f32_vec();
        for r in 0..37 {
            let row = &w[r * 70..(r + 1) * 70];
            let qr: Vec<i8> = data.as_slice()[r * 70..(r + 1) * 70]
                .iter()
                .map(|&b| b as i8)
                .collect();
            match format {
                Format::Bf16 => {
                    let bits: Vec<u16> = row.iter().map(|&v| f32_to_bf16(v)).collect();
                    let mut want = vec![0i8; 70];
                    let s = crate::int8::quantize_row_bf16_to_int8(&bits, &mut want);
                    assert_eq!((scale[r], &qr), (s, &want), "bf16 row {r}");
                }
                Format::Int8 => {
                    // Already int8: values and scales kept as they are.
                    let MatrixData::Int8Row {
                        data: d0,
                        scale: s0,
                    } = m.data()
                    else {
                        unreachable!()
                    };
                    assert_eq!(scale[r], s0[r]);
                    assert_eq!(
                        &data.as_slice()[r * 70..(r + 1) * 70],
                        &d0.as_slice()[r * 70..(r + 1) * 70]
                    );
                }
                _ => {
                    let amax = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    assert_eq!(scale[r], amax / 127.0, "{format:?} row {r}");
                    for (c, (&v, &qv)) in row.iter().zip(&qr).enumerate() {
                        let err = (v - qv as f32 * scale[r]).abs();
                        assert!(
                            err <= 0.5 * scale[r] * 1.0001,
                            "{format:?} [{r},{c}]: {v} vs {qv}"
                        );
                    }
                }
            }
        }
        // The product is the W8A8 product of the quantized rows (same kernel path as a
        // converted W8A8 checkpoint).
        let x: Vec<f32> = (0..70 * 3).map(|_| rng.value()).collect();
        let mut y = vec![0.0f32; 37 * 3];
        q.matmul(&x, 3, &mut y);
        let again = Matrix::new(
            37,
            70,
            MatrixData::W8A8 {
                data: data.clone(),
                scale: scale.clone(),
            },
        )
        .unwrap();
        let mut y2 = vec![0.0f32; 37 * 3];
        again.matmul(&x, 3, &mut y2);
        assert_eq!(bits(&y), bits(&y2));
    }
}

/// Row `r` of `m`, dequantized.
fn dequant_row(m: &Matrix, r: usize) -> Vec<u32> {
    let mut row = vec![0.0f32; m.cols()];
    m.row_to_f32(r, &mut row);
    bits(&row)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Slices hold the whole matrix's values at their positions (scales included, FP8 blocks
    /// and int4 groups cut anywhere), and a row slice's products are the whole product's rows
    /// bit for bit at every SIMD level.
    #[test]
    fn slices_hold_the_matrix_values((format, rows, cols, nt, block, seed) in case(), r in any::<(prop::sample::Index, prop::sample::Index)>(), c in any::<(prop::sample::Index, prop::sample::Index)>(), w8a8 in any::<bool>()) {
        let mut rng = Rng(seed);
        let mut m = random_matrix(format, rows, cols, block, &mut rng);
        if w8a8 && format == Format::Int8 {
            m = m.to_w8a8();
        }
        let (r0, r1) = (r.0.index(rows), r.1.index(rows));
        let rr = r0.min(r1)..r0.max(r1) + 1;
        let s = m.slice_rows(rr.clone()).unwrap();
        prop_assert_eq!(s.rows(), rr.len());
        for (i, row) in rr.clone().enumerate() {
            prop_assert_eq!(dequant_row(&s, i), dequant_row(&m, row));
        }
        let x: Vec<f32> = (0..nt * cols).map(|_| rng.value()).collect();
        for level in levels() {
            let mut whole = vec![0.0f32; nt * rows];
            m.matmul_rows_at(level, 0..rows, &x, nt, &mut whole);
            let mut part = vec![0.0f32; nt * rr.len()];
            s.matmul_rows_at(level, 0..rr.len(), &x, nt, &mut part);
            for t in 0..nt {
                prop_assert_eq!(
                    bits(&part[t * rr.len()..(t + 1) * rr.len()]),
                    bits(&whole[t * rows + rr.start..t * rows + rr.end]),
                    "{:?} {:?} rows {:?}", level, format, rr
                );
            }
        }
        let (c0, c1) = (c.0.index(cols), c.1.index(cols));
        let cr = c0.min(c1)..c0.max(c1) + 1;
        let packed = matches!(format, Format::Int4 | Format::Fp4);
        let refused = (packed && (cr.start % 2 != 0 || cr.len() % 2 != 0))
            || (matches!(format, Format::Fp4 | Format::Mxfp8) && cr.start % 32 != 0);
        match m.slice_cols(cr.clone()) {
            Err(e) => prop_assert!(refused, "{:?} columns {:?}: {}", format, cr, e),
            Ok(s) => {
                prop_assert!(!refused, "{:?} columns {:?} were cut", format, cr);
                prop_assert_eq!(s.cols(), cr.len());
                for row in 0..rows {
                    let mut want = vec![0.0f32; cols];
                    m.row_to_f32(row, &mut want);
                    prop_assert_eq!(dequant_row(&s, row), bits(&want[cr.clone()]));
                }
            }
        }
    }
}

#[test]
fn slices_outside_the_matrix_are_refused() {
    let m = random_matrix(Format::Fp8, 10, 20, (4, 8), &mut Rng(3));
    for e in [
        m.slice_rows(5..5).unwrap_err(),
        m.slice_rows(8..11).unwrap_err(),
        m.slice_cols(0..21).unwrap_err(),
    ] {
        let msg = e.to_string();
        assert!(
            msg.contains("cannot be sliced") && msg.contains(".."),
            "{msg}"
        );
    }
}
