#!/usr/bin/env python3
"""A rolling upgrade of a three-member cluster under lock traffic, from one build to another.

    python3 benches/rolling_upgrade.py OLD_BINARY NEW_BINARY [--shards N] [--holders N]
                                       [--callers N] [--lease S] [--client-binary BINARY]

Starts three members of OLD_BINARY (one core each, fresh data directories, fsync on), then the
traffic of benches/failover.py: HOLDERS `latchkey lock --lease LEASE` processes that extend
their lease for the whole run, and CALLERS threads looping `latchkey lock --wait 8s` on 4
contended keys (the client is CLIENT_BINARY, by default OLD_BINARY: applications upgrade
later). Then, one member at a time: SIGTERM (the member hands its leaderships over and exits),
restart it from its data directory with NEW_BINARY, 4 s to settle. Each step prints every
member's build and the cluster version it reports (`GET /stats`: the lowest peer wire version
of its cluster, as far as it knows; a build without the negotiation reports none).

Printed at the end: the callers' exit codes (0 done, 80 timeout, 81 busy, 82 indeterminate,
83 unavailable), holders that lost their lock (exit 85), and ghost holds once every client has
exited — the upgrade is clean when there is no 82, 83 or 85 and no ghost. With the disk's
fdatasync p50 beside them. Loopback only; about 20 s per member plus the start.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from failover import Cluster, disk_sync_p50, query  # noqa: E402


class Mixed(Cluster):
    """A cluster whose members may run different builds (`binaries[i]`)."""

    def __init__(self, binary, directory, shards, fsync):
        self.binaries = [binary] * 3
        super().__init__(binary, directory, shards, fsync)

    def launch(self, i):
        self.binary = self.binaries[i]
        super().launch(i)


def cluster_version(port):
    """The cluster version member `port` reports, None if it reports none, "down" if silent."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=2) as answer:
            stats = json.load(answer)
    except OSError:
        return "down"
    return (stats.get("cluster") or {}).get("cluster_version")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--client-binary")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--holders", type=int, default=16)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--lease", type=int, default=3)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="latchkey-upgrade.")
    cluster = Mixed(args.old, directory, args.shards, "true")
    client = args.client_binary or args.old
    env = dict(os.environ, LATCHKEY_SERVER=cluster.servers())
    env.pop("RUST_LOG", None)
    probe_keys = [f"probe/{n}" for n in range(64)]
    names = {args.old: "old", args.new: "new"}

    def report(step):
        builds = ", ".join(
            f"m{i + 1} {names[cluster.binaries[i]]} (cluster version "
            f"{cluster_version(port)})" for i, port in enumerate(cluster.clients))
        print(f"{step}: {builds}", flush=True)

    try:
        deadline = time.time() + 30
        while time.time() < deadline and any(cluster.served(k) is None for k in probe_keys):
            time.sleep(0.05)
        print(f"cluster up: {args.shards} shards, fsync on; disk fdatasync p50 "
              f"{disk_sync_p50(directory):.0f} us", flush=True)
        holders = [
            subprocess.Popen(
                [client, "lock", "--lease", f"{args.lease}s", "--wait", "10s",
                 f"holders/{i}", "--", "sleep", "3600"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for i in range(args.holders)
        ]
        stop = threading.Event()
        codes, codes_lock, errors = {}, threading.Lock(), []

        def caller(n):
            key = f"calls/{n % 4}"
            while not stop.is_set():
                done = subprocess.run(
                    [client, "lock", "--wait", "8s", "--lease", f"{args.lease}s", key, "--",
                     "true"],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                with codes_lock:
                    codes[done.returncode] = codes.get(done.returncode, 0) + 1
                    if done.returncode not in (0, 80):
                        errors.append(done.stderr.strip().splitlines()[-1:])

        threads = [threading.Thread(target=caller, args=(n,)) for n in range(args.callers)]
        calls_from = time.time()
        for thread in threads:
            thread.start()
        time.sleep(2)
        report("before")
        for i in range(3):
            process = cluster.processes[i]
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                print(f"m{i + 1} did not stop within 30 s: killed")
            cluster.processes[i] = None
            cluster.binaries[i] = args.new
            cluster.launch(i)
            time.sleep(4)
            report(f"m{i + 1} upgraded")
        time.sleep(2)
        report("after")
        stop.set()
        for thread in threads:
            thread.join()
        calls_s = time.time() - calls_from
        holder_codes, lost = {}, []
        for holder in holders:
            holder.send_signal(signal.SIGTERM)
        for holder in holders:
            try:
                code = holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                holder.kill()
                code = "killed"
            holder_codes[code] = holder_codes.get(code, 0) + 1
            if code not in (143, 0):
                lost.append(holder.stderr.read().strip().splitlines()[-2:])
        time.sleep(1)
        keys = [f"holders/{i}" for i in range(args.holders)] + [f"calls/{k}" for k in range(4)]
        ghosts = []
        for key in keys:
            for port in cluster.clients:
                state = query(port, key)
                if state is not None:
                    if state[0]:
                        ghosts.append(key)
                    break
        print(f"callers: exit codes {dict(sorted(codes.items()))} "
              f"(0 done, 80 timeout, 81 busy, 82 indeterminate, 83 unavailable); "
              f"{sum(codes.values()) / calls_s:.0f} calls/s over {calls_s:.0f} s")
        for line in errors[:5]:
            print(f"  e.g. {line}")
        print(f"holders: exit codes {holder_codes} (143: kept the lock to the end; 85: lost it)")
        for line in lost[:5]:
            print(f"  e.g. {line}")
        print(f"ghost holds (held once every client exited): {len(ghosts)} {ghosts[:8]}")
    finally:
        cluster.stop_all()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
