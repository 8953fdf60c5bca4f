"""Regenerate the checked-in gRPC modules from averaging.proto.

The modules are generated into a temporary `dtnode/proto/` tree so that their imports read
`from dtnode.proto import ...` (protoc derives import paths from the include root).
Run `make proto` after editing the .proto; tests/test_proto.py fails if they drift apart.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ["averaging.proto"]


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules for PROTOS into out_dir; return their paths."""
    with tempfile.TemporaryDirectory() as tmp:
        package_dir = Path(tmp, "dtnode", "proto")
        package_dir.mkdir(parents=True)
        for name in PROTOS:
            shutil.copy(PROTO_DIR / name, package_dir / name)
        args = ["protoc", f"-I{tmp}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        args += [f"dtnode/proto/{name}" for name in PROTOS]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        written = []
        for path in sorted(package_dir.glob("*_pb2*.py*")):  # the modules, and the typing stub of the messages
            target = out_dir / path.name
            shutil.copy(path, target)
            written.append(target)
        return written


if __name__ == "__main__":
    for p in generate(PROTO_DIR):
        print("wrote", p.relative_to(PROTO_DIR.parent))
    sys.exit(0)
