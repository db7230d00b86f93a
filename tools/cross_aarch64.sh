#!/usr/bin/env bash
# Cross-checks the aarch64 build: clippy over the whole workspace for aarch64-unknown-linux-gnu,
# then the kernel crate's tests (every SIMD level against its scalar reference, NEON `sdot`
# included) run under qemu-aarch64, whose default CPU has the dot-product extension, and last
# two models end to end (the shipped one and the DeepSeek-V4 Flash fixture): their
# log-probabilities of a text (`cachalot perplexity --json`) from the aarch64 build under qemu
# must equal the x86-64 build's bit for bit.
#
#   tools/cross_aarch64.sh            # needs qemu-user, gcc-aarch64-linux-gnu, the rustup target
#   CI=true tools/cross_aarch64.sh    # installs them first (apt, rustup)
#
# Exits 0 with a "skipped" line only when the rustup target cannot be installed (no route to
# the Rust distribution server); any build or test failure fails.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=aarch64-unknown-linux-gnu

if [ "${CI:-}" = "true" ]; then
  if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
    apt-get update -qq && apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross
  fi
fi
if ! rustup target list --installed | grep -qx "$TARGET"; then
  if ! rustup target add "$TARGET"; then
    echo "cross_aarch64: SKIPPED — the rustup target $TARGET could not be installed" >&2
    exit 0
  fi
fi
for tool in qemu-aarch64 aarch64-linux-gnu-gcc; do
  command -v "$tool" >/dev/null || { echo "cross_aarch64: $tool not found (apt-get install qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross)" >&2; exit 1; }
done

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
cargo clippy --release --target "$TARGET" --workspace --all-targets -- -D warnings
cargo test --release --target "$TARGET" -p cachalot-kernels
# Again on a core without the dot-product extension (Cortex-A72: Graviton 1, Raspberry Pi 4),
# where the NEON level runs the float products and the W8A8/W4A8 products run scalar.
CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu cortex-a72 -L /usr/aarch64-linux-gnu" \
  cargo test --release --target "$TARGET" -p cachalot-kernels

# End to end: every kernel level gives the scalar kernels' bits and the model code avoids libm
# functions whose bits differ between the two (f32 `log1pf`), so a model's log-probabilities
# are the same on aarch64 (NEON) as on x86-64 (AVX2 or AVX-512): the shipped model (DeepSeek-V3
# shape, FP8), the DeepSeek-V4 Flash fixture (FP8 + MXFP4 experts, compressed attention,
# sqrt-softplus routing), and the shipped model with `--bf16-dot` (BF16 × BF16 head and latent
# attention), each over the start of a text. (x86-64's AVX-512 BF16 flushes subnormals, the
# other levels do not; no value of these runs comes near them.)
cargo build --release --target "$TARGET" -p cachalot
cargo build --release -p cachalot
text=$(mktemp)
trap 'rm -f "$text"' EXIT
while read -r model source bytes flags; do
  head -c "$bytes" "$source" > "$text"
  # shellcheck disable=SC2086 # flags: zero or more words
  x86=$(target/release/cachalot perplexity --model "$model" --file "$text" --json $flags)
  # shellcheck disable=SC2086
  arm=$(qemu-aarch64 -L /usr/aarch64-linux-gnu "target/$TARGET/release/cachalot" perplexity --model "$model" --file "$text" --json $flags)
  if [ "$x86" != "$arm" ]; then
    echo "cross_aarch64: $model's log-probabilities differ between x86-64 and aarch64" >&2
    echo "x86-64:  ${x86:0:300}" >&2
    echo "aarch64: ${arm:0:300}" >&2
    exit 1
  fi
  echo "cross_aarch64: $model${flags:+ $flags}: log-probabilities of $(printf '%s' "$x86" | grep -o '"n_tokens":[0-9]*') equal on x86-64 and aarch64"
done <<'MODELS'
assets/cachalot-tiny-r1 assets/cachalot-tiny-r1/eval.txt 1000
fixtures/v4/flash_tiny fixtures/v4/text.txt 600
assets/cachalot-tiny-r1 assets/cachalot-tiny-r1/eval.txt 600 --bf16-dot
MODELS
