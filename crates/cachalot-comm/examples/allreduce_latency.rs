//! Time of one all-reduce of N f32 over a group of 2 ranks (threads of this process), over
//! loopback TCP and over shared memory:
//! `cargo run --release -p cachalot-comm --example allreduce_latency [N] [ITERS]`.
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let n = args.first().copied().unwrap_or(2048);
    let iters = args.get(1).copied().unwrap_or(5000);
    for shm in [false, true] {
        let comms = cachalot_comm::local_group(2, Duration::from_secs(10)).unwrap();
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let comm = cachalot_comm::share_memory(c, shm).unwrap();
                    let mut buf = vec![1.0f32; n];
                    let t = Instant::now();
                    for _ in 0..iters {
                        comm.all_reduce_sum(&mut buf).unwrap();
                    }
                    (comm.transport(), t.elapsed().as_secs_f64() / iters as f64)
                })
            })
            .collect();
        let (transport, s) = hs.into_iter().map(|h| h.join().unwrap()).next().unwrap();
        println!(
            "{n} values over {transport}: {:.1} µs per all-reduce",
            s * 1e6
        );
    }
}
