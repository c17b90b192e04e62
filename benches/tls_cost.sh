#!/usr/bin/env bash
# What TLS costs: plaintext, TLS, and TLS with client certificates and a prefix rule, measured in
# one run, interleaved, with the same binary.
#
#   benches/tls_cost.sh BINARY [ROUNDS]
#
# Makes a test CA, a server certificate (IP SAN 127.0.0.1) and a client certificate with the
# openssl recipe of the README (Security) in a temporary directory. For each round, each
# pipeline depth (1 and 16) and each mode: starts `BINARY serve --cores 1` pinned to CPU 0 with
# that mode's config, runs `BINARY bench --workload uncontended` pinned to CPU 1 against it
# (latchkey:// or latchkeys://), and reads the server's user+sys CPU ticks from /proc/PID/stat
# just before and just after the bench (no warm-up, so every request counted falls in that
# window; the TLS handshakes happen before the measured period and are in the CPU figure,
# 50 of them). Prints requests/s and µs of server CPU per request per run, then the medians
# and the ratios to plaintext. CONNECTIONS, DURATION and PIPELINES change a run.
set -euo pipefail
binary=$(realpath "${1:?binary}")
rounds=${2:-5}
connections=${CONNECTIONS:-50}
duration=${DURATION:-5s}
pipelines=${PIPELINES:-1 16}
ticks=$(getconf CLK_TCK)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# ----- certificates: the README's recipe ------------------------------------------------------
(
    cd "$dir"
    openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
        -keyout ca.key -out ca.crt -days 3650 -subj "/CN=latchkey test CA" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
    sign() {
        openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
            -keyout "$1.key" -out "$1.csr" -subj "$2"
        printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" \
            "$3" >"$1.ext"
        openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
            -extfile "$1.ext" -out "$1.crt"
        rm "$1.csr" "$1.ext"
    }
    sign server "/CN=latchkey" "subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
    sign bench "/CN=bench" "extendedKeyUsage=clientAuth"
) >/dev/null 2>&1

printf '' >"$dir/plain.toml"
cat >"$dir/tls.toml" <<EOF
[tls]
cert_file = "$dir/server.crt"
key_file = "$dir/server.key"
EOF
cat >"$dir/mtls.toml" <<EOF
[tls]
cert_file = "$dir/server.crt"
key_file = "$dir/server.key"
client_ca_file = "$dir/ca.crt"

[[auth.rule]]
identity = "bench"
prefixes = [""]
EOF

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# One measurement: prints "requests cpu_ticks requests_per_s".
measure() {
    local mode=$1 pipeline=$2 port pid before after json
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    taskset -c 0 "$binary" serve --config "$dir/$mode.toml" --cores 1 \
        --listen "127.0.0.1:$port" >/dev/null 2>&1 &
    pid=$!
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        sleep 0.05
    done
    local target=(--target "latchkey://127.0.0.1:$port")
    case $mode in
    tls) target=(--target "latchkeys://127.0.0.1:$port" --tls-ca "$dir/ca.crt") ;;
    mtls) target=(--target "latchkeys://127.0.0.1:$port" --tls-ca "$dir/ca.crt"
        --tls-cert "$dir/bench.crt" --tls-key "$dir/bench.key") ;;
    esac
    before=$(cpu_ticks "$pid")
    json=$(taskset -c 1 "$binary" bench "${target[@]}" --workload uncontended \
        --pipeline "$pipeline" --connections "$connections" --duration "$duration" \
        --warmup 0s --json)
    after=$(cpu_ticks "$pid")
    kill -TERM "$pid"
    wait "$pid" || true
    python3 -c 'import json,sys; r=json.loads(sys.argv[1]); n=sum(r["counts"].values()); print(n, sys.argv[2], r["requests_per_sec"])' \
        "$json" "$((after - before))"
}

results="$dir/results"
for round in $(seq "$rounds"); do
    for pipeline in $pipelines; do
        for mode in plain tls mtls; do
            read -r requests cpu rate < <(measure "$mode" "$pipeline")
            us=$(python3 -c "print(f'{$cpu / $ticks * 1e6 / $requests:.3f}')")
            printf 'round %s pipeline %s %-5s %9d requests %10.0f req/s %6s us CPU/request\n' \
                "$round" "$pipeline" "$mode" "$requests" "$rate" "$us"
            echo "$pipeline $mode $rate $us" >>"$results"
        done
    done
done
python3 - "$results" <<'EOF'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
print("medians (ratio to plain in the same run):")
for pipeline in sorted({r[0] for r in rows}, key=int):
    med = {}
    for mode in ("plain", "tls", "mtls"):
        sel = [r for r in rows if r[0] == pipeline and r[1] == mode]
        med[mode] = (statistics.median(float(r[2]) for r in sel),
                     statistics.median(float(r[3]) for r in sel))
    base_rate, base_cpu = med["plain"]
    for mode, (rate, cpu) in med.items():
        print(f"pipeline {pipeline:>2} {mode:<5} {rate:10.0f} req/s (x{rate / base_rate:.3f})"
              f"  {cpu:.3f} us CPU/request (x{cpu / base_cpu:.3f})")
EOF
