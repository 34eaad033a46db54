"""The CUDA driver API calls Kalos makes, via ctypes (libcuda, present wherever the driver
is): CUDA IPC of the channels' GPU result buffers, page-locking of the channels' response
arenas (:func:`host_register`), and launching a captured graph and waiting for it
(:func:`graph_launcher`).

The sidecar allocates each channel's GPU result buffer with ``cuMemAlloc`` (not through
torch's caching allocator, whose blocks are sub-allocated: an IPC handle names a whole
allocation) and exports it with ``cuIpcGetMemHandle``; the client opens the 64-byte handle
once with ``cuIpcOpenMemHandle`` and wraps the memory as torch tensors through the CUDA array
interface: no copy, no /dev/shm file (torch.multiprocessing's IPC would create one for its
reference counts).

Both sides must have torch's primary context current on the calling thread (torch makes it
current on first use: call :func:`ensure_context` after ``torch.cuda.init``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

from kalos.errors import ConfigError

IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_DEVICEMAP = 2
_EVENT_DISABLE_TIMING = 2
_NOT_READY = 600  # CUDA_ERROR_NOT_READY
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context current on the calling thread

log = logging.getLogger("kalos.gpu")

_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def _driver() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise ConfigError(
                    f"the CUDA driver (libcuda.so.1) is not available: {exc}"
                ) from exc
            lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
            lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
            lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
            lib.cuIpcOpenMemHandle_v2.argtypes = [
                ctypes.POINTER(ctypes.c_uint64),
                _IpcHandle,
                ctypes.c_uint,
            ]
            lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
            lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
            lib.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
            lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cuEventQuery.argtypes = [ctypes.c_void_p]
            lib.cuEventSynchronize.argtypes = [ctypes.c_void_p]
            lib.cuEventDestroy_v2.argtypes = [ctypes.c_void_p]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
            lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
            lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
            lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
            _lib = lib
        return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else "unknown error"
        raise RuntimeError(f"{what} failed: CUDA error {rc} ({text})")


def ensure_context(device: int) -> None:
    """Makes torch's primary context of ``device`` current on this thread. A thread that has
    made no CUDA runtime call has no current context, and ``torch.cuda.set_device`` does not
    bind one there when torch's cached device already matches: so through the driver."""
    import torch

    torch.cuda.init()
    lib = _driver()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    try:
        _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    finally:  # torch holds the primary context: this reference was only for the lookup
        lib.cuDevicePrimaryCtxRelease_v2(dev)
    torch.cuda.set_device(device)


def mem_alloc(nbytes: int) -> int:
    ptr = ctypes.c_uint64()
    _check(_driver().cuMemAlloc_v2(ctypes.byref(ptr), nbytes), "cuMemAlloc")
    return ptr.value


def mem_free(ptr: int) -> None:
    _check(_driver().cuMemFree_v2(ptr), "cuMemFree")


def host_register(ptr: int, nbytes: int) -> None:
    """Page-locks ``nbytes`` of host memory at ``ptr`` (e.g. a shared-memory channel) and maps
    it for every device: with unified addressing, kernels read and write it at ``ptr`` itself.
    Undo with :func:`host_unregister` before the memory is unmapped."""
    _check(
        _driver().cuMemHostRegister_v2(
            ptr, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_DEVICEMAP
        ),
        "cuMemHostRegister",
    )


def host_unregister(ptr: int) -> None:
    _check(_driver().cuMemHostUnregister(ptr), "cuMemHostUnregister")


def current_context() -> int:
    """The CUDA context current on this thread (0: none)."""
    ctx = ctypes.c_void_p()
    _check(_driver().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    return ctx.value or 0


def graph_launcher(graph_exec: int, stream: int, device: int | None = None) -> Any:
    """A no-argument function that launches the instantiated CUDA graph ``graph_exec`` (a
    ``cudaGraphExec_t``, e.g. torch's ``CUDAGraph.raw_cuda_graph_exec()``) on ``stream`` (a
    ``cudaStream_t``) and waits for the stream, through the driver: no torch bookkeeping per
    launch. ctypes drops the GIL during both calls. With ``device``, a thread that finds no
    context current (CUDA_ERROR_INVALID_CONTEXT) makes torch's primary context of that
    device current (:func:`ensure_context`) and launches again, once; a warning says so."""
    lib = _driver()
    launch, sync = lib.cuGraphLaunch, lib.cuStreamSynchronize
    g, s = ctypes.c_void_p(graph_exec), ctypes.c_void_p(stream)

    def run() -> None:
        rc = launch(g, s)
        if rc == _INVALID_CONTEXT and device is not None:
            log.warning(
                "no CUDA context current on thread %r (context %#x): making device %d's "
                "current", threading.current_thread().name, current_context(), device,
            )  # fmt: skip
            ensure_context(device)
            rc = launch(g, s)
        if rc == 0:
            rc = sync(s)
        if rc != 0:
            _check(rc, "cuGraphLaunch + cuStreamSynchronize")

    return run


class GraphLaunch:
    """Launches one instantiated CUDA graph on a stream without waiting, and records an event
    after each launch, so that the caller can ask whether the last launch, or the one before
    it, has finished (:meth:`done`), or wait for the last (:meth:`wait`), while later work
    queued on the stream goes on. ctypes drops the GIL during each call."""

    def __init__(self, graph_exec: int, stream: int) -> None:
        lib = _driver()
        self._launch, self._record = lib.cuGraphLaunch, lib.cuEventRecord
        self._query, self._sync = lib.cuEventQuery, lib.cuEventSynchronize
        self._graph, self._stream = ctypes.c_void_p(graph_exec), ctypes.c_void_p(stream)
        self._events: list[ctypes.c_void_p] = []
        for _ in range(2):  # the last launch's and the one before it, alternately
            event = ctypes.c_void_p()
            _check(lib.cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING), "cuEventCreate")
            self._events.append(event)
        self._last = 0

    def __call__(self) -> None:
        self._last ^= 1
        rc = self._launch(self._graph, self._stream)
        if rc == 0:
            rc = self._record(self._events[self._last], self._stream)
        if rc != 0:
            _check(rc, "cuGraphLaunch + cuEventRecord")

    def done(self, previous: bool = False) -> bool:
        """Whether the last launch (``previous``: the one before it) has finished; True for
        one that never happened."""
        rc = self._query(self._events[self._last ^ previous])
        if rc == _NOT_READY:
            return False
        _check(rc, "cuEventQuery")
        return True

    def wait(self) -> None:
        """Returns once the last launch has finished."""
        _check(self._sync(self._events[self._last]), "cuEventSynchronize")

    def close(self) -> None:
        for event in self._events:
            _driver().cuEventDestroy_v2(event)
        self._events = []


def ipc_handle(ptr: int) -> bytes:
    """The 64-byte IPC handle of an allocation made by :func:`mem_alloc`."""
    h = _IpcHandle()
    _check(_driver().cuIpcGetMemHandle(ctypes.byref(h), ptr), "cuIpcGetMemHandle")
    return bytes(h)  # all 64 bytes (the field's own getter would stop at a zero byte)


def ipc_open(handle: bytes) -> int:
    """Maps another process's allocation; returns its address in this process."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError("a CUDA IPC handle is 64 bytes")
    h = _IpcHandle.from_buffer_copy(handle)
    ptr = ctypes.c_uint64()
    _check(
        _driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS),
        "cuIpcOpenMemHandle",
    )
    return ptr.value


def ipc_close(ptr: int) -> None:
    _check(_driver().cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


class _CudaArray:
    """Describes device memory to torch through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,  # no synchronisation implied: ordering is the protocol's job
        }


def tensor_at(ptr: int, shape: tuple[int, ...], dtype: Any, device: int) -> Any:
    """A torch tensor over ``ptr`` (not owned: the buffer must outlive it)."""
    import numpy as np
    import torch

    typestr = np.dtype(str(dtype).replace("torch.", "")).str
    return torch.as_tensor(_CudaArray(ptr, shape, typestr), device=f"cuda:{device}")
