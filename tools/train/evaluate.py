#!/usr/bin/env python3
"""Evaluate the shipped model (`assets/cachalot-tiny-r1`) with transformers and write its
reference.json and README.md.

The checkpoint is read from disk and loaded into transformers' DeepseekV3ForCausalLM + MtpModel on
exactly the dequantized values (FP8: f32(e4m3 code) * weight_scale_inv per 128x128 block, in f32;
bf16: exact), float32, eager attention, CPU, full recomputation (no KV cache) - the same procedure
as tools/reference/make_fixtures.py.

Held-out perplexity (the number in README.md and reference.json "eval"):
  ids = tokenizer.json encoding of eval.txt, no special tokens added (no BOS);
  the ids are cut into consecutive non-overlapping windows of 512 tokens (the training context; the
  last window is shorter); every window is its own causal context starting at position 0; in each
  window every token but the first is scored: log p(ids[j] | window ids before j);
  nll = mean over all scored tokens, ppl = exp(nll).
reference.json "text" is window 0 alone (the first 512 tokens of eval.txt), i.e. exactly what an
engine gets from evaluating that token sequence in one causal context.

MTP agreement: for every window and row i, the MTP head gets embed(ids[i+1]) and the main model's
final-normed hidden state at i and predicts the token at i+2; agreement = fraction of rows whose
MTP argmax equals the main model's own argmax at position i+1 (its prediction of the token at
i+2). With greedy decoding and one draft token this is the fraction of drafts the main model
accepts; it is also measured on the model's own greedy continuations, where it is exactly that.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_def  # noqa: E402

WINDOW = model_def.TRAIN_CONTEXT
REF_TOKENS = 512  # reference.json "text": the first window
SAMPLE_PROMPTS = ["The best way to", "Love is", "A computer"]
SAMPLE_TOKENS = 48
SELF_DRAFT_TOKENS = 128


@torch.no_grad()
def window_stats(model, mtp, ids):
    """Per-window log-probs, main argmax and MTP argmax/log-probs (float64 log-softmax of f32 logits)."""
    out = []
    for s in range(0, len(ids), WINDOW):
        w = ids[s: s + WINDOW]
        if len(w) < 3:
            break
        x = torch.tensor([w])
        h, logits = model_def.main_forward(model, x)
        lp = torch.log_softmax(logits[0].double(), -1)
        n = len(w)
        main_lp = [float(lp[j, w[j + 1]]) for j in range(n - 1)]
        main_arg = logits[0].argmax(-1).tolist()  # main_arg[j] predicts w[j+1]
        _, ml = model_def.mtp_forward(mtp, h[:, : n - 1], x[:, 1:])  # rows 0..n-2
        mlp = torch.log_softmax(ml[0].double(), -1)
        top2 = torch.topk(ml[0], 2, dim=-1)
        out.append(dict(
            ids=w, main_lp=main_lp, main_arg=main_arg,
            mtp_lp=[float(mlp[i, w[i + 2]]) for i in range(n - 2)],
            mtp_arg=top2.indices[:, 0].tolist(),
            mtp_margin=(top2.values[:, 0] - top2.values[:, 1]).tolist(),
        ))
    return out


def summarize(stats):
    lps = [x for s in stats for x in s["main_lp"]]
    nll = -float(np.mean(lps))
    agree = sum(s["mtp_arg"][i] == s["main_arg"][i + 1] for s in stats for i in range(len(s["ids"]) - 1))
    rows = sum(len(s["ids"]) - 1 for s in stats)
    mtp_acc = sum(s["mtp_arg"][i] == s["ids"][i + 2] for s in stats for i in range(len(s["ids"]) - 2))
    mtp_rows = sum(len(s["ids"]) - 2 for s in stats)
    main_acc = sum(s["main_arg"][j] == s["ids"][j + 1] for s in stats for j in range(len(s["ids"]) - 1))
    mtp_nll = -float(np.mean([x for s in stats for x in s["mtp_lp"]]))
    return dict(
        windows=len(stats), scored_tokens=len(lps), nll=nll, ppl=math.exp(nll),
        main_top1_accuracy=main_acc / len(lps),
        mtp_rows=rows, mtp_agreement_with_main=agree / rows,
        mtp_top1_accuracy_vs_text=mtp_acc / mtp_rows, mtp_nll=mtp_nll, mtp_ppl=math.exp(mtp_nll),
    )


def prompt_ids(tok, prompt):
    """BOS + the prompt's ids: what R1's tokenizer gives with special tokens (add_bos_token: true).
    Without BOS the model cannot tell that the prompt starts a line (half of its training windows start
    at a random offset, mid-line) and its first guess is usually a newline."""
    ids = tok.encode(prompt, add_special_tokens=True).ids
    assert ids[0] == tok.token_to_id("<｜begin▁of▁sentence｜>") == 0
    return ids


@torch.no_grad()
def greedy(model, prompt_ids, n_new):
    ids = list(prompt_ids)
    margins = []
    for _ in range(n_new):
        _, lg = model_def.main_forward(model, torch.tensor([ids]))
        top2 = torch.topk(lg[0, -1], 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        ids.append(int(top2.indices[0]))
    return ids[len(prompt_ids):], margins


@torch.no_grad()
def self_draft_acceptance(model, mtp, prompt_ids, n_new):
    """Greedy continuation, then the MTP drafts along it: the fraction of continuation tokens the
    MTP head (fed the previous greedy token and hidden state) predicted = greedy next_n=1 acceptance."""
    cont, _ = greedy(model, prompt_ids, n_new)
    seq = list(prompt_ids) + cont
    x = torch.tensor([seq])
    h, logits = model_def.main_forward(model, x)
    _, ml = model_def.mtp_forward(mtp, h[:, :-1], x[:, 1:])
    arg = ml[0].argmax(-1).tolist()  # row i predicts seq[i+2]
    p = len(prompt_ids)
    # drafts for continuation tokens 2..n (row i = j-2 for token index j >= p + 1)
    hits = [arg[j - 2] == seq[j] for j in range(p + 1, len(seq))]
    return sum(hits), len(hits)


def dir_files(d: Path):
    return sorted((f.name, f.stat().st_size) for f in d.iterdir() if f.is_file())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=model_def.ASSETS)
    ap.add_argument("--work-dir", type=Path, default=Path("/work/train-work") / model_def.NAME,
                    help="train.py's work dir: training.json (for README.md) and float.pt (float-vs-FP8 ppl)")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    import tokenizers
    import transformers

    t0 = time.time()
    tok = tokenizers.Tokenizer.from_file(str(args.model / "tokenizer.json"))
    text = (args.model / "eval.txt").read_text(encoding="utf-8")
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    c, model, mtp = model_def.load_for_transformers(args.model)
    print(f"loaded {args.model} ({time.time() - t0:.1f} s); eval.txt {len(text.encode())} bytes -> {len(ids)} tokens")

    stats = window_stats(model, mtp, ids)
    summ = summarize(stats)
    # The same tensors through transformers' own from_pretrained (FP8 pre-dequantized to f32: its
    # dequantize-on-load mis-handles ragged 128x128 grids, see tools/reference/README.md).
    _, raw, refw = model_def.read_checkpoint(args.model)
    xc = model_def.make_fixtures.crosscheck_from_pretrained(
        SimpleNamespace(ckpt=raw, ref=refw), c, stats[0]["ids"][:128], stats[0]["main_lp"][:127])
    print(f"from_pretrained cross-check: max |dlogprob| {xc:.2e} on 128 tokens")
    assert xc < 1e-4
    print(f"held-out: {json.dumps(summ)}")
    w0 = stats[0]
    assert len(w0["ids"]) == REF_TOKENS
    w0_nll = -float(np.mean(w0["main_lp"]))

    samples = []
    for p in SAMPLE_PROMPTS:
        pids = prompt_ids(tok, p)
        cont, margins = greedy(model, pids, SAMPLE_TOKENS)
        samples.append(dict(prompt=p, prompt_ids=pids, continuation=cont, margins=margins, text=p + tok.decode(cont)))
        print(f"--- {p!r}\n{p + tok.decode(cont)}")
    acc_hit = acc_n = 0
    for p in SAMPLE_PROMPTS:
        h_, n_ = self_draft_acceptance(model, mtp, prompt_ids(tok, p), SELF_DRAFT_TOKENS)
        acc_hit += h_
        acc_n += n_
    self_accept = acc_hit / acc_n
    print(f"MTP acceptance on the model's own greedy continuations: {acc_hit}/{acc_n} = {self_accept:.4f}")

    float_summ = None
    fp = args.work_dir / "float.pt"
    if fp.exists():
        fm, fmtp = model_def.build_models(c, attn="eager")
        sd = torch.load(fp, map_location="cpu")
        fm.load_state_dict(sd["model"])
        fmtp.load_state_dict(sd["mtp"], strict=False)
        fm.eval()
        fmtp.eval()
        float_summ = summarize(window_stats(fm, fmtp, ids))
        print(f"float (pre-FP8) weights: {json.dumps(float_summ)}")

    ref = {
        "model": model_def.NAME,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float32 reference on dequantized FP8 / bf16 weights, eager attention, CPU, no KV cache",
        "text": {
            "file": "eval.txt",
            "token_ids": w0["ids"],
            "logprobs": w0["main_lp"],
            "nll": w0_nll,
            "ppl": math.exp(w0_nll),
        },
        "eval": {
            "file": "eval.txt",
            "tokens": len(ids),
            "window": WINDOW,
            "procedure": (
                "tokenizer.json encoding of eval.txt without special tokens; consecutive non-overlapping windows of "
                f"{WINDOW} tokens (last one shorter), each its own causal context from position 0; every token but "
                "the first of each window scored; nll = mean over scored tokens; ppl = exp(nll)"
            ),
            **{k: summ[k] for k in ("windows", "scored_tokens", "nll", "ppl", "main_top1_accuracy")},
        },
        "mtp": {
            "description": (
                "MTP layer on text.token_ids (window 0): row i (0..n-2) = enorm(embed(token_ids[i+1])) ++ hnorm(main "
                "final-normed hidden at i) -> eh_proj -> MTP MoE block at rope position i -> shared_head.norm -> main "
                "lm_head. logprobs[i] = log p(token_ids[i+2]) for i in 0..n-3; argmax[i] / margins[i] per row; "
                "main_argmax[j] = main model argmax at position j (predicts token j+1)."
            ),
            "logprobs": w0["mtp_lp"],
            "argmax": w0["mtp_arg"],
            "margins": w0["mtp_margin"],
            "main_argmax": w0["main_arg"],
            "agreement_with_main_eval_txt": summ["mtp_agreement_with_main"],
            "acceptance_on_own_greedy_continuations": self_accept,
        },
        "greedy": [{k: s[k] for k in ("prompt", "prompt_ids", "continuation", "margins")} for s in samples],
    }
    (args.model / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {args.model / 'reference.json'} ({(args.model / 'reference.json').stat().st_size} bytes)")

    if not args.no_readme:
        tj = args.work_dir / "training.json"
        if not tj.exists():
            raise SystemExit(f"{tj}: not found; README.md needs train.py's record (pass --work-dir, or --no-readme)")
        rec = json.loads(tj.read_text())
        write_readme(args.model, rec, summ, float_summ, samples, self_accept, (acc_hit, acc_n), w0_nll)
        print(f"wrote {args.model / 'README.md'}")
    total = sum(s for _, s in dir_files(args.model))
    print(f"files: {dir_files(args.model)}; total {total} bytes ({total / 2**20:.2f} MiB)")


def write_readme(d: Path, rec, summ, float_summ, samples, self_accept, acc_counts, w0_nll):
    c, hp, par, cm = rec["config"], rec["hparams"], rec["parameters"], rec["corpus"]
    hist = rec["history"]

    def avg(lo, hi, key):
        xs = [h[key] for h in hist if lo < h["step"] <= hi]
        return sum(xs) / len(xs)

    n = len(hist)
    rows = []
    marks = sorted(m for m in {1, 10, 25, 50} | set(range(50, n + 1, 50)) | {n} if m <= n)
    ev = {e["step"]: e for e in rec["evals"]}
    for m in marks:
        lo = max(0, m - 10)
        e = ev.get(m)
        rows.append(f"| {m} | {avg(lo, m, 'main'):.3f} | {avg(lo, m, 'mtp'):.3f} | "
                    + (f"{e['eval_main']:.3f} | {e['eval_mtp']:.3f} |" if e else "  |  |")
                    + f" {hist[m - 1]['max_load_over_mean']:.2f} |")
    files = [(f, s) for f, s in dir_files(d) if f != "README.md"]
    total = sum(s for _, s in files)
    sample_md = "\n\n".join(
        f"Prompt `{s['prompt']!r}` (greedy, {SAMPLE_TOKENS} tokens):\n\n```\n{s['text']}\n```" for s in samples)
    fq = ""
    if float_summ:
        fq = (f"The same procedure on the float32 weights before FP8 quantization gives ppl "
              f"{float_summ['ppl']:.3f} (nll {float_summ['nll']:.4f}), so FP8 e4m3 with 128x128 block scales costs "
              f"{summ['nll'] - float_summ['nll']:+.4f} nats/token; MTP agreement on float weights "
              f"{float_summ['mtp_agreement_with_main']:.4f}.")
    md = f"""# {model_def.NAME}

A small model with DeepSeek-V3 / R1's architecture, trained from scratch on CPU for this repository and
shipped in DeepSeek-R1's own checkpoint layout, so that the engine has a real (trained) default model: text
quality, quantization error and MTP acceptance can be measured on it, and `cargo test` can check the engine
against transformers on trained weights. It writes English-like fortune-cookie text; it knows nothing else.

Reproduce: `tools/train/README.md` (train.py, then evaluate.py, which wrote this file and `reference.json`).

## Architecture (`config.json`, DeepSeek's official field names)

| | |
|---|---|
| vocab | {c['vocab_size']} (byte-level BPE, R1 special tokens and chat template) |
| hidden | {c['hidden_size']}, {c['num_hidden_layers']} layers (layer 0 dense, intermediate {c['intermediate_size']}; layers 1-{c['num_hidden_layers'] - 1} MoE) + 1 MTP layer (layer {c['num_hidden_layers']}, MoE) |
| attention | MLA, {c['num_attention_heads']} heads, q_lora_rank {c['q_lora_rank']}, kv_lora_rank {c['kv_lora_rank']}, qk_nope / qk_rope / v = {c['qk_nope_head_dim']} / {c['qk_rope_head_dim']} / {c['v_head_dim']} |
| MoE | {c['n_routed_experts']} routed experts (intermediate {c['moe_intermediate_size']}), top-{c['num_experts_per_tok']}, n_group {c['n_group']} / topk_group {c['topk_group']}, {c['n_shared_experts']} shared expert, sigmoid scores + `e_score_correction_bias` (noaux_tc), norm_topk_prob, routed_scaling_factor {c['routed_scaling_factor']} |
| rope | rope_theta {c['rope_theta']}, YaRN as R1: factor {c['rope_scaling']['factor']}, original_max_position_embeddings {c['rope_scaling']['original_max_position_embeddings']}, beta_fast/slow {c['rope_scaling']['beta_fast']}/{c['rope_scaling']['beta_slow']}, mscale/mscale_all_dim 1/1 (trained with it on: transformers always applies YaRN) |
| context | trained on {hp['context']}-token windows; max_position_embeddings {c['max_position_embeddings']} (quality beyond {hp['context']} tokens is untested) |
| norms | RMSNorm, eps {c['rms_norm_eps']} |

Parameters: {par['total_unique']:,} in all = main model {par['main_model']:,} (embedding {par['embedding']:,}, lm_head
{par['lm_head']:,}) + MTP layer {par['mtp_layer']:,} (embedding and head shared with the main model). Active per token:
{par['main_active_per_token_excl_embedding']:,} in the main model (lm_head included, embedding lookup excluded), {par['mtp_active_per_token']:,} in the MTP layer.

## Files

| file | bytes |
|---|---|
""" + "\n".join(f"| `{f}` | {s:,} |" for f, s in files) + f"""
| total (without this README) | {total:,} ({total / 2**20:.2f} MiB) |

Checkpoint layout = DeepSeek-R1 on the HF hub: `model-0000k-of-00002.safetensors` + `model.safetensors.index.json`
(metadata `{{"format": "pt"}}`); FP8 e4m3fn Linear weights (attention projections, dense MLP, every routed expert as
its own tensor, shared expert) with f32 `weight_scale_inv` [ceil(out/128), ceil(in/128)] (scale = amax(block)/448,
codes = round-to-nearest-even, ragged edge blocks); bf16 `embed_tokens`, `lm_head`, all norms, router `mlp.gate.weight`,
MTP `enorm` / `hnorm` / `eh_proj` / `shared_head.norm`; f32 `mlp.gate.e_score_correction_bias`. The MTP layer is
`model.layers.{c['num_hidden_layers']}.*` and carries `shared_head.head.weight` and `embed_tokens.weight` as byte-identical copies of
`lm_head.weight` / `model.embed_tokens.weight`, as DeepSeek ships them. One `weight_scale_inv` sits in the shard after its
weight (as in real checkpoints). `config.json` has R1's `quantization_config` (fp8, e4m3, [128, 128], dynamic).
`generation_config.json` is R1's (BOS 0, EOS 1, temperature 0.6, top_p 0.95).

Tokenizer (`tokenizer.json`, `tokenizer_config.json`): byte-level BPE trained with Hugging Face `tokenizers` on the
training part of the corpus, with DeepSeek-V3/R1's pre-tokenizer (the same three regex splits + ByteLevel), ids 0/1/2 =
`<｜begin▁of▁sentence｜>` / `<｜end▁of▁sentence｜>` / `<｜▁pad▁｜>`, and after the BPE vocabulary `<｜User｜>`,
`<｜Assistant｜>`, `<think>`, `</think>` (not special, as in R1) and R1's nine tool tokens. `tokenizer_config.json`
carries R1's chat template (BOS + system prompts joined by blank lines, `<｜User｜>`..., `<｜Assistant｜>` + answer after
the last `</think>` + EOS, generation prompt `<｜Assistant｜><think>\\n`) and `add_bos_token: true` (the post-processor
prepends BOS when special tokens are requested). The model was never trained on chat turns: the template is there for
format parity with R1.

## Corpus and licence

Debian's `fortunes` / `fortunes-min` packages (fortune-mod 1.99.1, `apt-get install -y fortunes`): the files in
`/usr/share/games/fortunes` except `ascii-art` (pictures) and `translate-me` (not English) - {cm['cookies']:,} distinct
cookies after removing terminal overstrike sequences and exact duplicates. Shuffled with seed {cm['split_seed']}; 5 %
({cm['held_out_cookies']} cookies) held out; `eval.txt` is the whole held-out part ({cm['eval_bytes']:,} bytes,
{cm['eval_tokens']:,} tokens), the training part is {cm['train_bytes']:,} bytes / {cm['train_tokens']:,} tokens. Both are written
in the fortune file format (each cookie followed by a line `%`), which is what the model learned to write.

Licence: Debian's `/usr/share/doc/fortunes/copyright` states that the package "falls under the BSD copyright"
(Copyright (c) 1991 The Regents of the University of California, the 3-clause BSD licence: redistribution with the
copyright notice, the conditions and the disclaimer); `cookie` is from Karl Lehenbauer's alt.sources postings. Debian
ships it in `main` (DFSG-free). The cookies are quotations of many authors collected by the fortune-mod maintainers.
`eval.txt` is a verbatim subset of those files and is redistributed under the same terms; the weights are a derived
work. The chat template is DeepSeek-R1's (MIT licence).

## Training

`tools/train/train.py`: transformers {rec['env']['transformers']} `DeepseekV3ForCausalLM` + transformers' `MtpModel`, torch
{rec['env']['torch']}, float32, CPU, {rec['env']['threads']} thread; seed {hp['seed']} (init, batches).
{hp['steps']} steps x {hp['batch']} windows x {hp['context']} tokens = {rec['tokens_seen']:,} tokens (~{rec['tokens_seen'] / cm['train_tokens']:.2f} epochs);
even rows are BOS + a window starting at a cookie, odd rows a window at a random offset without BOS. AdamW (betas
{tuple(hp['betas'])}, weight decay {hp['weight_decay']} on matrices), lr {hp['lr']} with {hp['warmup']} warm-up steps and cosine decay to
{hp['min_lr_ratio']} x, gradient clipping {hp['grad_clip']}. Loss = CE(main, next token) + {hp['mtp_lambda']} x CE(MTP, token after next)
(DeepSeek-V3's MTP loss with D = 1). Router weights get gradients through the gathered sigmoid scores (checked at
step 1); `e_score_correction_bias` gets none and is updated after every step as DeepSeek-V3's auxiliary-loss-free
balancing: b_e += {hp['bias_update_speed']} x sign(mean load - load_e), per MoE layer (incl. the MTP block), with load = the
number of tokens routed to expert e in that step. Training time: {rec['train_seconds'] / 60:.1f} min wall
({rec['tokens_per_second']:.0f} tokens/s, on a 2-core AMD EPYC VM shared with other jobs).

Loss curve (train columns: mean of the 10 steps up to the step; eval: first {hp['eval_windows']} windows of eval.txt;
load: max expert load / mean load, worst MoE layer, at that step):

| step | train main CE | train MTP CE | eval main CE | eval MTP CE | load |
|---|---|---|---|---|---|
""" + "\n".join(rows) + f"""

## Evaluation (tools/train/evaluate.py; transformers, float32, exactly dequantized weights)

Held-out perplexity on `eval.txt`: **{summ['ppl']:.3f}** (nll {summ['nll']:.4f} nats/token over {summ['scored_tokens']:,} scored
tokens). Procedure: the `tokenizer.json` ids of `eval.txt` without special tokens, cut into consecutive non-overlapping
windows of {WINDOW} tokens ({summ['windows']} windows, the last shorter), each evaluated as its own causal context from
position 0, every token but a window's first scored. Main-model top-1 accuracy {summ['main_top1_accuracy']:.4f}. {fq}

`reference.json` (for the engine's tests): `text` = the first {REF_TOKENS} tokens of eval.txt (window 0) as one causal context,
with `token_ids`, `logprobs` ({REF_TOKENS - 1} values, logprobs[i] = log p(token_ids[i+1] | token_ids[..=i])), `nll`
{w0_nll:.6f}, `ppl` {math.exp(w0_nll):.4f}; `eval` = the whole-file numbers above; `mtp` = the MTP head on window 0 (per-row
log-probs, argmax, margins, and the main argmax); `greedy` = the three samples below as token ids with top-1 - top-2
logit margins.

MTP: top-1 agreement of the MTP head with the main model's own next-next token on eval.txt =
**{summ['mtp_agreement_with_main']:.4f}** ({summ['mtp_rows']:,} rows; this is the expected acceptance of one greedy MTP draft per step);
MTP top-1 accuracy against the text {summ['mtp_top1_accuracy_vs_text']:.4f}, MTP perplexity on the token after next
{summ['mtp_ppl']:.2f}. On the model's own greedy continuations ({SELF_DRAFT_TOKENS} tokens after each of the three prompts below) the
MTP draft is accepted {acc_counts[0]}/{acc_counts[1]} = **{self_accept:.4f}**.

Greedy samples (prompt = BOS + the prompt's ids, i.e. the tokenizer with special tokens as R1's adds BOS; argmax
decoding with full recomputation, no stop token; the model writes fortune-file text, so `%` lines separate cookies).
Without BOS the model's first token is usually a newline: half of its training windows start at a random offset,
mid-line, so a context without BOS (or a preceding `%` line) gives it no sign that the prompt starts a line.
The model is small and far from converged (~1.5 epochs; the training loss still fell ~0.1 nats per 50 steps at the
end), so greedy decoding soon falls into loops; the words and the local grammar are English.

{sample_md}
"""
    (d / "README.md").write_text(md, encoding="utf-8")


if __name__ == "__main__":
    main()
