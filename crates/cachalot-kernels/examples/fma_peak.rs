//! The CPU's f32 multiply-add ceiling, one thread: twelve independent FMA chains (enough to
//! cover the FMA latency on both pipes) at 8 lanes (AVX2) and, where the CPU has it, 16 lanes
//! (AVX-512). A product kernel's GFLOP/s (`matmul_throughput`) divided by this is its share of
//! the arithmetic ceiling; docs/PERF.md uses it to bound what batching can gain on a model whose
//! weights sit in cache.
//!
//!     cargo run -p cachalot-kernels --release --example fma_peak

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::time::Instant;
    const ITERS: u64 = 100_000_000;
    const CHAINS: usize = 12;
    if !is_x86_feature_detected!("fma") {
        println!("no FMA on this CPU");
        return;
    }
    let t = Instant::now();
    // SAFETY: the CPU has AVX2 + FMA (checked above for FMA; FMA CPUs have AVX2).
    let s = unsafe { chains256(ITERS) };
    let dt = t.elapsed().as_secs_f64();
    println!(
        "ymm (8 lanes): {:.1} GFLOP/s ({s:.3e})",
        (ITERS * CHAINS as u64 * 16) as f64 / dt / 1e9
    );
    if is_x86_feature_detected!("avx512f") {
        let t = Instant::now();
        // SAFETY: AVX-512 F checked.
        let s = unsafe { chains512(ITERS) };
        let dt = t.elapsed().as_secs_f64();
        println!(
            "zmm (16 lanes): {:.1} GFLOP/s ({s:.3e})",
            (ITERS * CHAINS as u64 * 32) as f64 / dt / 1e9
        );
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn chains256(iters: u64) -> f32 {
        use std::arch::x86_64::*;
        let (b, c) = (_mm256_set1_ps(1.000_000_1), _mm256_set1_ps(1e-9));
        let mut a: [__m256; CHAINS] = std::array::from_fn(|i| _mm256_set1_ps(i as f32));
        for _ in 0..iters {
            for v in a.iter_mut() {
                *v = _mm256_fmadd_ps(*v, b, c);
            }
        }
        let mut out = [0.0f32; 8];
        let mut s = _mm256_setzero_ps();
        for v in a {
            s = _mm256_add_ps(s, v);
        }
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum()
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn chains512(iters: u64) -> f32 {
        use std::arch::x86_64::*;
        let (b, c) = (_mm512_set1_ps(1.000_000_1), _mm512_set1_ps(1e-9));
        let mut a: [__m512; CHAINS] = std::array::from_fn(|i| _mm512_set1_ps(i as f32));
        for _ in 0..iters {
            for v in a.iter_mut() {
                *v = _mm512_fmadd_ps(*v, b, c);
            }
        }
        let mut s = _mm512_setzero_ps();
        for v in a {
            s = _mm512_add_ps(s, v);
        }
        _mm512_reduce_add_ps(s)
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("fma_peak measures x86-64 FMA units only");
}
