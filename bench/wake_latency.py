"""Does a spinning waiter notice a store later the longer it has spun?

bench/NOTES-gpu.md, run 10: at 10M rows the client's share of a search (from the sidecar's
publish to the client's return) is ~24 µs against ~8 at 1M, with the same work on both
sides; only the wait before it is longer (330 µs against 60). One suspect is the
hypervisor's pause-loop exiting: a vCPU that executes PAUSE in a tight loop for long enough
is taken off its CPU by the host, and the client's spin (``_native.wait_seq``) is such a loop.

Two processes share one page. The waiter announces it starts waiting, then waits for the
sequence word; the publisher busy-waits ``delay`` µs (a clock loop, no PAUSE), stamps the
clock and publishes. The waiter stamps the clock once it sees the word. Per delay, the
notice latency (waiter's stamp - publisher's stamp) for three waiters:

- ``native``: ``_native.wait_seq`` spinning (load + PAUSE, the client's wait);
- ``python``: a Python loop of ``_native.load_acquire`` (no PAUSE);
- ``park``: ``_native.wait_seq`` with no spin (futex; the publisher wakes it).

Usage: ``python3 bench/wake_latency.py [--cpus 2 3] [--reps 2000] [--out DIR]``
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform

import numpy as np

from kalos import _native
from kalos.bench.common import write_result

DELAYS_US = (5, 20, 60, 150, 330, 1000)
SEQ, PARKED, BELL, READY = 0, 64, 128, 192  # byte offsets, one line each


def _waiter(base: int, mode: str, reps: int) -> np.ndarray:
    """Waits for sequence 1..reps; the clock when each was seen."""
    import time

    mono = time.monotonic_ns
    load = _native.load_acquire
    seen = np.zeros(reps, np.int64)
    for i in range(1, reps + 1):
        _native.store_release(base + READY, i)
        if mode == "native":
            _native.wait_seq(base + SEQ, i, base + PARKED, base + BELL, 10**10, 10**10)
        elif mode == "park":
            _native.wait_seq(base + SEQ, i, base + PARKED, base + BELL, 0, 10**10)
        else:
            while load(base + SEQ) < i:
                pass
        seen[i - 1] = mono()
    return seen


def run_mode(mode: str, delay_us: float, reps: int, cpus: tuple[int, int]) -> dict[str, float]:
    import time

    page = mmap.mmap(-1, 4096)
    base = np.frombuffer(page, np.uint8).ctypes.data
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the waiter
        os.sched_setaffinity(0, {cpus[0]})
        os.close(r)
        os.write(w, _waiter(base, mode, reps).tobytes())
        os._exit(0)
    os.close(w)
    os.sched_setaffinity(0, {cpus[1]})
    mono = time.monotonic_ns
    load = _native.load_acquire
    delay = int(delay_us * 1000)
    pub = np.zeros(reps, np.int64)
    for i in range(1, reps + 1):
        while load(base + READY) < i:
            pass
        end = mono() + delay
        while mono() < end:
            pass
        pub[i - 1] = mono()
        _native.publish(base + SEQ, i, base + PARKED, base + BELL)
    data = b""
    while len(data) < reps * 8:
        chunk = os.read(r, reps * 8 - len(data))
        if not chunk:
            break
        data += chunk
    os.waitpid(pid, 0)
    os.close(r)
    seen = np.frombuffer(data, np.int64)
    lat = (seen - pub)[reps // 10 :] / 1e3  # the first 10% warm up
    return {
        "p50_us": round(float(np.percentile(lat, 50)), 2),
        "p90_us": round(float(np.percentile(lat, 90)), 2),
        "p99_us": round(float(np.percentile(lat, 99)), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", type=int, nargs=2, default=[2, 3])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--delays", type=float, nargs="+", default=list(DELAYS_US))
    p.add_argument("--machine", default=platform.node())
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cpus = (args.cpus[0], args.cpus[1])
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for mode in ("native", "python", "park"):
        rows[mode] = {}
        for d in args.delays:
            rows[mode][str(d)] = r = run_mode(mode, d, args.reps, cpus)
            print(f"{mode:7s} after {d:7.1f} µs: {r}", flush=True)
    if args.out:
        flat = [{"mode": mode, "after_us": float(d), **r}
                for mode, by_delay in rows.items() for d, r in by_delay.items()]  # fmt: skip
        path = write_result("wake-latency", args.machine, {"cpus": list(cpus), "reps": args.reps},
                            flat, args.out)  # fmt: skip
        print("wrote", path)


if __name__ == "__main__":
    main()
