//! Safetensors checkpoints: one `model.safetensors`, or `model.safetensors.index.json` + shards.
//!
//! Spec: `shared/specs/deepseek-v3-r1-kimi-k2.md` §2 (tensor inventory, FP8 + `weight_scale_inv`
//! block scales, possibly in another shard; the W8A8 layout of §5). Shards are mmap'd and tensors
//! are windows into the maps: nothing is read into RAM twice. Every tensor is accounted for: the
//! model loader `take`s what it uses, and whatever is left at the end is reported by name and
//! file, so a misnamed or stray tensor is an error rather than silently ignored.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cachalot_kernels::Bytes;
use safetensors::tensor::Dtype;
use serde_json::Value;

use crate::error::{ModelError, Result};

struct Shard {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
}

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    shard: usize,
    /// Absolute byte range within the shard file.
    start: usize,
    end: usize,
}

/// A view of one tensor's bytes, tied to its mmap'd shard.
pub struct TensorView {
    pub name: String,
    pub path: PathBuf,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Bytes,
}

impl TensorView {
    pub fn error(&self, message: impl Into<String>) -> ModelError {
        ModelError::Tensor {
            tensor: self.name.clone(),
            path: self.path.clone(),
            message: message.into(),
        }
    }

    /// The values as f32 (for small tensors: norms, biases, scales), from F32, BF16 or F16.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let b = self.bytes.as_slice();
        Ok(match self.dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| cachalot_kernels::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            other => {
                return Err(self.error(format!("has dtype {other:?}; expected F32, BF16 or F16")))
            }
        })
    }

    /// The values as i64 (small integer tensors: tables, shapes), from I64 or I32.
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        let b = self.bytes.as_slice();
        Ok(match self.dtype {
            Dtype::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
            Dtype::I32 => b
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
                .collect(),
            other => return Err(self.error(format!("has dtype {other:?}; expected I64 or I32"))),
        })
    }

    /// [`TensorView::to_f32_vec`] for a tensor whose values must all be finite (norm weights,
    /// biases, routers): a NaN or ±∞ there would spread to every activation, so it is named here.
    pub fn to_finite_f32_vec(&self) -> Result<Vec<f32>> {
        let v = self.to_f32_vec()?;
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(self.error(format!(
                "value #{i} is {}; the checkpoint is damaged (re-download this shard)",
                v[i]
            )));
        }
        Ok(v)
    }

    pub fn expect_shape(&self, shape: &[usize]) -> Result<()> {
        if self.shape == shape {
            Ok(())
        } else {
            Err(self.error(format!(
                "has shape {:?}; the config implies {:?}",
                self.shape, shape
            )))
        }
    }
}

/// An opened checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorInfo>,
    taken: HashSet<String>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut shard_names: Vec<String> = Vec::new();
        let mut index: Option<HashMap<String, String>> = None;
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|source| ModelError::Io {
                path: index_path.clone(),
                error: source,
            })?;
            let v: Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
                path: index_path.clone(),
                message: e.to_string(),
            })?;
            let Some(Value::Object(map)) = v.get("weight_map") else {
                return Err(ModelError::Checkpoint {
                    path: index_path,
                    message: "no `weight_map` object; expected {\"weight_map\": {tensor: file}}"
                        .into(),
                });
            };
            let mut m = HashMap::new();
            for (name, file) in map {
                let Some(file) = file.as_str() else {
                    return Err(ModelError::Checkpoint {
                        path: index_path,
                        message: format!("weight_map entry `{name}` is not a file name"),
                    });
                };
                // Shards live in the model directory (or below it): no absolute paths, no `..`.
                let inside = std::path::Path::new(file).components().all(|c| {
                    matches!(
                        c,
                        std::path::Component::Normal(_) | std::path::Component::CurDir
                    )
                });
                if !inside || file.is_empty() {
                    return Err(ModelError::Checkpoint {
                        path: index_path,
                        message: format!(
                            "weight_map entry `{name}` names the file {file:?}, which is not in \
                             the model directory; shards are file names beside the index"
                        ),
                    });
                }
                if !shard_names.iter().any(|s| s == file) {
                    shard_names.push(file.to_string());
                }
                m.insert(name.clone(), file.to_string());
            }
            shard_names.sort();
            index = Some(m);
        } else if single.symlink_metadata().is_ok() {
            // (Whatever it is: a link to nothing or a FIFO is refused by name below.)
            shard_names.push("model.safetensors".into());
        } else {
            return Err(ModelError::Checkpoint {
                path: dir.to_path_buf(),
                message: "no model.safetensors.index.json and no model.safetensors; \
                          is this a Hugging Face model directory?"
                    .into(),
            });
        }

        let mut shards = Vec::new();
        let mut tensors = BTreeMap::new();
        for (shard_idx, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            if let Some(message) = cachalot_kernels::shard_file_problem(&path) {
                return Err(ModelError::Checkpoint {
                    path: path.clone(),
                    message,
                });
            }
            if !path.exists() {
                // Named by the index (a lone model.safetensors exists): say which entry.
                let tensor = index
                    .iter()
                    .flatten()
                    .filter(|(_, f)| *f == name)
                    .map(|(t, _)| t.as_str())
                    .min()
                    .unwrap_or_default();
                return Err(ModelError::Checkpoint {
                    path: index_path,
                    message: format!(
                        "weight_map names the shard {name} (for `{tensor}`, perhaps among \
                         others), which is not in {}: a shard is missing (download it again) \
                         or the index is wrong",
                        dir.display()
                    ),
                });
            }
            let file = std::fs::File::open(&path).map_err(|source| ModelError::Io {
                path: path.clone(),
                error: source,
            })?;
            // SAFETY: the file is opened read-only and the map is never written; like every
            // mmap-based loader we rely on checkpoint files not being truncated while loaded.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| ModelError::Io {
                path: path.clone(),
                error: source,
            })?;
            let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map[..]).map_err(
                |e| match diagnose_header(&map[..]) {
                    Some((tensor, message)) => ModelError::Tensor {
                        tensor,
                        path: path.clone(),
                        message: format!("{message}; the shard's header is corrupt"),
                    },
                    None => ModelError::Checkpoint {
                        path: path.clone(),
                        message: format!(
                            "not a valid safetensors file ({e}){}; the file may be truncated \
                             or corrupt",
                            data_size_note(&map[..])
                        ),
                    },
                },
            )?;
            let data_start = 8 + header_len;
            for (tname, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                let start = data_start + s;
                let end = data_start + e;
                if end > map.len() {
                    return Err(ModelError::Tensor {
                        tensor: tname,
                        path,
                        message: format!(
                            "data ends at byte {end} but the file has {} bytes (truncated shard)",
                            map.len()
                        ),
                    });
                }
                if let Some(idx) = &index {
                    match idx.get(&tname) {
                        Some(f) if f == name => {}
                        Some(f) => {
                            return Err(ModelError::Tensor {
                                tensor: tname,
                                path,
                                message: format!("the index places it in {f}"),
                            })
                        }
                        None => {
                            return Err(ModelError::Tensor {
                                tensor: tname,
                                path,
                                message: "is not listed in model.safetensors.index.json".into(),
                            })
                        }
                    }
                }
                if let Some(prev) = tensors.insert(
                    tname.clone(),
                    TensorInfo {
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        shard: shard_idx,
                        start,
                        end,
                    },
                ) {
                    return Err(ModelError::Tensor {
                        tensor: tname,
                        path,
                        message: format!("also present in {}", shard_names[prev.shard]),
                    });
                }
            }
            shards.push(Shard {
                path,
                map: Arc::new(map),
            });
        }
        if let Some(idx) = &index {
            let mut missing: Vec<_> = idx.keys().filter(|n| !tensors.contains_key(*n)).collect();
            missing.sort();
            if let Some(first) = missing.first() {
                return Err(ModelError::Tensor {
                    tensor: (*first).clone(),
                    path: dir.join(&idx[*first]),
                    message: format!(
                        "listed in the index but absent from the file{}",
                        match missing.len() {
                            1 => String::new(),
                            n => format!(" ({n} tensors are)"),
                        }
                    ),
                });
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            tensors,
            taken: HashSet::new(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Marks every tensor whose name starts with `prefix` as deliberately unused (another
    /// rank's expert, say): never read, and not reported as left over.
    pub fn skip_prefix(&mut self, prefix: &str) {
        let names: Vec<String> = self.names_with_prefix(prefix).map(str::to_string).collect();
        for n in names {
            self.skip(&n);
        }
    }

    /// The names that start with `prefix`, in order (a range of the sorted index, not a scan).
    pub fn names_with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> {
        self.tensors
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .map(|(k, _)| k.as_str())
            .take_while(move |k| k.starts_with(prefix))
    }

    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.end - t.start).sum()
    }

    /// Every tensor's values are numbers (`--check-tensors`, as llama.cpp's): no NaN or
    /// infinity in BF16/F16/F32 tensors, no NaN code (0x7F, 0xFF) in F8_E4M3 ones, no NaN
    /// scale (255) in F8_E8M0 ones. Reads the whole checkpoint (the tensors in parallel); the
    /// first damaged tensor is named with the element, or Ok.
    pub fn check_values(&self) -> Result<()> {
        use rayon::prelude::*;
        let bad: Option<(String, usize, &'static str)> = self
            .tensors
            .par_iter()
            .filter_map(|(name, info)| {
                let bytes = &self.shards[info.shard].map[info.start..info.end];
                first_non_finite(info.dtype, bytes).map(|i| {
                    let what = match info.dtype {
                        Dtype::F8_E4M3 => "a NaN code",
                        Dtype::F8_E8M0 => "a NaN scale (255)",
                        _ => "a NaN or infinity",
                    };
                    (name.clone(), i, what)
                })
            })
            .min();
        match bad {
            None => Ok(()),
            Some((name, i, what)) => {
                let info = &self.tensors[&name];
                Err(ModelError::Tensor {
                    tensor: name,
                    path: self.shards[info.shard].path.clone(),
                    message: format!(
                        "{what} at element {i} (--check-tensors): the checkpoint is damaged; \
                         re-download this shard"
                    ),
                })
            }
        }
    }

    /// The tensor, marked as used. `expected` describes it for the error if it is missing.
    pub fn take(&mut self, name: &str, expected: &str) -> Result<TensorView> {
        let Some(info) = self.tensors.get(name) else {
            return Err(ModelError::MissingTensor {
                tensor: name.to_string(),
                dir: self.dir.clone(),
                expected: expected.to_string(),
            });
        };
        self.taken.insert(name.to_string());
        let shard = &self.shards[info.shard];
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = shard.map.clone();
        let bytes = Bytes::from_owner(owner, info.start, info.end - info.start)
            .map_err(|e| ModelError::Kernel(e.to_string()))?;
        let elem = dtype_size(info.dtype);
        let numel: usize = info.shape.iter().product();
        let view = TensorView {
            name: name.to_string(),
            path: shard.path.clone(),
            dtype: info.dtype,
            shape: info.shape.clone(),
            bytes,
        };
        if elem.map(|s| s * numel) != Some(info.end - info.start) {
            return Err(view.error(format!(
                "holds {} bytes, which does not match dtype {:?} and shape {:?}",
                info.end - info.start,
                info.dtype,
                info.shape
            )));
        }
        Ok(view)
    }

    /// Marks a tensor as deliberately unused (e.g. `rotary_emb.inv_freq`, or the MTP layer's
    /// copies of the shared embedding and head).
    pub fn skip(&mut self, name: &str) {
        if self.tensors.contains_key(name) {
            self.taken.insert(name.to_string());
        }
    }

    /// Errors on the first tensor no loader took, naming it and its file.
    pub fn ensure_all_used(&self) -> Result<()> {
        let unused: Vec<&String> = self
            .tensors
            .keys()
            .filter(|n| !self.taken.contains(*n))
            .collect();
        if let Some(first) = unused.first() {
            let info = &self.tensors[*first];
            return Err(ModelError::Tensor {
                tensor: (*first).clone(),
                path: self.shards[info.shard].path.clone(),
                message: format!(
                    "is not part of the model this config describes ({} unexpected tensors in \
                     all); check that config.json matches the checkpoint",
                    unused.len()
                ),
            });
        }
        Ok(())
    }
}

/// ": the header describes N bytes, the file holds M" where a readable header's tensors end
/// elsewhere than the file does (a cut file, or bytes after the data); empty otherwise.
fn data_size_note(bytes: &[u8]) -> String {
    let size = || -> Option<usize> {
        let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
        let header: Value = serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
        let end = header
            .as_object()?
            .values()
            .filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64())
            .max()
            .unwrap_or(0) as usize;
        (8 + n).checked_add(end)
    };
    match size() {
        Some(want) if want != bytes.len() => format!(
            ": its header describes {want} bytes, the file holds {}",
            bytes.len()
        ),
        _ => String::new(),
    }
}

/// Which tensor of a safetensors header the `safetensors` crate refused, and why (it says only
/// "invalid shape, data type, or offset"): a JSON header whose entries give a dtype, a shape and
/// `data_offsets` that must cover exactly dtype size × elements, one after another from 0.
fn diagnose_header(bytes: &[u8]) -> Option<(String, String)> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: Value = serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    let mut entries: Vec<(String, usize, usize, usize)> = Vec::new();
    for (name, t) in header.as_object()? {
        if name == "__metadata__" {
            continue;
        }
        let bad = |m: String| Some((name.clone(), m));
        let Some(dtype) = t.get("dtype").and_then(Value::as_str) else {
            return bad("has no dtype".into());
        };
        let Some(size) = serde_json::from_value::<Dtype>(Value::from(dtype))
            .ok()
            .and_then(dtype_size)
        else {
            return bad(format!("has an unknown dtype {dtype:?}"));
        };
        let Some(shape) = t.get("shape").and_then(Value::as_array) else {
            return bad("has no shape".into());
        };
        let dims: Option<Vec<usize>> = shape
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .collect();
        let Some(dims) = dims else {
            return bad(format!(
                "has a shape that is not a list of sizes: {shape:?}"
            ));
        };
        let want = dims.iter().try_fold(size, |acc, &d| acc.checked_mul(d));
        let offs = t.get("data_offsets").and_then(Value::as_array);
        let (Some(s), Some(e)) = (
            offs.and_then(|o| o.first()).and_then(Value::as_u64),
            offs.and_then(|o| o.get(1)).and_then(Value::as_u64),
        ) else {
            return bad("has no data_offsets [start, end]".into());
        };
        let (s, e) = (s as usize, e as usize);
        if e < s {
            return bad(format!("data_offsets [{s}, {e}] end before they start"));
        }
        if want != Some(e - s) {
            return bad(format!(
                "data_offsets [{s}, {e}] hold {} bytes, but a {dtype} tensor of shape {dims:?} \
                 takes {}",
                e - s,
                want.map_or("more than fits".into(), |w| w.to_string())
            ));
        }
        entries.push((name.clone(), s, e, size));
    }
    entries.sort_by_key(|&(_, s, e, _)| (s, e));
    let mut at = 0;
    let mut previous: Option<String> = None;
    for (name, s, e, _) in entries {
        if s != at {
            // Either this tensor's offsets or the one before it moved: both are named.
            let why = match previous {
                None => format!(
                    "data_offsets start at byte {s}, but the data begins at 0 (tensors must \
                     follow one another from the start)"
                ),
                Some(p) => format!(
                    "data_offsets start at byte {s}, but `{p}` ends at {at} (tensors must \
                     follow one another: one of the two has wrong data_offsets)"
                ),
            };
            return Some((name, why));
        }
        at = e;
        previous = Some(name);
    }
    None
}

/// The first element of `bytes` (little-endian values of `dtype`) that is not a number
/// ([`cachalot_kernels::first_non_finite`]); None for dtypes without such values (integers,
/// packed codes).
pub fn first_non_finite(dtype: Dtype, bytes: &[u8]) -> Option<usize> {
    use cachalot_kernels::StoredFloat as S;
    let kind = match dtype {
        Dtype::BF16 => S::Bf16,
        Dtype::F16 => S::F16,
        Dtype::F32 => S::F32,
        Dtype::F8_E4M3 => S::E4m3,
        Dtype::F8_E8M0 => S::E8m0,
        _ => return None,
    };
    cachalot_kernels::first_non_finite(kind, bytes)
}

pub fn dtype_size(d: Dtype) -> Option<usize> {
    Some(match d {
        Dtype::BOOL | Dtype::U8 | Dtype::I8 | Dtype::F8_E4M3 | Dtype::F8_E5M2 | Dtype::F8_E8M0 => 1,
        Dtype::BF16 | Dtype::F16 | Dtype::I16 | Dtype::U16 => 2,
        Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
        Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView as StView;

    /// A header whose tensors do not follow one another names both tensors around the gap.
    #[test]
    fn a_moved_tensor_is_named_with_its_neighbour() {
        let dir = tempfile::tempdir().unwrap();
        let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]},"c":{"dtype":"F32","shape":[1],"data_offsets":[20,24]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[0u8; 24]);
        std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
        let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("`b`") && e.contains("`a` ends at 8"), "{e}");
    }

    /// A shard that is a link to nothing or not a regular file (a FIFO would block the loader
    /// for ever) is refused, naming it.
    #[test]
    fn a_shard_that_is_not_a_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let shard = dir.path().join("model.safetensors");
        std::os::unix::fs::symlink(dir.path().join("blobs/gone"), &shard).unwrap();
        let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(
            e.contains("symbolic link") && e.contains("blobs/gone"),
            "{e}"
        );
        std::fs::remove_file(&shard).unwrap();
        let made = std::process::Command::new("mkfifo").arg(&shard).status();
        if made.is_ok_and(|s| s.success()) {
            let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
            assert!(e.contains("not a regular file"), "{e}");
        }
        std::fs::remove_file(&shard).unwrap();
        std::fs::create_dir(&shard).unwrap();
        let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("is a directory"), "{e}");
    }

    /// `check_values` passes numbers of every float dtype and names the tensor and element of
    /// a NaN or infinity, a NaN FP8 code or a NaN E8M0 scale.
    #[test]
    #[allow(clippy::type_complexity)]
    fn check_values_names_the_first_damaged_tensor() {
        let bf16: Vec<u8> = [1.0f32, -2.5, 0.0, 3.0]
            .iter()
            .flat_map(|&x| cachalot_kernels::f32_to_bf16(x).to_le_bytes())
            .collect();
        let f32s: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        let fp8 = vec![0x38u8, 0xB8, 0x7E, 0x00];
        let e8m0 = vec![127u8, 0, 254];
        let cases: [(&str, Dtype, Vec<usize>, Vec<u8>, usize, Vec<u8>); 4] = [
            (
                "a.bf16",
                Dtype::BF16,
                vec![2, 2],
                bf16,
                4,
                0x7FC0u16.to_le_bytes().to_vec(),
            ),
            (
                "b.f32",
                Dtype::F32,
                vec![2],
                f32s,
                4,
                f32::INFINITY.to_le_bytes().to_vec(),
            ),
            ("c.fp8", Dtype::F8_E4M3, vec![4], fp8, 3, vec![0xFF]),
            ("d.scale", Dtype::F8_E8M0, vec![3], e8m0, 1, vec![255]),
        ];
        let write = |tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]| {
            let dir = tempfile::tempdir().unwrap();
            let views: Vec<(String, StView)> = tensors
                .iter()
                .map(|(n, d, s, b)| (n.to_string(), StView::new(*d, s.clone(), b).unwrap()))
                .collect();
            safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors"))
                .unwrap();
            dir
        };
        let good: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = cases
            .iter()
            .map(|(n, d, s, b, ..)| (*n, *d, s.clone(), b.clone()))
            .collect();
        let dir = write(&good);
        Checkpoint::open(dir.path())
            .unwrap()
            .check_values()
            .unwrap();
        for (k, (name, _, _, bytes, at, bad)) in cases.iter().enumerate() {
            let mut damaged = good.clone();
            // The last element of the tensor (`at` bytes from its end) made bad.
            let b = &mut damaged[k].3;
            let start = bytes.len() - at;
            b[start..start + bad.len()].copy_from_slice(bad);
            let dir = write(&damaged);
            let e = Checkpoint::open(dir.path())
                .unwrap()
                .check_values()
                .unwrap_err()
                .to_string();
            let elem = start / (bytes.len() / cases[k].2.iter().product::<usize>());
            assert!(
                e.contains(name) && e.contains(&format!("element {elem}")),
                "{name}: {e}"
            );
        }
    }
}
