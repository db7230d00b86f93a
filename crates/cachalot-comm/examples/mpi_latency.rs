//! Time of one all-reduce of N f32 over the ranks of an MPI job (the `mpi` feature), to set
//! beside `allreduce_latency`'s TCP and shared-memory figures:
//! `cargo build --release -p cachalot-comm --features mpi --example mpi_latency` then
//! `mpirun -n 2 target/release/examples/mpi_latency [N] [ITERS]`. Rank 0 prints.
use std::time::Instant;

use cachalot_comm::Communicator;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("N and ITERS are counts"))
        .collect();
    let iters = args.get(1).copied().unwrap_or(5000);
    let comm = cachalot_comm::mpi::world().expect("start MPI");
    let sizes = match args.first() {
        Some(&n) => vec![n],
        None => vec![16, 2048],
    };
    for n in sizes {
        let mut buf = vec![1.0f32; n];
        comm.barrier().unwrap();
        let t = Instant::now();
        for _ in 0..iters {
            comm.all_reduce_sum(&mut buf).unwrap();
        }
        let s = t.elapsed().as_secs_f64() / iters as f64;
        if comm.rank() == 0 {
            println!(
                "{n} values over {} ranks ({}): {:.1} µs per all-reduce",
                comm.world_size(),
                comm.transport(),
                s * 1e6
            );
        }
    }
    cachalot_comm::mpi::finish(true);
}
