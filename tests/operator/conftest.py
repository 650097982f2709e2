"""Fixtures for the operator tests: kmock, the stand-in Admin API and the kopf operator process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kmock_harness import Api, KmockApi, OperatorProcess, StandInAdmin, running_operator

from tests.worker.model.hub_server import HubServer, Repo


@pytest.fixture(scope="module")
def kmock_api() -> Iterator[KmockApi]:
    with KmockApi() as api:
        yield api


@pytest.fixture(scope="module")
def admin() -> Iterator[StandInAdmin]:
    with StandInAdmin() as server:
        yield server


@pytest.fixture(scope="module")
def api(kmock_api: KmockApi) -> Api:
    return Api(kmock_api.url)


EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    """A local Hub that knows every hf:// repository of docs/examples: the operator pins their
    `main` to a commit (model_pin.py) and must never reach the real Hub from a test."""
    with HubServer() as server:
        for path in sorted(EXAMPLES.glob("*.yaml")):
            source = yaml.safe_load(path.read_text())["spec"]["model"]["source"]
            if source.startswith("hf://"):
                repo = server.repos.setdefault(source.removeprefix("hf://"), Repo())
                if "main" not in repo.refs:
                    repo.add_commit({"config.json": source.encode()}, "main")
        yield server


@pytest.fixture(scope="module")
def operator_process(
    kmock_api: KmockApi,
    admin: StandInAdmin,
    hub: HubServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    tmp = tmp_path_factory.mktemp("operator")
    env = {"HF_ENDPOINT": hub.url}
    with running_operator(kmock_api, admin, tmp, env) as op:
        yield op


@pytest.fixture()
def repo() -> Path:
    return Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def cpu_profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The text of a profile measured on this CPU (cpu_profile.py), once per session."""
    from cpu_profile import measure

    return measure(tmp_path_factory.mktemp("cpu-profile")).read_text()
