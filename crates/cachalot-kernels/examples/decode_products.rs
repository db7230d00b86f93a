//! The weight products of one batch-1 decode step of a DeepSeek-V3-shaped model, in the order
//! and grouping the model issues them (one parallel region per product or product group), against
//! the same bytes streamed in a single region: what the step's many short parallel regions cost.
//!
//!     cargo run -p cachalot-kernels --release --example decode_products -- [layers] [format]
//!
//! Shapes: the `v3-1b` benchmark model (hidden 2048, 16 heads, q_lora 768, kv_lora 512, 64
//! routed experts of 256 with top-6 and one shared, dense first layer of 8192, vocabulary 32000).
//! `format`: bf16 (default) or w8a8. Figures are GB/s of weight bytes, best of 5 rounds; last,
//! each kind of product (head, attention projections, expert gate/up, expert down) of all layers
//! in one region, to see which shapes stream slower.

#[path = "common/timing.rs"]
mod timing;

use timing::best_time;

use cachalot_kernels::{f32_to_bf16, u16s_to_le_bytes, Bytes, MatmulJob, Matrix, MatrixData};

struct Layer {
    q_a: Matrix,
    kv_a: Matrix,
    q_b: Matrix,
    kv_b: Matrix,
    o: Matrix,
    gate: Option<Matrix>,
    up_gate: Vec<Matrix>,
    down: Vec<Matrix>,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let layers: usize = args.first().map_or(8, |a| a.parse().expect("layers"));
    let format = args.get(1).cloned().unwrap_or_else(|| "bf16".into());
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut mat = |rows: usize, cols: usize| -> Matrix {
        let n = rows * cols;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let data = if format == "w8a8" {
            let codes: Vec<u8> = (0..n).map(|_| (next() % 255) as u8).collect();
            MatrixData::W8A8 {
                data: Bytes::from_vec(codes),
                scale: vec![1e-2; rows],
            }
        } else {
            let v: Vec<u16> = (0..n)
                .map(|_| f32_to_bf16((next() % 2001) as f32 / 1000.0 - 1.0))
                .collect();
            MatrixData::Bf16(Bytes::from_vec(u16s_to_le_bytes(&v)))
        };
        Matrix::new(rows, cols, data).expect("valid matrix")
    };
    let (h, heads) = (2048usize, 16usize);
    let built: Vec<Layer> = (0..layers)
        .map(|l| {
            let dense = l == 0;
            let (up_gate, down) = if dense {
                (vec![mat(8192, h), mat(8192, h)], vec![mat(h, 8192)])
            } else {
                (
                    (0..14).map(|_| mat(256, h)).collect(),
                    (0..7).map(|_| mat(h, 256)).collect(),
                )
            };
            Layer {
                q_a: mat(768, h),
                kv_a: mat(576, h),
                q_b: mat(heads * 192, 768),
                kv_b: mat(heads * 256, 512),
                o: mat(h, heads * 128),
                gate: (!dense).then(|| mat(64, h)),
                up_gate,
                down,
            }
        })
        .collect();
    let head = mat(32000, h);
    let mut all: Vec<&Matrix> = vec![&head];
    for l in &built {
        all.extend([&l.q_a, &l.kv_a, &l.q_b, &l.kv_b, &l.o]);
        all.extend(l.gate.iter());
        all.extend(l.up_gate.iter().chain(&l.down));
    }
    let bytes: usize = all.iter().map(|m| m.storage_bytes()).sum();
    println!(
        "{layers} layers, {format}, {:.1} MB of weights per step, {} products",
        bytes as f64 / 1e6,
        all.len()
    );

    let x: Vec<f32> = (0..8192).map(|i| ((i % 97) as f32 - 48.0) / 50.0).collect();
    let mut out = vec![0.0f32; 32000];
    let step = |out: &mut Vec<f32>| {
        let mut o_h = vec![0.0f32; 8192];
        for l in &built {
            l.q_a.matmul(&x[..h], 1, &mut o_h[..768]);
            l.kv_a.matmul(&x[..h], 1, &mut o_h[..576]);
            l.q_b.matmul(&x[..768], 1, &mut out[..heads * 192]);
            l.kv_b.matmul(&x[..512], 1, &mut out[..heads * 256]);
            l.o.matmul(&x[..h], 1, &mut o_h[..h]);
            if let Some(g) = &l.gate {
                g.matmul(&x[..h], 1, &mut o_h[..64]);
            }
            group(&l.up_gate.iter().collect::<Vec<_>>(), &x);
            group(&l.down.iter().collect::<Vec<_>>(), &x);
        }
        head.matmul(&x[..h], 1, &mut out[..32000]);
    };
    let one_region = || group(&all, &x);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for t in [1, threads] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build()
            .expect("thread pool");
        pool.install(|| {
            let s = best_time(|| step(&mut out));
            let r = best_time(one_region);
            println!(
                "threads {t}: step as issued {:.2} ms ({:.1} GB/s); one region {:.2} ms ({:.1} GB/s)",
                s * 1e3,
                bytes as f64 / s / 1e9,
                r * 1e3,
                bytes as f64 / r / 1e9
            );
        });
    }
    // Each kind of product over all layers in one region, on all threads: which shapes stream
    // slower than the rest.
    let kinds: Vec<(&str, Vec<&Matrix>)> = vec![
        ("head", vec![&head]),
        (
            "attention (q_a, kv_a, q_b, kv_b, o)",
            built
                .iter()
                .flat_map(|l| [&l.q_a, &l.kv_a, &l.q_b, &l.kv_b, &l.o])
                .collect(),
        ),
        (
            "expert gate/up",
            built
                .iter()
                .skip(1)
                .flat_map(|l| l.up_gate.iter())
                .collect(),
        ),
        (
            "expert down",
            built.iter().skip(1).flat_map(|l| l.down.iter()).collect(),
        ),
    ];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    pool.install(|| {
        for (name, ms) in &kinds {
            if ms.is_empty() {
                continue;
            }
            let b: usize = ms.iter().map(|m| m.storage_bytes()).sum();
            let t = best_time(|| group(ms, &x));
            println!(
                "threads {threads}: {name}: {:.1} MB in one region, {:.2} ms ({:.1} GB/s)",
                b as f64 / 1e6,
                t * 1e3,
                b as f64 / t / 1e9
            );
        }
    });
    std::hint::black_box(&out);
}

/// The products `ws` (one token each, `x` cut to each width) in one parallel region, as the
/// model issues an MoE layer's experts (`Matrix::matmul_group`).
fn group(ws: &[&Matrix], x: &[f32]) {
    let mut outs: Vec<Vec<f32>> = ws.iter().map(|m| vec![0.0f32; m.rows()]).collect();
    let mut jobs: Vec<MatmulJob> = ws
        .iter()
        .zip(outs.iter_mut())
        .map(|(w, o)| MatmulJob {
            w,
            x: &x[..w.cols()],
            n_tokens: 1,
            out: o,
        })
        .collect();
    Matrix::matmul_group(&mut jobs);
    std::hint::black_box(&outs);
}
