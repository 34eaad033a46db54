"""What every benchmark shares: latency summaries, machine facts, the result file, a progress
bar, the per-stage breakdown of a kalos call, and concurrent interleaved runs.

Results follow the shape in docs/PERFORMANCE.md: ``{"scenario", "machine", "date", "versions",
"params", "rows": [{"system", "p50_us", "p99_us", "p999_us", "qps", ...}]}``.

The five stages of a kalos call (:data:`STAGES`, µs; they sum to the round trip the benchmark
timed around the call, on the ``time.monotonic_ns`` clock the client and sidecar stamp with):

* ``client_write``: the call began → its request was published (argument checks, encoding
  into the channel, the header; for a benchmark also the Python call itself);
* ``sidecar_wait``: published → the sidecar picked it up (its spin or futex wake; other
  channels served first);
* ``compute``: the sidecar's validation and store/index work;
* ``response_write``: the sidecar encoding the response;
* ``client_read``: the rest: the response published → the client saw it (spin or futex
  wake) → decoded it (for ``device="cuda"``: the GPU handoff) → the call returned.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

import kalos

STAGES = ("client_write", "sidecar_wait", "compute", "response_write", "client_read")


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
    suffix: str | None = None,
    **extra: Any,
) -> str:
    """Writes bench/results/<scenario>-<machine>[-suffix].json, the result of record (the date
    and versions inside; the run it replaces lives on in git); returns its path."""
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
    tail = f"-{suffix}" if suffix else ""
    path = os.path.join(out_dir, f"{scenario}-{name}{tail}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return path


def write_sets(
    scenario: str,
    machine: str | None,
    params: dict[str, Any],
    rows: list[dict[str, Any]],
    out_dir: str,
    *,
    append: bool,
    same: Sequence[str],
    **extra: Any,
) -> str:
    """:func:`write_result`; with ``append``, the parameter sets the file already holds stay
    beside this run's (the file becomes a list of sets), but for one whose ``params`` agree
    with this run's on every key of ``same``, which this run replaces. Returns the path."""
    target = os.path.join(out_dir, f"{scenario}-{machine_name(machine)}.json")
    previous: list[dict[str, Any]] = []
    if append and os.path.exists(target):
        with open(target) as f:
            loaded = json.load(f)
        mine = [params.get(key) for key in same]
        previous = [
            s for s in (loaded if isinstance(loaded, list) else [loaded])
            if [s["params"].get(key) for key in same] != mine
        ]  # fmt: skip
    path = write_result(scenario, machine, params, rows, out_dir, **extra)
    if previous:
        with open(path) as f:
            doc = [*previous, json.load(f)]
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return path


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def source_revision() -> str:
    """The git commit the benchmark ran from (``+dirty`` with uncommitted changes), or "?"."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return rev + ("+dirty" if dirty else "")


def print_table(
    rows: list[dict[str, Any]],
    columns: tuple[str, ...] = ("system", "p50_us", "p99_us", "p999_us", "qps"),
) -> None:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=False)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=False)))


# -- CPU affinity --------------------------------------------------------------------------------


def add_affinity_argument(p: Any, servers: str = "the sidecar", cpus: str = "last CPU") -> None:
    """The benchmarks' ``--affinity`` option (see :func:`split_cpus`); ``servers`` names what
    runs on this process's ``cpus``, for the help text."""
    p.add_argument("--affinity", type=_affinity, default="split",
                   help=f"split: {servers} on this process's {cpus}, the calling threads on "
                   "the others (client and server never share a core); cpus:A,B,...: "
                   f"{servers} on those CPUs, the calling threads on the others; none: "
                   "wherever the scheduler puts them")  # fmt: skip


def _affinity(mode: str) -> str:
    """An ``--affinity`` value, checked (argparse reports the ValueError)."""
    if mode not in ("split", "none"):
        _listed_cpus(mode)
    return mode


def _listed_cpus(mode: str) -> list[int]:
    """The CPUs of a ``cpus:A,B,...`` affinity."""
    if not mode.startswith("cpus:"):
        raise ValueError(f"affinity must be split, none or cpus:A,B,..., not {mode!r}")
    try:
        cpus = sorted({int(c) for c in mode[5:].split(",") if c.strip()})
    except ValueError:
        raise ValueError(f"affinity {mode!r}: CPUs must be integers") from None
    if not cpus:
        raise ValueError(f"affinity {mode!r} names no CPU")
    return cpus


def split_cpus(mode: str, server_cpus: int = 1) -> tuple[list[int], list[int]] | None:
    """``(client CPUs, server CPUs)`` for ``--affinity`` ``mode``: "split" gives the servers
    (the sidecar's process, and a baseline's server beside it) the last ``server_cpus`` CPUs
    this process may use and the benchmark's own threads the others, so that a client and its
    server never share a core (a spinning client and a spinning sidecar on one core wait out
    each other's spins: ~280 µs a call); "cpus:A,B,..." gives the servers those CPUs instead
    (to place them by hand); None for "none", or without a CPU left for each."""
    if mode == "none":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if mode != "split":
        servers = _listed_cpus(mode)
        if not set(servers) < set(cpus):
            raise ValueError(f"affinity {mode!r}: needs CPUs of {cpus}, with one left over")
        return [c for c in cpus if c not in servers], servers
    if len(cpus) <= server_cpus:
        return None
    return cpus[:-server_cpus], cpus[-server_cpus:]


@contextlib.contextmanager
def cpu_split(
    mode: str, servers: dict[str, int], n_server_cpus: int = 1
) -> Iterator[dict[str, list[int]] | str]:
    """Pins the ``servers`` (name → pid) and this process as :func:`split_cpus` says, for the
    ``with`` block; yields what was pinned where, for the result file ("none": nothing). This
    process's threads get their CPUs back at the end."""
    split = split_cpus(mode, n_server_cpus)
    if split is None:
        yield "none"
        return
    client_cpus, server_cpus = split
    mine = sorted(os.sched_getaffinity(0))
    for pid in servers.values():  # first: a child inherits its parent's CPUs
        pin_process(pid, server_cpus)
    pin_process(0, client_cpus)
    try:
        yield {"client": client_cpus, **{name: server_cpus for name in servers}}
    finally:
        pin_process(0, mine)


def pin_process(pid: int, cpus: Sequence[int]) -> None:
    """Pins every thread of process ``pid`` (0: this one) to ``cpus``; threads it starts
    later inherit the CPUs of the thread that starts them."""
    tasks = f"/proc/{pid or os.getpid()}/task"
    for tid in os.listdir(tasks):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


# -- progress ----------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr: label, bar, done/total, rate and time left.

    Quiet when ``quiet`` or when the stream is not a terminal (logs and CI stay clean). Redraws
    at most every ``interval`` s; :meth:`update` is thread-safe and cheap, but call it between
    timed calls, never inside one.
    """

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        quiet: bool = False,
        stream: TextIO | None = None,
        interval: float = 0.25,
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = not quiet and bool(isatty and isatty())
        self.total = max(int(total), 1)
        self.label = label
        self.done = 0
        self._interval = interval
        self._start = self._drawn = time.monotonic()
        self._lock = threading.Lock()

    def update(self, n: int = 1, label: str | None = None) -> None:
        with self._lock:
            self.done += n
            if label is not None:
                self.label = label
            now = time.monotonic()
            if self.enabled and (now - self._drawn >= self._interval or self.done >= self.total):
                self._drawn = now
                self.stream.write("\r" + self.line(now))
                self.stream.flush()

    def line(self, now: float | None = None) -> str:
        """The bar as text: ``label [#####.....] 512/1,000 51% 840/s 0:01 left``."""
        elapsed = (time.monotonic() if now is None else now) - self._start
        done = min(self.done, self.total)
        frac = done / self.total
        bar = "#" * int(frac * 30) + "." * (30 - int(frac * 30))
        rate = done / elapsed if elapsed > 0 else 0.0
        left = (self.total - done) / rate if rate > 0 else 0.0
        return (
            f"{self.label} [{bar}] {done:,}/{self.total:,} {frac:4.0%} {rate:,.0f}/s "
            f"{int(left) // 60}:{int(left) % 60:02d} left"
        )

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * len(self.line()) + "\r")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the per-stage breakdown of a kalos call --------------------------------------------------


def split_stages(
    t0_ns: int, t1_ns: int, stamps: tuple[int, int, int] | None, timings: Any
) -> tuple[float, float, float, float, float] | None:
    """The five :data:`STAGES` (µs) of a call timed from ``t0_ns`` to ``t1_ns``
    (``time.monotonic_ns``), from the client's ``last_stamps`` and ``last_timings``; None when
    the transport does not stamp its requests. They sum to the round trip ``t1_ns - t0_ns``."""
    if stamps is None or timings is None or not stamps[1]:
        return None
    write = (stamps[1] - t0_ns) / 1e3
    queue, compute, out = timings.queue_us, timings.compute_us, timings.write_us
    return (write, queue, compute, out, (t1_ns - t0_ns) / 1e3 - write - queue - compute - out)


def stage_medians(timings: list[Any]) -> dict[str, Any]:
    """Median µs of each stage over a run's calls: the sidecar's queue (publish → picked
    up), compute (decode, search, sync) and write (response encoding), and the client's own
    share (encoding, publishing, waking, decoding: its round trip less the three); with the
    p99 of each, and ``tail``: each stage's mean over the calls slower than the p99 of the
    round trip (where the tail comes from)."""
    t = np.array([(x.queue_us, x.compute_us, x.write_us, x.total_us) for x in timings])
    client = t[:, 3] - t[:, 0] - t[:, 1] - t[:, 2]
    stages = {"queue_us": t[:, 0], "compute_us": t[:, 1], "write_us": t[:, 2],
              "client_us": client}  # fmt: skip
    out: dict[str, Any] = {k: round(float(np.median(v)), 2) for k, v in stages.items()}
    out.update({k.replace("_us", "_p99_us"): round(float(np.percentile(v, 99)), 2)
                for k, v in stages.items()})  # fmt: skip
    slow = t[:, 3] > np.percentile(t[:, 3], 99)
    if slow.any():
        tail = {k: round(float(v[slow].mean()), 2) for k, v in stages.items()}
        out["tail"] = {"calls": int(slow.sum()), **tail}
    return out


def stage_summary(stages: np.ndarray) -> dict[str, Any]:
    """Mean and p50 of each stage of ``stages`` ([n, 5] µs; NaN rows skipped). The means sum
    to the mean round trip; the p50s do not sum to anything."""
    ok = stages[~np.isnan(stages).any(axis=1)]
    if not len(ok):
        return {}
    return {
        "mean_us": {s: round(float(v), 3) for s, v in zip(STAGES, ok.mean(axis=0), strict=True)},
        "p50_us": {
            s: round(float(v), 3) for s, v in zip(STAGES, np.median(ok, axis=0), strict=True)
        },
    }


# -- concurrent, interleaved runs ---------------------------------------------------------------


@dataclass
class System:
    """One system under test. ``call(item)`` does one request (timed); ``check(item, result)``
    says whether its answer is right (run after the timer stopped, before the thread's next
    call: views stay valid). ``client``: a kalos client whose calls are split into stages."""

    name: str
    call: Callable[[int], Any]
    check: Callable[[int, Any], bool]
    client: Any = None


@dataclass
class LevelResult:
    """One system at one concurrency level: every request's ns, the wall time of the timed
    calls (warm-up calls excluded), the stages."""

    samples_ns: np.ndarray
    wall_s: float = 0.0
    stages_us: np.ndarray | None = None  # [n, 5], NaN where not split
    mismatches: int = 0


class Workers:
    """``n`` persistent threads that run one job each per round, released together. A thread
    keeps its kalos channels (one per thread per client) and Redis connections across rounds."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._job: Callable[[int], None] | None = None
        self._go = threading.Barrier(n + 1)
        self._done = threading.Barrier(n + 1)
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._loop, args=(k,), daemon=True, name=f"bench-{k}")
            for k in range(n)
        ]
        for t in self._threads:
            t.start()

    def _loop(self, k: int) -> None:
        while True:
            self._go.wait()
            job = self._job
            if job is None:
                return
            try:
                job(k)
            except BaseException as exc:
                self._errors.append(exc)
            self._done.wait()

    def run(self, job: Callable[[int], None]) -> float:
        """Runs ``job(k)`` on every thread k at once; the wall time in s, first start to last
        end. Re-raises a thread's exception."""
        self._job = job
        self._go.wait()
        t0 = time.perf_counter()
        self._done.wait()
        wall = time.perf_counter() - t0
        if self._errors:
            exc = self._errors[0]
            self._errors.clear()
            raise exc
        return wall

    def close(self) -> None:
        self._job = None
        self._go.wait()
        for t in self._threads:
            t.join()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_interleaved(
    systems: Sequence[System],
    order: np.ndarray,
    threads: int,
    *,
    block: int,
    warmup: int,
    progress: Progress | None = None,
) -> dict[str, LevelResult]:
    """Every system answers ``order`` (items), ``threads`` calls at a time, in interleaved blocks
    of ``block`` calls whose system order rotates. Thread k makes calls k, k+threads, ... of a
    block, after ``warmup`` untimed calls of its own (on the items that follow the block, so
    that none of the timed calls finds its item just warmed); every answer is checked."""
    n = len(order)
    results = {
        s.name: LevelResult(
            np.zeros(n, np.int64),
            stages_us=np.full((n, 5), np.nan) if s.client is not None else None,
        )
        for s in systems
    }
    lock = threading.Lock()
    span = np.zeros((threads, 2), np.int64)  # each thread's first timed call → its end, ns

    def block_job(system: System, res: LevelResult, at: int, end: int, k: int) -> None:
        call, check, client = system.call, system.check, system.client
        if client is not None:
            client.record_stages(True)
        # on the items after the block: warming its own first items would make them hits
        for j in range(warmup):
            call(int(order[(end + k + j * threads) % n]))
        samples, stages = res.samples_ns, res.stages_us
        clock = time.monotonic_ns
        bad = 0
        span[k, 0] = clock()
        for i in range(at + k, end, threads):
            item = int(order[i])
            t0 = clock()
            out = call(item)
            t1 = clock()
            samples[i] = t1 - t0
            if stages is not None:
                split = split_stages(t0, t1, client.last_stamps, client.last_timings)
                if split is not None:
                    stages[i] = split
            if not check(item, out):
                bad += 1
        span[k, 1] = clock()
        if client is not None:  # the other systems' calls, and the client's, stay unstamped
            client.record_stages(False)
        if bad:
            with lock:
                res.mismatches += bad

    with Workers(threads) as workers:
        for b, at in enumerate(range(0, n, block)):
            end = min(at + block, n)
            rotation = list(systems[b % len(systems) :]) + list(systems[: b % len(systems)])
            for system in rotation:
                res = results[system.name]
                workers.run(functools.partial(block_job, system, res, at, end))
                res.wall_s += (span[:, 1].max() - span[:, 0].min()) / 1e9
                if progress is not None:
                    progress.update(end - at)
    return results


def level_rows(
    results: dict[int, dict[str, LevelResult]],
    systems: Sequence[System],
    baseline: str,
    ratio: str = "baseline",
) -> tuple[list[dict[str, Any]], int]:
    """One row per (concurrency, system) of :func:`run_interleaved`'s results, each with its
    stages and how many times slower the system ``baseline`` was at p50 and p99
    (``<ratio>_over_this_p50`` and ``_p99``); and the mismatches over all of them."""
    rows: list[dict[str, Any]] = []
    mismatches = 0
    for threads, by_system in results.items():
        level = []
        for s in systems:
            res = by_system[s.name]
            mismatches += res.mismatches
            row = summarize(s.name, res.samples_ns, res.wall_s, concurrency=threads)
            row["mismatches"] = res.mismatches
            if res.stages_us is not None:
                row["stages"] = stage_summary(res.stages_us)
            level.append(row)
        base = next(row for row in level if row["system"] == baseline)
        for row in level:
            row[f"{ratio}_over_this_p50"] = round(base["p50_us"] / row["p50_us"], 2)
            row[f"{ratio}_over_this_p99"] = round(base["p99_us"] / row["p99_us"], 2)
        rows += level
    return rows, mismatches


def plot_levels(
    path: str, results: dict[int, dict[str, LevelResult]], rows: list[dict[str, Any]], title: str
) -> None:
    """The PNG beside ``path``: a latency CDF per concurrency level and the stage bars."""
    from kalos.bench.plots import plot_result

    png = plot_result(
        path,
        {
            f"{t} thread(s)": {s: res.samples_ns for s, res in by_system.items()}
            for t, by_system in results.items()
        },
        {
            f"{row['system']}, {row['concurrency']} thr": row["stages"]["mean_us"]
            for row in rows
            if row.get("stages")
        },
        title=title,
    )
    if png:
        print(f"wrote {png}")


def run_levels(
    name: str,
    systems: Sequence[System],
    order: np.ndarray,
    levels: Sequence[int],
    *,
    block: int,
    warmup: int,
    quiet: bool,
    on_level: Callable[[int], None] | None = None,
) -> dict[int, dict[str, LevelResult]]:
    """:func:`run_interleaved` at each concurrency level in turn, with one progress bar;
    ``warmup`` untimed calls per block at one thread (fewer per thread at more)."""
    results: dict[int, dict[str, LevelResult]] = {}
    with Progress(len(levels) * len(systems) * len(order), name, quiet=quiet) as progress:
        for threads in levels:
            if on_level is not None:
                on_level(threads)
            progress.update(0, f"{name}, {threads} thread(s)")
            results[threads] = run_interleaved(
                systems, order, threads, block=block,
                warmup=max(1, warmup // threads), progress=progress,
            )  # fmt: skip
    return results
