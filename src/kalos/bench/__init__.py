"""Benchmarks behind ``kalos bench SCENARIO`` (names from BENCHMARKS.md)."""

from __future__ import annotations

import argparse


def add_bench_parsers(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="scenario", required=True)
    from kalos.bench import (
        async_client,
        context,
        recovery,
        search_cpu,
        search_gpu,
        stress,
        transport,
        writes,
    )

    for module in (
        transport,
        search_cpu,
        search_gpu,
        context,
        writes,
        recovery,
        stress,
        async_client,
    ):
        p = sub.add_parser(
            module.SCENARIO, help=module.__doc__.splitlines()[0] if module.__doc__ else ""
        )
        p.add_argument("--out", default="bench/results", help="directory for the JSON result")
        p.add_argument("--machine", default=None, help="machine name in the result file")
        module.add_arguments(p)
        p.set_defaults(bench=module.run)


def run_scenario(args: argparse.Namespace) -> int:
    return int(args.bench(args))
