//! Broken checkpoints give errors that name the tensor and the file, never a panic.

use std::path::{Path, PathBuf};

use cachalot_model::{DeepseekV3, DeepseekV4, LoadOptions, V4LoadOptions};
use safetensors::tensor::Dtype;
use serde_json::Value;

mod common;
use common::{copy_dir, index, rewrite, shard_of};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v3/r1_tiny")
}

fn copy_fixture() -> tempfile::TempDir {
    copy_dir(&fixture())
}

/// A copy of the tiny DeepSeek-V4 Flash-like fixture.
fn copy_v4() -> tempfile::TempDir {
    copy_dir(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v4/flash_tiny"))
}

/// Removes tensor `name` from the shard that holds it.
fn drop_tensor(dir: &Path, name: &str) {
    let shard = shard_of(dir, name);
    rewrite(dir, &shard, |t| t.retain(|(n, ..)| n != name));
}

/// Rewrites the directory's config.json through `edit`.
fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let p = dir.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&p, cfg.to_string()).unwrap();
}

fn load_err(dir: &Path) -> String {
    match DeepseekV3::load(dir, LoadOptions::default()) {
        Ok(_) => panic!("loading a broken checkpoint succeeded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_named() {
    let tmp = copy_fixture();
    let name = "model.layers.1.mlp.experts.3.up_proj.weight";
    drop_tensor(tmp.path(), name);
    let e = load_err(tmp.path());
    assert!(e.contains(name) && e.contains("missing"), "{e}");
}

#[test]
fn missing_fp8_scale_is_named() {
    let tmp = copy_fixture();
    let name = "model.layers.0.self_attn.o_proj.weight_scale_inv";
    drop_tensor(tmp.path(), name);
    let e = load_err(tmp.path());
    assert!(e.contains(name) && e.contains("block scales"), "{e}");
}

#[test]
fn unknown_tensor_is_named_with_its_file() {
    let tmp = copy_fixture();
    let anchor = "model.norm.weight";
    let shard = shard_of(tmp.path(), anchor);
    rewrite(tmp.path(), &shard, |t| {
        t.push((
            "model.layers.0.mlp.bogus.weight".into(),
            Dtype::F32,
            vec![2],
            vec![0; 8],
        ))
    });
    let e = load_err(tmp.path());
    assert!(
        e.contains("model.layers.0.mlp.bogus.weight") && e.contains(&shard),
        "{e}"
    );
}

#[test]
fn misshapen_and_mistyped_tensors_are_named() {
    let tmp = copy_fixture();
    let name = "model.layers.0.input_layernorm.weight";
    let shard = shard_of(tmp.path(), name);
    rewrite(tmp.path(), &shard, |t| {
        let e = t.iter_mut().find(|(n, ..)| n == name).unwrap();
        e.2 = vec![e.2[0] / 2, 2];
    });
    let e = load_err(tmp.path());
    assert!(
        e.contains(name) && e.contains(&shard) && e.contains("shape"),
        "{e}"
    );

    let tmp = copy_fixture();
    let name = "model.layers.1.self_attn.kv_b_proj.weight";
    let shard = shard_of(tmp.path(), name);
    rewrite(tmp.path(), &shard, |t| {
        let e = t.iter_mut().find(|(n, ..)| n == name).unwrap();
        e.1 = Dtype::U8;
    });
    let e = load_err(tmp.path());
    assert!(e.contains(name) && e.contains("dtype"), "{e}");

    // An int8 weight beside an FP8 block scale: the dtype is what is named.
    let tmp = copy_fixture();
    let shard = shard_of(tmp.path(), name);
    rewrite(tmp.path(), &shard, |t| {
        let e = t.iter_mut().find(|(n, ..)| n == name).unwrap();
        e.1 = Dtype::I8;
    });
    let e = load_err(tmp.path());
    assert!(
        e.contains(name) && e.contains("dtype I8") && e.contains("weight_scale_inv"),
        "{e}"
    );
}

#[test]
fn truncated_shard_is_named() {
    let tmp = copy_fixture();
    let shard = shard_of(tmp.path(), "lm_head.weight");
    let path = tmp.path().join(&shard);
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 1000).unwrap();
    let e = load_err(tmp.path());
    assert!(e.contains(&shard) && e.contains("truncated"), "{e}");
}

#[test]
fn corrupt_header_offsets_name_the_tensor() {
    let tmp = copy_fixture();
    let name = "lm_head.weight";
    let shard = shard_of(tmp.path(), name);
    let path = tmp.path().join(&shard);
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let end = header[name]["data_offsets"][1].as_u64().unwrap();
    header[name]["data_offsets"][1] = Value::from(end - 1);
    // Same header length (padded with spaces), so every other offset stays right.
    let mut text = header.to_string();
    assert!(text.len() <= n);
    text.push_str(&" ".repeat(n - text.len()));
    let mut out = bytes[..8].to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
    let e = load_err(tmp.path());
    assert!(
        e.contains(name) && e.contains(&shard) && e.contains("data_offsets"),
        "{e}"
    );
}

/// The load error of `dir` with `idx` as its index.
fn load_with_index(dir: &std::path::Path, idx: &Value) -> String {
    std::fs::write(dir.join("model.safetensors.index.json"), idx.to_string()).unwrap();
    load_err(dir)
}

#[test]
fn bad_index_entries_are_reported() {
    let tmp = copy_fixture();
    let mut idx = index(tmp.path());
    let shard = shard_of(tmp.path(), "lm_head.weight");
    idx["weight_map"]["model.layers.9.ghost.weight"] = Value::from(shard.clone());
    let e = load_with_index(tmp.path(), &idx);
    assert!(
        e.contains("model.layers.9.ghost.weight") && e.contains(&shard),
        "{e}"
    );

    for outside in ["/etc/passwd", "../r1_tiny/model-00001-of-00003.safetensors"] {
        let tmp = copy_fixture();
        let mut idx = index(tmp.path());
        idx["weight_map"]["model.norm.weight"] = Value::from(outside);
        let e = load_with_index(tmp.path(), &idx);
        assert!(
            e.contains("model.norm.weight") && e.contains("not in the model directory"),
            "{e}"
        );
    }

    // A shard the index names that is not there: the index and an entry naming it are said.
    let tmp = copy_fixture();
    let mut idx = index(tmp.path());
    idx["weight_map"]["model.layers.9.ghost.weight"] =
        Value::from("model-00009-of-00009.safetensors");
    let e = load_with_index(tmp.path(), &idx);
    assert!(
        e.contains("model.safetensors.index.json")
            && e.contains("model-00009-of-00009.safetensors")
            && e.contains("model.layers.9.ghost.weight")
            && e.contains("missing"),
        "{e}"
    );

    let tmp = copy_fixture();
    std::fs::remove_file(tmp.path().join("model.safetensors.index.json")).unwrap();
    let e = load_err(tmp.path());
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn config_mismatch_is_reported() {
    let tmp = copy_fixture();
    edit_config(tmp.path(), |cfg| {
        cfg["hidden_size"] = Value::from(cfg["hidden_size"].as_u64().unwrap() + 8);
    });
    let e = load_err(tmp.path());
    assert!(e.contains("shape"), "{e}");
}

#[test]
fn missing_routing_bias_and_stray_scales_are_named() {
    // noaux_tc routes with e_score_correction_bias: without it the routing would change.
    let tmp = copy_fixture();
    let name = "model.layers.1.mlp.gate.e_score_correction_bias";
    drop_tensor(tmp.path(), name);
    let e = load_err(tmp.path());
    assert!(e.contains(name) && e.contains("missing"), "{e}");

    // An FP8 weight relabelled BF16: the weight is named, with the scales that give it away.
    let tmp = copy_fixture();
    let name = "model.layers.1.self_attn.q_a_proj.weight";
    let shard = shard_of(tmp.path(), name);
    rewrite(tmp.path(), &shard, |t| {
        let w = t.iter_mut().find(|(n, ..)| n == name).unwrap();
        w.1 = Dtype::BF16;
        w.3.truncate(w.3.len() / 2 * 2);
        let n: usize = w.2.iter().product();
        w.3.resize(2 * n, 0);
    });
    let e = load_err(tmp.path());
    assert!(
        e.contains(name) && e.contains("weight_scale_inv") && e.contains("F8_E4M3"),
        "{e}"
    );
}

#[test]
fn non_finite_norms_and_biases_are_named() {
    for name in [
        "model.norm.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
    ] {
        let tmp = copy_fixture();
        let shard = shard_of(tmp.path(), name);
        rewrite(tmp.path(), &shard, |t| {
            let w = t.iter_mut().find(|(n, ..)| n == name).unwrap();
            // bf16 0x7FC0 / f32 0x7FC00000: a quiet NaN in the first value.
            match w.1 {
                Dtype::BF16 => w.3[..2].copy_from_slice(&0x7FC0u16.to_le_bytes()),
                _ => w.3[..4].copy_from_slice(&f32::NAN.to_le_bytes()),
            }
        });
        let e = load_err(tmp.path());
        assert!(e.contains(name) && e.contains("NaN"), "{e}");
    }
}

#[test]
fn config_values_that_would_give_nan_are_refused() {
    for (field, value) in [
        ("rope_theta", Value::from(1.0)),
        ("rope_theta", Value::from(-5.0)),
        ("rms_norm_eps", Value::from(-1.0)),
        ("routed_scaling_factor", Value::from(0.0)),
        ("max_position_embeddings", Value::from(0)),
    ] {
        let tmp = copy_fixture();
        edit_config(tmp.path(), |cfg| {
            cfg[field] = value.clone();
        });
        let e = load_err(tmp.path());
        assert!(e.contains(field), "{field} = {value}: {e}");
    }
    // int-quantized with a scheme the loader does not run is named at the config field.
    let tmp = copy_fixture();
    edit_config(tmp.path(), |cfg| {
        cfg["quantization_config"] = serde_json::json!({
            "quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 96}}}
        });
    });
    let e = load_err(tmp.path());
    assert!(
        e.contains("quantization_config.config_groups.group_0.weights.num_bits"),
        "{e}"
    );
}

fn load_err_v4(dir: &Path) -> String {
    match DeepseekV4::load(
        dir,
        V4LoadOptions {
            load_mtp: true,
            ..Default::default()
        },
    ) {
        Ok(_) => panic!("loading a broken V4 checkpoint succeeded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn v4_missing_tensors_and_scales_are_named() {
    for name in [
        "layers.2.attn.indexer.compressor.ape",
        "layers.3.ffn.experts.5.w2.scale",
        "layers.1.attn.wo_a.scale",
        "mtp.0.h_proj.weight",
        "layers.0.ffn.gate.tid2eid",
    ] {
        let tmp = copy_v4();
        drop_tensor(tmp.path(), name);
        let e = load_err_v4(tmp.path());
        assert!(e.contains(name) && e.contains("missing"), "{name}: {e}");
    }
}

#[test]
fn v4_bad_scales_dtypes_and_tables_are_named() {
    // A NaN (255) E8M0 block scale.
    let tmp = copy_v4();
    let name = "layers.0.attn.wq_b.scale";
    let shard = shard_of(tmp.path(), name);
    rewrite(tmp.path(), &shard, |t| {
        for (n, _, _, b) in t.iter_mut() {
            if n == name {
                b[0] = 255;
            }
        }
    });
    let e = load_err_v4(tmp.path());
    assert!(e.contains(name) && e.contains("NaN"), "{e}");
    // A NaN MXFP4 group scale.
    let tmp = copy_v4();
    let name = "layers.1.ffn.experts.0.w1.scale";
    let shard = shard_of(tmp.path(), name);
    rewrite(tmp.path(), &shard, |t| {
        for (n, _, _, b) in t.iter_mut() {
            if n == name {
                b[3] = 255;
            }
        }
    });
    let e = load_err_v4(tmp.path());
    assert!(e.contains(name) && e.contains("NaN"), "{e}");
    // An MXFP4 expert weight reshaped (its bytes as [rows/2, 2·cols/2], INT4's layout): the
    // weight's shape is named, not its E8M0 scale's dtype.
    let tmp = copy_v4();
    let name = "layers.0.ffn.experts.0.w1.weight";
    let shard = shard_of(tmp.path(), name);
    rewrite(tmp.path(), &shard, |t| {
        let e = t.iter_mut().find(|(n, ..)| n == name).unwrap();
        e.2 = vec![e.2[0] / 2, e.2[1] * 2];
    });
    let e = load_err_v4(tmp.path());
    assert!(
        e.contains(name) && e.contains("has shape") && e.contains("MXFP4"),
        "{e}"
    );
    // An expert id outside the expert range in tid2eid.
    let tmp = copy_v4();
    let name = "layers.1.ffn.gate.tid2eid";
    let shard = shard_of(tmp.path(), name);
    rewrite(tmp.path(), &shard, |t| {
        for (n, _, _, b) in t.iter_mut() {
            if n == name {
                b[8..16].copy_from_slice(&99i64.to_le_bytes());
            }
        }
    });
    let e = load_err_v4(tmp.path());
    assert!(e.contains(name) && e.contains("expert 99"), "{e}");
    // An unsupported weight dtype.
    let tmp = copy_v4();
    let name = "layers.3.attn.wkv.weight";
    let shard = shard_of(tmp.path(), name);
    rewrite(tmp.path(), &shard, |t| {
        for (n, d, _, _) in t.iter_mut() {
            if n == name {
                *d = Dtype::F8_E5M2;
            }
        }
    });
    let e = load_err_v4(tmp.path());
    assert!(e.contains(name) && e.contains("F8_E5M2"), "{e}");
}

#[test]
fn v4_config_mismatch_is_reported() {
    // One layer fewer in the config: layer 3's tensors are left over and reported by name.
    let tmp = copy_v4();
    edit_config(tmp.path(), |c| {
        c["num_hidden_layers"] = Value::from(3);
        c["compress_ratios"] = serde_json::json!([0, 0, 4, 0]);
    });
    let e = load_err_v4(tmp.path());
    assert!(
        e.contains("layers.3.") && e.contains("not part of the model"),
        "{e}"
    );
    // A compress ratio that disagrees with the tensors present.
    let tmp = copy_v4();
    edit_config(tmp.path(), |c| {
        c["compress_ratios"][0] = Value::from(128);
    });
    let e = load_err_v4(tmp.path());
    assert!(
        e.contains("layers.0.attn.compressor") && e.contains("missing"),
        "{e}"
    );
}
