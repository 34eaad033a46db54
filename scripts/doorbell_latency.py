"""How soon does the doorbell's kernel see a client's request? (kalos.server.doorbell)

The kernel alone, in one process, over pinned host memory laid out as a channel's header
words and request arena. Per repetition the kernel is launched armed and left polling for
``--lead-us``; then this process, as the client would, writes a SEARCH that matches the
template and release-stores its sequence number, and spins until the kernel's verdict word
changes. Three rows, µs from the host's store (or launch) to the verdict seen on the host:

- ``pickup``: a matching request (TAKEN): the GPU's poll, its PCIe reads of the header,
  body and query, the copies, the fence and the verdict's store, seen by the host;
- ``cancel``: the cancel word instead (IDLE), what a settle waits before its sync;
- ``launch``: the request already there when the kernel is launched: the launch and the
  kernel's start, for scale.

Then, unless ``--no-trace``, the pickups again with the kernel's trace on (``TRACE``: the
GPU's ``%globaltimer`` after each step, each read after the data it follows), one row per
step, µs: ``poll-period`` (one turn of the wait loop: the acquire of the request word and
the read of the cancel word), ``header-read`` (the request's four header words, from the
loop's exit), ``body-read`` (the template's words and the query), ``stores-fence`` (the
device and response-header stores and the fence before the verdict).

Usage: ``python3 scripts/doorbell_latency.py [--reps 1000] [--lead-us 50] [--out DIR]`` on a
CUDA machine (``scripts/gpu-check doorbell`` runs it); writes
``doorbell-latency-H200-<date>.json`` (``kalos.bench.common.write_result``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from kalos import _native
from kalos.bench.common import summarize, write_result
from kalos.protocol import codes
from kalos.protocol import layout as L
from kalos.protocol import messages as M

DIM = 128


def _spin_until(addr: int, old: int, limit_ns: int = 50_000_000) -> int:
    end = time.monotonic_ns() + limit_ns
    while True:
        v = _native.load_acquire(addr)
        if v != old or time.monotonic_ns() > end:
            return time.monotonic_ns()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--lead-us", type=float, default=50.0, help="the kernel polls this long first")
    ap.add_argument("--out", default="")
    ap.add_argument("--no-trace", action="store_true", help="skip the traced pickups")
    args = ap.parse_args()
    import torch

    from kalos.server import doorbell as D

    dev = torch.device("cuda")
    pinned = {
        "req": torch.zeros(5, dtype=torch.int64).pin_memory(),
        "body": torch.zeros(L.DEFAULT_ARENA_BYTES, dtype=torch.uint8).pin_memory(),
        "resp": torch.zeros(6, dtype=torch.int64).pin_memory(),
        "ctl": torch.zeros(2, dtype=torch.int64).pin_memory(),
    }
    req, body, ctl = (pinned[k].numpy() for k in ("req", "body", "ctl"))
    arm = torch.zeros(8 + D.TEMPLATE_BYTES // 8, dtype=torch.int64, device=dev)
    template = arm[8:].view(torch.uint8)
    seq_dev = torch.zeros(1, dtype=torch.int64, device=dev)
    query_dev = torch.zeros(DIM, dtype=torch.float32, device=dev)
    gate = torch.zeros(1, dtype=torch.int32, device=dev)
    rng = np.random.default_rng(0)
    n = M.encode_search(body, rng.standard_normal((1, DIM), dtype=np.float32), 10,
                        M.encode_scope_fields(None))  # fmt: skip
    at = n - DIM * 4
    template[:at].copy_(torch.from_numpy(body[:at].copy()))
    words = np.zeros(8, np.int64)
    words[1] = int(args.lead_us * 1000) + 50_000_000  # the budget: never the limit here
    words[2] = codes.Op.SEARCH
    words[3] = n
    words[4] = at
    req[1], req[2] = codes.Op.SEARCH, n
    verdict_addr = int(ctl.ctypes.data) + 8
    req_seq_addr = int(req.ctypes.data)

    trace = torch.zeros(8, dtype=torch.int64, device=dev)

    def launch(armed: int, traced: bool = False) -> None:
        words[0] = armed
        arm[:8].copy_(torch.from_numpy(words))
        ctl[:] = 0
        D._doorbell_kernel[(1,)](
            pinned["req"], pinned["body"], pinned["body"].view(torch.float32), pinned["resp"],
            arm, template, pinned["ctl"], seq_dev, query_dev, gate, trace,
            D=DIM, BLOCK_D=DIM, ESIZE=4, TMAX=D.TEMPLATE_BYTES, GPU=True, TRACE=traced,
            num_warps=1,
        )  # fmt: skip

    def lead() -> None:
        end = time.monotonic_ns() + int(args.lead_us * 1000)
        while time.monotonic_ns() < end:
            pass

    def pickup(seq: int, traced: bool = False) -> tuple[int, bool]:
        """Armed at seq - 1, request ``seq`` stored after the lead: ns to the verdict seen,
        and whether it was TAKEN."""
        launch(seq - 1, traced)
        lead()
        t0 = time.monotonic_ns()
        _native.store_release(req_seq_addr, seq)
        t1 = _spin_until(verdict_addr, 0)
        torch.cuda.synchronize()
        return t1 - t0, int(ctl[1]) == seq << 2 | D.TAKEN

    seq = 1
    samples: dict[str, list[int]] = {"pickup": [], "cancel": [], "launch": []}
    wrong = 0
    for i in range(args.reps + 20):
        took, ok = pickup(seq)
        wrong += int(not ok)
        if i >= 20:
            samples["pickup"].append(took)
        # cancel: armed at the current sequence, the cancel word after the lead
        launch(seq)
        lead()
        t0 = time.monotonic_ns()
        ctl[0] = 1
        t1 = _spin_until(verdict_addr, 0)
        torch.cuda.synchronize()
        wrong += int(int(ctl[1]) & 3 != D.IDLE)
        if i >= 20:
            samples["cancel"].append(t1 - t0)
        # launch: the next request already published
        seq += 1
        _native.store_release(req_seq_addr, seq)
        t0 = time.monotonic_ns()
        launch(seq - 1)
        t1 = _spin_until(verdict_addr, 0)
        torch.cuda.synchronize()
        wrong += int(int(ctl[1]) != seq << 2 | D.TAKEN)
        if i >= 20:
            samples["launch"].append(t1 - t0)
        seq += 1
    if not args.no_trace:  # where a pickup's time goes, on the GPU's clock
        steps: dict[str, list[int]] = {
            "poll-period": [], "header-read": [], "body-read": [], "stores-fence": []
        }  # fmt: skip
        for i in range(args.reps + 20):
            _took, ok = pickup(seq, traced=True)
            wrong += int(not ok)
            start, seen, header, body, fenced, polls = trace[:6].tolist()
            if i >= 20:
                steps["poll-period"].append((seen - start) // max(polls, 1))
                steps["header-read"].append(header - seen)
                steps["body-read"].append(body - header)
                steps["stores-fence"].append(fenced - body)
            seq += 1
        samples.update(steps)
    rows = [summarize(name, np.array(v)) for name, v in samples.items()]
    for row in rows:
        print(row)
    print("wrong verdicts:", wrong)
    extra: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "wrong_verdicts": wrong}
    if args.out:
        params = {"reps": args.reps, "lead_us": args.lead_us, "dim": DIM}
        print(write_result("doorbell-latency", "H200", params, rows, args.out, **extra))
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
