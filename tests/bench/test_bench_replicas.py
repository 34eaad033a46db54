"""kalos bench replicas at a small size: 3 sidecars on a PostgreSQL server it starts."""

from __future__ import annotations

import json

import pytest

from kalos.cli import build_parser
from kalos.testing_postgres import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def test_replicas_bench(tmp_path):
    args = build_parser().parse_args(
        ["bench", "replicas", "--visible-writes", "20", "--seconds", "0.5", "--writers", "2",
         "--bootstrap-rows", "500", "--out", str(tmp_path), "--machine", "test", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    result = json.loads((tmp_path / "replicas-test.json").read_text())
    assert result["checks"]["lost"] == 0 and result["checks"]["replicas_agree"]
    rows = {r["system"]: r for r in result["rows"]}
    assert rows["write-to-visible"]["write_to_visible_p99_ms"] > 0
    assert rows["writes through 1 sidecar"]["adds_per_s"] > 0
    assert rows["bootstrap"]["items_loaded"] == 500
