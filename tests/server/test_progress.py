"""The bootstrap load's progress: a bar on a terminal, log lines otherwise."""

from __future__ import annotations

import io
import logging

import pytest

from kalos.server.progress import LoadProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_terminal_gets_a_bar_redrawn_in_place() -> None:
    out, clock = Terminal(), Clock()
    progress = LoadProgress("public.docs", 1000, stream=out, clock=clock)
    progress.update(100)  # too soon after the start: nothing drawn
    assert out.getvalue() == ""
    clock.now += 1.0
    progress.update(400)
    assert out.getvalue() == (
        "\r[############..................] loading public.docs: 400 / 1,000 rows (40%), 400 rows/s"
    )
    clock.now += 1.0
    progress.finish(1000)
    last = out.getvalue().split("\r")[-1]
    assert last.startswith("[" + "#" * 30 + "] loading public.docs: 1,000 / 1,000 rows (100%)")
    assert last.endswith("\n")


def test_without_a_terminal_it_logs_every_few_seconds(caplog: pytest.LogCaptureFixture) -> None:
    out, clock = io.StringIO(), Clock()
    caplog.set_level(logging.INFO, logger="kalos.source")
    progress = LoadProgress("kalos_memories", 2_000_000, estimated=True, stream=out,
                            every_s=5.0, clock=clock)  # fmt: skip
    for step in range(1, 13):  # 12 s, 100,000 rows a second
        clock.now += 1.0
        progress.update(step * 100_000)
    progress.finish(2_100_000)  # past the estimate
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "loading kalos_memories: 500,000 / ~2,000,000 rows (25%), 100,000 rows/s",
        "loading kalos_memories: 1,000,000 / ~2,000,000 rows (50%), 100,000 rows/s",
        "loaded 2,100,000 rows of kalos_memories in 12.00 s (175,000 rows/s)",
    ]
    assert out.getvalue() == ""
