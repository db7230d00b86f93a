//! `convert` takes Kimi-K2-Thinking's int4 release (compressed-tensors `pack-quantized`, spec
//! `deepseek-v3-r1-kimi-k2.md` §2.3) as input: on a random checkpoint in that layout (the
//! `--random-quant w4a16` model), the bfloat16 output's expert weights are bf16(q · scale) for
//! every element, the W8A8 output's are those bf16 values quantized per row by §5.2, nothing of
//! the packed layout is left, and all three checkpoints give close log-probabilities.

use std::collections::HashMap;
use std::path::Path;

use cachalot_convert::{convert, read_header, ConvertOptions, QuantMode, TensorInfo};
use cachalot_kernels::{bf16_to_f32, f32_to_bf16, int8::quantize_row_bf16_to_int8};
use cachalot_model::{eval, DeepseekV3, LoadOptions};
use serde_json::Value;

/// name → (info, bytes) of every tensor in a checkpoint directory.
fn tensors(dir: &Path) -> HashMap<String, (TensorInfo, Vec<u8>)> {
    let mut all = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            for (name, t) in read_header(&path).unwrap() {
                let data = bytes[t.start as usize..t.end as usize].to_vec();
                all.insert(name, (t, data));
            }
        }
    }
    all
}

fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn options(input: &Path, output: &Path, mode: QuantMode) -> ConvertOptions {
    ConvertOptions {
        input: input.to_path_buf(),
        output: output.to_path_buf(),
        mode,
        c8_scales: None,
        quant_param_path: None,
        force: false,
        progress: false,
    }
}

fn run(input: &Path, output: &Path, mode: QuantMode) {
    let report = convert(&options(input, output, mode)).unwrap();
    assert!(report.tensors_written > 0);
}

#[test]
fn kimi_k2_thinking_int4_converts_to_bf16_and_w8a8() {
    let tmp = tempfile::tempdir().unwrap();
    let parent = tmp.path().join("random");
    std::fs::create_dir_all(&parent).unwrap();
    let int4 = cachalot_run::random_model::build("v3-tiny", "w4a16", Some(&parent)).unwrap();
    let (bf16_dir, w8_dir) = (tmp.path().join("bf16"), tmp.path().join("w8a8"));
    run(&int4.dir, &bf16_dir, QuantMode::Bfloat16);
    run(&int4.dir, &w8_dir, QuantMode::W8A8C16);

    let src = tensors(&int4.dir);
    let bf = tensors(&bf16_dir);
    let w8 = tensors(&w8_dir);
    let mut checked = 0;
    for (name, (info, words)) in &src {
        let Some(prefix) = name.strip_suffix(".weight_packed") else {
            continue;
        };
        let (rows, cols) = (info.shape[0], info.shape[1] * 8);
        let (sinfo, sbytes) = &src[&format!("{prefix}.weight_scale")];
        let groups = sinfo.shape[1];
        let group = cols / groups;
        let scales = u16s(sbytes);
        let weight = format!("{prefix}.weight");
        let (binfo, bbytes) = &bf[&weight];
        assert_eq!(
            (binfo.dtype.as_str(), &binfo.shape),
            ("BF16", &vec![rows, cols])
        );
        let got = u16s(bbytes);
        // The nibbles read as int32 words: column 8j + i is bits 4i..4i+4 of word j.
        for r in 0..rows {
            for j in 0..cols / 8 {
                let at = (r * cols / 8 + j) * 4;
                let word = u32::from_le_bytes(words[at..at + 4].try_into().unwrap());
                for i in 0..8 {
                    let c = 8 * j + i;
                    let q = ((word >> (4 * i)) & 0xF) as i32 - 8;
                    let s = bf16_to_f32(scales[r * groups + c / group]);
                    assert_eq!(
                        got[r * cols + c],
                        f32_to_bf16(q as f32 * s),
                        "{weight}[{r}, {c}]"
                    );
                }
            }
        }
        // W8A8: the same bf16 rows quantized by the §5.2 rule, one f32 scale per row.
        let (qinfo, qbytes) = &w8[&weight];
        let (scale_info, scale_bytes) = &w8[&format!("{prefix}.weight_scale")];
        assert_eq!(
            (qinfo.dtype.as_str(), &qinfo.shape),
            ("I8", &vec![rows, cols])
        );
        assert_eq!(
            (scale_info.dtype.as_str(), &scale_info.shape),
            ("F32", &vec![rows, 1])
        );
        for r in 0..rows {
            let mut q = vec![0i8; cols];
            let s = quantize_row_bf16_to_int8(&got[r * cols..(r + 1) * cols], &mut q);
            let want: Vec<u8> = q.iter().map(|&v| v as u8).collect();
            assert_eq!(
                &qbytes[r * cols..(r + 1) * cols],
                &want[..],
                "{weight} row {r}"
            );
            assert_eq!(
                &scale_bytes[r * 4..r * 4 + 4],
                &s.to_le_bytes(),
                "{weight} scale {r}"
            );
        }
        checked += 1;
    }
    assert!(
        checked >= 12,
        "only {checked} packed weights in the random model"
    );
    for out in [&bf, &w8] {
        assert!(out
            .keys()
            .all(|n| !n.ends_with(".weight_packed") && !n.ends_with(".weight_shape")));
    }
    let config = |dir: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
    };
    assert!(config(&bf16_dir).get("quantization_config").is_none());
    assert_eq!(
        config(&w8_dir)["quantization_config"]["format"],
        "int-quantized"
    );

    // All three run, and agree: bf16 rounds each q · scale once; W8A8 adds int8 weights and
    // activations (bounds as for the FP8 conversions, crates/cachalot-convert/tests/runtime.rs).
    let ids: Vec<u32> = (0..48).map(|i| (i * 37 + 5) % 512).collect();
    let lp = |dir: &Path| {
        let m = DeepseekV3::load(dir, LoadOptions::default()).unwrap();
        eval::next_token_logprobs(&m, &ids, 16).unwrap()
    };
    let (l4, lb, l8) = (lp(&int4.dir), lp(&bf16_dir), lp(&w8_dir));
    let mean = |v: &[f32]| v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
    let dmax = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    eprintln!(
        "int4 vs bf16: max {:.4}, mean NLL Δ {:.4}; bf16 vs w8a8: max {:.4}, mean NLL Δ {:.4}",
        dmax(&l4, &lb),
        mean(&l4) - mean(&lb),
        dmax(&lb, &l8),
        mean(&lb) - mean(&l8)
    );
    assert!(dmax(&l4, &lb) < 0.1 && (mean(&l4) - mean(&lb)).abs() < 0.05);
    assert!((mean(&lb) - mean(&l8)).abs() < 0.15);
    assert!(dmax(&lb, &l8) < 12.0);
}

/// Copies `from` to `to`, applying `edit` to every shard's tensor list and `config` to
/// config.json.
fn damaged_copy(
    from: &Path,
    to: &Path,
    edit: impl Fn(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
    config: impl FnOnce(&mut Value),
) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap();
        if path.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let mut list: Vec<_> = st
                .tensors()
                .into_iter()
                .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
                .collect();
            edit(&mut list);
            let views: Vec<(String, safetensors::tensor::TensorView)> = list
                .iter()
                .map(|(n, d, s, b)| {
                    let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
                    (n.clone(), v)
                })
                .collect();
            safetensors::serialize_to_file(views, None, &to.join(name)).unwrap();
        } else {
            std::fs::copy(&path, to.join(name)).unwrap();
        }
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(to.join("config.json")).unwrap()).unwrap();
    config(&mut cfg);
    std::fs::write(to.join("config.json"), cfg.to_string()).unwrap();
    // The index follows what the shards hold.
    let mut map = serde_json::Map::new();
    for e in std::fs::read_dir(to).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            for (n, _) in read_header(&path).unwrap() {
                map.insert(n, Value::String(file.clone()));
            }
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(to.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn damaged_int4_checkpoints_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let parent = tmp.path().join("random");
    std::fs::create_dir_all(&parent).unwrap();
    let int4 = cachalot_run::random_model::build("v3-tiny", "w4a16", Some(&parent)).unwrap();
    let victim = "model.layers.1.mlp.experts.2.up_proj";
    let keep = |_: &mut Value| {};
    type Edit = Box<dyn Fn(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>)>;
    type Config = Box<dyn FnOnce(&mut Value)>;
    let cases: Vec<(&str, Edit, Config, Vec<String>)> = vec![
        (
            "8-bit scheme",
            Box::new(|_| {}),
            Box::new(|c: &mut Value| {
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] =
                    8.into()
            }),
            vec!["config_groups.group_0.weights.num_bits".into()],
        ),
        (
            "no scales",
            Box::new(move |l| l.retain(|t| t.0 != format!("{victim}.weight_scale"))),
            Box::new(keep),
            vec![
                format!("{victim}.weight_packed"),
                format!("{victim}.weight_scale"),
            ],
        ),
        (
            "wrong shape",
            Box::new(move |l| {
                for t in l
                    .iter_mut()
                    .filter(|t| t.0 == format!("{victim}.weight_shape"))
                {
                    t.3[4..8].copy_from_slice(&1000i32.to_le_bytes());
                }
            }),
            Box::new(keep),
            vec![format!("{victim}.weight_shape"), "1000".into()],
        ),
        (
            "NaN scale",
            Box::new(move |l| {
                for t in l
                    .iter_mut()
                    .filter(|t| t.0 == format!("{victim}.weight_scale"))
                {
                    t.3[6..8].copy_from_slice(&0x7FC0u16.to_le_bytes());
                }
            }),
            Box::new(keep),
            vec![format!("{victim}.weight_scale"), "NaN".into()],
        ),
        (
            "huge scale",
            Box::new(move |l| {
                for t in l
                    .iter_mut()
                    .filter(|t| t.0 == format!("{victim}.weight_scale"))
                {
                    // bf16 0x7F62: ~3.0e38, eight times which overflows.
                    t.3[6..8].copy_from_slice(&0x7F62u16.to_le_bytes());
                }
            }),
            Box::new(keep),
            vec![
                format!("{victim}.weight_scale"),
                "[0, 3]".into(),
                "too large".into(),
            ],
        ),
        (
            "no int4 config",
            Box::new(|_| {}),
            Box::new(|c: &mut Value| {
                c.as_object_mut().unwrap().remove("quantization_config");
            }),
            vec!["weight_packed".into(), "pack-quantized".into()],
        ),
    ];
    for (i, (what, edit, config, parts)) in cases.into_iter().enumerate() {
        let input = tmp.path().join(format!("in{i}"));
        damaged_copy(&int4.dir, &input, edit, config);
        let out = tmp.path().join(format!("out{i}"));
        let e = convert(&options(&input, &out, QuantMode::W8A8C16))
            .expect_err(what)
            .to_string();
        eprintln!("{what}: {e}");
        for p in parts {
            assert!(e.contains(&p), "{what}: `{e}` does not name `{p}`");
        }
        assert!(!out.exists(), "{what}: a failed conversion left its output");
    }
}
