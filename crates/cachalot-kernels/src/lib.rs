//! cachalot's numeric library: number formats, weight matrices in their stored formats and
//! their products with f32 activations, and the vector kernels of the DeepSeek-V3/R1 forward
//! pass (spec `shared/specs/deepseek-v3-r1-kimi-k2.md`: §2.2 FP8 e4m3fn and 128×128 block
//! scales, §2.3 Kimi-K2-Thinking's int4 groups, §3 forward math, §4 quantized execution, §5.2
//! the int8 per-row layout).
//!
//! - [`Bytes`]: weight storage, owned or a window into an mmap'd shard (unaligned, LE).
//! - [`fp8`], [`bf16_to_f32`] / [`f32_to_bf16`], [`f16_to_f32`] / [`f32_to_f16`]: scalar formats.
//! - [`Matrix`] over [`MatrixData`]: `matmul`, `matmul_rows`, `matmul_t_rows` (MLA
//!   absorption), `row_to_f32` (embeddings), `to_f32_vec` / `to_f32_matrix`.
//! - Vector kernels: [`dot`], [`axpy`], [`scale_in_place`], [`rms_norm`], [`rms_norm_rows`],
//!   [`silu_mul`], [`softmax_in_place`], [`log_softmax_at`], [`argmax`],
//!   [`rope_deinterleave_in_place`].
//!
//! It knows nothing of models or requests. Every SIMD kernel has a scalar twin; the level is
//! detected once per process ([`simd_level`]: AVX-512, AVX2 or scalar, capped with
//! `CACHALOT_SIMD=avx2` or `scalar`).
//!
//! Errors: constructors validate and return [`KernelError`]. Kernels do not fail; a slice of
//! the wrong length is a programmer error and panics with a message.

mod bytes;
mod error;
mod float16;
pub mod fp8;
pub mod hif8;
pub mod int4;
pub mod int8;
mod matrix;
pub mod mx;
mod parallel;
mod simd;
mod vector;

pub use bytes::{
    f32s_to_le_bytes, first_non_finite, shard_file_problem, u16s_to_le_bytes, ByteOwner, Bytes,
    StoredFloat,
};
pub use error::KernelError;
pub use float16::{bf16_round, bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
pub use matrix::{MatmulJob, Matrix, MatrixData};
pub use parallel::{serial, KeepWarm};
pub use simd::{kernel_isa, simd_level, SimdLevel};
pub use vector::{
    argmax, axpy, axpy_rows, axpy_rows_bf16, axpy_rows_many, dot, dot_rows, dot_rows_bf16,
    dot_rows_lanes, dot_rows_many, log_softmax_at, rms_norm, rms_norm_rows,
    rope_deinterleave_in_place, scale_in_place, silu_mul, softmax_in_place, softmax_in_place_stats,
    HeadLanes, HeadPairs,
};
