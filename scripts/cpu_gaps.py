"""How often, and for how long, a spinning thread loses its CPU on this machine.

A thread pinned to one CPU reads the monotonic clock in a tight loop for ``--seconds`` and
records every gap longer than ``--min-us`` between two reads: timer ticks, interrupts, the
hypervisor taking the vCPU, other threads. On the CI-class VM the guest's timer tick (250 Hz)
costs ~19 µs (docs/PERFORMANCE.md), which is what sets the p99 of a ~12 µs round trip; this
probe measures that floor on any machine, CPU by CPU, with nothing else of Kalos running.

Usage: ``python3 scripts/cpu_gaps.py [--cpus 0 1] [--seconds 2] [--machine NAME] [--out DIR]``;
prints a line per CPU and writes ``cpu-gaps-<machine>.json`` (the date inside) when ``--out``
is given. ``scripts/gpu-check bench`` runs it on the GPU host before the search-gpu bench.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import numpy as np


def probe(cpu: int, seconds: float, min_ns: int) -> dict:
    """Spins on ``cpu`` for ``seconds``; the gaps longer than ``min_ns``, summarised."""
    os.sched_setaffinity(0, {cpu})
    clock = time.monotonic_ns
    gaps: list[tuple[int, int]] = []  # (when, how long) ns
    start = last = clock()
    end = start + int(seconds * 1e9)
    reads = 0
    while last < end:
        now = clock()
        reads += 1
        if now - last > min_ns:
            gaps.append((now - start, now - last))
        last = now
    span = last - start
    lengths = np.array([g for _, g in gaps], np.float64) / 1e3
    row = {
        "system": "pinned-clock-loop",
        "cpu": cpu,
        "seconds": round(span / 1e9, 3),
        "read_ns": round(span / max(reads, 1), 1),  # the loop's own step
        "gaps": len(gaps),
        "gaps_per_s": round(len(gaps) / (span / 1e9), 1),
        "lost_pct": round(float(lengths.sum()) * 1e3 / span * 100, 3) if len(gaps) else 0.0,
    }
    if len(gaps):
        row.update(
            p50_us=round(float(np.percentile(lengths, 50)), 2),
            p90_us=round(float(np.percentile(lengths, 90)), 2),
            max_us=round(float(lengths.max()), 2),
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpus", type=int, nargs="+", default=None, help="default: every CPU")
    ap.add_argument("--seconds", type=float, default=2.0, help="per CPU")
    ap.add_argument("--min-us", type=float, default=3.0, help="shortest gap recorded")
    ap.add_argument("--machine", default=platform.node())
    ap.add_argument("--out", default=None, help="directory for the JSON result")
    args = ap.parse_args()
    mine = sorted(os.sched_getaffinity(0))
    cpus = args.cpus if args.cpus is not None else mine
    rows = []
    try:
        for cpu in cpus:
            row = probe(cpu, args.seconds, int(args.min_us * 1000))
            rows.append(row)
            print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    finally:
        os.sched_setaffinity(0, mine)
    if args.out:
        date = datetime.date.today().isoformat()
        path = os.path.join(args.out, f"cpu-gaps-{args.machine}.json")
        doc = {
            "scenario": "cpu-gaps",
            "machine": args.machine,
            "date": date,
            "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "params": {"seconds": args.seconds, "min_us": args.min_us},
            "rows": rows,
        }
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
