//! Row and column slices of a [`Matrix`] in its stored format, for tensor parallelism (spec
//! `deepseek-v3-r1-kimi-k2.md` §2.4: each rank holds a share of a Linear's output rows — column
//! parallel — or of its input columns — row parallel).
//!
//! A slice holds exactly the values of the whole matrix at those positions: a row slice is a
//! window into the same bytes (no copy), a column slice copies each row's part. Scales follow
//! their values. Where a slice starts inside an FP8 scale block (or an int4 group), the slice's
//! block (group) is made finer — the greatest common divisor of the block and the offset — and
//! the scale repeated, so every value keeps its own scale. The MX formats' 32-column groups are
//! fixed, so their column slices start on a multiple of 32; packed int4/fp4 column slices start
//! and end on even columns (two per byte).
//!
//! A row slice's products are the whole matrix's rows bit for bit (a row's sum does not depend
//! on the other rows); a column slice's partial products sum, over the slices, to the whole
//! product up to rounding.

use std::ops::Range;

use super::{data_bytes_of, format_of, name_of, Format, Matrix, MatrixData};
use crate::bytes::Bytes;
use crate::mx::MX_BLOCK;
use crate::KernelError;

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The finer block for a slice starting at `start` inside blocks of `block`.
fn finer(block: usize, start: usize) -> usize {
    if start == 0 {
        block
    } else {
        gcd(block, start)
    }
}

impl Matrix {
    fn slice_error(&self, what: &str, range: &Range<usize>, why: String) -> KernelError {
        KernelError::BadSlice {
            format: name_of(&self.data),
            rows: self.rows,
            cols: self.cols,
            detail: format!("{what} {}..{}: {why}", range.start, range.end),
        }
    }

    fn check_range(&self, what: &str, range: &Range<usize>, len: usize) -> Result<(), KernelError> {
        if range.start >= range.end || range.end > len {
            return Err(self.slice_error(
                what,
                range,
                format!("not a non-empty range inside 0..{len}"),
            ));
        }
        Ok(())
    }

    /// Rows `range` (output features) of this matrix, its bytes shared with it.
    pub fn slice_rows(&self, range: Range<usize>) -> Result<Matrix, KernelError> {
        self.check_range("rows", &range, self.rows)?;
        let (a, n, cols) = (range.start, range.len(), self.cols);
        let row_bytes = format_of(&self.data)
            .data_bytes(1, cols)
            .expect("a valid matrix's row fits");
        let window = |b: &Bytes| b.window(a * row_bytes, n * row_bytes);
        let data = match &self.data {
            MatrixData::F32(b) => MatrixData::F32(window(b)?),
            MatrixData::Bf16(b) => MatrixData::Bf16(window(b)?),
            MatrixData::Bf16Dot(b) => MatrixData::Bf16Dot(window(b)?),
            MatrixData::F16(b) => MatrixData::F16(window(b)?),
            MatrixData::Fp8Block {
                data,
                scale_inv,
                block_rows,
                block_cols,
            } => {
                let br = finer(*block_rows, a);
                let gc = cols.div_ceil(*block_cols);
                let mut scales = Vec::with_capacity(n.div_ceil(br) * gc);
                for i in 0..n.div_ceil(br) {
                    let src = (a + i * br) / block_rows;
                    scales.extend_from_slice(&scale_inv[src * gc..(src + 1) * gc]);
                }
                MatrixData::Fp8Block {
                    data: window(data)?,
                    scale_inv: scales,
                    block_rows: br,
                    block_cols: *block_cols,
                }
            }
            MatrixData::Int8Row { data, scale } => MatrixData::Int8Row {
                data: window(data)?,
                scale: scale[range.clone()].to_vec(),
            },
            MatrixData::W8A8 { data, scale } => MatrixData::W8A8 {
                data: window(data)?,
                scale: scale[range.clone()].to_vec(),
            },
            MatrixData::W4A8 { data, scale } => MatrixData::W4A8 {
                data: window(data)?,
                scale: scale[range.clone()].to_vec(),
            },
            MatrixData::Hif8 { data, scale } => MatrixData::Hif8 {
                data: window(data)?,
                scale: scale[range.clone()].to_vec(),
            },
            MatrixData::Int4Group {
                data,
                scale,
                group_size,
            } => {
                let g = cols.div_ceil(*group_size);
                MatrixData::Int4Group {
                    data: window(data)?,
                    scale: scale[a * g..(a + n) * g].to_vec(),
                    group_size: *group_size,
                }
            }
            MatrixData::Mxfp4 { data, scale } | MatrixData::Mxfp8 { data, scale } => {
                let g = cols.div_ceil(MX_BLOCK);
                let scale = scale.window(a * g, n * g)?;
                let data = window(data)?;
                if matches!(self.data, MatrixData::Mxfp4 { .. }) {
                    MatrixData::Mxfp4 { data, scale }
                } else {
                    MatrixData::Mxfp8 { data, scale }
                }
            }
        };
        Matrix::new(n, cols, data)
    }

    /// Columns `range` (input features) of this matrix, copied.
    pub fn slice_cols(&self, range: Range<usize>) -> Result<Matrix, KernelError> {
        self.check_range("columns", &range, self.cols)?;
        let (a, m, rows, cols) = (range.start, range.len(), self.rows, self.cols);
        let format = format_of(&self.data);
        let packed = matches!(format, Format::Int4 | Format::Fp4);
        if packed && (a % 2 != 0 || m % 2 != 0) {
            return Err(self.slice_error(
                "columns",
                &range,
                "packed 4-bit columns come two per byte: start and length must be even".into(),
            ));
        }
        if matches!(format, Format::Fp4 | Format::Mxfp8) && a % MX_BLOCK != 0 {
            return Err(self.slice_error(
                "columns",
                &range,
                format!("MX scales cover {MX_BLOCK} columns: the start must be a multiple of {MX_BLOCK}"),
            ));
        }
        // Bytes of each row's part: (offset in the row, length), and the row's length.
        let (off, len, row_len) = if packed {
            (a / 2, m / 2, cols / 2)
        } else {
            let es = format.data_bytes(1, 1).expect("one element");
            (a * es, m * es, cols * es)
        };
        let src = data_bytes_of(&self.data).as_slice();
        let mut bytes = Vec::with_capacity(rows * len);
        for r in 0..rows {
            bytes.extend_from_slice(&src[r * row_len + off..r * row_len + off + len]);
        }
        let bytes = Bytes::from_vec(bytes);
        let data = match &self.data {
            MatrixData::F32(_) => MatrixData::F32(bytes),
            MatrixData::Bf16(_) => MatrixData::Bf16(bytes),
            MatrixData::Bf16Dot(_) => MatrixData::Bf16Dot(bytes),
            MatrixData::F16(_) => MatrixData::F16(bytes),
            MatrixData::Fp8Block {
                scale_inv,
                block_rows,
                block_cols,
                ..
            } => {
                let bc = finer(*block_cols, a);
                let (gr, gc, gc_new) = (
                    rows.div_ceil(*block_rows),
                    cols.div_ceil(*block_cols),
                    m.div_ceil(bc),
                );
                let mut scales = Vec::with_capacity(gr * gc_new);
                for i in 0..gr {
                    for j in 0..gc_new {
                        scales.push(scale_inv[i * gc + (a + j * bc) / block_cols]);
                    }
                }
                MatrixData::Fp8Block {
                    data: bytes,
                    scale_inv: scales,
                    block_rows: *block_rows,
                    block_cols: bc,
                }
            }
            MatrixData::Int8Row { scale, .. } => MatrixData::Int8Row {
                data: bytes,
                scale: scale.clone(),
            },
            MatrixData::W8A8 { scale, .. } => MatrixData::W8A8 {
                data: bytes,
                scale: scale.clone(),
            },
            MatrixData::W4A8 { scale, .. } => MatrixData::W4A8 {
                data: bytes,
                scale: scale.clone(),
            },
            MatrixData::Hif8 { scale, .. } => MatrixData::Hif8 {
                data: bytes,
                scale: scale.clone(),
            },
            MatrixData::Int4Group {
                scale, group_size, ..
            } => {
                let gs = finer(*group_size, a);
                let (g, g_new) = (cols.div_ceil(*group_size), m.div_ceil(gs));
                let mut scales = Vec::with_capacity(rows * g_new);
                for r in 0..rows {
                    for j in 0..g_new {
                        scales.push(scale[r * g + (a + j * gs) / group_size]);
                    }
                }
                MatrixData::Int4Group {
                    data: bytes,
                    scale: scales,
                    group_size: gs,
                }
            }
            MatrixData::Mxfp4 { scale, .. } | MatrixData::Mxfp8 { scale, .. } => {
                let (g, first, g_new) =
                    (cols.div_ceil(MX_BLOCK), a / MX_BLOCK, m.div_ceil(MX_BLOCK));
                let s = scale.as_slice();
                let mut scales = Vec::with_capacity(rows * g_new);
                for r in 0..rows {
                    scales.extend_from_slice(&s[r * g + first..r * g + first + g_new]);
                }
                let scale = Bytes::from_vec(scales);
                if matches!(self.data, MatrixData::Mxfp4 { .. }) {
                    MatrixData::Mxfp4 { data: bytes, scale }
                } else {
                    MatrixData::Mxfp8 { data: bytes, scale }
                }
            }
        };
        Matrix::new(rows, m, data)
    }
}
