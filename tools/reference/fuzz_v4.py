#!/usr/bin/env python3
"""Differential fuzz for DeepSeek-V4: cachalot perplexity vs transformers' DeepseekV4ForCausalLM on random tiny
V4 configs (the V3 family's is fuzz.py).

Usage (from the repository root, after `cargo build --release`; the venv of tools/reference/README.md):
  python tools/reference/fuzz_v4.py --seeds 0-19
Environment: CACHALOT (the binary, default target/release/cachalot), FUZZ_RUNS (where each case's checkpoint,
config and result.json go; default $TMPDIR/cachalot-fuzz-v4).

What it varies is random_config() below: layer count and each layer's compression ratio (0, 4, 128), hash-routed
layers, widths (hidden, heads, head and RoPE dims, LoRA ranks, output groups), experts and top-k, the indexer's
heads, dims and top-k, hc_mult and Sinkhorn iterations, the sliding window, YaRN, SwiGLU clamp, routing scale and
normalisation, and the engine's prefill chunk and threads. Weights are drawn and stored as DeepSeek ships V4
(make_v4_fixtures.build_weights: FP8 with ue8m0 scales, MXFP4 experts), and the reference runs on exactly the
dequantized values in float32, without the activation-quantisation sims (the engine's default). A case fails above
TOL nats on any token's log-probability; the smallest relative gap of any indexer / router top-k decision in the
reference is reported, since a near-tie can flip under float32 rounding and move the logits legitimately: up to
4 weight draws are tried for one without a decision closer than make_v4_fixtures.MIN_DECISION_GAP (status `tie`
where none was found and the logits differ).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_v4_fixtures as mv  # noqa: E402
from run_check import mtp_check, run_check  # noqa: E402
from w8a8_check import quant_seqs, w8a8_v4_check  # noqa: E402
from make_fixtures import logits_of, logprobs_of  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[2]
ENGINE = os.environ.get("CACHALOT", str(REPO / "target" / "release" / "cachalot"))
RUNS = Path(os.environ.get("FUZZ_RUNS", Path(os.environ.get("TMPDIR", "/tmp")) / "cachalot-fuzz-v4"))
TOK_DIR = REPO / "fixtures" / "v4" / "flash_tiny"
TOL = 0.02


def random_config(rng):
    c = json.loads(json.dumps(mv.COMMON))
    ch = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    L = int(rng.integers(1, 5))
    mtp = ch([0, 1])
    c["num_hidden_layers"] = L
    c["num_nextn_predict_layers"] = mtp
    c["compress_ratios"] = [ch([0, 4, 4, 128]) for _ in range(L)] + [0] * mtp
    c["num_hash_layers"] = int(rng.integers(0, L + 1))
    c["hidden_size"] = ch([32, 64, 96])  # MXFP4 groups of 32 along each expert input
    c["vocab_size"] = ch([512, 640])
    heads = ch([1, 2, 4, 8])
    c["num_attention_heads"] = heads
    rope = ch([16, 32, 64])
    c["qk_rope_head_dim"] = rope
    c["head_dim"] = rope + ch([16, 64, 128])
    c["q_lora_rank"] = ch([16, 32, 48])
    c["o_groups"] = ch([g for g in (1, 2, 4) if heads % g == 0])
    c["o_lora_rank"] = ch([16, 32])
    E = ch([4, 8, 16])
    c["n_routed_experts"] = E
    c["num_experts_per_tok"] = int(rng.integers(1, min(4, E) + 1))
    c["moe_intermediate_size"] = ch([32, 64, 96, 128])  # (tensor parallel splits MXFP4 at 32 columns)
    c["index_n_heads"] = ch([8, 16])  # fewer heads: ReLU zeroes every head of many entries (exact ties)
    c["index_head_dim"] = ch([d for d in (32, 64, 128) if d >= rope])  # RoPE'd keys
    c["index_topk"] = ch([1, 4, 8, 32])
    c["hc_mult"] = ch([2, 4])
    c["hc_sinkhorn_iters"] = ch([5, 20])
    c["sliding_window"] = ch([128, 128, 64, 32])
    c["routed_scaling_factor"] = ch([1.0, 1.5, 2.5])
    c["swiglu_limit"] = ch([1.0, 10.0, 100.0])
    c["norm_topk_prob"] = ch([True, False])
    c["rope_theta"] = ch([10000.0, 50000.0])
    c["compress_rope_theta"] = ch([160000.0, 40000.0])
    c["rms_norm_eps"] = ch([1e-6, 1e-5])
    factor, orig = ch([4, 16, 40]), ch([64, 256, 65536])
    c["rope_scaling"] = {"type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
                         "beta_fast": ch([32, 16]), "beta_slow": 1}
    c["max_position_embeddings"] = orig * factor
    meta = {
        "threads": ch([1, 1, 2]),
        "expert_gain": ch([1.0, 3.0]),
        "seq_lens": [int(rng.integers(2, 24)), int(rng.integers(150, 301))],
        "chunk": ch([512, 512, 37, 64, 128, 1]),  # 1: every token a step, as decode
    }
    meta["seq_lens"] = [min(n, c["max_position_embeddings"]) for n in meta["seq_lens"]]
    # The cache layout every cachalot command of the case runs with (drawn last, so a seed's
    # model is what it was before the layouts existed).
    meta["v4_cache"] = ch(["compact", "compact", "full"])
    # The cache dtype of the run check (batching, preemption, MTP and ranks against one
    # process; the reference comparison stays f32): fp8 exists in the compact layout only.
    kv = ["f32", "bf16"] + (["fp8"] if meta["v4_cache"] == "compact" else [])
    meta["run_kv"] = ch(kv)
    return c, meta


def run_engine(d, ids, meta):
    cmd = [ENGINE, "perplexity", "--model", str(d), "--token-ids", ",".join(map(str, ids)), "--json",
           "--chunk", str(meta["chunk"]), "--v4-cache", meta.get("v4_cache", "compact")]
    env = dict(os.environ, RAYON_NUM_THREADS=str(meta.get("threads", 1)))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return p.returncode, p.stdout, p.stderr, cmd


def run_case(name, c, meta, wseed, keep=False, attempts=4):
    d = RUNS / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    res = {"name": name, "config": c, "meta": meta}
    rng = np.random.default_rng(wseed + 17)
    seqs = []
    for n in meta["seq_lens"]:
        ids = rng.integers(2, c["vocab_size"], size=n).tolist()
        ids[0] = 0
        seqs.append(ids)
    try:
        # Weights whose indexer and router decisions have no near-tie on these sequences, where a few
        # draws find them (ReLU can zero every indexer head of several entries: exact ties, which the
        # engine and torch.topk may break differently, both right).
        for attempt in range(attempts):
            seed = wseed + 100_000 * attempt
            b = mv.build_weights(c, seed, meta["expert_gain"])
            model = mv.build_hf_model(c, b.ref)
            gap = min(min(mv.decision_gaps(model, c, [ids])) for ids in seqs)
            if gap > mv.MIN_DECISION_GAP:
                break
        res["weight_seed"], res["min_gap"] = seed, gap
        mv.write_checkpoint(b, c, d)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOK_DIR / f, d / f)
    except Exception as e:  # the reference rejected the config
        res["status"] = "ref_error"
        res["error"] = repr(e)
        (d / "result.json").write_text(json.dumps(res, indent=1))
        return res
    worst, nll_rel = 0.0, 0.0
    res["seqs"] = []
    res["status"] = "ok"
    for ids in seqs:
        with torch.no_grad():
            ref = logprobs_of(logits_of(model, ids), ids)
        rc, out, err, cmd = run_engine(d, ids, meta)
        s = {"n": len(ids), "ids": ids, "ref": ref, "rc": rc}
        res["seqs"].append(s)
        if rc != 0:
            res["status"] = "engine_error"
            res["error"] = err[-2000:]
            break
        got = json.loads(out)["logprobs"]
        assert len(got) == len(ref), (len(got), len(ref))
        s["got"] = got
        diff = [abs(a - b_) for a, b_ in zip(got, ref)]
        mx = max(diff) if diff else 0.0
        s["max_abs"] = mx
        s["argmax_pos"] = int(np.argmax(diff)) if diff else None
        nr, ng_ = -np.mean(ref), -np.mean(got)
        nll_rel = max(nll_rel, float(abs(ng_ - nr) / nr))
        worst = max(worst, mx)
    if res["status"] == "ok" and worst > TOL:
        res["status"] = "tie" if res["min_gap"] <= mv.MIN_DECISION_GAP else "MISMATCH"
    if res["status"] == "ok":
        try:
            qtype = "w4a8-int" if wseed % 2 else "w8a8-int"
            res["quant_type"] = qtype
            w8, why = w8a8_v4_check(ENGINE, mv, d, c, quant_seqs(c, wseed), meta.get("threads", 1), qtype)
        except Exception as e:  # the simulation itself failed
            w8, why = None, f"the simulation failed: {e!r}"
        res["w8a8_first_max"] = w8
        if why:
            res["status"] = "quant_mismatch"
            res["error"] = f"{res['quant_type']} against its simulation: {why}"
    if res["status"] in ("ok", "tie") and c.get("num_nextn_predict_layers", 0) > 0:
        layout = ["--v4-cache", meta.get("v4_cache", "compact")]
        rc, err, cmd = mtp_check(ENGINE, d, wseed + 29, meta.get("threads", 1), layout)
        if rc != 0:
            res["status"] = "mtp_error"
            res["error"] = err[-2000:]
            res["cmd"] = " ".join(cmd)
    if res["status"] in ("ok", "tie"):
        why, ranks = run_check(ENGINE, d, "deepseek_v4", wseed + 31,
                        c.get("num_nextn_predict_layers", 0) > 0, meta.get("threads", 1),
                        extra=["--v4-cache", meta.get("v4_cache", "compact"),
                               "--kv-cache-dtype", meta.get("run_kv", "f32")])
        res["ranks"] = ranks
        if why:
            res["status"] = "run_mismatch"
            res["error"] = why
    res["max_abs"], res["nll_rel"] = worst, nll_rel
    (d / "result.json").write_text(json.dumps(res))
    if res["status"] == "ok" and not keep:
        for f in d.glob("*.safetensors"):
            f.unlink()
    return res


def summary(res):
    c, m = res["config"], res["meta"]
    rs = c["rope_scaling"]
    return (f"{res['name']}: {res['status']} ranks={res.get('ranks')} {res.get('quant_type', 'w8a8')}={'/'.join(f'{v:.3g}' for v in res.get('w8a8_first_max') or [])} max|d|={res.get('max_abs', float('nan')):.2e} "
            f"nllrel={res.get('nll_rel', 0):.1e} gap={res.get('min_gap')!s:.8} | L{c['num_hidden_layers']} "
            f"r{c['compress_ratios']} hash{c['num_hash_layers']} H{c['hidden_size']} V{c['vocab_size']} "
            f"nh{c['num_attention_heads']} d{c['head_dim']}/{c['qk_rope_head_dim']} q{c['q_lora_rank']} "
            f"o{c['o_groups']}x{c['o_lora_rank']} E{c['n_routed_experts']} K{c['num_experts_per_tok']} "
            f"F{c['moe_intermediate_size']} idx{c['index_n_heads']}x{c['index_head_dim']} top{c['index_topk']} "
            f"hc{c['hc_mult']}/{c['hc_sinkhorn_iters']} win{c['sliding_window']} rsf{c['routed_scaling_factor']} "
            f"clamp{c['swiglu_limit']} norm{int(c['norm_topk_prob'])} yarn f={rs['factor']} "
            f"orig={rs['original_max_position_embeddings']} | seq{m['seq_lens']} chunk{m['chunk']} "
            f"gain{m['expert_gain']} t{m['threads']} {m.get('v4_cache', 'compact')} kv={m.get('run_kv', 'f32')}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    lo, hi = map(int, a.seeds.split("-"))
    for s in range(lo, hi + 1):
        c, meta = random_config(np.random.default_rng(7000 + s))
        r = run_case(f"v{s:03d}", c, meta, 9000 + s, keep=a.keep)
        print(summary(r), flush=True)
        if r.get("error"):
            print("   ", r["error"].strip().replace("\n", "\n    ")[:1500], flush=True)


if __name__ == "__main__":
    main()
