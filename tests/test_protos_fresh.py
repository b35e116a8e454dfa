"""The committed generated protobuf code matches a fresh generation from protos/."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


# The generator's version stamps: grpcio-tools writes its own version into every
# *_pb2_grpc.py and its protoc's into every *_pb2.py. A newer grpcio-tools on the
# machine (a patch release appears, CI installs it) changes only these lines; what they
# demand of the runtime is checked against pyproject.toml's floors below instead.
_STAMPS = (
    re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M),
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.\w+,)[\s\d,]*"),
)


def _unstamped(text: str) -> str:
    for stamp in _STAMPS:
        text = stamp.sub(lambda m: m.group(1) if m.groups() else "<version>", text)
    return text


def _floor(requirement: str) -> tuple[int, ...]:
    """pyproject.toml's lowest allowed version of ``requirement`` (a ``>=`` floor)."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(rf'"{re.escape(requirement)}>=([\d.]+)', text)
    assert found, f"pyproject.toml has no '{requirement}>=' floor"
    return tuple(int(x) for x in found.group(1).split("."))


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_generated_code_is_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    gen = _load_generator()
    # protoc runs in its own process: in-process it can crash once TensorFlow or
    # h5py (optional reference tests) have loaded their own protobuf runtime.
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir() if p.name.endswith(gen.SUFFIXES)}
    committed = {
        p.name: p.read_text()
        for p in (ROOT / "psflow" / "proto").iterdir()
        if p.name.endswith(gen.SUFFIXES)
    }
    assert sorted(fresh) == sorted(committed), "generated file set differs; run gen_protos.py"
    stale = [name for name in fresh if _unstamped(fresh[name]) != _unstamped(committed[name])]
    assert not stale, f"{stale} differ from protos/; run python scripts/gen_protos.py"


def test_the_generated_codes_version_stamps_are_within_pyproject_floors():
    # Generated code refuses a runtime older than the generator that wrote it: a floor
    # below the stamp would let pip install a grpcio or protobuf the import then refuses.
    grpc_floor, protobuf_floor = _floor("grpcio"), _floor("protobuf")
    for path in sorted((ROOT / "psflow" / "proto").glob("*_pb2_grpc.py")):
        stamp = re.search(r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", path.read_text(), re.M)
        assert stamp, path.name
        needed = tuple(int(x) for x in stamp.group(1).split("."))
        assert needed <= grpc_floor, (
            f"{path.name} needs grpcio {needed}, pyproject allows {grpc_floor}"
        )
    for path in sorted((ROOT / "psflow" / "proto").glob("*_pb2.py")):
        stamp = re.search(
            r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.\w+,\s*(\d+),\s*(\d+),\s*(\d+),",
            path.read_text(),
        )
        assert stamp, path.name
        needed = tuple(int(x) for x in stamp.groups())
        assert needed <= protobuf_floor, (
            f"{path.name} needs protobuf {needed}, pyproject allows {protobuf_floor}"
        )


def test_generated_imports_are_package_relative():
    text = (ROOT / "psflow" / "proto" / "ps_pb2.py").read_text()
    assert "from . import tensor_pb2" in text
    assert "from psflow.v1" not in text


def test_every_field_and_enum_value_is_commented():
    # Proto style rule: a comment line directly above every field, enum value,
    # message, enum, service and rpc.
    for proto in sorted((ROOT / "protos" / "psflow" / "v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            declares = s.startswith(("message ", "enum ", "service ", "rpc ")) or (
                s.endswith(";") and "=" in s and not s.startswith(("syntax", "option"))
            )
            if declares:
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} {s!r}"
