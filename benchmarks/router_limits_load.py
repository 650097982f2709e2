"""Does the router stay responsive while a client sends the most expensive requests its limits
allow? `/health` and an ordinary completion, probed idle and under that load, p99 compared.

    .venv/bin/python benchmarks/router_limits_load.py            # → router_limits_load.json

A real `gearshift router` process (router.json, default limits and lanes) in front of two
scripted fake workers (tests/router/fake_worker.py, in this process), so what is measured is
the router alone. The load is a separate process with `--senders` concurrent connections, each
sending, back to back, in turn: a 4 MiB text prompt (the body cap), 1M prompt token ids (the
token-id cap), a chat of 2,048 messages (the message cap), 128 tools of 16 KiB schemas (through
the chat template), every sampling list at its cap at once with a 16 KiB regex, n = 8 with 32
stop strings of 256 characters (matched on every token of every sequence), a 4 MiB /tokenize,
and a 4 MiB prompt over gRPC (`--kinds` picks some; `n128` is n = 128 alone). Phases alternate
idle and loaded (`--rounds` each); each records `--probes` of each probe, sequential on one
keep-alive connection, after a warm-up. The figures are the p50 and p99 of all probes of a kind
per phase, and the loaded/idle ratios of the p99s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).with_suffix(".json")
TOKEN = "load-test-token"
MODEL = "fake"
ORDINARY = {"model": MODEL, "prompt": "Hello, how are you?", "max_tokens": 4}


# ---- the load (run in its own process: `router_limits_load.py heavy ...`) -------------------


def heavy_bodies() -> dict[str, tuple[str, bytes]]:
    """Name -> (route, body) of the most expensive requests the default limits allow."""
    from gearshift.operator.router.limits import RequestLimits

    lim = RequestLimits()
    text = "The quick brown fox jumps over the lazy dog. "
    fill = lim.max_body_bytes - 64
    regex = "|".join(f"word{i}" for i in range(3000))[: lim.max_regex_chars]
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}
    tool_schema = json.dumps(schema)[: 16 << 10]
    # Every sampling list at its cap, within the cap on their total over the sequences.
    lists = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 4,
        "bad_words": ["w" * 64] * lim.max_bad_words,
        "logit_bias": {str(i): 1.0 for i in range(1, lim.max_logit_bias + 1)},
        "allowed_token_ids": list(range(1, lim.max_allowed_token_ids + 1)),
        "stop_token_ids": list(range(1, lim.max_stop_token_ids + 1)),
        "guided_regex": regex,
    }
    # Several sequences, each matching the most (and longest) stop strings on every token.
    # (n = 128 alone, kind "n128", saturates the event loop with per-sequence work whatever the
    # caps: a throughput load, bounded by --max-requests-per-group, not by these limits.)
    sequences = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 4,
        "n": 8,
        "stop": [f"{i:03d}" + "s" * (lim.max_stop_chars - 3) for i in range(lim.max_stop)],
        "guided_regex": regex,
    }
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"f{i}",
                "parameters": json.loads(tool_schema.rsplit(",", 1)[0] + "}}"),
            },
        }
        for i in range(lim.max_tools)
    ]
    message = {"role": "user", "content": text * 40}
    bodies: dict[str, tuple[str, Any]] = {
        "text": ("/v1/completions", {"model": MODEL, "prompt": (text * (fill // len(text)))}),
        "ids": ("/v1/completions", {"model": MODEL, "prompt": [1] * (lim.max_token_ids - 1)}),
        "messages": (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [message] * lim.max_messages},
        ),
        "tools": ("/v1/chat/completions", {"model": MODEL, "messages": [message], "tools": tools}),
        "lists": ("/v1/completions", lists),
        "sequences": ("/v1/completions", sequences),
        "n128": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "n": 128}),
        "n8": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "n": 8}),
        "tokenize": ("/tokenize", {"model": MODEL, "prompt": text * (fill // len(text))}),
    }
    out = {}
    for name, (route, body) in bodies.items():
        raw = json.dumps(body).encode()
        assert len(raw) <= lim.max_body_bytes, (route, len(raw))
        out[name] = (route, raw)
    return out


KINDS = ("text", "ids", "messages", "tools", "lists", "sequences", "tokenize", "grpc")
EXTRA_KINDS = ("n128", "n8")  # not in the default mix (see `sequences` above)


def heavy(http: str, grpc_address: str, senders: int, kinds: list[str]) -> None:
    """Send the heavy requests `kinds` in turn from `senders` threads until killed."""
    import threading

    import grpc
    import httpx

    from gearshift.v1 import router_pb2, router_pb2_grpc

    bodies = heavy_bodies()
    big = router_pb2.GenerateRequest(prompt="x " * ((4 << 20) // 2 - 64))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def send(first: int) -> None:
        i = first
        with (
            httpx.Client(base_url=http, timeout=300) as client,
            grpc.insecure_channel(
                grpc_address, options=[("grpc.max_send_message_length", 8 << 20)]
            ) as channel,
        ):
            stub = router_pb2_grpc.GenerationStub(channel)
            print("sending", flush=True)
            while not stop.is_set():
                kind = kinds[i % len(kinds)]
                if kind == "grpc":
                    route, status = "grpc", "OK"
                    try:
                        list(stub.Generate(big, timeout=300))
                    except grpc.RpcError as exc:
                        status = exc.code().name  # type: ignore[attr-defined]
                else:
                    route, raw = bodies[kind]
                    headers = {"content-type": "application/json"}
                    status = str(client.post(route, content=raw, headers=headers).status_code)
                print("sent", route, status, flush=True)
                i += 1

    # Spread over the kinds from the start: sender k begins at kind 2k.
    threads = [threading.Thread(target=send, args=(2 * k,), daemon=True) for k in range(senders)]
    for t in threads:
        t.start()
    while not stop.is_set() and any(t.is_alive() for t in threads):
        stop.wait(0.2)


# ---- the router and its fake workers ---------------------------------------------------------


@contextlib.contextmanager
def router(tmp: Path) -> Iterator[dict[str, Any]]:
    """Two fake workers (a thread's loop) and a `gearshift router` process; its ready file."""
    sys.path.insert(0, str(ROOT))
    from tests.fuzz.background import Background
    from tests.router.fake_worker import FakeWorker, Script

    @contextlib.asynccontextmanager
    async def workers() -> Any:
        fakes = [await FakeWorker(f"g{i}", token=TOKEN).start() for i in range(2)]
        for f in fakes:
            # A worker paces its tokens (a step every 10 ms: a fast GPU), as real ones do.
            f.script = Script(tokens=[42, 43, 44, 45], delay_s=0.01)
        try:
            yield fakes
        finally:
            for f in fakes:
                await f.stop()

    with Background(workers) as fakes:
        (tmp / "token").write_text(TOKEN)
        (tmp / "admin-token").write_text(TOKEN + "-admin")
        config = {
            "deployment": MODEL,
            "model": {"name": MODEL, "path": "smollm2"},
            "groups": [{"name": f.name, "address": f.address} for f in fakes],
            "controlTokenFile": str(tmp / "token"),
            "adminTokenFile": str(tmp / "admin-token"),
            # n = 128 heavy requests must not fill the groups: the probes would get 429.
            "ports": {"http": 0, "grpc": 0, "admin": 0},
        }
        (tmp / "router.json").write_text(json.dumps(config))
        ready = tmp / "router.ready"
        log = (tmp / "router.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "gearshift.operator.cli", "router", "--config",
             str(tmp / "router.json"), "--host", "127.0.0.1", "--admin-host", "127.0.0.1",
             "--max-requests-per-group", "4096", "--ready-file", str(ready)],
            stdout=log, stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")},
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not ready.is_file():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((tmp / "router.log").read_text()[-3000:])
                time.sleep(0.1)
            yield json.loads(ready.read_text())
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            log.close()


# ---- probes ----------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def probe(http: str, probes: int, warmup: int = 20) -> dict[str, list[float]]:
    """Seconds of `probes` /health and ordinary completions, alternating, after a warm-up."""
    import httpx

    out: dict[str, list[float]] = {"health": [], "completion": []}
    with httpx.Client(base_url=http, timeout=60) as client:
        for i in range(warmup + probes):
            for kind in out:
                start = time.perf_counter()
                if kind == "health":
                    r = client.get("/health")
                else:
                    r = client.post("/v1/completions", json=ORDINARY)
                took = time.perf_counter() - start
                assert r.status_code == 200, (kind, r.status_code, r.text[:300])
                if i >= warmup:
                    out[kind].append(took)
    return out


@contextlib.contextmanager
def load(ready: dict[str, Any], senders: int, kinds: list[str], tmp: Path) -> Iterator[None]:
    """The heavy client, running (every sender's first body on its way) until the block ends."""
    http = f"http://127.0.0.1:{ready['http_port']}"
    out = (tmp / "heavy.log").open("w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "heavy",
            http,
            f"127.0.0.1:{ready['grpc_port']}",
            str(senders),
            ",".join(kinds),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 120
        while (tmp / "heavy.log").read_text().count("sending") < senders:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((tmp / "heavy.log").read_text()[-3000:])
            time.sleep(0.2)
        time.sleep(1.0)  # the bodies are sent and being prepared
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        out.close()


def measure(
    probes: int, rounds: int, senders: int, kinds: list[str] | None = None
) -> dict[str, Any]:
    """Idle and loaded phases, interleaved; p50/p99 per probe kind and the loaded/idle ratios."""
    phases: dict[str, dict[str, list[float]]] = {
        "idle": {"health": [], "completion": []},
        "loaded": {"health": [], "completion": []},
    }
    answers: list[tuple[str, ...]] = []
    with tempfile.TemporaryDirectory() as d, router(Path(d)) as ready:
        http = f"http://127.0.0.1:{ready['http_port']}"
        for _ in range(rounds):
            for kind, took in probe(http, probes).items():
                phases["idle"][kind] += took
            with load(ready, senders, kinds or list(KINDS), Path(d)):
                for kind, took in probe(http, probes).items():
                    phases["loaded"][kind] += took
            answers += [
                tuple(line.split()[1:3])
                for line in (Path(d) / "heavy.log").read_text().splitlines()
                if line.startswith("sent ")
            ]
    result: dict[str, Any] = {
        "probes": probes,
        "rounds": rounds,
        "senders": senders,
        "kinds": kinds or list(KINDS),
    }
    for phase, kinds in phases.items():
        for kind, took in kinds.items():
            result[f"{phase}_{kind}_p50_ms"] = round(1000 * _percentile(took, 0.5), 3)
            result[f"{phase}_{kind}_p99_ms"] = round(1000 * _percentile(took, 0.99), 3)
    for kind in ("health", "completion"):
        result[f"{kind}_p99_ratio"] = round(
            result[f"loaded_{kind}_p99_ms"] / result[f"idle_{kind}_p99_ms"], 3
        )
    # What the heavy requests were answered (route, status): refusals for the context are
    # expected (the fake workers' context is 512 tokens); a 5xx or INTERNAL is not.
    result["heavy_answers"] = {f"{r} {c}": answers.count((r, c)) for r, c in sorted(set(answers))}
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "heavy":
        heavy(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5].split(","))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probes", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--senders", type=int, default=4)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"of {','.join(KINDS + EXTRA_KINDS)}")
    args = p.parse_args()
    result = measure(args.probes, args.rounds, args.senders, args.kinds.split(","))
    result["command"] = " ".join(["benchmarks/router_limits_load.py", *sys.argv[1:]])
    print(json.dumps(result, indent=1))
    OUT.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
