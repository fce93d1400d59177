"""The committed stubs in protos/ must be exactly what `python -m tools.gen_protos` makes."""

from __future__ import annotations

from pathlib import Path

from tools.gen_protos import PROTO_DIR, generate, proto_files


def test_committed_stubs_match_the_protos(tmp_path: Path):
    fresh = generate(tmp_path)
    assert {p.name for p in fresh} >= {f"{p.stem}_pb2.py" for p in proto_files()}
    committed = {p.name for p in PROTO_DIR.iterdir()
                 if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))}
    assert committed == {p.name for p in fresh}, "stub files added/removed: run gen_protos"
    stale = [p.name for p in fresh if p.read_bytes() != (PROTO_DIR / p.name).read_bytes()]
    assert not stale, f"stale stubs {stale}: run `python -m tools.gen_protos` and commit"


def test_stubs_import_and_carry_raw_bytes():
    from protos import node_pb2

    chunk = node_pb2.KvChunk(layer=3, block_ids=[5, 6], shape=[2, 16, 2, 8], dtype="float32",
                             data=b"\x00\x01" * 8)
    again = node_pb2.KvChunk.FromString(chunk.SerializeToString())
    assert again.data == b"\x00\x01" * 8 and list(again.block_ids) == [5, 6]
