//! Random-weight DeepSeek-V4 checkpoints in the native release layout (spec `deepseek-v4.md`
//! §4.1), for `cachalot bench --random-weights v4-…` and offline runs with `with_ckpt: false`.
//!
//! The recipe of `tools/quant/v4_random_checkpoint.py`, ported so neither needs Python or torch:
//! FP8 e4m3 linears (values N(0, 64²) clamped to ±448) with F8_E8M0 128×128 block scales
//! `<name>.scale` (2^−12..2^−6); routed experts as packed e2m1 bytes (I8 `[N, K/2]`, uniform
//! codes) with F8_E8M0 scales per 32 columns (2^−9..2^−3); bf16 norms, router, compressor and
//! indexer projections, embedding and head (N(0, 0.05²)); f32 `hc_*`, `ape`, sinks and router
//! bias (N(0, 0.5²)); I64 `tid2eid` for the hash layers; `mtp.{j}.*` blocks. Shapes come from
//! the config (the loader's, `crates/cachalot-model/src/deepseek_v4.rs`); values differ from
//! the Python tool's (another generator). The model computes nothing meaningful.

use std::path::Path;

use anyhow::Result;
use cachalot_kernels::f32_to_bf16;
use cachalot_kernels::fp8::f32_to_e4m3;
use safetensors::tensor::Dtype;
use serde_json::{json, Value};

use crate::random_model::{field, field_or, write_checkpoint, Rng};

/// Named V4 shapes (those of the Python tool): `v4-tiny` (D 64, 4 experts, 4 layers + MTP) and
/// `v4-1b` (~1.2 B parameters, 32 experts top-6; the decode figures of docs/PERF.md).
pub fn preset(name: &str) -> Option<Value> {
    // D, F, E, layers, vocab, heads, head_dim, q_lora, o_lora, groups, hc, idx heads, idx dim, k
    let p: [usize; 14] = match name {
        "v4-tiny" => [64, 32, 4, 4, 128, 2, 64, 32, 32, 2, 2, 2, 32, 2],
        "v4-1b" => [2048, 1024, 32, 6, 8192, 8, 512, 512, 512, 4, 4, 8, 128, 6],
        _ => return None,
    };
    let layers = p[3];
    let ratios: Vec<usize> = (0..layers)
        .map(|i| [0, 4, 128, 4][i % 4])
        .chain([0])
        .collect();
    Some(json!({
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": p[4],
        "hidden_size": p[0],
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": p[5],
        "num_key_value_heads": 1,
        "head_dim": p[6],
        "qk_rope_head_dim": p[6] / 8,
        "q_lora_rank": p[7],
        "o_lora_rank": p[8],
        "o_groups": p[9],
        "sliding_window": 8,
        "compress_ratios": ratios,
        "compress_rope_theta": 160000,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-6,
        "n_routed_experts": p[2],
        "n_shared_experts": 1,
        "num_experts_per_tok": p[13],
        "moe_intermediate_size": p[1],
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": true,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "num_hash_layers": 3,
        "index_n_heads": p[11],
        "index_head_dim": p[12],
        "index_topk": 4,
        "hc_mult": p[10],
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "expert_dtype": "fp4",
        "quantization_config": native_quantization(),
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }))
}

/// The native release's `quantization_config` (FP8 with ue8m0 block scales).
pub fn native_quantization() -> Value {
    json!({"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
           "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
}

/// Whether a config.json describes a DeepSeek-V4 model.
pub fn is_v4(cfg: &Value) -> bool {
    cfg.get("model_type").and_then(Value::as_str) == Some("deepseek_v4")
        || cfg
            .get("architectures")
            .and_then(Value::as_array)
            .is_some_and(|a| {
                a.iter()
                    .any(|v| v.as_str() == Some("DeepseekV4ForCausalLM"))
            })
}

#[derive(Clone, Copy)]
enum Kind {
    /// e4m3 codes of N(0, 64²) clamped to ±448.
    Fp8,
    /// Packed e2m1 bytes, uniform.
    Fp4,
    /// E8M0 bytes uniform in lo..=hi.
    E8m0(u8, u8),
    /// bf16 N(0, 0.05²).
    Bf16,
    /// f32 N(0, 0.5²).
    F32,
    /// i64 uniform in 0..n.
    Ids(usize),
}

struct Spec {
    name: String,
    kind: Kind,
    shape: Vec<usize>,
}

/// The tensors of `cfg`, in the loader's order.
fn plan(cfg: &Value) -> Result<Vec<Spec>> {
    let d = field(cfg, "hidden_size")?;
    let f = field(cfg, "moe_intermediate_size")?;
    let e = field(cfg, "n_routed_experts")?;
    let layers = field(cfg, "num_hidden_layers")?;
    let v = field(cfg, "vocab_size")?;
    let nh = field(cfg, "num_attention_heads")?;
    let hd = field(cfg, "head_dim")?;
    let ql = field(cfg, "q_lora_rank")?;
    let ol = field(cfg, "o_lora_rank")?;
    let g = field(cfg, "o_groups")?;
    let hc = field(cfg, "hc_mult")?;
    let kk = field(cfg, "num_experts_per_tok")?;
    let hash_layers = field_or(cfg, "num_hash_layers", 0);
    let mtp_layers = field_or(cfg, "num_nextn_predict_layers", 0);
    let (hi, di) = (
        field_or(cfg, "index_n_heads", 0),
        field_or(cfg, "index_head_dim", 0),
    );
    let ratios: Vec<usize> = cfg
        .get("compress_ratios")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|x| x.as_u64().unwrap_or(0) as usize).collect())
        .unwrap_or_default();
    let ratio = |i: usize| ratios.get(i).copied().unwrap_or(0);
    if g == 0 || !(nh * hd).is_multiple_of(g) {
        anyhow::bail!("random V4 model: o_groups {g} must divide heads × head_dim ({nh} × {hd})");
    }

    let mut out: Vec<Spec> = Vec::new();
    let mut push =
        |name: String, kind: Kind, shape: Vec<usize>| out.push(Spec { name, kind, shape });
    let fp8 = |push: &mut dyn FnMut(String, Kind, Vec<usize>), p: &str, n: usize, k: usize| {
        push(format!("{p}.weight"), Kind::Fp8, vec![n, k]);
        push(
            format!("{p}.scale"),
            Kind::E8m0(115, 121),
            vec![n.div_ceil(128), k.div_ceil(128)],
        );
    };
    let fp4 = |push: &mut dyn FnMut(String, Kind, Vec<usize>), p: &str, n: usize, k: usize| {
        push(format!("{p}.weight"), Kind::Fp4, vec![n, k / 2]);
        push(format!("{p}.scale"), Kind::E8m0(118, 124), vec![n, k / 32]);
    };
    let hc_params = |push: &mut dyn FnMut(String, Kind, Vec<usize>), p: &str| {
        let mix = (2 + hc) * hc;
        for site in ["attn", "ffn"] {
            push(format!("{p}hc_{site}_fn"), Kind::F32, vec![mix, hc * d]);
            push(format!("{p}hc_{site}_base"), Kind::F32, vec![mix]);
            push(format!("{p}hc_{site}_scale"), Kind::F32, vec![3]);
        }
    };
    let compressor =
        |push: &mut dyn FnMut(String, Kind, Vec<usize>), p: &str, ratio: usize, width: usize| {
            let c = if ratio == 4 { 2 } else { 1 };
            push(format!("{p}wkv.weight"), Kind::Bf16, vec![c * width, d]);
            push(format!("{p}wgate.weight"), Kind::Bf16, vec![c * width, d]);
            push(format!("{p}ape"), Kind::F32, vec![ratio, c * width]);
            push(format!("{p}norm.weight"), Kind::Bf16, vec![width]);
        };
    let block = |push: &mut dyn FnMut(String, Kind, Vec<usize>), p: &str, r: usize, hash: bool| {
        hc_params(push, p);
        push(format!("{p}attn_norm.weight"), Kind::Bf16, vec![d]);
        push(format!("{p}ffn_norm.weight"), Kind::Bf16, vec![d]);
        let a = format!("{p}attn.");
        fp8(push, &format!("{a}wq_a"), ql, d);
        push(format!("{a}q_norm.weight"), Kind::Bf16, vec![ql]);
        fp8(push, &format!("{a}wq_b"), nh * hd, ql);
        fp8(push, &format!("{a}wkv"), hd, d);
        push(format!("{a}kv_norm.weight"), Kind::Bf16, vec![hd]);
        fp8(push, &format!("{a}wo_a"), g * ol, nh * hd / g);
        fp8(push, &format!("{a}wo_b"), d, g * ol);
        push(format!("{a}attn_sink"), Kind::F32, vec![nh]);
        if r > 0 {
            compressor(push, &format!("{a}compressor."), r, hd);
        }
        if r == 4 {
            fp8(push, &format!("{a}indexer.wq_b"), hi * di, ql);
            push(
                format!("{a}indexer.weights_proj.weight"),
                Kind::Bf16,
                vec![hi, d],
            );
            compressor(push, &format!("{a}indexer.compressor."), r, di);
        }
        let m = format!("{p}ffn.");
        push(format!("{m}gate.weight"), Kind::Bf16, vec![e, d]);
        if hash {
            push(format!("{m}gate.tid2eid"), Kind::Ids(e), vec![v, kk]);
        } else {
            push(format!("{m}gate.bias"), Kind::F32, vec![e]);
        }
        for j in 0..e {
            fp4(push, &format!("{m}experts.{j}.w1"), f, d);
            fp4(push, &format!("{m}experts.{j}.w2"), d, f);
            fp4(push, &format!("{m}experts.{j}.w3"), f, d);
        }
        fp8(push, &format!("{m}shared_experts.w1"), f, d);
        fp8(push, &format!("{m}shared_experts.w2"), d, f);
        fp8(push, &format!("{m}shared_experts.w3"), f, d);
    };

    push("embed.weight".into(), Kind::Bf16, vec![v, d]);
    push("head.weight".into(), Kind::Bf16, vec![v, d]);
    push("norm.weight".into(), Kind::Bf16, vec![d]);
    push("hc_head_fn".into(), Kind::F32, vec![hc, hc * d]);
    push("hc_head_base".into(), Kind::F32, vec![hc]);
    push("hc_head_scale".into(), Kind::F32, vec![1]);
    for i in 0..layers {
        block(
            &mut push,
            &format!("layers.{i}."),
            ratio(i),
            i < hash_layers,
        );
    }
    for j in 0..mtp_layers {
        let p = format!("mtp.{j}.");
        fp8(&mut push, &format!("{p}e_proj"), d, d);
        fp8(&mut push, &format!("{p}h_proj"), d, d);
        for n in ["enorm", "hnorm", "norm"] {
            push(format!("{p}{n}.weight"), Kind::Bf16, vec![d]);
        }
        push(format!("{p}hc_head_fn"), Kind::F32, vec![hc, hc * d]);
        push(format!("{p}hc_head_base"), Kind::F32, vec![hc]);
        push(format!("{p}hc_head_scale"), Kind::F32, vec![1]);
        block(&mut push, &p, ratio(layers + j), false);
    }
    Ok(out)
}

fn generate(s: &Spec) -> (Dtype, Vec<u8>) {
    let n: usize = s.shape.iter().product();
    let mut rng = Rng::for_name(&s.name);
    match s.kind {
        Kind::Fp8 => (
            Dtype::F8_E4M3,
            (0..n)
                .map(|_| f32_to_e4m3((rng.normal() * 64.0).clamp(-448.0, 448.0)))
                .collect(),
        ),
        Kind::Fp4 => (Dtype::I8, (0..n).map(|_| rng.next() as u8).collect()),
        Kind::E8m0(lo, hi) => (
            Dtype::F8_E8M0,
            (0..n)
                .map(|_| lo + (rng.next() % (hi - lo + 1) as u64) as u8)
                .collect(),
        ),
        Kind::Bf16 => {
            let v: Vec<u16> = (0..n).map(|_| f32_to_bf16(rng.normal() * 0.05)).collect();
            (Dtype::BF16, cachalot_kernels::u16s_to_le_bytes(&v))
        }
        Kind::F32 => {
            let v: Vec<f32> = (0..n).map(|_| rng.normal() * 0.5).collect();
            (Dtype::F32, cachalot_kernels::f32s_to_le_bytes(&v))
        }
        Kind::Ids(e) => (
            Dtype::I64,
            (0..n)
                .flat_map(|_| ((rng.next() % e.max(1) as u64) as i64).to_le_bytes())
                .collect(),
        ),
    }
}

/// Bytes of the checkpoint `cfg` describes (for messages).
pub fn native_bytes(cfg: &Value) -> Result<u64> {
    Ok(plan(cfg)?
        .iter()
        .map(native_bytes_of)
        .fold(0u64, u64::saturating_add))
}

/// Writes the native FP8 + MXFP4 checkpoint of `cfg` (its `quantization_config` replaced by the
/// native one) into `dir` (created): about 256 MB per shard, `model.safetensors.index.json`,
/// `config.json`.
pub fn write_native(cfg: &Value, dir: &Path) -> Result<()> {
    let specs = plan(cfg)?;
    // Contiguous shards of about 256 MB.
    let mut shards: Vec<Vec<&Spec>> = vec![Vec::new()];
    let mut bytes = 0u64;
    for s in &specs {
        let b = native_bytes_of(s);
        if bytes > 0 && bytes + b > 256 << 20 {
            shards.push(Vec::new());
            bytes = 0;
        }
        bytes += b;
        shards.last_mut().expect("a shard").push(s);
    }
    let mut cfg = cfg.clone();
    if let Some(o) = cfg.as_object_mut() {
        o.insert("quantization_config".into(), native_quantization());
    }
    write_checkpoint(
        dir,
        &cfg,
        &shards,
        |s| (s.name.as_str(), s.shape.as_slice()),
        generate,
    )
}

fn native_bytes_of(s: &Spec) -> u64 {
    let n = s
        .shape
        .iter()
        .fold(1u64, |n, &x| n.saturating_mul(x as u64));
    n.saturating_mul(match s.kind {
        Kind::Fp8 | Kind::Fp4 | Kind::E8m0(..) => 1,
        Kind::Bf16 => 2,
        Kind::F32 => 4,
        Kind::Ids(_) => 8,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_preset_loads_with_its_mtp_block() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let cfg = preset("v4-tiny").expect("preset");
        write_native(&cfg, tmp.path()).expect("write");
        let model = cachalot_model::DeepseekV4::load(
            tmp.path(),
            cachalot_model::V4LoadOptions {
                load_mtp: true,
                ..Default::default()
            },
        )
        .expect("the random V4 checkpoint loads, MTP block included");
        assert_eq!(model.config().hidden_size, 64);
        assert_eq!(model.routed_expert_format(), Some("mxfp4"));
        assert!(native_bytes(&cfg).unwrap() > 0);
    }

    #[test]
    fn bench_builds_every_v4_format() {
        let tmp = tempfile::tempdir().expect("tempdir");
        for (quant, experts) in [
            ("fp8", "mxfp4"),
            ("w8a8-int", "w8a8_int8"),
            ("w4a8-int", "w4a8_int4"),
        ] {
            let m = crate::random_model::build("v4-tiny", quant, Some(tmp.path())).expect(quant);
            let model = cachalot_model::DeepseekV4::load(&m.dir, Default::default()).expect(quant);
            assert_eq!(model.routed_expert_format(), Some(experts), "{quant}");
        }
        let err = crate::random_model::build("v4-tiny", "w8a8c16", Some(tmp.path()))
            .err()
            .expect("an error");
        assert!(err.to_string().contains("w4a8-mx-hif"), "{err}");
    }
}
