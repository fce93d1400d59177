"""Regenerate the committed gRPC/protobuf stubs: `python -m tools.gen_protos`.

Compiles every protos/*.proto with grpcio-tools (a dev dependency) into protos/ as
*_pb2.py, *_pb2.pyi and *_pb2_grpc.py. Imports inside the stubs are `from protos import ...`,
so the repository root (or the installed distribution) must be on sys.path.
tests/tools/test_protos_drift.py regenerates into a temporary folder and fails if the
committed stubs differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Compile all protos into `out_root`/protos/; returns the generated files."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency, imported only here

    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "protos").mkdir(exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"   # google/protobuf/*.proto
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}"]
    args += [str(p.relative_to(ROOT)) for p in proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (out_root / "protos").iterdir()
                  if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT,
                        help="root to generate into (default: the repository root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
