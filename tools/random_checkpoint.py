#!/usr/bin/env python3
"""Write a random-weight DeepSeek-V3-shaped checkpoint in the DeepSeek-R1 release layout (for benchmarks).

numpy only (no torch / transformers / safetensors needed): the safetensors files are written by a small
streaming writer, so memory stays bounded (~100 MB) whatever the model size.

Layout (same as fixtures/v3/*): config.json (official DeepSeek field names), model-0000k-of-0000n.safetensors
shards + model.safetensors.index.json, FP8 e4m3fn Linear weights with f32 `weight_scale_inv`
[ceil(out/128), ceil(in/128)] (one scale per 128x128 block, ragged edges), bf16 norms / embed_tokens / lm_head /
router `mlp.gate.weight`, f32 `mlp.gate.e_score_correction_bias`, one tensor per routed expert, optional MTP layer
at index num_hidden_layers, plus tokenizer.json / tokenizer_config.json copied from fixtures/v3/r1_tiny.

Weights: FP8 codes are drawn i.i.d. from a normal distribution quantized to e4m3 (sigma ~100 in code units, so
the block max lands near 448; the NaN codes 0x7F/0xFF never occur), and each block's scale_inv is
(gain/sqrt(in_features))/sigma_code times a small random jitter, so dequantized weights look like
N(0, gain^2/in_features) and activations stay O(1) through the RMSNorm'd layers.

Usage:
  python3 tools/random_checkpoint.py --out /tmp/v3-1b                       # ~1 B parameters, ~1.5 GB on disk
  python3 tools/random_checkpoint.py --out /tmp/x --preset v3-tiny          # r1_tiny shapes, seconds
  python3 tools/random_checkpoint.py --out /tmp/x --layers 4 --experts 32 --mtp-layers 0
  python3 tools/random_checkpoint.py --preset v3-1b --dry-run               # just print the parameter counts
"""

import argparse
import json
import math
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np

BLOCK = 128
FP8_MAX = 448.0
SIGMA_CODE = 100.0  # std of the drawn fp8 values in code units (block amax ~ 4.3 sigma ~ 430)
REPO = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER_DIR = REPO / "fixtures" / "v3" / "r1_tiny"

PRESETS = {
    # ~0.99 B parameters in the main model (plus the MTP layer), DeepSeek-V3 proportions scaled down.
    "v3-1b": dict(
        model_type="deepseek_v3",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        moe_intermediate_size=256,
        num_hidden_layers=8,
        first_k_dense_replace=1,
        num_attention_heads=16,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_group=8,
        topk_group=4,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        rope_theta=10000,
        rope_factor=40,
        max_position_embeddings=163840,
        num_nextn_predict_layers=1,
    ),
    # Same shapes as fixtures/v3/r1_tiny (quick smoke tests).
    "v3-tiny": dict(
        model_type="deepseek_v3",
        vocab_size=512,
        hidden_size=192,
        intermediate_size=320,
        moe_intermediate_size=96,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        rope_theta=10000,
        rope_factor=40,
        max_position_embeddings=8192,
        num_nextn_predict_layers=1,
    ),
}

KIMI_DEFAULTS = dict(n_group=1, topk_group=1, routed_scaling_factor=2.827, rope_theta=50000, rope_factor=32)

OVERRIDES = [
    # (flag, preset key, type)
    ("--model-type", "model_type", lambda t: _model_type(t)),
    ("--vocab-size", "vocab_size", int),
    ("--hidden-size", "hidden_size", int),
    ("--intermediate-size", "intermediate_size", int),
    ("--moe-intermediate-size", "moe_intermediate_size", int),
    ("--layers", "num_hidden_layers", int),
    ("--first-k-dense", "first_k_dense_replace", int),
    ("--heads", "num_attention_heads", int),
    ("--q-lora-rank", "q_lora_rank", int),  # 0 -> null (q_proj instead of q_a/q_b)
    ("--kv-lora-rank", "kv_lora_rank", int),
    ("--qk-nope-head-dim", "qk_nope_head_dim", int),
    ("--qk-rope-head-dim", "qk_rope_head_dim", int),
    ("--v-head-dim", "v_head_dim", int),
    ("--experts", "n_routed_experts", int),
    ("--experts-per-tok", "num_experts_per_tok", int),
    ("--n-group", "n_group", int),
    ("--topk-group", "topk_group", int),
    ("--shared-experts", "n_shared_experts", int),
    ("--routed-scaling-factor", "routed_scaling_factor", float),
    ("--rope-theta", "rope_theta", float),
    ("--rope-factor", "rope_factor", float),
    ("--max-position-embeddings", "max_position_embeddings", int),
    ("--mtp-layers", "num_nextn_predict_layers", int),
]


def _model_type(t):
    """The V3-layout model types this tool writes; DeepSeek-V4 has its own layout
    (tools/quant/v4_random_checkpoint.py)."""
    if t not in ("deepseek_v3", "kimi_k2"):
        raise argparse.ArgumentTypeError(
            f"{t!r}: this tool writes deepseek_v3 or kimi_k2 checkpoints; for deepseek_v4 use "
            "tools/quant/v4_random_checkpoint.py")
    return t


def _num(x):
    """40.0 -> 40 (the real configs write integral floats as ints)."""
    return int(x) if float(x).is_integer() else float(x)


def make_config(p):
    q_lora = p["q_lora_rank"] or None
    kimi = p["model_type"] == "kimi_k2"
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": p["first_k_dense_replace"],
        "hidden_act": "silu",
        "hidden_size": p["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": p["intermediate_size"],
        "kv_lora_rank": p["kv_lora_rank"],
        "max_position_embeddings": p["max_position_embeddings"],
        "model_type": p["model_type"],
        "moe_intermediate_size": p["moe_intermediate_size"],
        "moe_layer_freq": 1,
        "n_group": p["n_group"],
        "n_routed_experts": p["n_routed_experts"],
        "n_shared_experts": p["n_shared_experts"],
        "norm_topk_prob": True,
        "num_attention_heads": p["num_attention_heads"],
        "num_experts_per_tok": p["num_experts_per_tok"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_key_value_heads": p["num_attention_heads"],
        "num_nextn_predict_layers": p["num_nextn_predict_layers"],
        "pretraining_tp": 1,
        "q_lora_rank": q_lora,
        "qk_nope_head_dim": p["qk_nope_head_dim"],
        "qk_rope_head_dim": p["qk_rope_head_dim"],
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 1.0 if kimi else 32,
            "beta_slow": 1.0 if kimi else 1,
            "factor": _num(p["rope_factor"]),
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": _num(p["rope_theta"]),
        "routed_scaling_factor": _num(p["routed_scaling_factor"]),
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": p["topk_group"],
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": p["v_head_dim"],
        "vocab_size": p["vocab_size"],
    }
    E, G = cfg["n_routed_experts"], cfg["n_group"]
    assert E % G == 0 and cfg["topk_group"] <= G, "n_routed_experts must be divisible by n_group"
    assert cfg["num_experts_per_tok"] <= (E // G) * cfg["topk_group"]
    assert cfg["qk_rope_head_dim"] % 2 == 0
    return cfg


# ------------------------------------------------------------------------------------------------
# Tensor plan
# ------------------------------------------------------------------------------------------------


class T:
    """One checkpoint tensor: kind in {fp8, scale, bf16, f32}; gen = (distribution, params)."""

    __slots__ = ("name", "kind", "shape", "gen")

    def __init__(self, name, kind, shape, gen):
        self.name, self.kind, self.shape, self.gen = name, kind, tuple(shape), gen

    @property
    def dtype(self):
        return {"fp8": "F8_E4M3", "scale": "F32", "bf16": "BF16", "f32": "F32"}[self.kind]

    @property
    def nbytes(self):
        return int(np.prod(self.shape)) * {"fp8": 1, "scale": 4, "bf16": 2, "f32": 4}[self.kind]


def plan(cfg):
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    ts, fp8 = [], []

    def lin(name, out_f, in_f, gain=1.0):
        ts.append(T(name + ".weight", "fp8", (out_f, in_f), None))
        ts.append(T(name + ".weight_scale_inv", "scale", (-(-out_f // BLOCK), -(-in_f // BLOCK)), gain / math.sqrt(in_f)))
        fp8.append(name + ".weight")

    def norm(name, dim):
        ts.append(T(name, "bf16", (dim,), ("norm", None)))

    def layer(li, moe):
        p = f"model.layers.{li}."
        norm(p + "input_layernorm.weight", H)
        a = p + "self_attn."
        if cfg["q_lora_rank"] is None:
            lin(a + "q_proj", nh * qk, H)
        else:
            lin(a + "q_a_proj", cfg["q_lora_rank"], H)
            norm(a + "q_a_layernorm.weight", cfg["q_lora_rank"])
            lin(a + "q_b_proj", nh * qk, cfg["q_lora_rank"])
        lin(a + "kv_a_proj_with_mqa", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], H)
        norm(a + "kv_a_layernorm.weight", cfg["kv_lora_rank"])
        lin(a + "kv_b_proj", nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"])
        lin(a + "o_proj", H, nh * cfg["v_head_dim"])
        norm(p + "post_attention_layernorm.weight", H)
        m = p + "mlp."
        if not moe:
            inter = cfg["intermediate_size"]
            lin(m + "gate_proj", inter, H)
            lin(m + "up_proj", inter, H)
            lin(m + "down_proj", H, inter)
        else:
            E, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            ts.append(T(m + "gate.weight", "bf16", (E, H), ("normal", 1.0 / math.sqrt(H))))
            ts.append(T(m + "gate.e_score_correction_bias", "f32", (E,), ("normal", 0.02)))
            for e in range(E):
                lin(m + f"experts.{e}.gate_proj", inter, H)
                lin(m + f"experts.{e}.up_proj", inter, H)
                lin(m + f"experts.{e}.down_proj", H, inter)
            si = inter * cfg["n_shared_experts"]
            if si > 0:  # n_shared_experts 0: no shared expert tensors at all
                lin(m + "shared_experts.gate_proj", si, H)
                lin(m + "shared_experts.up_proj", si, H)
                lin(m + "shared_experts.down_proj", H, si)

    L = cfg["num_hidden_layers"]
    ts.append(T("model.embed_tokens.weight", "bf16", (V, H), ("normal", 1.0)))
    for li in range(L):
        layer(li, li >= cfg["first_k_dense_replace"] and li % cfg["moe_layer_freq"] == 0)
    norm("model.norm.weight", H)
    ts.append(T("lm_head.weight", "bf16", (V, H), ("normal", 1.0 / math.sqrt(H))))
    for j in range(cfg["num_nextn_predict_layers"]):
        li = L + j
        p = f"model.layers.{li}."
        layer(li, True)  # the MTP block is always MoE
        norm(p + "enorm.weight", H)
        norm(p + "hnorm.weight", H)
        ts.append(T(p + "eh_proj.weight", "bf16", (H, 2 * H), ("normal", 1.0 / math.sqrt(2 * H))))
        norm(p + "shared_head.norm.weight", H)
        # DeepSeek ships copies of the main embedding / head here: same generator seed -> identical bytes.
        src = {t.name: t for t in ts}
        for name, of in (("shared_head.head.weight", "lm_head.weight"), ("embed_tokens.weight", "model.embed_tokens.weight")):
            ts.append(T(p + name, "bf16", (V, H), ("copy", (of, src[of].gen))))
    return ts, fp8


def param_counts(cfg):
    """(main model total, activated per token, MTP layer total) in parameters; embeddings counted in total only."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    q = nh * qk * H if cfg["q_lora_rank"] is None else cfg["q_lora_rank"] * (H + nh * qk + 1)
    attn = q + (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * H + cfg["kv_lora_rank"]
    attn += nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]) * cfg["kv_lora_rank"] + H * nh * cfg["v_head_dim"] + 2 * H
    dense = 3 * H * cfg["intermediate_size"]
    E, I, K, S = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"], cfg["n_shared_experts"]
    expert = 3 * H * I
    moe_total = E * expert + S * expert + E * H + E
    moe_active = K * expert + S * expert + E * H
    L, kd = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    n_moe = sum(1 for li in range(L) if li >= kd)
    total = L * attn + kd * dense + n_moe * moe_total + 2 * V * H + H
    active = L * attn + kd * dense + n_moe * moe_active + V * H + H
    mtp = cfg["num_nextn_predict_layers"] * (attn + moe_total + 2 * H * H + 3 * H)
    return total, active, mtp


# ------------------------------------------------------------------------------------------------
# Value generation
# ------------------------------------------------------------------------------------------------


def fp8_values():
    """e4m3fn decode table (codes 0..255 -> f32; 0x7F/0xFF NaN)."""
    v = np.zeros(256, dtype=np.float64)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 7
        if e == 0xF and m == 7:
            v[b] = np.nan
        elif e == 0:
            v[b] = s * 2.0**-6 * m / 8
        else:
            v[b] = s * 2.0 ** (e - 7) * (1 + m / 8)
    return v


def normal_code_table(sigma):
    """65536-entry table: uniform uint16 -> e4m3fn code whose value is the nearest to the inverse-normal-CDF
    sample (std `sigma` in code units), saturated at +-448. Never yields 0x7F/0xFF."""
    vals = fp8_values()
    pos_codes = np.arange(0, 0x7F)  # 0x00..0x7E: 0 .. 448, increasing
    pos_vals = vals[pos_codes]
    mids = (pos_vals[1:] + pos_vals[:-1]) / 2
    nd = statistics.NormalDist(0.0, sigma)
    u = (np.arange(65536) + 0.5) / 65536
    x = np.array([nd.inv_cdf(t) for t in u])
    mag = np.minimum(np.abs(x), FP8_MAX)
    idx = np.searchsorted(mids, mag)  # nearest positive code
    codes = pos_codes[idx].astype(np.uint8)
    codes = np.where(x < 0, codes | 0x80, codes).astype(np.uint8)
    codes[(codes & 0x7F) == 0] = 0  # no negative zero
    assert not np.any((codes & 0x7F) == 0x7F)
    return codes


def f32_to_bf16_bits(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    u = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (u >> np.uint32(16)).astype(np.uint16)


def tensor_rng(seed, name):
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


CHUNK_ELEMS = 1 << 23  # 8 Mi elements per generated chunk (bounds memory to ~150 MB)


def gen_chunks(t: T, seed, code_table):
    """Yield the tensor's raw bytes in chunks (bounded memory)."""
    if t.kind == "fp8":
        rng = tensor_rng(seed, t.name)
        n = int(np.prod(t.shape))
        for s in range(0, n, CHUNK_ELEMS):
            k = min(CHUNK_ELEMS, n - s)
            u = np.frombuffer(rng.bytes(2 * k), dtype=np.uint16)
            yield code_table[u]
    elif t.kind == "scale":
        rng = tensor_rng(seed, t.name)
        target_std = t.gen
        jitter = 1.0 + 0.25 * (rng.random(t.shape) - 0.5)
        yield (target_std / SIGMA_CODE * jitter).astype(np.float32)
    elif t.kind in ("bf16", "f32"):
        dist, p = t.gen
        src = t.name
        if dist == "copy":  # regenerate the source tensor from its own seed -> identical bytes
            src, (dist, p) = p
        rng = tensor_rng(seed, src)
        n = int(np.prod(t.shape))
        for s in range(0, n, CHUNK_ELEMS):
            k = min(CHUNK_ELEMS, n - s)
            x = rng.standard_normal(k, dtype=np.float32)
            if dist == "norm":
                x = 1.0 + 0.1 * x
            else:
                x *= np.float32(p)
            yield f32_to_bf16_bits(x) if t.kind == "bf16" else x.astype(np.float32)
    else:
        raise ValueError(t.kind)


# ------------------------------------------------------------------------------------------------
# Streaming safetensors writer
# ------------------------------------------------------------------------------------------------


def write_shard(path: Path, tensors, seed, code_table):
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for t in tensors:
            written = 0
            for chunk in gen_chunks(t, seed, code_table):
                b = memoryview(np.ascontiguousarray(chunk)).cast("B")
                f.write(b)
                written += len(b)
            assert written == t.nbytes, (t.name, written, t.nbytes)
    return off


def assign_shards(ts, fp8, shard_bytes):
    total = sum(t.nbytes for t in ts)
    n = max(1, math.ceil(total / shard_bytes))
    target = total / n
    assign, acc = {}, 0
    for t in ts:
        assign[t.name] = min(int(acc // target), n - 1)
        acc += t.nbytes
    # Like the real checkpoints: at each shard boundary, the last FP8 weight's scale goes to the next shard.
    for s in range(n - 1):
        cands = [w for w in fp8 if assign[w] == s and assign[w + "_scale_inv"] == s]
        if cands:
            assign[cands[-1] + "_scale_inv"] = s + 1
    return assign, n, total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="output directory (created; must be empty or absent unless --force)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="v3-1b")
    for flag, key, typ in OVERRIDES:
        ap.add_argument(flag, dest=key, type=typ, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-size-mb", type=float, default=512.0)
    ap.add_argument("--tokenizer-dir", type=Path, default=DEFAULT_TOKENIZER_DIR,
                    help="directory holding tokenizer.json / tokenizer_config.json to copy (default fixtures/v3/r1_tiny)")
    ap.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    ap.add_argument("--dry-run", action="store_true", help="print the config and parameter counts only")
    args = ap.parse_args()

    p = dict(PRESETS[args.preset])
    for _, key, _ in OVERRIDES:
        v = getattr(args, key)
        if v is not None:
            p[key] = v
    if p["model_type"] == "kimi_k2":
        # Kimi-K2 values for everything not given explicitly (beta_fast = beta_slow = 1 is set in make_config).
        for key, v in KIMI_DEFAULTS.items():
            if getattr(args, key) is None:
                p[key] = v
    cfg = make_config(p)
    total, active, mtp = param_counts(cfg)
    ts, fp8 = plan(cfg)
    disk = sum(t.nbytes for t in ts)
    assert sum(int(np.prod(t.shape)) for t in ts if not t.name.endswith("_scale_inv")) == total + mtp + (
        2 * cfg["vocab_size"] * cfg["hidden_size"] * cfg["num_nextn_predict_layers"]), "param count mismatch"
    print(f"preset {args.preset}: H={cfg['hidden_size']} L={cfg['num_hidden_layers']} (dense {cfg['first_k_dense_replace']}) "
          f"heads={cfg['num_attention_heads']} q_lora={cfg['q_lora_rank']} kv_lora={cfg['kv_lora_rank']} "
          f"E={cfg['n_routed_experts']} K={cfg['num_experts_per_tok']} I_moe={cfg['moe_intermediate_size']} "
          f"I_dense={cfg['intermediate_size']} V={cfg['vocab_size']} MTP={cfg['num_nextn_predict_layers']}")
    print(f"parameters: main model total {total / 1e9:.3f} B, activated per token {active / 1e9:.3f} B "
          f"(excl. embedding lookup, incl. lm_head); MTP layer {mtp / 1e6:.1f} M (+ {cfg['num_nextn_predict_layers']}x "
          f"embed/head copies); {len(ts)} tensors, {disk / 1e9:.3f} GB on disk")
    if args.dry_run:
        return
    if args.out is None:
        ap.error("--out is required")
    out = args.out
    if out.exists() and any(out.iterdir()):
        if not args.force:
            sys.exit(f"{out} is not empty (use --force)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    code_table = normal_code_table(SIGMA_CODE)
    assign, n, total_bytes = assign_shards(ts, fp8, args.shard_size_mb * 1e6)
    fname = lambda s: f"model-{s + 1:05d}-of-{n:05d}.safetensors"  # noqa: E731
    for s in range(n):
        shard_ts = [t for t in ts if assign[t.name] == s]
        sz = write_shard(out / fname(s), shard_ts, args.seed, code_table)
        print(f"  {fname(s)}: {len(shard_ts)} tensors, {sz / 1e6:.1f} MB  ({time.time() - t0:.1f} s)")
    index = {"metadata": {"total_size": total_bytes}, "weight_map": {t.name: fname(assign[t.name]) for t in sorted(ts, key=lambda t: t.name)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        src = args.tokenizer_dir / f
        if src.exists():
            shutil.copyfile(src, out / f)
        else:
            print(f"  warning: {src} not found, no {f} written (run tools/reference/make_fixtures.py first)")
    dt = time.time() - t0
    print(f"wrote {total_bytes / 1e9:.3f} GB to {out} in {dt:.1f} s ({total_bytes / 1e9 / dt:.2f} GB/s)")


if __name__ == "__main__":
    main()
