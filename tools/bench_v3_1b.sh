#!/usr/bin/env bash
# Decode/prefill throughput of a DeepSeek-V3-shaped random model of about 1 B parameters (FP8 as
# DeepSeek ships it), with FP8 multiplied natively and dequantized to f32 at load.
# Usage: tools/bench_v3_1b.sh [MODEL_DIR]   (needs python3 with numpy + safetensors)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-/tmp/cachalot-v3-1b}
py=${PYTHON:-python3}
[ -f "$dir/config.json" ] || "$py" tools/random_checkpoint.py --out "$dir" --preset v3-1b
cargo build --release -q -p cachalot
for fp8 in native f32; do
  ./target/release/cachalot bench --model "$dir" --prompt-len 128 --gen-len 32 --fp8 "$fp8" --json
done
