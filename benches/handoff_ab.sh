#!/usr/bin/env bash
# What a handoff costs in a three-member cluster, two or more builds interleaved in one run.
#
#   benches/handoff_ab.sh ROUNDS BINARY...
#
# Each round, for each binary in turn: a fresh three-member cluster (one core each, one shard,
# fsync on, on loopback), then `bench --workload contended --hot-keys 1 --connections 8
# --pipeline 1 --identify` for 3 s after 1 s of warm-up (every acquire but the holder's queues:
# each cycle is one handoff), its cycles/s, handoff p50/p99 and the server CPU per cycle
# (user+sys of the three members from /proc/PID/stat around the run, summed, warm-up included
# in neither). Every session identifies, so a build that mirrors its queues in the replicated
# state (`Enqueue`/`Withdraw`, docs/cluster-design.md) pays for it here. Each round ends with
# the disk's 4 KiB `fdatasync` p50 where the data directories live. Quote medians over rounds.
# FSYNC=false runs without fsync.
set -euo pipefail
rounds=${1:?rounds}
shift
[ $# -ge 1 ] || { echo "usage: $0 ROUNDS BINARY..." >&2; exit 2; }
dir=$(mktemp -d /tmp/latchkey-handoff-ab.XXXXXX)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done; rm -rf "$dir"; }
trap cleanup EXIT
# shellcheck source=benches/cluster_lib.sh
source "$(dirname "$0")/cluster_lib.sh"
hz=$(getconf CLK_TCK)
fsync=${FSYNC:-true}

idle_note
for round in $(seq "$rounds"); do
    for binary in "$@"; do
        rm -rf "$dir"/run-*
        pids=()
        start_three "$binary" run 1 "$fsync"
        for port in "${members_ports[@]}"; do
            wait_port "$port" || { tail -5 "$dir"/run-*.log >&2; exit 1; }
        done
        leader=$(find_leader "${members_ports[@]}")
        "$binary" bench --target "latchkey://127.0.0.1:$leader" --workload contended \
            --hot-keys 1 --connections 8 --pipeline 1 --duration 1s --warmup 0s --identify \
            --json >/dev/null
        before=$(cpu_ticks "${members_pids[@]}")
        json=$("$binary" bench --target "latchkey://127.0.0.1:$leader" --workload contended \
            --hot-keys 1 --connections 8 --pipeline 1 --duration 3s --warmup 0s --identify --json)
        after=$(cpu_ticks "${members_pids[@]}")
        python3 - "$round" "$binary" "$((after - before))" "$hz" "$json" <<'PY'
import json, sys
round_, binary, ticks, hz, text = sys.argv[1:]
r = json.loads(text)
assert r["ok"], "the bench run was not clean"
h = r["handoff_latency_us"]
cpu = int(ticks) * 1e6 / int(hz) / max(r["cycles"], 1)
print(f"round {round_} {binary}: {r['cycles_per_sec']:>7,.0f} handoffs/s  handoff p50 {h['p50']:7.1f} us"
      f"  p99 {h['p99']:8.1f} us  server CPU {cpu:6.1f} us/handoff")
PY
        { for pid in "${members_pids[@]}"; do kill -9 "$pid" && wait "$pid"; done; } 2>/dev/null || true
        pids=()
    done
    disk_sync "round $round"
done
