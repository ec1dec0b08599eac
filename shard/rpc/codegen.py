"""Regenerate the protobuf and purerpc code in ``shard/v1/`` from ``proto/``.

Run ``python -m shard.rpc.codegen`` after editing a .proto file (needs the ``grpcio-tools`` test
extra). ``tests/test_codegen.py`` regenerates into a temporary directory and fails when the
committed files are stale.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
PROTO_FILES = ("shard/v1/shard.proto",)
GENERATED = ("shard/v1/shard_pb2.py", "shard/v1/shard_pb2.pyi", "shard/v1/shard_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (python, pyi and purerpc outputs) into ``out_dir``; return generated files."""
    from grpc_tools import protoc  # test/dev extra only

    plugin = shutil.which("protoc-gen-purerpc", path=str(Path(sys.executable).parent))
    if plugin is None:
        raise SystemExit("protoc-gen-purerpc not found next to the Python interpreter")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--plugin=protoc-gen-purerpc={plugin}",
        f"--purerpc_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return [out_dir / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
