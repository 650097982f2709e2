"""What `gearshift worker` runs: engine.json (the operator's contract), env, then flags.

engine.json is documented in docs/operator.md ("The contract with the worker and the router");
the GEARSHIFT_* variables come from the worker pod's env. Flags override both, which is how
`gearshift serve` starts local groups.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gearshift.v1 import policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.model.registry import default_served_name
from gearshift.worker.policies import checks
from gearshift.worker.policies.support import check_supported
from gearshift.worker.server import auth
from gearshift.worker.server.engine_json import EngineJson

if TYPE_CHECKING:
    from gearshift.worker.config import EngineConfig

DEFAULT_WORKER_PORT = 50051
# Low enough that a hung (e.g. SIGSTOPped) rank turns the group not ready within 5 s: the
# leader's verdict (this), its exit noticed (0.5 s) and the router's next poll (1 s).
DEFAULT_HEARTBEAT_TIMEOUT_S = 2.5


@dataclass(frozen=True)
class EngineKnobs:
    """Engine options that engine.json does not carry; vLLM's names."""

    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 0  # 0: the device's default (EngineConfig)
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    prefill_threads: int | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False


@dataclass(frozen=True)
class WorkerSettings:
    """Everything one worker process needs to start."""

    model: str
    served_model_name: str
    policy: policy_pb2.Policy  # defaults filled in for `ranks`
    engine: EngineKnobs
    ranks: int = 1
    node_rank: int = 0
    group_name: str = ""
    revision: str = ""
    host: str = "0.0.0.0"
    port: int = DEFAULT_WORKER_PORT
    # Requests admitted beyond max_num_seqs before Generate answers RESOURCE_EXHAUSTED.
    max_waiting: int = 256
    ready_file: Path | None = None
    exit_with_parent: bool = False
    # Required as `authorization: Bearer` on every Worker call (auth.py); None: not checked.
    control_token: str | None = None
    # A rank without a heartbeat for this long is dead: the group stops and restarts.
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    # On SIGTERM, seconds running requests may finish before the engine stops (and aborts them).
    drain_timeout_s: float = 30.0

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0


def add_engine_args(
    p: argparse.ArgumentParser,
    *,
    dtype_default: str | None = "auto",
    attention_backend_default: str | None = "auto",
    threads_help: str = "torch CPU threads per rank",
    prefill_threads_help: str = "torch CPU threads for 256+ token steps (default: --num-threads)",
) -> None:
    """The engine flags `generate`, `serve` and `worker` share (EngineConfig's knobs, vLLM's
    names where vLLM has one)."""
    p.add_argument("--dtype", default=dtype_default, help="auto, float32, bfloat16 or float16")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu; cuda (local rank i on GPU i, NCCL); cuda:N (every rank of this host on GPU "
        "N, gloo)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="tokens per KV block (default: 64 on CPU, where longer runs stream faster; 16 on GPU)",
    )
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache size on CPU")
    p.add_argument("--num-threads", type=int, default=None, help=threads_help)
    p.add_argument("--prefill-threads", type=int, default=None, help=prefill_threads_help)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--attention-backend",
        default=attention_backend_default,
        help="auto (the C++ kernels on CPU, Triton on CUDA), torch (the reference), cpu, or "
        "triton (CUDA; on a CPU only under TRITON_INTERPRET=1)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never replay decode steps from CUDA graphs (vLLM's flag; graphs run only on CUDA)",
    )


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig of the flags `add_engine_args` added (plus ``--model``); ``overrides``
    win (what a command fixes, such as prefix caching off for profiling)."""
    from gearshift.worker.config import EngineConfig

    knobs: dict[str, Any] = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        enable_prefix_caching=args.enable_prefix_caching,
        num_threads=args.num_threads,
        prefill_threads=args.prefill_threads,
        attention_backend=args.attention_backend or "auto",
        enforce_eager=args.enforce_eager,
    )
    knobs.update(overrides)
    return EngineConfig(**knobs)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """Flags of `gearshift worker`; each overrides engine.json and the environment."""
    p.add_argument("--config", default=None, help="engine.json (default: $GEARSHIFT_CONFIG)")
    p.add_argument("--model", default=None, help="model folder, .gguf file, or 'smollm2'")
    p.add_argument("--served-model-name", default=None)
    add_engine_args(p, dtype_default=None, attention_backend_default=None)
    p.add_argument("--max-waiting", type=int, default=None, help="default: max-num-seqs")
    p.add_argument(
        "--policy-config",
        "--policy-json",
        default=None,
        dest="policy_json",
        help="the CRD's spec.policy (gearshift.v1.Policy): a JSON/YAML file or inline",
    )
    p.add_argument("--group-name", default=None)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=None, help="0 lets the OS pick")
    p.add_argument("--ready-file", type=Path, default=None, help="write {port, pid} when ready")
    p.add_argument("--exit-with-parent", action="store_true", help="stop when the parent dies")
    p.add_argument(
        "--control-token-file",
        default=None,
        help=f"require this token on Worker calls (default: ${auth.TOKEN_FILE_ENV})",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests may finish (SIGUSR1 only stops admission)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help=f"seconds without a rank's heartbeat before the group stops "
        f"(default {DEFAULT_HEARTBEAT_TIMEOUT_S}, or $GEARSHIFT_HEARTBEAT_TIMEOUT)",
    )


def _policy(raw: Any, ranks: int) -> policy_pb2.Policy:
    from gearshift.worker.policies.flags import read_policy_text
    from gearshift.worker.policies.policy_json import parse_policy

    policy = parse_policy(read_policy_text(raw) if isinstance(raw, str) else raw)
    errors = checks.layout_errors(policy, ranks)
    if errors:
        raise InvalidRequestError("policy", "; ".join(errors))
    # Refused here, before any rank starts, with the operator's InvalidSpec message.
    return check_supported(policy, ranks)


def load_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> WorkerSettings:
    """Settings from flags over env over engine.json; raises InvalidRequestError naming a field."""
    env = os.environ if env is None else env
    path = args.config or env.get("GEARSHIFT_CONFIG")
    cfg = EngineJson.load(path) if path else EngineJson()
    if cfg.engine != "gearshift":
        raise InvalidRequestError(
            "engine", f"{path}: engine {cfg.engine!r} is not served by `gearshift worker`"
        )
    model = args.model or cfg.model.path or "smollm2"
    ranks = int(env.get("GEARSHIFT_GROUP_SIZE") or cfg.group.ranks)
    port = args.port
    if port is None:
        port = int(env.get("GEARSHIFT_WORKER_PORT") or (cfg.ports and cfg.ports.worker) or 0)
        port = port or DEFAULT_WORKER_PORT
    token_file = args.control_token_file or env.get(auth.TOKEN_FILE_ENV)
    try:
        token = auth.read_token(token_file) if token_file else None
    except auth.TokenError as exc:
        raise InvalidRequestError("control_token_file", str(exc)) from exc
    heartbeat = args.heartbeat_timeout
    if heartbeat is None:
        heartbeat = float(env.get("GEARSHIFT_HEARTBEAT_TIMEOUT") or DEFAULT_HEARTBEAT_TIMEOUT_S)
    if heartbeat <= 0:
        raise InvalidRequestError("heartbeat_timeout", f"must be > 0, got {heartbeat}")
    attention_backend = args.attention_backend or cfg.model.attention_backend
    from gearshift.worker.config import check_attention_backend

    check_attention_backend(attention_backend, args.device)  # before any rank starts
    engine = EngineKnobs(
        dtype=args.dtype or cfg.model.dtype or "auto",
        device=args.device,
        max_model_len=args.max_model_len or cfg.model.max_model_len or None,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        enable_prefix_caching=args.enable_prefix_caching,
        num_threads=args.num_threads,
        prefill_threads=args.prefill_threads,
        attention_backend=attention_backend,
        enforce_eager=args.enforce_eager,
    )
    return WorkerSettings(
        model=model,
        served_model_name=args.served_model_name or cfg.model.name or default_served_name(model),
        policy=_policy(args.policy_json or cfg.policy, ranks),
        engine=engine,
        ranks=ranks,
        node_rank=int(env.get("GEARSHIFT_NODE_RANK") or 0),
        group_name=args.group_name or env.get("GEARSHIFT_GROUP_NAME") or "",
        revision=env.get("GEARSHIFT_REVISION", ""),
        host=args.host,
        port=port,
        max_waiting=args.max_waiting if args.max_waiting is not None else args.max_num_seqs,
        ready_file=args.ready_file,
        exit_with_parent=args.exit_with_parent,
        control_token=token,
        heartbeat_timeout_s=heartbeat,
        drain_timeout_s=max(0.0, args.drain_timeout),
    )
