"""The committed stubs in protos/ must be exactly what `python -m tools.gen_protos` makes."""

from __future__ import annotations

import re
from pathlib import Path

from tools.gen_protos import PROTO_DIR, generate, proto_files


def test_committed_stubs_match_the_protos(tmp_path: Path):
    fresh = generate(tmp_path)
    assert {p.name for p in fresh} >= {f"{p.stem}_pb2.py" for p in proto_files()}
    committed = {p.name for p in PROTO_DIR.iterdir()
                 if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))}
    assert committed == {p.name for p in fresh}, "stub files added/removed: run gen_protos"
    stale = [p.name for p in fresh
             if _content(p.read_text()) != _content((PROTO_DIR / p.name).read_text())]
    assert not stale, f"stale stubs {stale}: run `python -m tools.gen_protos` and commit"


# The generator's own version, written into every stub: a new grpcio-tools release on PyPI
# (a fresh clone installs the latest) changes only this line, not what the stubs say. What
# the protos declare must match; the release that wrote them need not.
_GENERATOR_VERSION = re.compile(r"^GRPC_GENERATED_VERSION = '[0-9.]+'$", re.M)


def _content(text: str) -> str:
    return _GENERATOR_VERSION.sub("GRPC_GENERATED_VERSION = <version>", text)


def test_a_stub_that_differs_beyond_the_generator_version_is_stale():
    stub = (PROTO_DIR / "node_pb2_grpc.py").read_text()
    newer = _GENERATOR_VERSION.sub("GRPC_GENERATED_VERSION = '99.0.0'", stub)
    assert newer != stub and _content(newer) == _content(stub)
    assert _content(stub.replace("def ", "def  ", 1)) != _content(stub)


def test_stubs_import_and_carry_raw_bytes():
    from protos import node_pb2

    chunk = node_pb2.KvChunk(layer=3, block_ids=[5, 6], shape=[2, 16, 2, 8], dtype="float32",
                             data=b"\x00\x01" * 8)
    again = node_pb2.KvChunk.FromString(chunk.SerializeToString())
    assert again.data == b"\x00\x01" * 8 and list(again.block_ids) == [5, 6]
