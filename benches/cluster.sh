#!/usr/bin/env bash
# A three-member cluster against a single node, measured with `latchkey bench` in one run.
#
#   benches/cluster.sh BINARY [DURATION] [SHARDS...]
#
# For the single node and for a cluster with fsync on and off: start the server(s) on loopback
# (one core each; the cluster's three members and the load share this machine's CPUs), run the
# uncontended workload at pipeline 1 (one connection: the latency of one acquire+release after
# another) and at pipeline 16 (50 connections), the contended workload (8 hot keys, 50
# connections, pipeline 1) and handoffs (1 hot key, 8 connections: cycles/s is handoffs/s), and
# print requests/s, cycles/s and per-request latency percentiles (the handoff p99 for the
# contended ones) and the redirects (M) followed; at pipeline 16 also the server CPU per request
# (user+sys of every member, from /proc/PID/stat around a bench run without warm-up, summed);
# after each shape the worst event-loop iteration of each server (`GET /stats`,
# loop_iteration_seconds: the busiest core's max since start) and the disk's own `fdatasync`
# latency, measured right there on the data directories' file system (4 KiB write + fdatasync,
# 300 times); for the cluster also each leader's fsync (WAL sync) and commit
# latency from its /stats.
#
# Each cluster shape is run with 1 shard and with 64 shards (or the SHARDS given). With one
# shard one member leads every key: the script finds it with a Q and benches it alone (listing
# every member would cost each new key of the uncontended workload a redirect). With
# several, leadership is spread over the members: the script waits until every probe key has
# a leader, then benches all three members (`--target a,b,c`, `--shards N`): the bench sends
# each request to its key's leader, learning leaders from M answers per shard (counted in the M
# column; each shard costs at most one redirect once its leader is known).
#
# LOAD_BINARY=PATH runs the load (`bench`) with another build than the servers, e.g. to compare
# two server builds with the same load generator.
set -euo pipefail
binary=${1:?latchkey binary}
load=${LOAD_BINARY:-$binary}
duration=${2:-5s}
shift $(( $# < 2 ? $# : 2 ))
shard_counts=("$@")
[ ${#shard_counts[@]} -gt 0 ] || shard_counts=(1 64)
dir=$(mktemp -d /tmp/latchkey-cluster-bench.XXXXXX)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done; rm -rf "$dir"; }
trap cleanup EXIT

# free_port, wait_port, cluster_target, cpu_ticks, idle_note, disk_sync, start_three (use $dir).
# shellcheck source=benches/cluster_lib.sh
source "$(dirname "$0")/cluster_lib.sh"

# The worst loop iteration of each server since it started (GET /stats on its client port).
worst_loop() { # label ports...
    local label=$1
    shift
    python3 - "$label" "$@" <<'PY'
import json, sys, urllib.request
label, ports = sys.argv[1], sys.argv[2:]
worst = []
for port in ports:
    stats = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5))
    worst.append(max(core["max"] for core in stats["loop_iteration_seconds"]) * 1e6)
print(f"{label:<24} worst loop iteration per server: " + ", ".join(f"{w:,.0f} us" for w in worst))
PY
}

run_bench() { # label target shards server-pids...
    local label=$1 target=$2 shards=$3
    shift 3
    for spec in "uncontended 1 1 8" "uncontended 16 50 8" "contended 1 50 8" "contended 1 8 1"; do
        read -r workload pipeline connections hot <<<"$spec"
        # The pipeline-16 run is the CPU measurement: no warm-up, so that every request the
        # bench counts falls between the two readings.
        local warmup=1s before after
        [ "$pipeline" = 16 ] && warmup=0s
        before=$(cpu_ticks "$@")
        json=$("$load" bench --target "latchkey://$target" --workload "$workload" \
            --pipeline "$pipeline" --connections "$connections" --hot-keys "$hot" \
            --duration "$duration" --warmup "$warmup" ${shards:+--shards "$shards"} --json)
        after=$(cpu_ticks "$@")
        python3 - "$label" "$workload" "$pipeline" "$connections" "$hot" "$((after - before))" \
            "$(getconf CLK_TCK)" "$json" <<'PY'
import json, sys
label, workload, pipeline, connections, hot, ticks, hz, text = sys.argv[1:]
r = json.loads(text)
l = r["latency_us"]
name = workload if workload == "uncontended" else f"contended/{hot}"
line = (f"{label:<24} {name:<12} p{pipeline:<3} c{connections:<3} {r['requests_per_sec']:>10,.0f} req/s"
        f" {r['cycles_per_sec']:>9,.0f} cycles/s  latency p50 {l['p50']:>8.1f} us  p99 {l['p99']:>9.1f} us")
if workload == "contended":
    line += f"  handoff p99 {r['handoff_latency_us']['p99']:>9.1f} us"
if pipeline == "16":
    cpu_us = int(ticks) * 1e6 / int(hz) / max(r["requests"], 1)
    line += f"  server CPU {cpu_us:.2f} us/request"
print(line + f"  M {r['counts']['M']:>6}  ok={r['ok']}")
PY
    done
}

# The leader's write-ahead log syncs and commit latency over the three workloads (GET /stats
# on its client port): the fsync part of a cluster request's latency, measured in the same run.
leader_sync() { # port
    python3 - "$1" <<'PY'
import json, sys, urllib.request
stats = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/stats", timeout=5))
c = stats["cluster"]
for name in ("sync_latency_seconds", "commit_latency_seconds"):
    h = c[name]
    mean = h["sum"] / h["count"] * 1e6 if h["count"] else 0.0
    p50 = h["p50"] * 1e6 if h["p50"] is not None else float("nan")
    print(f"{'':<24} :{sys.argv[1]} {name[:-16]:<6} latency: {h['count']:>9,} samples  mean {mean:>8.1f} us"
          f"  p50 <= {p50:>8.0f} us  max {h['max'] * 1e6:>9.0f} us")
PY
}

port=$(free_port)
"$binary" serve --cores 1 --listen "127.0.0.1:$port" >/dev/null 2>&1 &
pids+=($!)
wait_port "$port"
idle_note
disk_sync "this disk"
run_bench "single node" "127.0.0.1:$port" "" "${pids[0]}"
worst_loop "single node" "$port"
kill -TERM "${pids[0]}"; wait "${pids[0]}" 2>/dev/null || true
pids=()

for shards in "${shard_counts[@]}"; do
for fsync in true false; do
    start_three "$binary" "member-$shards-$fsync" "$shards" "$fsync"
    ports=("${members_ports[@]}")
    label="cluster s=$shards fsync=$fsync"
    target=$(cluster_target "$shards" "${ports[@]}")
    if [ "$shards" -eq 1 ]; then
        run_bench "$label" "$target" "" "${pids[@]}"
        leader_sync "${target##*:}"
    else
        run_bench "$label" "$target" "$shards" "${pids[@]}"
        for p in "${ports[@]}"; do leader_sync "$p"; done
    fi
    worst_loop "$label" "${ports[@]}"
    if [ "$fsync" = true ]; then disk_sync "this disk"; fi
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    pids=()
done
done
