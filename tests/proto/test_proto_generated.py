"""The committed gearshift.v1 modules are exactly what `make proto` generates from the .protos."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto" / "gearshift" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _generated(folder: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(folder.iterdir())
        if p.name.endswith(GENERATED_SUFFIXES)
    }


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("proto")
    out = root / "gearshift" / "v1"
    out.mkdir(parents=True)
    for src in PROTO_DIR.glob("*.proto"):
        shutil.copy(src, out / src.name)
    # The same command as `make proto`, run from a copy so the working tree is untouched.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{root}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            *sorted(str(p.relative_to(root)) for p in out.glob("*.proto")),
        ],
        check=True,
        cwd=root,
        timeout=120,
    )
    return _generated(out)


def test_committed_generated_modules_match_the_proto_files(regenerated: dict[str, bytes]) -> None:
    committed = _generated(PROTO_DIR)
    assert sorted(committed) == sorted(regenerated), "run `make proto` (files added or removed)"
    stale = [name for name in regenerated if committed[name] != regenerated[name]]
    assert not stale, f"run `make proto`: {stale} differ from the .proto files"


def test_generated_modules_import_under_the_gearshift_v1_package() -> None:
    bare = re.compile(r"^(import \w+_pb2|from \w+_pb2 import)", re.MULTILINE)
    for path in PROTO_DIR.glob("*_pb2*.py"):
        assert not bare.search(path.read_text()), f"{path.name} imports a sibling without package"
    assert "from gearshift.v1 import policy_pb2" in (PROTO_DIR / "router_pb2.py").read_text()
    from gearshift.v1 import router_pb2_grpc, worker_pb2_grpc

    assert hasattr(worker_pb2_grpc, "WorkerStub")
    assert hasattr(router_pb2_grpc, "AdminStub") and hasattr(router_pb2_grpc, "GenerationStub")
