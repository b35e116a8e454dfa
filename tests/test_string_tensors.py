"""String tensors (dtype ``string``): conversion, and through ``Dataset`` slicing, map and batch."""

from __future__ import annotations

import numpy as np
import pytest

import psflow as pf
from psflow.data import Dataset


def test_text_of_every_form_becomes_a_string_tensor_of_str() -> None:
    for value, shape in [
        ("héllo", ()),
        (b"bytes", ()),
        (["a", "bb"], (2,)),
        (np.array([["x"], ["yz"]]), (2, 1)),
        (np.array([b"q", b"r"]), (2,)),
        (np.array(["o", b"p"], dtype=object), (2,)),
    ]:
        t = pf.constant(value)
        assert t.dtype == pf.string and t.shape == shape
        arr = np.asarray(t)  # numpy() of a scalar is the str itself, as TF gives bytes
        assert arr.dtype == object and all(type(e) is str for e in arr.reshape(-1))
    assert pf.constant(b"caf\xc3\xa9").numpy() == "café"  # bytes decode as UTF-8
    assert pf.as_dtype(np.dtype("<U3")) is pf.string and pf.as_dtype(str) is pf.string


def test_a_string_tensor_owns_its_array() -> None:
    source = np.array(["a", "b"], dtype=object)
    t = pf.constant(source)
    source[0] = "changed"
    assert t.numpy().tolist() == ["a", "b"]


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: pf.constant(["a", None]), "None"),
        (lambda: pf.constant(np.array([b"\xff"], dtype=object)), "UTF-8"),
        (lambda: pf.constant(["a"], dtype="float32"), "float32"),
        (lambda: pf.constant([1.5], dtype="string"), "1.5"),
        (lambda: pf.cast(pf.constant(["7"]), "int32"), "'7'"),
        (lambda: pf.ones([2]) + "abc", "'abc'"),
    ],
)
def test_bad_text_conversions_raise_type_error_naming_the_value(make, fragment: str) -> None:
    with pytest.raises(TypeError) as info:
        make()
    assert fragment in str(info.value)


def test_dataset_slices_maps_shuffles_and_batches_strings() -> None:
    words = np.array(["red", "green", "blue", "red", "amber"])
    ds = (
        Dataset.from_tensor_slices({"word": words, "n": np.arange(5)})
        .map(lambda e: (e["word"], e["n"] * 2))
        .shuffle(5, seed=1)
        .batch(2)
    )
    spec = ds.element_spec
    assert spec[0].dtype == pf.string and spec[0].shape.as_list() == [None]
    seen_words, seen_n = [], []
    for w, n in ds:
        assert w.dtype == pf.string and w.numpy().dtype == object
        seen_words += w.numpy().tolist()
        seen_n += n.numpy().tolist()
    assert sorted(seen_words) == sorted(words.tolist())
    assert [words[k // 2] for k in seen_n] == seen_words  # rows stay together


def test_dataset_of_one_string_component_yields_scalar_string_tensors() -> None:
    elems = list(Dataset.from_tensor_slices(["a", "b"]))
    assert [e.shape for e in elems] == [(), ()]
    assert [e.numpy() for e in elems] == ["a", "b"]
    assert [b.numpy().tolist() for b in Dataset.from_tensor_slices(["a", "b", "c"]).batch(2)] == [
        ["a", "b"],
        ["c"],
    ]


def test_map_may_return_text() -> None:
    out = [t.numpy() for t in Dataset.range(3).map(lambda x: "n")]
    assert out == ["n", "n", "n"]
