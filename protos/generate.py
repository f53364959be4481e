"""Regenerate the committed gRPC stubs: ``python -m protos.generate [OUT_DIR]``.

Stubs are generated from the repository root so their imports read
``from protos.kvstore.v1 import kvstore_pb2``; ``tests/unit/test_protos.py``
regenerates into a temporary directory and fails if the committed ones differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "protos/kvstore/v1/kvstore.proto"


def generate(out_dir: Path = ROOT) -> None:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
