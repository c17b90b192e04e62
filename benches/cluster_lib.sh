# Helpers of the cluster benchmark scripts (`cluster.sh`, `cluster_ab.sh`); sourced, not run.
# `disk_sync` measures where `$dir` is.

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.05; done; echo "nothing on port $1" >&2; return 1; }

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

# Waits until each of 512 probe keys is served (answers Q) by some member: every shard that
# the probes hash to has a leader.
wait_all_led() {
    python3 - "$@" <<'PY'
import socket, struct, sys, time
ports = [int(p) for p in sys.argv[1:]]
conns = {}
def served(key, nonce):
    for port in ports:
        try:
            s = conns.get(port) or socket.create_connection(("127.0.0.1", port), timeout=1)
            conns[port] = s
            s.sendall(b"Q" + struct.pack(">Q", nonce) + key + b"\n")
            answer = s.recv(64)
            if answer[:1] == b"Q":
                return True
        except OSError:
            conns.pop(port, None)
    return False
pending = [f"probe/{n}".encode() for n in range(512)]
deadline = time.time() + 60
while pending and time.time() < deadline:
    pending = [k for i, k in enumerate(pending) if not served(k, i + 1)]
    if pending:
        time.sleep(0.05)
if pending:
    sys.exit(f"{len(pending)} probe keys still without a leader")
PY
}

# Prints the `bench --target` address list for a three-member cluster of SHARDS shards: with
# one shard, the member that leads it (listing every member would cost each new key of the
# uncontended workload a redirect); with several, all three, once every probe key has a leader
# (the bench then sends each request to its key's leader, with `--shards`).
cluster_target() { # shards ports...
    local shards=$1
    shift
    if [ "$shards" = 1 ]; then
        echo "127.0.0.1:$(find_leader "$@")"
    else
        wait_all_led "$@"
        echo "127.0.0.1:$1,127.0.0.1:$2,127.0.0.1:$3"
    fi
}

# The user+sys CPU ticks of the given processes, summed.
cpu_ticks() {
    local total=0 pid fields
    for pid in "$@"; do
        read -r -a fields <<<"$(sed 's/.*) //' "/proc/$pid/stat")"
        total=$((total + fields[11] + fields[12]))
    done
    echo "$total"
}

# How this machine's idle CPUs wake (printed once by the scripts beside their figures): a CPU
# that halts as soon as it is idle takes tens of microseconds to wake, which every sleep and
# wake-up on a replicated request's path pays (docs/operations.md, Latency tuning).
idle_note() {
    local driver poll=""
    driver=$(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none)
    [ -r /sys/module/haltpoll/parameters/guest_halt_poll_ns ] &&
        poll=", guest_halt_poll_ns $(cat /sys/module/haltpoll/parameters/guest_halt_poll_ns)"
    echo "idle CPUs: cpuidle driver ${driver}${poll}"
}

# The disk's own fdatasync latency where the data directories live (the physics a replicated
# request cannot beat), measured with nothing of latchkey in the way.
disk_sync() { # label
    python3 - "$dir" "$1" <<'PY'
import os, statistics, sys, time
path = os.path.join(sys.argv[1], "fdatasync-probe")
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
block, times = b"x" * 4096, []
for i in range(300):
    os.pwrite(fd, block, (i % 64) * 4096)
    start = time.perf_counter()
    os.fdatasync(fd)
    times.append((time.perf_counter() - start) * 1e6)
os.close(fd)
os.unlink(path)
times.sort()
print(f"{sys.argv[2]:<24} disk fdatasync (4 KiB): p50 {times[150]:>7.0f} us  p99 {times[296]:>7.0f} us"
      f"  mean {statistics.mean(times):>7.0f} us")
PY
}


# Makes a CA and the peer certificates of members 1 to 3 (`member-N.crt`, `member-N.key`, naming
# member-N, for both TLS uses) in PKI_DIR, with openssl, as docs/cluster.md's "Peer TLS" does.
peer_pki() { # pki_dir
    local pki=$1 n
    mkdir -p "$pki"
    openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
        -keyout "$pki/ca.key" -out "$pki/ca.crt" -days 30 -subj "/CN=latchkey bench CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    for n in 1 2 3; do
        openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
            -keyout "$pki/member-$n.key" -out "$pki/member-$n.csr" \
            -subj "/CN=latchkey member $n" 2>/dev/null
        printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" \
            "subjectAltName=DNS:member-$n" "extendedKeyUsage=serverAuth,clientAuth" \
            >"$pki/member-$n.ext"
        openssl x509 -req -in "$pki/member-$n.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
            -CAcreateserial -days 30 -extfile "$pki/member-$n.ext" \
            -out "$pki/member-$n.crt" 2>/dev/null
    done
}

# Starts three members of BINARY, one core each, with SHARDS shards and fsync FSYNC, on fresh
# loopback ports; their configs, data and logs are under "$dir/TAG-*". With PKI_DIR (made by
# `peer_pki`), every member has `[cluster.tls]`. Sets `members_ports` (their client ports,
# members 1, 2, 3) and `members_pids`, and appends the pids to `pids`.
start_three() { # binary tag shards fsync [pki_dir]
    local binary=$1 tag=$2 shards=$3 fsync=$4 pki=${5:-} members="" i peer_ports=() tls
    members_ports=()
    members_pids=()
    for i in 1 2 3; do members_ports+=("$(free_port)"); peer_ports+=("$(free_port)"); done
    for i in 0 1 2; do
        members+="  { id = $((i + 1)), client = \"127.0.0.1:${members_ports[$i]}\", peer = \"127.0.0.1:${peer_ports[$i]}\" },"$'\n'
    done
    for i in 1 2 3; do
        tls=""
        [ -z "$pki" ] || tls="[cluster.tls]
cert_file = \"$pki/member-$i.crt\"
key_file = \"$pki/member-$i.key\"
ca_file = \"$pki/ca.crt\""
        cat >"$dir/$tag-$i.toml" <<TOML
[server]
cores = 1
[cluster]
node_id = $i
data_dir = "$dir/$tag-data-$i"
shards = $shards
fsync = $fsync
members = [
$members]
$tls
TOML
        "$binary" serve --config "$dir/$tag-$i.toml" >"$dir/$tag-$i.log" 2>&1 &
        members_pids+=($!)
        pids+=($!)
    done
}
