#!/usr/bin/env bash
# Two ranks on two "hosts": two network namespaces joined by a veth pair (10.213.0.1 and
# 10.213.0.2, made here and removed at exit), each rank in its own, so the ranks reach each other
# only through a network interface, as on two hosts. Runs r1_tiny's config (5 requests,
# data-expert: requests shared out, routed experts split, two all-to-alls per MoE layer) over
# TCP (--rank/--world-size/--master) and, when the binary has MPI, under mpirun (Open MPI's
# TCP transport, its daemon started in the second namespace by an rsh agent that enters it),
# and checks that both give the outputs of `--ranks 2` on one host. Needs root (ip netns);
# says so and exits 0 where namespaces cannot be made. Usage: tools/two_hosts.sh [CACHALOT]
# (default target/release/cachalot; `.ci/run` calls it after the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${1:-target/release/cachalot}")
tag=$$
ns0=cachalot-h0-$tag ns1=cachalot-h1-$tag
dir=$(mktemp -d)
cleanup() {
  ip netns del "$ns0" 2>/dev/null || true
  ip netns del "$ns1" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
if ! command -v python3 > /dev/null; then
  echo "two_hosts: needs python3 (to compare the runs' outputs); skipped"
  exit 0
fi
if ! ip netns add "$ns0" 2>/dev/null; then
  echo "two_hosts: cannot make network namespaces here (needs root and ip netns); skipped"
  exit 0
fi
ip netns add "$ns1"
ip link add cv0-$tag type veth peer name cv1-$tag
ip link set cv0-$tag netns "$ns0"
ip link set cv1-$tag netns "$ns1"
ip -n "$ns0" addr add 10.213.0.1/24 dev cv0-$tag
ip -n "$ns1" addr add 10.213.0.2/24 dev cv1-$tag
for n in "$ns0" "$ns1"; do ip -n "$n" link set lo up; done
ip -n "$ns0" link set cv0-$tag up
ip -n "$ns1" link set cv1-$tag up

args=(run --config configs/tiny/r1_tiny.yaml --num-requests 5 --quiet --json
      --parallel data-expert)
outputs() { python3 -c '
import glob, json, sys
print(json.dumps([json.loads(l)["output_ids"] for l in open(glob.glob(sys.argv[1] + "/*/requests.jsonl")[0])]))' "$1"; }
summary() { python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
print("%d ranks, %s, %.0f generated tok/s" % (d["ranks"], d["parallel"], d["output_tokens"] / d["wall_s"]))' "$1"; }

"$bin" "${args[@]}" --ranks 2 --res-dir "$dir/local" > "$dir/local.json"
want=$(outputs "$dir/local")

# TCP: rank 1 in the second namespace, rank 0 (which listens) in the first.
ip netns exec "$ns1" "$bin" "${args[@]}" --rank 1 --world-size 2 --master 10.213.0.1:29431 \
  --transport tcp --res-dir "$dir/tcp1" > /dev/null 2> "$dir/tcp1.err" &
rank1=$!
if ! ip netns exec "$ns0" timeout 300 "$bin" "${args[@]}" --rank 0 --world-size 2 \
    --master 10.213.0.1:29431 --transport tcp --res-dir "$dir/tcp" > "$dir/tcp.json" \
    2> "$dir/tcp.err"; then
  cat "$dir/tcp.err" "$dir/tcp1.err" >&2
  echo "two_hosts: the TCP run failed" >&2
  exit 1
fi
wait "$rank1"
[ "$(outputs "$dir/tcp")" = "$want" ] || { echo "two_hosts: TCP outputs differ" >&2; exit 1; }
echo "two_hosts: TCP across two namespaces: $(summary "$dir/tcp.json"), outputs equal one host's"

# MPI, when the binary has it (without, --transport mpi fails before reading the config).
if ! command -v mpirun > /dev/null \
    || "$bin" run --transport mpi --config /nonexistent 2>&1 | grep -q "built without MPI"; then
  echo "two_hosts: no MPI here (mpirun, or a build with --features mpi); MPI skipped"
  exit 0
fi
cat > "$dir/agent.sh" <<AGENT
#!/bin/bash
# mpirun's rsh agent: HOST COMMAND… runs COMMAND in HOST's namespace.
host=\$1; shift
case "\$host" in
  10.213.0.1) ns=$ns0 ;;
  10.213.0.2) ns=$ns1 ;;
  *) echo "agent: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" /bin/sh -c "\$*"
AGENT
chmod +x "$dir/agent.sh"
if ! ip netns exec "$ns0" timeout 300 mpirun --allow-run-as-root -H 10.213.0.1,10.213.0.2 -n 2 \
    --mca plm_rsh_agent "$dir/agent.sh" --mca btl self,tcp \
    --mca btl_tcp_if_include 10.213.0.0/24 --mca oob_tcp_if_include 10.213.0.0/24 \
    "$bin" "${args[@]}" --res-dir "$dir/mpi" > "$dir/mpi.json" 2> "$dir/mpi.err"; then
  cat "$dir/mpi.err" >&2
  echo "two_hosts: the MPI run failed" >&2
  exit 1
fi
grep -q "exchange data over mpi" "$dir"/mpi/*/run.log || { echo "two_hosts: not over MPI" >&2; exit 1; }
[ "$(outputs "$dir/mpi")" = "$want" ] || { echo "two_hosts: MPI outputs differ" >&2; exit 1; }
echo "two_hosts: MPI across two namespaces: $(summary "$dir/mpi.json"), outputs equal one host's"
