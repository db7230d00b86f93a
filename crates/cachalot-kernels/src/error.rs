//! Errors from the constructors of this crate ([`crate::Bytes`], [`crate::Matrix`]).
//!
//! The kernels themselves do not fail: once a [`crate::Matrix`] exists its geometry is known to
//! be consistent, and a slice-length mismatch in a `matmul*` call is a programmer error (an
//! `assert!` with a message). The messages here say what is inconsistent; the caller (the model
//! loader) adds which tensor and which file.

/// What was wrong with the inputs given to a constructor.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// A byte window that does not fit inside its owner.
    #[error(
        "byte window {start}..{start}+{len} is outside its owner of {owner_len} bytes \
         (check the tensor's data offsets)"
    )]
    WindowOutOfBounds {
        start: usize,
        len: usize,
        owner_len: usize,
    },
    /// A matrix dimension of zero (almost surely a shape read from the wrong place).
    #[error(
        "a {format} matrix of {rows}x{cols} has a zero dimension; expected rows > 0 and cols > 0"
    )]
    ZeroDimension {
        format: &'static str,
        rows: usize,
        cols: usize,
    },
    /// rows x cols x bytes-per-element does not fit in `usize`.
    #[error("a {format} matrix of {rows}x{cols} is too large to address")]
    ShapeOverflow {
        format: &'static str,
        rows: usize,
        cols: usize,
    },
    /// The weight bytes do not match the shape and format.
    #[error(
        "a {format} matrix of {rows}x{cols} needs {expected} bytes of weights, got {actual} \
         (wrong dtype or shape?)"
    )]
    ByteLength {
        format: &'static str,
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    /// A block size of zero for a block-scaled format.
    #[error("{format} block size must be positive, got {block_rows}x{block_cols}")]
    ZeroBlockSize {
        format: &'static str,
        block_rows: usize,
        block_cols: usize,
    },
    /// The number of scales does not match the scale grid implied by the shape.
    #[error("a {format} matrix of {rows}x{cols} needs {expected} scales ({grid}), got {actual}")]
    ScaleCount {
        format: &'static str,
        rows: usize,
        cols: usize,
        /// How the expected count is derived, e.g. "a 2x3 grid of 128x128 blocks".
        grid: String,
        expected: usize,
        actual: usize,
    },
    /// An int4 matrix whose rows or groups would split a byte.
    #[error(
        "an int4_group matrix of {rows}x{cols} with groups of {group_size} columns: cols and \
         the group size must be even and positive (two columns per byte)"
    )]
    Int4Layout {
        rows: usize,
        cols: usize,
        group_size: usize,
    },
    /// A row or column slice ([`crate::Matrix::slice_rows`], [`crate::Matrix::slice_cols`])
    /// outside the matrix, or one its format cannot cut.
    #[error("a {format} matrix of {rows}x{cols} cannot be sliced at {detail}")]
    BadSlice {
        format: &'static str,
        rows: usize,
        cols: usize,
        detail: String,
    },
    /// A scale that is NaN or infinite (it would silently poison every output it touches).
    #[error("{format} scale #{index} is {value}, expected a finite number")]
    NonFiniteScale {
        format: &'static str,
        index: usize,
        value: f32,
    },
    /// A packed 4-bit format whose rows would split a byte.
    #[error("a {format} matrix of {rows}x{cols}: cols must be even (two columns per byte)")]
    OddPackedCols {
        format: &'static str,
        rows: usize,
        cols: usize,
    },
    /// An E8M0 scale byte that is NaN (255) or too large for the kernels.
    #[error(
        "{format} E8M0 scale byte #{index} is {byte}; expected at most {limit} (255 is NaN; \
         larger scales overflow the kernels)"
    )]
    E8m0Scale {
        format: &'static str,
        index: usize,
        byte: u8,
        limit: u8,
    },
    /// A `u64` scale tensor that is not the V4 INT4 layout.
    #[error("INT4 u64 scales: {why}")]
    U64Scales { why: String },
}
