"""The progress of a bootstrap load (``kalos serve --source``): rows loaded of a total.

On a terminal, a bar on stderr redrawn at most every 0.2 s; otherwise (a log collector, a
pod's stderr) a log line every ``every_s`` seconds. Either way a last line with the count,
the time and the rate. :meth:`LoadProgress.update` costs a clock read between reports.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("kalos.source")

BAR_EVERY_S = 0.2
LOG_EVERY_S = 5.0
BAR_WIDTH = 30


class LoadProgress:
    """Reports ``update(rows)`` calls against ``total`` rows (``estimated``: the total is the
    planner's estimate, shown as ``~N``; a load may pass it)."""

    def __init__(
        self,
        what: str,
        total: int,
        *,
        estimated: bool = False,
        stream: TextIO | None = None,
        every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.total = max(0, total)
        self.estimated = estimated
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = BAR_EVERY_S if self.tty else every_s
        self.clock = clock
        self.started = self.last = clock()
        self.drawn = False

    def line(self, rows: int) -> str:
        """``loading T: 400,000 / ~1,000,000 rows (40%), 120,000 rows/s``."""
        elapsed = max(self.clock() - self.started, 1e-9)
        total = max(self.total, rows)
        approx = "~" if self.estimated and rows < self.total else ""
        share = f" ({100 * rows // total}%)" if total else ""
        return (
            f"loading {self.what}: {rows:,} / {approx}{total:,} rows{share}, "
            f"{rows / elapsed:,.0f} rows/s"
        )

    def bar(self, rows: int) -> str:
        total = max(self.total, rows)
        done = BAR_WIDTH if not total else BAR_WIDTH * rows // total
        return f"\r[{'#' * done}{'.' * (BAR_WIDTH - done)}] {self.line(rows)}"

    def update(self, rows: int) -> None:
        """``rows`` loaded so far."""
        now = self.clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        if self.tty:
            self.stream.write(self.bar(rows))
            self.stream.flush()
            self.drawn = True
        else:
            log.info("%s", self.line(rows))

    def finish(self, rows: int) -> None:
        """The load read ``rows``: the last report."""
        elapsed = self.clock() - self.started
        self.total, self.estimated = rows, False
        rate = f"{rows / elapsed:,.0f} rows/s" if elapsed > 0 else "-"
        done = f"loaded {rows:,} rows of {self.what} in {elapsed:.2f} s ({rate})"
        if self.tty and self.drawn:
            self.stream.write(self.bar(rows) + "\n")
            self.stream.flush()
        log.info("%s", done)
