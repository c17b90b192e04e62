#!/usr/bin/env python3
"""Backup and restore of a loaded cluster, measured.

    python3 benches/backup.py BINARY [--shards 64] [--holds 20000] [--threads 16]

Starts three members of BINARY on loopback (fsync on), takes HOLDS locks on distinct keys with
leases of 255 s (the Python client of clients/python, THREADS threads), then times `latchkey
cluster backup FILE` (and says the file's size), stops the cluster, starts a new one from the
file (`cluster.restore_from`, empty data directories) and times how long until every shard
serves, and checks that every held key is held again and that a new key's token is above every
backed-up one. Prints the disk's fdatasync p50 beside the figures. Loopback only; bounded.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python", "src")
)
import latchkey  # noqa: E402
from failover import Cluster, disk_sync_p50, wait_served  # noqa: E402


def take(servers, keys, tokens, errors):
    client = latchkey.Client(servers, sessions=1, transport_timeout=10.0)
    try:
        for key in keys:
            try:
                ticket = client.acquire(key, wait=5.0, lease=255.0)
                tokens[key] = ticket.token
            except Exception as error:  # noqa: BLE001 - counted and shown
                errors.append(f"{key}: {error!r}")
    finally:
        client.close()


class Restoring(Cluster):
    """Three members that start from the backup file `backup` (`cluster.restore_from`)."""

    backup = ""

    def launch(self, i):
        with open(self.configs[i]) as f:
            text = f.read()
        if "restore_from" not in text:
            key = f'[cluster]\nrestore_from = "{self.backup}"\n'
            with open(self.configs[i], "w") as f:
                f.write(text.replace("[cluster]\n", key, 1))
        super().launch(i)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("binary")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--holds", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="latchkey-backup.")
    backup_file = os.path.join(directory, "locks.backup")
    os.makedirs(os.path.join(directory, "old"))
    old = Cluster(args.binary, os.path.join(directory, "old"), args.shards, "true")
    new = None
    try:
        wait_served(old)
        print(f"cluster up: 3 members, {args.shards} shards, fsync on; disk fdatasync p50 "
              f"{disk_sync_p50(directory):.0f} us", flush=True)
        keys = [f"backup/{n}" for n in range(args.holds)]
        tokens, errors = {}, []
        start = time.perf_counter()
        threads = [
            threading.Thread(target=take, args=(old.servers(), keys[t::args.threads], tokens, errors))
            for t in range(args.threads)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(f"held: {len(tokens)} keys in {time.perf_counter() - start:.1f} s "
              f"({len(errors)} errors{': ' + errors[0] if errors else ''})", flush=True)
        start = time.perf_counter()
        backup = subprocess.run(
            [args.binary, "cluster", "backup", backup_file, "--server", old.servers()],
            capture_output=True, text=True, timeout=300)
        took = time.perf_counter() - start
        print(f"backup: exit {backup.returncode} in {took:.2f} s, "
              f"{os.path.getsize(backup_file) if os.path.exists(backup_file) else 0} bytes; "
              f"{backup.stdout.strip()} {backup.stderr.strip()}", flush=True)
        old.stop_all()
        start = time.perf_counter()
        os.makedirs(os.path.join(directory, "new"))
        Restoring.backup = backup_file
        new = Restoring(args.binary, os.path.join(directory, "new"), args.shards, "true")
        wait_served(new)
        print(f"restored cluster serves every shard {time.perf_counter() - start:.2f} s after "
              "its members were started", flush=True)
        client = latchkey.Client(new.servers(), sessions=1, transport_timeout=10.0)
        sample = keys[:: max(1, len(keys) // 1000)]
        held = sum(1 for key in sample if client.query(key).held)
        ticket = client.acquire("backup/new-key", wait=5.0, lease=10.0)
        highest = max(tokens.values()) if tokens else 0
        print(f"after restore: {held} of {len(sample)} sampled keys held; a new key's token "
              f"{ticket.token} {'>' if ticket.token > highest else '<='} the highest backed-up "
              f"token {highest}", flush=True)
        client.close()
    finally:
        old.stop_all()
        if new is not None:
            new.stop_all()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
