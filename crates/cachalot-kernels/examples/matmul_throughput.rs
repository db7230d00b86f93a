//! Weight-streaming throughput of `Matrix::matmul` per format (GB/s of weight bytes).
//!
//!     cargo run -p cachalot-kernels --release --example matmul_throughput -- [rows cols tokens]
//!
//! Defaults: a 4096x4096 matrix, 1 token (decode), run on 1 thread and on all threads; then
//! the transposed product, and MLA's W_UKᵀ·q absorption over a kv_b_proj-shaped matrix.
//! Each figure is the best of 5 rounds.
//! `CACHALOT_SIMD=scalar` (or `avx2`) measures the scalar (AVX2) kernels on an AVX-512 CPU.
//! Numbers on shared machines are noisy: compare formats within one run.

#[path = "common/timing.rs"]
mod timing;

use timing::best_time;

use cachalot_kernels::{
    f32_to_bf16, f32s_to_le_bytes, simd_level, u16s_to_le_bytes, Bytes, Matrix, MatrixData,
};

fn main() {
    // Optional: rows cols tokens [section], section = forward | transposed | absorption | all.
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let section = raw.get(3).cloned().unwrap_or_else(|| "all".to_string());
    let run = |name: &str| section == "all" || section == name;
    let args: Vec<usize> = raw
        .iter()
        .take(3)
        .map(|a| a.parse().expect("arguments: rows cols tokens [section]"))
        .collect();
    let rows = args.first().copied().unwrap_or(4096);
    let cols = args.get(1).copied().unwrap_or(4096);
    let tokens = args.get(2).copied().unwrap_or(1);

    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let n = rows * cols;
    let values: Vec<f32> = (0..n)
        .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let codes: Vec<u8> = (0..n)
        .map(|_| {
            let b = next() as u8;
            if b & 0x7F == 0x7F {
                b - 1
            } else {
                b
            }
        })
        .collect();
    let grid = rows.div_ceil(128) * cols.div_ceil(128);
    let matrices = [
        MatrixData::Fp8Block {
            data: Bytes::from_vec(codes.clone()),
            scale_inv: vec![1e-3; grid],
            block_rows: 128,
            block_cols: 128,
        },
        MatrixData::Int8Row {
            data: Bytes::from_vec(codes.clone()),
            scale: vec![1e-2; rows],
        },
        MatrixData::W8A8 {
            data: Bytes::from_vec(codes.clone()),
            scale: vec![1e-2; rows],
        },
        MatrixData::Int4Group {
            data: Bytes::from_vec(codes[..n / 2].to_vec()),
            scale: vec![1e-2; rows],
            group_size: cols,
        },
        MatrixData::W4A8 {
            data: Bytes::from_vec(codes[..n / 2].to_vec()),
            scale: vec![1e-2; rows],
        },
        MatrixData::Bf16(Bytes::from_vec(u16s_to_le_bytes(
            &values.iter().map(|v| f32_to_bf16(*v)).collect::<Vec<_>>(),
        ))),
        MatrixData::F32(Bytes::from_vec(f32s_to_le_bytes(&values))),
        // MXFP4 (DeepSeek-V4's routed experts): e2m1 nibbles, an e8m0 scale per 32 columns.
        MatrixData::Mxfp4 {
            data: Bytes::from_vec(codes[..n / 2].to_vec()),
            scale: Bytes::from_vec(vec![120u8; rows * cols.div_ceil(32)]),
        },
    ]
    .map(|d| Matrix::new(rows, cols, d).expect("valid matrix"));
    // The bf16 matrix again, multiplied as BF16 x BF16 (`--bf16-dot`).
    let bf16_dot = matrices[5].to_bf16_dot();
    let matrices: Vec<&Matrix> = matrices.iter().chain([&bf16_dot]).collect();
    drop(values);

    let x: Vec<f32> = (0..tokens * cols)
        .map(|i| ((i % 97) as f32 - 48.0) / 50.0)
        .collect();
    let mut out = vec![0.0f32; tokens * rows];
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "{rows}x{cols}, {tokens} token(s), simd level {}",
        simd_level().name()
    );
    let mut thread_counts = vec![1];
    if all > 1 {
        thread_counts.push(all);
    }
    if !run("forward") {
        thread_counts.clear();
    }
    for threads in thread_counts {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        for &m in &matrices {
            pool.install(|| {
                let per_call = best_time(|| m.matmul(&x, tokens, &mut out));
                println!(
                    "threads {threads}  {:>15}  {:>7.1} MB  {:>8.3} ms/call  {:>6.2} GB/s of weights  {:>8.2} GFLOP/s",
                    m.format_name(),
                    m.storage_bytes() as f64 / 1e6,
                    per_call * 1e3,
                    m.storage_bytes() as f64 / per_call / 1e9,
                    2.0 * (rows * cols * tokens) as f64 / per_call / 1e9,
                );
            });
        }
    }
    // The transposed product (MLA absorption), single thread, over all rows.
    let xt: Vec<f32> = (0..tokens * rows)
        .map(|i| ((i % 89) as f32 - 44.0) / 50.0)
        .collect();
    let mut out_t = vec![0.0f32; tokens * cols];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("thread pool");
    for m in matrices.iter().filter(|_| run("transposed")) {
        pool.install(|| {
            let per_call = best_time(|| m.matmul_t_rows(0..rows, &xt, tokens, &mut out_t));
            println!(
                "transposed, threads 1  {:>15}  {:>8.3} ms/call  {:>6.2} GB/s of weights",
                m.format_name(),
                per_call * 1e3,
                m.storage_bytes() as f64 / per_call / 1e9,
            );
        });
    }
    // MLA absorption as the model calls it: kv_b_proj [128 heads x 256, 512], q̃_h = W_UK,hᵀ q_h
    // over the first 128 rows of each head, one call per head, single thread.
    let (heads, kv_rank) = (128usize, 512usize);
    let kvb_rows = heads * 256;
    let kvb_codes: Vec<u8> = (0..kvb_rows * kv_rank)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    let kvb = [
        MatrixData::Fp8Block {
            data: Bytes::from_vec(kvb_codes.clone()),
            scale_inv: vec![1e-3; (kvb_rows / 128) * (kv_rank / 128)],
            block_rows: 128,
            block_cols: 128,
        },
        MatrixData::Bf16(Bytes::from_vec(u16s_to_le_bytes(
            &kvb_codes
                .iter()
                .map(|c| f32_to_bf16(*c as f32 / 256.0 - 0.5))
                .collect::<Vec<_>>(),
        ))),
    ]
    .map(|d| Matrix::new(kvb_rows, kv_rank, d).expect("valid matrix"));
    let q: Vec<f32> = (0..tokens * 128)
        .map(|i| ((i % 31) as f32 - 15.0) / 16.0)
        .collect();
    let mut q_abs = vec![0.0f32; tokens * kv_rank];
    for m in kvb.iter().filter(|_| run("absorption")) {
        pool.install(|| {
            let per_call = best_time(|| {
                for h in 0..heads {
                    m.matmul_t_rows(h * 256..h * 256 + 128, &q, tokens, &mut q_abs);
                }
            });
            let bytes = m.storage_bytes() as f64 / 2.0;
            println!(
                "absorption W_UK^T q, 128 heads, threads 1  {:>15}  {:>8.3} ms/layer  {:>6.2} GB/s of weights",
                m.format_name(),
                per_call * 1e3,
                bytes / per_call / 1e9,
            );
        });
    }
    std::hint::black_box((&out, &out_t, &q_abs));
}
