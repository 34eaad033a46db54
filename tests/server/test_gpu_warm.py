"""A cuda sidecar's warm-up (GpuSearch.warm, CudaFlatIndex.warm) covers every kernel variant
its searches launch afterwards, on the CPU.

Every Triton kernel (each ``*_kernel`` of the package's modules) is replaced by a recorder
that notes the variant a launch would compile, as Triton's JIT keys it: the kernel, its
constexpr values, the specialisation of every other argument (type, ==1 / divisible by 16,
pointer alignment, except where the kernel's ``do_not_specialize`` says not to) and the
launch options. The recorder does not run the kernel (only which variant is launched matters
here, and the interpreter would take minutes): a prefiltered search then looks unproven and
also launches the full scan, which only adds launches. The warm-up's variants are recorded
first; then random searches through every path the server takes, on an index that grows past
the prefilter's threshold and through several capacities, must launch none that it missed.
"""

from __future__ import annotations

# isort: off
from triton_interp import torch, triton

# isort: on

import inspect
import pickle
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

try:  # Triton's own specialisation of an argument (its JIT's cache key), as the JIT computes it
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
except ImportError:  # pragma: no cover - an older Triton
    pytest.skip("this triton has no native_specialize_impl", allow_module_level=True)

from cuda_reference import make_index
from kalos.gpu import driver
from kalos.index.cuda_flat import _MAX_K
from kalos.index.kernels import (  # noqa: F401  (recorded)
    ivf_keys,
    precompile,
    scan_topk,
    topk_small,
)
from kalos.protocol import layout as L
from kalos.protocol import messages as M
from kalos.server.channels import ServerChannel
from kalos.server.doorbell import ArmedGraph
from kalos.server.gpu_search import GPU_MAX_HITS, GpuSearch

THRESHOLD = 1500  # the prefilter's, lowered: the index grows past it


class Registry:
    """The kernel variants launched while recording (see the module doc)."""

    def __init__(self) -> None:
        self.variants: set[tuple] = set()
        self.launches = 0

    def record(self, kernel, args: tuple, kwargs: dict) -> None:
        params = list(inspect.signature(kernel.fn).parameters.values())
        names = [p.name for p in params]
        dns = set(kernel.kwargs.get("do_not_specialize") or ())
        dnsa = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
        bound = dict(zip(names, args, strict=False))
        options = {}
        for name, value in kwargs.items():
            if name in names:
                bound[name] = value
            else:
                options[name] = value
        key: list = [kernel.fn.__module__ + "." + kernel.fn.__name__]
        for i, p in enumerate(params):
            value = bound.get(p.name, p.default)
            if "constexpr" in str(p.annotation):
                key.append((p.name, value))
            else:
                specialize = p.name not in dns and i not in dns
                align = p.name not in dnsa and i not in dnsa
                spec = native_specialize_impl(BaseBackend, value, False, specialize, align)
                key.append((p.name, spec))
        key.append(tuple(sorted(options.items())))
        self.variants.add(tuple(key))
        self.launches += 1


class Recorder:
    """Stands in for one kernel: ``kernel[grid](*args, **kwargs)`` records, runs nothing."""

    def __init__(self, kernel, registry: Registry) -> None:
        self.kernel = kernel
        self.registry = registry

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.registry.record(self.kernel, args, kwargs)


@pytest.fixture
def registry(monkeypatch):
    reg = Registry()
    interpreted = triton.runtime.interpreter.InterpretedFunction
    for name, module in list(sys.modules.items()):
        if not name.startswith("kalos.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if attr.endswith("_kernel") and isinstance(value, interpreted):
                monkeypatch.setattr(module, attr, Recorder(value, reg))
    return reg


@pytest.fixture(
    params=[(64, 0), (272, 0), (272, 16)], ids=["int8-prefilter", "4bit-cascade", "4bit-batched"]
)
def gpu(monkeypatch, request):
    """A GpuSearch with its doorbell over an interpreted index (no CUDA: host registration
    is recorded, page-locking is a no-op, the stream is None)."""
    registered: list[int] = []
    monkeypatch.setattr(driver, "host_register", lambda ptr, n: registered.append(ptr))
    monkeypatch.setattr(driver, "host_unregister", lambda ptr: registered.remove(ptr))
    monkeypatch.setattr(driver, "ensure_context", lambda device: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **kw: None)
    # The launch shapes a GPU would take (nothing runs here): they differ by batch and k
    from kalos.index.kernels import codes4, scan_topk

    choose, choose_prefilter = scan_topk.choose_config, scan_topk.choose_prefilter_config
    choose4 = codes4.choose_config
    monkeypatch.setattr(codes4, "choose_config", lambda d, on_gpu: choose4(d, True))
    monkeypatch.setattr(
        scan_topk, "choose_config", lambda d, e, nq, k, on_gpu: choose(d, e, nq, k, True)
    )
    monkeypatch.setattr(
        scan_topk,
        "choose_prefilter_config",
        lambda d, on_gpu, mode=2: choose_prefilter(d, True, mode),
    )
    dim, batch4 = request.param
    index = make_index("ip", "fp16", dim, "cpu")  # 272: the 4-bit cascade's dims
    index.batch4_max_batch = batch4  # 16: batches of 2 to 16 through the batched cascade
    index._sms = 16  # more programs, as on a GPU: the count changes as the capacity grows
    index.prefilter_min_rows = THRESHOLD
    gpu = GpuSearch(index, doorbell=True)
    assert gpu.doorbell is not None
    yield gpu
    assert registered == []


def grow(index, n: int, rng: np.random.Generator) -> None:
    m = n - len(index)
    scopes = np.zeros((m, 3), np.int64)
    scopes[:, 0] = rng.integers(1, 3, m)
    ids = np.arange(len(index), n, dtype=np.int64) + 1
    index.add(rng.standard_normal((m, index.dim)).astype(np.float32), ids, scopes)


class Channel:
    """A shm channel's GPU side: its registered arena (in-place results the kernel may
    publish) and a GPU result buffer's tensors."""

    def __init__(self, gpu: GpuSearch) -> None:
        self.ch = ServerChannel(1, 7, L.MIN_ARENA_BYTES)
        self.pinned = gpu.pin(self.ch.resp_arena, self.ch.buf[: L.CHANNEL_HEADER_SIZE],
                              self.ch.req_arena)  # fmt: skip
        self.buffer = SimpleNamespace(
            query=torch.zeros((gpu.max_batch, gpu.index.dim)),
            scores=torch.zeros(GPU_MAX_HITS),
            ids=torch.zeros(GPU_MAX_HITS, dtype=torch.int64),
            graphs={},
        )

    def close(self, gpu: GpuSearch) -> None:
        gpu.unpin(self.pinned)


def random_searches(gpu: GpuSearch, channel: Channel, rng: np.random.Generator, count: int):
    """Searches through every path a cuda sidecar takes, with random shapes."""
    index = gpu.index
    batch = gpu.max_batch
    for _ in range(count):
        k = int(rng.integers(1, _MAX_K + 1)) if rng.random() < 0.5 else int(rng.integers(1, 33))
        nq = 1 if rng.random() < 0.4 else int(rng.integers(1, batch + 1))
        scope = (int(rng.integers(1, 3)), 0, 0) if rng.random() < 0.5 else None
        q = rng.standard_normal((nq, index.dim)).astype(np.float32)
        path = rng.integers(0, 5)
        if path == 0:  # host results through the staging graphs (uds, grpc)
            gpu.search(q, k, scope)
        elif path == 1:  # in place, into the channel's response arena (the kernel publishes)
            if M.search_response_size(nq, k) > len(channel.ch.resp_arena):
                continue
            _, scores, ids = M.search_response_views(channel.ch.resp_arena, nq, k)
            gpu.search(q, k, scope, out=(scores, ids), pinned=channel.pinned)
            graph = channel.pinned.graphs.get((nq, k, scope is not None))
            # a search the kernel published: the doorbell arms that graph (Doorbell.arm)
            if graph is not None and graph.publish is not None and len(index) >= THRESHOLD:
                armed = ArmedGraph(gpu.doorbell, channel.pinned, graph, int(rng.choice([2, 4])))
                armed.work()
                armed.close()
        elif path == 2:  # GPU results, the query from pinned staging or in the GPU slots
            if nq * k > GPU_MAX_HITS:
                continue
            gpu.search_to_device(channel.buffer, None if rng.random() < 0.5 else q, nq, k, scope)
        elif path == 3:  # more queries than a graph takes: the index's batches
            big = rng.standard_normal((int(rng.integers(batch + 1, 3 * batch)), index.dim))
            index.search(big.astype(np.float32), k, scope=scope)
        else:  # the plain host path of one batch
            index.search(q, k, scope=scope)


def test_no_search_after_the_warm_up_launches_a_variant_it_missed(gpu, registry):
    rng = np.random.default_rng(11)
    index = gpu.index
    grow(index, 300, rng)
    gpu.warm()
    warm = set(registry.variants)
    assert warm and registry.launches > 100
    registry.variants.clear()
    channel = Channel(gpu)
    try:
        # below the prefilter's threshold, then past it, through three capacities (each
        # with more programs than the last)
        caps = []
        for n in (300, 1200, THRESHOLD + 500, 5000):
            if len(index) < n:
                grow(index, n, rng)
            caps.append(index.capacity)
            random_searches(gpu, channel, rng, 120)
        assert len(set(caps)) >= 3 and all(c % 16 == 0 for c in caps)
        missed = registry.variants - warm
        assert not missed, "launched after the warm-up, not by it:\n" + "\n".join(
            str(v) for v in sorted(missed, key=str)[:3]
        )
        assert index.prefilter_searches > 0  # the prefilter ran
    finally:
        channel.close(gpu)


def test_odd_capacities_are_rounded_to_a_multiple_of_16():
    index = make_index("ip", "fp16", 64, "cpu")
    index.reserve(5001)
    assert index.capacity == 5008
    index.add(np.zeros((5009, 64), np.float32), np.arange(5009, dtype=np.int64) + 1)
    assert index.capacity % 16 == 0 and index.capacity >= 5009


def test_the_dry_warm_up_notes_every_variant_of_the_warm_up_and_runs_none(gpu, registry):
    index = gpu.index
    grow(index, 300, np.random.default_rng(3))
    with precompile.recording() as noted:
        dry = index._warm_launches(publish=True, gated=True, stop=None, dry=True)
    assert registry.launches == 0 and len(noted) >= dry > 100  # noted, none launched
    launches = [(rec.kernel, args, kwargs) for rec, args, kwargs in noted]
    for kernel, args, kwargs in launches:
        registry.record(kernel, args, kwargs)
    planned = set(registry.variants)
    # the portable variants are the JIT's: none merged, none split
    found = precompile.variants(launches)
    assert len(found) == len(planned)
    assert pickle.loads(pickle.dumps(found)) == found  # what a worker process is handed
    registry.variants.clear()
    index.warm()  # the real warm-up (no precompile off a GPU) launches nothing unplanned
    assert registry.variants and registry.variants <= planned


def test_the_warm_up_times_its_dry_run_compile_and_launches(gpu, registry, monkeypatch):
    """With the parallel compile (a GPU's default; here its workers stood in for): what it
    did, with the seconds of the dry run and of the real launches beside the compile's, as
    the sidecar's log line gives them."""
    handed: list[int] = []

    def compile_all(found, *, device, workers, stop=None):  # type: ignore[no-untyped-def]
        handed.append(len(found))
        return {"variants": len(found), "compiled": len(found), "workers": workers,
                "seconds": 0.25, "failures": 0, "keys": []}  # fmt: skip

    real_variants = precompile.variants  # of the kernels the recorders stand in for

    def variants(noted):  # type: ignore[no-untyped-def]
        return real_variants([(rec.kernel, args, kwargs) for rec, args, kwargs in noted])

    monkeypatch.setattr(precompile, "compile_all", compile_all)
    monkeypatch.setattr(precompile, "variants", variants)
    index = gpu.index
    launches = index.warm(precompile=True)
    done = index.precompiled
    assert launches > 100 and handed == [done["variants"]] and done["variants"] > 50
    assert done["dry_s"] > 0 and done["launches_s"] > 0 and done["seconds"] == 0.25
    assert registry.launches > 0  # the real launches ran after the dry one


def test_the_fused_scan_has_one_variant_for_every_grid(gpu, registry):
    # the final selection's step (CHUNK) is one width whatever the program count, so the
    # warm-up's scan variants do not multiply by the classes of program count its capacity
    # can reach (merge_topk's step still follows them: several classes are walked here)
    index = gpu.index
    grow(index, 300, np.random.default_rng(5))
    with precompile.recording() as noted:
        index._warm_launches(publish=True, gated=True, stop=None, dry=True)
    steps: dict[str, set[int]] = {"_scan_topk_kernel": set(), "_merge_topk_kernel": set()}
    for rec, _, kwargs in noted:
        name = rec.kernel.fn.__name__
        if name in steps:
            steps[name].add(kwargs["CHUNK"])
    assert len(steps["_merge_topk_kernel"]) > 1
    assert steps["_scan_topk_kernel"] == {scan_topk.FUSED_CHUNK}


def test_a_failing_precompile_worker_is_reported_and_a_stop_ends_them():
    found = [("kalos.index.kernels.scan_topk", "_scan_topk_kernel", (), {})]
    # no CUDA here: the worker fails at its device, which the warm-up only reports
    done = precompile.compile_all(found * 2, device=0, workers=2)
    assert done["variants"] == 2 and done["compiled"] == 0 and done["workers"] == 2
    assert len(done["failures"]) == 2 and "worker exited" in done["failures"][0]
    with pytest.raises(InterruptedError):
        precompile.compile_all(found, device=0, workers=1, stop=lambda: True)


def test_launch_runs_the_kernel_unless_this_thread_records():
    ran = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: ran.append((grid, args, kwargs))

    precompile.launch(Kernel(), (3,), 1, X=2)
    assert ran == [((3,), (1,), {"X": 2})]
    with precompile.recording() as noted:
        precompile.launch(Kernel(), (4,), 5)
        other = []
        t = threading.Thread(target=lambda: other.append(precompile.launch(Kernel(), (6,))))
        t.start()
        t.join()
    assert len(ran) == 2 and ran[1][0] == (6,)  # another thread's launch ran
    assert len(noted) == 1 and noted[0][1] == (5,)
    precompile.launch(Kernel(), (7,))
    assert len(ran) == 3  # recording ended


def test_compiles_notes_each_variant_the_jit_takes_and_keeps_a_hook_already_set():
    from triton import knobs

    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["key"])
    try:
        with precompile.compiles() as noted:
            knobs.runtime.jit_cache_hook(key="k1", repr="kernel[num_warps=4](...)", fn=None)
        assert noted == [("k1", "kernel[num_warps=4](...)")] and seen == ["k1"]
        assert knobs.runtime.jit_cache_hook(key="k2", repr="", fn=None) is None  # restored
        assert seen == ["k1", "k2"] and len(noted) == 1
    finally:
        knobs.runtime.jit_cache_hook = None


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_the_cuda_ivf_warm_up_launches_the_variant_of_every_search(registry, metric):
    """cuda:ivf's kernels (kalos.index.kernels.ivf_keys, topk_small) have one variant per
    index and k's power of two, whatever the nprobe, the width and the batch: the warm-up's
    launches on scratch rows are every one of them."""
    from kalos.index.cuda_ivf import CudaIvfIndex
    from kalos.index.kernels.topk_small import MAX_K

    index = CudaIvfIndex("cuda:ivf,nlist=16,nprobe=2", dim=48, metric=metric, device="cpu")
    index.use_kernel()
    rng = np.random.default_rng(3)
    index.add(rng.standard_normal((2000, 48)).astype(np.float32), np.arange(2000))
    index.flush()
    index.warm()
    warm = set(registry.variants)
    assert len(warm) == 1 + 2 * (MAX_K.bit_length())  # the keys; each k's power of two, 2 stages
    main = index._main
    small, index._topk_small = index._topk_small, None  # the lists in torch: nothing recorded
    for nq, probes, width in [(1, 1, 1024), (1, 16, 4096), (5, 3, 777), (64, 7, 2048)]:
        q = torch.from_numpy(rng.standard_normal((nq, 48)).astype(np.float32))
        ends, base = index._lists_of(q, probes)
        index._ivf_keys(q, main.vecs, main.sq, ends, base, width, metric == "l2")
        for k in (1, 3, 10, 33, MAX_K):
            small.topk_small(torch.zeros((nq, width)), min(k, width))
    assert registry.variants == warm
