"""Fixtures for the operator tests: kmock, the stand-in Admin API and the kopf operator process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kmock_harness import Api, KmockApi, OperatorProcess, StandInAdmin, wait_for


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


@pytest.fixture(scope="module")
def operator_process(
    kmock_api: KmockApi, admin: StandInAdmin, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    tmp = tmp_path_factory.mktemp("operator")
    with OperatorProcess(
        kmock_api.kubeconfig(tmp / "kubeconfig"), admin.address, tmp / "kopf.log"
    ) as op:
        try:
            wait_for(op.alive, 5, "operator process")
            yield op
        finally:
            # pytest shows captured output only for failures: then the operator's log tail is there.
            print(op.log.read_text()[-4000:])


@pytest.fixture()
def repo() -> Path:
    return Path(__file__).resolve().parents[2]
