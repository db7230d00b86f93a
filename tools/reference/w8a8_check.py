"""W8A8 end to end on a fuzz case's FP8 checkpoint (fuzz.py): `cachalot convert --quant-mode w8a8c16`, then the
engine's log-probabilities on the converted checkpoint against transformers' DeepseekV3 on the same converted
tensors with every int8 Linear simulated as the seed runs it (spec `deepseek-v3-r1-kimi-k2.md` §4: per-token
dynamic symmetric int8 activations, sx = max|x| / 127, round half to even; int32 sums; y = Σ xq·Wq · sx · sw, the
routed experts' gate/up and down alike; kv_b_proj, the router, embeddings, norms and lm_head as stored, bf16).
An independent reading of which Linears run int8 and how their scales apply.
"""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

import make_fixtures as mf

QUANTIZED = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj")


def quant_act(x):
    """Per-row dynamic int8 codes (as f64 values) and scales, in f32: q = round_half_even(x · (127 / amax)), the
    reciprocal as the NPU kernel receives it (on these random models one flipped code moves every later
    position's log-probability by ~1e-2, so the rounding must be the same one)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    q = torch.round(x * inv).clamp(-127, 127)
    return q.double(), (amax / 127.0).double()


def qlinear(x, wq, sw):
    q, sx = quant_act(x)
    return ((q @ wq.double().T) * sx * sw.double().view(1, -1)).float()


class QLinear(torch.nn.Module):
    def __init__(self, wq, sw):
        super().__init__()
        self.wq, self.sw = wq, sw

    def forward(self, x):
        shape = x.shape
        return qlinear(x.reshape(-1, shape[-1]), self.wq, self.sw).reshape(*shape[:-1], -1)


def qexperts_forward(self, hidden_states, top_k_index, top_k_weights):
    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        hit = (top_k_index == e)
        token_idx, pos = torch.where(hit)
        if len(token_idx) == 0:
            continue
        x = hidden_states[token_idx]
        gate, up = qlinear(x, self.q13[e], self.s13[e]).chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        y = qlinear(h, self.q2[e], self.s2[e]) * top_k_weights[token_idx, pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def convert(engine, d):
    out = Path(d) / "w8a8c16"
    cmd = [engine, "convert", "--input", str(d), "--output", str(out), "--quant-mode", "w8a8c16", "--force"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return out, p.returncode, p.stderr[-2000:]


def build_sim(build_hf_model, c, out):
    """transformers' model on the converted tensors, int8 Linears simulated (module docs)."""
    t = {}
    for f in sorted(Path(out).glob("*.safetensors")):
        t.update(load_file(str(f)))
    scales = {k[: -len("_scale")]: v for k, v in t.items() if k.endswith(".weight_scale")}
    ref = {k: v.float() for k, v in t.items() if not k.endswith(".weight_scale")}
    if c.get("tie_word_embeddings") and "lm_head.weight" not in ref:  # a tied checkpoint may omit it
        ref["lm_head.weight"] = ref["model.embed_tokens.weight"]
    int8 = {k for k, v in t.items() if v.dtype == torch.int8}
    assert int8 == set(scales), (sorted(int8 ^ set(scales))[:4])
    model = build_hf_model(c, ref)
    n = 0
    covered = set()
    for name, mod in list(model.named_modules()):
        for child in QUANTIZED:
            w = f"{name}.{child}.weight"
            if isinstance(getattr(mod, child, None), torch.nn.Linear) and w in scales:
                setattr(mod, child, QLinear(ref[w], scales[w].view(-1)))
                covered.add(w)
                n += 1
    # Routed experts: per-expert codes and scales (gate rows first, as hf_state_dict fuses them).
    for li, layer in enumerate(model.model.layers):
        ex = getattr(layer.mlp, "experts", None)
        if ex is None:
            continue
        p = f"model.layers.{li}.mlp.experts."
        E = c["n_routed_experts"]
        ex.q13 = [torch.cat([ref[p + f"{e}.gate_proj.weight"], ref[p + f"{e}.up_proj.weight"]], 0) for e in range(E)]
        ex.s13 = [torch.cat([scales[p + f"{e}.gate_proj.weight"].view(-1), scales[p + f"{e}.up_proj.weight"].view(-1)])
                  for e in range(E)]
        ex.q2 = [ref[p + f"{e}.down_proj.weight"] for e in range(E)]
        ex.s2 = [scales[p + f"{e}.down_proj.weight"].view(-1) for e in range(E)]
        ex.forward = qexperts_forward.__get__(ex)
        covered |= {p + f"{e}.{w}_proj.weight" for e in range(E) for w in ("gate", "up", "down")}
        n += 1
    # Every int8 tensor of the main layers runs simulated (the MTP layers do not run here).
    L = c["num_hidden_layers"]
    main = {k for k in int8 if not any(k.startswith(f"model.layers.{li}.") for li in range(L, L + 8))}
    assert main <= covered, sorted(main - covered)[:4]
    return model, n


# Int8 codes flip where upstream f32 rounding differs by an ulp near a .5 boundary (the simulation's norms,
# attention and sums run in another order than the engine's), about one position in fifty on these models,
# or a router near-tie flips on the quantization noise; from there every later position of these chaotic
# random models moves (by up to nats with top-1 routing). A systematic error (a Linear run in float, a scale
# misapplied) shows at once: floating the attention Linears, the MLPs or the experts in the simulation moved
# the first position past 1e-3 of its log-probability, and leaving q_proj unsimulated the second (the first
# attends only to itself). So the check holds each sequence's first PREFIX positions to AGREE nats, or AGREE
# of the log-probability where it is large (random models with tied embeddings reach −100), and fails only
# where every sequence diverges there: a flip hits one sequence (one in fifty had one within its first two
# positions, its other sequence agreeing to 1e-6), a systematic error all of them. The sequences
# (`quant_seqs`) start with different tokens: a flip at a shared first position hit both of a case's
# sequences at once.
PREFIX = 2
AGREE = 1e-3


def w8a8_check(engine, build_hf_model, d, c, seqs, threads):
    """((first position past AGREE over `seqs`, max |d logprob|), None) or (None, what failed); the first
    position is the shortest sequence's length where none is."""
    out, rc, err = convert(engine, d)
    if rc != 0:
        return None, f"convert: {err}"
    model, n = build_sim(build_hf_model, c, out)
    if n == 0:
        return None, "no int8 Linear in the converted checkpoint"
    return compare(engine, model, out, seqs, threads, ["--kv-cache-dtype", "f32"])


def compare(engine, model, out, seqs, threads, extra):
    """The engine on checkpoint `out` against `model` over `seqs` (`w8a8_check`'s rule)."""
    first, worst, early = None, 0.0, []
    for ids in seqs:
        with torch.no_grad():
            ref = mf.logprobs_of(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float(), ids)
        cmd = [engine, "perplexity", "--model", str(out), "--token-ids", ",".join(map(str, ids)), "--json"] + extra
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, RAYON_NUM_THREADS=str(threads)))
        if p.returncode != 0:
            return None, f"perplexity on the converted checkpoint: {p.stderr[-2000:]}"
        got = json.loads(p.stdout)["logprobs"]
        d_ = [abs(a - b) for a, b in zip(got, ref)]
        at = next((i for i, (x, r) in enumerate(zip(d_, ref)) if x > AGREE * max(1.0, abs(r))), len(d_))
        if at < min(PREFIX, len(d_)):
            early.append(f"position {at} of a {len(ids)}-token sequence differs by {d_[at]:.3e} nats")
        first = at if first is None else min(first, at)
        worst = max([worst] + d_)
    if len(early) == len(seqs):
        return None, "; ".join(early) + f" (max {worst:.3e})"
    return (first, worst), None

# ------------------------------------------------------------------------------------------------
# DeepSeek-V4 `--quant-type w8a8-int` (spec `deepseek-v4.md` §4.2: routed and shared experts, wq_b, wo_b and
# the indexer's wq_b in INT8 per channel with int8 per-token activations; the rest as stored)
# ------------------------------------------------------------------------------------------------

V4_LINEARS = [  # DeepSeek name under layers.N. -> transformers module path under model.layers.N.
    ("attn.wq_b", "self_attn.q_b_proj"),
    ("attn.wo_b", "self_attn.o_b_proj"),
    ("attn.indexer.wq_b", "self_attn.compressor.indexer.q_b_proj"),
    ("ffn.shared_experts.w1", "mlp.shared_experts.gate_proj"),
    ("ffn.shared_experts.w3", "mlp.shared_experts.up_proj"),
    ("ffn.shared_experts.w2", "mlp.shared_experts.down_proj"),
]


def qexperts_v4_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' V4 experts with int8 products; the routing weight multiplies h before w2, as the
    engine and DeepSeek's code do (the same int8 codes as after: per-token scaling)."""
    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        token_idx, pos = torch.where(top_k_index == e)
        if len(token_idx) == 0:
            continue
        h = self._apply_gate(qlinear(hidden_states[token_idx], self.q13[e], self.s13[e]))
        y = qlinear(h * top_k_weights[token_idx, pos, None], self.q2[e], self.s2[e])
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def quant_seqs(c, seed):
    """The sequences the quantized check scores: three of 8-64 random tokens, each starting with its own token
    (a flip at a shared first position would hit every sequence at once and read as systematic)."""
    rng = np.random.default_rng(seed + 41)
    firsts = rng.choice(np.arange(2, c["vocab_size"]), size=3, replace=False)
    return [[int(f)] + rng.integers(2, c["vocab_size"], size=int(rng.integers(8, 64))).tolist() for f in firsts]


def unpack_int4(w):
    """`w4a8-int`'s INT4 weight (spec §4.4): int8 [N/2, K], row 2j in the low nibble of byte [j, k] and row
    2j + 1 in the high one, two's complement; returns the codes as f32 [N, K]."""
    b = w.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    lo, hi = torch.where(lo >= 8, lo - 16, lo), torch.where(hi >= 8, hi - 16, hi)
    return torch.stack([lo, hi], 1).reshape(-1, w.shape[1]).float()


def int4_scale(s):
    """uint64 [N, 1], the low 32 bits an f32's pattern."""
    low = (s.view(torch.int64).numpy() & 0xFFFFFFFF).astype(np.uint32)
    return torch.from_numpy(low.view(np.float32).reshape(-1).copy())


def build_v4_sim(mv, c, out):
    t = {}
    for f in sorted(Path(out).glob("*.safetensors")):
        t.update(load_file(str(f)))
    int8 = {k for k, v in t.items() if v.dtype == torch.int8}
    scales, int4 = {}, set()
    for k in int8:
        sc = t[k[: -len(".weight")] + ".scale"]
        if sc.dtype == torch.uint64:  # INT4, packed along N, with the Ascend kernel's bias beside it
            int4.add(k)
            scales[k] = int4_scale(sc)
        else:
            scales[k] = sc.view(-1).float()
    base = {k[: -len(".weight")] for k in int8}
    ref = {k: (v if v.dtype == torch.int64 else v.float()) for k, v in t.items()
           if not (k.endswith((".scale", ".bias")) and k.rsplit(".", 1)[0] in base)}
    for k in int4:
        ref[k] = unpack_int4(t[k])
    model = mv.build_hf_model(c, ref)
    covered = set()
    for li, layer in enumerate(model.model.layers):
        for src, dst in V4_LINEARS:
            w = f"layers.{li}.{src}.weight"
            if w not in int8:
                continue
            *path, leaf = dst.split(".")
            mod = layer
            for p in path:
                mod = getattr(mod, p)
            setattr(mod, leaf, QLinear(ref[w], scales[w]))
            covered.add(w)
        p = f"layers.{li}.ffn.experts."
        if p + "0.w1.weight" in int8:
            ex, E = layer.mlp.experts, c["n_routed_experts"]
            ex.q13 = [torch.cat([ref[p + f"{e}.w1.weight"], ref[p + f"{e}.w3.weight"]], 0) for e in range(E)]
            ex.s13 = [torch.cat([scales[p + f"{e}.w1.weight"], scales[p + f"{e}.w3.weight"]]) for e in range(E)]
            ex.q2 = [ref[p + f"{e}.w2.weight"] for e in range(E)]
            ex.s2 = [scales[p + f"{e}.w2.weight"] for e in range(E)]
            ex.forward = qexperts_v4_forward.__get__(ex)
            covered |= {p + f"{e}.w{i}.weight" for e in range(E) for i in (1, 2, 3)}
    main = {k for k in int8 if k.startswith("layers.")}
    assert main <= covered, sorted(main - covered)[:4]
    return model


def w8a8_v4_check(engine, mv, d, c, seqs, threads, qtype="w8a8-int"):
    """`w8a8_check` for DeepSeek-V4's `--quant-type w8a8-int` or `w4a8-int` (INT4 routed experts)."""
    out = Path(d) / qtype
    cmd = [engine, "convert", "--input", str(d), "--output", str(out), "--quant-type", qtype, "--force"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        return None, f"convert: {p.stderr[-2000:]}"
    model = build_v4_sim(mv, c, out)
    return compare(engine, model, out, seqs, threads, [])
