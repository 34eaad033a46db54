"""Every store a dispatcher serves, snapshotted into one SQLite file and directory, restored
into a fresh dispatcher: what clients read afterwards is what they read before."""

from __future__ import annotations

import sqlite3
import threading

import numpy as np

import kalos
from conftest import TIMEOUT
from kalos import Scope
from kalos.server.dispatch import Dispatcher
from kalos.stores.memories import MemoryStore
from kalos.transport.inproc import InprocTransport

DIM = 4


def served() -> tuple[Dispatcher, kalos.Client]:
    d = Dispatcher(MemoryStore(kalos.index.create("cpu:flat", dim=DIM, metric="ip")))
    lock = threading.Lock()
    return d, kalos.Client("inproc", connector=lambda: InprocTransport(d, lock), timeout=TIMEOUT)


def observe(c: kalos.Client, times: bool = True) -> dict:
    q = np.ones(DIM, np.float32)
    out: dict = {
        "search": [
            (tuple(r.ids.tolist()), tuple(r.payloads or []))
            for r in (c.search(q, 10, scope=s) for s in (None, Scope("a"), Scope("b", "u")))
        ],
        "sessions": c.sessions(),
        "state": [c.get("k", scope=s) for s in (Scope("a"), Scope("a", "u", "s1"))],
        "events": [e if times else e._replace(time=0.0) for e in c.events("s1")],
    }
    for info in out["sessions"]:
        for budget in (0, 5, 50, 1000):
            ctx = c.context(info.session, budget)
            out[(info.session, budget)] = (ctx.tokens.tolist(), list(ctx.turns), ctx.system)
    return out


def test_snapshot_restore_every_store(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d, c = served()
    rng = np.random.default_rng(1)
    c.add(
        rng.standard_normal((5, DIM)).astype(np.float32),
        [1, 2, 3, 4, 5],
        list("abcde"),
        scope=Scope("a", "u"),
    )
    c.add(
        rng.standard_normal((3, DIM)).astype(np.float32),
        [6, 7, 8],
        None,
        scope=Scope("b", "u", "s2"),
    )
    c.remove([2])
    c.append_turn("s1", "system", "sys", [1, 2], pin=True, scope=Scope("a", "u"))
    for k in range(12):
        c.append_turn("s1", "user", f"turn {k} ✓", list(range(k, 2 * k)))
    c.trim("s1", 8)
    c.append_turn("s2", "user", "x", [9] * 7, scope=Scope("b", "u"), ttl_s=3600, rolling=True)
    c.put("k", b"value-a", scope=Scope("a"))
    c.cas("k", 0, "value-s1", scope=Scope("a", "u", "s1"))
    c.log("s1", "tool", "call")
    c.log("s1", "result", b"\x00\x01")
    before = observe(c)

    db = sqlite3.connect(str(tmp_path / "snapshot.db"))
    for store in (d.memories, d.sessions, d.state):
        store.snapshot(db, str(tmp_path))
    db.commit()
    db.close()

    d2, c2 = served()
    c2.append_turn("stale", "user", "x", [1])  # replaced by the restore
    db = sqlite3.connect(str(tmp_path / "snapshot.db"))
    for store in (d2.memories, d2.sessions, d2.state):
        store.restore(db, str(tmp_path))
    assert observe(c2) == before
    # the restored stores keep working as the originals do
    for client in (c, c2):
        client.append_turn("s1", "user", "after", [42])
        client.log("s1", "step", "x")
        client.put("k", b"new", scope=Scope("a"))
        client.forget(Scope("b"))
    assert observe(c2, times=False) == observe(c, times=False)  # new events: new times
    c.close()
    c2.close()
