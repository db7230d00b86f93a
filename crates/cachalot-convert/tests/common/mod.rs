//! Helpers shared by the converter's integration tests.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use cachalot_convert::read_header;
use serde_json::Value;
use sha2::{Digest, Sha256};

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// name → [shard, dtype, shape, sha256] of a converted directory.
pub fn summarize(dir: &Path) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for e in fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        if !file.ends_with(".safetensors") {
            continue;
        }
        let bytes = fs::read(&path).unwrap();
        for (name, t) in read_header(&path).unwrap() {
            let digest = Sha256::digest(&bytes[t.start as usize..t.end as usize]);
            out.insert(
                name,
                serde_json::json!([file, t.dtype, t.shape, hex(&digest)]),
            );
        }
    }
    out
}
