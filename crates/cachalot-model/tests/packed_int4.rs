//! Kimi-K2-Thinking's own checkpoint layout: compressed-tensors `pack-quantized` int4 routed
//! experts (spec `deepseek-v3-r1-kimi-k2.md` §1.1 and §2.3), loaded natively.
//!
//! The `kimi_tiny` fixture is rewritten twice from the same values: (A) as K2-Thinking ships
//! it — every routed expert projection as `weight_packed` (int32, 8 nibbles a word, low nibble
//! first, q + 8), `weight_scale` (bf16, one per 32 input columns) and `weight_shape`, the other
//! Linears in plain floats, `quantization_config` the `pack-quantized` one — and (B) with those
//! int4 weights dequantized (q · scale, exact in f32) and no quantization. Both must give the
//! same log-probabilities up to the order of the sums. Broken variants must name the tensor or
//! the config field.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cachalot_model::eval;
use cachalot_model::{DeepseekV3, LoadOptions};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{json, Value};

mod common;
use common::{ids, max_abs_diff};

const GROUP: usize = 32;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v3/kimi_tiny")
}

type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// Every tensor of a checkpoint directory, from all its shards.
fn read_all(dir: &Path) -> Tensors {
    let idx: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mut shards: Vec<String> = idx["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    shards.sort();
    shards.dedup();
    let mut out = Tensors::new();
    for s in shards {
        let bytes = std::fs::read(dir.join(&s)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (n, t) in st.tensors() {
            out.insert(n, (t.dtype(), t.shape().to_vec(), t.data().to_vec()));
        }
    }
    out
}

/// A checkpoint directory: one shard, its index, `config`, and the fixture's tokenizer files.
fn write_dir(tensors: &Tensors, config: &Value) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let shard = "model-00001-of-00001.safetensors";
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(
        tmp.path().join(shard),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let map: serde_json::Map<String, Value> = tensors
        .keys()
        .map(|n| (n.clone(), Value::from(shard)))
        .collect();
    std::fs::write(
        tmp.path().join("model.safetensors.index.json"),
        json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    std::fs::write(tmp.path().join("config.json"), config.to_string()).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture().join(f), tmp.path().join(f)).unwrap();
    }
    tmp
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// An FP8 weight with its 128 × 128 block scales, as f32.
fn dequantize_fp8(codes: &[u8], shape: &[usize], scale_inv: &[u8]) -> Vec<f32> {
    let (rows, cols) = (shape[0], shape[1]);
    let gc = cols.div_ceil(128);
    let s = |i: usize| f32::from_le_bytes(scale_inv[4 * i..4 * i + 4].try_into().unwrap());
    (0..rows * cols)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            cachalot_kernels::fp8::e4m3_to_f32(codes[i]) * s((r / 128) * gc + c / 128)
        })
        .collect()
}

/// Symmetric int4 with a bf16 scale per `GROUP` columns (the last group of a row may be short):
/// the stored nibbles (q + 8) and the scales.
fn quantize_int4(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let groups = cols.div_ceil(GROUP);
    let mut q = vec![0u8; rows * cols];
    let mut scales = vec![0f32; rows * groups];
    for r in 0..rows {
        for g in 0..groups {
            let cs = g * GROUP..((g + 1) * GROUP).min(cols);
            let amax = cs
                .clone()
                .map(|c| w[r * cols + c].abs())
                .fold(0f32, f32::max);
            let scale = cachalot_kernels::bf16_round(if amax > 0.0 { amax / 7.0 } else { 1.0 });
            scales[r * groups + g] = scale;
            for c in cs {
                let v = (w[r * cols + c] / scale).round().clamp(-8.0, 7.0) as i32;
                q[r * cols + c] = (v + 8) as u8;
            }
        }
    }
    (q, scales)
}

fn is_routed_expert(name: &str) -> bool {
    name.contains(".mlp.experts.")
}

/// (A) the K2-Thinking layout and (B) the same weights dequantized.
fn build() -> (tempfile::TempDir, tempfile::TempDir) {
    let src = read_all(&fixture());
    let mut packed = Tensors::new();
    let mut plain = Tensors::new();
    for (name, (dtype, shape, bytes)) in &src {
        if name.ends_with(".weight_scale_inv") {
            continue;
        }
        if *dtype != Dtype::F8_E4M3 {
            packed.insert(name.clone(), (*dtype, shape.clone(), bytes.clone()));
            plain.insert(name.clone(), (*dtype, shape.clone(), bytes.clone()));
            continue;
        }
        let prefix = name.strip_suffix(".weight").unwrap();
        let scale_inv = &src[&format!("{prefix}.weight_scale_inv")].2;
        let w = dequantize_fp8(bytes, shape, scale_inv);
        let (rows, cols) = (shape[0], shape[1]);
        if !is_routed_expert(name) {
            let t = (Dtype::F32, shape.clone(), f32_bytes(&w));
            packed.insert(name.clone(), t.clone());
            plain.insert(name.clone(), t);
            continue;
        }
        let (q, scales) = quantize_int4(&w, rows, cols);
        let groups = cols.div_ceil(GROUP);
        let deq: Vec<f32> = (0..rows * cols)
            .map(|i| (q[i] as f32 - 8.0) * scales[(i / cols) * groups + (i % cols) / GROUP])
            .collect();
        plain.insert(name.clone(), (Dtype::F32, shape.clone(), f32_bytes(&deq)));
        // Word j of a row holds columns 8j..8j+8, nibble i at bits 4i..4i+4.
        let words: Vec<u8> = (0..rows * cols / 8)
            .flat_map(|j| {
                let word = (0..8).fold(0u32, |acc, i| acc | ((q[8 * j + i] as u32) << (4 * i)));
                word.to_le_bytes()
            })
            .collect();
        let scale_bytes: Vec<u8> = scales
            .iter()
            .flat_map(|&s| cachalot_kernels::f32_to_bf16(s).to_le_bytes())
            .collect();
        let shape_bytes: Vec<u8> = [rows as i32, cols as i32]
            .iter()
            .flat_map(|d| d.to_le_bytes())
            .collect();
        packed.insert(
            format!("{prefix}.weight_packed"),
            (Dtype::I32, vec![rows, cols / 8], words),
        );
        packed.insert(
            format!("{prefix}.weight_scale"),
            (Dtype::BF16, vec![rows, groups], scale_bytes),
        );
        packed.insert(
            format!("{prefix}.weight_shape"),
            (Dtype::I32, vec![2], shape_bytes),
        );
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    let mut plain_config = config.clone();
    plain_config
        .as_object_mut()
        .unwrap()
        .remove("quantization_config");
    config["quantization_config"] = k2_thinking_quantization();
    (
        write_dir(&packed, &config),
        write_dir(&plain, &plain_config),
    )
}

/// K2-Thinking's `quantization_config` (spec §1.1: int4 W4A16, group 32, symmetric; attention,
/// shared experts, dense MLPs and lm_head ignored).
fn k2_thinking_quantization() -> Value {
    json!({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": null,
                "output_activations": null,
                "weights": {
                    "num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
                    "group_size": GROUP, "dynamic": false, "actorder": null, "observer": "minmax",
                    "observer_kwargs": {}, "block_structure": null
                }
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": null,
        "sparsity_config": {}
    })
}

fn tokens() -> Vec<u32> {
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
            .unwrap();
    ids(&r["sequences"][1]["token_ids"])
}

fn load_err(dir: &Path) -> String {
    match DeepseekV3::load(dir, LoadOptions::default()) {
        Ok(_) => panic!("loading a broken checkpoint succeeded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn packed_int4_experts_equal_their_dequantized_weights() {
    let (packed, plain) = build();
    let a = DeepseekV3::load(packed.path(), LoadOptions::default()).unwrap();
    let b = DeepseekV3::load(plain.path(), LoadOptions::default()).unwrap();
    // The experts stay int4 (half a byte per weight and a scale per 32, against f32's four).
    let (a_experts, _) = a.routed_expert_bytes();
    let (b_experts, _) = b.routed_expert_bytes();
    assert!(a_experts * 6 < b_experts, "{a_experts} vs {b_experts}");
    let toks = tokens();
    let la = eval::next_token_logprobs(&a, &toks, 4096).unwrap();
    let lb = eval::next_token_logprobs(&b, &toks, 4096).unwrap();
    assert!(la.iter().all(|x| x.is_finite()));
    let d = max_abs_diff(&la, &lb);
    assert!(d < 1e-4, "max |Δ logprob| {d}");
    // Decode (one token per step, the 1-token products) agrees too.
    let ga = eval::greedy(&a, &toks[..8], 12).unwrap();
    let gb = eval::greedy(&b, &toks[..8], 12).unwrap();
    assert_eq!(ga, gb);
}

#[test]
fn packed_int4_errors_name_the_tensor_or_field() {
    let (packed, _plain) = build();
    let dir = packed.path();
    let config_path = dir.join("config.json");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();

    // weight_packed in a checkpoint whose config does not say pack-quantized.
    let mut c = config.clone();
    c.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(&config_path, c.to_string()).unwrap();
    let e = load_err(dir);
    assert!(
        e.contains(".weight_packed") && e.contains("pack-quantized"),
        "{e}"
    );

    // Unsupported quantization groups.
    for (edit, field) in [
        (
            json!({"num_bits": 8}),
            "quantization_config.config_groups.group_0.weights.num_bits",
        ),
        (
            json!({"symmetric": false}),
            "quantization_config.config_groups.group_0.weights.symmetric",
        ),
        (
            json!({"group_size": 0}),
            "quantization_config.config_groups.group_0.weights.group_size",
        ),
        (
            json!({"strategy": "tensor"}),
            "quantization_config.config_groups.group_0.weights.strategy",
        ),
    ] {
        let mut c = config.clone();
        let w = c["quantization_config"]["config_groups"]["group_0"]["weights"]
            .as_object_mut()
            .unwrap();
        for (k, v) in edit.as_object().unwrap() {
            w.insert(k.clone(), v.clone());
        }
        std::fs::write(&config_path, c.to_string()).unwrap();
        let e = load_err(dir);
        assert!(e.contains(field), "{field}: {e}");
    }

    // A group size the scales do not have.
    let mut c = config.clone();
    c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = json!(64);
    std::fs::write(&config_path, c.to_string()).unwrap();
    let e = load_err(dir);
    assert!(
        e.contains(".weight_scale") && e.contains("group_size"),
        "{e}"
    );
    std::fs::write(&config_path, config.to_string()).unwrap();

    // A weight_shape that disagrees with the config, and packed words of the wrong dtype.
    let mut t = read_all(dir);
    let name = "model.layers.1.mlp.experts.3.down_proj";
    let (_, _, bytes) = t.get_mut(&format!("{name}.weight_shape")).unwrap();
    bytes[..4].copy_from_slice(&7i32.to_le_bytes());
    let broken = write_dir(&t, &config);
    let e = load_err(broken.path());
    assert!(e.contains(&format!("{name}.weight_shape")), "{e}");

    let mut t = read_all(dir);
    t.get_mut(&format!("{name}.weight_packed")).unwrap().0 = Dtype::F32;
    let broken = write_dir(&t, &config);
    let e = load_err(broken.path());
    assert!(
        e.contains(&format!("{name}.weight_packed")) && e.contains("I32"),
        "{e}"
    );

    // A NaN scale is named with its place; a packed weight that is gone is named as such; a
    // Linear stored both ways is refused.
    let mut t = read_all(dir);
    t.get_mut(&format!("{name}.weight_scale")).unwrap().2[2..4]
        .copy_from_slice(&0x7FC0u16.to_le_bytes());
    let broken = write_dir(&t, &config);
    let e = load_err(broken.path());
    assert!(
        e.contains(&format!("{name}.weight_scale"))
            && e.contains("non-finite scale (NaN) at [0, 1]"),
        "{e}"
    );
    let mut t = read_all(dir);
    t.remove(&format!("{name}.weight_packed"));
    let broken = write_dir(&t, &config);
    let e = load_err(broken.path());
    assert!(e.contains(&format!("`{name}.weight_packed` (int32")), "{e}");
    let mut t = read_all(dir);
    let shape = t[&format!("{name}.weight_shape")].clone();
    let dims: Vec<usize> = shape
        .2
        .chunks(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as usize)
        .collect();
    t.insert(
        format!("{name}.weight"),
        (Dtype::BF16, dims.clone(), vec![0u8; dims[0] * dims[1] * 2]),
    );
    let broken = write_dir(&t, &config);
    let e = load_err(broken.path());
    assert!(e.contains("not both"), "{e}");
}
