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
        self.shape.iter().product()
    }
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
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
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
        let want = shape.iter().product::<usize>() as u64 * size as u64;
        if offsets[1] < offsets[0] || offsets[1] - offsets[0] != want {
            return Err(bad(format!(
                "tensor {name}: data_offsets {offsets:?} hold {} bytes; {dtype} {shape:?} needs \
                 {want}",
                offsets[1].saturating_sub(offsets[0])
            )));
        }
        let (start, end) = (data_start + offsets[0], data_start + offsets[1]);
        if end > file_len {
            return Err(bad(format!(
                "tensor {name} ends at byte {end} but the file is {file_len} bytes (truncated?)"
            )));
        }
        out.push((
            name,
            TensorInfo {
                dtype,
                shape,
                start,
                end,
            },
        ));
    }
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
