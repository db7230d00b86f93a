//! The `.pt` reader against files written by torch 2.15 (`tools/quant/make_pt_fixtures.py`,
//! `fixtures/torch_pt/`): every value of a dict and an OrderedDict — f64/f32/f16/bf16 tensors,
//! 0-dim, [N, 1], transposed and offset views of a shared storage, an nn.Parameter, an empty
//! tensor, Python numbers, strings, lists, None — equals what torch reported; broken files
//! give errors that say what is wrong.

use std::path::{Path, PathBuf};

use cachalot_convert::torch_pt::{load_pt, load_pt_bytes, PtValue};
use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/torch_pt")
}

fn matches(got: &PtValue, want: &Value) -> bool {
    match (got, want) {
        (PtValue::Tensor(t), Value::Object(o)) => {
            let shape: Vec<usize> = o["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            let values: Vec<f64> = o["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            t.dtype == o["dtype"].as_str().unwrap()
                && t.shape == shape
                && t.values.len() == values.len()
                // serde_json parses decimals to within an ulp or so (no float_roundtrip).
                && t.values.iter().zip(&values).all(|(a, b)| (a - b).abs() <= 1e-15 * b.abs())
        }
        (PtValue::Float(a), Value::Number(n)) => n.as_f64() == Some(*a),
        (PtValue::Int(a), Value::Number(n)) => n.as_i64() == Some(*a),
        (PtValue::Bool(a), Value::Bool(b)) => a == b,
        (PtValue::None, Value::Null) => true,
        (PtValue::Str(a), Value::String(b)) => a == b,
        (PtValue::List(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| matches(x, y))
        }
        _ => false,
    }
}

#[test]
fn reads_what_torch_saves() {
    let want: serde_json::Map<String, Value> =
        serde_json::from_str(&std::fs::read_to_string(dir().join("expected.json")).unwrap())
            .unwrap();
    for file in ["dict.pt", "ordered.pt"] {
        let PtValue::Dict(items) = load_pt(&dir().join(file)).unwrap() else {
            panic!("{file}: not a dict")
        };
        let keys: Vec<&str> = items
            .iter()
            .map(|(k, _)| match k {
                PtValue::Str(s) => s.as_str(),
                other => panic!("{file}: key {other:?}"),
            })
            .collect();
        assert_eq!(
            keys,
            want.keys().map(String::as_str).collect::<Vec<_>>(),
            "{file}: key order"
        );
        for ((k, v), (name, w)) in items.iter().zip(&want) {
            assert!(matches(v, w), "{file}: {k:?} = {v:?}, torch says {w}");
            let _ = name;
        }
    }
}

#[test]
fn broken_files_are_named_errors() {
    let e = load_pt(&dir().join("missing.pt")).unwrap_err();
    assert!(e.contains("missing.pt") && e.contains("cannot read"), "{e}");
    let e = load_pt_bytes(b"PK\x03\x04 definitely not complete").unwrap_err();
    assert!(e.contains("not a zip archive"), "{e}");
    // Truncate a real file: its central directory goes.
    let bytes = std::fs::read(dir().join("dict.pt")).unwrap();
    let e = load_pt_bytes(&bytes[..bytes.len() / 2]).unwrap_err();
    assert!(!e.is_empty());
    // A storage missing from the archive: rename data/0 inside the zip (same length).
    let mut renamed = bytes.clone();
    let needle = b"/data/0";
    let mut n = 0;
    for i in 0..renamed.len() - needle.len() {
        if &renamed[i..i + needle.len()] == needle {
            renamed[i + needle.len() - 1] = b'Z';
            n += 1;
        }
    }
    assert!(n >= 2, "data/0 appears in the local and central headers");
    let e = load_pt_bytes(&renamed).unwrap_err();
    assert!(e.contains("data/0") && e.contains("missing"), "{e}");
}
