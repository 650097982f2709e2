"""`gearshift serve`: the router plus N local worker groups, as on a cluster but on one machine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from gearshift.operator.commands import children as kids
from gearshift.operator.commands.layout import choose_serve_layout, model_heads
from gearshift.operator.commands.router import (
    add_router_args,
    port_flag,
    serve_until_signal,
    write_ready,
)
from gearshift.worker.policies.flags import add_policy_args
from gearshift.worker.server import auth
from gearshift.worker.server.engine_json import EngineJson, GroupJson, ModelJson
from gearshift.worker.server.settings import add_engine_args

if TYPE_CHECKING:
    from gearshift.v1 import policy_pb2

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="serve a model: router + local worker groups")
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="as --model")
    p.add_argument(
        "--model", default=None, help="model folder, .gguf file, hf://org/name[@rev], or 'smollm2'"
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--name", default="gearshift", help="deployment name; groups are NAME-gI")
    add_engine_args(
        p,
        threads_help="torch threads per rank; default: the cores less the router's, shared",
        prefill_threads_help="per rank, for steps of 256+ tokens; default: every core, shared",
    )
    add_policy_args(p)
    p.add_argument(
        "--layout",
        choices=("fastest",),
        default=None,
        help="fastest: pick the policy, --tp and --sp for this machine's cores and the model's "
        "heads, and print which and why (docs/serving.md)",
    )
    p.add_argument("--groups", type=int, default=1, help="worker groups (replicas)")
    p.add_argument("--worker-start-timeout", type=float, default=600.0)
    p.add_argument(
        "--max-group-restarts",
        type=int,
        default=10,
        help="restarts in a row of a worker group that dies (back-off 1 s doubling to 30 s); "
        "0: never restart",
    )
    p.add_argument(
        "--control-token-file",
        default=None,
        help="the token router → worker calls carry; default: a new random one per run, named "
        "in the ready file (control_token_file)",
    )
    p.add_argument(
        "--admin-token-file",
        default=None,
        help="the token Admin calls must carry; default: a new random one per run, named in "
        "the ready file (admin_token_file)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help="seconds without a rank's heartbeat before its group stops (and restarts)",
    )
    add_router_args(p)
    p.set_defaults(func=run)


def apply_layout(args: argparse.Namespace, model: str) -> str | None:
    """For --layout fastest: set the policy flags on `args`; an error message or None."""
    if args.layout is None:
        return None
    if args.device != "cpu":
        return "--layout fastest chooses among CPU layouts; on other devices set the policy"
    if args.policy_config is not None or any(
        getattr(args, f) is not None for f in ("policy", "tp", "sp", "pp")
    ):
        return "--layout fastest picks the policy itself; drop --policy-config/--policy/--tp/--sp"
    heads, kv_heads = model_heads(model)
    cores = max(1, len(os.sched_getaffinity(0)) // max(args.groups, 1))
    chosen = choose_serve_layout(cores, heads, kv_heads)
    args.policy, args.tp, args.sp = chosen.policy, chosen.tp, chosen.sp
    # Printed, not logged: the first thing a newcomer should read is what runs and why.
    print(f"gearshift serve: layout fastest -> {chosen.describe()}", file=sys.stderr, flush=True)
    return None


def max_requests_per_group(args: argparse.Namespace) -> int:
    return int(args.max_requests_per_group or 2 * args.max_num_seqs)


def default_threads(groups: int, ranks: int) -> int:
    """Torch threads per rank: the cores less one for the router, shared by every rank.

    Oversubscribed OpenMP threads spin against each other, which costs far more than a core.
    """
    cores = os.cpu_count() or 1
    return max(1, (cores - 1 if cores > 1 else 1) // (groups * ranks))


def default_prefill_threads(groups: int, ranks: int) -> int:
    """Torch threads per rank for long (prefill) steps: every core shared, the router's too,
    since it has nothing to stream while such a step runs (ModelRunner's StepThreads)."""
    return max(1, (os.cpu_count() or 1) // (groups * ranks))


def local_engine_json(
    args: argparse.Namespace, model: str, served: str, policy: policy_pb2.Policy, ranks: int
) -> EngineJson:
    """The engine.json every local group reads: one node of ``ranks`` ranks."""
    from gearshift.worker.policies import policy_json

    return EngineJson(
        deployment=args.name,
        model=ModelJson(
            path=model, name=served, dtype=args.dtype, max_model_len=args.max_model_len
        ),
        group=GroupJson(nodes=1, gpus_per_node=ranks, ranks=ranks),
        policy=policy_json.to_dict(policy),
    )


def _worker_args(args: argparse.Namespace, engine_json: Path, ranks: int) -> list[str]:
    threads = args.num_threads or default_threads(args.groups, ranks)
    prefill_threads = args.prefill_threads or max(
        threads, default_prefill_threads(args.groups, ranks)
    )
    out = [
        "--config",
        str(engine_json),
        "--device",
        args.device,
        "--max-num-seqs",
        str(args.max_num_seqs),
        # The router bounds the queue (and answers 429); the worker must not refuse first.
        "--max-waiting",
        str(max_requests_per_group(args)),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--num-threads",
        str(threads),
        "--prefill-threads",
        str(prefill_threads),
        "--attention-backend",
        args.attention_backend,
    ]
    if args.block_size:
        out += ["--block-size", str(args.block_size)]
    if args.kv_cache_bytes:
        out += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if not args.enable_prefix_caching:
        out.append("--no-enable-prefix-caching")
    if args.enforce_eager:
        out.append("--enforce-eager")
    if args.heartbeat_timeout is not None:
        out += ["--heartbeat-timeout", str(args.heartbeat_timeout)]
    return out


def _token_file(given: str | None, generated: Path) -> tuple[Path, str]:
    """The token file to use and its token: `given` (readable, not empty), or a new random
    token written to `generated`."""
    if given:
        return Path(given), auth.read_token(given)
    token = auth.generate_token()
    return auth.write_token(generated, token), token


async def _serve(args: argparse.Namespace, workdir: Path) -> int:
    from gearshift.operator.router import config as config_mod
    from gearshift.operator.router.server import RouterServer
    from gearshift.worker.config import check_attention_backend
    from gearshift.worker.errors import GearshiftError, InvalidRequestError
    from gearshift.worker.model.registry import default_served_name
    from gearshift.worker.policies.checks import default_world
    from gearshift.worker.policies.flags import policy_from_args
    from gearshift.worker.policies.support import check_supported
    from gearshift.worker.tokenizer.errors import TokenizerError

    model = args.model or args.model_pos or "smollm2"
    served = args.served_model_name or default_served_name(model)
    try:
        layout_error = apply_layout(args, model)
    except (GearshiftError, TokenizerError, OSError, KeyError, ValueError) as exc:
        layout_error = f"--layout fastest: cannot read the model's heads: {exc}"
    if layout_error:
        print(f"error: {layout_error}", file=sys.stderr)
        return 2
    problems: list[str] = []
    try:
        policy = policy_from_args(args)
        # The operator's InvalidSpec rule, word for word: the registry refuses what this engine
        # cannot run (kind, layout), naming the field. Torch-free (check_runnable would import
        # the policy's worker class, and torch with it: 2-3 s of CPU in a process that runs no
        # model); each worker builds the policy itself.
        policy, ranks = check_supported(policy), default_world(policy)
    except InvalidRequestError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if args.groups < 1:
        problems.append("--groups must be >= 1")
    if args.max_group_restarts < 0:
        problems.append(f"--max-group-restarts must be >= 0, got {args.max_group_restarts}")
    if args.heartbeat_timeout is not None and args.heartbeat_timeout <= 0:
        problems.append(f"--heartbeat-timeout must be > 0, got {args.heartbeat_timeout}")
    for flag in ("num_threads", "prefill_threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            problems.append(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    try:  # refused here, before any group starts
        check_attention_backend(args.attention_backend, args.device)
    except InvalidRequestError as exc:
        problems.append(exc.message)
    if problems:
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    if model.startswith("hf://"):  # download once, before the router and groups read it
        from gearshift.worker.errors import ModelLoadError
        from gearshift.worker.model.registry import resolve_model_path

        try:
            model = str(await asyncio.to_thread(resolve_model_path, model))
        except ModelLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    engine_json = workdir / "engine.json"
    engine_json.write_text(local_engine_json(args, model, served, policy, ranks).dumps())
    try:
        keys = config_mod.read_api_keys(
            args.api_key, args.api_key_file, "GEARSHIFT_API_KEY", os.environ, env_required=False
        )
    except config_mod.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Two tokens (auth.py): the router sends the control token to the workers, Admin requires
    # the admin token. Generated here unless given, so auth is on without any setup.
    try:
        token_file, token = _token_file(args.control_token_file, workdir / "control.token")
        admin_token_file, admin_token = _token_file(args.admin_token_file, workdir / "admin.token")
    except auth.TokenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    worker_args = [*_worker_args(args, engine_json, ranks), "--control-token-file", str(token_file)]
    children = [
        kids.spawn_worker(f"{args.name}-g{i}", worker_args, workdir / f"g{i}.ready")
        for i in range(args.groups)
    ]
    server: RouterServer | None = None

    def ready_extra() -> dict[str, object]:
        groups = [{"name": c.name, "address": c.address, "pid": c.proc.pid} for c in children]
        return {
            "groups": groups,
            "control_token_file": str(token_file),
            "admin_token_file": str(admin_token_file),
        }

    def respawn(old: kids.WorkerChild, restart: int) -> kids.WorkerChild:
        ready = workdir / f"{old.name}.r{restart}.ready"
        return kids.spawn_worker(old.name, worker_args, ready)

    async def restarted(child: kids.WorkerChild, restart: int) -> None:
        if server is None or server.router is None:
            return
        router = server.router
        router.metrics.group_restarts.labels(router.model_name, child.name).inc()
        await router.pool.configure(
            [config_mod.GroupSpec(c.name, c.address) for c in children if c.port is not None]
        )
        if server.ports is not None:
            write_ready(args.ready_file, {**server.ports.as_ready(), **ready_extra()})

    restart_policy = kids.RestartPolicy(
        max_restarts=args.max_group_restarts, start_timeout_s=args.worker_start_timeout
    )
    watcher: asyncio.Task[None] | None = None
    try:
        await kids.wait_ready(children, args.worker_start_timeout, stop)
        watcher = asyncio.create_task(kids.supervise(children, respawn, restart_policy, restarted))
        cfg = config_mod.RouterConfig(
            model_name=served,
            model_path=model,
            groups=tuple(config_mod.GroupSpec(c.name, c.address) for c in children),
            policy=policy,
            host=args.host,
            http_port=8000 if args.port is None else args.port,
            grpc_port=port_flag(50050 if args.grpc_port is None else args.grpc_port),
            admin_host=args.admin_host or "127.0.0.1",
            admin_port=port_flag(50060 if args.admin_port is None else args.admin_port),
            api_keys=keys,
            max_requests_per_group=max_requests_per_group(args),
            drain_timeout_s=args.drain_timeout,
            queue_timeout_s=600.0 if args.queue_timeout is None else args.queue_timeout,
            control_token=token,
            control_token_file=token_file,
            admin_token=admin_token,
            admin_token_file=admin_token_file,
            protect_metrics=args.protect_metrics,
            cache_salt_by_api_key=args.cache_salt_by_api_key,
            record_trace=args.record_trace,
        ).with_preparation(args.max_body_bytes, args.preparation_processes)
        server = RouterServer(cfg)
        if not stop.is_set():
            await serve_until_signal(server, args.ready_file, ready_extra(), stop)
    except kids.ChildFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (config_mod.ConfigError, OSError, RuntimeError) as exc:  # RuntimeError: gRPC bind
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if watcher is not None:
            watcher.cancel()
        await asyncio.to_thread(kids.stop_children, children)
    return 0


def run(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="gearshift-serve-"))
    try:
        return asyncio.run(_serve(args, workdir))
    except KeyboardInterrupt:
        return 130
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(workdir)
