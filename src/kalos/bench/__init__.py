"""Benchmarks behind ``kalos bench SCENARIO`` (names in docs/PERFORMANCE.md).

Every scenario writes ``<out>/<scenario>-<machine>-<date>.json`` and, where it has samples, a
PNG beside it (:mod:`kalos.bench.plots`); long runs show a progress bar on a terminal's
stderr (``--quiet``: none).
"""

from __future__ import annotations

import argparse


def add_bench_parsers(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="scenario", required=True)
    from kalos.bench import (
        async_client,
        context,
        load,
        recall,
        recovery,
        replicas,
        search_ann,
        search_batch,
        search_cpu,
        search_filtered,
        search_gpu,
        search_shards,
        stress,
        transport,
        writes,
    )

    for module in (
        transport,
        search_cpu,
        search_gpu,
        search_shards,
        search_filtered,
        search_ann,
        search_batch,
        load,
        context,
        recall,
        writes,
        recovery,
        replicas,
        stress,
        async_client,
    ):
        p = sub.add_parser(
            module.SCENARIO, help=module.__doc__.splitlines()[0] if module.__doc__ else ""
        )
        p.add_argument("--out", default="bench/results", help="directory for the JSON result")
        p.add_argument("--machine", default=None, help="machine name in the result file")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        module.add_arguments(p)
        p.set_defaults(bench=module.run)


def run_scenario(args: argparse.Namespace) -> int:
    return int(args.bench(args))
