#!/usr/bin/env bash
# Prefix caching's effect on an offline run: 32 requests, 8 questions repeated 4 times, each
# about the same ~1 900-token document (the first 6 000 bytes of the shipped model's eval.txt),
# through `cachalot run` with --prefix-caching off and on, alternating; prints wall time,
# generated tokens/s, TTFT and the cache's figures of each run, and checks that both modes give
# the same outputs. Usage: tools/prefix_bench.sh [ROUNDS] [RUN OPTIONS…] (default 2 rounds;
# options go to both runs, e.g. `--mtp 1`), after `cargo build --release`. MODEL=DIR runs
# another model (its directory needs a tokenizer; MODEL_NAME names it in the run id).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=2
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$dir" <<'PY'
import json, sys
doc = open("assets/cachalot-tiny-r1/eval.txt").read()[:6000]
qs = ["What is this text about?", "Who is the main character?",
      "Summarize the first paragraph.", "List three facts from the text.",
      "What happens at the end?", "Explain one word from the text.",
      "Where does the story take place?", "What is the tone of the text?"]
json.dump({"text": [doc + "\n\nQuestion: " + q for q in qs]},
          open(sys.argv[1] + "/default_prompt.json", "w"))
PY
cat > "$dir/run.yaml" <<YAML
model_config:
  model_name: "${MODEL_NAME:-deepseek_r1}"
  model_path: "${MODEL:-$PWD/assets/cachalot-tiny-r1}"
data_config:
  dataset: "default"
  dataset_path: "$dir"
  input_truncated_len: 4000
  num_requests: 32
  temperature: 0.0
scheduler_config:
  block_size: 128
  batch_size: 16
  max_new_tokens: 32
  max_prefill_tokens: 2048
YAML
for r in $(seq "$rounds"); do
  for mode in off on; do
    target/release/cachalot run --config "$dir/run.yaml" --res-dir "$dir/res" \
      --prefix-caching "$mode" --quiet --json "$@" > "$dir/$mode.json"
    python3 - "$dir" "$mode" <<'PY'
import json, sys
d = json.load(open(f"{sys.argv[1]}/{sys.argv[2]}.json"))
outs = [json.loads(l)["output_ids"]
        for l in open(f"{sys.argv[1]}/res/{d['run_id']}/requests.jsonl")]
json.dump(outs, open(f"{sys.argv[1]}/{sys.argv[2]}.out", "w"))
print(f"prefix caching {sys.argv[2]:3}: {d['prompt_tokens']} prompt tokens, wall {d['wall_s']:.2f} s, "
      f"{d['throughput']['output_tok_s']:.0f} generated tok/s, TTFT mean {d['ttft_s']['mean']*1e3:.0f} ms "
      f"p50 {d['ttft_s']['p50']*1e3:.0f} ms, cache {d.get('prefix_cache')}"
      + (f", MTP acceptance {d['mtp']['acceptance_rate']:.3f} ({d['mtp']['accepted']}/{d['mtp']['drafted']})"
         if d.get('mtp') else ""))
PY
  done
  cmp -s "$dir/off.out" "$dir/on.out" || { echo "outputs differ between the modes" >&2; exit 1; }
done
echo "outputs equal in both modes"
