//! Just enough of the safetensors format to read a shard's header without mapping it and to
//! write a shard whose header is known before its data: 8-byte little-endian header length,
//! the JSON header (`__metadata__` plus `{dtype, shape, data_offsets}` per tensor, offsets
//! relative to the data section, contiguous), padded with spaces to a multiple of 8.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use serde_json::{json, Map, Value};

use crate::ConvertError;

/// One tensor of a shard's header.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub start: u64,
    pub end: u64,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        // Cannot overflow: [`read_header`] checked numel · dtype size against the file.
        self.shape.iter().product()
    }
}

/// The element count of `shape`, or `None` when it overflows `usize`.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// The safetensors format lays the tensors out back to back: together they cover the data
/// section exactly, with neither overlaps nor holes (what the `safetensors` crate, and so the
/// runtime's loader, require too). `tensors` have been checked to lie within the data section.
fn check_coverage(
    tensors: &[(String, TensorInfo)],
    data_start: u64,
    data_len: u64,
) -> Result<(), String> {
    let mut by_start: Vec<&(String, TensorInfo)> = tensors.iter().collect();
    by_start.sort_by_key(|(_, t)| (t.start, t.end));
    let rel = |t: &TensorInfo| [t.start - data_start, t.end - data_start];
    let mut covered = 0u64;
    let mut prev: Option<&(String, TensorInfo)> = None;
    for cur in by_start {
        let (name, t) = cur;
        let [begin, end] = rel(t);
        if begin < covered {
            let (pname, pt) = prev.expect("covered > 0 only after a tensor");
            return Err(format!(
                "tensor {name}: data_offsets {:?} overlap those of tensor {pname} {:?}; tensors \
                 must not share bytes, the header is corrupt (re-download or re-export the shard)",
                [begin, end],
                rel(pt)
            ));
        }
        if begin > covered {
            return Err(format!(
                "tensor {name}: data_offsets {:?} leave bytes {covered}..{begin} of the data \
                 section to no tensor; safetensors data is contiguous, the header is corrupt \
                 (re-download or re-export the shard)",
                [begin, end]
            ));
        }
        covered = end;
        prev = Some(cur);
    }
    if covered != data_len {
        return Err(format!(
            "the data section is {data_len} bytes but its tensors end at byte {covered}; {} \
             trailing bytes belong to no tensor (a corrupt header or data appended to the file; \
             re-download or re-export the shard)",
            data_len - covered
        ));
    }
    Ok(())
}

/// Bytes per element of a safetensors dtype name.
pub fn dtype_size(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => 1,
        "BF16" | "F16" | "I16" | "U16" => 2,
        "F32" | "I32" | "U32" => 4,
        "F64" | "I64" | "U64" => 8,
        _ => return None,
    })
}

/// The tensors of a shard, in header order, checked against the file's length.
pub fn read_header(path: &Path) -> Result<Vec<(String, TensorInfo)>, ConvertError> {
    let bad = |why: String| ConvertError::Shard {
        file: path.to_path_buf(),
        why,
    };
    let mut f = File::open(path).map_err(|e| ConvertError::io(path, e))?;
    let file_len = f.metadata().map_err(|e| ConvertError::io(path, e))?.len();
    let mut len8 = [0u8; 8];
    f.read_exact(&mut len8).map_err(|_| {
        bad(format!(
            "is {file_len} bytes, too short for a safetensors header"
        ))
    })?;
    let header_len = u64::from_le_bytes(len8);
    if header_len > file_len.saturating_sub(8) || header_len > 100 << 20 {
        return Err(bad(format!(
            "declares a {header_len}-byte header but the file is {file_len} bytes (truncated or \
             not safetensors)"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header)
        .map_err(|e| ConvertError::io(path, e))?;
    let value: Value = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("has a header that is not JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(bad("has a header that is not a JSON object".into()));
    };
    let data_start = 8 + header_len;
    // The data section: every byte after the header (the header fits in the file, checked above).
    let data_len = file_len - data_start;
    let mut out = Vec::new();
    for (name, v) in map {
        if name == "__metadata__" {
            continue;
        }
        let field = |k: &str| v.get(k);
        let dtype = field("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("tensor {name}: no dtype in the header")))?
            .to_string();
        let shape: Vec<usize> = field("shape")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect()
            })
            .ok_or_else(|| bad(format!("tensor {name}: no valid shape in the header")))?;
        let offsets: Vec<u64> = field("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect())
            .filter(|o: &Vec<u64>| o.len() == 2)
            .ok_or_else(|| {
                bad(format!(
                    "tensor {name}: no valid data_offsets in the header"
                ))
            })?;
        let size = dtype_size(&dtype)
            .ok_or_else(|| bad(format!("tensor {name}: unknown dtype {dtype}")))?;
        // Checked: a bogus shape must not wrap to a small (or zero) byte count.
        let want = checked_numel(&shape)
            .and_then(|n| n.checked_mul(size))
            .and_then(|b| u64::try_from(b).ok())
            .ok_or_else(|| {
                bad(format!(
                    "tensor {name}: shape {shape:?} × {size} bytes ({dtype}) overflows; the \
                     header is corrupt (re-download or re-export the shard)"
                ))
            })?;
        let (begin, end) = (offsets[0], offsets[1]);
        if end < begin {
            return Err(bad(format!(
                "tensor {name}: data_offsets [{begin}, {end}] end before they begin; the header \
                 is corrupt (re-download or re-export the shard)"
            )));
        }
        if end - begin != want {
            return Err(bad(format!(
                "tensor {name}: data_offsets [{begin}, {end}] hold {} bytes, its shape \
                 {shape:?} of {dtype} needs {want}; the header is corrupt (re-download or \
                 re-export the shard)",
                end - begin
            )));
        }
        if end > data_len {
            return Err(bad(format!(
                "tensor {name}: data_offsets [{begin}, {end}]: end {end} is past the file's data \
                 section of {data_len} bytes (truncated? re-download the shard)"
            )));
        }
        out.push((
            name,
            TensorInfo {
                dtype,
                shape,
                start: data_start + begin,
                end: data_start + end,
            },
        ));
    }
    check_coverage(&out, data_start, data_len).map_err(bad)?;
    Ok(out)
}

/// An output tensor's place in a shard being written.
#[derive(Clone, Debug)]
pub struct OutTensor {
    pub name: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    /// Absolute byte offset in the output file (set by [`layout`]).
    pub offset: u64,
}

impl OutTensor {
    pub fn bytes(&self) -> u64 {
        (self.shape.iter().product::<usize>() * dtype_size(self.dtype).unwrap_or(1)) as u64
    }
}

/// Orders the tensors as the Python `safetensors` writer does (larger element size first, then
/// by name, which keeps every tensor aligned), assigns their offsets, and returns the padded
/// header bytes (length prefix included) and the file's total length.
pub fn layout(tensors: &mut [OutTensor]) -> (Vec<u8>, u64) {
    tensors.sort_by(|a, b| {
        let (sa, sb) = (dtype_size(a.dtype), dtype_size(b.dtype));
        sb.cmp(&sa).then_with(|| a.name.cmp(&b.name))
    });
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut pos = 0u64;
    for t in tensors.iter() {
        let n = t.bytes();
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [pos, pos + n]}),
        );
        pos += n;
    }
    let mut text = serde_json::to_vec(&Value::Object(header)).expect("a JSON map serializes");
    while !(text.len() + 8).is_multiple_of(8) {
        text.push(b' ');
    }
    let data_start = 8 + text.len() as u64;
    let mut offset = data_start;
    for t in tensors.iter_mut() {
        t.offset = offset;
        offset += t.bytes();
    }
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&text);
    (bytes, offset)
}
