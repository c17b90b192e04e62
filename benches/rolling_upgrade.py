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
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from failover import Cluster, Traffic, disk_sync_p50, wait_served  # noqa: E402


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
    names = {args.old: "old", args.new: "new"}

    def report(step):
        builds = ", ".join(
            f"m{i + 1} {names[cluster.binaries[i]]} (cluster version "
            f"{cluster_version(port)})" for i, port in enumerate(cluster.clients))
        print(f"{step}: {builds}", flush=True)

    try:
        wait_served(cluster)
        print(f"cluster up: {args.shards} shards, fsync on; disk fdatasync p50 "
              f"{disk_sync_p50(directory):.0f} us", flush=True)
        traffic = Traffic(cluster, client, env, args.holders, args.callers, args.lease)
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
        traffic.finish()
        traffic.report_ghosts()
    finally:
        cluster.stop_all()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
