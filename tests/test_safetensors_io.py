"""Our safetensors reader/writer against the reference ``safetensors`` package."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

from psflow.errors import DataLossError, InvalidArgumentError
from psflow.io import atomic_write
from psflow.io import manifest as mf
from psflow.io.safetensors import load_file, read_header, save_file

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, bool]


def _tensors():
    rng = np.random.default_rng(0)
    out = {}
    for i, dt in enumerate(DTYPES):
        shape = [(), (0,), (3,), (2, 3), (2, 0, 4)][i % 5]
        out[f"t{i}/{np.dtype(dt).name}"] = np.asarray(rng.standard_normal(shape) * 10).astype(dt)
    return out


def test_round_trip_every_dtype_and_shape(tmp_path):
    tensors = _tensors()
    digests = save_file(tmp_path / "a.safetensors", tensors, {"step": "3"})
    back = load_file(tmp_path / "a.safetensors", checksums=digests)
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert back[k].tobytes() == v.tobytes()
        assert digests[k] == hashlib.sha256(v.tobytes()).hexdigest()
    header, _ = read_header(tmp_path / "a.safetensors")
    assert header["__metadata__"] == {"step": "3"}


def test_files_we_write_load_with_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    tensors = _tensors()
    save_file(tmp_path / "ours.safetensors", tensors)
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    assert sorted(theirs) == sorted(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(theirs[k], v)
        assert theirs[k].dtype == v.dtype


def test_files_the_safetensors_package_writes_load_with_ours(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    tensors = {k: v for k, v in _tensors().items() if v.size}  # it rejects some empties
    st.save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"a": "b"})
    ours = load_file(tmp_path / "theirs.safetensors")
    for k, v in tensors.items():
        assert ours[k].tobytes() == v.tobytes() and ours[k].dtype == v.dtype
    mapped = load_file(tmp_path / "theirs.safetensors", mmap=True)
    for k, v in tensors.items():
        np.testing.assert_array_equal(mapped[k], v)


def test_checksum_mismatch_is_data_loss_naming_the_tensor(tmp_path):
    path = tmp_path / "c.safetensors"
    digests = save_file(path, {"w": np.arange(1000, dtype=np.float32)})
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(DataLossError, match="'w'"):
        load_file(path, checksums=digests)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda raw: raw[:5], "too short"),
        (lambda raw: struct.pack("<Q", 10**9) + raw[8:], "header length"),
        (lambda raw: raw[:8] + b"{not json" + raw[17:], "JSON"),
        (lambda raw: raw[:-4], "cover"),
    ],
    ids=["short", "huge-header", "bad-json", "truncated-data"],
)
def test_malformed_files_are_data_loss(tmp_path, mutate, match):
    path = tmp_path / "m.safetensors"
    save_file(path, {"w": np.arange(16, dtype=np.float32)})
    path.write_bytes(mutate(path.read_bytes()))
    with pytest.raises(DataLossError, match=match):
        load_file(path)


def test_offsets_that_do_not_tile_are_data_loss(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    header["b"] = {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}  # overlaps a
    blob = json.dumps(header).encode()
    path = tmp_path / "o.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(8))
    with pytest.raises(DataLossError, match="'b'"):
        load_file(path)


def test_unsupported_dtype_and_reserved_names_are_rejected(tmp_path):
    with pytest.raises(InvalidArgumentError, match="complex"):
        save_file(tmp_path / "x", {"c": np.zeros(2, np.complex64)})
    with pytest.raises(InvalidArgumentError, match="__metadata__"):
        save_file(tmp_path / "x", [("__metadata__", np.zeros(2))])
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_write(path) as f:
        f.write(b"new, half written")
        raise RuntimeError("crash")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_manifest_round_trip_and_validation(tmp_path):
    entry = {
        "name": "w",
        "dtype": "float32",
        "shape": [2],
        "trainable": True,
        "optimizer": None,
        "value_key": "v/w",
        "slots": {},
        "version": 1,
        "optimizer_step": 0,
        "sync_step": -1,
    }
    m = {"task": "ps:0", "step": 5, "tensor_file": "x", "variables": [entry], "checksums": {}}
    path = tmp_path / "m.json"
    mf.write_manifest(path, m)
    assert mf.read_manifest(path)["variables"] == [entry]
    bad = dict(entry, version="one")
    mf.write_manifest(path, dict(m, variables=[bad]))
    with pytest.raises(DataLossError, match="version"):
        mf.read_manifest(path)
    path.write_text("{")
    with pytest.raises(DataLossError, match="JSON"):
        mf.read_manifest(path)
