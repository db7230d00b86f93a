#!/usr/bin/env python3
"""Time to first token of `cachalot serve` with prefix caching off and on.

For each mode given (default: off on off on) it starts `target/release/cachalot serve` on the
shipped model with `--prefix-caching MODE`, sends 8 streamed chat requests one after another,
each the same ~1 950-token system prompt (the first 6 000 bytes of the model's eval.txt) and its
own question (greedy, 16 tokens), and prints the first request's TTFT, the mean of the other
seven, and `usage.prompt_tokens_details.cached_tokens` of each; at the end it checks that every
mode gave the same answers. Run from the repository root after `cargo build --release`:

    python3 tools/serve/prefix_ttft.py [MODE ...]
"""
import json
import re
import subprocess
import sys
import time
import urllib.request

DOC = open("assets/cachalot-tiny-r1/eval.txt").read()[:6000]
QUESTIONS = ["What is this text about?", "Who is the main character?",
             "Summarize the first paragraph.", "List three facts from the text.",
             "What happens at the end?", "Explain one word from the text.",
             "Where does the story take place?", "What is the tone of the text?"]


def ask(addr, question):
    """(TTFT in seconds, answer text, cached prompt tokens, prompt tokens) of one request."""
    body = json.dumps({"messages": [{"role": "system", "content": DOC},
                                    {"role": "user", "content": question}],
                       "max_tokens": 16, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(addr + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    t0, first, text, usage = time.time(), None, "", {}
    with urllib.request.urlopen(req) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for c in ev.get("choices", []):
                d = c.get("delta", {})
                piece = (d.get("content") or "") + (d.get("reasoning_content") or "")
                if piece and first is None:
                    first = time.time() - t0
                text += piece
    return first, text, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def main():
    modes = sys.argv[1:] or ["off", "on", "off", "on"]
    answers = {}
    for mode in modes:
        server = subprocess.Popen(["target/release/cachalot", "serve", "--port", "0",
                                   "--prefix-caching", mode], stderr=subprocess.PIPE, text=True)
        try:
            addr = None
            for line in server.stderr:
                m = re.search(r"listening on (http://[^/\s]+)", line)
                if m:
                    addr = m.group(1)
                    break
            runs = [ask(addr, q) for q in QUESTIONS]
        finally:
            server.kill()
        ttft = [r[0] for r in runs]
        answers[mode] = [r[1] for r in runs]
        print(f"prefix caching {mode:3}: prompt {runs[0][3]} tokens; TTFT first "
              f"{ttft[0] * 1e3:.0f} ms, the other seven {sum(ttft[1:]) / 7 * 1e3:.0f} ms mean; "
              f"cached tokens {[r[2] for r in runs]}")
    if len({json.dumps(a) for a in answers.values()}) != 1:
        sys.exit("the modes gave different answers")
    print("the same answers in every mode")


if __name__ == "__main__":
    main()
