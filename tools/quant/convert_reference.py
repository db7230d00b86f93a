#!/usr/bin/env python3
"""Independent implementation of the seed's FP8 -> bfloat16 / W8A8C16 / W8A8C8 conversion rules
(spec deepseek-v3-r1-kimi-k2.md §5), in torch bf16 tensor arithmetic as the seed's
convert_model.py runs it, applied to the FP8 fixture models.

It writes one compact summary per model, fixtures/v3/converted/<model>.json:

  {"<mode>": {"config": <config.json as the converter writes it>,
              "weight_map": {tensor: shard},
              "tensors": {tensor: [shard, dtype, shape, sha256 of the raw little-endian bytes]}}}

and the C8 scales file it uses for w8a8c8, fixtures/v3/converted/c8_scales_<model>.json.
The Rust test crates/cachalot-convert/tests/reference.rs converts the same models and compares
every tensor name, shard, dtype, shape and byte (through the hash), and the config and index.

Usage (from the repository root): /work/venv/ref/bin/python tools/quant/convert_reference.py
"""
import argparse
import hashlib
import json
import os

import torch
from safetensors import safe_open

MODES = ["bfloat16", "w8a8c16", "w8a8c8"]


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().tobytes()
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().tobytes()
    return t.numpy().tobytes()


DTYPE = {
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float16: "F16",
}


def dequant(w: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """Spec §2.2: f32 upcast times the expanded block scales, then cast to bf16."""
    m, n = w.shape
    br, bc = block
    full = s.repeat_interleave(br, 0)[:m].repeat_interleave(bc, 1)[:, :n]
    return (w.to(torch.float32) * full).to(torch.bfloat16)


def quant_int8(w: torch.Tensor):
    """Spec §5.2, every step a bf16 tensor op (f32 compute, bf16 result)."""
    assert w.dtype == torch.bfloat16
    amax = w.abs().amax(dim=1, keepdim=True)
    s = amax / 127.0
    assert s.dtype == torch.bfloat16
    t = w / s
    q = torch.round(t).clamp(-127, 127)
    q = torch.where(s == 0, torch.zeros_like(q), q).to(torch.int8)
    return q, s.to(torch.float32)


def ignore_list(num_hidden, num_layers):
    out = []
    for i in range(num_layers):
        out.append(f"model.layers.{i}.self_attn.kv_b_proj")
        if i >= 3:
            out.append(f"model.layers.{i}.mlp.gate")
        if i >= num_hidden:
            out.append(f"model.layers.{i}.eh_proj")
            out.append(f"model.layers.{i}.shared_head.head")
    out.append("lm_head")
    return out


def quant_config(ignore, c8):
    return {
        "config_groups": {
            "group_0": {
                "input_activations": {
                    "actorder": None, "block_structure": None, "dynamic": True, "group_size": None,
                    "num_bits": 8, "observer": "memoryless", "observer_kwargs": {},
                    "strategy": "token", "symmetric": True, "type": "int",
                },
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
                    "num_bits": 8, "observer": "minmax", "observer_kwargs": {},
                    "strategy": "channel", "symmetric": True, "type": "int",
                },
            }
        },
        "format": "int-quantized",
        "global_compression_ratio": 1,
        "ignore": ignore,
        "kv_cache_scheme": (
            {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True}
            if c8 else None
        ),
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def convert(model_dir, mode, c8_scales):
    config = json.load(open(os.path.join(model_dir, "config.json")))
    block = config["quantization_config"].get("weight_block_size", [128, 128])
    del config["quantization_config"]
    num_hidden = config["num_hidden_layers"]
    num_layers = num_hidden + config.get("num_nextn_predict_layers", 0)
    index = json.load(open(os.path.join(model_dir, "model.safetensors.index.json")))["weight_map"]
    ignore = ignore_list(num_hidden, num_layers)
    int8 = mode != "bfloat16"
    handles = {}

    def tensor(name):
        f = index[name]
        if f not in handles:
            handles[f] = safe_open(os.path.join(model_dir, f), "pt")
        return handles[f].get_tensor(name)

    out = {}  # name -> (shard, tensor)
    files = sorted(set(index.values()))
    for f in files:
        with safe_open(os.path.join(model_dir, f), "pt") as h:
            for name in h.keys():
                if name.endswith("_scale_inv"):
                    continue
                t = h.get_tensor(name)
                if t.element_size() != 1:
                    out[name] = (f, t)
                    continue
                w = dequant(t, tensor(name + "_scale_inv"), block)
                if not int8 or any(m in name for m in ignore):
                    out[name] = (f, w)
                else:
                    q, s = quant_int8(w)
                    out[name] = (f, q)
                    out[name.replace("weight", "weight_scale")] = (f, s)
    if mode == "w8a8c8":
        for i, s in enumerate(c8_scales):
            out[f"model.layers.{i}.self_attn.ckv_scale"] = (files[-1], torch.tensor([s], dtype=torch.float32))
    if int8:
        config["quantization_config"] = quant_config(ignore, mode == "w8a8c8")
    return {
        "config": config,
        "weight_map": {n: f for n, (f, _) in sorted(out.items())},
        "tensors": {
            n: [f, DTYPE[t.dtype], list(t.shape), hashlib.sha256(raw_bytes(t)).hexdigest()]
            for n, (f, t) in sorted(out.items())
        },
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="fixtures/v3")
    ap.add_argument("--models", nargs="+", default=["r1_tiny", "kimi_tiny", "v3_noq_tiny"])
    args = ap.parse_args()
    out_dir = os.path.join(args.fixtures, "converted")
    os.makedirs(out_dir, exist_ok=True)
    for model in args.models:
        d = os.path.join(args.fixtures, model)
        cfg = json.load(open(os.path.join(d, "config.json")))
        n = cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)
        # Fixed, distinct, bf16-unfriendly scales so the C8 tensors are checked bit for bit.
        c8 = [0.0123 * (i + 1) + 1e-7 for i in range(n)]
        c8 = [float(torch.tensor(s, dtype=torch.float32)) for s in c8]
        with open(os.path.join(out_dir, f"c8_scales_{model}.json"), "w") as f:
            json.dump({"format": "cachalot-c8-scales", "ckv_scale": c8}, f, indent=2)
            f.write("\n")
        summary = {mode: convert(d, mode, c8) for mode in MODES}
        with open(os.path.join(out_dir, f"{model}.json"), "w") as f:
            json.dump(summary, f, indent=1, sort_keys=False)
            f.write("\n")
        print(model, {m: len(s["tensors"]) for m, s in summary.items()})


if __name__ == "__main__":
    main()
