"""The asyncio client: :class:`AsyncClient`, for FastAPI and vLLM-style API servers.

Every method of :class:`kalos.Client` is here as a coroutine with the same arguments and
results; awaiting one never blocks the event loop. ``await kalos.connect_async(name)`` (or
``async with kalos.AsyncClient(name) as client``) makes one.

How: a pool of channel threads, each owning one channel of a private :class:`Client` (the
sync client keeps one channel per thread). A call on the event loop queues a job; an idle
channel thread (a new one while fewer than ``max_channels`` exist) runs the sync call, which
spins and parks on its channel with the GIL released (parks at once while more of the
process's calls wait than a quarter of its CPUs, as every sync caller does:
``kalos.transport.shm.SPINNERS``), copies any view out of the channel and hands the result
back to the loop: one ``loop.call_soon_threadsafe`` (a wake-up of the loop) for all the
results that arrive before the loop comes round to them. Beyond ``max_channels`` calls in
flight, calls queue (first in, first out) for the next free channel; the deadline of
a call counts from the moment it was awaited, queueing included.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from kalos.client import Client, Timings, forked_in_child
from kalos.errors import ClosedError, ConfigError, ConnectError
from kalos.options import ClientOptions, ClientOptionsArgs, timeout_error
from kalos.transport import Transport

if TYPE_CHECKING:
    from typing import Unpack

P = ParamSpec("P")
R = TypeVar("R")

_monotonic_ns = time.monotonic_ns

# The timings of the current task's last completed call (a task sees only its own).
_last_timings: contextvars.ContextVar[Timings | None] = contextvars.ContextVar(
    "kalos_async_last_timings", default=None
)


def _owned(value: Any) -> Any:
    """``value`` with every view into a channel replaced by a copy the caller owns.

    Numpy arrays that do not own their memory are copied; named tuples (SearchResult,
    Context, ...) are rebuilt around owned fields; torch tensors (search_gpu's, over the
    channel's GPU result buffer) are cloned, and the clone completed before the channel can
    take its next request. Everything else the sync client returns is owned already.
    """
    if isinstance(value, np.ndarray):
        return value if value.flags.owndata else value.copy()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        fields = [_owned(v) for v in value]
        if all(a is b for a, b in zip(fields, value, strict=True)):
            return value
        return type(value)(*fields)
    if type(value).__module__.startswith("torch") and hasattr(value, "clone"):
        copy = value.clone()
        if copy.is_cuda:
            import torch

            torch.cuda.current_stream(copy.device).synchronize()
        return copy
    return value


class _Job:
    """One call: run on a channel thread, or expired on the loop while it still queued."""

    __slots__ = (
        "args", "claim", "future", "kwargs", "loop", "method", "start", "stream", "timeout",
    )  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future,
        method: Callable[..., Any],
        args: tuple,
        kwargs: dict[str, Any],
        timeout: float,
        start: int,
    ) -> None:
        self.loop = loop
        self.future = future
        self.method = method
        self.args = args
        self.kwargs = kwargs
        self.timeout = timeout  # seconds, from ``start`` (the await)
        self.start = start
        self.stream = _cuda_stream(args, kwargs)
        # Whoever takes it first runs the job: a channel thread, or the loop's deadline timer.
        self.claim = threading.Lock()

    def left(self) -> float:
        """Seconds of the deadline left (0 once it passed)."""
        return max(0.0, self.timeout - (_monotonic_ns() - self.start) * 1e-9)


def _cuda_stream(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The awaiting caller's current CUDA stream when an argument is a torch CUDA tensor (a
    search_gpu query), else None. The channel thread runs the call on that stream, so the
    query's copy into the channel follows the caller's work on it, as in the sync client."""
    for arg in (*args, *kwargs.values()):
        if getattr(arg, "is_cuda", False) is True:
            import torch

            return torch.cuda.current_stream(arg.device)
    return None


def _resolve(future: asyncio.Future, ok: bool, value: Any) -> None:
    """On the loop: completes the awaiting task's future (unless it was cancelled)."""
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


class _Completions:
    """Results handed back from channel threads to their loops, one wake-up for all that
    arrive before the loop comes round to them: a thread appends its result to its loop's
    queue and schedules a drain only when none is pending (``call_soon_threadsafe`` writes to
    the loop's self-pipe: a syscall and a wake-up a call otherwise)."""

    def __init__(self, done: weakref.WeakMethod) -> None:
        # weak: no cycle through it keeps a dropped AsyncClient (and its threads) alive
        self._done = done
        self.reset()

    def reset(self) -> None:
        """Nothing handed back (made new in a fork's child: no result of the parent's is
        the child's, and a lock held by a parent's thread at the fork stays held)."""
        # loop -> [its results, whether a drain is scheduled]
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def hand_back(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, ok: bool,
                  value: Any) -> None:  # fmt: skip
        """On a channel thread: ``future``'s result, resolved on ``loop`` by ``done``."""
        entry = self._queues.get(loop)
        if entry is None:
            with self._lock:
                entry = self._queues.setdefault(loop, [collections.deque(), False])
        entry[0].append((future, ok, value))  # before the flag is read (see _drain)
        if not entry[1]:
            entry[1] = True
            try:
                loop.call_soon_threadsafe(self._drain, entry)
            except RuntimeError:  # a closed loop: nobody waits for these
                entry[1] = False

    def _drain(self, entry: list[Any]) -> None:
        """On the loop: every result handed back so far. The flag drops first, so a result
        appended after the last pop schedules a drain of its own."""
        entry[1] = False
        results = entry[0]
        done = self._done()
        if done is None:  # the client is gone: nobody awaits these
            results.clear()
            return
        while results:
            done(*results.popleft())


class _ChannelThreads:
    """Up to ``limit`` threads taking jobs from one FIFO queue; each keeps its channel.

    A thread starts when a job finds no idle one and fewer than ``limit`` run; threads live
    until :meth:`stop` (or until the AsyncClient that made them is garbage).
    """

    def __init__(self, limit: int, run: weakref.WeakMethod) -> None:
        self.limit = limit
        self._run = run  # weak: the threads never keep their AsyncClient alive
        self.reset()

    def reset(self) -> None:
        """No thread and no job (made new in a fork's child, where no thread of the parent
        runs: a job queued for one would wait out its deadline)."""
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # released by a thread when it waits for a job
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, job: _Job) -> None:
        self._jobs.put(job)
        if self._idle.acquire(blocking=False):
            return  # an idle thread takes it
        with self._lock:
            if len(self._threads) < self.limit:
                t = threading.Thread(
                    target=_serve,
                    args=(self._jobs, self._idle, self._run),
                    name=f"kalos-async-{len(self._threads)}",
                    daemon=True,  # never keeps the interpreter alive; close() ends them
                )
                t.start()
                self._threads.append(t)

    @property
    def started(self) -> int:
        return len(self._threads)

    def stop(self) -> None:
        """Ends every thread once the jobs already queued are done."""
        with self._lock:
            for _ in self._threads:
                self._jobs.put(None)
            self._threads = []
            self.limit = 0


def _serve(
    jobs: queue.SimpleQueue[_Job | None], idle: threading.Semaphore, run: weakref.WeakMethod
) -> None:
    """A channel thread's loop. It holds its AsyncClient only while running a job, so a client
    dropped without close is collected, and its finalizer ends the threads."""
    while True:
        job = jobs.get()
        if job is None:
            return
        method = run()
        if method is None:
            return
        method(job)
        del job, method
        idle.release()


def _no_op(client: Client, *, timeout: float) -> None:
    """The job of :meth:`AsyncClient.connect`: making the sync client is the work."""


def _forward(
    method: Callable[Concatenate[Client, P], R],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, R]]:
    """``Client.<method>`` as a coroutine method of AsyncClient: same arguments, same result
    (owned), run on a channel thread."""

    async def call(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._call(method, args, kwargs)

    functools.update_wrapper(call, method)  # name, docstring, signature (__wrapped__)
    return call


class AsyncClient:
    """An asyncio client of one sidecar: every :class:`kalos.Client` method as a coroutine.

    ``await kalos.connect_async(name, ...)`` or ``async with kalos.AsyncClient(name, ...)``
    connects (the handshake runs on a channel thread, not on the loop); the options are
    :func:`kalos.connect`'s (:class:`kalos.ClientOptions`, as keywords or ``options=``), plus
    ``max_channels``; ``connector`` is :class:`kalos.Client`'s. Any number of tasks may share
    one client.

    Concurrency: each call in flight holds one channel (single producer, single consumer) and
    one channel thread; up to ``max_channels`` (default 32) of them, opened as concurrency
    demands, each ``4 KiB + 2 × arena_bytes`` of shared memory. Further calls queue, first in
    first out; a call's ``timeout`` counts from its await, time queued included.

    Results are owned: ``search``, ``context`` and ``search_gpu`` return copies, made on the
    channel thread before the channel takes another request, so no other task's call can
    overwrite them (``copy`` is accepted and changes nothing). ``timings.total_us`` in a result
    is the round trip seen by the channel thread; :meth:`ping` and :attr:`last_timings` give
    the whole await, thread hops included. ``last_timings`` is per task. (The sync client's
    per-thread benchmark stamps, ``record_stages`` and ``last_stamps``, have no counterpart.)

    Failures are the sync client's: SidecarGone, RequestTimeout, ``on_unavailable="degrade"``,
    reconnecting on a later call (``reconnects``). A cancelled await never corrupts a channel:
    a call still queued is dropped, one already sent finishes on its channel thread (within
    its deadline) and its result is discarded before the channel serves anyone else.

    Cost (channel threads, chosen over an eventfd wake-up negotiated per channel, which would
    touch the handshake and the poller and save only the request-side hop): the loop never
    waits on a channel; each call pays two thread hops, loop to a channel thread through a
    queue and back through ``call_soon_threadsafe``, about 45-50 µs on a shared 2-core VM.
    ``kalos bench async`` there (4,000 pings, shm): ping p50 from one task 51-54 µs against
    the sync client's 4.5 µs (11-12x) while the machine was quiet enough for the sync
    client's spin to catch the response, and 122-136 µs against 66 µs (1.9-2.1x) under other
    load (load average ~4.5), when both park. With 8 tasks against 8 threads of a sync client
    the throughput was 1.0-1.8x the sync client's (the hops overlap; 8 spinning threads on 2
    cores do not). So: a few-µs sync call costs ~50 µs awaited there; worth it where the loop
    must not stall, not inside a tight loop (use a sync Client on a thread of your own for
    that). ``kalos bench async`` on the target machine gives the numbers to quote.
    """

    def __init__(
        self,
        name: str,
        *,
        options: ClientOptions | None = None,
        max_channels: int = 32,
        connector: Callable[[], Transport] | None = None,
        **kwargs: Unpack[ClientOptionsArgs],
    ) -> None:
        if not isinstance(max_channels, int) or max_channels < 1:
            raise ConfigError(f"max_channels must be an integer >= 1, not {max_channels!r}")
        opts = ClientOptions.of(options, kwargs)
        self.options = opts
        self.name = name
        self.timeout = opts.timeout
        self.on_unavailable = opts.on_unavailable
        self.max_channels = max_channels
        self._make_client = functools.partial(Client, name, options=opts, connector=connector)
        self._client: Client | None = None
        self._client_lock = threading.Lock()
        self._closed = False
        self._in_flight = 0  # calls submitted and not yet back on the loop
        self._threads = _ChannelThreads(max_channels, weakref.WeakMethod(self._run))
        self._completions = _Completions(weakref.WeakMethod(self._done))
        weakref.finalize(self, self._threads.stop)
        forked_in_child(self)

    def _forked(self) -> None:
        """In a fork's child: no channel thread of the parent's runs here and no call of
        its is this process's; the private sync client lets go of its channels itself
        (Client._forked), and the next call starts threads of this process."""
        self._threads.reset()
        self._completions.reset()
        self._client_lock = threading.Lock()
        self._in_flight = 0

    # -- the sync client, on a channel thread ------------------------------------------------

    def _sync_client(self) -> Client:
        """The private sync client, made (connecting) by the first channel thread to need it."""
        client = self._client
        if client is not None:
            return client
        with self._client_lock:
            if self._client is None:
                if self._closed:
                    raise ClosedError("this client is closed")
                client = self._make_client()
                self._client = client
                if self._closed:  # close() ran during the handshake
                    client.close()
            return self._client

    def _run(self, job: _Job) -> None:
        """On a channel thread: runs ``job`` unless it was cancelled or expired meanwhile."""
        if not job.claim.acquire(blocking=False):
            return  # it expired while queued (AsyncClient._expire answered it)
        result: Any = None
        ok = False
        if not job.future.cancelled():  # else dropped: cancelled while queued
            try:
                client = self._sync_client()
                client._local.timings = None
                if job.stream is None:
                    value = job.method(client, *job.args, timeout=job.left(), **job.kwargs)
                else:
                    import torch

                    with torch.cuda.stream(job.stream):
                        value = job.method(client, *job.args, timeout=job.left(), **job.kwargs)
                value = _owned(value)
                result, ok = (value, client._local.timings), True
            except BaseException as exc:  # handed to the awaiting task, raised there
                result = exc
        self._completions.hand_back(job.loop, job.future, ok, result)

    def _done(self, future: asyncio.Future, ok: bool, result: Any) -> None:
        self._in_flight -= 1
        _resolve(future, ok, result)

    def _expire(self, job: _Job) -> None:
        """On the loop, at a queued call's deadline: answers it as the sync client answers a
        call whose deadline passed before it had a channel (RequestTimeout, or a degraded
        search or context), with no I/O and without waiting for a channel."""
        if not job.claim.acquire(blocking=False):
            return  # a channel thread runs it: the sync call keeps the deadline
        self._in_flight -= 1
        client = self._client
        try:
            if client is None:
                raise ConnectError("no channel could be opened before the call's deadline")
            # No channel on the loop thread and no time left: the sync call raises
            # RequestTimeout (or degrades) before any I/O.
            value = job.method(client, *job.args, timeout=0.0, **job.kwargs)
        except BaseException as exc:
            _resolve(job.future, False, exc)
        else:
            _resolve(job.future, True, (value, None))

    # -- calls on the loop -------------------------------------------------------------------

    async def _call(self, method: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        start = _monotonic_ns()
        if self._closed:
            raise ClosedError("this client is closed")
        timeout = kwargs.pop("timeout", None)
        bad = timeout_error(timeout)
        if bad is not None:
            raise bad
        timeout = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        job = _Job(loop, future, method, args, kwargs, timeout, start)
        self._in_flight += 1
        timer = None
        if self._in_flight > self.max_channels:  # it will queue: keep its deadline from here
            timer = loop.call_at(loop.time() + timeout, self._expire, job)
        self._threads.submit(job)
        try:
            value, timings = await future
        finally:
            if timer is not None:
                timer.cancel()
        if timings is not None:
            timings = timings._replace(total_us=(_monotonic_ns() - start) / 1e3)
            _last_timings.set(timings)
            if type(value) is Timings:  # ping: the whole await
                value = timings
        return value

    # -- properties --------------------------------------------------------------------------

    def _connected(self) -> Client:
        if self._client is None:
            raise ConnectError(
                "not connected yet: use `await kalos.connect_async(...)` or `async with`"
            )
        return self._client

    @property
    def info(self) -> dict:
        """What the sidecar said at the last handshake: dim, metric, max_k, index, version..."""
        return dict(self._connected()._info)

    @property
    def dim(self) -> int:
        """The sidecar's vector dimension (as of the last handshake)."""
        return self._connected().dim

    @property
    def epoch(self) -> int:
        """The epoch of the sidecar of the last handshake: new on every sidecar start."""
        return self._connected().epoch

    @property
    def reconnects(self) -> int:
        """Channels reopened after a lost sidecar or a timed-out call, over all channels."""
        return 0 if self._client is None else self._client.reconnects

    @property
    def channels(self) -> int:
        """Channel threads started so far (at most ``max_channels``)."""
        return self._threads.started

    @property
    def last_timings(self) -> Timings | None:
        """Timings of the current task's last completed call; ``total_us`` is the whole await."""
        return _last_timings.get()

    # -- lifecycle ---------------------------------------------------------------------------

    async def connect(self) -> AsyncClient:
        """Connects (the first channel's handshake) unless connected; ConnectError when no
        sidecar answers within ``timeout``."""
        if self._client is None:
            await self._call(_no_op, (), {})
        return self

    async def close(self) -> None:
        """Closes every channel and ends the channel threads. Idempotent; calls in flight
        raise ClosedError (or finish), later calls raise ClosedError. Never blocks."""
        self._closed = True
        client = self._client  # not under _client_lock: a handshake may hold it
        if client is not None:
            client.close()
        self._threads.stop()

    aclose = close

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    def __reduce__(self) -> Any:
        raise TypeError(
            "a kalos.AsyncClient holds this process's channels and threads and cannot be "
            "pickled: pass its name and options (client.name, client.options) and connect in "
            "the other process (one made before os.fork() works in the child as it is)"
        )

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- operations: Client's, awaited (one line each) ---------------------------------------
    # A method added to Client is one line here; tests/test_async_client.py fails until it is.
    ping = _forward(Client.ping)
    stats = _forward(Client.stats)
    search = _forward(Client.search)

    search_gpu = _forward(Client.search_gpu)

    add = _forward(Client.add)
    remove = _forward(Client.remove)
    append_turn = _forward(Client.append_turn)
    context = _forward(Client.context)
    sessions = _forward(Client.sessions)
    trim = _forward(Client.trim)
    delete_session = _forward(Client.delete_session)
    put = _forward(Client.put)
    cas = _forward(Client.cas)
    get = _forward(Client.get)
    delete = _forward(Client.delete)
    log = _forward(Client.log)
    events = _forward(Client.events)
    forget = _forward(Client.forget)
    recall = _forward(Client.recall)
    lookup = _forward(Client.lookup)


async def connect_async(
    name: str,
    *,
    options: ClientOptions | None = None,
    max_channels: int = 32,
    **kwargs: Unpack[ClientOptionsArgs],
) -> AsyncClient:
    """Connects to the running sidecar ``name`` without blocking the event loop; the
    options are :func:`kalos.connect`'s (:class:`kalos.ClientOptions`), plus ``max_channels``
    (see :class:`AsyncClient`). Raises ConnectError when none runs."""
    client = AsyncClient(name, options=ClientOptions.of(options, kwargs), max_channels=max_channels)
    try:
        return await client.connect()
    except BaseException:
        await client.close()
        raise
