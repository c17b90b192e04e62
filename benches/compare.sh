#!/usr/bin/env bash
# latchkey vs Redis vs the frame echo baseline, on this machine, with `latchkey bench`.
#
# Starts a release latchkey (`serve --cores 1`), redis-server (no persistence) and the echo
# baseline (benches/echo.rs) on 127.0.0.1, pins the servers to one CPU and the load generator
# to another with taskset, runs the same workloads against each in alternation (latchkey,
# Redis, echo, then again, ROUNDS times) and prints a markdown table of the medians with the
# latchkey/Redis and latchkey/echo ratios. `hold` runs get a fresh server each (so the RSS
# reading starts from an empty one). Raw JSON lines go to $OUT/results.jsonl.
#
# Usage: benches/compare.sh            (about 5 minutes after the build)
# Environment (defaults in brackets):
#   ROUNDS [5]  DURATION [3s]  WARMUP [1s]  CONNECTIONS [50]  HOT_KEYS [8]
#   HOLD_KEYS [1000000]  HOLD_LEASE [5s, longer than the grant phase]  SKIP_HOLD [0]  SKIP_REDIS [0]
#   SERVER_CPU [0]  LOAD_CPU [1]  LATCHKEY_CORES [1]  REDIS_PORT [6390]  OUT [target/compare]
#   SCALE_CORES [2 with >= 4 CPUs, else 0 = skipped]  SCALE_SERVER_CPUS [0-(N-1)]
#   SCALE_LOAD_CPUS [N-(2N-1)]
# Scaling: with SCALE_CORES=N, each round also runs uncontended at pipeline 16 and 1 against a
# `--cores 1` server pinned to the first of SCALE_SERVER_CPUS and a `--cores N` server pinned to
# all of them, both driven by the same load (one thread per CPU of SCALE_LOAD_CPUS), and prints
# the N/1 ratio. Server and load CPUs must not overlap for the ratio to mean anything.
# A quick look: ROUNDS=1 DURATION=1s WARMUP=200ms HOLD_KEYS=20000 HOLD_LEASE=1s benches/compare.sh
#
# Redis is the Debian package: `apt-get install -y redis-server`. Without it the Redis column
# is skipped (with a message), not faked.
set -euo pipefail

ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-3s}
WARMUP=${WARMUP:-1s}
CONNECTIONS=${CONNECTIONS:-50}
HOT_KEYS=${HOT_KEYS:-8}
HOLD_KEYS=${HOLD_KEYS:-1000000}
HOLD_LEASE=${HOLD_LEASE:-5s}
SKIP_HOLD=${SKIP_HOLD:-0}
SKIP_REDIS=${SKIP_REDIS:-0}
SERVER_CPU=${SERVER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
LATCHKEY_CORES=${LATCHKEY_CORES:-1}
REDIS_PORT=${REDIS_PORT:-6390}
if [ "$(nproc)" -ge 4 ]; then SCALE_CORES=${SCALE_CORES:-2}; else SCALE_CORES=${SCALE_CORES:-0}; fi
SCALE_SERVER_CPUS=${SCALE_SERVER_CPUS:-0-$((SCALE_CORES - 1))}
SCALE_LOAD_CPUS=${SCALE_LOAD_CPUS:-$SCALE_CORES-$((2 * SCALE_CORES - 1))}

cd "$(dirname "$0")/.."
OUT=${OUT:-target/compare}
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: >"$RESULTS"

say() { printf '%s\n' "$*" >&2; }

PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT

# --- build -------------------------------------------------------------------------------
executable() { # name cargo-build-args... → path of the executable called name (or name-HASH)
    local name=$1
    shift
    cargo build --release "$@" --message-format=json 2>>"$OUT/build.log" |
        grep -o "\"executable\":\"[^\"]*/$name\(-[0-9a-f]*\)\{0,1\}\"" | tail -1 | cut -d'"' -f4
}
say "building (release)..."
: >"$OUT/build.log"
LATCHKEY=$(executable latchkey --bin latchkey)
ECHO=$(executable echo --bench echo)
if [ ! -x "$LATCHKEY" ] || [ ! -x "$ECHO" ]; then
    say "build failed: see $OUT/build.log"
    exit 2
fi

PIN_SERVER=()
PIN_LOAD=()
if command -v taskset >/dev/null && [ "$(nproc)" -ge 2 ]; then
    PIN_SERVER=(taskset -c "$SERVER_CPU")
    PIN_LOAD=(taskset -c "$LOAD_CPU")
else
    say "warning: taskset or a second CPU is missing: servers and load are NOT pinned"
fi

REDIS=1
if [ "$SKIP_REDIS" = 1 ]; then
    REDIS=0
    say "SKIP_REDIS=1: Redis skipped"
elif ! command -v redis-server >/dev/null; then
    REDIS=0
    say "redis-server not found: Redis is SKIPPED."
    say "  Install it (Debian package) with: apt-get install -y redis-server"
fi

# --- servers -----------------------------------------------------------------------------
SERVER_PID=
SERVER_ADDR=
start_listening() { # name command... : a server that prints "listening on ADDR" first
    local name=$1
    shift
    "${PIN_SERVER[@]}" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err" &
    SERVER_PID=$!
    PIDS+=("$SERVER_PID")
    local tries=0
    until SERVER_ADDR=$(sed -n 's/^listening on //p' "$OUT/$name.out") && [ -n "$SERVER_ADDR" ]; do
        tries=$((tries + 1))
        if [ $tries -gt 100 ] || ! kill -0 "$SERVER_PID" 2>/dev/null; then
            say "$name did not start: see $OUT/$name.err"
            exit 2
        fi
        sleep 0.05
    done
}
start_redis() {
    if (exec 3<>"/dev/tcp/127.0.0.1/$REDIS_PORT") 2>/dev/null; then
        say "port $REDIS_PORT is already in use: stop that server or set REDIS_PORT"
        exit 2
    fi
    "${PIN_SERVER[@]}" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' \
        --appendonly no --daemonize no >"$OUT/redis.log" 2>&1 &
    SERVER_PID=$!
    PIDS+=("$SERVER_PID")
    SERVER_ADDR=127.0.0.1:$REDIS_PORT
    local tries=0
    until (exec 3<>"/dev/tcp/127.0.0.1/$REDIS_PORT") 2>/dev/null; do
        tries=$((tries + 1))
        if [ $tries -gt 100 ] || ! kill -0 "$SERVER_PID" 2>/dev/null; then
            say "redis-server did not start on port $REDIS_PORT: see $OUT/redis.log"
            exit 2
        fi
        sleep 0.05
    done
}
stop_server() { # pid
    kill "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
}
start_latchkey() { start_listening latchkey "$LATCHKEY" serve --listen 127.0.0.1:0 --cores "$LATCHKEY_CORES"; }
start_scaled() { # cores cpus: a latchkey for the scaling runs, pinned to cpus
    local cores=$1 cpus=$2
    PIN_SERVER=(taskset -c "$cpus")
    start_listening "latchkey-cores$cores" "$LATCHKEY" serve --listen 127.0.0.1:0 --cores "$cores"
    PIN_SERVER=(taskset -c "$SERVER_CPU")
}
start_echo() { start_listening echo "$ECHO" --listen 127.0.0.1:0; }

# --- runs --------------------------------------------------------------------------------
FAILED=0
run() { # label target flags... → appends "label<TAB>json" to $RESULTS
    local label=$1 target=$2
    shift 2
    local json
    if ! json=$("${PIN_LOAD[@]}" "$LATCHKEY" bench --target "$target" --json \
        --connections "$CONNECTIONS" "$@" 2>>"$OUT/bench.err"); then
        FAILED=1
        say "  $label: UNEXPECTED errors or a failed run (see $OUT/bench.err)"
    fi
    if [ -n "$json" ]; then
        printf '%s\t%s\n' "$label" "$json" >>"$RESULTS"
    fi
    say "  $label $(printf '%s' "$json" | grep -o '"requests_per_sec":[0-9.]*' || echo failed)"
}

TIMED=(--duration "$DURATION" --warmup "$WARMUP")
CONFIGS=(
    "u16|--workload uncontended --pipeline 16"
    "u1|--workload uncontended --pipeline 1"
    "c8|--workload contended --pipeline 16 --hot-keys $HOT_KEYS"
)
HOLD=(--workload hold --pipeline 16 --keys "$HOLD_KEYS" --lease "$HOLD_LEASE")

cpu_list() { # "0-2,5" → "0 1 2 5"
    local part
    for part in ${1//,/ }; do
        if [[ $part == *-* ]]; then seq "${part%-*}" "${part#*-}"; else echo "$part"; fi
    done
}
SCALE=0
shared_cpus=
if [ "$SCALE_CORES" -gt 1 ] && [ ${#PIN_SERVER[@]} -gt 0 ]; then
    SCALE=1
    shared_cpus=$(comm -12 <(cpu_list "$SCALE_SERVER_CPUS" | sort) <(cpu_list "$SCALE_LOAD_CPUS" | sort) |
        tr '\n' ' ')
    if [ -n "$shared_cpus" ]; then
        say "warning: scaling servers and load share CPUs $shared_cpus: the scaling ratio measures"
        say "  that competition, not the server"
    fi
    start_scaled 1 "${SCALE_SERVER_CPUS%%[-,]*}"
    S1_ADDR=$SERVER_ADDR
    start_scaled "$SCALE_CORES" "$SCALE_SERVER_CPUS"
    SN_ADDR=$SERVER_ADDR
elif [ "$SCALE_CORES" -gt 1 ]; then
    say "scaling skipped: it needs taskset and separate CPUs for the servers and the load"
else
    say "scaling skipped: set SCALE_CORES=N (it needs 2N CPUs: N for the servers, N for the load)"
fi
start_latchkey
L_PID=$SERVER_PID L_ADDR=$SERVER_ADDR
start_echo
E_PID=$SERVER_PID E_ADDR=$SERVER_ADDR
if [ $REDIS = 1 ]; then
    start_redis
    R_PID=$SERVER_PID R_ADDR=$SERVER_ADDR
fi

for round in $(seq 1 "$ROUNDS"); do
    say "round $round of $ROUNDS"
    for config in "${CONFIGS[@]}"; do
        name=${config%%|*}
        read -r -a flags <<<"${config#*|}"
        run "$name latchkey" "latchkey://$L_ADDR" "${flags[@]}" "${TIMED[@]}"
        if [ $REDIS = 1 ]; then
            run "$name redis" "redis://$R_ADDR" "${flags[@]}" "${TIMED[@]}"
        fi
        if [ "$name" != c8 ]; then # the echo keeps no locks: contention means nothing to it
            run "$name echo" "latchkey://$E_ADDR" "${flags[@]}" "${TIMED[@]}"
        fi
    done
    if [ $SCALE = 1 ]; then
        saved_pin=("${PIN_LOAD[@]}")
        PIN_LOAD=(taskset -c "$SCALE_LOAD_CPUS")
        for config in "s16|--pipeline 16" "s1|--pipeline 1"; do
            name=${config%%|*}
            read -r -a flags <<<"${config#*|}"
            run "$name cores1" "latchkey://$S1_ADDR" --workload uncontended "${flags[@]}" "${TIMED[@]}"
            run "$name coresN" "latchkey://$SN_ADDR" --workload uncontended "${flags[@]}" "${TIMED[@]}"
        done
        PIN_LOAD=("${saved_pin[@]}")
    fi
    if [ "$SKIP_HOLD" != 1 ]; then
        start_latchkey
        run "hold latchkey" "latchkey://$SERVER_ADDR" "${HOLD[@]}" --server-pid "$SERVER_PID"
        stop_server "$SERVER_PID"
        if [ $REDIS = 1 ]; then
            stop_server "$R_PID"
            start_redis
            R_PID=$SERVER_PID
            run "hold redis" "redis://$R_ADDR" "${HOLD[@]}" --server-pid "$R_PID"
        fi
    fi
done
stop_server "$L_PID"
stop_server "$E_PID"

# --- table -------------------------------------------------------------------------------
# value label path: path is "field" or "object.field" of the JSON line; non-numbers skipped.
values() {
    local label=$1 path=$2 object field
    if [[ $path == *.* ]]; then object=${path%%.*} field=${path#*.}; else object='' field=$path; fi
    { grep -F "$label"$'\t' "$RESULTS" || true; } | cut -f2 | while read -r json; do
        if [ -n "$object" ]; then
            json=$(printf '%s' "$json" | grep -o "\"$object\":{[^}]*}" || true)
        fi
        printf '%s' "$json" | { grep -o "\"$field\":-\{0,1\}[0-9][0-9.]*" || true; } |
            head -1 | cut -d: -f2
    done
}
median() { # label path → median, or "-"
    values "$1" "$2" | sort -g | awk '{v[NR]=$1} END {
        if (NR == 0) { print "-"; exit }
        if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2] + v[NR/2+1]) / 2 }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "-" || b == "-" || b == 0) print "-";
    else printf "%.2f", a / b }'; }
fmt() { awk -v v="$1" 'BEGIN { if (v == "-") print "-"; else if (v >= 1000) printf "%.0f", v;
    else if (v >= 10) printf "%.1f", v; else printf "%.2f", v }'; }
spread() { # label path → "min–max", or "-"
    values "$1" "$2" | sort -g | awk '{v[NR]=$1} END {
        if (NR == 0) { print "-"; exit }
        f = (v[NR] >= 1000) ? "%.0f" : (v[NR] >= 10 ? "%.1f" : "%.2f")
        printf f "-" f "\n", v[1], v[NR] }'
}
spread_row() { # workload metric label-prefix path
    printf '| %s | %s | %s | %s | %s |\n' "$1" "$2" "$(spread "$3 latchkey" "$4")" \
        "$(spread "$3 redis" "$4")" "$(spread "$3 echo" "$4")"
}
row() { # workload metric label-prefix path
    local l r e
    l=$(median "$3 latchkey" "$4")
    r=$(median "$3 redis" "$4")
    e=$(median "$3 echo" "$4")
    printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$1" "$2" "$(fmt "$l")" "$(fmt "$r")" \
        "$(fmt "$e")" "$(ratio "$l" "$r")" "$(ratio "$l" "$e")"
}

echo
echo "latchkey bench, medians of $ROUNDS interleaved rounds; servers on CPU $SERVER_CPU, load on CPU $LOAD_CPU;"
echo "$CONNECTIONS connections, $DURATION measured after $WARMUP warm-up; latchkey --cores $LATCHKEY_CORES;"
echo "$(nproc) CPUs, $(uname -r). Redis: $( [ $REDIS = 1 ] && redis-server --version | cut -d' ' -f3 || echo skipped)."
echo
ROWS=(
    "uncontended, pipeline 16|requests/s|u16|requests_per_sec"
    "uncontended, pipeline 16|p99 latency us|u16|latency_us.p99"
    "uncontended, pipeline 1|requests/s|u1|requests_per_sec"
    "uncontended, pipeline 1|p99 latency us|u1|latency_us.p99"
    "contended, $HOT_KEYS hot keys|cycles/s|c8|cycles_per_sec"
    "contended, $HOT_KEYS hot keys|handoff p99 us|c8|handoff_latency_us.p99"
    "contended, $HOT_KEYS hot keys|fairness max/min grants|c8|fairness.max_over_min"
)
if [ "$SKIP_HOLD" != 1 ]; then
    ROWS+=(
        "hold, $HOLD_KEYS leases|RSS bytes per lock|hold|rss_bytes_per_lock"
        "hold, $HOLD_KEYS leases|expiry lateness p99 us|hold|expiry_lateness_us.p99"
    )
fi
echo "| workload | metric | latchkey | Redis | echo | latchkey/Redis | latchkey/echo |"
echo "|---|---|---|---|---|---|---|"
for spec in "${ROWS[@]}"; do
    IFS='|' read -r workload metric label path <<<"$spec"
    row "$workload" "$metric" "$label" "$path"
done
if [ $SCALE = 1 ]; then
    echo
    echo "Scaling: servers on CPUs $SCALE_SERVER_CPUS (--cores 1 on the first), load on CPUs $SCALE_LOAD_CPUS."
    if [ -n "$shared_cpus" ]; then
        echo "Servers and load SHARE CPUs $shared_cpus: the ratio measures that competition, not scaling."
    fi
    echo
    echo "| workload | metric | --cores 1 | --cores $SCALE_CORES | ratio |"
    echo "|---|---|---|---|---|"
    for spec in "uncontended, pipeline 16|s16" "uncontended, pipeline 1|s1"; do
        IFS='|' read -r workload label <<<"$spec"
        one=$(median "$label cores1" requests_per_sec)
        many=$(median "$label coresN" requests_per_sec)
        printf '| %s | requests/s | %s | %s | %s |\n' "$workload" "$(fmt "$one")" "$(fmt "$many")" \
            "$(ratio "$many" "$one")"
    done
fi
echo
echo "Spread across the rounds (min-max): a wide one means the machine was busy; rerun with more"
echo "ROUNDS before trusting a ratio."
echo
echo "| workload | metric | latchkey | Redis | echo |"
echo "|---|---|---|---|---|"
for spec in "${ROWS[@]}"; do
    IFS='|' read -r workload metric label path <<<"$spec"
    spread_row "$workload" "$metric" "$label" "$path"
done
echo
echo "Latency, handoff, fairness, RSS and lateness: lower is better. Redis has no wait queue:"
echo "in contended and hold a failed SET NX is retried every 1 ms, as typical clients do."
echo "Raw results: $RESULTS"
if [ $FAILED = 1 ]; then
    say "SOME RUNS REPORTED UNEXPECTED ERRORS: see $OUT/bench.err and the \"errors\" fields."
    exit 1
fi
