#!/usr/bin/env python3
"""Faults a three-member cluster under lock traffic and counts what reached the callers.

    python3 benches/failover.py BINARY [--shards N] [--holders N] [--callers N] [--lease S]
                                       [--stall S] [--fsync true|false] [--members 1,2,3]
                                       [--client-binary CLIENT_BINARY]

Starts three members of BINARY (one core each, fresh data directories on this machine), then:

* HOLDERS processes `latchkey lock --lease LEASE holders/i -- sleep ...`, which extend their
  lease every lease/3 for the whole run (keys spread over the shards);
* CALLERS threads, each looping `latchkey lock --wait 8s --lease LEASE calls/k -- true` on 4
  contended keys.

For each member in turn (MEMBERS): SIGSTOP for STALL seconds, SIGCONT, 3 s to settle; then
kill -9, 2 s down, restart, 3 s to settle. Meanwhile a prober measures failover: from each
fault to the first moment every probe key is served (answers `Q`) by a member that is up.

Before each fault, on a key the member about to fail leads: a `latchkey lock` holder with a
waiter queued behind it (`latchkey lock --wait 30s`), the holder told to let go (SIGTERM) at the
fault — so the waiter's grant must come from the new leader — and a holder of the Python client
(clients/python, from this checkout) extending a 3 s lease every 0.2 s. Per fault: the time from
the fault to the waiter's grant, and to the first extend confirmed after it (p50, max).

Printed at the end: the callers' exit codes (0 done, 80 timeout, 81 busy, 82 indeterminate,
83 unavailable, other), holders that lost their lock (exit 85) or ended otherwise, failover
times (p50, max), and ghost holds — keys still held once every client has exited and released
(a grant nobody knows of). With the disk's fdatasync p50 beside them. Loopback only; bounded in
time (about 15 s per member plus the start).
"""

import argparse
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(port, key, nonce=1, timeout=0.5):
    """The `Q` answer of the member on `port` for `key`: (held, waiters), or None (M, down)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"Q" + struct.pack(">Q", nonce) + key.encode() + b"\n")
            answer = b""
            while len(answer) < 19 and answer[:1] in (b"", b"Q"):
                chunk = s.recv(64)
                if not chunk:
                    return None
                answer += chunk
                if answer[:1] != b"Q":
                    return None
            held, _lease, waiters = struct.unpack(">BII", answer[9:18])
            return bool(held), waiters
    except OSError:
        return None


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python", "src"))


def key_led_by(cluster, member, prefix):
    """A key whose shard `member` leads now (only the leader answers `Q`), or None."""
    for n in range(4096):
        key = f"{prefix}/{n}"
        if cluster.served(key) == member:
            return key
    return None


class Watch:
    """The two measurements around one fault on a key `member` leads (see the module docs)."""

    def __init__(self, cluster, member, client_binary, env, tag):
        import latchkey  # the Python client of this checkout

        self.ok = False
        wait_key = key_led_by(cluster, member, f"wait-{tag}")
        extend_key = key_led_by(cluster, member, f"extend-{tag}")
        if wait_key is None or extend_key is None:
            print(f"  ({tag}: no key led by m{member + 1} found; not measured)")
            return
        self.holder = subprocess.Popen(
            [client_binary, "lock", "--lease", "3s", "--wait", "5s", wait_key, "--", "sleep",
             "600"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = cluster.clients[member]
        deadline = time.time() + 10
        while time.time() < deadline and (query(port, wait_key) or (False, 0))[0] is not True:
            time.sleep(0.01)
        self.waiter = subprocess.Popen(
            [client_binary, "lock", "--wait", "30s", "--lease", "3s", wait_key, "--",
             sys.executable, "-c", "import time; print(repr(time.time()))"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while time.time() < deadline and (query(port, wait_key) or (False, 0))[1] != 1:
            time.sleep(0.01)
        self.client = latchkey.Client(env["LATCHKEY_SERVER"])
        self.ticket = self.client.acquire(extend_key, wait=5, lease=3)
        self.extends = []  # (answered at, confirmed)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.extend_loop)
        self.thread.start()
        self.ok = time.time() < deadline

    def extend_loop(self):
        while not self.stop.is_set():
            try:
                confirmed = self.ticket.extend(3)
            except Exception:  # noqa: BLE001 - an unanswered extend is a measurement too
                confirmed = False
            self.extends.append((time.time(), confirmed))
            self.stop.wait(0.2)

    def fault(self):
        """At the fault: the holder lets go (its release must reach the new leader)."""
        if self.ok:
            self.holder.send_signal(signal.SIGTERM)

    def finish(self, fault_at):
        """(seconds to the waiter's grant, seconds to the first confirmed extend), None for
        either not seen within 30 s."""
        if not self.ok:
            return None, None
        granted = None
        try:
            out, _ = self.waiter.communicate(timeout=30)
            granted = float(out.strip()) - fault_at if out.strip() else None
        except (subprocess.TimeoutExpired, ValueError):
            self.waiter.kill()
        self.holder.wait()
        deadline = time.time() + 30
        first = None
        while first is None and time.time() < deadline:
            first = next((at for at, confirmed in list(self.extends)
                          if confirmed and at > fault_at), None)
            time.sleep(0.05)
        self.stop.set()
        self.thread.join()
        try:
            self.ticket.release()
        except Exception:  # noqa: BLE001 - released or lost: the measurement is taken
            pass
        self.client.close()
        return granted, (first - fault_at if first is not None else None)


def disk_sync_p50(directory):
    path = os.path.join(directory, "fdatasync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    times = []
    for i in range(200):
        os.pwrite(fd, b"x" * 4096, (i % 64) * 4096)
        start = time.perf_counter()
        os.fdatasync(fd)
        times.append((time.perf_counter() - start) * 1e6)
    os.close(fd)
    os.unlink(path)
    return statistics.median(times)


class Cluster:
    def __init__(self, binary, directory, shards, fsync):
        self.binary, self.dir = binary, directory
        self.clients = [free_port() for _ in range(3)]
        peers = [free_port() for _ in range(3)]
        members = "".join(
            f'  {{ id = {i + 1}, client = "127.0.0.1:{self.clients[i]}", '
            f'peer = "127.0.0.1:{peers[i]}" }},\n'
            for i in range(3)
        )
        self.configs = []
        for i in range(3):
            path = os.path.join(directory, f"member-{i + 1}.toml")
            with open(path, "w") as f:
                f.write(
                    f"[server]\ncores = 1\n[cluster]\nnode_id = {i + 1}\n"
                    f'data_dir = "{directory}/data-{i + 1}"\nshards = {shards}\n'
                    f"fsync = {fsync}\nmembers = [\n{members}]\n"
                )
            self.configs.append(path)
        self.processes = [None, None, None]
        for i in range(3):
            self.launch(i)

    def launch(self, i):
        log = open(os.path.join(self.dir, f"member-{i + 1}.log"), "a")
        self.processes[i] = subprocess.Popen(
            [self.binary, "serve", "--config", self.configs[i]], stdout=log, stderr=log
        )

    def servers(self):
        return ",".join(f"127.0.0.1:{port}" for port in self.clients)

    def served(self, key, skip=()):
        for i, port in enumerate(self.clients):
            if i in skip or self.processes[i] is None:
                continue
            if query(port, key) is not None:
                return i
        return None

    def stop_all(self):
        for process in self.processes:
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


PROBE_KEYS = [f"probe/{n}" for n in range(64)]


def wait_served(cluster):
    """Waits (30 s at most) until every probe key is served: each shard has a leader."""
    deadline = time.time() + 30
    while time.time() < deadline and any(cluster.served(k) is None for k in PROBE_KEYS):
        time.sleep(0.05)


class Traffic:
    """The lock traffic of the module docs on `cluster`, with the `latchkey lock` of `client`:
    `holders` processes extending a `lease`-second lease, `callers` threads looping on 4 keys.
    Also used by benches/rolling_upgrade.py."""

    def __init__(self, cluster, client, env, holders, callers, lease):
        self.cluster, self.holder_count = cluster, holders
        self.holders = [
            subprocess.Popen(
                [client, "lock", "--lease", f"{lease}s", "--wait", "10s",
                 f"holders/{i}", "--", "sleep", "3600"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for i in range(holders)
        ]
        self.stop = threading.Event()
        self.codes, self.codes_lock, self.errors = {}, threading.Lock(), []

        def caller(n):
            key = f"calls/{n % 4}"
            while not self.stop.is_set():
                done = subprocess.run(
                    [client, "lock", "--wait", "8s", "--lease", f"{lease}s", key, "--", "true"],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                with self.codes_lock:
                    self.codes[done.returncode] = self.codes.get(done.returncode, 0) + 1
                    if done.returncode not in (0, 80):
                        self.errors.append(done.stderr.strip().splitlines()[-1:])

        self.threads = [threading.Thread(target=caller, args=(n,)) for n in range(callers)]
        self.calls_from = time.time()
        for thread in self.threads:
            thread.start()

    def finish(self):
        """Stops the callers, lets the holders go (SIGTERM), prints the callers' and holders'
        exit codes, and looks for ghost holds (printed by `report_ghosts`)."""
        self.stop.set()
        for thread in self.threads:
            thread.join()
        calls_s = time.time() - self.calls_from
        holder_codes = {}
        lost = []
        for holder in self.holders:
            holder.send_signal(signal.SIGTERM)
        for holder in self.holders:
            try:
                code = holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                holder.kill()
                code = "killed"
            holder_codes[code] = holder_codes.get(code, 0) + 1
            if code not in (143, 0):
                lines = int(os.environ.get("FAILOVER_LOST_LINES", "2"))
                lost.append(holder.stderr.read().strip().splitlines()[-lines:])
        time.sleep(1)
        keys = ([f"holders/{i}" for i in range(self.holder_count)]
                + [f"calls/{k}" for k in range(4)])
        self.ghosts = []
        for key in keys:
            for port in self.cluster.clients:
                state = query(port, key)
                if state is not None:
                    if state[0]:
                        self.ghosts.append(key)
                    break
        print(f"callers: exit codes {dict(sorted(self.codes.items()))} "
              f"(0 done, 80 timeout, 81 busy, 82 indeterminate, 83 unavailable); "
              f"{sum(self.codes.values()) / calls_s:.0f} calls/s over {calls_s:.0f} s")
        for line in self.errors[:5]:
            print(f"  e.g. {line}")
        # `latchkey lock` forwards SIGTERM to `sleep` and releases: a holder that kept its
        # lock to the end exits 143 (its command's status); 85 is a lost lease.
        print(f"holders: exit codes {holder_codes} (143: kept the lock to the end; 85: lost it)")
        for line in lost[:5]:
            print(f"  e.g. {line}")

    def report_ghosts(self):
        print(f"ghost holds (held once every client exited): {len(self.ghosts)} "
              f"{self.ghosts[:8]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("binary")
    parser.add_argument("--client-binary", help="the `latchkey lock` of the holders and callers "
                        "(default: BINARY), to tell a client's part from the server's")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--holders", type=int, default=16)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--lease", type=int, default=3)
    parser.add_argument("--stall", type=float, default=6.0)
    parser.add_argument("--fsync", default="true")
    parser.add_argument("--members", default="1,2,3")
    args = parser.parse_args()
    order = [int(m) - 1 for m in args.members.split(",")]
    directory = tempfile.mkdtemp(prefix="latchkey-failover.")
    cluster = Cluster(args.binary, directory, args.shards, args.fsync)
    client_binary = args.client_binary or args.binary
    env = dict(os.environ, LATCHKEY_SERVER=cluster.servers())
    env.pop("RUST_LOG", None)
    try:
        wait_served(cluster)
        print(f"cluster up: {args.shards} shards, fsync {args.fsync}; "
              f"disk fdatasync p50 {disk_sync_p50(directory):.0f} us", flush=True)
        traffic = Traffic(cluster, client_binary, env, args.holders, args.callers, args.lease)
        time.sleep(2)
        failovers = []

        def failover_after(fault_at, down):
            """Seconds until every probe key is served by a member other than `down`."""
            pending = list(PROBE_KEYS)
            while pending and time.time() < fault_at + 30:
                pending = [k for k in pending if cluster.served(k, skip=(down,)) is None]
                time.sleep(0.005)
            return time.time() - fault_at if not pending else None

        resumed = []  # (kind, member, seconds to the waiter's grant, to the first extend)
        for i in order:
            process = cluster.processes[i]
            watch = Watch(cluster, i, client_binary, env, f"stop-{i + 1}")
            process.send_signal(signal.SIGSTOP)
            fault_at = time.time()
            watch.fault()
            took = failover_after(fault_at, i)
            failovers.append(("stop", i + 1, took))
            resumed.append(("stop", i + 1) + watch.finish(fault_at))
            time.sleep(max(0.0, fault_at + args.stall - time.time()))
            process.send_signal(signal.SIGCONT)
            time.sleep(3)
            watch = Watch(cluster, i, client_binary, env, f"kill-{i + 1}")
            process.kill()
            fault_at = time.time()
            watch.fault()
            process.wait()
            cluster.processes[i] = None
            took = failover_after(fault_at, i)
            failovers.append(("kill", i + 1, took))
            resumed.append(("kill", i + 1) + watch.finish(fault_at))
            time.sleep(max(0.0, fault_at + 2 - time.time()))
            cluster.launch(i)
            time.sleep(3)
        traffic.finish()
        times = [took for _, _, took in failovers if took is not None]
        print("failover (every probe key served by a member that is up), per fault: "
              + ", ".join(f"{kind} m{m} {took * 1000:.0f} ms" if took else f"{kind} m{m} -"
                          for kind, m, took in failovers))
        if times:
            print(f"failover p50 {statistics.median(times) * 1000:.0f} ms, "
                  f"max {max(times) * 1000:.0f} ms")
        def fmt(seconds):
            return f"{seconds * 1000:.0f} ms" if seconds is not None else "-"

        print("from the fault to the queued waiter's grant / to the first confirmed extend, per "
              "fault: " + ", ".join(f"{kind} m{m} {fmt(grant)} / {fmt(extend)}"
                                     for kind, m, grant, extend in resumed))
        for label, column in (("waiter's grant", 2), ("first confirmed extend", 3)):
            seen = [row[column] for row in resumed if row[column] is not None]
            missing = len(resumed) - len(seen)
            if seen:
                print(f"{label}: p50 {statistics.median(seen) * 1000:.0f} ms, max "
                      f"{max(seen) * 1000:.0f} ms" + (f" ({missing} not seen)" if missing else ""))
        traffic.report_ghosts()
    finally:
        cluster.stop_all()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
