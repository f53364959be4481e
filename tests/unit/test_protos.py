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


def test_stub_gencode_loads_under_protobuf_6_and_7() -> None:
    """LMCache pins ``protobuf<7``: the stubs' gencode must be 6.x (protobuf 7 loads 6.x gencode,
    protobuf 6 refuses 7.x gencode), and the package's range must admit both majors."""
    import re
    import tomllib

    header = (ROOT / "protos" / "kvstore" / "v1" / "kvstore_pb2.py").read_text()
    gencode = re.search(r"# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", header)
    assert gencode, "no gencode version in the stub's header"
    major, minor, patch = (int(x) for x in gencode.groups())
    assert major == 6, f"gencode {major}.{minor}.{patch}: protobuf 6 runtimes (LMCache's pin) cannot load it"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("protobuf")]
    low = re.search(r">=(\d+)\.(\d+)\.(\d+)", spec)
    assert low and tuple(int(x) for x in low.groups()) >= (major, minor, patch), spec
    assert "<8" in spec, spec
