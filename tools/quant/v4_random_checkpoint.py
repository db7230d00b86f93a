#!/usr/bin/env python3
"""A random checkpoint in the native DeepSeek-V4 layout (spec deepseek-v4.md §4.1): FP8 e4m3
weights with F8_E8M0 128x128 block scales `<layer>.scale`, routed experts as packed e2m1 (I8
[N, K/2]) with F8_E8M0 scales per 32 columns, BF16 compressor / indexer projections, F32 hc_*,
ape and sinks, I64 tid2eid for the hash layers, an `mtp.0.*` block, a config.json with
compress_ratios and the fp8 quantization_config, and model.safetensors.index.json.

The values are random (seeded) and the model computes nothing meaningful: the checkpoint exists to
test the converter (tools/quant/v4_convert_reference.py, crates/cachalot-convert/tests/v4_*.rs)
and to measure it.

  --size tiny   the committed fixture fixtures/v4/tiny (D = 64, 4 routed experts, 4 layers +
                MTP, 2 shards, ~0.4 MB); hidden/expert widths are not multiples of 128, so FP8
                scale grids have ragged edge blocks
  --size bench  a larger one for throughput measurements (not committed; ~0.5 GB)
  --size v4-1b  ~1.2 B parameters, 32 experts top-6 (decode figures in docs/PERF.md; ~1.3 GB)

Usage: /work/venv/ref/bin/python tools/quant/v4_random_checkpoint.py --size tiny --out fixtures/v4/tiny
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

SIZES = {
    # D, F, E, layers, vocab, heads, head_dim, q_lora, o_lora, groups, hc, idx heads, idx dim
    "tiny": dict(D=64, F=32, E=4, L=4, V=128, H=2, hd=64, ql=32, ol=32, G=2, hc=2, Hi=2, Di=32,
                 shards=2),
    "bench": dict(D=2048, F=1024, E=16, L=4, V=4096, H=8, hd=512, ql=512, ol=512, G=4, hc=4,
                  Hi=8, Di=128, shards=4),
    # ~1.2 B parameters, top-6 of 32 experts: for decode tokens/s (docs/PERF.md; not committed)
    "v4-1b": dict(D=2048, F=1024, E=32, L=6, V=8192, H=8, hd=512, ql=512, ol=512, G=4, hc=4,
                  Hi=8, Di=128, shards=6, k=6),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=4)
    args = ap.parse_args()
    p = SIZES[args.size]
    g = torch.Generator().manual_seed(args.seed)
    D, F, E, L, V = p["D"], p["F"], p["E"], p["L"], p["V"]
    H, hd, ql, ol, G, hc, Hi, Di = p["H"], p["hd"], p["ql"], p["ol"], p["G"], p["hc"], p["Hi"], p["Di"]
    ratios = ([0, 4, 128, 4] * L)[:L] + [0]
    k_act = p.get("k", 2)

    def normal(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std

    def e8m0(shape, lo, hi):
        b = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int32).to(torch.uint8)
        return b.view(torch.float8_e8m0fnu)

    tensors = {}  # name -> tensor, in creation order

    def bf16(name, *shape):
        tensors[name] = normal(*shape).to(torch.bfloat16)

    def f32(name, *shape):
        tensors[name] = normal(*shape, std=0.5).to(torch.float32)

    def fp8(prefix, n, k):
        # Values spread over the e4m3 range (subnormals included); scales 2^-12 .. 2^-6.
        v = torch.randn(n, k, generator=g) * 64
        tensors[f"{prefix}.weight"] = v.clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[f"{prefix}.scale"] = e8m0(((n + 127) // 128, (k + 127) // 128), 115, 121)

    def fp4(prefix, n, k):
        codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32)
        tensors[f"{prefix}.weight"] = codes.to(torch.uint8).view(torch.int8)
        tensors[f"{prefix}.scale"] = e8m0((n, k // 32), 118, 124)

    def hc_params(prefix):
        mix = (2 + hc) * hc
        f32(f"{prefix}hc_attn_fn", mix, hc * D)
        f32(f"{prefix}hc_attn_base", mix)
        f32(f"{prefix}hc_attn_scale", 3)
        f32(f"{prefix}hc_ffn_fn", mix, hc * D)
        f32(f"{prefix}hc_ffn_base", mix)
        f32(f"{prefix}hc_ffn_scale", 3)

    def block(prefix, layer, ratio, hash_layer, mtp):
        hc_params(prefix)
        bf16(f"{prefix}attn_norm.weight", D)
        bf16(f"{prefix}ffn_norm.weight", D)
        a = f"{prefix}attn."
        fp8(a + "wq_a", ql, D)
        bf16(a + "q_norm.weight", ql)
        fp8(a + "wq_b", H * hd, ql)
        fp8(a + "wkv", hd, D)
        bf16(a + "kv_norm.weight", hd)
        fp8(a + "wo_a", G * ol, H * hd // G)
        fp8(a + "wo_b", D, G * ol)
        f32(a + "attn_sink", H)
        if ratio and not mtp:
            c = 2 if ratio == 4 else 1
            bf16(a + "compressor.wkv.weight", c * hd, D)
            bf16(a + "compressor.wgate.weight", c * hd, D)
            f32(a + "compressor.ape", ratio, c * hd)
            bf16(a + "compressor.norm.weight", hd)
            if ratio == 4:
                fp8(a + "indexer.wq_b", Hi * Di, ql)
                bf16(a + "indexer.weights_proj.weight", Hi, D)
                bf16(a + "indexer.compressor.wkv.weight", 2 * Di, D)
                bf16(a + "indexer.compressor.wgate.weight", 2 * Di, D)
                f32(a + "indexer.compressor.ape", 4, 2 * Di)
                bf16(a + "indexer.compressor.norm.weight", Di)
        m = f"{prefix}ffn."
        bf16(m + "gate.weight", E, D)
        if hash_layer:
            tensors[m + "gate.tid2eid"] = torch.randint(0, E, (V, k_act), generator=g)
        else:
            f32(m + "gate.bias", E)
        for e in range(E):
            fp4(f"{m}experts.{e}.w1", F, D)
            fp4(f"{m}experts.{e}.w2", D, F)
            fp4(f"{m}experts.{e}.w3", F, D)
        fp8(m + "shared_experts.w1", F, D)
        fp8(m + "shared_experts.w2", D, F)
        fp8(m + "shared_experts.w3", F, D)

    bf16("embed.weight", V, D)
    bf16("head.weight", V, D)
    bf16("norm.weight", D)
    f32("hc_head_fn", hc, hc * D)
    f32("hc_head_base", hc)
    f32("hc_head_scale", 1)
    for i in range(L):
        block(f"layers.{i}.", i, ratios[i], i < 3, False)
    fp8("mtp.0.e_proj", D, D)
    fp8("mtp.0.h_proj", D, D)
    for n in ["enorm", "hnorm", "norm"]:
        bf16(f"mtp.0.{n}.weight", D)
    f32("mtp.0.hc_head_fn", hc, hc * D)
    f32("mtp.0.hc_head_base", hc)
    f32("mtp.0.hc_head_scale", 1)
    block("mtp.0.", L, 0, False, True)

    # Shards: a contiguous split of the tensor list; one scale is moved to another shard than
    # its weight (the index, not the shard, says where a tensor lives).
    names = list(tensors)
    n_sh = p["shards"]
    files = [f"model-{i + 1:05d}-of-{n_sh:05d}.safetensors" for i in range(n_sh)]
    shard_of = {n: files[min(i * n_sh // len(names), n_sh - 1)] for i, n in enumerate(names)}
    if "layers.1.attn.wo_b.scale" in shard_of:
        shard_of["layers.1.attn.wo_b.scale"] = files[-1]
    os.makedirs(args.out, exist_ok=True)
    for f in files:
        save_file({n: tensors[n].contiguous() for n in names if shard_of[n] == f},
                  os.path.join(args.out, f), metadata={"format": "pt"})
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: shard_of[n] for n in sorted(names)}}, f,
                  indent=2)
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": V,
        "hidden_size": D,
        "num_hidden_layers": L,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": H,
        "num_key_value_heads": 1,
        "head_dim": hd,
        "qk_rope_head_dim": hd // 8,
        "q_lora_rank": ql,
        "o_lora_rank": ol,
        "o_groups": G,
        "sliding_window": 8,
        "compress_ratios": ratios,
        "compress_rope_theta": 160000,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-6,
        "n_routed_experts": E,
        "n_shared_experts": 1,
        "num_experts_per_tok": k_act,
        "moe_intermediate_size": F,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "num_hash_layers": 3,
        "index_n_heads": Hi,
        "index_head_dim": Di,
        "index_topk": 4,
        "hc_mult": hc,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "expert_dtype": "fp4",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in files)
    print(f"wrote {len(names)} tensors, {total / 1e6:.2f} MB in {n_sh} shards to {args.out}")


if __name__ == "__main__":
    main()
