#!/usr/bin/env python3
"""Independent implementation of the DeepSeek-V4 conversion rules (spec deepseek-v4.md §4.2-§4.6,
§1.2) in torch bf16 tensor arithmetic, as the seed's convert_model.py runs them (default dtype
bf16: every op computes in f32 and rounds to bf16), applied to the V4 fixture checkpoint
fixtures/v4/tiny (made by tools/quant/v4_random_checkpoint.py).

Writes fixtures/v4/converted/<quant type>.json for bfloat16, w8a8-int, w4a8-int, w4a8-mx and
w4a8-mx-hif:

  {"config": <config.json as converted>,
   "weight_map": {tensor: shard},
   "tensors": {tensor: [shard, dtype, shape, sha256 of the raw LE bytes]},
   "int4": {weight: {"scale": [f32 per row], "bias": [f32 per row]}}}

and fixtures/v4/converted/convert_config.json, the quantization_config convert_config.py writes
(keys "plain" and "hif"). crates/cachalot-convert/tests/
v4_reference.rs converts the same checkpoint and compares every tensor bit for bit, except the
INT4 range search (§4.4), which it compares per row with a tolerance.

Usage (from the repository root): /work/venv/ref/bin/python tools/quant/v4_convert_reference.py
"""
import hashlib
import json
import os
import sys

import numpy as np
import torch
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert_reference import quant_int8, raw_bytes  # noqa: E402  (§5.2 = §4.3 INT8 rule)

TYPES = ["bfloat16", "w8a8-int", "w4a8-int", "w4a8-mx", "w4a8-mx-hif"]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int8: "I8", torch.uint8: "U8",
         torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64", torch.uint64: "U64",
         torch.float8_e8m0fnu: "F8_E8M0"}


def as_bytes(t):
    t = t.contiguous()
    if t.dtype == torch.uint64:
        return t.view(torch.int64).numpy().tobytes()
    return raw_bytes(t)


# ---------------------------------------------------------------- dequantisation (§4.1)

def e8m0_value(s):
    return torch.exp2(s.view(torch.uint8).to(torch.float32) - 127.0)


def dequant_fp8(w, s):
    n, k = w.shape
    full = e8m0_value(s).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (w.to(torch.float32) * full).to(torch.bfloat16)


def dequant_fp4(w, s):
    b = w.view(torch.uint8).to(torch.int64)
    lut = torch.tensor(E2M1, dtype=torch.float32)
    vals = torch.stack([lut[b & 15], lut[b >> 4]], dim=-1).reshape(b.shape[0], -1)
    full = e8m0_value(s).repeat_interleave(32, 1)[:, :vals.shape[1]]
    return (vals * full).to(torch.bfloat16)


# ---------------------------------------------------------------- §4.4 INT4 search

def quant_int4(w):
    """Per row: 61 clip candidates, bf16 arithmetic, first strictly smallest loss."""
    assert w.dtype == torch.bfloat16
    mx = w.max(dim=1, keepdim=True)[0]
    best = torch.full_like(mx, float("inf"))
    clip = torch.zeros_like(mx)
    for i in range(61):
        c = (0.7 + 0.01 * i) * mx
        s = c / 7
        q = (torch.clamp(w, -c, c) * (1.0 / s)).round() * s
        loss = ((w - q) ** 2).sum(dim=1, keepdim=True)
        better = loss < best
        best = torch.where(better, loss, best)
        clip = torch.where(better, c, clip)
    scale = clip / 7
    q = (torch.clamp(w, -clip, clip) * (1.0 / scale)).round()
    q = torch.nan_to_num(q, nan=0.0).clamp(-7, 7).to(torch.int8)
    bias = (scale * q * 8).sum(dim=1).float()
    qt = q.T.contiguous()  # [K, N]: pack pairs of output rows
    packed = ((qt[:, 0::2] & 0x0F) | (qt[:, 1::2] << 4)).T.contiguous()
    s32 = scale.float().numpy().reshape(-1).view(np.uint32).astype(np.uint64)
    return packed, torch.from_numpy(s32.reshape(-1, 1).view(np.int64)).view(torch.uint64), bias, \
        scale.float().reshape(-1)


# ---------------------------------------------------------------- §4.5 quantize_mx

def quant_mx(w, bits):
    """Blocks of 32 along the row; bf16 ops as the seed runs them."""
    assert w.dtype == torch.bfloat16
    emax, emin, mb, maxv = (8, -6, 3, 448.0) if bits == 8 else (2, 0, 1, 6.0)
    n, k = w.shape
    pad = (-k) % 32
    x = torch.nn.functional.pad(w, (0, pad)).reshape(n, -1, 32)
    amax = x.abs().amax(dim=2, keepdim=True)
    amax = torch.where(amax == 0, torch.full_like(amax, 2.0 ** -126), amax)
    e = torch.floor(torch.log2(amax))
    e = torch.where(amax / torch.exp2(e) > 1.75, e + 1, e)
    se = torch.clamp(e - emax, min=-127)
    v = x / torch.exp2(se)
    pe = torch.floor(torch.log2(v.abs() + (v == 0).to(v.dtype))).clamp(min=emin)
    t = v / torch.exp2(pe) * (2 ** mb)
    r = torch.sign(t) * torch.floor(t.abs() + 0.5)
    q = (r / (2 ** mb) * torch.exp2(pe)).clamp(-maxv, maxv)
    q = q.reshape(n, -1)[:, :k]
    scale = (se + 127).to(torch.uint8).reshape(n, -1)
    if bits == 8:
        return q.to(torch.float8_e4m3fn), scale
    # e2m1 codes: sign bit 8, magnitude index on the grid (values are exactly on it)
    qf = q.float()
    mags = torch.tensor(E2M1[:8])
    idx = (qf.abs().unsqueeze(-1) == mags).float().argmax(-1)
    codes = (idx | (torch.signbit(qf).to(torch.int64) << 3)).to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)), scale


# ---------------------------------------------------------------- §4.6 HiF8

def hif8_encode(x):
    """fp32 -> HiF8 code, ties away, Inf on overflow (written from the spec's rules)."""
    if np.isnan(x):
        return 0x80
    if x == 0:
        return 0
    s = 0x80 if x < 0 else 0
    a = abs(float(x))
    if np.isinf(a):
        return s | 0x6F
    m, e = np.frexp(np.float32(a))  # a = m * 2^e, m in [0.5, 1)
    e = int(e) - 1
    frac = float(m) * 2 - 1  # mantissa fraction in [0, 1)
    if e > 15:
        return s | 0x6F
    if e < -23:
        return 0
    if e == -23:
        e, kept = -22, 0
    else:
        ae = abs(e)
        w = 3 if ae <= 3 else 2 if ae <= 7 else 1 if ae <= 15 else 0
        u = frac * (1 << w) + 0.5  # exact in double
        kept = int(np.floor(u))
        if kept >= (1 << w):
            e, kept = e + 1, 0
    if e > 15 or (e == 15 and kept):
        return s | 0x6F
    if e <= -16:
        return s | (e + 23)
    ae, neg = abs(e), int(e < 0)
    if ae == 0:
        c = 0b0001000 | kept
    elif ae == 1:
        c = 0b0010000 | neg << 3 | kept
    elif ae <= 3:
        c = 0b0100000 | neg << 4 | (ae - 2) << 3 | kept
    elif ae <= 7:
        c = 0b1000000 | neg << 4 | (ae - 4) << 2 | kept
    else:
        c = 0b1100000 | neg << 4 | (ae - 8) << 1 | kept
    return s | c


def quant_hif8(w):
    x = w.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = amax / 32768.0
    q = np.zeros(x.shape, dtype=np.uint8)
    xs = x.numpy()
    sn = scale.numpy()
    for i in range(xs.shape[0]):
        if sn[i, 0] == 0:
            continue
        row = (xs[i] / sn[i, 0]).astype(np.float32)
        q[i] = [hif8_encode(v) for v in row]
    return torch.from_numpy(q), scale


# ---------------------------------------------------------------- §4.2 layer sets and config

def quant_layers(num_layers, num_experts, ratios, w4a8, mx, hif):
    q = {}
    moe = 4 if w4a8 else 8
    for i in range(num_layers):
        for j in range(num_experts):
            for n in ("w1", "w2", "w3"):
                q[f"layers.{i}.ffn.experts.{j}.{n}"] = moe
        for n in ("w1", "w2", "w3"):
            q[f"layers.{i}.ffn.shared_experts.{n}"] = 8
        names = ["wq_b", "wo_b"] + (["wq_a", "wkv", "wo_a"] if mx else [])
        if ratios[i] == 4:
            names.append("indexer.wq_b")
            if hif:
                names += ["compressor.wkv", "compressor.wgate", "indexer.weights_proj",
                          "indexer.compressor.wkv", "indexer.compressor.wgate"]
        elif ratios[i] == 128 and hif:
            names += ["compressor.wkv", "compressor.wgate"]
        for n in names:
            q[f"layers.{i}.attn.{n}"] = 8
    for j in range(num_experts):
        for n in ("w1", "w2", "w3"):
            q[f"mtp.0.ffn.experts.{j}.{n}"] = moe
    for n in ("w1", "w2", "w3"):
        q[f"mtp.0.ffn.shared_experts.{n}"] = 8
    for n in ["attn.wq_b", "attn.wo_b", "e_proj", "h_proj"] + (
            ["attn.wq_a", "attn.wkv", "attn.wo_a"] if mx else []):
        q[f"mtp.0.{n}"] = 8
    return q


def ignore_list(num_layers, ratios, is_fp, hif):
    out = []
    for i in range(num_layers):
        if not is_fp:
            out += [f"layers.{i}.attn.{n}" for n in ("wq_a", "wkv", "wo_a")]
        if ratios[i] == 4 and not hif:
            out += [f"layers.{i}.attn.{n}" for n in (
                "indexer.weights_proj", "indexer.compressor.wgate", "indexer.compressor.wkv",
                "compressor.wgate", "compressor.wkv")]
        if ratios[i] == 128 and not hif:
            out += [f"layers.{i}.attn.{n}" for n in ("compressor.wgate", "compressor.wkv")]
    if not is_fp:
        out += [f"mtp.0.attn.{n}" for n in ("wq_a", "wkv", "wo_a")]
    return out + ["mtp.0.head", "head"]


def group(w_bits, qtype, is_mx, hif, a_strategy_hif):
    a_group = w_group = w_block = None
    if hif:
        a_s, w_s = a_strategy_hif, "channel"
    elif qtype == "int":
        a_s, w_s = "token", "channel"
    elif is_mx:
        a_s, w_s, a_group, w_group = "group", "group", 32, 32
    else:
        a_s, w_s, a_group, w_block = "group", "block", 128, "128x128"

    def spec(strategy, gs, bits, block, dynamic, observer):
        return {"actorder": None, "block_structure": block, "dynamic": dynamic, "group_size": gs,
                "num_bits": bits, "observer": observer, "observer_kwargs": {},
                "strategy": strategy, "symmetric": True, "type": qtype}
    return {"input_activations": spec(a_s, a_group, 8, None, True, "memoryless"),
            "activation_use_clip": False, "output_activations": None,
            "weights": spec(w_s, w_group, w_bits, w_block, False, "minmax")}


def quant_config(ignore, mx_cache, w4a8, is_fp, is_mx, hif):
    qtype = "float" if is_fp else "int"
    groups = {"group_0": {"targets": ["Linear"], **group(8, qtype, is_mx, hif, "tensor")}}
    if w4a8:
        groups["group_1"] = {"targets": ["MoEGMM"], **group(4, qtype, is_fp, False, None)}
    q = {"config_groups": groups, "format": "float-quantized" if is_fp else "int-quantized",
         "global_compression_ratio": 1, "ignore": ignore, "quant_method": "compressed-tensors",
         "quantization_status": "compressed",
         "kv_cache_scheme": {"num_bits": 8, "type": "float"} if mx_cache else None,
         "li_cache_scheme": {"type": "float" if mx_cache else "int", "num_bits": 8}}
    if hif:
        q["weight_block_size"] = [128, 128]
    return q


# ---------------------------------------------------------------- conversion

def apply_clip(w, factors):
    """The seed's int_weight_quant clip (spec §4.3 step 1), op for op on the bf16 weight."""
    cur_min, cur_max = w.min(1, keepdim=True)[0], w.max(1, keepdim=True)[0]
    cur_min *= factors[0]
    cur_max *= factors[1]
    return torch.clamp(w, min=cur_min, max=cur_max)


def make_clip_params(model_dir, clip_dir):
    """quant_params_{L}.pt for every layer L, as the seed's --quant_param_path reads them: clip
    factors for some INT8 linears and some INT4 experts, as f32, f64 and bf16 [N, 1] tensors,
    0-dim f32 and f64 tensors and Python floats (the file format does not fix their type; an
    [N] tensor would not broadcast against the seed's [N, 1] row minima)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        where = json.load(f)["weight_map"]
    n_layers = config["num_hidden_layers"]
    q8 = quant_layers(n_layers, config["n_routed_experts"], config["compress_ratios"],
                      False, False, False)
    q4 = quant_layers(n_layers, config["n_routed_experts"], config["compress_ratios"],
                      True, False, False)
    gen = torch.Generator().manual_seed(7)
    files = [dict() for _ in range(n_layers)]
    kinds = ["f32_n1", "scalar", "bf16_n1", "float", "f64_n1", "f64_scalar"]
    chosen = sorted(k for k in set(q8) | set(q4) if k + ".weight" in where)[::3]
    for i, key in enumerate(chosen):
        with safe_open(os.path.join(model_dir, where[key + ".weight"]), "pt") as f:
            rows = f.get_slice(key + ".weight").get_shape()[0]
        layer = int(key.split(".")[1]) if key.startswith("layers.") else n_layers - 1
        for j, end in enumerate(["min", "max"]):
            kind = kinds[(i + j) % len(kinds)]
            lo = 0.55 + 0.1 * j
            v = (torch.rand(rows, 1, generator=gen, dtype=torch.float32) * 0.4 + lo)
            value = {"f32_n1": v,
                     "scalar": v[0, 0].clone(), "bf16_n1": v.to(torch.bfloat16),
                     "f64_n1": v.to(torch.float64) + 1e-9, "f64_scalar": v[0, 0].double() + 1e-9,
                     "float": float(v[0, 0])}[kind]
            files[min(layer, n_layers - 1)][f"{key}.clip_factor_{end}"] = value
    os.makedirs(clip_dir, exist_ok=True)
    for layer, d in enumerate(files):
        torch.save(d, os.path.join(clip_dir, f"quant_params_{layer}.pt"))
    merged = {}
    for d in files:
        merged.update(d)
    return merged


def convert(model_dir, qtype, clip=None):
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        where = json.load(f)["weight_map"]
    n_layers = config["num_hidden_layers"]
    ratios = config["compress_ratios"]
    w4a8, w8a8 = qtype.startswith("w4a8"), qtype.startswith("w8a8")
    mx, hif = "mx" in qtype.split("-"), qtype.endswith("hif")
    qlayers = quant_layers(n_layers, config["n_routed_experts"], ratios, w4a8, mx, hif) \
        if (w4a8 or w8a8) else {}

    def tensor(name):
        with safe_open(os.path.join(model_dir, where[name]), "pt") as f:
            return f.get_tensor(name)

    out, weight_map, int4 = {}, {}, {}
    for shard in sorted(set(where.values())):
        with safe_open(os.path.join(model_dir, shard), "pt") as f:
            names = list(f.keys())
        for name in names:
            if name.endswith(".scale"):
                continue
            w = tensor(name)
            key = name.rsplit(".", 1)[0]
            if w.element_size() == 1:
                s = tensor(key + ".scale")
                w = dequant_fp4(w, s) if w.dtype == torch.int8 else dequant_fp8(w, s)
            outs = {name: w}
            bits = qlayers.get(key)
            if bits is not None:
                if clip is not None and not mx:
                    factors = [clip.get(key + ".clip_factor_min"), clip.get(key + ".clip_factor_max")]
                    if not all(f is None for f in factors):
                        w = apply_clip(w, factors)
                if mx and hif and bits == 8 and "shared_experts" not in key:
                    q, s = quant_hif8(w)
                elif mx:
                    q, s = quant_mx(w, bits)
                elif bits == 4:
                    q, s, bias, s32 = quant_int4(w)
                    outs[name.replace(".weight", ".bias")] = bias
                    int4[name] = {"scale": s32.tolist(), "bias": bias.tolist()}
                else:
                    q, s = quant_int8(w)
                    s = s.to(torch.float32)
                outs[name] = q
                outs[key + ".scale"] = s
            for n, t in outs.items():
                out[n] = [shard, DTYPE[t.dtype], list(t.shape),
                          hashlib.sha256(as_bytes(t)).hexdigest()]
                weight_map[n] = shard
    if w4a8 or w8a8:
        config.pop("quantization_config", None)
        config["quantization_config"] = quant_config(
            ignore_list(n_layers, ratios, mx, hif), mx, w4a8, mx, mx, hif)
    return {"config": config, "weight_map": weight_map, "tensors": out, "int4": int4}


def main():
    torch.set_default_dtype(torch.bfloat16)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    model = os.path.join(root, "fixtures", "v4", "tiny")
    out_dir = os.path.join(root, "fixtures", "v4", "converted")
    os.makedirs(out_dir, exist_ok=True)

    def write(name, value):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(value, f, separators=(",", ":"))
            f.write("\n")

    for t in TYPES:
        summary = convert(model, t)
        write(f"{t}.json", summary)
        print(t, len(summary["tensors"]), "tensors")
    clip = make_clip_params(model, os.path.join(root, "fixtures", "v4", "clip"))
    for t in ["w8a8-int", "w4a8-int"]:
        summary = convert(model, t, clip)
        write(f"{t}-clip.json", summary)
        print(t, "with clip factors for", len(clip) // 2, "layers")
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    n, r = config["num_hidden_layers"], config["compress_ratios"]
    write("convert_config.json", {
        "plain": quant_config(ignore_list(n, r, True, False), True, True, True, False, False),
        "hif": quant_config(ignore_list(n, r, True, True), True, True, True, False, True),
    })


if __name__ == "__main__":
    main()
