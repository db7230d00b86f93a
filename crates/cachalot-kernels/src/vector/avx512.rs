//! AVX-512 twins of the latent-attention kernels (`dot_rows_lanes`, `axpy_rows_many`, written
//! once in `vector::latent` for any width), which dominate absorbed MLA decode once the
//! context is a few hundred positions long. Both are
//! bit-identical to their AVX2 and scalar twins, because neither sum depends on the vector
//! width: `dot_rows_many` holds heads in lanes (each (row, head) sum is one FMA chain over the
//! columns in order), and `axpy_rows_many` gives every output element its rows' FMAs in row
//! order whatever the number of columns a vector covers.
//!
//! Callers guarantee `SimdLevel::Avx512.supported()` and consistent lengths (checked by the
//! dispatching wrappers in `vector/mod.rs`). Spec: `deepseek-v3-r1-kimi-k2.md` §3.4 (absorbed
//! MLA decode: MQA over the latent cache).

use std::arch::x86_64::*;

crate::vector::latent::latent_kernels!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    __m512,
    16,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    _mm512_storeu_ps,
    _mm512_fmadd_ps,
    _mm512_set1_ps
);
