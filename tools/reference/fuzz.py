#!/usr/bin/env python3
"""Differential fuzz: cachalot perplexity vs transformers DeepseekV3ForCausalLM on random tiny configs.

Usage (from the repository root, after `cargo build --release`; the venv of tools/reference/README.md):
  python tools/reference/fuzz.py --seeds 0-29          # random configs
  python tools/reference/fuzz.py --config cfg.json --meta meta.json   # one explicit config
Environment: CACHALOT (the binary, default target/release/cachalot), FUZZ_RUNS (where each case's
checkpoint, config, reference, engine output and result.json go; default $TMPDIR/cachalot-fuzz).
What it varies is random_config() below, the tolerance TOL (as tests/reference.rs); transformers' V3
ignores moe_layer_freq, so the reference gets DeepSeek's rule patched in.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402
from run_check import mtp_check, run_check  # noqa: E402
from w8a8_check import quant_seqs, w8a8_check  # noqa: E402
from transformers.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[2]
ENGINE = os.environ.get("CACHALOT", str(REPO / "target" / "release" / "cachalot"))
RUNS = Path(os.environ.get("FUZZ_RUNS", Path(os.environ.get("TMPDIR", "/tmp")) / "cachalot-fuzz"))
TOK_DIR = REPO / "fixtures" / "v3" / "r1_tiny"
TOL = 0.02


# ------------------------------------------------------------------------------------------
# config generation
# ------------------------------------------------------------------------------------------

def random_config(rng):
    c = json.loads(json.dumps(mf.COMMON))
    ch = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    c["model_type"] = ch(["deepseek_v3", "kimi_k2"])
    c["hidden_size"] = ch([64, 96, 128, 192, 256])
    c["vocab_size"] = ch([512, 512, 640, 1024])
    L = int(rng.integers(1, 5))
    c["num_hidden_layers"] = L
    c["first_k_dense_replace"] = L if rng.random() < 0.12 else int(rng.integers(0, L))
    c["moe_layer_freq"] = ch([1, 1, 1, 2])
    c["num_attention_heads"] = c["num_key_value_heads"] = ch([1, 2, 3, 4, 8])
    c["qk_nope_head_dim"] = ch([16, 32, 48, 64])
    c["qk_rope_head_dim"] = ch([8, 16, 32, 64])
    c["v_head_dim"] = ch([16, 32, 48, 64])
    c["q_lora_rank"] = ch([None, 32, 64, 96, 160])
    c["kv_lora_rank"] = ch([32, 64, 96, 128, 160])
    c["intermediate_size"] = ch([64, 128, 320])
    c["moe_intermediate_size"] = ch([16, 24, 40, 64])
    ng, tg = ch([(1, 1), (2, 1), (4, 2), (8, 4), (8, 3), (4, 1), (2, 2)])
    per = ch([2, 3, 4, 8])
    while ng * per > 64:
        per //= 2
    per = max(per, 2)
    c["n_group"], c["topk_group"], c["n_routed_experts"] = ng, tg, ng * per
    c["num_experts_per_tok"] = int(rng.integers(1, min(8, tg * per) + 1))
    c["n_shared_experts"] = ch([0, 1, 1, 2])
    c["norm_topk_prob"] = bool(rng.integers(2))
    c["routed_scaling_factor"] = ch([1.0, 2.5, 2.827, float(round(rng.uniform(0.5, 4.0), 3))])
    c["rms_norm_eps"] = ch([1e-6, 1e-5])
    c["rope_theta"] = ch([10000, 50000, 1000000])
    if rng.random() < 0.25:
        c["rope_scaling"] = None
        c["max_position_embeddings"] = ch([4096, 8192])
    else:
        f = ch([4, 8, 32, 40, 64])
        orig = ch([64, 128, 256, 4096])
        ms = ch([(1.0, 1.0), (1.0, 1.0), (0.707, 0.707), (1.0, 0.707), (0.8, 1.0), (1.0, 0.0)])
        c["rope_scaling"] = {
            "beta_fast": ch([32, 32, 1, 16]),
            "beta_slow": ch([1, 1, 2]),
            "factor": f,
            "mscale": ms[0],
            "mscale_all_dim": ms[1],
            "original_max_position_embeddings": orig,
            "type": "yarn",
        }
        if c["rope_scaling"]["beta_slow"] > c["rope_scaling"]["beta_fast"]:
            c["rope_scaling"]["beta_slow"] = 1
        c["max_position_embeddings"] = orig * f
    c["num_nextn_predict_layers"] = ch([0, 1])
    c["tie_word_embeddings"] = rng.random() < 0.15
    if rng.random() < 0.4:  # odd (non-SIMD-friendly) sizes
        c["hidden_size"] = ch([72, 100, 136, 200])
        c["vocab_size"] = ch([515, 600, 777])
        c["qk_nope_head_dim"] = ch([8, 24, 40])
        c["qk_rope_head_dim"] = ch([2, 6, 10, 12])
        c["v_head_dim"] = ch([8, 20, 24, 40])
        c["kv_lora_rank"] = ch([40, 72, 136])
        c["q_lora_rank"] = ch([None, 48, 100, 130])
        c["moe_intermediate_size"] = ch([12, 20, 36, 130])
        c["intermediate_size"] = ch([100, 200, 260])
        c["num_attention_heads"] = c["num_key_value_heads"] = ch([1, 3, 5, 16])
        if c["rope_scaling"] is not None:
            c["max_position_embeddings"] = c["rope_scaling"]["original_max_position_embeddings"] * c["rope_scaling"]["factor"]
    meta = {
        "threads": ch([1, 1, 2]),
        "weights": ch(["fp8", "fp8", "fp8", "bf16", "bf16", "f16", "f32"]),
        "shards": int(rng.integers(1, 4)),
        "tie_omit_lm_head": bool(rng.integers(2)),
        "seq_lens": [int(rng.integers(2, 24)), int(rng.integers(150, 301))],
        "chunk": ch([512, 512, 64, 37, 128, 1]),  # 1: every token a step, as decode
        "attention": ch(["auto", "auto", "naive", "absorbed"]),
        "fp8": ch(["native", "native", "f32"]),
    }
    # The engine refuses contexts past max_position_embeddings (a YaRN config's can be 256).
    meta["seq_lens"] = [min(n, c["max_position_embeddings"]) for n in meta["seq_lens"]]
    if meta["weights"] != "fp8":
        c.pop("quantization_config", None)
    return dict(sorted(c.items())), meta


# ------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------

class Builder(mf.Builder):
    def __init__(self, rng, fmt):
        super().__init__(rng)
        self.fmt = fmt

    def fp8_linear(self, name, out_f, in_f, gain=1.0):
        if self.fmt == "fp8":
            return super().fp8_linear(name, out_f, in_f, gain)
        w = self.randn(out_f, in_f) * np.float32(gain / math.sqrt(in_f))
        dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[self.fmt]
        q = w.to(dt).contiguous()
        self.ckpt[name + ".weight"] = q
        self.ref[name + ".weight"] = q.to(torch.float32)


def build_layer(b, c, li, moe):
    """make_fixtures.build_layer, but n_shared_experts = 0 writes no shared expert."""
    if not moe or c["n_shared_experts"] > 0:
        return mf.build_layer(b, c, li, moe)
    c2 = dict(c, n_shared_experts=1)
    mf.build_layer(b, c2, li, moe)
    p = f"model.layers.{li}.mlp.shared_experts."
    for k in list(b.ckpt):
        if k.startswith(p):
            del b.ckpt[k]
            b.ref.pop(k, None)
    b.fp8_names = [n for n in b.fp8_names if not n.startswith(p)]


def is_moe(c, li):
    return li >= c["first_k_dense_replace"] and li % c["moe_layer_freq"] == 0


def build_weights(c, meta, seed):
    b = Builder(np.random.default_rng(seed), meta["weights"])
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    b.bf16("model.embed_tokens.weight", b.randn(V, H) * np.float32(mf.GAINS["embed"]))
    for li in range(L):
        build_layer(b, c, li, moe=is_moe(c, li))
    b.norm("model.norm.weight", H)
    if c["tie_word_embeddings"]:
        if not meta["tie_omit_lm_head"]:
            b.ckpt["lm_head.weight"] = b.ckpt["model.embed_tokens.weight"].clone()
        b.ref["lm_head.weight"] = b.ref["model.embed_tokens.weight"]
    else:
        b.bf16("lm_head.weight", b.randn(V, H) * np.float32(mf.GAINS["lm_head"] / math.sqrt(H)))
    for j in range(c["num_nextn_predict_layers"]):
        li = L + j
        p = f"model.layers.{li}."
        build_layer(b, c, li, moe=True)
        b.norm(p + "enorm.weight", H)
        b.norm(p + "hnorm.weight", H)
        b.bf16(p + "eh_proj.weight", b.randn(H, 2 * H) * np.float32(mf.GAINS["eh_proj"] / math.sqrt(2 * H)))
        b.norm(p + "shared_head.norm.weight", H)
        b.ckpt[p + "shared_head.head.weight"] = b.ckpt.get("lm_head.weight", b.ckpt["model.embed_tokens.weight"]).clone()
        b.ckpt[p + "embed_tokens.weight"] = b.ckpt["model.embed_tokens.weight"].clone()
    return b


def write_checkpoint(b, c, n_shards, out):
    if b.fmt == "fp8" and len(b.fp8_names) >= n_shards:
        try:
            return mf.write_checkpoint(b, c, n_shards, out)
        except IndexError:
            pass
    names = list(b.ckpt)
    total = sum(mf.nbytes(b.ckpt[k]) for k in names)
    target = total / n_shards
    assign, acc = {}, 0
    for k in names:
        assign[k] = min(int(acc // target), n_shards - 1)
        acc += mf.nbytes(b.ckpt[k])
    used = sorted(set(assign.values()))
    n = len(used)
    remap = {s: i for i, s in enumerate(used)}
    fname = lambda s: f"model-{s + 1:05d}-of-{n:05d}.safetensors"  # noqa: E731
    for s in used:
        save_file({k: b.ckpt[k].contiguous() for k in names if assign[k] == s}, str(out / fname(remap[s])), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": {k: fname(remap[assign[k]]) for k in sorted(names)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")


# ------------------------------------------------------------------------------------------
# reference model
# ------------------------------------------------------------------------------------------

def hf_config(c):
    rs = c["rope_scaling"]
    if rs is None:
        rp = {"rope_type": "default", "rope_theta": float(c["rope_theta"])}
    else:
        rp = {
            "rope_type": rs.get("type") or rs.get("rope_type"),
            "rope_theta": float(c["rope_theta"]),
            "factor": float(rs["factor"]) if rs.get("factor") is not None else None,
            "original_max_position_embeddings": rs["original_max_position_embeddings"],
            "beta_fast": float(rs["beta_fast"]),
            "beta_slow": float(rs["beta_slow"]),
        }
        for k in ("mscale", "mscale_all_dim"):
            if k in rs:
                rp[k] = float(rs[k])
    cfg = DeepseekV3Config(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        moe_intermediate_size=c["moe_intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        n_shared_experts=c["n_shared_experts"], n_routed_experts=c["n_routed_experts"],
        routed_scaling_factor=c["routed_scaling_factor"], kv_lora_rank=c["kv_lora_rank"], q_lora_rank=c["q_lora_rank"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], qk_nope_head_dim=c["qk_nope_head_dim"],
        n_group=c["n_group"], topk_group=c["topk_group"], num_experts_per_tok=c["num_experts_per_tok"],
        first_k_dense_replace=c["first_k_dense_replace"], norm_topk_prob=c["norm_topk_prob"], hidden_act="silu",
        max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"], bos_token_id=0,
        eos_token_id=1, tie_word_embeddings=c["tie_word_embeddings"], attention_bias=False,
        num_mtp_layers=c["num_nextn_predict_layers"], rope_parameters=rp,
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def build_hf_model(c, ref):
    cfg = hf_config(c)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32).eval()
    L = c["num_hidden_layers"]
    # DeepSeek's own modeling code: MoE iff layer >= first_k_dense_replace and layer % moe_layer_freq == 0.
    # transformers ignores moe_layer_freq: patch the dense layers in.
    for li in range(L):
        if not is_moe(c, li) and li >= c["first_k_dense_replace"]:
            model.model.layers[li].mlp = DeepseekV3MLP(cfg).to(torch.float32)
    sd = mf.hf_state_dict(ref, c, range(L), lambda li: f"model.layers.{li}.")
    sd["model.embed_tokens.weight"] = ref["model.embed_tokens.weight"]
    sd["model.norm.weight"] = ref["model.norm.weight"]
    sd["lm_head.weight"] = ref["lm_head.weight"]
    own = model.state_dict()
    for k in own:  # zero-width shared experts (n_shared_experts = 0)
        if k not in sd and own[k].numel() == 0:
            sd[k] = own[k].clone()
    assert set(sd) == set(own), (sorted(set(own) - set(sd)), sorted(set(sd) - set(own)))
    for k in own:
        assert own[k].shape == sd[k].shape, (k, own[k].shape, sd[k].shape)
    model.load_state_dict(sd, strict=True)
    if c["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@torch.no_grad()
def router_min_gap(model, c, ids):
    """Smallest relative gap in the reference between the last selected and first rejected candidate
    (groups and experts), over all MoE layers and tokens: near-ties can legitimately flip in f32."""
    probe = mf.RouterProbe(model)
    model(input_ids=torch.tensor([ids]), use_cache=False)
    probe.close()
    E, G, TG, K = c["n_routed_experts"], c["n_group"], c["topk_group"], c["num_experts_per_tok"]
    best = float("inf")
    for li, rl, idx, bias in probe.records:
        sc = torch.sigmoid(rl.double()) + bias.double()
        if G > 1:
            gs = sc.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
            if TG < G:
                v = gs.sort(-1, descending=True).values
                best = min(best, float(((v[:, TG - 1] - v[:, TG]) / v[:, TG - 1].abs()).min()))
            keep = torch.zeros_like(gs, dtype=torch.bool)
            keep.scatter_(1, gs.topk(TG, dim=-1).indices, True)
            sc = sc.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
        v = sc.sort(-1, descending=True).values
        if K < v.shape[1]:
            nxt = v[:, K]
            fin = torch.isfinite(nxt)
            if fin.any():
                best = min(best, float(((v[fin, K - 1] - nxt[fin]) / v[fin, K - 1].abs()).min()))
    return best


# ------------------------------------------------------------------------------------------
# one case
# ------------------------------------------------------------------------------------------

def run_engine(d, ids, meta):
    cmd = [ENGINE, "perplexity", "--model", str(d), "--token-ids", ",".join(map(str, ids)), "--json",
           "--chunk", str(meta["chunk"]), "--attention", meta["attention"], "--fp8", meta["fp8"],
           # The reference keeps f32 latents; the default bf16 cache (the seed's C16) rounds them
           # on purpose, moving logits by up to a few nats on these random models.
           "--kv-cache-dtype", meta.get("kv_cache_dtype", "f32")]
    env = dict(os.environ, RAYON_NUM_THREADS=str(meta.get("threads", 1)))
    cmd += meta.get("extra_args", [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return p.returncode, p.stdout, p.stderr, cmd


def run_case(name, c, meta, wseed, keep=False):
    d = RUNS / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps(meta, indent=1))
    res = {"name": name, "config": c, "meta": meta}
    try:
        b = build_weights(c, meta, wseed)
        write_checkpoint(b, c, meta["shards"], d)
        ec = json.loads(json.dumps(c))
        for path, v in meta.get("engine_cfg_patch", []):  # spelling variants seen only by the engine
            tgt = ec
            for k in path[:-1]:
                tgt = tgt[k]
            if v == "__DELETE__":
                tgt.pop(path[-1], None)
            else:
                tgt[path[-1]] = v
        (d / "config.json").write_text(json.dumps(ec, indent=2) + "\n")
        if meta.get("single_file"):
            from safetensors.torch import load_file
            allt = {}
            for f in sorted(d.glob("model-*.safetensors")):
                allt.update(load_file(str(f)))
                f.unlink()
            (d / "model.safetensors.index.json").unlink()
            save_file(allt, str(d / "model.safetensors"), metadata={"format": "pt"})
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOK_DIR / f, d / f)
        model = build_hf_model(c, b.ref)
    except Exception as e:  # reference rejected the config
        res["status"] = "ref_error"
        res["error"] = repr(e)
        (d / "result.json").write_text(json.dumps(res, indent=1))
        return res
    rng = np.random.default_rng(wseed + 17)
    worst, worst_seq, nll_rel, gaps = 0.0, None, 0.0, []
    res["seqs"] = []
    scored = []
    for n in meta["seq_lens"]:
        ids = rng.integers(0, c["vocab_size"], size=n).tolist()
        ids[0] = 0
        scored.append(ids)
        with torch.no_grad():
            lg = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        ref = mf.logprobs_of(lg, ids)
        gap = router_min_gap(model, c, ids) if any(is_moe(c, li) for li in range(c["num_hidden_layers"])) else None
        rc, out, err, cmd = run_engine(d, ids, meta)
        s = {"n": n, "ids": ids, "ref": ref, "router_min_rel_gap": gap, "rc": rc}
        if rc != 0:
            s["stderr"] = err[-2000:]
            res["status"] = "engine_error"
            res["error"] = err[-2000:]
            res["cmd"] = " ".join(cmd[:4]) + " --token-ids <ids> " + " ".join(cmd[6:])
            res["seqs"].append(s)
            break
        got = json.loads(out)["logprobs"]
        s["got"] = got
        diff = [abs(a - b_) for a, b_ in zip(got, ref)]
        assert len(got) == len(ref), (len(got), len(ref))
        mx = max(diff) if diff else 0.0
        s["max_abs"] = mx
        s["argmax_pos"] = int(np.argmax(diff)) if diff else None
        nr, ng_ = -np.mean(ref), -np.mean(got)
        s["nll_rel"] = float(abs(ng_ - nr) / nr)
        nll_rel = max(nll_rel, s["nll_rel"])
        if mx > worst:
            worst, worst_seq = mx, n
        res["seqs"].append(s)
    else:
        res["status"] = "ok" if worst <= TOL else "MISMATCH"
    if res["status"] in ("ok", "tie") and c.get("num_nextn_predict_layers", 0) > 0:
        rc, err, cmd = mtp_check(ENGINE, d, wseed + 29, meta.get("threads", 1), ["--kv-cache-dtype", meta.get("kv_cache_dtype", "f32")])
        if rc != 0:
            res["status"] = "mtp_error"
            res["error"] = err[-2000:]
            res["cmd"] = " ".join(cmd)
    if res["status"] == "ok" and meta["weights"] == "fp8":
        try:
            w8, why = w8a8_check(ENGINE, build_hf_model, d, c, quant_seqs(c, wseed), meta.get("threads", 1))
        except Exception as e:  # the simulation itself failed (an int8 tensor it does not place, ...)
            w8, why = None, f"the simulation failed: {e!r}"
        res["w8a8_first_max"] = w8
        if why:
            res["status"] = "w8a8_mismatch"
            res["error"] = f"W8A8 against its simulation: {why}"
    if res["status"] in ("ok", "tie"):
        why, ranks = run_check(ENGINE, d, "kimi_k2" if c["model_type"] == "kimi_k2" else "deepseek_r1", wseed + 31,
                        c.get("num_nextn_predict_layers", 0) > 0, meta.get("threads", 1))
        res["ranks"] = ranks
        if why:
            res["status"] = "run_mismatch"
            res["error"] = why
    res["max_abs"] = worst
    res["nll_rel"] = nll_rel
    (d / "result.json").write_text(json.dumps(res))
    if res["status"] == "ok" and not keep:
        for f in d.glob("*.safetensors"):
            f.unlink()
    return res


def summary(res):
    c, m = res["config"], res["meta"]
    rs = c["rope_scaling"]
    rope = "none" if rs is None else f"yarn f={rs['factor']} orig={rs['original_max_position_embeddings']} b={rs['beta_fast']}/{rs['beta_slow']} ms={rs.get('mscale')}/{rs.get('mscale_all_dim')}"
    gaps = [s.get("router_min_rel_gap") for s in res.get("seqs", []) if s.get("router_min_rel_gap") is not None]
    return (f"{res['name']}: {res['status']} ranks={res.get('ranks')} w8a8={'/'.join(f'{v:.3g}' for v in res.get('w8a8_first_max') or [])} max|d|={res.get('max_abs', float('nan')):.2e} nllrel={res.get('nll_rel', 0):.1e} "
            f"gap={min(gaps) if gaps else None!s:.8} | {c['model_type']} H{c['hidden_size']} V{c['vocab_size']} L{c['num_hidden_layers']} "
            f"fkd{c['first_k_dense_replace']} freq{c['moe_layer_freq']} nh{c['num_attention_heads']} "
            f"d{c['qk_nope_head_dim']}/{c['qk_rope_head_dim']}/{c['v_head_dim']} q{c['q_lora_rank']} kv{c['kv_lora_rank']} "
            f"E{c['n_routed_experts']} G{c['n_group']}/{c['topk_group']} K{c['num_experts_per_tok']} sh{c['n_shared_experts']} "
            f"norm{int(c['norm_topk_prob'])} rsf{c['routed_scaling_factor']} eps{c['rms_norm_eps']} theta{c['rope_theta']} {rope} "
            f"mtp{c['num_nextn_predict_layers']} tie{int(c['tie_word_embeddings'])} | {m['weights']} sh{m['shards']} "
            f"seq{m['seq_lens']} chunk{m['chunk']} {m['attention']} fp8={m['fp8']}"
            + (f" omit_lm_head={m['tie_omit_lm_head']}" if c["tie_word_embeddings"] else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--config")
    ap.add_argument("--meta")
    ap.add_argument("--name", default="manual")
    ap.add_argument("--wseed", type=int, default=12345)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    if a.config:
        c = json.loads(Path(a.config).read_text())
        meta = json.loads(Path(a.meta).read_text())
        r = run_case(a.name, c, meta, a.wseed, keep=True)
        print(summary(r))
        if r.get("error"):
            print(r["error"])
        return
    lo, hi = map(int, a.seeds.split("-"))
    for s in range(lo, hi + 1):
        c, meta = random_config(np.random.default_rng(1000 + s))
        r = run_case(f"s{s:03d}", c, meta, 5000 + s, keep=a.keep)
        print(summary(r), flush=True)
        if r.get("error"):
            print("   ", r["error"].strip().replace("\n", "\n    ")[:1500], flush=True)


if __name__ == "__main__":
    main()
