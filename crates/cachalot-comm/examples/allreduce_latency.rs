//! Round-trip time of one all-reduce of N f32 over a loopback TCP group of 2 ranks (threads):
//! `cargo run --release -p cachalot-comm --example allreduce_latency [N] [ITERS]`.
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let n = args.first().copied().unwrap_or(2048);
    let iters = args.get(1).copied().unwrap_or(5000);
    let times = cachalot_comm::run_local_group(2, |comm| {
        let mut buf = vec![1.0f32; n];
        let t = Instant::now();
        for _ in 0..iters {
            comm.all_reduce_sum(&mut buf).unwrap();
        }
        t.elapsed().as_secs_f64() / iters as f64
    })
    .unwrap();
    println!("{n} values: {:.1} µs per all-reduce", times[0] * 1e6);
}
