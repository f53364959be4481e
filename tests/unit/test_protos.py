"""The committed gRPC stubs are exactly what ``python -m protos.generate`` makes from the .proto.

Edit ``protos/kvstore/v1/kvstore.proto``, then run ``python -m protos.generate`` and
commit the regenerated files; this test fails if they drift apart.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUBS = ["kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stubs")
    r = subprocess.run(
        [sys.executable, "-m", "protos.generate", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return out / "protos" / "kvstore" / "v1"


@pytest.mark.parametrize("name", STUBS)
def test_committed_stub_matches_the_generator(generated: Path, name: str) -> None:
    committed = (ROOT / "protos" / "kvstore" / "v1" / name).read_bytes()
    fresh = (generated / name).read_bytes()
    assert fresh == committed, (
        f"protos/kvstore/v1/{name} is stale: run `python -m protos.generate` and commit the result"
    )


def test_generator_writes_nothing_else(generated: Path) -> None:
    assert sorted(p.name for p in generated.iterdir()) == sorted(STUBS)


def test_stubs_import_from_the_package_root() -> None:
    from protos.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

    assert kvstore_pb2.DESCRIPTOR.package == "kvstore.v1"
    assert "KVStore" in kvstore_pb2.DESCRIPTOR.services_by_name
    assert hasattr(kvstore_pb2_grpc, "KVStoreStub")
    # enums start at *_UNSPECIFIED = 0 (architecture §8)
    for enum in kvstore_pb2.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED")
