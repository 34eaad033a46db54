"""A channel lives as long as its thread: threads that end release theirs at the sidecar."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

from conftest import DIM, TIMEOUT
from kalos.testing import RunningSidecar


def test_threads_that_end_release_their_channels(sidecar: Callable[..., RunningSidecar]) -> None:
    sc = sidecar(dim=DIM)
    client = sc.connect(timeout=TIMEOUT)

    def one_call() -> None:
        client.ping()

    for _ in range(20):
        t = threading.Thread(target=one_call)
        t.start()
        t.join()
    gc.collect()
    deadline = time.monotonic() + TIMEOUT
    channels = client.stats()["channels"]
    while channels > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
        channels = client.stats()["channels"]
    assert channels == 1  # only the main thread's
    client.close()
