//! Time of one all-to-all over a loopback TCP group of RANKS ranks (threads of this process),
//! each part BYTES long, with every pair linked (the default) or through rank 0
//! (`CACHALOT_TCP_LINKS=0`):
//! `cargo run --release -p cachalot-comm --example all_to_all_links [RANKS] [BYTES] [ITERS]`.
use std::time::{Duration, Instant};

use cachalot_comm::Communicator;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let ranks = args.first().copied().unwrap_or(4);
    let bytes = args.get(1).copied().unwrap_or(2 << 20);
    let iters = args.get(2).copied().unwrap_or(20);
    let comms = cachalot_comm::local_group(ranks, Duration::from_secs(30)).unwrap();
    let pairwise = comms.iter().all(|c| c.pairwise());
    let t = Instant::now();
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let parts: Vec<Vec<u8>> = (0..ranks).map(|_| vec![1u8; bytes]).collect();
                for _ in 0..iters {
                    c.all_to_all(&parts).unwrap();
                }
            });
        }
    });
    let each = t.elapsed().as_secs_f64() / iters as f64;
    println!(
        "{ranks} ranks, parts of {bytes} B, {}: {:.1} µs per all-to-all",
        if pairwise {
            "pairwise links"
        } else {
            "through rank 0"
        },
        each * 1e6
    );
}
