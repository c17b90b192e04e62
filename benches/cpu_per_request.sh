#!/usr/bin/env bash
# Server CPU per request of two latchkey builds, measured in one run, interleaved.
#
#   benches/cpu_per_request.sh OLD_BINARY NEW_BINARY [ROUNDS]
#
# For each round and each binary: start `BINARY serve --cores 1` pinned to CPU 0, run
# `NEW_BINARY bench --workload uncontended --pipeline 16` pinned to CPU 1 (same load generator
# for both), and read the server's user+sys CPU ticks from /proc/PID/stat just before and just
# after the bench; the bench runs without warm-up, so every request it counts falls in that
# window. Prints µs of server CPU per request per round and the medians. PIPELINE,
# CONNECTIONS, DURATION, WARMUP and WORKLOAD change a run; NEW_BENCH_ARGS adds arguments to
# the bench of NEW_BINARY's rounds only (e.g. `--identify`: the cost of identified sessions,
# docs/protocol.md §5, against an OLD_BINARY that knows none).
set -euo pipefail
old=${1:?old binary}
new=${2:?new binary}
rounds=${3:-5}
pipeline=${PIPELINE:-16}
connections=${CONNECTIONS:-50}
duration=${DURATION:-5s}
warmup=${WARMUP:-0s}
workload=${WORKLOAD:-uncontended}
ticks=$(getconf CLK_TCK)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# One measurement: prints "requests cpu_ticks".
measure() {
    local binary=$1 extra=$2 port
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    taskset -c 0 "$binary" serve --cores 1 --listen "127.0.0.1:$port" >/dev/null 2>&1 &
    local pid=$!
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        sleep 0.05
    done
    local before after json requests
    before=$(cpu_ticks "$pid")
    json=$(taskset -c 1 "$new" bench --target "latchkey://127.0.0.1:$port" --workload "$workload" \
        --pipeline "$pipeline" --connections "$connections" --duration "$duration" \
        --warmup "$warmup" --json $extra)
    after=$(cpu_ticks "$pid")
    kill -TERM "$pid"; wait "$pid" || true
    requests=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(sum(r["counts"].values()))' "$json")
    echo "$requests $((after - before))"
}

declare -a old_us new_us
for round in $(seq "$rounds"); do
    for which in old new; do
        binary=$old extra=""
        [ "$which" = new ] && binary=$new extra=${NEW_BENCH_ARGS:-}
        read -r requests cpu < <(measure "$binary" "$extra")
        us=$(python3 -c "print(f'{$cpu / $ticks * 1e6 / $requests:.3f}')")
        echo "round $round $which: $requests requests, $cpu ticks of server CPU, $us us/request"
        if [ "$which" = old ]; then old_us+=("$us"); else new_us+=("$us"); fi
    done
done
python3 - "${old_us[*]}" "${new_us[*]}" <<'EOF'
import statistics, sys
old = [float(x) for x in sys.argv[1].split()]
new = [float(x) for x in sys.argv[2].split()]
mo, mn = statistics.median(old), statistics.median(new)
print(f"median server CPU per request: old {mo:.3f} us, new {mn:.3f} us, new/old {mn/mo:.3f}")
print(f"spread: old {min(old):.3f}-{max(old):.3f} us, new {min(new):.3f}-{max(new):.3f} us")
EOF
