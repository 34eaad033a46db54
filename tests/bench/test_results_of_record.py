"""bench/results holds results of record in the shape docs/PERFORMANCE.md gives, each indexed
in its README, and every results file the docs link to exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def _checker():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "check_results", ROOT / "scripts" / "check_results.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_result_has_the_shape() -> None:
    sets, bad = _checker().problems(str(RESULTS))
    assert sets > 0
    assert bad == []


def test_the_results_readme_lists_every_file() -> None:
    index = (RESULTS / "README.md").read_text()
    for path in RESULTS.iterdir():
        if path.name != "README.md":
            assert f"({path.name})" in index, path.name


def test_every_linked_result_exists() -> None:
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]:
        for link in re.findall(r"bench/results/([A-Za-z0-9.-]+\.(?:json|png))", doc.read_text()):
            assert (RESULTS / link).exists(), f"{doc.name} links {link}"
        if doc.parent == RESULTS:
            for link in re.findall(r"\]\(([A-Za-z0-9.-]+\.(?:json|png))\)", doc.read_text()):
                assert (RESULTS / link).exists(), f"{doc.name} links {link}"
