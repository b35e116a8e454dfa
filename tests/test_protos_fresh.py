"""The committed generated protobuf code matches a fresh generation from protos/."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_generated_code_is_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    gen = _load_generator()
    fresh = {p.name: p.read_text() for p in gen.generate(tmp_path)}
    committed = {
        p.name: p.read_text()
        for p in (ROOT / "psflow" / "proto").iterdir()
        if p.name.endswith(gen.SUFFIXES)
    }
    assert sorted(fresh) == sorted(committed), "generated file set differs; run gen_protos.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"{stale} differ from protos/; run python scripts/gen_protos.py"


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
