//! The DeepSeek-V4 conversions against the independent Python implementation of spec
//! `deepseek-v4.md` §4 (`tools/quant/v4_convert_reference.py`, summaries in
//! `fixtures/v4/converted/`), on the random V4-layout checkpoint `fixtures/v4/tiny`: every
//! tensor's name, shard, dtype, shape and bytes (SHA-256), the index and `config.json`, for all
//! five quant types. The INT4 range search (§4.4) is compared per row with §6.4's tolerance: the
//! same scale on ≥ 99.9% of rows, and where the scale differs, a dequantization error no larger
//! than the reference's. Also `convert_config` (§1.2) and V4 input checks.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use cachalot_convert::{convert, convert_config, read_header, ConvertOptions, QuantMode};
use cachalot_kernels::{bf16_round, bf16_to_f32};
use serde_json::Value;

mod common;
use common::summarize;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v4")
}

fn reference(name: &str) -> Value {
    let path = fixtures().join(format!("converted/{name}.json"));
    serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap()
}

fn run(input: &Path, out: &Path, mode: QuantMode) {
    run_clip(input, out, mode, None)
}

fn run_clip(input: &Path, out: &Path, mode: QuantMode, clip: Option<&Path>) {
    let opts = ConvertOptions {
        input: input.to_path_buf(),
        output: out.to_path_buf(),
        mode,
        c8_scales: None,
        quant_param_path: clip.map(Path::to_path_buf),
        force: false,
        progress: false,
    };
    convert(&opts).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
}

/// The raw bytes of tensor `name` in a converted directory.
fn tensor_bytes(dir: &Path, name: &str) -> Vec<u8> {
    for e in fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            for (n, t) in read_header(&path).unwrap() {
                if n == name {
                    let bytes = fs::read(&path).unwrap();
                    return bytes[t.start as usize..t.end as usize].to_vec();
                }
            }
        }
    }
    panic!("{name} not in {}", dir.display())
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Squared error of one row quantized with `scale` (the §4.4 final step with c = 7·scale).
fn int4_row_error(row: &[f32], scale: f32) -> f64 {
    let c = bf16_round(scale * 7.0);
    let inv = bf16_round(1.0 / scale);
    row.iter()
        .map(|&x| {
            let q = bf16_round(x.max(-c).min(c) * inv)
                .round_ties_even()
                .clamp(-7.0, 7.0);
            (x as f64 - q as f64 * scale as f64).powi(2)
        })
        .sum()
}

/// `ty`'s reference; with `clip`, converted with that `--quant-param-path` (the INT4 rows whose
/// searched scale differs are then only counted: `bf16_dir` holds the unclipped rows).
fn check(ty: &str, mode: QuantMode, bf16_dir: &Path, clip: Option<&Path>) {
    let want = reference(ty);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    run_clip(&fixtures().join("tiny"), &out, mode, clip);
    let got = summarize(&out);
    let want_t = want["tensors"].as_object().unwrap();
    assert_eq!(
        got.keys().collect::<BTreeSet<_>>(),
        want_t.keys().collect::<BTreeSet<_>>(),
        "{ty}: tensor names"
    );
    let int4 = want["int4"].as_object().unwrap();
    let mut searched = BTreeMap::new();
    for (w, r) in int4 {
        let key = w.strip_suffix(".weight").unwrap();
        searched.insert(format!("{key}.scale"), w.clone());
        searched.insert(format!("{key}.bias"), w.clone());
        searched.insert(w.clone(), w.clone());
        assert_eq!(
            r["scale"].as_array().unwrap().len(),
            r["bias"].as_array().unwrap().len()
        );
    }
    let (mut rows, mut same_rows) = (0usize, 0usize);
    for (name, w) in want_t {
        let g = &got[name];
        if !searched.contains_key(name) {
            assert_eq!(g, w, "{ty}: tensor {name}");
            continue;
        }
        // Name, shard, dtype and shape exactly; bytes below.
        assert_eq!(
            g.as_array().unwrap()[..3],
            w.as_array().unwrap()[..3],
            "{ty}: tensor {name}"
        );
    }
    for (w, r) in int4 {
        let key = w.strip_suffix(".weight").unwrap();
        let ours: Vec<f32> = tensor_bytes(&out, &format!("{key}.scale"))
            .chunks_exact(8)
            .map(|b| {
                assert_eq!(&b[4..], &[0, 0, 0, 0], "{ty}: {key}.scale high word");
                f32::from_bits(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            })
            .collect();
        let theirs: Vec<f32> = r["scale"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let our_bias = f32s(&tensor_bytes(&out, &format!("{key}.bias")));
        let their_bias: Vec<f32> = r["bias"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let bf: Vec<f32> = tensor_bytes(bf16_dir, w)
            .chunks_exact(2)
            .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect();
        let cols = bf.len() / ours.len();
        let mut all_same = true;
        for (i, (&a, &b)) in ours.iter().zip(&theirs).enumerate() {
            rows += 1;
            if a.to_bits() == b.to_bits() {
                same_rows += 1;
                let tol = their_bias[i].abs() / 128.0 + 1e-6;
                assert!(
                    (our_bias[i] - their_bias[i]).abs() <= tol,
                    "{ty}: {key}.bias[{i}] {} vs {}",
                    our_bias[i],
                    their_bias[i]
                );
                continue;
            }
            all_same = false;
            if clip.is_some() {
                continue;
            }
            let row = &bf[i * cols..(i + 1) * cols];
            let (eo, et) = (int4_row_error(row, a), int4_row_error(row, b));
            assert!(
                eo <= et * (1.0 + 1e-3) + 1e-12,
                "{ty}: {w} row {i}: scale {a} (error {eo}) vs reference {b} (error {et})"
            );
        }
        if all_same {
            assert_eq!(got[w.as_str()], want_t[w.as_str()], "{ty}: packed {w}");
        }
    }
    if rows > 0 {
        assert!(
            same_rows * 1000 >= rows * 999,
            "{ty}: INT4 scales agree on {same_rows} of {rows} rows (< 99.9%)"
        );
        eprintln!("{ty}: INT4 scales agree on {same_rows} of {rows} rows");
    }
    let config: Value =
        serde_json::from_str(&fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config, want["config"], "{ty}: config.json");
    let index: Value = serde_json::from_str(
        &fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["metadata"], serde_json::json!({}));
    assert_eq!(index["weight_map"], want["weight_map"], "{ty}: weight_map");
}

/// `--quant-param-path` (spec §4.3 step 1): the clip factors of `fixtures/v4/clip` (torch.save'd
/// f32/f64/bf16 [N, 1], 0-dim tensors and Python floats) clamp the INT8 and INT4 layers that
/// have them exactly as the seed's torch code does.
#[test]
fn clip_factors_match_the_python_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let bf16 = tmp.path().join("bf16");
    run(&fixtures().join("tiny"), &bf16, QuantMode::Bfloat16);
    let clip = fixtures().join("clip");
    for (ty, mode) in [
        ("w8a8-int", QuantMode::W8A8Int),
        ("w4a8-int", QuantMode::W4A8Int),
    ] {
        check(&format!("{ty}-clip"), mode, &bf16, Some(&clip));
        // The clip changes some tensors.
        let plain = reference(ty);
        let clipped = reference(&format!("{ty}-clip"));
        assert_ne!(
            plain["tensors"], clipped["tensors"],
            "{ty}: clipping changed nothing"
        );
    }
    // The MX types have no INT8/INT4 layer: the factors are read and not used (the output is
    // the one without them), not refused as naming no weight.
    for (ty, mode) in [
        ("w4a8-mx", QuantMode::W4A8Mx),
        ("w4a8-mx-hif", QuantMode::W4A8MxHif),
    ] {
        check(ty, mode, &bf16, Some(&clip));
    }
    // A missing layer file is named.
    let partial = tmp.path().join("partial");
    fs::create_dir(&partial).unwrap();
    fs::copy(
        clip.join("quant_params_0.pt"),
        partial.join("quant_params_0.pt"),
    )
    .unwrap();
    let e = convert(&ConvertOptions {
        input: fixtures().join("tiny"),
        output: tmp.path().join("never"),
        mode: QuantMode::W8A8Int,
        c8_scales: None,
        quant_param_path: Some(partial.clone()),
        force: false,
        progress: false,
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("quant_params_1.pt") && e.contains("missing"),
        "{e}"
    );
    assert!(!tmp.path().join("never").exists());
    // Not a torch file.
    let bad = tmp.path().join("bad");
    fs::create_dir(&bad).unwrap();
    for l in 0..8 {
        fs::write(bad.join(format!("quant_params_{l}.pt")), b"not a zip").unwrap();
    }
    let e = convert(&ConvertOptions {
        input: fixtures().join("tiny"),
        output: tmp.path().join("never"),
        mode: QuantMode::W8A8Int,
        c8_scales: None,
        quant_param_path: Some(bad),
        force: false,
        progress: false,
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("quant_params_0.pt") && e.contains("not a zip"),
        "{e}"
    );
}

#[test]
fn every_quant_type_matches_the_python_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let bf16 = tmp.path().join("bf16");
    run(&fixtures().join("tiny"), &bf16, QuantMode::Bfloat16);
    for (ty, mode) in [
        ("bfloat16", QuantMode::Bfloat16),
        ("w8a8-int", QuantMode::W8A8Int),
        ("w4a8-int", QuantMode::W4A8Int),
        ("w4a8-mx", QuantMode::W4A8Mx),
        ("w4a8-mx-hif", QuantMode::W4A8MxHif),
    ] {
        check(ty, mode, &bf16, None);
    }
}

/// §4.5: the w4a8-mx experts dequantize bit-identically to the native FP4 experts.
#[test]
fn mxfp4_experts_are_lossless() {
    let tmp = tempfile::tempdir().unwrap();
    let (bf, mx) = (tmp.path().join("bf16"), tmp.path().join("mx"));
    run(&fixtures().join("tiny"), &bf, QuantMode::Bfloat16);
    run(&fixtures().join("tiny"), &mx, QuantMode::W4A8Mx);
    let mut checked = 0;
    let bf_summary = summarize(&bf);
    for name in summarize(&mx).keys() {
        if !(name.contains(".experts.") && name.ends_with(".weight")) {
            continue;
        }
        let key = name.strip_suffix(".weight").unwrap();
        let packed = tensor_bytes(&mx, name);
        let scales = tensor_bytes(&mx, &format!("{key}.scale"));
        let want: Vec<u16> = tensor_bytes(&bf, name)
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let shape = bf_summary[name][2].as_array().unwrap();
        let (rows, cols) = (
            shape[0].as_u64().unwrap() as usize,
            shape[1].as_u64().unwrap() as usize,
        );
        assert_eq!(packed.len(), rows * cols / 2);
        for r in 0..rows {
            let mut row = vec![0.0f32; cols];
            cachalot_kernels::mx::dequantize_mxfp4_row(
                &packed[r * cols / 2..(r + 1) * cols / 2],
                &scales[r * cols / 32..(r + 1) * cols / 32],
                &mut row,
            );
            for (c, v) in row.iter().enumerate() {
                // ±0 may differ (torch.sign(−0) = 0); values are equal.
                assert_eq!(*v, bf16_to_f32(want[r * cols + c]), "{name} [{r}, {c}]");
            }
        }
        checked += 1;
    }
    assert!(checked > 0);
}

#[test]
fn convert_config_rewrites_quantization_config() {
    let want = reference("convert_config");
    for (hif, key) in [(false, "plain"), (true, "hif")] {
        let tmp = tempfile::tempdir().unwrap();
        let src = fixtures().join("tiny/config.json");
        fs::copy(&src, tmp.path().join("config.json")).unwrap();
        convert_config(tmp.path(), hif).unwrap();
        let got: Value =
            serde_json::from_str(&fs::read_to_string(tmp.path().join("config.json")).unwrap())
                .unwrap();
        let orig: Value = serde_json::from_str(&fs::read_to_string(&src).unwrap()).unwrap();
        assert_eq!(got["quantization_config"], want[key], "{key}");
        // Nothing else changes.
        let (mut a, mut b) = (got.clone(), orig.clone());
        a.as_object_mut().unwrap().remove("quantization_config");
        b.as_object_mut().unwrap().remove("quantization_config");
        assert_eq!(a, b);
        // The original is kept beside it, once (a second rewrite keeps the first original).
        let kept = tmp.path().join("config.json.orig");
        assert_eq!(fs::read(&kept).unwrap(), fs::read(&src).unwrap());
        convert_config(tmp.path(), !hif).unwrap();
        assert_eq!(fs::read(&kept).unwrap(), fs::read(&src).unwrap());
        // A file of that name that is not an earlier description of this config is not
        // taken for one: refused, both files left as they were.
        let other = tmp.path().join("other");
        fs::copy(&kept, &other).unwrap();
        let mut unrelated = orig.clone();
        unrelated["hidden_size"] = 7.into();
        fs::write(&kept, unrelated.to_string()).unwrap();
        let before = fs::read(tmp.path().join("config.json")).unwrap();
        let e = convert_config(tmp.path(), hif).unwrap_err().to_string();
        assert!(e.contains("not an earlier description"), "{e}");
        assert_eq!(fs::read(tmp.path().join("config.json")).unwrap(), before);
        fs::rename(&other, &kept).unwrap();
        // Once rewritten, the same rewrite writes nothing (a lost .orig is not remade from
        // the rewritten config).
        fs::remove_file(&kept).unwrap();
        assert_eq!(
            convert_config(tmp.path(), !hif).unwrap(),
            cachalot_convert::ConfigRewrite::AlreadyDone
        );
        assert!(!kept.exists());
    }
    // A link (a Hugging Face cache's snapshot) is replaced, the file it points to kept.
    let tmp = tempfile::tempdir().unwrap();
    let blob = tmp.path().join("blob.json");
    fs::copy(fixtures().join("tiny/config.json"), &blob).unwrap();
    let dir = tmp.path().join("snapshot");
    fs::create_dir(&dir).unwrap();
    std::os::unix::fs::symlink(&blob, dir.join("config.json")).unwrap();
    convert_config(&dir, false).unwrap();
    assert_eq!(
        fs::read(&blob).unwrap(),
        fs::read(fixtures().join("tiny/config.json")).unwrap()
    );
    assert!(!fs::symlink_metadata(dir.join("config.json"))
        .unwrap()
        .file_type()
        .is_symlink());
    // Another model's config is refused by its model_type; whole-number floats are ratios.
    let mut v: Value =
        serde_json::from_str(&fs::read_to_string(fixtures().join("tiny/config.json")).unwrap())
            .unwrap();
    v["model_type"] = "deepseek_v3".into();
    fs::write(dir.join("config.json"), v.to_string()).unwrap();
    let e = convert_config(&dir, false).unwrap_err().to_string();
    assert!(e.contains("model_type is \"deepseek_v3\""), "{e}");
    v["model_type"] = "deepseek_v4".into();
    let floats: Vec<f64> = v["compress_ratios"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_f64().unwrap())
        .collect();
    v["compress_ratios"] = serde_json::json!(floats);
    fs::write(dir.join("config.json"), v.to_string()).unwrap();
    convert_config(&dir, false).unwrap();
    // A checkpoint `convert` made is not described as the release.
    v["quantization_config"] =
        serde_json::json!({"quant_method": "compressed-tensors", "format": "int-quantized"});
    fs::write(dir.join("config.json"), v.to_string()).unwrap();
    let e = convert_config(&dir, false).unwrap_err().to_string();
    assert!(
        e.contains("int-quantized") && e.contains("does not describe"),
        "{e}"
    );
}

/// The release rewritten in place by convert-config (as the seed's README has it, no copy
/// kept) still converts, to the same bytes.
#[test]
fn a_release_described_by_convert_config_still_converts() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("tiny");
    let dir = tmp.path().join("release");
    fs::create_dir(&dir).unwrap();
    for e in fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    for hif in [false, true] {
        convert_config(&dir, hif).unwrap();
        fs::remove_file(dir.join("config.json.orig")).unwrap();
        let (a, b) = (
            tmp.path().join(format!("a{hif}")),
            tmp.path().join(format!("b{hif}")),
        );
        run(&src, &a, QuantMode::W8A8Int);
        run(&dir, &b, QuantMode::W8A8Int);
        for e in fs::read_dir(&a).unwrap() {
            let name = e.unwrap().file_name();
            if name.to_string_lossy().ends_with(".safetensors") {
                assert_eq!(
                    fs::read(a.join(&name)).unwrap(),
                    fs::read(b.join(&name)).unwrap()
                );
            }
        }
    }
}
