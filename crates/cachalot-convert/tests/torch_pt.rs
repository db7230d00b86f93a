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
    // The legacy format (a bare pickle stream: PROTO 2, then torch's magic number) is named.
    let e = load_pt_bytes(b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.").unwrap_err();
    assert!(e.contains("legacy (non-zip) format"), "{e}");
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
    // A changed byte of a stored tensor: the entry's CRC-32 no longer matches (as Python's
    // zipfile.testzip finds).
    assert_eq!(
        cachalot_convert::torch_pt::crc32(b"123456789"),
        0xCBF4_3926,
        "the standard check value"
    );
    let mut damaged = bytes.clone();
    // The first local header whose name ends in /data/0; its data follows its name and extra
    // field.
    let header = (0..bytes.len() - 30)
        .find(|&i| {
            bytes[i..i + 4] == [0x50, 0x4b, 0x03, 0x04] && {
                let n = u16::from_le_bytes([bytes[i + 26], bytes[i + 27]]) as usize;
                bytes[i + 30..i + 30 + n].ends_with(b"/data/0")
            }
        })
        .expect("the local header of data/0");
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let data = header + 30 + u16_at(header + 26) + u16_at(header + 28);
    damaged[data] ^= 0x40;
    let e = load_pt_bytes(&damaged).unwrap_err();
    assert!(e.contains("CRC-32") && e.contains("damaged"), "{e}");
}

/// A stored (uncompressed) zip archive of `entries`, laid out as `torch.save` writes one.
fn zip(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let (mut out, mut central) = (Vec::new(), Vec::new());
    for (name, data) in entries {
        let offset = out.len() as u32;
        let (len, name_len) = (
            (data.len() as u32).to_le_bytes(),
            (name.len() as u16).to_le_bytes(),
        );
        let crc = cachalot_convert::torch_pt::crc32(data).to_le_bytes();
        // Local header: signature, version, flags, method 0, time, date, crc.
        out.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        out.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&crc);
        out.extend_from_slice(&len);
        out.extend_from_slice(&len);
        out.extend_from_slice(&name_len);
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(data);
        // Central directory entry: signature, made by, needed, flags, method, time, date, crc.
        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        central.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        central.extend_from_slice(&crc);
        central.extend_from_slice(&len);
        central.extend_from_slice(&len);
        central.extend_from_slice(&name_len);
        // Extra, comment, disk, internal and external attributes.
        central.extend_from_slice(&[0; 12]);
        central.extend_from_slice(&offset.to_le_bytes());
        central.extend_from_slice(name.as_bytes());
    }
    let cd = out.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    let n = (entries.len() as u16).to_le_bytes();
    out.extend_from_slice(&[0, 0, 0, 0, n[0], n[1], n[0], n[1]]);
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&cd.to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out
}

/// A `.pt` archive of `pickle` with storage `0` of 16 f32 values 0, 1, ..., 15.
fn pt_file(pickle: &[u8]) -> Vec<u8> {
    let storage: Vec<u8> = (0..16).flat_map(|v| (v as f32).to_le_bytes()).collect();
    zip(&[
        ("archive/data.pkl", pickle),
        ("archive/byteorder", b"little"),
        ("archive/data/0", &storage),
    ])
}

/// Pickle BINUNICODE.
fn unicode(s: &str) -> Vec<u8> {
    let mut out = vec![b'X'];
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    out
}

/// The pickle of `torch._utils._rebuild_tensor_v2` over storage `0` (16 f32) with this size
/// and stride, ints as 8-byte LONG1.
fn tensor_pickle(size: &[i64], stride: &[i64]) -> Vec<u8> {
    let long = |v: i64| [&[0x8a, 8][..], &v.to_le_bytes()].concat();
    let mut p = vec![0x80, 2];
    p.extend_from_slice(b"ctorch._utils\n_rebuild_tensor_v2\n(");
    // The persistent id ('storage', torch.FloatStorage, '0', 'cpu', 16).
    p.push(b'(');
    p.extend(unicode("storage"));
    p.extend_from_slice(b"ctorch\nFloatStorage\n");
    p.extend(unicode("0"));
    p.extend(unicode("cpu"));
    p.extend_from_slice(&[b'K', 16, b't', b'Q', b'K', 0, b'(']);
    size.iter().for_each(|&v| p.extend(long(v)));
    p.extend_from_slice(b"t(");
    stride.iter().for_each(|&v| p.extend(long(v)));
    // requires_grad False, hooks None; call; STOP.
    p.extend_from_slice(&[b't', 0x89, b'N', b't', b'R', b'.']);
    p
}

/// A size or stride that overflows, or a view larger than its storage (stride 0), is an error
/// naming the storage: it used to wrap to a "valid" view, or to reserve 2^40 · 8 bytes (abort)
/// or 2^62 · 8 (capacity overflow panic).
#[test]
fn bogus_tensor_views_are_errors() {
    let t = load_pt_bytes(&pt_file(&tensor_pickle(&[2, 3], &[1, 4]))).unwrap();
    let PtValue::Tensor(t) = t else {
        panic!("{t:?}")
    };
    assert_eq!(
        (t.dtype, &t.shape[..], &t.values[..]),
        ("float32", &[2, 3][..], &[0.0, 4.0, 8.0, 1.0, 5.0, 9.0][..])
    );
    // Stride 0 within the storage is a valid (expanded) view.
    let t = load_pt_bytes(&pt_file(&tensor_pickle(&[4], &[0]))).unwrap();
    assert!(
        matches!(&t, PtValue::Tensor(t) if t.values == [0.0; 4]),
        "{t:?}"
    );

    let cases: [(&[i64], &[i64], &str); 4] = [
        (
            &[1 << 40],
            &[0],
            "tensor view of 1099511627776 elements exceeds its storage of 16",
        ),
        (
            &[1 << 62],
            &[0],
            "tensor view of 4611686018427387904 elements exceeds its storage",
        ),
        (&[1 << 62, 8], &[0, 0], "element count overflows"),
        (
            &[3, 3],
            &[1 << 62, 1 << 62],
            "last element's index overflows",
        ),
    ];
    for (size, stride, want) in cases {
        let e = load_pt_bytes(&pt_file(&tensor_pickle(size, stride))).unwrap_err();
        assert!(
            e.contains("data/0") && e.contains(want),
            "{size:?} {stride:?}: {e}"
        );
    }
}

/// A pickle whose memo copies a list into itself again and again (2^40 nodes from ~400 bytes)
/// stops at the object bound; one that nests lists 200000 deep stops at the depth bound (it
/// used to overflow the stack when converted or dropped). Errors name the file.
#[test]
fn pickle_bombs_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    // [] memoized as 0; then list k+1 = [list k, list k], memoized as k + 1.
    let mut p = vec![0x80, 2, b']', b'q', 0];
    for k in 0..40u8 {
        p.extend_from_slice(&[b']', b'(', b'h', k, b'h', k, b'e', b'q', k + 1]);
    }
    p.push(b'.');
    let path = tmp.path().join("bomb.pt");
    std::fs::write(&path, pt_file(&p)).unwrap();
    let e = load_pt(&path).unwrap_err();
    assert!(
        e.contains("bomb.pt") && e.contains("pickle too large or malformed: more than"),
        "{e}"
    );

    let n = 200_000;
    let mut p = vec![0x80, 2];
    p.extend(std::iter::repeat_n(b']', n));
    p.extend(std::iter::repeat_n(b'a', n - 1));
    p.push(b'.');
    let path = tmp.path().join("deep.pt");
    std::fs::write(&path, pt_file(&p)).unwrap();
    let e = load_pt(&path).unwrap_err();
    assert!(
        e.contains("deep.pt") && e.contains("nested more than 100 deep"),
        "{e}"
    );
}
