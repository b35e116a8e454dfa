"""Dataset sources: from_tensor_slices, from_tensors, range, from_generator."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import psflow as pf
from psflow.data import Dataset, TensorSpec


def values(ds):
    return [np.asarray(x).tolist() for x in ds.as_numpy_iterator()]


# -- from_tensor_slices -------------------------------------------------------------------------


def test_slices_of_python_list_is_one_component():
    ds = Dataset.from_tensor_slices([[1, 2], [3, 4]])
    assert ds.element_spec == TensorSpec([2], pf.int32)
    assert values(ds) == [[1, 2], [3, 4]]


def test_slices_infer_tf_dtypes_and_keep_numpy_dtypes():
    ds = Dataset.from_tensor_slices(([1, 2], [1.5, 2.5], np.array([1.0, 2.0])))
    assert [s.dtype for s in ds.element_spec] == [pf.int32, pf.float32, pf.float64]


def test_slices_of_tuple_give_tuple_elements():
    ds = Dataset.from_tensor_slices((np.arange(3), np.arange(3) * 10))
    out = [(int(a), int(b)) for a, b in ds]
    assert out == [(0, 0), (1, 10), (2, 20)]


def test_slices_of_dict_keep_key_order_and_values():
    ds = Dataset.from_tensor_slices({"b": [1, 2], "a": [3.0, 4.0]})
    assert list(ds.element_spec) == ["b", "a"]
    first = next(iter(ds))
    assert list(first) == ["b", "a"]
    assert int(first["b"]) == 1 and float(first["a"]) == 3.0


def test_slices_of_nested_structure_and_namedtuple():
    Point = collections.namedtuple("Point", ["x", "y"])
    ds = Dataset.from_tensor_slices({"p": Point([1, 2], [3, 4]), "label": [0, 1]})
    e = list(ds.as_numpy_iterator())[1]
    assert isinstance(e["p"], Point)
    assert (int(e["p"].x), int(e["p"].y), int(e["label"])) == (2, 4, 1)


def test_slices_of_tensor_and_multidim_rows():
    x = pf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    ds = Dataset.from_tensor_slices(x)
    assert ds.element_spec == TensorSpec([3], pf.float32)
    rows = [t.numpy().tolist() for t in ds]
    assert rows == np.arange(12).reshape(4, 3).tolist()


def test_slices_copy_numpy_input():
    arr = np.arange(4)
    ds = Dataset.from_tensor_slices(arr)
    arr[:] = 100
    assert values(ds) == [0, 1, 2, 3]


def test_slices_reject_mismatched_lengths_naming_them():
    with pytest.raises(pf.errors.InvalidArgumentError, match=r"\[2, 3\]"):
        Dataset.from_tensor_slices(([1, 2], [1, 2, 3]))


def test_slices_reject_scalar():
    with pytest.raises(pf.errors.InvalidArgumentError, match="scalar"):
        Dataset.from_tensor_slices(5)


def test_slices_reject_data_that_is_neither_numbers_nor_text():
    with pytest.raises(TypeError, match="None"):
        Dataset.from_tensor_slices(["a", None])
    with pytest.raises(TypeError, match="object"):
        Dataset.from_tensor_slices(np.array([object(), object()]))


def test_slices_reject_ragged_lists():
    with pytest.raises(pf.errors.InvalidArgumentError):
        Dataset.from_tensor_slices([[1, 2], [3]])


def test_elements_are_psflow_tensors_on_cpu():
    t = next(iter(Dataset.from_tensor_slices([1.0, 2.0])))
    assert isinstance(t, pf.Tensor)
    assert t.dtype == pf.float32 and t.shape == ()
    assert t.device.endswith("CPU:0")


# -- from_tensors -------------------------------------------------------------------------------


def test_from_tensors_is_one_element():
    ds = Dataset.from_tensors(([1, 2, 3], 4.0))
    assert int(ds.cardinality()) == 1
    assert ds.element_spec == (TensorSpec([3], pf.int32), TensorSpec([], pf.float32))
    (a, b), *rest = list(ds.as_numpy_iterator())
    assert rest == [] and a.tolist() == [1, 2, 3] and b == 4.0


def test_from_tensors_repeat_batch():
    ds = Dataset.from_tensors([1, 2]).repeat(3).batch(2)
    assert values(ds) == [[[1, 2], [1, 2]], [[1, 2]]]


def test_from_tensors_accepts_scalar():
    assert values(Dataset.from_tensors(7)) == [7]


# -- range ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,expected",
    [
        ((5,), [0, 1, 2, 3, 4]),
        ((2, 5), [2, 3, 4]),
        ((1, 5, 2), [1, 3]),
        ((5, 1, -2), [5, 3]),
        ((1, 5, -1), []),
        ((0,), []),
    ],
)
def test_range_like_python(args, expected):
    ds = Dataset.range(*args)
    assert values(ds) == expected
    assert int(ds.cardinality()) == len(expected)
    assert ds.element_spec == TensorSpec([], pf.int64)


def test_range_output_type():
    ds = Dataset.range(3, output_type=pf.int32)
    assert next(iter(ds)).dtype == pf.int32


def test_range_rejects_zero_step_and_bad_args():
    with pytest.raises(pf.errors.InvalidArgumentError, match="step"):
        Dataset.range(0, 5, 0)
    with pytest.raises(TypeError, match=r"1\.5"):
        Dataset.range(1.5)
    with pytest.raises(TypeError):
        Dataset.range()


def test_range_huge_is_lazy():
    ds = Dataset.range(10**15).batch(4).take(2)
    assert values(ds) == [[0, 1, 2, 3], [4, 5, 6, 7]]


# -- from_generator -----------------------------------------------------------------------------


def test_generator_with_signature_and_variable_shapes():
    def gen():
        yield [1, 2]
        yield [3]

    ds = Dataset.from_generator(gen, output_signature=TensorSpec([None], pf.int32))
    assert values(ds) == [[1, 2], [3]]
    assert int(ds.cardinality()) == pf.data.UNKNOWN_CARDINALITY


def test_generator_tuple_signature_converts_dtypes():
    def gen():
        for i in range(3):
            yield i, [float(i)] * 2

    ds = Dataset.from_generator(
        gen, output_signature=(TensorSpec([], pf.int64), TensorSpec([2], pf.float32))
    )
    a, b = next(iter(ds))
    assert a.dtype == pf.int64 and b.dtype == pf.float32 and b.shape == (2,)


def test_generator_dict_signature():
    def gen():
        yield {"x": 1, "y": 2.0}

    ds = Dataset.from_generator(
        gen, output_signature={"x": TensorSpec([], pf.int32), "y": TensorSpec([], pf.float32)}
    )
    e = next(iter(ds))
    assert int(e["x"]) == 1 and float(e["y"]) == 2.0


def test_generator_output_types_and_shapes():
    ds = Dataset.from_generator(
        lambda: iter([[1, 2], [3]]), output_types=pf.int32, output_shapes=[None]
    )
    assert ds.element_spec == TensorSpec([None], pf.int32)
    unknown = Dataset.from_generator(lambda: iter([1]), output_types=pf.int32)
    assert unknown.element_spec.shape is None
    assert (
        repr(unknown.element_spec) == "TensorSpec(shape=<unknown>, dtype=psflow.int32, name=None)"
    )


def test_generator_args_and_fresh_call_each_pass():
    calls = []

    def gen(lo, hi):
        calls.append((int(lo), int(hi)))
        yield from range(int(lo), int(hi))

    ds = Dataset.from_generator(gen, output_types=pf.int64, args=(1, 4))
    assert values(ds) == [1, 2, 3]
    assert values(ds.repeat(2)) == [1, 2, 3, 1, 2, 3]
    assert calls == [(1, 4)] * 3


def test_generator_requires_a_signature():
    with pytest.raises(TypeError, match="output_signature"):
        Dataset.from_generator(lambda: iter([1]))


def test_generator_rejects_non_callable_and_bad_signature():
    with pytest.raises(TypeError, match="callable"):
        Dataset.from_generator([1, 2], output_types=pf.int32)
    with pytest.raises(TypeError, match="TensorSpec"):
        Dataset.from_generator(lambda: iter([1]), output_signature=pf.int32)


def test_generator_shape_mismatch_names_shapes():
    ds = Dataset.from_generator(
        lambda: iter([[1, 2, 3]]), output_signature=TensorSpec([2], pf.int32)
    )
    with pytest.raises(pf.errors.InvalidArgumentError, match=r"\(3,\).*\(2,\)"):
        list(ds)


def test_generator_structure_mismatch_and_lossy_values():
    ds = Dataset.from_generator(
        lambda: iter([1]), output_signature=(TensorSpec([], pf.int32), TensorSpec([], pf.int32))
    )
    with pytest.raises(TypeError, match="structure"):
        list(ds)
    lossy = Dataset.from_generator(lambda: iter([1.5]), output_types=pf.int32)
    with pytest.raises(TypeError, match=r"1\.5"):
        list(lossy)
    text = Dataset.from_generator(lambda: iter(["a"]), output_types=pf.int32)
    with pytest.raises(TypeError, match="'a'"):
        list(text)


# -- files: TextLineDataset, list_files, interleave ------------------------------------------


def test_text_lines_plain_gzip_and_zlib_read_alike(tmp_path):
    import gzip
    import zlib

    text = b"one\r\ntwo\n\nthree"  # CRLF and LF endings, an empty line, no final newline
    (tmp_path / "a.txt").write_bytes(text)
    (tmp_path / "a.gz").write_bytes(gzip.compress(text))
    (tmp_path / "a.z").write_bytes(zlib.compress(text))
    want = ["one", "two", "", "three"]
    for name, kind in (("a.txt", None), ("a.gz", "GZIP"), ("a.z", "ZLIB")):
        ds = pf.data.TextLineDataset(str(tmp_path / name), compression_type=kind)
        assert [x.numpy() for x in ds] == want, name


def test_text_lines_bad_input_is_a_typed_error_naming_it(tmp_path):
    with pytest.raises(pf.errors.InvalidArgumentError, match="'BZIP2'"):
        pf.data.TextLineDataset("x.txt", compression_type="BZIP2")
    with pytest.raises(pf.errors.InvalidArgumentError, match="must be strings, got 3"):
        pf.data.TextLineDataset(["a.txt", 3])
    with pytest.raises(pf.errors.InvalidArgumentError, match="buffer_size must be > 0"):
        pf.data.TextLineDataset("x.txt", buffer_size=0)
    missing = pf.data.TextLineDataset(str(tmp_path / "missing.txt"))  # nothing opened yet
    with pytest.raises(pf.errors.NotFoundError, match=r"missing\.txt"):
        list(missing)
    (tmp_path / "cut.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(pf.errors.DataLossError, match=r"cut\.gz"):
        list(pf.data.TextLineDataset(str(tmp_path / "cut.gz"), compression_type="GZIP"))
    with pytest.raises(pf.errors.InvalidArgumentError, match="no files matched"):
        pf.data.Dataset.list_files(str(tmp_path / "*.none"))


def test_list_files_is_sorted_or_seeded_and_a_dataset_of_names_feeds_a_reader(tmp_path):
    for i in (2, 0, 1):
        (tmp_path / f"p{i}.txt").write_text(f"line{i}\n")
    pattern = str(tmp_path / "p*.txt")
    names = [x.numpy() for x in pf.data.Dataset.list_files(pattern, shuffle=False)]
    assert names == [str(tmp_path / f"p{i}.txt") for i in range(3)]
    a = [x.numpy() for x in pf.data.Dataset.list_files(pattern, seed=7)]
    b = [x.numpy() for x in pf.data.Dataset.list_files(pattern, seed=7)]
    assert a == b and sorted(a) == names
    lines = pf.data.TextLineDataset(pf.data.Dataset.list_files(pattern, shuffle=False))
    assert [x.numpy() for x in lines] == ["line0", "line1", "line2"]


def test_interleave_follows_tensorflows_documented_order_and_checks_its_lengths():
    # TF's interleave documentation: range(1, 6), each element repeated 6 times,
    # cycle_length=2, block_length=4
    ds = pf.data.Dataset.range(1, 6).interleave(
        lambda x: pf.data.Dataset.from_tensors(x).repeat(6), cycle_length=2, block_length=4
    )
    assert [int(x) for x in ds] == (
        [1] * 4 + [2] * 4 + [1] * 2 + [2] * 2 + [3] * 4 + [4] * 4 + [3] * 2 + [4] * 2 + [5] * 6
    )
    with pytest.raises(pf.errors.InvalidArgumentError, match="block_length"):
        pf.data.Dataset.range(3).interleave(pf.data.Dataset.from_tensors, 1, 0)
