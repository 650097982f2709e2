"""The router's configuration: router.json (the operator's contract) plus flags.

router.json is documented in docs/operator.md: `{deployment, model: {name, path}, backend,
groups: [{name, address}], policy, ports: {http, grpc, admin}, apiKeyEnv, controlTokenFile,
protectMetrics, maxBodyBytes, preparationProcesses, adminTokenFile, cacheSaltByApiKey,
queueTimeoutSeconds}`; backend is worker-grpc or openai-http.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gearshift.operator.router.lanes import LaneConfig
from gearshift.operator.router.limits import RequestLimits
from gearshift.v1 import policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies import policy_json
from gearshift.worker.server import auth

# How the router reaches its groups: gearshift.v1.Worker over gRPC, or OpenAI HTTP (vLLM pods).
BACKENDS = ("worker-grpc", "openai-http")


class ConfigError(ValueError):
    """router.json or a flag is invalid; the message names it."""


@dataclass(frozen=True)
class GroupSpec:
    """One worker group: its name (the operator's StatefulSet name) and leader address."""

    name: str
    address: str


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router process needs; ports 0 let the OS pick."""

    model_name: str
    model_path: str  # where the tokenizer loads from: a folder, a .gguf, or "smollm2"
    groups: tuple[GroupSpec, ...] = ()
    policy: policy_pb2.Policy | None = None
    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int | None = 50050  # None: no gRPC Generation service
    admin_host: str = "0.0.0.0"
    admin_port: int | None = 50060  # None: no Admin service
    api_keys: tuple[str, ...] = ()
    # Requests in flight per group before the router answers 429.
    max_requests_per_group: int = 512
    poll_interval_s: float = 0.5  # a hung group must turn /ready 503 within 5 s
    rpc_timeout_s: float = 2.0
    drain_timeout_s: float = 30.0
    # How long a request may wait in the router for room on its group (a Tetris group with no
    # decode instance that has its KV slots free; room_queue.py) before a 503 with Retry-After.
    # 0: never wait. --queue-timeout, router.json queueTimeoutSeconds.
    queue_timeout_s: float = 600.0
    config_path: Path | None = None  # re-read for group changes (a mounted ConfigMap)
    reload_interval_s: float = 5.0
    backend: str = "worker-grpc"
    # The deployment's control token (worker/server/auth.py): sent on every Worker call (the
    # API key of openai-http groups). The file, when set, is followed for rotation.
    control_token: str | None = None
    control_token_file: Path | None = None
    # The admin token: required on every Admin call (the operator's credential).
    admin_token: str | None = None
    admin_token_file: Path | None = None
    # Without tokens the router refuses to start (worker-grpc groups, Admin) unless this is set.
    insecure_no_auth: bool = False
    # /metrics needs an API key too (Prometheus then scrapes with a bearer token).
    protect_metrics: bool = False
    # Each API key gets its own prefix cache: its requests' cache_salt is derived from the key
    # (cache_salt.py), so one client cannot probe another's prompts through cached_tokens.
    cache_salt_by_api_key: bool = False
    # --record-trace: a JSONL line per finished request (trace_recorder.py); None: off.
    record_trace: Path | None = None
    # What one request may ask (limits.py) and where its preparation runs (lanes.py).
    limits: RequestLimits = field(default_factory=RequestLimits)
    lanes: LaneConfig = field(default_factory=LaneConfig)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def with_overrides(self, **changes: Any) -> RouterConfig:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def with_preparation(self, max_body_bytes: int | None, processes: int | None) -> RouterConfig:
        """The body cap and the number of preparation processes, where given."""
        cfg = self
        if max_body_bytes is not None:
            if max_body_bytes < 1024:
                raise ConfigError(
                    f"maxBodyBytes (--max-body-bytes) must be >= 1024, got {max_body_bytes}"
                )
            cfg = replace(cfg, limits=replace(cfg.limits, max_body_bytes=max_body_bytes))
        if processes is not None:
            if processes < 0:
                raise ConfigError(
                    f"preparationProcesses (--preparation-processes) must be >= 0, got {processes}"
                )
            cfg = replace(cfg, lanes=replace(cfg.lanes, processes=processes))
        return cfg


def read_api_keys(
    keys: list[str] | None,
    key_file: str | None,
    env_name: str | None,
    env: Mapping[str, str],
    env_required: bool = True,
) -> tuple[str, ...]:
    """Keys from flags, a file (one per line, # comments) and an environment variable.

    A source that is given must hold a key: an empty or blank flag, a file without a key line,
    or a variable that is set but blank (an empty Secret) is a ConfigError, never an open API;
    so is an unset variable when `env_required` (router.json names it only with a Secret).
    """
    out = []
    for k in keys or []:
        if not k.strip():
            raise ConfigError("--api-key: an empty or blank API key would let anyone in")
        out.append(k.strip())
    if key_file:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file {key_file}: {exc}") from exc
        found = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not found:
            raise ConfigError(f"the API key file {key_file} holds no key (empty or blank)")
        out += found
    if env_name and (env_name in env or env_required):
        value = env.get(env_name, "").strip()
        if not value:
            raise ConfigError(
                f"${env_name} (the API key) is unset, empty or blank: an empty key would let "
                "anyone in; check the Secret it comes from"
            )
        out.append(value)
    return tuple(dict.fromkeys(out))


def parse_groups(raw: Any) -> tuple[GroupSpec, ...]:
    if not isinstance(raw, list):
        raise ConfigError("router.json: groups must be a list")
    groups = []
    for i, g in enumerate(raw):
        if not isinstance(g, Mapping) or not g.get("name") or not g.get("address"):
            raise ConfigError(f"router.json: groups[{i}] needs a name and an address")
        groups.append(GroupSpec(str(g["name"]), str(g["address"])))
    if len({g.name for g in groups}) != len(groups):
        raise ConfigError("router.json: group names must be unique")
    return tuple(groups)


def read_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def from_file(path: Path, env: Mapping[str, str] | None = None) -> RouterConfig:
    """A RouterConfig from router.json; the API key comes from the env variable it names."""
    env = os.environ if env is None else env
    data = read_file(path)
    model = data.get("model") or {}
    policy = None
    if data.get("policy"):
        try:
            policy = policy_json.parse_policy(data["policy"])
        except InvalidRequestError as exc:
            raise ConfigError(f"{path}: {exc.message}") from exc
    ports = data.get("ports") or {}
    backend = str(data.get("backend") or "worker-grpc")
    if backend not in BACKENDS:
        raise ConfigError(f"{path}: backend {backend!r} is not one of {', '.join(BACKENDS)}")
    token_file = data.get("controlTokenFile") or env.get(auth.TOKEN_FILE_ENV)
    admin_file = data.get("adminTokenFile") or env.get(auth.ADMIN_TOKEN_FILE_ENV)
    try:
        token = auth.read_token(token_file) if token_file else None
    except auth.TokenError as exc:
        raise ConfigError(f"{path}: controlTokenFile: {exc}") from exc
    try:
        admin_token = auth.read_token(admin_file) if admin_file else None
    except auth.TokenError as exc:
        raise ConfigError(f"{path}: adminTokenFile: {exc}") from exc
    keys = read_api_keys(None, None, data.get("apiKeyEnv") or None, env)
    config = RouterConfig(
        model_name=str(model.get("name") or data.get("deployment") or "model"),
        model_path=str(model.get("path") or ""),
        groups=parse_groups(data.get("groups") or []),
        policy=policy,
        http_port=int(ports.get("http", 8000)),
        grpc_port=int(ports.get("grpc", 50050)),
        admin_port=int(ports.get("admin", 50060)),
        api_keys=keys,
        config_path=path,
        backend=backend,
        control_token=token,
        control_token_file=Path(token_file) if token_file else None,
        admin_token=admin_token,
        admin_token_file=Path(admin_file) if admin_file else None,
        protect_metrics=bool(data.get("protectMetrics", False)),
        cache_salt_by_api_key=bool(data.get("cacheSaltByApiKey", False)),
        queue_timeout_s=_queue_timeout(data, path),
    )
    return config.with_preparation(
        _optional_int(data, "maxBodyBytes", path), _optional_int(data, "preparationProcesses", path)
    )


def _queue_timeout(data: Mapping[str, Any], path: Path) -> float:
    value = data.get("queueTimeoutSeconds", RouterConfig.queue_timeout_s)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{path}: queueTimeoutSeconds must be a number >= 0, got {value!r}")
    return float(value)


def _optional_int(data: Mapping[str, Any], key: str, path: Path) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: {key} must be an integer, got {value!r}")
    return value
