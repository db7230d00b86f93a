//! Timing shared by the kernel examples (`#[path]`-included; not an example of its own).

use std::time::Instant;

/// The fastest per-call time over 5 rounds of at least 0.1 s each (after a warm-up call): the
/// least disturbed by other work on a shared machine.
pub fn best_time(mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        let mut calls = 0u32;
        while start.elapsed().as_secs_f64() < 0.1 {
            f();
            calls += 1;
        }
        best = best.min(start.elapsed().as_secs_f64() / calls as f64);
    }
    best
}
