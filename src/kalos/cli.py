"""The ``kalos`` command: serve, status, demo, bench."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import signal
import sys

from kalos.errors import KalosError
from kalos.server.admin import DEFAULT_ADMIN_PORT


def _serve(args: argparse.Namespace) -> int:
    from kalos.server import Sidecar, SidecarConfig
    from kalos.server.sidecar import STOP_BUDGET_S
    from kalos.stores.limits import Limits

    config = SidecarConfig(
        source=_source(args),
        source_max_lag=args.source_max_lag,
        source_retention_s=args.source_retention_s,
        source_snapshot_s=args.source_snapshot_s,
        source_table=args.source_table,
        source_columns=args.source_columns,
        name=args.name,
        dim=args.dim,
        metric=args.metric,
        device=args.device,
        index=args.index,
        runtime_dir=args.runtime_dir,
        spin_us=args.spin_us,
        max_spin_us=args.max_spin_us,
        compute_threads=args.compute_threads,
        batch_delay_us=args.batch_delay_us,
        batch_max=args.batch_max,
        max_channels=args.max_channels,
        allowed_uids=tuple(args.allow_uid),
        allowed_gid=args.allow_gid,
        data_dir=args.data_dir,
        fsync=args.fsync,
        snapshot_bytes=max(1, int(args.snapshot_mb * (1 << 20))),
        tokenizer=args.tokenizer,
        token_heap_bytes=int(args.token_heap_mb * 1024) * 1024,
        session_index_slots=args.session_index_slots,
        gpu_doorbell=args.gpu_doorbell,
        cache_dir=args.cache_dir,
        reserve=args.reserve,
        # No --admin-port: the default port if it is free; an explicit one must be.
        admin_port=None
        if args.no_admin
        else (DEFAULT_ADMIN_PORT if args.admin_port is None else args.admin_port),
        admin_port_strict=args.admin_port is not None,
        grpc=tuple(args.grpc),
        grpc_tls_cert=args.grpc_tls_cert,
        grpc_tls_key=args.grpc_tls_key,
        grpc_tls_client_ca=args.grpc_tls_client_ca,
        load=args.load,
        load_ids=args.load_ids,
        load_payloads=args.load_payloads,
        limits=Limits(
            max_turn_tokens=args.max_turn_tokens,
            max_turn_bytes=args.max_turn_bytes,
            max_session_turns=args.max_session_turns,
            max_state_bytes=args.max_state_bytes,
            tenant_max_items=args.tenant_max_items,
            tenant_max_bytes=args.tenant_max_bytes,
        ),
    )
    sidecar = Sidecar(config)

    def on_signal(signum: int, frame: object) -> None:
        if not stopping:
            stopping.append(signum)
            # The backstop of the stop's budget (Sidecar.stop): should anything still hold the
            # process after it, the threads' stacks go to stderr and the process exits (1).
            faulthandler.dump_traceback_later(STOP_BUDGET_S + 0.8, exit=True)
        sidecar.stop()

    stopping: list[int] = []

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sidecar.serve()
    return 0


def _source(args: argparse.Namespace) -> str | None:
    """The source database's connection string: --source (no password allowed there: the
    command line is visible to every user of the host), else --source-file, else the
    environment's KALOS_SOURCE; None without any. libpq reads PGPASSWORD and PGPASSFILE."""
    import os

    if args.source is not None:
        from kalos.server.source import check_no_password

        check_no_password(args.source)
        return str(args.source)
    if args.source_file is not None:
        try:
            with open(args.source_file) as f:
                return f.read().strip()
        except OSError as exc:
            raise KalosError(f"--source-file: {exc}") from exc
    return os.environ.get("KALOS_SOURCE") or None


def _status(args: argparse.Namespace) -> int:
    from kalos.client import connect

    with connect(args.name, runtime_dir=args.runtime_dir, timeout=args.timeout) as client:
        print(json.dumps(client.stats(), indent=2, sort_keys=True))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kalos.bench import run_scenario

    return run_scenario(args)


def _demo(args: argparse.Namespace) -> int:
    from kalos.demo import run

    return run(args)


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help where it has a default worth showing (not
    None, False or an empty list) and the help does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, [], argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


DESCRIPTION = (
    "Kalos, a memory-recall sidecar for LLM services. kalos serve runs a sidecar, kalos "
    "status prints its stats, kalos demo runs a chat assistant's memory step on real text, "
    "kalos bench runs a named benchmark scenario. kalos COMMAND --help: its options."
)


def build_parser() -> argparse.ArgumentParser:
    from kalos.bench import add_bench_parsers

    parser = argparse.ArgumentParser(
        prog="kalos", description=DESCRIPTION, formatter_class=_HelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,status,demo,bench}")

    serve = sub.add_parser(
        "serve", help="run a sidecar in the foreground", formatter_class=_HelpFormatter
    )
    serve.add_argument("--name", required=True, help="the sidecar's name (its socket)")
    serve.add_argument("--dim", type=int, required=True, help="vector dimension")
    serve.add_argument(
        "--metric",
        choices=("ip", "cosine", "l2"),
        default="ip",
        help="how search scores: ip (inner product, descending), cosine (vectors normalised "
        "at add and search, descending) or l2 (squared distance, ascending)",
    )
    serve.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    serve.add_argument(
        "--index",
        default=None,
        help="index spec string, e.g. cpu:faiss-flat, cuda:flat,bf16 or the approximate "
        "cuda:ivf,nlist=16384,nprobe=32 (docs/ANN.md) (default: the "
        "device's exact index: cpu:flat, or cuda[:N]:flat,fp16)",
    )
    serve.add_argument(
        "--runtime-dir",
        default=None,
        help="socket directory (default: $KALOS_RUNTIME_DIR, else $XDG_RUNTIME_DIR/kalos, "
        "else /tmp/kalos-UID)",
    )
    serve.add_argument(
        "--spin-us",
        type=float,
        default=200.0,
        help="µs to keep polling after the last request before parking",
    )
    serve.add_argument(
        "--max-spin-us",
        type=float,
        default=0.0,
        help="while requests come at least every MAX/5 µs on average, keep polling 5x their "
        "mean gap before parking (at least --spin-us); 0 (default): --spin-us only",
    )
    serve.add_argument(
        "--compute-threads", type=int, default=1, help="BLAS/OpenMP threads for CPU search"
    )
    serve.add_argument(
        "--batch-delay-us",
        type=float,
        default=0.0,
        help="µs the first of a batch of searches may wait for more (default 0: batch only "
        "the searches already waiting on other channels; a lone caller never waits)",
    )
    serve.add_argument(
        "--batch-max",
        type=int,
        default=64,
        help="most searches and recalls answered in one pass over the index (1: no batching)",
    )
    serve.add_argument(
        "--reserve", type=int, default=0, help="rows to allocate up front (GPU: keeps graphs)"
    )
    serve.add_argument(
        "--load",
        metavar="VECTORS.npy",
        help="bulk load at start: the sidecar reads this .npy of float32/float16 vectors "
        "[n, dim] itself before it reports ready (docs/ANN.md)",
    )
    serve.add_argument(
        "--load-ids", metavar="IDS.npy", help="with --load: int64 ids [n] (default 0..n-1)"
    )
    serve.add_argument(
        "--load-payloads",
        metavar="PAYLOADS.jsonl",
        help="with --load: n lines, each a JSON string (a text payload) or null",
    )
    serve.add_argument(
        "--gpu-doorbell",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cuda: the GPU picks a channel's next search of the same shape up itself, with no "
        "sidecar CPU between the client and the kernel (default; --no-gpu-doorbell: every "
        "search goes through the sidecar's poller)",
    )
    serve.add_argument(
        "--cache-dir",
        default=None,
        help="cuda: keep the compiled GPU kernels here, so that a restart loads them instead "
        "of compiling (seconds instead of minutes before ready); default: TRITON_CACHE_DIR "
        "if set, else DATA_DIR/kernel-cache with --data-dir, else Triton's (~/.triton/cache)",
    )
    serve.add_argument(
        "--token-heap-mb",
        type=float,
        default=256.0,
        help="shared memory for sessions' token ids, mapped read-only by shm clients so that "
        "a context's ids are not copied (touched pages only); 0: copy them",
    )
    serve.add_argument(
        "--session-index-slots",
        type=int,
        default=1 << 16,
        help="sessions whose context windows shm clients compute themselves, from shared "
        "memory, without a request (a power of two; 768 bytes each, touched pages only); "
        "0: every context asks the sidecar",
    )
    serve.add_argument(
        "--max-channels",
        type=int,
        default=1024,
        help="client channels (shm) and uds connections open at once; more are refused (busy)",
    )
    serve.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        default=[],
        help="another uid allowed to connect (repeatable)",
    )
    serve.add_argument("--allow-gid", type=int, default=None, help="a gid allowed to connect")
    serve.add_argument(
        "--data-dir",
        default=None,
        help="keep a write-ahead log and snapshots here and recover from them at start "
        "(without it the sidecar keeps everything in memory only); with --source: snapshots "
        "of the replica only, which a restart resumes from instead of loading the tables",
    )
    serve.add_argument(
        "--source",
        default=None,
        help="PostgreSQL as the source of truth: postgresql://USER@HOST/DB[?sslmode=...] "
        "(no password here: PGPASSWORD, PGPASSFILE, --source-file or KALOS_SOURCE). Memories "
        "and state live there; every sidecar on it is a replica (docs/OPERATIONS.md)",
    )
    serve.add_argument(
        "--source-file",
        default=None,
        help="a file holding the --source connection string (it may carry a password)",
    )
    serve.add_argument(
        "--source-table",
        default=None,
        metavar="[SCHEMA.]TABLE",
        help="with --source: mirror this table, which other programs write, as the memories "
        "(the sidecar installs triggers on it; docs/OPERATIONS.md, 'Mirroring a table')",
    )
    serve.add_argument(
        "--source-columns",
        default=None,
        metavar="ROLE=COLUMN,...",
        help="the --source-table's columns: id and vector, and optionally payload, tenant, "
        "user, session, metadata; e.g. id=doc_id,vector=embedding,payload=body,tenant=org",
    )
    serve.add_argument(
        "--source-max-lag",
        type=int,
        default=0,
        help="become ready once at most this many changes behind the source (default 0)",
    )
    serve.add_argument(
        "--source-retention-s",
        type=float,
        default=3600.0,
        help="keep the change feed's rows this long for followers that lag or are away",
    )
    serve.add_argument(
        "--source-snapshot-s",
        type=float,
        default=60.0,
        help="with --source and --data-dir: snapshot the replica this often while changes "
        "arrive (and at a clean stop); a restart resumes from the newest snapshot",
    )
    serve.add_argument(
        "--fsync",
        default="always",
        help="always (sync before acknowledging a write; concurrent writes share a sync), "
        "interval:MS (sync every MS ms) or off (the OS decides)",
    )
    serve.add_argument(
        "--snapshot-mb",
        type=float,
        default=256.0,
        help="take a snapshot once the log grew this many MiB since the last one",
    )
    serve.add_argument(
        "--tokenizer",
        default=None,
        help="a Hugging Face tokenizer.json: tokenizes turns appended without token ids "
        "(needs pip install 'kalos[text]')",
    )
    serve.add_argument("--max-turn-tokens", type=int, default=32_768, help="token ids per turn")
    serve.add_argument(
        "--max-turn-bytes", type=int, default=256 << 10, help="UTF-8 bytes of a turn's role+text"
    )
    serve.add_argument(
        "--max-session-turns",
        type=int,
        default=10_000,
        help="turns per session; a full session refuses appends unless it is rolling",
    )
    serve.add_argument(
        "--max-state-bytes", type=int, default=256 << 10, help="a state value or event's data"
    )
    serve.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="serve /healthz, /readyz and /metrics on 127.0.0.1:PORT "
        f"(default {DEFAULT_ADMIN_PORT}: skipped with a warning when taken; an explicit port "
        "must be free; 0: any free port, "
        "logged and shown by kalos status as admin_port)",
    )
    serve.add_argument("--no-admin", action="store_true", help="no admin HTTP endpoint")
    serve.add_argument(
        "--grpc",
        action="append",
        default=[],
        metavar="ADDR",
        help="also serve the grpc transport on ADDR (host:port, [::]:port or unix:/path; "
        "port 0: any free port, shown by kalos status as grpc; repeatable; needs "
        "pip install 'kalos[grpc]'). Without TLS, listen on trusted networks only",
    )
    serve.add_argument("--grpc-tls-cert", default=None, help="PEM certificate chain: grpc TLS")
    serve.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert")
    serve.add_argument(
        "--grpc-tls-client-ca",
        default=None,
        help="PEM CA: grpc clients must present a certificate it signed (mutual TLS)",
    )
    serve.add_argument(
        "--tenant-max-items", type=int, default=None, help="memories per tenant (default: no limit)"
    )
    serve.add_argument(
        "--tenant-max-bytes",
        type=int,
        default=None,
        help="bytes of memories per tenant: vectors at 4 bytes a dimension plus payloads and "
        "token ids (4 bytes each) (default: no limit)",
    )
    serve.set_defaults(func=_serve)

    status = sub.add_parser(
        "status", help="print a running sidecar's stats as JSON", formatter_class=_HelpFormatter
    )
    status.add_argument("--name", required=True, help="the sidecar's name (kalos serve --name)")
    status.add_argument(
        "--runtime-dir",
        default=None,
        help="the sidecar's socket directory, if kalos serve was given one (default: "
        "$KALOS_RUNTIME_DIR, else $XDG_RUNTIME_DIR/kalos, else /tmp/kalos-UID)",
    )
    status.add_argument(
        "--timeout", type=float, default=2.0, help="seconds to wait for the connection and answer"
    )
    status.set_defaults(func=_status)

    demo = sub.add_parser(
        "demo",
        help="a chat assistant's memory step on real text: kalos vs a Redis pipeline",
        formatter_class=_HelpFormatter,
    )
    from kalos.demo import add_arguments

    add_arguments(demo)
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="run a named benchmark scenario")
    add_bench_parsers(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return int(args.func(args))
    except KalosError as exc:
        print(f"kalos: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
