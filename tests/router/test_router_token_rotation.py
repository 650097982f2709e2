"""Token rotation on a running router (issue 31, item 4): new Secret versions of the admin and
control tokens are picked up without a restart, the old tokens stay valid for the grace window
(so pods the kubelet refreshes later still get through), and a wrong token is refused."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import httpx
import pytest

from gearshift.operator.router.config import GroupSpec, RouterConfig
from gearshift.operator.router.server import RouterServer, load_tokenizer
from gearshift.v1 import router_pb2, router_pb2_grpc
from gearshift.worker.server import auth
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_worker import FakeWorker


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


def _rotate(path: Path, token: str) -> None:
    """As the kubelet updates a mounted Secret: a whole new file, renamed in."""
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_text(token)
    os.replace(tmp, path)


async def _until(predicate: object, what: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def test_rotated_tokens_are_picked_up_by_a_running_router_and_its_workers(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    admin_file = auth.write_token(tmp_path / "admin", "admin-1")
    # The router and the worker pod each mount the control token: separate files, refreshed
    # at different times, as the kubelet does pod by pod.
    router_file = auth.write_token(tmp_path / "router-control", "control-1")
    worker_file = auth.write_token(tmp_path / "worker-control", "control-1")

    async def main() -> None:
        worker_token = auth.TokenSource.from_file(worker_file)
        worker = await FakeWorker("g0", token=worker_token).start()  # type: ignore[arg-type]
        config = RouterConfig(
            model_name="fake",
            model_path="smollm2",
            groups=(GroupSpec(worker.name, worker.address),),
            host="127.0.0.1",
            http_port=0,
            grpc_port=None,
            admin_host="127.0.0.1",
            admin_port=0,
            poll_interval_s=0.1,
            rpc_timeout_s=2.0,
            control_token="control-1",
            control_token_file=router_file,
            admin_token="admin-1",
            admin_token_file=admin_file,
        )
        server = RouterServer(config, tokenizer=tokenizer)
        ports = await server.start()
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports.http}", timeout=20)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{ports.admin}")
        admin = router_pb2_grpc.AdminStub(channel)

        async def status_with(token: str) -> grpc.StatusCode:
            try:
                await admin.GetStatus(
                    router_pb2.GetStatusRequest(),
                    metadata=(("authorization", f"Bearer {token}"),),
                    timeout=5,
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        async def ready() -> bool:
            return (await http.get("/ready")).status_code == 200

        async def completes() -> bool:
            r = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            return r.status_code == 200

        try:
            await _until(ready, "the worker serving")
            assert await status_with("admin-1") == grpc.StatusCode.OK
            assert await status_with("wrong") == grpc.StatusCode.UNAUTHENTICATED

            # Admin: a new Secret version is taken within the recheck interval; the old token
            # keeps working for the grace window (the operator may still hold it).
            _rotate(admin_file, "admin-2")

            async def admin_rotated() -> bool:
                return await status_with("admin-2") == grpc.StatusCode.OK

            await _until(admin_rotated, "the new admin token accepted")
            assert await status_with("admin-1") == grpc.StatusCode.OK
            assert await status_with("admin-3") == grpc.StatusCode.UNAUTHENTICATED

            # Control token, worker pod refreshed first: the router still sends the old token,
            # which the worker accepts for the grace window.
            _rotate(worker_file, "control-2")
            await asyncio.sleep(1.5)  # past the worker's recheck: it now holds control-2
            assert worker_token.tokens() == ("control-2", "control-1")
            assert await completes() and await ready()
            # Then the router's copy: it sends the new token (and the old one, in the window).
            _rotate(router_file, "control-2")
            await asyncio.sleep(1.5)
            assert await completes() and await ready()
            assert auth.call_metadata(server.router.pool.token)[0] == (  # type: ignore[union-attr,index]
                "authorization",
                "Bearer control-2",
            )
        finally:
            await channel.close()
            await http.aclose()
            await server.stop(drain_timeout_s=1)
            await worker.stop()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_a_router_that_never_got_the_new_token_is_refused_once_the_grace_window_ends(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The window is a bound, not a back door: after it only the current token works."""
    worker_file = auth.write_token(tmp_path / "worker-control", "control-1")

    async def main() -> None:
        worker_token = auth.TokenSource.from_file(worker_file, grace_s=1.0)
        worker = await FakeWorker("g0", token=worker_token).start()  # type: ignore[arg-type]
        config = RouterConfig(
            model_name="fake",
            model_path="smollm2",
            groups=(GroupSpec(worker.name, worker.address),),
            host="127.0.0.1",
            http_port=0,
            grpc_port=None,
            admin_port=None,
            poll_interval_s=0.1,
            rpc_timeout_s=2.0,
            control_token="control-1",  # no file: this router never sees a rotation
        )
        server = RouterServer(config, tokenizer=tokenizer)
        ports = await server.start()
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports.http}", timeout=20)

        async def ready() -> bool:
            return (await http.get("/ready")).status_code == 200

        async def not_ready() -> bool:
            return not await ready()

        try:
            await _until(ready, "the worker serving")
            _rotate(worker_file, "control-2")
            await _until(not_ready, "the old token refused after the grace window")
            assert worker_token.tokens() == ("control-2",)
        finally:
            await http.aclose()
            await server.stop(drain_timeout_s=1)
            await worker.stop()

    asyncio.run(asyncio.wait_for(main(), 90))
