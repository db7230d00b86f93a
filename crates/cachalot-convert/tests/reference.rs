//! The converter's output against the independent Python implementation of spec §5
//! (`tools/quant/convert_reference.py`, summaries in `fixtures/v3/converted/`): every tensor's
//! name, shard, dtype, shape and bytes (SHA-256), the index and `config.json`, for the three FP8
//! fixture models in all three modes.

use std::fs;
use std::path::{Path, PathBuf};

use cachalot_convert::{convert, ConvertOptions, QuantMode};
use serde_json::Value;

mod common;
use common::summarize;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v3")
}

fn check(model: &str) {
    let want: Value = serde_json::from_str(
        &fs::read_to_string(fixtures().join(format!("converted/{model}.json"))).unwrap(),
    )
    .unwrap();
    for (mode_name, mode) in [
        ("bfloat16", QuantMode::Bfloat16),
        ("w8a8c16", QuantMode::W8A8C16),
        ("w8a8c8", QuantMode::W8A8C8),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let c8 = (mode == QuantMode::W8A8C8)
            .then(|| fixtures().join(format!("converted/c8_scales_{model}.json")));
        let opts = ConvertOptions {
            input: fixtures().join(model),
            output: out.clone(),
            mode,
            c8_scales: c8,
            quant_param_path: None,
            force: false,
            progress: false,
        };
        convert(&opts).unwrap_or_else(|e| panic!("{model} {mode_name}: {e}"));
        let want = &want[mode_name];
        let got = summarize(&out);
        let want_tensors = want["tensors"].as_object().unwrap();
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want_tensors.keys().collect::<Vec<_>>(),
            "{model} {mode_name}: tensor names"
        );
        for (name, w) in want_tensors {
            assert_eq!(&got[name], w, "{model} {mode_name}: tensor {name}");
        }
        let config: Value =
            serde_json::from_str(&fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(config, want["config"], "{model} {mode_name}: config.json");
        let index: Value = serde_json::from_str(
            &fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(index["metadata"], serde_json::json!({}));
        assert_eq!(
            index["weight_map"], want["weight_map"],
            "{model} {mode_name}: weight_map"
        );
        // Every *.json of the input is there (tokenizer files, reference.json).
        for f in ["tokenizer.json", "tokenizer_config.json", "reference.json"] {
            assert_eq!(
                fs::read(out.join(f)).unwrap(),
                fs::read(fixtures().join(model).join(f)).unwrap(),
                "{model} {mode_name}: {f}"
            );
        }
    }
}

#[test]
fn r1_tiny_matches_the_python_reference() {
    check("r1_tiny");
}

#[test]
fn kimi_tiny_matches_the_python_reference() {
    check("kimi_tiny");
}

#[test]
fn v3_noq_tiny_matches_the_python_reference() {
    check("v3_noq_tiny");
}

/// The seed's spelling of C8 (spec §5.4): `--quant-param-path DIR` of `quant_parameters_{i}.pth`
/// (torch.save'd, `tools/quant/make_pt_fixtures.py`) gives the same checkpoint as the JSON.
#[test]
fn c8_scales_from_the_seeds_pth_files() {
    let want: Value = serde_json::from_str(
        &fs::read_to_string(fixtures().join("converted/r1_tiny.json")).unwrap(),
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let opts = ConvertOptions {
        input: fixtures().join("r1_tiny"),
        output: out.clone(),
        mode: QuantMode::W8A8C8,
        c8_scales: None,
        quant_param_path: Some(fixtures().join("c8_pth_r1_tiny")),
        force: false,
        progress: false,
    };
    convert(&opts).unwrap();
    let got = summarize(&out);
    for (name, w) in want["w8a8c8"]["tensors"].as_object().unwrap() {
        assert_eq!(&got[name], w, "tensor {name}");
    }
    // One layer's file missing: named.
    let partial = tmp.path().join("partial");
    fs::create_dir(&partial).unwrap();
    fs::copy(
        fixtures().join("c8_pth_r1_tiny/quant_parameters_0.pth"),
        partial.join("quant_parameters_0.pth"),
    )
    .unwrap();
    let e = convert(&ConvertOptions {
        quant_param_path: Some(partial),
        output: tmp.path().join("never"),
        ..opts
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("quant_parameters_1.pth") && e.contains("missing"),
        "{e}"
    );
}
