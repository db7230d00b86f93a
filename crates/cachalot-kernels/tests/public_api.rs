//! The public surface the model crate is written against: exact signatures, and the dispatched
//! (process-wide SIMD level) paths end to end.

use std::sync::Arc;

use cachalot_kernels::fp8::{e4m3_table, e4m3_to_f32, f32_to_e4m3};
use cachalot_kernels::*;

#[test]
fn signatures() {
    let _: fn(Vec<u8>) -> Bytes = Bytes::from_vec;
    // `ByteOwner` is `Arc<dyn AsRef<[u8]> + Send + Sync>`.
    let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(vec![0u8; 4]);
    let _: Result<Bytes, KernelError> = Bytes::from_owner(owner, 0, 4);
    let _: fn(ByteOwner, usize, usize) -> Result<Bytes, KernelError> = Bytes::from_owner;
    let _: fn(u8) -> f32 = e4m3_to_f32;
    let _: fn() -> &'static [f32; 256] = e4m3_table;
    let _: fn(f32) -> u8 = f32_to_e4m3;
    let _: fn(u16) -> f32 = bf16_to_f32;
    let _: fn(f32) -> u16 = f32_to_bf16;
    let _: fn(usize, usize, MatrixData) -> Result<Matrix, KernelError> = Matrix::new;
    let _: fn(&Matrix, &[f32], usize, &mut [f32]) = Matrix::matmul;
    let _: fn(&Matrix, std::ops::Range<usize>, &[f32], usize, &mut [f32]) = Matrix::matmul_rows;
    let _: fn(&Matrix, std::ops::Range<usize>, &[f32], usize, &mut [f32]) = Matrix::matmul_t_rows;
    let _: fn(&Matrix, usize, &mut [f32]) = Matrix::row_to_f32;
    let _: fn(&Matrix) -> Vec<f32> = Matrix::to_f32_vec;
    let _: fn(&Matrix) -> Matrix = Matrix::to_f32_matrix;
    let _: fn(&Matrix) -> &'static str = Matrix::format_name;
    let _: fn(&[f32], &[f32]) -> f32 = dot;
    let _: fn(f32, &[f32], &mut [f32]) = axpy;
    let _: fn(&mut [f32], f32) = scale_in_place;
    let _: fn(&[f32], &[f32], f32, &mut [f32]) = rms_norm;
    let _: fn(&[f32], usize, &[f32], f32, &mut [f32]) = rms_norm_rows;
    let _: fn(&[f32], &[f32], &mut [f32]) = silu_mul;
    let _: fn(&mut [f32]) = softmax_in_place;
    let _: fn(&[f32], usize) -> f32 = log_softmax_at;
    let _: fn(&[f32]) -> usize = argmax;
    let _: fn(&mut [f32], &[f32], &[f32]) = rope_deinterleave_in_place;
    fn shared<T: Send + Sync + Clone>() {}
    shared::<Matrix>();
    shared::<Bytes>();
    shared::<MatrixData>();
}

#[test]
fn bytes_window_into_a_shared_owner() {
    let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new((0u8..=255).collect::<Vec<u8>>());
    let b = Bytes::from_owner(owner.clone(), 10, 4).unwrap();
    assert_eq!(b.as_slice(), &[10, 11, 12, 13]);
    assert_eq!(b.len(), 4);
    assert!(!b.is_empty());
    let e = Bytes::from_owner(owner, 250, 10).unwrap_err();
    assert!(e.to_string().contains("250..250+10"), "{e}");
}

/// An FP8 matrix stored at an odd byte offset inside a larger owner (safetensors offsets are not
/// aligned), multiplied through the dispatched kernels.
#[test]
fn fp8_matmul_from_an_unaligned_window() {
    let (rows, cols) = (150usize, 260usize);
    let mut file = vec![0xAAu8; 3];
    let codes: Vec<u8> = (0..rows * cols)
        .map(|i| {
            let b = (i * 37 % 253) as u8;
            if b & 0x7F == 0x7F {
                0x3C
            } else {
                b
            }
        })
        .collect();
    file.extend_from_slice(&codes);
    file.extend_from_slice(&[0xAA; 5]);
    let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(file);
    let data = Bytes::from_owner(owner, 3, rows * cols).unwrap();
    let scale_inv: Vec<f32> = (0..2 * 3).map(|i| 1e-3 * (i + 1) as f32).collect();
    let m = Matrix::new(
        rows,
        cols,
        MatrixData::Fp8Block {
            data,
            scale_inv,
            block_rows: 128,
            block_cols: 128,
        },
    )
    .unwrap();
    assert_eq!(m.format_name(), "fp8_e4m3_block");
    assert_eq!(m.storage_bytes(), rows * cols + 24);

    let n = 6;
    let x: Vec<f32> = (0..n * cols)
        .map(|i| ((i % 17) as f32 - 8.3) / 9.0)
        .collect();
    let mut out = vec![f32::NAN; n * rows];
    m.matmul(&x, n, &mut out);
    let w = m.to_f32_vec();
    for t in 0..n {
        for r in 0..rows {
            let (mut want, mut bound) = (0.0f64, 0.0f64);
            for c in 0..cols {
                let p = w[r * cols + c] as f64 * x[t * cols + c] as f64;
                want += p;
                bound += p.abs();
            }
            let got = out[t * rows + r] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * bound,
                "t={t} r={r}: {got} vs {want}"
            );
        }
        // Bit-identical alone.
        let mut one = vec![f32::NAN; rows];
        m.matmul(&x[t * cols..(t + 1) * cols], 1, &mut one);
        assert_eq!(
            one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            out[t * rows..(t + 1) * rows]
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        );
    }

    // The same through the exactly dequantized f32 matrix.
    let f = m.to_f32_matrix();
    let mut out_f = vec![f32::NAN; n * rows];
    f.matmul(&x, n, &mut out_f);
    for (a, b) in out.iter().zip(&out_f) {
        assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0));
    }

    // Transposed over rows 100..150 and a sub-range forward.
    let xt: Vec<f32> = (0..2 * 50).map(|i| (i as f32 * 0.31).sin()).collect();
    let mut out_t = vec![f32::NAN; 2 * cols];
    m.matmul_t_rows(100..150, &xt, 2, &mut out_t);
    for t in 0..2 {
        for c in 0..cols {
            let want: f64 = (100..150)
                .map(|r| w[r * cols + c] as f64 * xt[t * 50 + r - 100] as f64)
                .sum();
            assert!((out_t[t * cols + c] as f64 - want).abs() < 1e-4);
        }
    }
    let mut part = vec![f32::NAN; n * 20];
    m.matmul_rows(120..140, &x, n, &mut part);
    for t in 0..n {
        for j in 0..20 {
            assert_eq!(
                part[t * 20 + j].to_bits(),
                out[t * rows + 120 + j].to_bits()
            );
        }
    }
}

#[test]
fn vector_kernels_end_to_end() {
    let x = [1.0f32, -2.0, 3.0, -4.0, 5.0];
    assert_eq!(dot(&x, &x), 55.0);
    let mut y = [1.0f32; 5];
    axpy(2.0, &x, &mut y);
    assert_eq!(y, [3.0, -3.0, 7.0, -7.0, 11.0]);
    scale_in_place(&mut y, 0.5);
    assert_eq!(y, [1.5, -1.5, 3.5, -3.5, 5.5]);
    let mut out = [f32::NAN; 5];
    rms_norm(&x, &[1.0; 5], 0.0, &mut out);
    let inv = 1.0 / 11.0f32.sqrt();
    assert!(out.iter().zip(&x).all(|(o, v)| (o - v * inv).abs() < 1e-6));
    let mut rows = [f32::NAN; 10];
    rms_norm_rows(&[x, x].concat(), 5, &[1.0; 5], 0.0, &mut rows);
    assert_eq!(&rows[5..], &out[..]);
    silu_mul(&[0.0, 1.0], &[3.0, 2.0], &mut out[..2]);
    assert_eq!(out[0], 0.0);
    assert!((out[1] - 2.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
    let mut p = [1.0f32, 2.0, 3.0];
    softmax_in_place(&mut p);
    assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6 && p[2] > p[1]);
    assert!((log_softmax_at(&[1.0, 2.0, 3.0], 2) - p[2].ln()).abs() < 1e-6);
    assert_eq!(argmax(&[0.5, 2.0, 2.0]), 1);
    let mut r = [1.0f32, 2.0, 3.0, 4.0];
    rope_deinterleave_in_place(&mut r, &[0.0, 1.0], &[1.0, 0.0]);
    // Pair (1, 2) rotated by 90°: (-2, 1); pair (3, 4) unrotated.
    assert_eq!(r, [-2.0, 3.0, 1.0, 4.0]);
}
