#!/usr/bin/env python3
"""Train the shipped small DeepSeek-V3-architecture model (`assets/cachalot-tiny-r1`) on CPU.

Steps (one command; see tools/train/README.md):
  1. corpus: Debian `fortunes` cookies, 5 % held out (corpus.py); eval.txt = held-out part;
  2. tokenizer: byte-level BPE (vocab 4096) with R1's pre-tokenizer, special tokens, chat template;
  3. training: transformers' DeepseekV3ForCausalLM (MLA with q_lora, 1 dense + 3 MoE layers,
     16 routed experts top-2 in 4 groups / 2 kept, 1 shared expert, sigmoid routing, YaRN rope) plus
     one MTP layer (transformers' MtpModel), loss = CE(main) + lambda * CE(MTP, token t+2);
     e_score_correction_bias updated without gradients after every step (DeepSeek-V3's loss-free
     balancing: b_e += gamma * sign(mean load - load_e));
  4. export: R1 layout (FP8 e4m3 + 128x128 weight_scale_inv, bf16, f32 bias, MTP as layer 4).

The float weights, the optimizer-free training record and the logs go to --work-dir (outside the
repository); the model goes to assets/cachalot-tiny-r1/. Then run evaluate.py.
"""

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
import model_def  # noqa: E402
from model_def import CONFIG, GENERATION_CONFIG  # noqa: E402

HPARAMS = dict(
    seed=20250521,
    context=model_def.TRAIN_CONTEXT,  # tokens per training window
    batch=6,  # windows per step
    steps=380,
    lr=3e-3,
    min_lr_ratio=0.1,
    warmup=40,
    weight_decay=0.1,
    betas=(0.9, 0.95),
    grad_clip=1.0,
    mtp_lambda=0.3,  # DeepSeek-V3: 0.3 for the first 10T tokens
    bias_update_speed=2e-2,  # DeepSeek-V3 uses 1e-3 over ~14.8T tokens; this run is a few hundred steps
    bos_rows="even",  # even rows: BOS + window starting at a cookie; odd rows: random offset, no BOS
    eval_every=50,
    eval_windows=8,
    threads=1,
)


def log(fh, msg):
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if fh:
        fh.write(line + "\n")
        fh.flush()


def encode_cookie_stream(tok, text):
    """Token ids of a fortune-format text, and the token index where every cookie starts. Encoding
    cookie by cookie equals encoding the whole text (checked): the '%\\n' line ends a pre-token."""
    pieces = [p + "\n%\n" for p in text.split("\n%\n")[:-1]]
    encs = tok.encode_batch(pieces, add_special_tokens=False)
    ids, starts = [], []
    for e in encs:
        starts.append(len(ids))
        ids.extend(e.ids)
    whole = tok.encode(text, add_special_tokens=False).ids
    assert whole == ids, "cookie-wise tokenization differs from whole-text tokenization"
    return np.array(ids, dtype=np.int64), np.array(starts, dtype=np.int64)


class Batches:
    def __init__(self, ids, starts, hp, bos_id):
        self.ids, self.starts, self.hp, self.bos = ids, starts, hp, bos_id
        self.rng = np.random.default_rng(hp["seed"] + 1)
        # cookie starts that leave room for a full window
        self.ok_starts = starts[starts + hp["context"] + 1 < len(ids)]

    def next(self):
        T, B = self.hp["context"], self.hp["batch"]
        rows = []
        for r in range(B):
            if r % 2 == 0:
                s = int(self.rng.choice(self.ok_starts))
                seq = np.concatenate([[self.bos], self.ids[s: s + T + 1]])
            else:
                o = int(self.rng.integers(0, len(self.ids) - T - 2))
                seq = self.ids[o: o + T + 2]
            rows.append(seq)
        return torch.from_numpy(np.stack(rows))  # [B, T + 2]


def lr_at(step, hp):
    if step < hp["warmup"]:
        return hp["lr"] * (step + 1) / hp["warmup"]
    t = (step - hp["warmup"]) / max(1, hp["steps"] - hp["warmup"])
    return hp["lr"] * (hp["min_lr_ratio"] + (1 - hp["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * t)))


class LoadCounter:
    """Per-router expert selection counts of the current training forward (forward hooks)."""

    def __init__(self, routers, E):
        self.routers = routers
        self.counts = {lbl: torch.zeros(E, dtype=torch.float64) for lbl, _ in routers}
        self.active = False
        for lbl, gate in routers:
            gate.register_forward_hook(self._hook(lbl, E))

    def _hook(self, lbl, E):
        def f(mod, inp, out):
            if self.active:
                self.counts[lbl] += torch.bincount(out[2].reshape(-1), minlength=E).to(torch.float64)

        return f

    def reset(self):
        for v in self.counts.values():
            v.zero_()


@torch.no_grad()
def eval_loss(model, mtp, ids, hp, n_windows):
    """Mean main / MTP cross-entropy over the first n_windows non-overlapping windows of `ids`
    (each window is its own causal context; no BOS)."""
    T = hp["context"]
    main, mt, n_main, n_mt = 0.0, 0.0, 0, 0
    for w in range(n_windows):
        seq = torch.from_numpy(ids[w * T: (w + 1) * T + 0]).unsqueeze(0)
        if seq.shape[1] < T:
            break
        h, logits = model_def.main_forward(model, seq)
        main += F.cross_entropy(logits[0, :-1], seq[0, 1:], reduction="sum").item()
        n_main += T - 1
        _, ml = model_def.mtp_forward(mtp, h[:, :-2], seq[:, 1:-1])
        mt += F.cross_entropy(ml[0], seq[0, 2:], reduction="sum").item()
        n_mt += T - 2
    return main / n_main, mt / n_mt


def param_groups(model, mtp, wd):
    decay, no_decay, seen = [], [], set()
    for mod in (model, mtp):
        for name, p in mod.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if p.dim() < 2 or "embed_tokens" in name else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def count_params(model, mtp, c):
    main = sum(p.numel() for p in model.parameters())
    mtp_own = sum(p.numel() for n, p in mtp.named_parameters() if not n.startswith(("embed_tokens", "shared_head")))
    H, V, E, K, I = c["hidden_size"], c["vocab_size"], c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    inactive_per_moe = (E - K) * 3 * H * I
    n_moe = c["num_hidden_layers"] - c["first_k_dense_replace"]
    emb = V * H
    return {
        "main_model": main,
        "mtp_layer": mtp_own,
        "total_unique": main + mtp_own,
        "embedding": emb,
        "lm_head": emb,
        "main_active_per_token_excl_embedding": main - emb - n_moe * inactive_per_moe,
        "mtp_active_per_token": mtp_own - inactive_per_moe,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, default=Path("/work/train-work") / model_def.NAME)
    ap.add_argument("--out", type=Path, default=model_def.ASSETS)
    ap.add_argument("--steps", type=int, default=None, help="override the number of steps (default: HPARAMS)")
    ap.add_argument("--bench", type=int, default=0, help="time this many steps and exit (no export)")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention kernel for training")
    ap.add_argument("--export-only", action="store_true", help="re-export --work-dir/float.pt without training")
    args = ap.parse_args()

    hp = dict(HPARAMS)
    if args.steps is not None:
        hp["steps"] = args.steps
    torch.set_num_threads(hp["threads"])
    torch.manual_seed(hp["seed"])
    random.seed(hp["seed"])
    np.random.seed(hp["seed"] % 2**32)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    logf = None if args.bench else open(args.work_dir / ("export.log" if args.export_only else "train.log"), "w")
    import tokenizers
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    log(logf, f"env {env}")

    # 1-2. corpus and tokenizer
    train_text, eval_text, corpus_meta = corpus.build_corpus()
    tok = corpus.train_tokenizer(train_text)
    train_ids, train_starts = encode_cookie_stream(tok, train_text)
    eval_ids, _ = encode_cookie_stream(tok, eval_text)
    corpus_meta.update(train_bytes=len(train_text.encode()), train_tokens=len(train_ids),
                       eval_bytes=len(eval_text.encode()), eval_tokens=len(eval_ids))
    log(logf, f"corpus {json.dumps({k: v for k, v in corpus_meta.items() if k != 'files'})}")

    # 3. model
    c = dict(CONFIG)
    model, mtp = model_def.build_models(c, attn=args.attn)
    if args.export_only:
        sd = torch.load(args.work_dir / "float.pt", map_location="cpu")
        model.load_state_dict(sd["model"])
        mtp.load_state_dict(sd["mtp"])
        export(model.eval(), mtp.eval(), c, tok, eval_text, args.out, logf)
        log(logf, f"exported {args.work_dir / 'float.pt'} to {args.out}")
        return
    model_def.init_weights(model, mtp, c, hp["seed"])
    model.train()
    mtp.train()
    params = count_params(model, mtp, c)
    log(logf, f"parameters {params}")
    routers = model_def.routers(model, mtp)
    counter = LoadCounter(routers, c["n_routed_experts"])
    opt = torch.optim.AdamW(param_groups(model, mtp, hp["weight_decay"]), lr=hp["lr"], betas=hp["betas"], eps=1e-8)
    batches = Batches(train_ids, train_starts, hp, tok.token_to_id(corpus.BOS))
    all_params = [p for g in opt.param_groups for p in g["params"]]

    history, evals = [], []
    t0 = time.time()
    n_steps = args.bench or hp["steps"]
    router_grad_checked = False
    for step in range(n_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, hp)
        batch = batches.next()
        T = hp["context"]
        x, y = batch[:, :T], batch[:, 1: T + 1]
        counter.reset()
        counter.active = True
        h, logits = model_def.main_forward(model, x)
        loss_main = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        _, mlogits = model_def.mtp_forward(mtp, h, batch[:, 1: T + 1])
        loss_mtp = F.cross_entropy(mlogits.reshape(-1, mlogits.shape[-1]), batch[:, 2: T + 2].reshape(-1))
        counter.active = False
        loss = loss_main + hp["mtp_lambda"] * loss_mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not router_grad_checked:
            # transformers' router returns weights gathered from sigmoid(W_g x): W_g gets gradients.
            for lbl, gate in routers:
                assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0, f"{lbl}: no router gradient"
                assert gate.e_score_correction_bias.grad is None
            log(logf, "router weights receive gradients (all MoE layers incl. MTP); bias is a buffer")
            router_grad_checked = True
        gnorm = torch.nn.utils.clip_grad_norm_(all_params, hp["grad_clip"]).item()
        opt.step()
        # DeepSeek-V3 auxiliary-loss-free balancing (per step, per MoE layer).
        imbalance = {}
        with torch.no_grad():
            for lbl, gate in routers:
                load = counter.counts[lbl]
                gate.e_score_correction_bias += hp["bias_update_speed"] * torch.sign(load.mean() - load).to(torch.float32)
                imbalance[lbl] = float(load.max() / load.mean())
        rec = dict(step=step + 1, loss=round(loss.item(), 4), main=round(loss_main.item(), 4), mtp=round(loss_mtp.item(), 4),
                   lr=round(lr_at(step, hp), 6), gnorm=round(gnorm, 3),
                   max_load_over_mean=round(max(imbalance.values()), 3), t=round(time.time() - t0, 1))
        history.append(rec)
        if step < 5 or (step + 1) % 10 == 0:
            log(logf, " ".join(f"{k}={v}" for k, v in rec.items()) + " load " +
                " ".join(f"{k}:{v:.2f}" for k, v in imbalance.items()))
        if not args.bench and ((step + 1) % hp["eval_every"] == 0 or step + 1 == n_steps):
            model.eval()
            mtp.eval()
            em, et = eval_loss(model, mtp, eval_ids, hp, hp["eval_windows"])
            model.train()
            mtp.train()
            evals.append(dict(step=step + 1, eval_main=round(em, 4), eval_mtp=round(et, 4), t=round(time.time() - t0, 1)))
            log(logf, f"eval step {step + 1}: main CE {em:.4f} (ppl {math.exp(em):.2f}), MTP CE {et:.4f}")
    train_s = time.time() - t0
    tok_per_s = n_steps * hp["batch"] * hp["context"] / train_s
    log(logf, f"trained {n_steps} steps in {train_s:.0f} s ({tok_per_s:.0f} tokens/s)")
    if args.bench:
        return

    # float checkpoint + record
    model.eval()
    mtp.eval()
    biases = {lbl: gate.e_score_correction_bias.tolist() for lbl, gate in routers}
    torch.save({"model": model.state_dict(), "mtp": mtp.state_dict()}, args.work_dir / "float.pt")
    record = {
        "hparams": hp,
        "config": c,
        "env": env,
        "corpus": corpus_meta,
        "parameters": params,
        "train_seconds": round(train_s, 1),
        "tokens_per_second": round(tok_per_s, 1),
        "tokens_seen": n_steps * hp["batch"] * hp["context"],
        "history": history,
        "evals": evals,
        "final_e_score_correction_bias": biases,
    }
    (args.work_dir / "training.json").write_text(json.dumps(record, indent=1) + "\n")

    # 4. export in DeepSeek-R1's layout
    export(model, mtp, c, tok, eval_text, args.out, logf)
    log(logf, f"exported to {args.out}")


def export(model, mtp, c, tok, eval_text, out: Path, logf=None):
    tensors = model_def.float_tensors_by_checkpoint_name(model, mtp, c)
    b = model_def.quantized_builder(tensors)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model_def.make_fixtures.write_checkpoint(b, c, 2, tmp)
    n_fp8 = model_def.make_fixtures.verify_checkpoint(b, tmp)
    corpus.write_tokenizer(tok, tmp, c["max_position_embeddings"])
    (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    (tmp / "eval.txt").write_text(eval_text, encoding="utf-8")
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes 0600
    # keep files evaluate.py writes (README.md, reference.json) if re-exporting
    if out.exists():
        for keep in ("README.md", "reference.json"):
            if (out / keep).exists():
                shutil.copy(out / keep, tmp / keep)
        shutil.rmtree(out)
    os.replace(tmp, out)
    log(logf, f"checkpoint: {len(b.ckpt)} tensors, {n_fp8} FP8 weights verified (spec LUT dequant == reference)")


if __name__ == "__main__":
    main()
