"""The checked-in generated modules must match averaging.proto."""

import importlib.util
from pathlib import Path

import pytest

from dtnode.proto import averaging_pb2

pytest.importorskip("grpc_tools")
PROTO_DIR = Path(__file__).resolve().parents[1] / "proto"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_modules_match_the_proto(tmp_path):
    generate = _load(PROTO_DIR / "generate.py")
    written = generate.generate(tmp_path)
    assert {p.name for p in written} == {"averaging_pb2.py", "averaging_pb2.pyi", "averaging_pb2_grpc.py"}
    for path in written:
        assert path.read_text() == (PROTO_DIR / path.name).read_text(), f"{path.name} is stale: run `make proto`"
    assert averaging_pb2.DESCRIPTOR.services_by_name["Averaging"].methods_by_name["Reduce"].client_streaming
