"""Regenerates psflow/proto/ from protos/psflow/v1/*.proto with grpc_tools.protoc.

Usage: ``python scripts/gen_protos.py`` from the repository root (needs the dev
extra: grpcio-tools).  The generated modules are committed; the imports protoc
writes (``from psflow.v1 import tensor_pb2``) are rewritten to package-relative
ones (``from . import tensor_pb2``) so the package works wherever psflow is
installed.  ``tests/test_protos_fresh.py`` fails when the committed files differ
from a fresh generation.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = pathlib.Path("psflow") / "v1"
OUT_DIR = ROOT / "psflow" / "proto"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _fix_imports(text: str) -> str:
    # protoc mirrors the proto package path; make it relative to psflow/proto.
    return re.sub(r"^from psflow\.v1 import (\w+)", r"from . import \1", text, flags=re.M)


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Generates the modules into ``out_dir``; returns the files written."""
    from grpc_tools import protoc  # dev-only dependency

    protos = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        for src in sorted((pathlib.Path(tmp) / PACKAGE_DIR).iterdir()):
            if not src.name.endswith(SUFFIXES):
                continue
            dst = out_dir / src.name
            dst.write_text(_fix_imports(src.read_text()))
            written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: regenerate into psflow/proto (or --out)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    if args.out == OUT_DIR:
        for old in OUT_DIR.glob("*_pb2*"):
            old.unlink()
    for path in generate(args.out):
        sys.stderr.write(f"wrote {path}\n")
    shutil.rmtree(args.out / "__pycache__", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
