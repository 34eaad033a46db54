"""Crash test: SIGKILL the sidecar 20 times under a stream of writes; no acknowledged write lost.

A writer process (this file run as a script) streams writes through shm and uds clients:
adds of fresh ids with payloads, upserts, removes, session turn appends and state puts.
Before each it writes the op to its ledger, after the acknowledgement it writes "ack"
(flushed and fsynced). A write whose outcome it could not learn (the sidecar died under it)
is resolved after the restart by reading the sidecar's state: applied entirely, or not at
all; anything in between is written down as "half".

The test kills the sidecar with SIGKILL at random moments (after a few acks since its start,
plus a random delay, so snapshots and group commits are hit mid-way too), 20 times, and
restarts it on the same --data-dir, cycling the fsync policy (always, interval:20, off: a
killed process loses nothing any policy acknowledged; only a host crash tells them apart).
At the end it kills it once more, restarts it, rebuilds the expected state from the ledger
and checks every item, session and state key against it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

DIM = 8
KILLS = 20
SESSIONS = 12
KEYS = 12
POLICIES = ("always", "interval:20", "off")
TIMEOUT = 60.0


def vector(item: int) -> np.ndarray:
    """The item's vector: random, so no two items are at distance 0 (the test finds each
    item by searching for its own vector, l2, k=1)."""
    return np.random.default_rng(item).standard_normal(DIM).astype(np.float32)


def payload(tag: str, item: int) -> str:
    return f"{tag}:{item}"


# -- the expected state ------------------------------------------------------------------------


class Model:
    """What the sidecar must hold after the ops applied so far (acked or resolved applied)."""

    def __init__(self) -> None:
        self.items: dict[int, str] = {}  # live id -> payload
        self.ever: set[int] = set()
        self.turns: dict[str, list[tuple[str, str]]] = {}
        self.state: dict[str, str] = {}

    def apply(self, op: dict) -> None:
        kind = op["kind"]
        if kind in ("add", "upsert"):
            for item in op["ids"]:
                self.items[item] = payload(op["tag"], item)
                self.ever.add(item)
        elif kind == "remove":
            for item in op["ids"]:
                self.items.pop(item, None)
        elif kind == "turn":
            self.turns.setdefault(op["session"], []).append(("user", op["text"]))
        elif kind == "put":
            self.state[op["key"]] = op["value"]


def read_ledger(path: Path) -> tuple[dict[int, dict], dict[int, str]]:
    ops: dict[int, dict] = {}
    results: dict[int, str] = {}
    with open(path) as f:
        for line in f:
            entry = json.loads(line)
            if "kind" in entry:
                ops[entry["n"]] = entry
            else:
                results[entry["n"]] = entry["result"]
    return ops, results


# -- reading the sidecar's state ---------------------------------------------------------------


def lookup(client, ids: list[int]) -> dict[int, str | None]:
    """id -> its payload in the sidecar, or None when absent (searching for its vector)."""
    out: dict[int, str | None] = {}
    for i in range(0, len(ids), 256):
        chunk = ids[i : i + 256]
        q = np.stack([vector(item) for item in chunk])
        r = client.search(q, k=1, payloads=True)
        for j, item in enumerate(chunk):
            hit = int(r.ids[j, 0]) == item and float(r.scores[j, 0]) < 1e-6
            out[item] = r.payloads[j] if hit else None
    return out


def session_turns(client, session: str) -> list[tuple[str, str]]:
    import kalos

    try:
        ctx = client.context(session, max_tokens=1 << 20)
    except kalos.NotFound:
        return []
    return [tuple(t) for t in ctx.turns]


def state_value(client, key: str) -> str | None:
    import kalos

    try:
        return client.get(key).value.decode()
    except kalos.NotFound:
        return None


def has_sessions(client) -> bool:
    return hasattr(client, "append_turn") and hasattr(client, "put")


# -- the writer process ------------------------------------------------------------------------


def writer_main(runtime_dir: str, ledger_path: str, stop_path: str, seed: int) -> None:
    import kalos

    rng = random.Random(seed)
    model = Model()
    ledger = open(ledger_path, "a")  # noqa: SIM115 (kept open for the writer's life)

    def record(entry: dict) -> None:
        ledger.write(json.dumps(entry) + "\n")
        ledger.flush()
        os.fsync(ledger.fileno())

    def connect() -> tuple:
        while True:
            try:
                shm = kalos.connect("crash", runtime_dir=runtime_dir, timeout=TIMEOUT)
                uds = kalos.connect(
                    "crash", runtime_dir=runtime_dir, timeout=TIMEOUT, transport="uds"
                )
                return shm, uds
            except kalos.ConnectError:
                time.sleep(0.02)

    def run(client, op: dict):
        kind = op["kind"]
        if kind in ("add", "upsert"):
            ids = op["ids"]
            vecs = np.stack([vector(item) for item in ids])
            return client.add(vecs, ids, [payload(op["tag"], item) for item in ids])
        if kind == "remove":
            return client.remove(op["ids"])
        if kind == "turn":
            return client.append_turn(op["session"], "user", op["text"], tokens=[op["n"]])
        return client.put(op["key"], op["value"])

    def resolve(client, op: dict) -> str:
        """Whether an op of unknown outcome was applied: 'applied', 'not-applied' or 'half'."""
        kind = op["kind"]
        if kind in ("add", "upsert", "remove"):
            found = lookup(client, op["ids"])
            if kind == "remove":
                new = [found[i] is None for i in op["ids"]]
                old = [found[i] == model.items.get(i) for i in op["ids"]]
            else:
                new = [found[i] == payload(op["tag"], i) for i in op["ids"]]
                old = [found[i] == model.items.get(i) for i in op["ids"]]
        elif kind == "turn":
            turns = session_turns(client, op["session"])
            before = model.turns.get(op["session"], [])
            new = [turns == [*before, ("user", op["text"])]]
            old = [turns == before]
        else:
            value = state_value(client, op["key"])
            new = [value == op["value"]]
            old = [value == model.state.get(op["key"])]
        if all(new):
            return "applied"
        if all(old):
            return "not-applied"
        return "half"

    shm, uds = connect()
    sessions = has_sessions(shm)
    next_id = 1
    n = 0
    pending: dict | None = None  # an op whose outcome is unknown
    while True:
        if pending is not None:
            try:
                result = resolve(shm, pending)
            except (kalos.TransportError, kalos.ServerError):
                shm, uds = connect()
                continue
            record({"n": pending["n"], "result": result})
            if result == "applied":
                model.apply(pending)
            pending = None
        if os.path.exists(stop_path):
            break
        n += 1
        live = sorted(model.items)
        roll = rng.random()
        if roll < 0.4 or len(live) < 8:
            k = rng.randint(1, 16)
            op = {"n": n, "kind": "add", "ids": list(range(next_id, next_id + k)), "tag": f"a{n}"}
            next_id += k
        elif roll < 0.55:
            op = {"n": n, "kind": "upsert", "ids": rng.sample(live, rng.randint(1, 4))}
            op["tag"] = f"u{n}"
        elif roll < 0.7:
            op = {"n": n, "kind": "remove", "ids": rng.sample(live, rng.randint(1, 4))}
        elif roll < 0.85 and sessions:
            op = {"n": n, "kind": "turn", "session": f"s{rng.randrange(SESSIONS)}"}
            op["text"] = f"turn {n}"
        elif sessions:
            op = {"n": n, "kind": "put", "key": f"k{rng.randrange(KEYS)}", "value": f"v{n}"}
        else:
            op = {"n": n, "kind": "remove", "ids": rng.sample(live, 1)}
        record(op)
        try:
            run(shm if rng.random() < 0.7 else uds, op)
        except (kalos.TransportError, kalos.ServerError):
            # The sidecar died (or failed) under the write: its outcome is unknown.
            pending = op
            with contextlib.suppress(Exception):
                shm.close()
                uds.close()
            shm, uds = connect()
            continue
        record({"n": n, "result": "ack"})
        model.apply(op)
    shm.close()
    uds.close()
    ledger.close()


# -- the test ----------------------------------------------------------------------------------


def start_sidecar(runtime_dir: Path, data_dir: Path, policy: str, log) -> subprocess.Popen:
    from kalos.testing import serve_command

    cmd = serve_command(
        "crash",
        DIM,
        str(runtime_dir),
        "--data-dir",
        str(data_dir),
        "--fsync",
        policy,
        "--snapshot-mb",
        "0.03",  # a snapshot every ~30 KiB of log: many, so kills land in them too
        metric="l2",
    )
    return subprocess.Popen(cmd, stdout=log, stderr=log)


def acks(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b'"ack"')
    except FileNotFoundError:
        return 0


def wait_for(predicate, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.slow
def test_sigkill_loses_no_acknowledged_write(tmp_path: Path) -> None:
    import kalos
    from kalos.paths import socket_path
    from kalos.testing import wait_for_socket, wait_ready

    runtime_dir, data_dir = tmp_path / "run", tmp_path / "data"
    runtime_dir.mkdir(mode=0o700)
    ledger, stop = tmp_path / "ledger.jsonl", tmp_path / "stop"
    log = open(tmp_path / "sidecar.log", "ab")  # noqa: SIM115
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    sock = socket_path("crash", str(runtime_dir))
    sidecar = start_sidecar(runtime_dir, data_dir, POLICIES[0], log)
    writer = subprocess.Popen(
        [sys.executable, __file__, str(runtime_dir), str(ledger), str(stop), str(seed)]
    )
    try:
        for kill in range(KILLS):
            base = acks(ledger)
            wait_for(lambda base=base: acks(ledger) >= base + 5, "the writer to make progress")
            assert writer.poll() is None, "the writer died"
            time.sleep(rng.uniform(0.0, 0.4))
            sidecar.send_signal(signal.SIGKILL)
            sidecar.wait(TIMEOUT)
            sidecar = start_sidecar(runtime_dir, data_dir, POLICIES[(kill + 1) % 3], log)
        base = acks(ledger)
        wait_for(lambda: acks(ledger) >= base + 5, "the writer to make progress")
        stop.touch()
        assert writer.wait(TIMEOUT) == 0
        sidecar.send_signal(signal.SIGKILL)  # the last state is recovered from a crash too
        sidecar.wait(TIMEOUT)
        sidecar = start_sidecar(runtime_dir, data_dir, "always", log)
        wait_for_socket(sock, sidecar, TIMEOUT)
        wait_ready(sock, sidecar, TIMEOUT)

        ops, results = read_ledger(ledger)
        model = Model()
        for n in sorted(ops):
            if results.get(n) in ("ack", "applied"):
                model.apply(ops[n])
        acked = sum(1 for r in results.values() if r == "ack")
        half = [n for n, r in results.items() if r == "half"]
        unresolved = [n for n in ops if n not in results and n != max(ops)]

        with kalos.connect("crash", runtime_dir=str(runtime_dir), timeout=TIMEOUT) as client:
            found = lookup(client, sorted(model.ever))
            lost_items = [i for i in model.ever if found[i] != model.items.get(i)]
            lost_turns = [s for s in model.turns if session_turns(client, s) != model.turns[s]]
            lost_state = [k for k in model.state if state_value(client, k) != model.state[k]]
            items = client.stats()["items"]
        losses = len(lost_items) + len(lost_turns) + len(lost_state)
        kinds = {k: sum(1 for o in ops.values() if o["kind"] == k) for k in ("add", "upsert")}
        kinds.update(
            {k: sum(1 for o in ops.values() if o["kind"] == k) for k in ("remove", "turn", "put")}
        )
        print(
            f"\ncrash test (seed {seed}): {KILLS + 1} SIGKILLs, {len(ops)} writes "
            f"({', '.join(f'{v} {k}' for k, v in kinds.items())}), {acked} acknowledged, "
            f"{sum(1 for r in results.values() if r in ('applied', 'not-applied'))} of unknown "
            f"outcome resolved ({sum(1 for r in results.values() if r == 'applied')} applied, "
            f"{sum(1 for r in results.values() if r == 'not-applied')} not), "
            f"{len(half)} half-applied; checked {len(model.ever)} ids, "
            f"{len(model.turns)} sessions, {len(model.state)} state keys: {losses} losses"
        )
        assert not half, f"half-applied writes: {[ops[n] for n in half]}"
        assert not unresolved, f"writes without an outcome: {unresolved}"
        assert not lost_items, (
            f"items differ: {[(i, found[i], model.items.get(i)) for i in lost_items][:10]}"
        )
        assert not lost_turns, f"sessions differ: {lost_turns}"
        assert not lost_state, f"state keys differ: {lost_state}"
        assert items == len(model.items)
    finally:
        for proc in (writer, sidecar):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.close()


if __name__ == "__main__":
    writer_main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
