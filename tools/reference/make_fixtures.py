#!/usr/bin/env python3
"""Generate the tiny DeepSeek-V3 / R1 / Kimi-K2 reference fixtures under fixtures/v3/.

For each tiny model this script
  1. draws random float32 weights (numpy, fixed seed),
  2. quantizes every Linear that DeepSeek ships in FP8 to float8_e4m3fn with one f32 scale per 128x128 block
     (scale_inv = amax(block)/448, ragged edge blocks), and rounds norms / embeddings / lm_head / router to bf16,
  3. writes the checkpoint in the layout of the HF-hub DeepSeek-R1 release (config.json, sharded
     model-0000k-of-0000n.safetensors, model.safetensors.index.json, per-expert tensors, MTP layer),
  4. loads EXACTLY the dequantized values (fp8 -> f32 times scale_inv, in f32; bf16 -> f32) into transformers'
     own DeepseekV3ForCausalLM (float32, CPU, eager attention) and dumps reference log-probs, greedy continuations
     and logits to reference.json,
  5. prints sanity checks (routing / bias / group sensitivity, rope + YaRN sensitivity, logprob spread, greedy
     margins) and asserts the greedy top-1 - top-2 margins are > 1e-3 (otherwise it moves on to the next seed).

Run:  /work/venv/ref/bin/python tools/reference/make_fixtures.py      (see tools/reference/README.md)
"""

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

import transformers
from transformers.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUT_ROOT = REPO / "fixtures" / "v3"
BLOCK = 128
FP8_MAX = 448.0
MIN_MARGIN = 1e-3

TEXT = (
    "The cachalot swims through the dark water with slow, steady strokes of its tail. Every few seconds it "
    "sends out a sharp click, and the echo tells it where the squid are hiding. A language model works in a "
    "similar way: it reads the tokens that came before, listens to what they say about the next one, and makes "
    "its best guess. When the guess is wrong, the error is small if the model was unsure, and large if it was "
    "confident.\n"
)

# ------------------------------------------------------------------------------------------------
# Model definitions (config.json contents, official DeepSeek field names)
# ------------------------------------------------------------------------------------------------

COMMON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 192,
    "initializer_range": 0.02,
    "intermediate_size": 320,
    "kv_lora_rank": 64,
    "max_position_embeddings": 8192,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 40,
    "moe_layer_freq": 1,
    "n_group": 4,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 96,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 32,
    "vocab_size": 512,
}


def _cfg(**over):
    c = json.loads(json.dumps(COMMON))
    for k, v in over.items():
        c[k] = v
    return dict(sorted(c.items()))


MODELS = {
    "r1_tiny": dict(config=_cfg(), seed=1001, shards=3),
    "kimi_tiny": dict(
        config=_cfg(
            model_type="kimi_k2",
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            rope_theta=50000,
            rope_scaling={
                "beta_fast": 1.0,
                "beta_slow": 1.0,
                "factor": 32,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                # 256 instead of Kimi's real 4096: with beta_fast = beta_slow = 1 and base 50000 the real value only
                # interpolates rope dims 5..7 of 8, whose angles stay tiny at <= 300 positions (YaRN-vs-plain rope
                # moved the logprobs by only 0.02 nats on average). 256 moves the one-dim ramp to low=2, high=3.
                "original_max_position_embeddings": 256,
                "type": "yarn",
            },
            num_nextn_predict_layers=0,
            n_routed_experts=24,
        ),
        seed=2002,
        shards=3,
    ),
    "v3_noq_tiny": dict(
        config=_cfg(
            q_lora_rank=None,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=2,
            num_hidden_layers=4,
            num_nextn_predict_layers=0,
        ),
        seed=3003,
        shards=2,
    ),
}

# ------------------------------------------------------------------------------------------------
# Quantization helpers
# ------------------------------------------------------------------------------------------------


def quantize_fp8_block(w: torch.Tensor):
    """w: f32 [M, N]. Returns (fp8 [M,N] float8_e4m3fn, scale_inv f32 [ceil(M/128), ceil(N/128)], dequant f32)."""
    assert w.dtype == torch.float32 and w.dim() == 2
    m, n = w.shape
    bm, bn = -(-m // BLOCK), -(-n // BLOCK)
    wp = torch.zeros(bm * BLOCK, bn * BLOCK, dtype=torch.float32)
    wp[:m, :n] = w
    blocks = wp.view(bm, BLOCK, bn, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).to(torch.float32)
    assert (scale > 0).all()
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(bm * BLOCK, bn * BLOCK)[:m, :n].contiguous()
    deq = dequant_fp8_torch(q, scale)
    return q, scale.contiguous(), deq


def dequant_fp8_torch(q, scale):
    m, n = q.shape
    s = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:m, :n]
    return q.to(torch.float32) * s


def fp8_lut_spec():
    """e4m3fn decode table built from the bit formula in the spec (independent of torch)."""
    lut = np.zeros(256, dtype=np.float64)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 0xF
        mant = b & 0x7
        if e == 0xF and mant == 0x7:
            lut[b] = np.nan
        elif e == 0:
            lut[b] = s * 2.0**-6 * (mant / 8.0)
        else:
            lut[b] = s * 2.0 ** (e - 7) * (1.0 + mant / 8.0)
    return lut.astype(np.float32)


FP8_LUT = fp8_lut_spec()


def dequant_fp8_numpy(q: torch.Tensor, scale: torch.Tensor):
    codes = q.view(torch.uint8).numpy()
    vals = FP8_LUT[codes]
    sc = scale.numpy()
    r = np.arange(codes.shape[0]) // BLOCK
    c = np.arange(codes.shape[1]) // BLOCK
    return vals * sc[r[:, None], c[None, :]]  # f32 * f32 -> f32


def to_bf16(x: torch.Tensor):
    b = x.to(torch.bfloat16)
    return b, b.to(torch.float32)


# ------------------------------------------------------------------------------------------------
# Weight generation
# ------------------------------------------------------------------------------------------------


class Builder:
    """Collects checkpoint tensors (DeepSeek names / dtypes) and the f32 reference state dict."""

    def __init__(self, rng):
        self.rng = rng
        self.ckpt = {}  # name -> torch tensor (bf16 / fp8 / f32), insertion order = natural order
        self.ref = {}  # checkpoint name (weight) -> f32 tensor used by the reference model
        self.fp8_names = []

    def randn(self, *shape):
        return torch.from_numpy(self.rng.standard_normal(shape, dtype=np.float32))

    def fp8_linear(self, name, out_f, in_f, gain=1.0):
        w = self.randn(out_f, in_f) * np.float32(gain / math.sqrt(in_f))
        q, s, deq = quantize_fp8_block(w)
        self.ckpt[name + ".weight"] = q
        self.ckpt[name + ".weight_scale_inv"] = s
        self.ref[name + ".weight"] = deq
        self.fp8_names.append(name + ".weight")

    def bf16(self, name, t):
        b, f = to_bf16(t)
        self.ckpt[name] = b
        self.ref[name] = f

    def norm(self, name, dim):
        self.bf16(name, 1.0 + 0.2 * self.randn(dim))

    def f32(self, name, t):
        self.ckpt[name] = t.to(torch.float32).contiguous()
        self.ref[name] = self.ckpt[name]


GAINS = dict(embed=1.0, lm_head=3.0, router=1.5, bias=0.1, eh_proj=1.0)


def build_layer(b: Builder, c, li, moe: bool):
    H = c["hidden_size"]
    nh = c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    p = f"model.layers.{li}."
    b.norm(p + "input_layernorm.weight", H)
    a = p + "self_attn."
    if c["q_lora_rank"] is None:
        b.fp8_linear(a + "q_proj", nh * qk, H)
    else:
        b.fp8_linear(a + "q_a_proj", c["q_lora_rank"], H)
        b.norm(a + "q_a_layernorm.weight", c["q_lora_rank"])
        b.fp8_linear(a + "q_b_proj", nh * qk, c["q_lora_rank"])
    b.fp8_linear(a + "kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], H)
    b.norm(a + "kv_a_layernorm.weight", c["kv_lora_rank"])
    b.fp8_linear(a + "kv_b_proj", nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
    b.fp8_linear(a + "o_proj", H, nh * c["v_head_dim"])
    b.norm(p + "post_attention_layernorm.weight", H)
    m = p + "mlp."
    if not moe:
        inter = c["intermediate_size"]
        b.fp8_linear(m + "gate_proj", inter, H)
        b.fp8_linear(m + "up_proj", inter, H)
        b.fp8_linear(m + "down_proj", H, inter)
    else:
        E, inter = c["n_routed_experts"], c["moe_intermediate_size"]
        b.bf16(m + "gate.weight", b.randn(E, H) * np.float32(GAINS["router"] / math.sqrt(H)))
        b.f32(m + "gate.e_score_correction_bias", b.randn(E) * np.float32(GAINS["bias"]))
        for e in range(E):
            b.fp8_linear(m + f"experts.{e}.gate_proj", inter, H)
            b.fp8_linear(m + f"experts.{e}.up_proj", inter, H)
            b.fp8_linear(m + f"experts.{e}.down_proj", H, inter)
        si = inter * c["n_shared_experts"]
        b.fp8_linear(m + "shared_experts.gate_proj", si, H)
        b.fp8_linear(m + "shared_experts.up_proj", si, H)
        b.fp8_linear(m + "shared_experts.down_proj", H, si)


def build_weights(c, seed):
    b = Builder(np.random.default_rng(seed))
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    b.bf16("model.embed_tokens.weight", b.randn(V, H) * np.float32(GAINS["embed"]))
    for li in range(L):
        build_layer(b, c, li, moe=li >= c["first_k_dense_replace"] and li % c["moe_layer_freq"] == 0)
    b.norm("model.norm.weight", H)
    b.bf16("lm_head.weight", b.randn(V, H) * np.float32(GAINS["lm_head"] / math.sqrt(H)))
    for j in range(c["num_nextn_predict_layers"]):
        li = L + j
        p = f"model.layers.{li}."
        # The MTP decoder block is always MoE.
        build_layer(b, c, li, moe=True)
        b.norm(p + "enorm.weight", H)
        b.norm(p + "hnorm.weight", H)
        b.bf16(p + "eh_proj.weight", b.randn(H, 2 * H) * np.float32(GAINS["eh_proj"] / math.sqrt(2 * H)))
        b.norm(p + "shared_head.norm.weight", H)
        # DeepSeek ships copies of the main embedding / head here (documented as shared).
        b.ckpt[p + "shared_head.head.weight"] = b.ckpt["lm_head.weight"].clone()
        b.ref[p + "shared_head.head.weight"] = b.ref["lm_head.weight"]
        b.ckpt[p + "embed_tokens.weight"] = b.ckpt["model.embed_tokens.weight"].clone()
        b.ref[p + "embed_tokens.weight"] = b.ref["model.embed_tokens.weight"]
    return b


def hf_state_dict(ref, c, layer_range, prefix_map):
    """Map DeepSeek checkpoint names (f32 reference values) to transformers 5.x parameter names.

    prefix_map: ckpt prefix 'model.layers.{li}.' -> hf prefix. Fuses per-expert weights into
    experts.gate_up_proj [E, 2I, H] (gate rows first) and experts.down_proj [E, H, I].
    """
    sd = {}
    E = c["n_routed_experts"]
    for li in layer_range:
        src = f"model.layers.{li}."
        dst = prefix_map(li)
        for k, v in ref.items():
            if not k.startswith(src):
                continue
            rest = k[len(src):]
            if ".experts." in rest:
                continue
            sd[dst + rest] = v
        ek = src + "mlp.experts.0.gate_proj.weight"
        if ek in ref:
            gate_up = torch.stack(
                [
                    torch.cat([ref[src + f"mlp.experts.{e}.gate_proj.weight"], ref[src + f"mlp.experts.{e}.up_proj.weight"]], 0)
                    for e in range(E)
                ]
            )
            down = torch.stack([ref[src + f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
            sd[dst + "mlp.experts.gate_up_proj"] = gate_up
            sd[dst + "mlp.experts.down_proj"] = down
    return sd


def hf_config(c):
    rs = c["rope_scaling"]
    cfg = DeepseekV3Config(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        moe_intermediate_size=c["moe_intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        n_shared_experts=c["n_shared_experts"],
        n_routed_experts=c["n_routed_experts"],
        routed_scaling_factor=c["routed_scaling_factor"],
        kv_lora_rank=c["kv_lora_rank"],
        q_lora_rank=c["q_lora_rank"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        n_group=c["n_group"],
        topk_group=c["topk_group"],
        num_experts_per_tok=c["num_experts_per_tok"],
        first_k_dense_replace=c["first_k_dense_replace"],
        norm_topk_prob=c["norm_topk_prob"],
        hidden_act=c["hidden_act"],
        max_position_embeddings=c["max_position_embeddings"],
        rms_norm_eps=c["rms_norm_eps"],
        bos_token_id=c["bos_token_id"],
        eos_token_id=c["eos_token_id"],
        tie_word_embeddings=c["tie_word_embeddings"],
        attention_bias=c["attention_bias"],
        num_mtp_layers=c["num_nextn_predict_layers"],
        rope_parameters={
            "rope_type": rs["type"],
            "rope_theta": float(c["rope_theta"]),
            "factor": float(rs["factor"]),
            "original_max_position_embeddings": rs["original_max_position_embeddings"],
            "beta_fast": float(rs["beta_fast"]),
            "beta_slow": float(rs["beta_slow"]),
            "mscale": float(rs["mscale"]),
            "mscale_all_dim": float(rs["mscale_all_dim"]),
        },
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def build_hf_model(c, ref):
    cfg = hf_config(c)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32).eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    L = c["num_hidden_layers"]
    sd = hf_state_dict(ref, c, range(L), lambda li: f"model.layers.{li}.")
    sd["model.embed_tokens.weight"] = ref["model.embed_tokens.weight"]
    sd["model.norm.weight"] = ref["model.norm.weight"]
    sd["lm_head.weight"] = ref["lm_head.weight"]
    own = model.state_dict()
    assert set(sd) == set(own), (sorted(set(own) - set(sd)), sorted(set(sd) - set(own)))
    for k in own:
        assert own[k].shape == sd[k].shape, (k, own[k].shape, sd[k].shape)
    model.load_state_dict(sd, strict=True)
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, sd[k]), k
    return model


def build_hf_mtp(model, c, ref):
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(model, c["num_nextn_predict_layers"]).to(torch.float32).eval()
    L = c["num_hidden_layers"]
    sd = {}
    for j in range(c["num_nextn_predict_layers"]):
        li = L + j
        src = f"model.layers.{li}."
        block = hf_state_dict(ref, c, [li], lambda _li: f"layers.{j}.mtp_block.")
        for k, v in block.items():
            rest = k[len(f"layers.{j}.mtp_block."):]
            if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
                sd[f"layers.{j}." + rest] = v
            elif rest.startswith("shared_head.norm."):
                sd[f"layers.{j}.post_norm." + rest[len("shared_head.norm."):]] = v
            elif rest.startswith(("shared_head.head.", "embed_tokens.")):
                # shared with the main model (we wrote identical copies)
                continue
            else:
                sd[k] = v
    own = mtp.state_dict()
    shared = {k for k in own if k.startswith(("embed_tokens.", "shared_head."))}
    assert set(sd) == set(own) - shared, (sorted(set(own) - shared - set(sd)), sorted(set(sd) - set(own)))
    missing, unexpected = mtp.load_state_dict(sd, strict=False)
    assert set(missing) == shared and not unexpected, (missing, unexpected)
    assert mtp.embed_tokens is model.model.embed_tokens and mtp.shared_head is model.lm_head
    return mtp


# ------------------------------------------------------------------------------------------------
# Checkpoint writing
# ------------------------------------------------------------------------------------------------


def nbytes(t):
    return t.numel() * t.element_size()


def shard_assign(b: Builder, n_shards):
    names = list(b.ckpt)
    total = sum(nbytes(b.ckpt[k]) for k in names)
    target = total / n_shards
    assign, acc = {}, 0
    for k in names:
        s = min(int(acc // target), n_shards - 1)
        assign[k] = s
        acc += nbytes(b.ckpt[k])
    # Real checkpoints sometimes store a weight_scale_inv in a later shard than its weight: force that at each
    # shard boundary for the last FP8 weight of the shard.
    moved = []
    for s in range(n_shards - 1):
        cands = [w for w in b.fp8_names if assign[w] == s and assign[w + "_scale_inv"] == s]
        w = cands[-1]
        assign[w + "_scale_inv"] = s + 1
        moved.append(w + "_scale_inv")
    return assign, total, moved


def write_checkpoint(b: Builder, c, n_shards, out: Path):
    assign, total, moved = shard_assign(b, n_shards)
    fname = lambda s: f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"  # noqa: E731
    for s in range(n_shards):
        tensors = {k: b.ckpt[k].contiguous() for k in b.ckpt if assign[k] == s}
        save_file(tensors, str(out / fname(s)), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: fname(assign[k]) for k in sorted(b.ckpt)},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n", encoding="utf-8")
    return moved


def verify_checkpoint(b: Builder, out: Path):
    """Reload the written shards with safetensors and check dequant (spec LUT, numpy) == reference values."""
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / f), framework="pt") as fh:
            assert fh.metadata() == {"format": "pt"}
            for k in fh.keys():
                assert index["weight_map"][k] == f
                loaded[k] = fh.get_tensor(k)
    assert set(loaded) == set(b.ckpt)
    assert sum(nbytes(t) for t in loaded.values()) == index["metadata"]["total_size"]
    def raw(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    for k, t in loaded.items():
        assert t.dtype == b.ckpt[k].dtype and torch.equal(raw(t), raw(b.ckpt[k])), k
    n_fp8 = 0
    for w in b.fp8_names:
        q, s = loaded[w], loaded[w + "_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert tuple(s.shape) == (-(-q.shape[0] // BLOCK), -(-q.shape[1] // BLOCK))
        codes = q.view(torch.uint8)
        assert not ((codes & 0x7F) == 0x7F).any(), "NaN fp8 code"
        deq = dequant_fp8_numpy(q, s)
        assert np.array_equal(deq, b.ref[w].numpy()), w
        n_fp8 += 1
    for k, t in loaded.items():
        if t.dtype == torch.bfloat16:
            assert torch.equal(t.float(), b.ref[k]), k
    return n_fp8


# ------------------------------------------------------------------------------------------------
# Reference computations
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def logits_of(model, ids):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].to(torch.float32)


def logprobs_of(logits, ids):
    lp = torch.log_softmax(logits.double(), dim=-1)
    return [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


@torch.no_grad()
def greedy(model, prompt, n_new=32):
    ids = list(prompt)
    margins = []
    for _ in range(n_new):
        lg = logits_of(model, ids)[-1]
        top2 = torch.topk(lg, 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        ids.append(int(top2.indices[0]))
    return ids[len(prompt):], margins


def spec_yarn_inv_freq(c):
    """YaRN inverse frequencies per spec section 3.2, computed independently in numpy."""
    rs = c["rope_scaling"]
    d = c["qk_rope_head_dim"]
    base = float(c["rope_theta"])
    i = np.arange(d // 2, dtype=np.float32)
    extra = (1.0 / (np.float32(base) ** (2 * i / np.float32(d)))).astype(np.float32)
    inter = extra / np.float32(rs["factor"])

    def corr(r):
        return d * math.log(rs["original_max_position_embeddings"] / (2 * math.pi * r)) / (2 * math.log(base))

    low = max(math.floor(corr(rs["beta_fast"])), 0)
    high = min(math.ceil(corr(rs["beta_slow"])), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((i - low) / (high - low), 0, 1).astype(np.float32)
    return (inter * ramp + extra * (1 - ramp)).astype(np.float32), (low, high), (corr(rs["beta_fast"]), corr(rs["beta_slow"]))


def spec_route(logits_f32, bias, c):
    """Spec section 3.5 selection (independent re-implementation); returns sorted expert id lists."""
    s = torch.sigmoid(logits_f32)
    sc = s + bias
    E, G, TG, K = c["n_routed_experts"], c["n_group"], c["topk_group"], c["num_experts_per_tok"]
    if G > 1:
        gs = sc.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs, dtype=torch.bool)
        keep.scatter_(1, gs.topk(TG, dim=-1).indices, True)
        sc = sc.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    idx = sc.topk(K, dim=-1).indices
    return [sorted(r) for r in idx.tolist()]


class RouterProbe:
    """Records router inputs/outputs of every MoE layer during a forward pass."""

    def __init__(self, model):
        self.records = []
        self.handles = []
        for li, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                self.handles.append(gate.register_forward_hook(self._hook(li)))

    def _hook(self, li):
        def f(mod, inp, out):
            router_logits, w, idx = out
            self.records.append((li, router_logits.detach().clone(), idx.detach().clone(), mod.e_score_correction_bias.detach().clone()))

        return f

    def close(self):
        for h in self.handles:
            h.remove()


def routing_report(model, c, ids):
    probe = RouterProbe(model)
    logits_of(model, ids)
    probe.close()
    c_nogroup = dict(c, n_group=1, topk_group=1)
    lines = []
    stats = {}
    for li, rl, idx, bias in probe.records:
        hf = [sorted(r) for r in idx.tolist()]
        spec = spec_route(rl, bias, c)
        assert hf == spec, f"layer {li}: HF routing != spec routing"
        nobias = spec_route(rl, torch.zeros_like(bias), c)
        nogroup = spec_route(rl, bias, c_nogroup)
        T = len(hf)
        distinct_sets = len({tuple(r) for r in hf})
        used = sorted({e for r in hf for e in r})
        n_bias = sum(a != b for a, b in zip(hf, nobias))
        n_group = sum(a != b for a, b in zip(hf, nogroup))
        lines.append(
            f"    layer {li}: {T} tokens, {distinct_sets} distinct expert sets, {len(used)}/{c['n_routed_experts']} experts used; "
            f"bias changes selection for {n_bias}/{T} tokens; group limit changes it for {n_group}/{T}"
        )
        stats[li] = dict(distinct=distinct_sets, used=len(used), bias_changed=n_bias, group_changed=n_group, tokens=T)
    return lines, stats


@torch.no_grad()
def rope_report(model, c, ids):
    rot = model.model.rotary_emb
    base_inv = rot.inv_freq.clone()
    ref_lg = logits_of(model, ids)
    lp_ref = torch.log_softmax(ref_lg, -1)
    out = {}
    d = c["qk_rope_head_dim"]
    plain = 1.0 / (float(c["rope_theta"]) ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    for name, inv in [("rope disabled (inv_freq=0)", torch.zeros_like(base_inv)), ("plain rope freqs (no YaRN ramp)", plain)]:
        rot.inv_freq.copy_(inv)
        lg = logits_of(model, ids)
        rot.inv_freq.copy_(base_inv)
        lp = torch.log_softmax(lg, -1)
        dl = (lp - lp_ref).abs()
        flips = int((lg.argmax(-1) != ref_lg.argmax(-1)).sum())
        out[name] = (float(dl.max()), float(dl.mean()), flips, len(ids))
    assert torch.equal(rot.inv_freq, base_inv)
    # Absolute position shift (same tokens, positions +7): should only change logits at float-rounding level
    # because RoPE is relative.
    pos = torch.arange(len(ids)).unsqueeze(0) + 7
    lg = model(input_ids=torch.tensor([ids]), position_ids=pos, use_cache=False).logits[0]
    out["positions shifted by +7 (relative invariance)"] = (
        float((torch.log_softmax(lg, -1) - lp_ref).abs().max()), None, int((lg.argmax(-1) != ref_lg.argmax(-1)).sum()), len(ids))
    return out


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def make_sequences(seed, V):
    rng = np.random.default_rng(seed)
    seqs = []
    for n in (5, 17, 40, 96):
        ids = rng.integers(2, V, size=n).tolist()
        seqs.append(ids)
    seqs[1][0] = 0  # one sequence starting with BOS
    return seqs


def generate_model(name, spec, tok, text_ids, out_dir: Path, max_attempts=20):
    c = spec["config"]
    V = c["vocab_size"]
    seqs = make_sequences(spec["seed"] + 7, V)
    prompts = [[0], [0] + make_sequences(spec["seed"] + 11, V)[0][:7], text_ids[:16]]
    for attempt in range(max_attempts):
        seed = spec["seed"] + 100 * attempt
        b = build_weights(c, seed)
        model = build_hf_model(c, b.ref)
        greedy_out = []
        min_margin = float("inf")
        for p in prompts:
            cont, margins = greedy(model, p)
            greedy_out.append(dict(prompt=p, continuation=cont, margins=margins))
            min_margin = min(min_margin, min(margins))
        if min_margin > MIN_MARGIN:
            break
        print(f"  [{name}] seed {seed}: min greedy margin {min_margin:.2e} <= {MIN_MARGIN}, trying next seed")
    else:
        raise SystemExit(f"{name}: no seed with greedy margins > {MIN_MARGIN}")
    print(f"  [{name}] weight seed {seed} (attempt {attempt}), min greedy top1-top2 margin {min_margin:.4f}")

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    moved = write_checkpoint(b, c, spec["shards"], out_dir)
    n_fp8 = verify_checkpoint(b, out_dir)
    print(f"  [{name}] checkpoint verified: {len(b.ckpt)} tensors, {n_fp8} FP8 weights (numpy spec-LUT dequant == reference), "
          f"scales stored in a later shard than their weight: {moved}")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tiny_tokenizer.tokenizer_config_json(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    # YaRN table check against the spec formula
    inv_spec, (low, high), (rlow, rhigh) = spec_yarn_inv_freq(c)
    inv_hf = model.model.rotary_emb.inv_freq.numpy()
    yarn_rel = float(np.max(np.abs(inv_hf - inv_spec) / inv_spec))
    attn_scale = model.model.layers[0].self_attn.scaling
    m = 0.1 * c["rope_scaling"]["mscale_all_dim"] * math.log(c["rope_scaling"]["factor"]) + 1.0
    scale_spec = (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) ** -0.5 * m * m
    print(f"  [{name}] YaRN: correction range raw ({rlow:.4f}, {rhigh:.4f}) -> low={low} high={high}; "
          f"HF inv_freq vs spec max rel diff {yarn_rel:.2e}; attention_scaling (cos/sin amp) "
          f"{model.model.rotary_emb.attention_scaling}; softmax scale HF {attn_scale!r} spec {scale_spec!r}")
    print(f"  [{name}] inv_freq = {[float(x) for x in inv_hf]}")
    assert yarn_rel < 1e-6 and abs(attn_scale - scale_spec) < 1e-12

    ref = {
        "model": name,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "weight_seed": seed,
        "dtype": "float32 reference on dequantized FP8 / bf16 weights, eager attention, CPU",
        "sequences": [],
        "greedy": [],
    }
    all_lp = []
    for ids in seqs:
        lg = logits_of(model, ids)
        lp = logprobs_of(lg, ids)
        all_lp += lp
        ref["sequences"].append({"token_ids": ids, "logprobs": lp})
    ref["greedy"] = greedy_out
    lg = logits_of(model, text_ids)
    lp = logprobs_of(lg, text_ids)
    nll = -sum(lp) / len(lp)
    ref["text"] = {"file": "../text.txt", "token_ids": text_ids, "logprobs": lp, "nll": nll, "ppl": math.exp(nll)}
    ref["last_logits"] = logits_of(model, seqs[0])[-1].tolist()

    # Spread of the predictive distributions.
    all_lp += lp
    ent = []
    for ids in seqs + [text_ids]:
        l = torch.log_softmax(logits_of(model, ids).double(), -1)
        ent += (-(l.exp() * l).sum(-1)).tolist()
    a = np.array(all_lp)
    print(f"  [{name}] logprobs of observed tokens: min {a.min():.2f} max {a.max():.2f} mean {a.mean():.2f} std {a.std():.2f} nats; "
          f"predictive entropy mean {np.mean(ent):.2f} (uniform = {math.log(V):.2f}) range [{min(ent):.2f}, {max(ent):.2f}]; "
          f"text nll {nll:.3f} ppl {math.exp(nll):.1f}")

    lines, rstats = routing_report(model, c, seqs[3])
    print(f"  [{name}] routing on sequences[3] (HF top-k == independent spec top-k for every token):")
    print("\n".join(lines))
    for li, s in rstats.items():
        assert s["distinct"] > 1 and s["bias_changed"] > 0, (li, s)
        if c["n_group"] > 1:
            assert s["group_changed"] > 0, (li, s)

    rr = rope_report(model, c, seqs[3])
    print(f"  [{name}] rope sensitivity on sequences[3] (max |dlogprob|, mean |dlogprob|, top-1 flips/positions):")
    for k, (mx, mean, flips, n) in rr.items():
        print(f"    {k}: max {mx:.4f}" + (f" mean {mean:.4f}" if mean is not None else "") + f", flips {flips}/{n}")
    assert rr["rope disabled (inv_freq=0)"][0] > 0.5
    assert rr["plain rope freqs (no YaRN ramp)"][0] > 0.05

    gl = [len(set(g["continuation"])) for g in greedy_out]
    print(f"  [{name}] greedy: distinct tokens per continuation {gl}; per-prompt min margins "
          f"{[round(min(g['margins']), 4) for g in greedy_out]}")

    if c["num_nextn_predict_layers"] > 0:
        ref["mtp"] = mtp_reference(model, c, b.ref, seqs[2])
        print(f"  [{name}] MTP: {len(ref['mtp']['argmax'])} draft rows, positions-from-0 vs positions-from-1 max |dlogit| "
              f"{ref['mtp']['_shift_check']:.2e}; argmax margins min {min(ref['mtp']['margins']):.4f}")
        del ref["mtp"]["_shift_check"]

    xc = crosscheck_from_pretrained(b, c, seqs[3], ref["sequences"][3]["logprobs"])
    print(f"  [{name}] from_pretrained cross-check (same tensor names, FP8 pre-dequantized to f32, transformers' own loader "
          f"incl. per-expert stacking): max |dlogprob| vs reference {xc:.2e}")
    assert xc < 1e-4

    (out_dir / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n", encoding="utf-8")
    return ref


@torch.no_grad()
def crosscheck_from_pretrained(b: Builder, c, ids, lp_ref):
    """Load a copy of the checkpoint (same DeepSeek names; FP8 weights replaced by their f32 dequantized values,
    scale tensors and quantization_config dropped) through DeepseekV3ForCausalLM.from_pretrained. This checks the
    tensor naming against transformers' own loader and conversion mapping (per-expert -> fused experts).
    transformers' FP8 dequantize-on-load cannot be used: it derives the block size as rows/scale_rows and rejects
    (or mis-scales) ragged 128x128 grids."""
    import tempfile

    from transformers.utils import logging as hf_logging

    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        tensors = {}
        for k, t in b.ckpt.items():
            if k.endswith("_scale_inv"):
                continue
            tensors[k] = b.ref[k] if t.dtype == torch.float8_e4m3fn else t
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(td / "model.safetensors"), metadata={"format": "pt"})
        cfg = {k: v for k, v in c.items() if k != "quantization_config"}
        cfg["model_type"] = "deepseek_v3"
        (td / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
        verb = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            m = DeepseekV3ForCausalLM.from_pretrained(
                str(td), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
            ).eval()
        finally:
            hf_logging.set_verbosity(verb)
        for name, p in m.state_dict().items():
            assert p.dtype == torch.float32, name
        lg = m(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        lp = logprobs_of(lg, ids)
        return max(abs(a - b_) for a, b_ in zip(lp, lp_ref))


@torch.no_grad()
def mtp_reference(model, c, ref_w, ids):
    mtp = build_hf_mtp(model, c, ref_w)
    n = len(ids)
    h = model.model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state  # post final norm
    inp = torch.tensor([ids[1:]])
    prev = h[:, : n - 1]

    def run(pos0):
        pos = (torch.arange(n - 1) + pos0).unsqueeze(0)
        u = mtp.forward_layer(0, prev, pos, None, input_ids=inp)
        return u, mtp.shared_head(u)[0]

    u, lg = run(0)
    _, lg1 = run(1)
    lp = torch.log_softmax(lg.double(), -1)
    top2 = torch.topk(lg, 2, dim=-1)
    return {
        "description": (
            "MTP layer (model.layers.{L}) as transformers' MtpModel runs it: row i (0..n-2) feeds embed(token_ids[i+1]) "
            "(enorm) and the main model's final-normed hidden state at position i (hnorm), eh_proj([e; h]), the MTP decoder "
            "block at position i (rope positions 0..n-2; HF's candidate generator uses 1..n-1, identical up to rounding "
            "because RoPE is relative), shared_head.norm, then the main lm_head. logprobs[i] = log p_mtp(token_ids[i+2]) "
            "for i in 0..n-3; argmax[i] = draft token of row i; last_logits = logits of row n-2."
        ),
        "token_ids": ids,
        "logprobs": [float(lp[i, ids[i + 2]]) for i in range(n - 2)],
        "argmax": top2.indices[:, 0].tolist(),
        "margins": (top2.values[:, 0] - top2.values[:, 1]).tolist(),
        "last_logits": lg[-1].tolist(),
        "_shift_check": float((lg - lg1).abs().max()),
    }


def dir_size(p: Path):
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT_ROOT)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    args = ap.parse_args()

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    torch.use_deterministic_algorithms(True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, numpy {np.__version__}")
    args.out.mkdir(parents=True, exist_ok=True)

    tok = tiny_tokenizer.build_tokenizer()
    (args.out / "text.txt").write_text(TEXT, encoding="utf-8")
    text_ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert tok.decode(text_ids) == TEXT
    print(f"tokenizer: vocab {tok.get_vocab_size()}, sha256 {hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]}; "
          f"text.txt: {len(TEXT)} chars -> {len(text_ids)} tokens")

    for name in args.models:
        print(f"== {name}")
        generate_model(name, MODELS[name], tok, text_ids, args.out / name)

    print("== sizes")
    total = 0
    for name in args.models:
        d = args.out / name
        sz = dir_size(d)
        total += sz
        files = ", ".join(f"{f.name} {f.stat().st_size / 1024:.0f}K" for f in sorted(d.iterdir()))
        print(f"  {name}: {sz / 1e6:.2f} MB ({files})")
    print(f"  total: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
