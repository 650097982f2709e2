"""A group that is an OpenAI-compatible HTTP server (`engine: vllm` pods, another gateway).

The router polls it like a worker group: `GET /v1/models` says it is up, which model names it
serves and its context length; `GET /metrics` (vLLM's or Gearshift's Prometheus names), when
it answers, fills the running / waiting / KV gauges. Requests are proxied by openai_proxy.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Generator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gearshift.operator.router.config import GroupSpec
from gearshift.operator.router.group import Group
from gearshift.v1 import worker_pb2
from gearshift.worker.server import auth

log = logging.getLogger(__name__)

# Gauge names of vLLM's /metrics and of a Gearshift router's, summed over their label sets.
_RUNNING = ("vllm:num_requests_running", "gearshift_num_requests_running")
_WAITING = ("vllm:num_requests_waiting", "gearshift_num_requests_waiting")
_KV_USAGE = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "gearshift_kv_cache_usage_perc",
)


def base_url(address: str) -> str:
    """`host:port` (what router.json carries) or a full http(s) URL, without a trailing /."""
    address = address.rstrip("/")
    return address if address.startswith(("http://", "https://")) else f"http://{address}"


class BearerToken(httpx.Auth):
    """The deployment's control token as the server's API key (`vllm serve` reads it from
    VLLM_API_KEY): the current token, and on a 401 once more with the one it replaced, for a
    server started before a rotation."""

    def __init__(self, source: auth.TokenSource) -> None:
        self.source = source

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        current, *previous = self.source.tokens()
        request.headers["Authorization"] = f"Bearer {current}"
        response = yield request
        if response.status_code == 401 and previous:
            request.headers["Authorization"] = f"Bearer {previous[0]}"
            yield request


class OpenAIGroup(Group):
    """A client of one OpenAI-compatible server."""

    def __init__(
        self, spec: GroupSpec, rpc_timeout_s: float, token: auth.TokenSource | None = None
    ) -> None:
        # The control token is the server's API key (engine: vllm pods get it as
        # VLLM_API_KEY); without one (a server that takes no key) nothing is sent.
        super().__init__(spec, rpc_timeout_s, token)
        self.url = base_url(spec.address)
        self.models: list[str] = []  # ids from the last /v1/models answer
        # No read timeout: a generation streams for as long as it needs; a dead server is
        # noticed by the connection failing and by the health poll (its own timeout).
        self.client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(None, connect=rpc_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            auth=BearerToken(token) if token is not None else None,
        )

    def backend_model(self, name: str) -> str:
        """The `model` to send: the router's name if the server serves it, else its first."""
        if name in self.models or not self.models:
            return name
        return self.models[0]

    async def poll(self) -> None:
        """GET /v1/models (health, names, context length), then /metrics if it answers."""
        try:
            resp = await self.client.get("/v1/models", timeout=self.rpc_timeout_s)
        except httpx.HTTPError as exc:
            self._set_down(f"GET /v1/models: {type(exc).__name__}: {exc}")
            return
        if resp.status_code != 200:
            self._set_down(f"GET /v1/models answered {resp.status_code}")
            return
        try:
            data = resp.json().get("data") or []
            models = [str(m["id"]) for m in data]
        except (ValueError, AttributeError, KeyError, TypeError) as exc:
            self._set_down(f"GET /v1/models: not an OpenAI model list ({exc})")
            return
        if not models:
            self._set_down("GET /v1/models lists no model")
            return
        self.models = models
        stats = worker_pb2.WorkerStats(model=self.backend_model(models[0]))
        lengths = [m.get("max_model_len") for m in data if isinstance(m, dict)]
        if lengths and isinstance(lengths[0], int):
            stats.max_model_len = lengths[0]
        await self._read_metrics(stats)
        self.stats = stats
        self._set_up()

    async def _read_metrics(self, stats: worker_pb2.WorkerStats) -> None:
        # Optional: a server without /metrics still serves; its gauges just stay 0.
        try:
            resp = await self.client.get("/metrics", timeout=self.rpc_timeout_s)
            if resp.status_code != 200:
                return
            families = list(text_string_to_metric_families(resp.text))
        except (httpx.HTTPError, ValueError):
            return
        values: dict[str, list[float]] = {}
        for fam in families:
            for sample in fam.samples:
                values.setdefault(sample.name, []).append(sample.value)
        # Counts add up over a server's engines; the KV fraction is their mean.
        stats.running = int(next((sum(values[n]) for n in _RUNNING if n in values), 0))
        stats.waiting = int(next((sum(values[n]) for n in _WAITING if n in values), 0))
        kv = next((values[n] for n in _KV_USAGE if n in values), [])
        stats.kv_usage = sum(kv) / len(kv) if kv else 0.0

    async def close(self) -> None:
        self.removed = True
        with contextlib.suppress(Exception):
            await self.client.aclose()
