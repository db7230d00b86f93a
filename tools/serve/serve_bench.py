#!/usr/bin/env python3
"""Load test of an OpenAI-compatible server (`cachalot serve`, vLLM, llama-server): N streamed
completion requests, C at a time; per request the time to first token (TTFT) and the time per
output token after it (TPOT); for the run the output tokens/s. Standard library only.

    python3 tools/serve/serve_bench.py --url http://127.0.0.1:8000 --prompts dataset/default_prompt.json \
        --requests 64 --concurrency 16 --max-tokens 64

Token counts come from the usage chunk (`stream_options.include_usage`); the prompts are the
seed's default_prompt.json (a JSON list of strings, or of objects with a "prompt" field) or
lines of a text file.
"""
import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse


def load_prompts(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return [line for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), [])
    out = []
    for d in data:
        if isinstance(d, str):
            out.append(d)
        elif isinstance(d, dict):
            out.append(d.get("prompt") or d.get("text") or json.dumps(d))
    return out


def one(url, body):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    tokens = 0
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ")
            if data == "[DONE]":
                continue
            v = json.loads(data)
            if v.get("usage"):
                tokens = v["usage"]["completion_tokens"]
            elif v["choices"] and v["choices"][0].get("text"):
                now = time.perf_counter()
                first = first or now
                last = now
    conn.close()
    end = time.perf_counter()
    ttft = (first or end) - t0
    tpot = (last - first) / (tokens - 1) if first and tokens > 1 else None
    return ttft, tpot, tokens, end - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", help="the model field (default: none sent)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    a = ap.parse_args()
    prompts = load_prompts(a.prompts)
    if not prompts:
        raise SystemExit(f"{a.prompts}: no prompts")
    jobs = list(range(a.requests))
    lock = threading.Lock()
    results, errors = [], []

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                i = jobs.pop(0)
            body = {"prompt": prompts[i % len(prompts)], "max_tokens": a.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            if a.model:
                body["model"] = a.model
            try:
                r = one(a.url, body)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    ttft = sorted(r[0] for r in results)
    tpot = sorted(r[1] for r in results if r[1] is not None)
    out_tokens = sum(r[2] for r in results)

    def pct(v, p):
        return v[min(len(v) - 1, int(p / 100 * len(v)))] if v else float("nan")

    fig = {
        "requests": len(results), "concurrency": a.concurrency, "wall_s": wall,
        "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
        "ttft_ms": {"mean": 1e3 * statistics.mean(ttft), "p50": 1e3 * pct(ttft, 50),
                    "p99": 1e3 * pct(ttft, 99)},
        "tpot_ms": {"mean": 1e3 * statistics.mean(tpot) if tpot else None,
                    "p50": 1e3 * pct(tpot, 50), "p99": 1e3 * pct(tpot, 99)},
    }
    if a.json:
        print(json.dumps(fig))
    else:
        print(f"{len(results)} requests, {a.concurrency} at a time, {wall:.2f} s: "
              f"{fig['output_tok_s']:.1f} output tok/s")
        print(f"TTFT ms mean {fig['ttft_ms']['mean']:.1f} p50 {fig['ttft_ms']['p50']:.1f} "
              f"p99 {fig['ttft_ms']['p99']:.1f}")
        print(f"TPOT ms mean {fig['tpot_ms']['mean']:.2f} p50 {fig['tpot_ms']['p50']:.2f} "
              f"p99 {fig['tpot_ms']['p99']:.2f}")


if __name__ == "__main__":
    main()
