//! MLA's W_UKᵀ·q absorption with weights out of cache, as a batch-1 decode step meets it: the
//! `v3-1b` benchmark model's kv_b_proj ([16 heads × 256, 512]), one call per head inside a
//! parallel loop over heads (as `attend_absorbed` calls it), over enough layer copies (256 MB)
//! that every call reads DRAM. Beside it, the same bytes through the forward product (one
//! region per layer) as the bandwidth the step's other products get.
//!
//!     cargo run -p cachalot-kernels --release --example absorption_cold -- [format] [tokens]
//!
//! `format`: bf16 (default) or fp8. Figures are GB/s of the bytes touched (W_UK: the first 128
//! of each head's 256 rows), best of 5 rounds.

#[path = "common/timing.rs"]
mod timing;

use rayon::prelude::*;
use timing::best_time;

use cachalot_kernels::{f32_to_bf16, u16s_to_le_bytes, Bytes, Matrix, MatrixData};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let format = args.first().cloned().unwrap_or_else(|| "bf16".into());
    let tokens: usize = args.get(1).map_or(1, |a| a.parse().expect("tokens"));
    let (heads, per_head, nope, kvr) = (16usize, 256usize, 128usize, 512usize);
    let rows = heads * per_head;
    let layers = 64;
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut make = |r: usize, c: usize| -> Matrix {
        let n = r * c;
        let data = if format == "fp8" {
            let codes: Vec<u8> = (0..n).map(|_| (next() as u8) & 0xF7).collect();
            MatrixData::Fp8Block {
                data: Bytes::from_vec(codes),
                scale_inv: vec![1e-3; r.div_ceil(128) * c.div_ceil(128)],
                block_rows: 128,
                block_cols: 128,
            }
        } else {
            let v: Vec<u16> = (0..n)
                .map(|_| f32_to_bf16((next() % 2001) as f32 / 1000.0 - 1.0))
                .collect();
            MatrixData::Bf16(Bytes::from_vec(u16s_to_le_bytes(&v)))
        };
        Matrix::new(r, c, data).expect("valid matrix")
    };
    let kvb: Vec<Matrix> = (0..layers).map(|_| make(rows, kvr)).collect();
    // The forward comparison: matrices of the touched bytes' shape ([16 × 128, 512]).
    let fwd: Vec<Matrix> = (0..layers).map(|_| make(heads * nope, kvr)).collect();
    let q: Vec<f32> = (0..tokens * nope)
        .map(|i| ((i % 31) as f32 - 15.0) / 16.0)
        .collect();
    let x: Vec<f32> = (0..tokens * kvr)
        .map(|i| ((i % 29) as f32 - 14.0) / 16.0)
        .collect();
    let touched =
        (layers * heads * nope * kvr) as f64 * kvb[0].storage_bytes() as f64 / (rows * kvr) as f64;
    let pool = rayon::ThreadPoolBuilder::new().build().expect("pool");
    pool.install(|| {
        let t = best_time(|| {
            for m in &kvb {
                let outs: Vec<Vec<f32>> = (0..heads)
                    .into_par_iter()
                    .map(|h| {
                        let mut o = vec![0.0f32; tokens * kvr];
                        m.matmul_t_rows(h * per_head..h * per_head + nope, &q, tokens, &mut o);
                        o
                    })
                    .collect();
                std::hint::black_box(outs);
            }
        });
        println!(
            "absorption, {} threads, {tokens} token(s), {}: {:.3} ms per layer, {:.2} GB/s",
            rayon::current_num_threads(),
            kvb[0].format_name(),
            t * 1e3 / layers as f64,
            touched / t / 1e9
        );
        let mut out = vec![0.0f32; tokens * heads * nope];
        let t = best_time(|| {
            for m in &fwd {
                m.matmul(&x, tokens, &mut out);
            }
        });
        println!(
            "forward (same bytes), {}: {:.3} ms per layer, {:.2} GB/s",
            fwd[0].format_name(),
            t * 1e3 / layers as f64,
            touched / t / 1e9
        );
    });
}
