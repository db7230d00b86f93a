#!/usr/bin/env python3
"""Side-by-side benchmark of cachalot and llama.cpp on the same DeepSeek-V3-shaped random model (issue 7).

Everything it downloads or builds lives under --work (default /work/peer), never in this repository:

  build   llama.cpp's `llama-bench` from the `llama-cpp-python` source distribution on PyPI
          (pip download --no-binary :all: --no-deps; cmake + ninja from pip if missing; vendor/llama.cpp
          built with -j2, only the llama-bench target, CPU backend, -DGGML_NATIVE=ON).
  model   the same weights four ways: tools/random_checkpoint.py --preset v3-1b --mtp-layers 0 (FP8, the
          DeepSeek release layout) -> `cachalot convert --quant-mode bfloat16` and `--quant-mode w8a8c16`; the
          BF16 checkpoint -> GGUF BF16 and GGUF Q8_0 by llama.cpp's own convert_hf_to_gguf.py from the sdist
          (arch deepseek2 with MLA: kv_b_proj split into k_b/v_b, key/value_length_mla), run through
          `gguf_convert.py` here, which only substitutes a synthetic vocabulary (the random model has no
          real tokenizer; both benchmarks feed random ids).
  run     alternating rounds A B A B ...: llama-bench (pp512; tg128 at depth 512, i.e. after a 512-token
          context, as our decode runs after its 512-token prompt; -t 2, -r 1) and `cachalot bench
          --prompt-len 512 --gen-len 128 --threads 2 --json`, for BF16 vs BF16 and our W8A8 vs its Q8_0
          (with the seed's bf16 lm_head, and with `--int8-head`, which holds it in int8 as Q8_0 does), and
          BF16 with `--bf16-dot` (bf16 activations, as llama.cpp multiplies BF16); `--pairs` picks a subset;
          prints each figure's median over the rounds, the ratio ours/llama.cpp, and bandwidth fractions
          (bytes per decoded token / TPOT / measured bandwidth; llama.cpp's bytes are counted from its GGUF
          tensors: everything but the unrouted experts and all but one embedding row).
  all     build + model + run.

Usage:
  /work/venv/ref/bin/python tools/peer/peer_bench.py all [--work /work/peer] [--rounds 3] [--threads 2]
  /work/venv/ref/bin/python tools/peer/peer_bench.py run --rounds 5 --json-out /tmp/peer.json
(any Python with gguf, torch, transformers and numpy)
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def sh(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def python():
    return os.environ.get("PYTHON", sys.executable)


def llama_src(work: Path) -> Path:
    cands = sorted(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return cands[-1] if cands else None


# `--isa`: `native` builds llama.cpp with -DGGML_NATIVE=ON and runs ours at its best level; `avx2` builds
# llama.cpp for AVX2 + FMA + F16C only (no AVX-512, VNNI or AMX; in build-avx2/) and runs ours with
# CACHALOT_SIMD=avx2, CACHALOT_AVX_VNNI=0 and CACHALOT_AMX=0: what a CI-class x86 machine without
# AVX-512 runs, on this CPU. `avx2-vnni` is the same plus AVX-VNNI on both sides (llama.cpp's
# GGML_AVX_VNNI, our AVX-VNNI W8A8 kernel): an x86 machine with AVX-VNNI but no AVX-512 (Intel client
# cores from Alder Lake, AMD Zen 5 with AVX-512 off).
AVX2_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
              "-DGGML_AMX_BF16=OFF"]
ISA_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": AVX2_FLAGS + ["-DGGML_AVX_VNNI=OFF"],
    "avx2-vnni": AVX2_FLAGS + ["-DGGML_AVX_VNNI=ON"],
}
ISA_ENV = {
    "native": {},
    "avx2": {"CACHALOT_SIMD": "avx2", "CACHALOT_AVX_VNNI": "0", "CACHALOT_AMX": "0"},
    "avx2-vnni": {"CACHALOT_SIMD": "avx2", "CACHALOT_AVX_VNNI": "1", "CACHALOT_AMX": "0"},
}


def build_dir(isa: str) -> str:
    return "build" if isa == "native" else f"build-{isa}"


def llama_bench(work: Path, isa: str = "native") -> Path:
    src = llama_src(work)
    return src / build_dir(isa) / "bin" / "llama-bench" if src else None


def cmd_build(a):
    work = a.work
    work.mkdir(parents=True, exist_ok=True)
    lb = llama_bench(work, a.isa)
    if lb and lb.exists():
        print(f"llama-bench already built: {lb}")
        return
    if not llama_src(work):
        if not list(work.glob("llama_cpp_python-*.tar.gz")):
            # scikit-build-core must be importable: pip reads the sdist's metadata through it, and
            # without --no-build-isolation it would build cmake itself from source first.
            sh([python(), "-m", "pip", "install", "-q", "cmake", "ninja", "scikit-build-core"])
            sh([python(), "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--no-build-isolation",
                "llama-cpp-python", "-d", work])
        tgz = sorted(work.glob("llama_cpp_python-*.tar.gz"))[-1]
        with tarfile.open(tgz) as t:
            t.extractall(work, filter="data")
    src = llama_src(work)
    env = dict(os.environ, PATH=f"{Path(python()).parent}:{os.environ['PATH']}")
    if not shutil.which("cmake", path=env["PATH"]):
        sh([python(), "-m", "pip", "install", "-q", "cmake", "ninja"])
    gen = ["-G", "Ninja"] if shutil.which("ninja", path=env["PATH"]) else []
    out = src / build_dir(a.isa)
    sh(["cmake", "-S", src, "-B", out, *gen, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
        *ISA_FLAGS[a.isa], "-DBUILD_SHARED_LIBS=OFF"], env=env)
    sh(["cmake", "--build", out, "--target", "llama-bench", f"-j{a.jobs}"], env=env)


def cachalot_bin():
    return REPO / "target" / "release" / "cachalot"


def models(work: Path):
    m = work / "models"
    return {
        "fp8": m / "v3-1b",
        "bf16": m / "v3-1b-bf16",
        "w8a8": m / "v3-1b-w8a8c16",
        "gguf_bf16": m / "v3-1b-bf16.gguf",
        "gguf_q8_0": m / "v3-1b-q8_0.gguf",
    }


def cmd_model(a):
    p = models(a.work)
    if not (p["fp8"] / "config.json").exists():
        sh([python(), REPO / "tools" / "random_checkpoint.py", "--out", p["fp8"], "--preset", "v3-1b",
            "--mtp-layers", "0"])
    if not cachalot_bin().exists():
        sh(["cargo", "build", "--release", "-j1", "-p", "cachalot"], cwd=REPO)
    for key, mode in (("bf16", "bfloat16"), ("w8a8", "w8a8c16")):
        if not (p[key] / "config.json").exists():
            sh([cachalot_bin(), "convert", "--input", p["fp8"], "--output", p[key], "--quant-mode", mode, "--force"])
    src = llama_src(a.work)
    if src is None:
        sys.exit("llama.cpp sources not found under --work; run `build` first")
    for key, outtype in (("gguf_bf16", "bf16"), ("gguf_q8_0", "q8_0")):
        if not p[key].exists():
            sh([python(), HERE / "gguf_convert.py", "--llama-src", src, "--model", p["bf16"], "--outtype", outtype,
                "--outfile", p[key]])


def run_json(cmd, env=None):
    print("+", " ".join(f"{k}={v}" for k, v in (env or {}).items()), " ".join(str(c) for c in cmd), flush=True)
    r = subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True,
                       env=dict(os.environ, **(env or {})))
    return json.loads(r.stdout)


def llama_json(cmd, fallbacks: set, name: str):
    """llama-bench's JSON. Where its default weight repacking (the CPU backend's extra buffer types,
    AMX tiles among them) aborts, as the vendored build does for Q8_0 DeepSeek-2 on AMX CPUs
    (`GGML_ASSERT(*cur_backend_id != -1)` while reserving the graph), the pair is rerun with
    `--repack 0` and recorded as such."""
    if name not in fallbacks:
        try:
            return run_json(cmd)
        except subprocess.CalledProcessError as e:
            print(f"llama-bench failed ({e.returncode}) with its default repacking; {name} reruns with --repack 0",
                  flush=True)
            fallbacks.add(name)
    return run_json([*cmd, "--repack", "0"])


def gguf_bytes_per_token(path: Path, src: Path):
    """Bytes of GGUF tensors one decoded token reads: all but the unrouted experts (k/E of each merged
    expert tensor) and all but one row of token_embd."""
    sys.path.insert(0, str(src / "gguf-py"))
    import gguf  # noqa: E402

    r = gguf.GGUFReader(str(path))
    kv = {f.name: f for f in r.fields.values()}

    def scalar(key):
        f = kv[key]
        return int(f.parts[f.data[0]][0])

    e = scalar("deepseek2.expert_count")
    k = scalar("deepseek2.expert_used_count")
    total = 0
    for t in r.tensors:
        n = int(t.n_bytes)
        if "_exps." in t.name:
            total += n * k // e
        elif t.name == "token_embd.weight":
            total += n // int(t.shape[-1])
        else:
            total += n
    return total


def cmd_run(a):
    p = models(a.work)
    lb = llama_bench(a.work, a.isa)
    src = llama_src(a.work)
    if not lb or not lb.exists():
        sys.exit(f"llama-bench not built for --isa {a.isa}; run `build --isa {a.isa}` first")
    # (key, name, our model, its GGUF, our extra flags). `bf16-dot` multiplies our BF16 weights
    # with bf16-rounded activations (`--bf16-dot`, `vdpbf16ps`), as llama.cpp does with BF16;
    # `w8a8-int8-head` holds our head in int8 as the Q8_0 file holds output.weight
    # (`--int8-head`), so both read the same kinds of bytes.
    all_pairs = [("bf16", "BF16", p["bf16"], p["gguf_bf16"], []),
                 ("bf16-dot", "BF16 --bf16-dot", p["bf16"], p["gguf_bf16"], ["--bf16-dot"]),
                 ("w8a8", "W8A8 vs Q8_0", p["w8a8"], p["gguf_q8_0"], []),
                 ("w8a8-int8-head", "W8A8 int8 head vs Q8_0", p["w8a8"], p["gguf_q8_0"], ["--int8-head"])]
    wanted = a.pairs.split(",") if a.pairs else [k for k, *_ in all_pairs]
    unknown = [k for k in wanted if k not in [k for k, *_ in all_pairs]]
    if unknown:
        sys.exit(f"--pairs: unknown {unknown}; choose from {[k for k, *_ in all_pairs]}")
    pairs = [(n, m, g, e) for k, n, m, g, e in all_pairs if k in wanted]
    gguf_bytes = {name: gguf_bytes_per_token(g, src) for name, _, g, _ in pairs}
    res = {name: {"ours": [], "llama": []} for name, _, _, _ in pairs}
    fallbacks = set()
    for rnd in range(a.rounds):
        for name, ours, gg, extra in pairs:
            # A: llama.cpp. pp512 at depth 0; tg128 after a 512-token context (-d 512).
            pp = llama_json([lb, "-m", gg, "-p", a.prompt, "-n", "0", "-t", a.threads, "-r", "1", "-o", "json"],
                            fallbacks, name)
            tg = llama_json([lb, "-m", gg, "-p", "0", "-n", a.gen, "-d", a.prompt, "-t", a.threads, "-r", "1",
                             "-o", "json"], fallbacks, name)
            lpp = pp[0]["avg_ts"]
            ltg = tg[0]["avg_ts"]
            # B: cachalot.
            o = run_json([cachalot_bin(), "bench", "--model", ours, *extra, *a.ours_extra.split(), "--prompt-len",
                          a.prompt, "--gen-len",
                          a.gen, "--threads", a.threads, "--json", "--membw-passes", "5"], env=ISA_ENV[a.isa])
            res[name]["llama"].append({"prefill_tok_s": lpp, "decode_tok_s": ltg})
            res[name]["ours"].append(o)
            print(f"round {rnd + 1} {name}: llama.cpp pp {lpp:.1f} tg {ltg:.2f} | cachalot prefill "
                  f"{o['prefill_tok_s']:.1f} decode {o['decode_tok_s']:.2f} (membw {o['membw_gb_s']:.1f} GB/s)",
                  flush=True)
    med = statistics.median
    summary = {}
    print()
    print(f"medians over {a.rounds} alternating rounds, {a.threads} threads, prompt {a.prompt}, gen {a.gen}, "
          f"isa {a.isa}")
    print("| pair | figure | cachalot | llama.cpp | ratio | cachalot frac. of BW | llama.cpp frac. of BW |")
    print("|---|---|---|---|---|---|---|")
    for name, _, _, _ in pairs:
        ours, ll = res[name]["ours"], res[name]["llama"]
        bw = med([o["membw_gb_s"] for o in ours])
        obytes = ours[0]["decode_bytes_per_token"]
        lbytes = gguf_bytes[name]
        o_pp, l_pp = med([o["prefill_tok_s"] for o in ours]), med([x["prefill_tok_s"] for x in ll])
        o_tg, l_tg = med([o["decode_tok_s"] for o in ours]), med([x["decode_tok_s"] for x in ll])
        o_frac = med([o["decode_fraction_of_membw"] for o in ours])
        l_frac = lbytes * l_tg / 1e9 / bw
        print(f"| {name} | prefill {a.prompt} tok/s | {o_pp:.1f} | {l_pp:.1f} | {o_pp / l_pp:.2f} | | |")
        print(f"| {name} | decode batch 1 tok/s | {o_tg:.2f} | {l_tg:.2f} | {o_tg / l_tg:.2f} | {o_frac:.2f} | "
              f"{l_frac:.2f} |")
        summary[name] = dict(ours_prefill=o_pp, llama_prefill=l_pp, ours_decode=o_tg, llama_decode=l_tg,
                             ours_bytes_per_token=obytes, llama_bytes_per_token=lbytes, membw_gb_s=bw,
                             ours_fraction=o_frac, llama_fraction=l_frac,
                             ours_peak_rss=med([o["peak_rss_bytes"] for o in ours]))
    print()
    for name, s in summary.items():
        print(f"{name}: bytes/token ours {s['ours_bytes_per_token'] / 1e6:.1f} MB, llama.cpp "
              f"{s['llama_bytes_per_token'] / 1e6:.1f} MB; membw median {s['membw_gb_s']:.2f} GB/s; "
              f"our peak RSS {s['ours_peak_rss'] / 1e6:.0f} MB")
    if fallbacks:
        print(f"llama.cpp ran with --repack 0 (its default aborted) for: {', '.join(sorted(fallbacks))}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"isa": a.isa, "summary": summary, "rounds": res,
                                                "llama_repack_off": sorted(fallbacks)}, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["build", "model", "run", "all"])
    ap.add_argument("--work", type=Path, default=Path("/work/peer"), help="llama.cpp, GGUF and models go here")
    ap.add_argument("--jobs", type=int, default=2, help="parallel jobs of the llama.cpp build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--isa", choices=sorted(ISA_FLAGS), default="native",
                    help="native: both at this CPU's best; avx2: both held to AVX2+FMA+F16C (llama.cpp in "
                         "build-avx2/); avx2-vnni: the same plus AVX-VNNI (build-avx2-vnni/)")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--prompt", default="512")
    ap.add_argument("--gen", default="128")
    ap.add_argument("--json-out")
    ap.add_argument("--pairs", help="comma-separated subset of bf16,bf16-dot,w8a8,w8a8-int8-head (default: all)")
    ap.add_argument("--ours-extra", default="",
                    help="flags added to every `cachalot bench` call, e.g. '--kv-cache-dtype f32' (the exact "
                         "cache; the default, auto, is bf16 for these models, 16-bit as llama.cpp's f16 KV cache)")
    a = ap.parse_args()
    t = time.time()
    if a.step in ("build", "all"):
        cmd_build(a)
    if a.step in ("model", "all"):
        cmd_model(a)
    if a.step in ("run", "all"):
        cmd_run(a)
    print(f"done in {time.time() - t:.0f} s")


if __name__ == "__main__":
    main()
