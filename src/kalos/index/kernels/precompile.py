"""Compiling a warm-up's kernel variants in parallel, in worker processes.

Triton compiles one variant at a time and holds the interpreter while it does (threads do not
help). A cuda index's warm-up launches 150 to 200 variants (its dry run with an H100's
launch shapes: 156 at 384 dimensions, 192 at 128), seconds of compile each: minutes from an
empty kernel cache. So the
warm-up first runs dry: with :func:`recording` active, :func:`launch` notes each kernel
launch (the kernel, its arguments' types, alignments and values, its options) instead of
running it. :func:`compile_all` then hands the distinct launches to worker processes
(``python -m kalos.index.kernels.precompile``), which compile each through Triton's own JIT
(``warmup``: the same specialisation and cache key as a launch, nothing runs) into the
shared disk cache (``TRITON_CACHE_DIR``). The warm-up then
runs for real: each launch finds its variant on disk and loads it. A variant the dry run did
not foresee still compiles then, in this process: slower, never wrong; :func:`compiles`
notes each variant the real warm-up takes, so that those are counted and named.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

log = logging.getLogger("kalos.index")

_state = threading.local()  # .launches: the recording list of this thread, when one is active


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, or, while this thread records, notes it instead."""
    noted = getattr(_state, "launches", None)
    if noted is None:
        kernel[grid](*args, **kwargs)
    else:
        noted.append((kernel, args, kwargs))


@contextmanager
def recording() -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Within it, this thread's :func:`launch` calls are noted in the list it yields, not
    run (what they would have written stays unwritten)."""
    noted: list[tuple[Any, tuple, dict]] = []
    _state.launches = noted
    try:
        yield noted
    finally:
        _state.launches = None


_POINTER = "kalos.tensor"  # (_POINTER, dtype, address mod 16): a tensor, to a worker


def _portable(value: Any) -> Any:
    """A tensor as the JIT specialises it: its dtype and its address mod 16."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return (_POINTER, str(value.dtype).removeprefix("torch."), value.data_ptr() % 16)
    return value


def _spec(value: Any, specialize: bool, align: bool) -> Any:
    """A runtime argument as Triton's JIT keys its variant: a tensor by dtype and whether its
    address is a multiple of 16; an integer by width and, unless the kernel says not to
    specialise it, whether it is 1 or a multiple of 16; a bool or float by type."""
    if isinstance(value, tuple) and value[:1] == (_POINTER,):
        return ("tensor", value[1], align and value[2] == 0)
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        width = "i32" if -(2**31) <= value < 2**31 else ("i64" if value < 2**63 else "u64")
        if not specialize:
            return width
        return 1 if value == 1 else (width, value % 16 == 0)
    if isinstance(value, float):
        return "fp32"
    return repr(value)


def _key(kernel: Any, args: tuple, kwargs: dict) -> str:
    """The variant a launch compiles: its kernel, its constexprs and options by value, every
    other argument by :func:`_spec`."""
    fn = kernel.fn
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params]
    opts = getattr(kernel, "kwargs", None) or {}  # an interpreted kernel keeps them there
    dns = set(getattr(kernel, "do_not_specialize", None) or opts.get("do_not_specialize") or ())
    dnsa = set(
        getattr(kernel, "do_not_specialize_on_alignment", None)
        or opts.get("do_not_specialize_on_alignment")
        or ()
    )
    bound = dict(zip(names, args, strict=False))
    bound.update((k, v) for k, v in kwargs.items() if k in names)
    key: list[Any] = [fn.__module__, fn.__name__]
    for i, p in enumerate(params):
        value = bound.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            key.append(repr(value))
        else:
            key.append(_spec(value, p.name not in dns and i not in dns,
                             p.name not in dnsa and i not in dnsa))  # fmt: skip
    key.append(sorted((k, repr(v)) for k, v in kwargs.items() if k not in names))
    return repr(key)


def variants(launches: list[tuple[Any, tuple, dict]]) -> list[tuple[str, str, tuple, dict]]:
    """The distinct variants of ``launches``, portable to another process: (module, kernel
    name, arguments, keyword arguments), tensors as (_POINTER, dtype, address mod 16)."""
    out: dict[str, tuple[str, str, tuple, dict]] = {}
    for kernel, args, kwargs in launches:
        a = tuple(_portable(x) for x in args)
        kw = {k: _portable(x) for k, x in kwargs.items()}
        out.setdefault(_key(kernel, a, kw), (kernel.fn.__module__, kernel.fn.__name__, a, kw))
    return list(out.values())


def workers_for(count: int) -> int:
    """Worker processes for ``count`` variants: one per CPU this process may run on, less
    one, at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(count, cpus - 1, 16))


def compile_all(found: list[tuple[str, str, tuple, dict]], *, device: int, workers: int,
                stop: Callable[[], bool] | None = None, timeout: float = 1800.0
                ) -> dict[str, Any]:  # fmt: skip
    """Compiles ``found`` (:func:`variants`) on ``workers`` processes into the disk cache for
    CUDA device ``device``. Returns what it did: variants, compiled, workers, seconds,
    failures (a worker that fails only leaves its variants to compile later) and keys (the
    JIT's key of each variant compiled, as :func:`compiles` notes them). ``stop``: polled;
    when it turns true the workers are killed and InterruptedError raised."""
    t0 = time.perf_counter()
    with ExitStack() as files:  # files, not pipes: a worker's output never blocks it
        procs = []
        for share in (found[i::workers] for i in range(workers)):
            if not share:
                continue
            out, err = (files.enter_context(tempfile.TemporaryFile()) for _ in range(2))
            with tempfile.TemporaryFile() as given:
                given.write(pickle.dumps(share))
                given.seek(0)
                p = subprocess.Popen(
                    [sys.executable, "-m", "kalos.index.kernels.precompile", str(device)],
                    stdin=given, stdout=out, stderr=err,
                )  # fmt: skip
            procs.append((p, out, err))
        failures = _wait(procs, stop, timeout)
        compiled, keys = 0, []
        for p, out, err in procs:
            out.seek(0)
            err.seek(0)
            if p.returncode == 0:
                done = pickle.loads(out.read())
                compiled += done["compiled"]
                keys += done["keys"]
            else:
                tail = err.read().decode(errors="replace").strip().splitlines()[-1:] or [""]
                failures.append(f"worker exited {p.returncode}: {tail[0]}")
    for f in failures:
        log.warning("kernel precompile: %s (those variants compile at the warm-up)", f)
    return {"variants": len(found), "compiled": compiled, "workers": len(procs),
            "seconds": round(time.perf_counter() - t0, 2), "failures": failures,
            "keys": keys}  # fmt: skip


def _wait(procs: list[tuple[Any, Any, Any]], stop: Callable[[], bool] | None, timeout: float
          ) -> list[str]:  # fmt: skip
    """Until every worker has exited (a stop or the timeout kills those still running)."""
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p, _, _ in procs):
            if stop is not None and stop():
                raise InterruptedError("stopped during the kernel precompile")
            if time.monotonic() > deadline:
                failures.append(f"precompile workers still running after {timeout} s: killed")
                break
            time.sleep(0.05)
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return failures


@contextmanager
def compiles() -> Iterator[list[tuple[str, str]]]:
    """Within it, each kernel variant this process compiles or loads from the disk cache
    (first use in the process) is noted in the list it yields as (the JIT's key, a readable
    name), through Triton's ``jit_cache_hook`` (a hook already set still runs)."""
    from triton import knobs

    noted: list[tuple[str, str]] = []
    before = knobs.runtime.jit_cache_hook

    def hook(*, key: Any, repr: str, **kwargs: Any) -> bool | None:
        noted.append((str(key), repr))
        return before(key=key, repr=repr, **kwargs) if before is not None else None

    knobs.runtime.jit_cache_hook = hook
    try:
        yield noted
    finally:
        knobs.runtime.jit_cache_hook = before


def _compile_share(share: list[tuple[str, str, tuple, dict]], device: int) -> dict[str, Any]:
    """A worker's part: each variant through the JIT's warmup (compiled, cached, not run)
    and loaded. A tensor argument is a small tensor of its dtype at its address mod 16 (all
    the JIT reads of a tensor); the rest go as they were."""
    import torch

    torch.cuda.set_device(device)
    base = torch.zeros(64, dtype=torch.uint8, device=f"cuda:{device}")  # 512-byte aligned

    def real(x: Any) -> Any:
        if isinstance(x, tuple) and x[:1] == (_POINTER,):
            dtype = getattr(torch, x[1])
            return base[x[2] : x[2] + 16].view(dtype)
        return x

    done = 0
    with compiles() as noted:
        for module, name, args, kwargs in share:
            kernel = getattr(importlib.import_module(module), name)
            compiled = kernel.warmup(
                *(real(a) for a in args), grid=(1,), **{k: real(x) for k, x in kwargs.items()}
            )
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            # its launcher too (a C module built per signature, into the same disk cache),
            # and the binary loaded once, which checks it fits the device (shared memory)
            init = getattr(compiled, "_init_handles", None)
            if init is not None:
                init()
            done += 1
    return {"compiled": done, "keys": [key for key, _ in noted]}


def main() -> int:
    share = pickle.loads(sys.stdin.buffer.read())
    sys.stdout.buffer.write(pickle.dumps(_compile_share(share, int(sys.argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
