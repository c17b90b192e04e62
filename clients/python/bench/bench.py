#!/usr/bin/env python3
"""Acquire+release cycles per second of the latchkey Python client, side by side with redis-py's
``Lock`` against ``redis-server``, in one Python process, at 1 and 32 threads.

Each thread takes and releases a key of its own (``bench/<thread>``) in a loop for
``--seconds``; the figures are cycles/s, the p50 and p99 of one cycle, and the client
process's own CPU time (all its threads, ``time.process_time``) per cycle. The servers run in
their own processes on the same machine (started here unless ``--latchkey``/``--redis`` name
running ones); the redis column is skipped when ``redis-server`` or the ``redis`` package is
absent.

    python3 clients/python/bench/bench.py                 # after cargo build --release
    python3 clients/python/bench/bench.py --threads 1,8,32 --seconds 10
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[3]

Cycle = Callable[[str], None]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


def start_latchkey() -> Tuple[subprocess.Popen[bytes], str]:
    binary = os.environ.get("LATCHKEY_BIN") or str(REPO / "target" / "release" / "latchkey")
    if not os.path.exists(binary):
        sys.exit(f"no {binary}: run cargo build --release (or set LATCHKEY_BIN)")
    process = subprocess.Popen(
        [binary, "serve", "--listen", "127.0.0.1:0", "--cores", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    line = process.stdout.readline().decode()
    assert line.startswith("listening on "), line
    return process, line.split()[-1]


def start_redis() -> Optional[Tuple[subprocess.Popen[bytes], int]]:
    if shutil.which("redis-server") is None:
        return None
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    until = time.monotonic() + 10
    while time.monotonic() < until:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, port
        except OSError:
            time.sleep(0.05)
    process.kill()
    return None


def run(threads: int, seconds: float, make_cycle: Callable[[], Cycle]) -> Dict[str, float]:
    """Runs ``threads`` threads of cycles for ``seconds``; cycles/s, p50/p99 (ms), CPU/cycle (µs)."""
    cycle = make_cycle()
    for i in range(threads):  # warm up: sessions, connections, scripts
        cycle(f"bench/{i}")
    latencies: List[List[float]] = [[] for _ in range(threads)]
    start_barrier = threading.Barrier(threads + 1)
    stop = threading.Event()

    def worker(index: int) -> None:
        key = f"bench/{index}"
        out = latencies[index]
        clock = time.perf_counter
        start_barrier.wait()
        while not stop.is_set():
            began = clock()
            cycle(key)
            out.append(clock() - began)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    start_barrier.wait()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    every = sorted(x for per in latencies for x in per)
    count = len(every)
    return {
        "cycles_s": count / wall,
        "p50_ms": every[count // 2] * 1000,
        "p99_ms": every[min(count - 1, int(count * 0.99))] * 1000,
        "cpu_us": cpu / count * 1e6,
        "cycles": count,
    }


def latchkey_cycle(addr: str, threads: int) -> Callable[[], Cycle]:
    import latchkey

    def make() -> Cycle:
        client = latchkey.Client(addr, sessions=2)

        def cycle(key: str) -> None:
            ticket = client.acquire(key, wait=5.0, lease=30.0)
            ticket.release()

        return cycle

    return make


def redis_cycle(port: int) -> Callable[[], Cycle]:
    import redis

    def make() -> Cycle:
        client = redis.Redis(host="127.0.0.1", port=port)

        def cycle(key: str) -> None:
            lock = client.lock(key, timeout=30, blocking_timeout=5)
            if not lock.acquire():
                raise RuntimeError("redis lock not acquired")
            lock.release()

        return cycle

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latchkey", help="ADDR of a running latchkey (default: start target/release/latchkey)")
    parser.add_argument("--redis", type=int, help="port of a running redis-server on 127.0.0.1")
    parser.add_argument("--threads", default="1,32")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    started: List["subprocess.Popen[bytes]"] = []
    try:
        addr = args.latchkey
        if addr is None:
            process, addr = start_latchkey()
            started.append(process)
        redis_port: Optional[int] = args.redis
        try:
            import redis  # noqa: F401

            have_redis_py = True
        except ImportError:
            have_redis_py = False
        if redis_port is None and have_redis_py:
            got = start_redis()
            if got is not None:
                started.append(got[0])
                redis_port = got[1]
        if not have_redis_py:
            redis_port = None
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, Python {sys.version.split()[0]}, "
              f"{os.cpu_count()} CPUs, {args.seconds:g} s per run, one key per thread")
        header = "| threads | client | cycles/s | p50 ms | p99 ms | client CPU µs/cycle |"
        print(header)
        print("|---|---|---|---|---|---|")
        results: Dict[Tuple[int, str], Dict[str, float]] = {}
        for threads in counts:
            columns = [("latchkey", latchkey_cycle(addr, threads))]
            if redis_port is not None:
                columns.append(("redis-py Lock", redis_cycle(redis_port)))
            for name, make in columns:
                r = run(threads, args.seconds, make)
                results[(threads, name)] = r
                print(f"| {threads} | {name} | {r['cycles_s']:,.0f} | {r['p50_ms']:.3f} | "
                      f"{r['p99_ms']:.3f} | {r['cpu_us']:.0f} |", flush=True)
        if redis_port is not None:
            for threads in counts:
                ratio = results[(threads, "latchkey")]["cycles_s"] / results[(threads, "redis-py Lock")]["cycles_s"]
                print(f"# {threads} threads: latchkey / redis-py = {ratio:.2f}x")
        else:
            print("# redis column skipped: redis-server or the redis package is absent")
    finally:
        for process in started:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()
