//! Throughput of the latent-attention kernels (`dot_rows_many`, `dot_rows_lanes`,
//! `dot_rows_bf16`, `axpy_rows_many`, `axpy_rows_bf16`) on one
//! thread: H heads against a chunk of cached latent rows, as the absorbed MLA decode step runs
//! them (16 heads, rows of 576 = 512 + 64 scored, 512 added).
//!
//!     cargo run -p cachalot-kernels --release --example attention_throughput -- [heads rows]
//!
//! Best of 20 rounds; GFMA/s counts one multiply-add per (head, row, column).

use std::time::Instant;

use cachalot_kernels::{
    axpy_rows_bf16, axpy_rows_many, dot_rows_bf16, dot_rows_lanes, dot_rows_many, f32_to_bf16,
    simd_level, HeadLanes, HeadPairs,
};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("arguments: heads rows"))
        .collect();
    let heads = args.first().copied().unwrap_or(16);
    let n = args.get(1).copied().unwrap_or(128);
    let (width, kvr) = (576, 512);
    let v = |i: usize| ((i * 7919 % 1000) as f32 - 500.0) / 1000.0;
    let q: Vec<f32> = (0..heads * width).map(v).collect();
    let cache: Vec<Vec<f32>> = (0..n)
        .map(|s| (0..width).map(|c| v(s * width + c + 3)).collect())
        .collect();
    let rows: Vec<&[f32]> = cache.iter().map(|r| &r[..]).collect();
    let ckv: Vec<&[f32]> = cache.iter().map(|r| &r[..kvr]).collect();
    let p: Vec<f32> = (0..n * heads).map(|i| v(i) / n as f32).collect();
    let mut scores = vec![0.0f32; n * heads];
    let mut y = vec![0.0f32; heads * kvr];
    let best = |f: &mut dyn FnMut()| {
        (0..20)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let td = best(&mut || dot_rows_many(&q, &rows, &mut scores));
    let lanes = HeadLanes::new(&q, heads);
    let tl = best(&mut || dot_rows_lanes(&lanes, &rows, &mut scores));
    let ta = best(&mut || axpy_rows_many(&p, &ckv, &mut y));
    // The same rows in a bf16 cache, scored against bf16 queries (`--kv-cache-dtype bf16
    // --bf16-dot`).
    let cache16: Vec<Vec<u16>> = cache
        .iter()
        .map(|r| r.iter().map(|&x| f32_to_bf16(x)).collect())
        .collect();
    let rows16: Vec<&[u16]> = cache16.iter().map(|r| &r[..]).collect();
    let pairs = HeadPairs::new(&q, heads);
    let tb = best(&mut || dot_rows_bf16(&pairs, &rows16, &mut scores));
    let tv = best(&mut || axpy_rows_bf16(&p, &rows16, &mut y));
    println!(
        "{heads} heads x {n} rows, simd level {}",
        simd_level().name()
    );
    let g = |fma: usize, t: f64| fma as f64 / t / 1e9;
    println!(
        "dot_rows_many  {:8.1} us  {:6.2} GFMA/s",
        td * 1e6,
        g(heads * n * width, td)
    );
    println!(
        "dot_rows_lanes {:8.1} us  {:6.2} GFMA/s (queries already in lanes)",
        tl * 1e6,
        g(heads * n * width, tl)
    );
    println!(
        "dot_rows_bf16  {:8.1} us  {:6.2} GFMA/s (bf16 rows and queries)",
        tb * 1e6,
        g(heads * n * width, tb)
    );
    println!(
        "axpy_rows_many {:8.1} us  {:6.2} GFMA/s",
        ta * 1e6,
        g(heads * n * kvr, ta)
    );
    println!(
        "axpy_rows_bf16 {:8.1} us  {:6.2} GFMA/s (bf16 rows and probabilities)",
        tv * 1e6,
        g(heads * n * kvr, tv)
    );
}
