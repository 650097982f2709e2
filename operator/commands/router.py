"""`gearshift router`: the router alone, over the groups named in router.json."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gearshift.operator.router.server import RouterServer

log = logging.getLogger(__name__)


def add_router_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `gearshift router` and `gearshift serve` (vLLM's names where they exist)."""
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=None, help="HTTP port (0: the OS picks)")
    p.add_argument("--grpc-port", type=int, default=None, help="Generation service; -1: off")
    p.add_argument("--admin-port", type=int, default=None, help="Admin service; -1: off")
    p.add_argument("--admin-host", default=None, help="default: 127.0.0.1 for serve")
    p.add_argument("--api-key", action="append", default=None, help="repeatable")
    p.add_argument("--api-key-file", default=None, help="one key per line")
    p.add_argument("--max-requests-per-group", type=int, default=None)
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body (HTTP) or message (gRPC) accepted; larger: 413 "
        "(default 4 MiB; docs/serving.md, Limits)",
    )
    p.add_argument(
        "--preparation-processes",
        type=int,
        default=None,
        help="processes that parse and tokenise bodies over 16 KiB, off the event loop "
        "(default 2; 0: threads only)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish on SIGTERM; streams still running after "
        "it end with an error event",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=None,
        help="seconds a request may wait in the router for room on its group (a Tetris group "
        "whose decode instances lack free KV for it) before a 503 with Retry-After "
        "(default 600; 0: never wait)",
    )
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="/metrics needs an API key too (default: open, as Prometheus expects)",
    )
    p.add_argument(
        "--cache-salt-by-api-key",
        action="store_true",
        help="give each API key its own prefix cache (requests are salted by their key, as "
        "vLLM's cache_salt), so cached_tokens tells no client about another's prompts",
    )
    p.add_argument("--ready-file", type=Path, default=None, help="write the bound ports (JSON)")
    p.add_argument(
        "--record-trace",
        type=Path,
        default=None,
        help="append each finished request's arrival time and token counts to this JSONL file "
        "(replay it with the simulator, gearshift.operator.sim)",
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("router", help="run the OpenAI-compatible router (router.json)")
    p.add_argument("--config", default=None, help="router.json (default: $GEARSHIFT_CONFIG)")
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="run without control/admin tokens: worker and Admin calls are not authenticated "
        "(development only; without tokens and without this flag the router refuses to start)",
    )
    add_router_args(p)
    p.set_defaults(func=run)


def port_flag(value: int | None) -> int | None:
    """-1 turns a service off; None keeps the configured port."""
    return None if value is not None and value < 0 else value


def write_ready(path: Path | None, payload: dict[str, object]) -> None:
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload), encoding="utf-8")
    tmp.replace(path)


async def serve_until_signal(
    server: RouterServer,
    ready_file: Path | None,
    extra: dict[str, object],
    stop: asyncio.Event | None = None,
) -> None:
    """Start `server`, then drain and stop it on SIGTERM or SIGINT (or when `stop` is set)."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        ports = await server.start()
        # preStop: stop admission first (503, /ready false); SIGTERM then drains.
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, server.stop_admission)
        write_ready(ready_file, {**ports.as_ready(), **extra})
        await stop.wait()
        log.info("stopping: draining in-flight requests")
    finally:
        await server.stop()


def run(args: argparse.Namespace) -> int:
    from gearshift.operator.router import config as config_mod
    from gearshift.operator.router.server import RouterServer

    path = args.config or os.environ.get("GEARSHIFT_CONFIG")
    if not path:
        print("error: --config (router.json) is required", file=sys.stderr)
        return 2
    try:
        cfg = config_mod.from_file(Path(path))
        keys = config_mod.read_api_keys(args.api_key, args.api_key_file, None, os.environ)
        cfg = cfg.with_overrides(
            host=args.host,
            http_port=args.port,
            admin_host=args.admin_host,
            max_requests_per_group=args.max_requests_per_group,
            drain_timeout_s=args.drain_timeout,
            queue_timeout_s=args.queue_timeout,
            api_keys=(*cfg.api_keys, *keys) or None,
            protect_metrics=args.protect_metrics or None,
            record_trace=args.record_trace,
            insecure_no_auth=args.insecure_no_auth or None,
            cache_salt_by_api_key=args.cache_salt_by_api_key or None,
        ).with_preparation(args.max_body_bytes, args.preparation_processes)
        if args.grpc_port is not None:
            cfg = dataclasses.replace(cfg, grpc_port=port_flag(args.grpc_port))
        if args.admin_port is not None:
            cfg = dataclasses.replace(cfg, admin_port=port_flag(args.admin_port))
        asyncio.run(serve_until_signal(RouterServer(cfg), args.ready_file, {}))
    except config_mod.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
