#!/usr/bin/env bash
# A three-member cluster against a single node, measured with `latchkey bench` in one run.
#
#   benches/cluster.sh BINARY [DURATION]
#
# For the single node and for a cluster with fsync on and off: start the server(s) on loopback
# (one core each; the cluster's three members and the load share this machine's CPUs), run the
# uncontended workload at pipeline 1 (one connection: the latency of one acquire+release after
# another) and at pipeline 16 (50 connections), and the contended workload (8 hot keys, 50
# connections, pipeline 1), and print requests/s and per-request latency percentiles; for the
# cluster also the leader's fsync (WAL sync) and commit latency from its /stats.
#
# The cluster has one shard, so that one member leads every key: `latchkey bench` sends all of
# its load to one address and does not follow redirects (M). The script finds the leader with a
# Q and benches it; its followers replicate every entry as in any cluster.
set -euo pipefail
binary=${1:?latchkey binary}
duration=${2:-5s}
dir=$(mktemp -d /tmp/latchkey-cluster-bench.XXXXXX)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done; rm -rf "$dir"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.05; done; echo "nothing on port $1" >&2; exit 1; }

# Prints the client port of the member that serves key "probe" (answers Q, not M).
find_leader() {
    python3 - "$@" <<'PY'
import socket, struct, sys, time
ports = [int(p) for p in sys.argv[1:]]
for _ in range(500):
    for port in ports:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=1)
            s.sendall(b"Q" + struct.pack(">Q", 1) + b"probe\n")
            if s.recv(64)[:1] == b"Q":
                print(port); sys.exit(0)
        except OSError:
            pass
    time.sleep(0.02)
sys.exit("no leader")
PY
}

run_bench() { # label port
    local label=$1 port=$2
    for spec in "uncontended 1 1" "uncontended 16 50" "contended 1 50"; do
        read -r workload pipeline connections <<<"$spec"
        json=$("$binary" bench --target "latchkey://127.0.0.1:$port" --workload "$workload" \
            --pipeline "$pipeline" --connections "$connections" --duration "$duration" \
            --warmup 1s --json)
        python3 - "$label" "$workload" "$pipeline" "$connections" "$json" <<'PY'
import json, sys
label, workload, pipeline, connections, text = sys.argv[1:]
r = json.loads(text)
l = r["latency_us"]
print(f"{label:<18} {workload:<12} p{pipeline:<3} c{connections:<3} {r['requests_per_sec']:>10,.0f} req/s"
      f"  latency p50 {l['p50']:>8.1f} us  p99 {l['p99']:>9.1f} us  ok={r['ok']}")
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
    print(f"{'':<18} leader {name[:-16]:<6} latency: {h['count']:>9,} samples  mean {mean:>8.1f} us"
          f"  p50 <= {p50:>8.0f} us  max {h['max'] * 1e6:>9.0f} us")
PY
}

port=$(free_port)
"$binary" serve --cores 1 --listen "127.0.0.1:$port" >/dev/null 2>&1 &
pids+=($!)
wait_port "$port"
run_bench "single node" "$port"
kill -TERM "${pids[0]}"; wait "${pids[0]}" 2>/dev/null || true
pids=()

for fsync in true false; do
    ports=(); peers=()
    for i in 1 2 3; do ports+=("$(free_port)"); peers+=("$(free_port)"); done
    members=""
    for i in 0 1 2; do
        members+="  { id = $((i + 1)), client = \"127.0.0.1:${ports[$i]}\", peer = \"127.0.0.1:${peers[$i]}\" },"$'\n'
    done
    for i in 1 2 3; do
        cat >"$dir/member-$i-$fsync.toml" <<TOML
[server]
cores = 1
[cluster]
node_id = $i
data_dir = "$dir/data-$i-$fsync"
shards = 1
fsync = $fsync
members = [
$members]
TOML
        "$binary" serve --config "$dir/member-$i-$fsync.toml" >/dev/null 2>&1 &
        pids+=($!)
    done
    leader=$(find_leader "${ports[@]}")
    run_bench "cluster fsync=$fsync" "$leader"
    leader_sync "$leader"
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    pids=()
done
