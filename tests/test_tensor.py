"""Tensor and Variable semantics: dtype inference, printing, operators, indexing, assign."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psflow as pf

# -- printed formats (TensorFlow's, with "psflow" for "tf") ------------------------------

FORMATS = {
    "int32-rank1": (
        lambda m: m.constant([1, 2, 3, 4, 5]) + 1,
        "psflow.Tensor([2 3 4 5 6], shape=(5,), dtype=int32)",
        "<psflow.Tensor: shape=(5,), dtype=int32, numpy=array([2, 3, 4, 5, 6], dtype=int32)>",
    ),
    "float32-rank0": (
        lambda m: m.constant(3.0),
        "psflow.Tensor(3.0, shape=(), dtype=float32)",
        "<psflow.Tensor: shape=(), dtype=float32, numpy=3.0>",
    ),
    "int32-rank0": (
        lambda m: m.constant(7),
        "psflow.Tensor(7, shape=(), dtype=int32)",
        "<psflow.Tensor: shape=(), dtype=int32, numpy=7>",
    ),
    "bool-rank0": (
        lambda m: m.constant(True),
        "psflow.Tensor(True, shape=(), dtype=bool)",
        "<psflow.Tensor: shape=(), dtype=bool, numpy=True>",
    ),
    "bool-rank1": (
        lambda m: m.constant([True, False]),
        "psflow.Tensor([ True False], shape=(2,), dtype=bool)",
        "<psflow.Tensor: shape=(2,), dtype=bool, numpy=array([ True, False])>",
    ),
    "float32-rank2": (
        lambda m: m.constant([[1.0, 2.0], [3.0, 4.5]]),
        "psflow.Tensor(\n[[1.  2. ]\n [3.  4.5]], shape=(2, 2), dtype=float32)",
        "<psflow.Tensor: shape=(2, 2), dtype=float32, numpy=\n"
        "array([[1. , 2. ],\n       [3. , 4.5]], dtype=float32)>",
    ),
    "int32-rank2": (
        lambda m: m.constant([[1, 2], [3, 4]]),
        "psflow.Tensor(\n[[1 2]\n [3 4]], shape=(2, 2), dtype=int32)",
        "<psflow.Tensor: shape=(2, 2), dtype=int32, numpy=\n"
        "array([[1, 2],\n       [3, 4]], dtype=int32)>",
    ),
    "float64-empty": (
        lambda m: m.zeros([2, 0], dtype=m.float64),
        "psflow.Tensor([], shape=(2, 0), dtype=float64)",
        "<psflow.Tensor: shape=(2, 0), dtype=float64, numpy=array([], shape=(2, 0), "
        "dtype=float64)>",
    ),
}

VARIABLE_FORMATS = {
    "int32-rank1": (
        lambda m: m.Variable([1, 2, 3, 4, 5], name="weights"),
        "<psflow.Variable 'weights:0' shape=(5,) dtype=int32, "
        "numpy=array([1, 2, 3, 4, 5], dtype=int32)>",
    ),
    "float32-rank0": (
        lambda m: m.Variable(2.0),
        "<psflow.Variable 'Variable:0' shape=() dtype=float32, numpy=2.0>",
    ),
    "float32-rank2": (
        lambda m: m.Variable([[1.0, 2.0]], name="w"),
        "<psflow.Variable 'w:0' shape=(1, 2) dtype=float32, "
        "numpy=array([[1., 2.]], dtype=float32)>",
    ),
    "bool-rank1": (
        lambda m: m.Variable([True], name="flag", trainable=False),
        "<psflow.Variable 'flag:0' shape=(1,) dtype=bool, numpy=array([ True])>",
    ),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tensor_str_and_repr(name: str) -> None:
    make, want_str, want_repr = FORMATS[name]
    t = make(pf)
    assert str(t) == want_str
    assert repr(t) == want_repr


@pytest.mark.parametrize("name", sorted(VARIABLE_FORMATS))
def test_variable_str_and_repr(name: str) -> None:
    make, want = VARIABLE_FORMATS[name]
    v = make(pf)
    assert repr(v) == want
    assert str(v) == want


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tensor_formats_match_tensorflow(name: str) -> None:
    tf = pytest.importorskip("tensorflow")
    make, _, _ = FORMATS[name]
    t_pf, t_tf = make(pf), make(tf)
    assert str(t_pf) == str(t_tf).replace("tf.Tensor", "psflow.Tensor")
    assert repr(t_pf) == repr(t_tf).replace("tf.Tensor", "psflow.Tensor")


@pytest.mark.parametrize("name", sorted(VARIABLE_FORMATS))
def test_variable_formats_match_tensorflow(name: str) -> None:
    tf = pytest.importorskip("tensorflow")
    make, _ = VARIABLE_FORMATS[name]
    assert repr(make(pf)) == repr(make(tf)).replace("tf.Variable", "psflow.Variable")


def test_large_tensors_print_summarized() -> None:
    text = str(pf.range(5000))
    assert "..." in text and text.endswith("shape=(5000,), dtype=int32)")


# -- dtype inference ---------------------------------------------------------------------

INFERENCE = [
    (1, pf.int32),
    (2**40, pf.int64),
    (-(2**31) - 1, pf.int64),
    (1.5, pf.float32),
    ([1, 2.5], pf.float32),
    (True, pf.bool),
    ([], pf.float32),
    ([[1, 2], [3, 4]], pf.int32),
    (np.float64(1.0), pf.float64),
    (np.array([1, 2], np.int64), pf.int64),
    (np.array([1, 2], np.uint8), pf.uint8),
    (np.array(1.0, np.float16), pf.float16),
    ((1, 2), pf.int32),
]


@pytest.mark.parametrize(("value", "dtype"), INFERENCE, ids=[repr(v) for v, _ in INFERENCE])
def test_dtype_inference(value: Any, dtype: pf.DType) -> None:
    assert pf.constant(value).dtype == dtype
    assert pf.convert_to_tensor(value).dtype == dtype


def test_explicit_dtype_converts_without_losing_data() -> None:
    assert pf.constant(1, dtype=pf.float64).numpy() == 1.0
    assert pf.constant(True, dtype=pf.int32).numpy() == 1
    assert pf.constant(np.array([1.5]), dtype=pf.float32).dtype == pf.float32
    with pytest.raises(TypeError, match=r"1\.5"):
        pf.constant(1.5, dtype=pf.int32)
    with pytest.raises(TypeError, match=r"\b1\b.*bool"):
        pf.constant(1, dtype=pf.bool)


def test_convert_to_tensor_keeps_tensors_and_checks_dtype() -> None:
    t = pf.constant([1.0])
    assert pf.convert_to_tensor(t) is t
    with pytest.raises(pf.errors.InvalidArgumentError, match="int32"):
        pf.convert_to_tensor(t, dtype=pf.int32)
    assert pf.convert_to_tensor(1, dtype_hint=pf.float32).dtype == pf.float32
    assert pf.convert_to_tensor(1.5, dtype_hint=pf.int32).dtype == pf.float32  # hint only


def test_constant_copies_and_reshapes() -> None:
    arr = np.array([1.0, 2.0], np.float32)
    t = pf.constant(arr)
    arr[0] = 99.0
    assert t.numpy()[0] == 1.0
    assert pf.constant(0.5, shape=(2, 3)).numpy().tolist() == [[0.5] * 3] * 2
    assert pf.constant([1, 2, 3, 4], shape=[2, 2]).shape == (2, 2)


@pytest.mark.parametrize("name", ["float32", "int64", "bool", "uint8", "float16", "double"])
def test_dtypes_by_name(name: str) -> None:
    d = pf.as_dtype(name)
    assert d is getattr(pf, name) and pf.as_dtype(d.np) is d and pf.as_dtype(d) is d
    assert pf.zeros([1], dtype=name).dtype == d


def test_python_types_map_to_tensorflow_dtypes() -> None:
    assert pf.as_dtype(float) is pf.float32
    assert pf.as_dtype(int) is pf.int32
    assert pf.as_dtype(bool) is pf.bool
    assert pf.float32.is_floating and pf.int8.is_integer and pf.uint16.is_unsigned
    assert pf.float32 == "float32" and pf.float32 != pf.float64


# -- attributes, conversions, operators --------------------------------------------------


def test_tensor_attributes() -> None:
    t = pf.constant([[1, 2, 3], [4, 5, 6]])
    assert t.shape == (2, 3) and t.shape.as_list() == [2, 3] and t.ndim == 2
    assert isinstance(t.shape, pf.TensorShape) and t.shape.num_elements() == 6
    assert t.device.endswith("device:CPU:0")
    assert len(t) == 2
    assert pf.is_tensor(t) and pf.is_tensor(pf.Variable(1.0)) and not pf.is_tensor(1.0)


def test_python_scalar_conversions() -> None:
    assert float(pf.constant(2.5)) == 2.5
    assert int(pf.constant(3)) == 3
    assert bool(pf.constant([True])) is True
    assert [10, 20, 30][pf.constant(1)] == 20
    with pytest.raises(TypeError, match="float32"):
        [1, 2][pf.constant(1.0)]
    with pytest.raises(pf.errors.InvalidArgumentError, match=r"\(2,\)"):
        bool(pf.constant([1, 2]))
    with pytest.raises(TypeError):
        len(pf.constant(1.0))


def test_tensors_are_unhashable_but_have_refs() -> None:
    a, b = pf.constant(1.0), pf.constant(1.0)
    with pytest.raises(TypeError):
        hash(a)
    refs = {a.ref(): "a", b.ref(): "b"}
    assert refs[a.ref()] == "a" and a.ref().deref() is a
    v = pf.Variable(1.0)
    assert {v: 1}[v] == 1


OPERATORS = [
    ("add", lambda x, y: x + y, np.add),
    ("radd", lambda x, y: 2 + y, lambda x, y: 2 + y),
    ("sub", lambda x, y: x - y, np.subtract),
    ("rsub", lambda x, y: 10 - x, lambda x, y: 10 - x),
    ("mul", lambda x, y: x * y, np.multiply),
    ("div", lambda x, y: x / y, np.divide),
    ("rdiv", lambda x, y: 1 / y, lambda x, y: 1 / y),
    ("floordiv", lambda x, y: x // y, np.floor_divide),
    ("mod", lambda x, y: x % y, np.mod),
    ("pow", lambda x, y: x**y, np.power),
    ("rpow", lambda x, y: 2**x, lambda x, y: 2**x),
    ("matmul", lambda x, y: x @ pf.transpose(y), lambda x, y: x @ y.T),
    ("neg", lambda x, y: -x, lambda x, y: -x),
    ("abs", lambda x, y: abs(-x), lambda x, y: abs(-x)),
    ("lt", lambda x, y: x < y, np.less),
    ("le", lambda x, y: x <= y, np.less_equal),
    ("gt", lambda x, y: x > y, np.greater),
    ("ge", lambda x, y: x >= y, np.greater_equal),
    ("eq", lambda x, y: x == y, np.equal),
    ("ne", lambda x, y: x != y, np.not_equal),
]


@pytest.mark.parametrize(("fn", "ref"), [pytest.param(f, r, id=n) for n, f, r in OPERATORS])
@pytest.mark.parametrize("kind", ["tensor", "variable"])
def test_operators_match_numpy(fn: Any, ref: Any, kind: str) -> None:
    a = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
    b = np.array([[2.0, 2.0, 1.5], [3.0, 5.0, 4.0]], np.float32)
    wrap = pf.constant if kind == "tensor" else pf.Variable
    got = fn(wrap(a), wrap(b))
    want = ref(a, b)
    assert isinstance(got, pf.Tensor)
    assert got.dtype == pf.as_dtype(want.dtype)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_logical_operators_on_bool_tensors() -> None:
    a, b = pf.constant([True, True, False]), pf.constant([True, False, False])
    assert (a & b).numpy().tolist() == [True, False, False]
    assert (a | b).numpy().tolist() == [True, True, False]
    assert (a ^ b).numpy().tolist() == [False, True, False]
    assert (~a).numpy().tolist() == [False, False, True]


def test_equality_with_none_or_incompatible_shapes_is_false() -> None:
    t = pf.constant([1, 2])
    assert (t == None) is False  # noqa: E711
    assert (t != None) is True  # noqa: E711
    assert (t == pf.constant([1, 2, 3])) is False


def test_numpy_values_on_either_side_adopt_the_tensor_dtype() -> None:
    t = pf.constant([1.0, 2.0])
    for y in (t * np.float64(2.0), np.float64(2.0) * t, t + np.array([1.0, 1.0]), 1 + t):
        assert isinstance(y, pf.Tensor) and y.dtype == pf.float32
    assert (pf.constant([1]) + np.int64(1)).dtype == pf.int32
    assert np.asarray(t).dtype == np.float32 and np.array(t, dtype=np.float64).dtype == np.float64


# -- indexing and iteration --------------------------------------------------------------

INDEXES = [
    (1, "1"),
    (-1, "-1"),
    (slice(1, None), "1:"),
    ((slice(1, None), slice(None, None, 2)), "1:,::2"),
    ((Ellipsis, 1), "...,1"),
    ((None, 0), "None,0"),
    ((slice(None, None, -1), 2), "::-1,2"),
    ((1, 2), "1,2"),
    ((slice(0, 0),), "0:0"),
]


@pytest.mark.parametrize("key", [k for k, _ in INDEXES], ids=[i for _, i in INDEXES])
def test_indexing_matches_numpy(key: Any) -> None:
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    got = pf.constant(a)[key]
    np.testing.assert_array_equal(got.numpy(), a[key])
    assert got.shape == a[key].shape
    np.testing.assert_array_equal(pf.Variable(a)[key].numpy(), a[key])


def test_indexing_with_scalar_tensors_and_rejecting_lists() -> None:
    t = pf.constant([10, 20, 30])
    assert int(t[pf.constant(2)]) == 30
    with pytest.raises(pf.errors.InvalidArgumentError, match=r"\[0, 1\].*gather"):
        t[[0, 1]]
    with pytest.raises(pf.errors.InvalidArgumentError, match="out of bounds"):
        t[3]


def test_slices_do_not_alias_the_tensor() -> None:
    v = pf.Variable([1.0, 2.0, 3.0])
    s = v[1:]
    v.assign([7.0, 8.0, 9.0])
    assert s.numpy().tolist() == [2.0, 3.0]


def test_iteration_over_the_first_dimension() -> None:
    rows = list(pf.constant([[1, 2], [3, 4], [5, 6]]))
    assert [r.numpy().tolist() for r in rows] == [[1, 2], [3, 4], [5, 6]]
    assert all(isinstance(r, pf.Tensor) for r in rows)
    assert [float(x) for x in pf.Variable([1.0, 2.0])] == [1.0, 2.0]
    with pytest.raises(TypeError, match="scalar"):
        iter(pf.constant(1))


# -- variables ---------------------------------------------------------------------------


def test_variable_attributes() -> None:
    v = pf.Variable([[1.0, 2.0]], name="w", trainable=False, dtype=pf.float64)
    assert v.name == "w:0" and not v.trainable and v.dtype == pf.float64
    assert v.shape == (1, 2) and v.ndim == 2
    assert pf.Variable(lambda: pf.ones([3])).shape == (3,)
    assert pf.Variable(1.0).trainable
    sync = pf.Variable(1.0, synchronization=pf.VariableSynchronization.ON_READ)
    assert not sync.trainable


def test_variable_numpy_is_a_copy() -> None:
    v = pf.Variable([1.0, 2.0])
    arr = v.numpy()
    arr[0] = 100.0
    assert v.numpy()[0] == 1.0
    r = v.read_value()
    v.assign_add([1.0, 1.0])
    assert r.numpy().tolist() == [1.0, 2.0]


def test_assign_family() -> None:
    v = pf.Variable([1.0, 2.0])
    assert v.assign([3.0, 4.0]) is v
    assert v.assign_add(pf.constant([1.0, 1.0])).numpy().tolist() == [4.0, 5.0]
    assert v.assign_sub(np.array([0.5, 0.5])).numpy().tolist() == [3.5, 4.5]
    assert v.assign([0.0, 0.0], read_value=False) is None
    assert v.numpy().tolist() == [0.0, 0.0]
    s = pf.Variable(1.0)
    s.assign_sub(0.25)
    assert float(s) == 0.75


BAD_ASSIGNS = [
    ("assign", [1.0, 2.0, 3.0], r"shape \(2,\) got shape \(3,\)"),
    ("assign", pf.constant([1, 2]), r"dtype float32 got dtype int32"),
    ("assign_add", pf.constant([1.0], pf.float64), r"dtype float32 got dtype float64"),
    ("assign_sub", 1.0, r"shape \(2,\) got shape \(\)"),
    ("assign", "ab", r"'ab'"),
    ("assign", [[1.0], [2.0, 3.0]], r"\[\[1\.0\], \[2\.0, 3\.0\]\]"),
    ("assign_add", [object(), 1.0], r"object"),
]


@pytest.mark.parametrize(("method", "value", "pattern"), BAD_ASSIGNS)
def test_bad_assign_raises_and_leaves_the_value_unchanged(
    method: str, value: Any, pattern: str
) -> None:
    v = pf.Variable([1.0, 2.0], name="w")
    with pytest.raises(pf.errors.InvalidArgumentError, match=pattern) as info:
        getattr(v, method)(value)
    assert "w:0" in str(info.value)
    assert v.numpy().tolist() == [1.0, 2.0] and v.dtype == pf.float32


def test_int_variable_refuses_fractional_values() -> None:
    v = pf.Variable([1, 2], name="counts")
    with pytest.raises(pf.errors.InvalidArgumentError, match=r"counts:0.*\[1\.5, 2\.5\]"):
        v.assign([1.5, 2.5])
    with pytest.raises(pf.errors.InvalidArgumentError, match="int32 got dtype float32"):
        v.assign_add(pf.constant([1.0, 1.0]))
    assert v.numpy().tolist() == [1, 2]
    v.assign_add([1, 1])
    assert v.numpy().tolist() == [2, 3] and v.dtype == pf.int32


def test_variable_declared_shape_is_checked() -> None:
    with pytest.raises(pf.errors.InvalidArgumentError, match=r"\(3,\)"):
        pf.Variable([1.0, 2.0, 3.0], shape=(2,))
    with pytest.raises(pf.errors.InvalidArgumentError, match="initial_value"):
        pf.Variable()


def test_variable_creator_scope_intercepts_creation() -> None:
    seen = []

    def creator(next_creator: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["name"])
        return next_creator(**kwargs)

    with pf.variable_creator_scope(creator):
        v = pf.Variable(1.0, name="inside")
    pf.Variable(1.0, name="outside")
    assert seen == ["inside"] and isinstance(v, pf.Variable)


def test_format_of_a_scalar_is_its_numpy_value_with_the_spec_applied() -> None:
    # TensorFlow formats an eager tensor as its NumPy value: "{}" gives 0.25, specs apply
    loss = pf.constant(0.25)
    assert "{}".format(loss) == "0.25" == format(np.float32(0.25))  # noqa: UP032
    assert f"{loss:.3f}" == "0.250"
    assert f"{pf.constant(7):>3d}" == "  7"
    assert f"{pf.constant('ab'):>4}" == "  ab"
    assert f"{loss!r}" == repr(loss)  # !r and str() keep the tensor's own text
    assert str(loss) == "psflow.Tensor(0.25, shape=(), dtype=float32)"


def test_format_of_a_non_scalar_is_numpys() -> None:
    t = pf.constant([1.0, 2.0])
    assert f"{t}" == format(np.array([1.0, 2.0], np.float32)) == "[1. 2.]"
    with pytest.raises(TypeError, match="format"):
        f"{t:.2f}"
