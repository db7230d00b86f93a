#!/usr/bin/env bash
# Cross-checks the aarch64 build: clippy over the whole workspace for aarch64-unknown-linux-gnu,
# then the kernel crate's tests (every SIMD level against its scalar reference, NEON `sdot`
# included) run under qemu-aarch64, whose default CPU has the dot-product extension.
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
