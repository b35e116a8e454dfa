"""Datasets that read files, and how a multi-worker strategy shards them by file.

* :class:`TextLineDataset` (``tf.data.TextLineDataset``): one string element
  per line of each file in turn, without its line ending (``\\n`` or
  ``\\r\\n``); plain, ``GZIP`` or ``ZLIB`` files.  Nothing is opened before
  the first element is asked for.
* :func:`list_files` (``Dataset.list_files``): the sorted names matching a
  glob pattern (a list of patterns: their union), shuffled unless
  ``shuffle=False``.
* :func:`shard_by_files`: ``AutoShardPolicy.FILE``.  As TensorFlow's
  auto-shard rewrite puts a ``shard(num_workers, index)`` before the inputs
  of every file reader, this gives each worker every ``num_workers``-th
  file: a reader's own list of names is cut, and where readers are made per
  element (``flat_map`` / ``interleave`` over a dataset of names) that
  dataset is cut, below a ``shuffle`` of it, so that workers that shuffle
  their names differently still read disjoint files.  Fewer files than
  workers is an error, as in TensorFlow.

Example:
    >>> import os, tempfile
    >>> import psflow as pf
    >>> d = tempfile.mkdtemp()
    >>> for i in range(2):
    ...     with open(os.path.join(d, f"part-{i}.txt"), "w") as f:
    ...         _ = f.write(f"a{i}\\nb{i}\\n")
    >>> names = pf.data.Dataset.list_files(os.path.join(d, "*.txt"), shuffle=False)
    >>> [x.numpy() for x in names.interleave(pf.data.TextLineDataset, cycle_length=2)]
    ['a0', 'a1', 'b0', 'b1']
"""

from __future__ import annotations

import copy
import glob
import gzip
import io
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow import dtypes, errors
from psflow.data.dataset import UNKNOWN_CARDINALITY, Dataset
from psflow.data.structure import TensorSpec, to_host_array

__all__ = ["TextLineDataset", "list_files", "reads_files", "shard_by_files"]

_COMPRESSION = ("", "GZIP", "ZLIB")


def _names(filenames: Any, what: str) -> list[str]:
    """``filenames`` (a string, a list or 1-D array of strings) as a list of str."""
    if isinstance(filenames, (str, bytes)):
        values: list[Any] = [filenames]
    elif isinstance(filenames, (list, tuple)):  # as given: an array would make 3 into "3"
        values = list(filenames)
    else:
        array = to_host_array(filenames, what)
        if array.ndim > 1:
            raise errors.InvalidArgumentError(
                f"{what} must be a string or a 1-D list of strings, got shape {array.shape}"
            )
        values = list(array.reshape(-1))
    names = []
    for v in values:
        if isinstance(v, bytes):
            v = v.decode("utf-8", "surrogateescape")
        if not isinstance(v, str):
            raise errors.InvalidArgumentError(f"{what} must be strings, got {v!r}")
        names.append(v)
    return names


def _with_inputs(node: Dataset, *inputs: Dataset) -> Any:
    """A shallow copy of ``node`` reading ``inputs`` (its derived caches dropped)."""
    copied = copy.copy(node)
    copied._inputs = tuple(inputs)
    copied._spec_cache = copied._template_cache = copied._packer = None
    return copied


def _string(value: str) -> np.ndarray:
    out = np.empty((), dtype=object)
    out[()] = value
    return out


class TextLineDataset(Dataset):
    """The lines of text files, one string element per line (``tf.data.TextLineDataset``).

    Args:
        filenames: a file name, a list (or 1-D string tensor) of them, or a
            dataset of names (each file read whole, in the dataset's order).
        compression_type: ``""`` or None (plain), ``"GZIP"`` or ``"ZLIB"``.
        buffer_size: bytes read at a time (None: 256 KiB).
        num_parallel_reads: accepted for TensorFlow's signature; files are
            read one after another (the order TensorFlow gives with None).

    Raises:
        InvalidArgumentError: a name that is not a string, an unknown
            compression, a bad buffer size; when read, a file that cannot be
            opened (``NotFoundError``) or decompressed (``DataLossError``).

    Example:
        >>> import os, tempfile
        >>> import psflow as pf
        >>> path = os.path.join(tempfile.mkdtemp(), "x.txt")
        >>> with open(path, "w") as f:
        ...     _ = f.write("one\\r\\ntwo\\nthree")
        >>> [x.numpy() for x in pf.data.TextLineDataset(path)]
        ['one', 'two', 'three']
    """

    def __init__(
        self,
        filenames: Any,
        compression_type: str | None = None,
        buffer_size: int | None = None,
        num_parallel_reads: int | None = None,
        name: str | None = None,
    ) -> None:
        if isinstance(filenames, Dataset):
            super().__init__(filenames)
            self._files: list[str] | None = None
        else:
            super().__init__()
            self._files = _names(filenames, "TextLineDataset: filenames")
        kind = (compression_type or "").upper()
        if kind not in _COMPRESSION:
            raise errors.InvalidArgumentError(
                f"TextLineDataset: compression_type must be one of {list(_COMPRESSION)}, "
                f"got {compression_type!r}"
            )
        self._compression = kind
        if buffer_size is not None and (isinstance(buffer_size, bool) or int(buffer_size) <= 0):
            raise errors.InvalidArgumentError(
                f"TextLineDataset: buffer_size must be > 0, got {buffer_size!r}"
            )
        self._buffer = 256 << 10 if buffer_size is None else int(buffer_size)

    def _derive_spec(self, *input_specs: Any) -> Any:
        return TensorSpec([], dtypes.string)

    def _cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    @property
    def filenames(self) -> list[str] | None:
        """The files it reads, in order (None: a dataset of names gives them)."""
        return None if self._files is None else list(self._files)

    def with_files(self, filenames: list[str]) -> TextLineDataset:
        """The same reader over ``filenames``."""
        node = _with_inputs(self)
        node._files = list(filenames)
        return node

    def _open(self, path: str) -> io.BufferedIOBase:
        try:
            raw = open(path, "rb", buffering=self._buffer)  # noqa: SIM115 (closed by _lines)
        except FileNotFoundError:
            raise errors.NotFoundError(f"TextLineDataset: {path}: no such file") from None
        except OSError as e:
            raise errors.InvalidArgumentError(f"TextLineDataset: cannot open {path}: {e}") from e
        if self._compression == "GZIP":
            return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
        return raw

    def _lines(self, path: str) -> Iterator[tuple[np.ndarray]]:
        stream = self._open(path)
        try:
            if self._compression == "ZLIB":
                try:
                    data = zlib.decompress(stream.read())
                except zlib.error as e:
                    raise errors.DataLossError(f"TextLineDataset: {path}: {e}") from None
                stream.close()
                stream = io.BytesIO(data)
            while True:
                try:
                    line = stream.readline()
                except (OSError, EOFError) as e:  # a corrupt or cut GZIP stream
                    raise errors.DataLossError(f"TextLineDataset: {path}: {e}") from None
                if not line:
                    return
                if line.endswith(b"\n"):
                    line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
                yield (_string(line.decode("utf-8", "surrogateescape")),)
        finally:
            stream.close()

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        if self._files is not None:
            names: Iterator[str] = iter(self._files)
        else:
            names = (str(flat[0][()]) for flat in self._inputs[0]._iter_flat())

        def gen() -> Iterator[tuple[Any, ...]]:
            for path in names:
                yield from self._lines(path)

        return gen()


def list_files(file_pattern: Any, shuffle: bool | None = None, seed: Any = None) -> Dataset:
    """The names of the files matching ``file_pattern`` (``Dataset.list_files``).

    Sorted, then shuffled unless ``shuffle`` is False (``seed`` makes the
    order repeatable).  A list of patterns gives their union.

    Raises:
        InvalidArgumentError: no file matches (the message names the pattern).
    """
    patterns = _names(file_pattern, "list_files: file_pattern")
    found = sorted({path for p in patterns for path in glob.glob(p)})
    if not found:
        raise errors.InvalidArgumentError(f"list_files: no files matched pattern: {patterns}")
    names = np.empty(len(found), dtype=object)
    names[:] = found
    dataset = Dataset.from_tensor_slices(names)
    if shuffle is None or shuffle:
        dataset = dataset.shuffle(len(found), seed=seed)
    return dataset


def reads_files(dataset: Dataset) -> bool:
    """Whether the pipeline has a file reader (:class:`TextLineDataset`, made per element too)."""
    return _rewrite(dataset, None) is not None


def shard_by_files(dataset: Dataset, num_shards: int, index: int) -> Dataset:
    """``dataset`` reading only the files of shard ``index`` of ``num_shards`` (module docstring).

    Raises:
        NotFoundError: the pipeline reads no files (as TensorFlow's FILE policy).
        InvalidArgumentError: fewer files than shards (the message gives both).
    """
    rewritten = _rewrite(dataset, (num_shards, index))
    if rewritten is None:
        raise errors.NotFoundError(
            "auto_shard_policy FILE: the dataset reads no files to shard by worker "
            "(no TextLineDataset in it); use AutoShardPolicy.DATA or OFF"
        )
    return rewritten


def _too_few(count: int, num_shards: int) -> errors.InvalidArgumentError:
    return errors.InvalidArgumentError(
        f"auto_shard_policy FILE: there are {count} input files for {num_shards} workers; "
        "give at least as many files as workers, or use AutoShardPolicy.DATA"
    )


def _makes_readers(node: Dataset) -> bool:
    """Whether ``node`` maps each element to a dataset that reads files."""
    from psflow.data.mapping import FlatMapDataset

    if not isinstance(node, FlatMapDataset):
        return False
    try:
        made = node._made_for_spec()
    except Exception:
        return False
    return reads_files(made)


def _shard_names(names: Dataset, shards: tuple[int, int]) -> Dataset:
    """``names`` cut to one shard, below a shuffle of it (workers' shuffles may differ)."""
    from psflow.data.shuffle import ShuffleDataset

    num, index = shards
    count = names._cardinality()
    if 0 <= count < num:
        raise _too_few(count, num)
    if isinstance(names, ShuffleDataset):
        return _with_inputs(names, _shard_names(names._inputs[0], shards))
    return names.shard(num, index)


def _rewrite(node: Dataset, shards: tuple[int, int] | None) -> Dataset | None:
    """``node`` with its file readers sharded (``shards`` None: only find them); None: none."""
    if isinstance(node, TextLineDataset):
        if shards is None:
            return node
        files = node.filenames
        if files is None:
            return _with_inputs(node, _shard_names(node._inputs[0], shards))
        num, index = shards
        if len(files) < num:
            raise _too_few(len(files), num)
        return node.with_files(files[index::num])
    if _makes_readers(node):
        if shards is None:
            return node
        return _with_inputs(node, _shard_names(node._inputs[0], shards))
    found = False
    inputs = []
    for d in node._inputs:
        r = _rewrite(d, shards)
        found = found or r is not None
        inputs.append(d if r is None else r)
    if not found:
        return None
    return node if shards is None else _with_inputs(node, *inputs)
