"""Checks bench/results/*.json against the results shape of docs/PERFORMANCE.md.

Usage (from the project root): ``python3 scripts/check_results.py [bench/results]``. Prints
how many parameter sets the files hold and each problem; exits 1 when a file breaks the
shape: a name that is not ``<scenario>-<machine>.json`` / ``.png`` (dates and run labels live
inside the file and in git), no scenario, machine, date or rows, a row without ``system``, a
search or load set without ``params.corpus``, or an exact-search set without
``checks.wrong_results`` (an approximate one reports ``recall_at_10`` in its rows instead).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

NAME = re.compile(r"[a-z0-9-]+-[A-Za-z0-9]+(-[a-z0-9]+)*\.(json|png)")
DATED = re.compile(r"-20\d\d-\d\d-\d\d|-s\d+\b")


def problems(root: str) -> tuple[int, list[str]]:
    """(parameter sets seen, problems found) over the files in ``root``."""
    bad: list[str] = []
    sets = 0
    for name in sorted(os.listdir(root)):
        if name == "README.md":
            continue
        if not NAME.fullmatch(name) or DATED.search(name):
            bad.append(f"{name}: name is not <scenario>-<machine>.json")
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(root, name)) as f:
                doc: Any = json.load(f)
        except ValueError as exc:
            bad.append(f"{name}: not JSON ({exc})")
            continue
        for i, s in enumerate(doc if isinstance(doc, list) else [doc]):
            sets += 1
            where = f"{name}[{i}]"
            bad += [
                f"{where}: no {key}"
                for key in ("scenario", "machine", "date", "rows")
                if key not in s
            ]
            if any("system" not in row for row in s.get("rows", [])):
                bad.append(f"{where}: a row without system")
            scenario, params = s.get("scenario", ""), s.get("params", {})
            searches = ("search-gpu", "search-cpu", "search-shards")
            if scenario in (*searches, "load") and "corpus" not in params:
                bad.append(f"{where}: {scenario} without params.corpus")
            if (
                scenario in searches
                and "wrong_results" not in s.get("checks", {})
                and "recall_at_10" not in json.dumps(s.get("rows", []))
            ):
                bad.append(
                    f"{where}: no checks.wrong_results (exact) or recall_at_10 (approximate)"
                )
    return sets, bad


def main(argv: list[str]) -> int:
    root = argv[1] if len(argv) > 1 else "bench/results"
    sets, bad = problems(root)
    print(f"{sets} parameter sets in {root}")
    for line in bad:
        print("-", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
