"""What every benchmark shares: latency summaries, machine facts and the result file.

Results follow the shape in BENCHMARKS.md: ``{"scenario", "machine", "date", "versions",
"params", "rows": [{"system", "p50_us", "p99_us", "p999_us", "qps", ...}]}``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Any

import numpy as np

import kalos


def summarize(
    system: str, samples_ns: np.ndarray, wall_s: float | None = None, **extra: Any
) -> dict[str, Any]:
    """p50/p99/p99.9 in µs of ``samples_ns``; qps from the wall time (or the samples' sum)."""
    us = np.asarray(samples_ns, dtype=np.float64) / 1e3
    total = wall_s if wall_s is not None else float(us.sum()) / 1e6
    row = {
        "system": system,
        "n": len(us),
        "p50_us": round(float(np.percentile(us, 50)), 3),
        "p99_us": round(float(np.percentile(us, 99)), 3),
        "p999_us": round(float(np.percentile(us, 99.9)), 3),
        "mean_us": round(float(us.mean()), 3),
        "qps": round(len(us) / total, 1) if total > 0 else 0.0,
    }
    row.update(extra)
    return row


def machine_name(override: str | None) -> str:
    if override:
        return override
    env = os.environ.get("KALOS_MACHINE")
    if env:
        return env
    return f"{platform.machine()}-{os.cpu_count()}core"


def versions() -> dict[str, str]:
    out = {"kalos": kalos.__version__, "python": platform.python_version(), "numpy": np.__version__}
    for mod in ("faiss", "torch", "triton", "grpc", "redis"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except ImportError:
            pass
    return out


def host_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    facts["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if var in os.environ:
            facts[var] = os.environ[var]
    return facts


def write_result(
    scenario: str,
    machine: str | None,
    params: dict[str, Any],
    rows: list[dict[str, Any]],
    out_dir: str,
    **extra: Any,
) -> str:
    """Writes bench/results/<scenario>-<machine>-<date>.json; returns its path."""
    date = datetime.date.today().isoformat()
    name = machine_name(machine)
    result = {
        "scenario": scenario,
        "machine": name,
        "date": date,
        "versions": versions(),
        "host": host_facts(),
        "params": params,
        "rows": rows,
        **extra,
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{scenario}-{name}-{date}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return path


def print_table(
    rows: list[dict[str, Any]],
    columns: tuple[str, ...] = ("system", "p50_us", "p99_us", "p999_us", "qps"),
) -> None:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=False)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=False)))
