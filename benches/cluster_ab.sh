#!/usr/bin/env bash
# Two or more builds of a three-member cluster, interleaved, to compare them in one run.
#
#   benches/cluster_ab.sh ROUNDS BINARY...
#
# A BINARY written PATH+tls is PATH with peer TLS: every member gets `[cluster.tls]`, with
# certificates made once per run by openssl (`peer_pki`), so that
# `benches/cluster_ab.sh 5 target/release/latchkey target/release/latchkey+tls` measures what
# peer TLS costs, interleaved.
#
# Each round, for fsync on then off, for each binary in turn: start a fresh three-member
# cluster (one core each, one shard unless SHARDS says, on loopback, data in a fresh
# directory), find the leader, measure pipeline-1 latency (`bench --workload uncontended
# --pipeline 1 --connections 1`, 3 s after 1 s of warm-up) and then server CPU per request at
# pipeline 16 over 50 connections
# (user+sys of the three members from /proc/PID/stat around a 3 s run, summed), and stop it.
# The CPU line also gives the busiest member's share (its own user+sys per request): on three
# machines, the member that would run out of CPU first. Each round ends with the disk's own
# 4 KiB `fdatasync` p50 where the data directories live.
# Interleaving keeps the machine's drift (other tenants, the disk) out of the comparison; quote
# medians over the rounds.
#
# SHARDS=N runs N shards per cluster instead of one: the script waits until every probe key has
# a leader and benches all three members (`--target a,b,c --shards N`, each request to its
# key's leader). LOAD_BINARY=PATH runs every load (`bench`) with that build, so that only the
# servers differ (e.g. when the builds differ in their allocator). PIPELINE=N runs the CPU
# measurement at pipeline N instead of 16 (with several shards each connection becomes one
# socket per member, each carrying about N/3 of its requests), CONNECTIONS=N over N
# connections instead of 50. FSYNCS="true" (or "false") runs one fsync setting instead of both.
set -euo pipefail
rounds=${1:?rounds}
shift
[ $# -ge 1 ] || { echo "usage: $0 ROUNDS BINARY..." >&2; exit 2; }
dir=$(mktemp -d /tmp/latchkey-cluster-ab.XXXXXX)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done; rm -rf "$dir"; }
trap cleanup EXIT
# shellcheck source=benches/cluster_lib.sh
source "$(dirname "$0")/cluster_lib.sh"
hz=$(getconf CLK_TCK)

shards=${SHARDS:-1}
pipeline=${PIPELINE:-16}
connections=${CONNECTIONS:-50}
fsyncs=${FSYNCS:-true false}

start_cluster() { # binary fsync [pki_dir] -> sets pids, ports
    rm -rf "$dir"/run-*
    pids=()
    start_three "$1" run "$shards" "$2" "${3:-}"
    ports=("${members_ports[@]}")
    local i
    for i in 0 1 2; do
        wait_port "${ports[$i]}" || { tail -n 5 "$dir"/run-*.log >&2; exit 1; }
    done
}

idle_note
for argument in "$@"; do
    case $argument in *+tls) peer_pki "$dir/pki"; break ;; esac
done
for round in $(seq "$rounds"); do
    for fsync in $fsyncs; do
        for argument in "$@"; do
            binary=${argument%+tls}
            pki=""
            [ "$binary" = "$argument" ] || pki="$dir/pki"
            start_cluster "$binary" "$fsync" "$pki"
            load=${LOAD_BINARY:-$binary}
            target=$(cluster_target "$shards" "${ports[@]}")
            routing=()
            [ "$shards" = 1 ] || routing=(--shards "$shards")
            p1=$("$load" bench --target "latchkey://$target" --workload uncontended \
                --pipeline 1 --connections 1 --hot-keys 8 --duration 3s --warmup 1s \
                "${routing[@]}" --json)
            before=()
            for pid in "${pids[@]}"; do before+=("$(cpu_ticks "$pid")"); done
            p16=$("$load" bench --target "latchkey://$target" --workload uncontended \
                --pipeline "$pipeline" --connections "$connections" --hot-keys 8 --duration 3s \
                --warmup 0s "${routing[@]}" --json)
            ticks=()
            for i in "${!pids[@]}"; do ticks+=("$(($(cpu_ticks "${pids[$i]}") - before[i]))"); done
            python3 - "$round" "$fsync" "$argument" "$p1" "$p16" "$hz" "$pipeline" "${ticks[@]}" <<'PY'
import json, sys
round_, fsync, binary, p1, p16, hz, pipeline = sys.argv[1:8]
ticks = [int(t) for t in sys.argv[8:]]
p1, p16 = json.loads(p1), json.loads(p16)
assert p1["ok"] and p16["ok"], "a bench run was not clean"
per_request = lambda t: t * 1e6 / int(hz) / p16["requests"]
print(f"round {round_} fsync={fsync:<5} {binary}: p1 p50 {p1['latency_us']['p50']:7.1f} us"
      f"  p{pipeline} {p16['requests_per_sec']:>9,.0f} req/s  server CPU"
      f" {per_request(sum(ticks)):5.2f} us/request (busiest member {per_request(max(ticks)):5.2f})")
PY
            { for pid in "${pids[@]}"; do kill -9 "$pid" && wait "$pid"; done; } 2>/dev/null || true
            pids=()
        done
    done
    disk_sync "round $round"
done
