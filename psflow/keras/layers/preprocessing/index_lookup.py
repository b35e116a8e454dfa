"""``StringLookup`` and ``IntegerLookup``: a vocabulary mapped to contiguous indices.

The index space is Keras's: the mask token (if any, and only with
``output_mode="int"``; other modes drop masked values) at 0, then
``num_oov_indices`` out-of-vocabulary buckets, then the vocabulary in order.
A value outside the vocabulary goes to the only OOV bucket, or with several:
text to ``fingerprint64(utf8) % num_oov_indices`` (TensorFlow's
``to_hash_bucket_fast``), integers to ``value mod num_oov_indices``. With
``invert=True`` the layer maps indices back to tokens (OOV and out-of-range
indices to the OOV token). Each call looks up every distinct value once.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor, TensorShape, constant
from psflow.keras.layers.base import Layer
from psflow.keras.layers.preprocessing import _common
from psflow.keras.layers.preprocessing.hash_functions import fingerprint64


class _IndexLookup(Layer):
    """The shared lookup; subclasses fix the token kind (text or integers)."""

    _text = True

    def __init__(
        self,
        max_tokens: int | None = None,
        num_oov_indices: int = 1,
        mask_token: Any = None,
        oov_token: Any = None,
        vocabulary: Any = None,
        invert: bool = False,
        output_mode: str = "int",
        pad_to_max_tokens: bool = False,
        sparse: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("vocabulary_dtype", None)
        kwargs.pop("encoding", None)
        idf_weights = kwargs.pop("idf_weights", None)
        output_mode = _common.LEGACY_OUTPUT_MODES.get(output_mode, output_mode)
        if output_mode != "int":
            kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        cls = type(self).__name__
        if max_tokens is not None and int(max_tokens) <= 1:
            raise errors.InvalidArgumentError(f"{cls}: max_tokens must be > 1, got {max_tokens!r}")
        if int(num_oov_indices) < 0:
            raise errors.InvalidArgumentError(
                f"{cls}: num_oov_indices must be >= 0, got {num_oov_indices!r}"
            )
        if sparse:
            raise errors.UnimplementedError(f"{cls}: sparse outputs are not implemented")
        if invert and output_mode != "int":
            raise errors.InvalidArgumentError(
                f"{cls}: invert=True needs output_mode='int', got {output_mode!r}"
            )
        self.output_mode = _common.check_output_mode(
            output_mode, (*_common.OUTPUT_MODES, "tf_idf"), cls
        )
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self.num_oov_indices = int(num_oov_indices)
        self.mask_token = self._token(mask_token) if mask_token is not None else None
        self.oov_token = self._token(oov_token)
        self.invert = bool(invert)
        self.pad_to_max_tokens = bool(pad_to_max_tokens)
        self.sparse = False
        self._input_vocabulary = vocabulary
        self._input_idf_weights = idf_weights
        self._tokens: list[Any] = []
        self._index: dict[Any, int] = {}
        self._idf: np.ndarray | None = None  # one weight per index (tf_idf), specials included
        if vocabulary is not None:
            self.set_vocabulary(vocabulary, idf_weights)
        elif idf_weights is not None:
            raise errors.InvalidArgumentError(
                f"{cls}: idf_weights needs a vocabulary (or adapt, which computes them)"
            )
        self.built = True

    # -- tokens ------------------------------------------------------------------------
    def _token(self, value: Any) -> Any:
        """A token in canonical form: ``str`` for text, ``int`` for integers."""
        if self._text:
            if isinstance(value, bytes):
                return value.decode("utf-8")
            if not isinstance(value, str):
                raise errors.InvalidArgumentError(
                    f"{type(self).__name__}: tokens must be text, got {value!r}"
                )
            return value
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise errors.InvalidArgumentError(
                f"{type(self).__name__}: tokens must be integers, got {value!r}"
            )
        return int(value)

    @property
    def _masks_to_zero(self) -> bool:
        """Whether the mask token has index 0 (in ``int`` mode; encodings drop it)."""
        return self.mask_token is not None and self.output_mode == "int"

    @property
    def _token_start(self) -> int:
        return self._masks_to_zero + self.num_oov_indices

    def get_vocabulary(self, include_special_tokens: bool = True) -> list[Any]:
        """The tokens by index: mask token, OOV token(s), then the vocabulary."""
        if not include_special_tokens:
            return list(self._tokens)
        specials = [self.mask_token] if self._masks_to_zero else []
        return [*specials, *([self.oov_token] * self.num_oov_indices), *self._tokens]

    def vocabulary_size(self) -> int:
        """The number of indices, special ones included."""
        return self._token_start + len(self._tokens)

    def set_vocabulary(self, vocabulary: Any, idf_weights: Any = None) -> None:
        """Replaces the vocabulary: a list or array of tokens, or a text file of one a line.

        A vocabulary that starts with the special tokens (as ``get_vocabulary``
        returns) is accepted as is. ``output_mode="tf_idf"`` needs ``idf_weights``,
        one per token given; the special indices get their mean unless the
        vocabulary includes them (Keras's rule).

        Raises:
            InvalidArgumentError: an empty vocabulary, a repeated token, the mask or
                OOV token inside it, or more tokens than ``max_tokens`` allows;
                ``idf_weights`` missing for ``tf_idf``, given for another mode, or
                not one per token.
        """
        cls = type(self).__name__
        if isinstance(vocabulary, (str, os.PathLike)):
            with open(vocabulary, encoding="utf-8") as f:
                vocabulary = [line for line in f.read().splitlines()]
                while vocabulary and vocabulary[-1] == "":
                    vocabulary.pop()
            if not self._text:
                vocabulary = [int(v) for v in vocabulary]
        values = _common.host_array(vocabulary, cls).reshape(-1).tolist()
        tokens = [self._token(v) for v in values]
        if not tokens:
            raise errors.InvalidArgumentError(f"{cls}: cannot set an empty vocabulary")
        idf = self._check_idf(idf_weights, len(tokens))
        specials = self.get_vocabulary()[: self._token_start]
        with_specials = tokens[: self._token_start] == specials
        if with_specials:
            tokens = tokens[self._token_start :]
        seen: set[Any] = set()
        repeated = sorted({t for t in tokens if t in seen or seen.add(t)}, key=str)
        if repeated:
            raise errors.InvalidArgumentError(f"{cls}: the vocabulary repeats {repeated}")
        for name, special in (("mask", self.mask_token), ("OOV", self.oov_token)):
            if special is not None and special in seen and (name == "mask" or self.num_oov_indices):
                raise errors.InvalidArgumentError(
                    f"{cls}: the {name} token {special!r} is in the vocabulary"
                )
        if self.max_tokens is not None and self._token_start + len(tokens) > self.max_tokens:
            raise errors.InvalidArgumentError(
                f"{cls}: {len(tokens)} tokens and {self._token_start} special indices exceed "
                f"max_tokens={self.max_tokens}"
            )
        self._tokens = tokens
        self._index = {t: i + self._token_start for i, t in enumerate(tokens)}
        if idf is not None:
            self._idf = idf if with_specials else self._with_special_idf(idf)

    def _check_idf(self, idf_weights: Any, count: int) -> np.ndarray | None:
        cls = type(self).__name__
        if self.output_mode != "tf_idf":
            if idf_weights is not None:
                raise errors.InvalidArgumentError(
                    f"{cls}: idf_weights apply to output_mode='tf_idf', not {self.output_mode!r}"
                )
            return None
        if idf_weights is None:
            raise errors.InvalidArgumentError(
                f"{cls}: output_mode='tf_idf' with a vocabulary needs idf_weights (one per token)"
            )
        idf = _common.host_array(idf_weights, cls).reshape(-1).astype(np.float32)
        if idf.size != count:
            raise errors.InvalidArgumentError(
                f"{cls}: {idf.size} idf_weights for a vocabulary of {count} tokens"
            )
        return idf

    def _with_special_idf(self, idf: np.ndarray) -> np.ndarray:
        """Token weights with the special indices in front, each the tokens' mean (Keras
        cannot know an OOV value's document frequency either)."""
        mean = np.float32(idf.mean()) if idf.size else np.float32(0)
        return np.concatenate([np.full(self._token_start, mean, np.float32), idf])

    def adapt(self, data: Any, batch_size: int | None = None, steps: int | None = None) -> None:
        """Learns the vocabulary from ``data``: tokens by decreasing count, ties by
        decreasing token (Keras's order), the special tokens left out, at most
        ``max_tokens`` indices in all.

        Raises:
            InvalidArgumentError: the layer got a vocabulary at construction, or
                ``data`` is not of the layer's token kind.
        """
        cls = type(self).__name__
        if self._input_vocabulary is not None:
            raise errors.InvalidArgumentError(
                f"{cls}: adapt cannot replace the vocabulary given at construction"
            )
        counts: dict[Any, int] = {}
        documents: dict[Any, int] = {}  # tf_idf: how many rows hold each token
        num_documents = 0
        for arr in _common.batches(data, steps, cls):
            self._check_kind(arr)
            uniq, n = np.unique(arr.reshape(-1), return_counts=True)
            for token, c in zip(uniq.tolist(), n.tolist()):
                token = self._token(token)
                counts[token] = counts.get(token, 0) + c
            if self.output_mode == "tf_idf":
                # a row is a document; a rank-1 batch is one token per document
                rows = arr.reshape(-1, 1) if arr.ndim < 2 else arr.reshape(-1, arr.shape[-1])
                num_documents += rows.shape[0]
                for row in rows:
                    for token in set(row.tolist()):
                        token = self._token(token)
                        documents[token] = documents.get(token, 0) + 1
        counts.pop(self.mask_token, None)
        if self.num_oov_indices:
            counts.pop(self.oov_token, None)
        order = sorted(counts, key=lambda t: (counts[t], t), reverse=True)
        if self.max_tokens is not None:
            order = order[: self.max_tokens - self._token_start]
        self._tokens = order
        self._index = {t: i + self._token_start for i, t in enumerate(order)}
        if self.output_mode == "tf_idf":
            df = np.array([documents.get(t, 0) for t in order], dtype=np.float64)
            idf = np.log1p(num_documents / (1.0 + df)).astype(np.float32)
            self._idf = self._with_special_idf(idf)

    # -- calling -------------------------------------------------------------------------
    def _check_kind(self, arr: np.ndarray) -> None:
        text = arr.dtype.kind == "O"
        want_text = self._text and not self.invert
        if text != want_text or (not text and arr.dtype.kind not in "iu"):
            raise errors.InvalidArgumentError(
                f"{self.name}: expected {'text' if want_text else 'integer'} inputs, got "
                f"elements of type {arr.dtype}"
            )

    def _oov_index(self, token: Any) -> int:
        if self.num_oov_indices == 1:
            return self._token_start - 1
        if self._text:
            bucket = fingerprint64(token.encode("utf-8")) % self.num_oov_indices
        else:
            bucket = token % self.num_oov_indices
        return self._masks_to_zero + bucket

    def _lookup(self, uniq: list[Any]) -> np.ndarray:
        out = np.empty(len(uniq), dtype=np.int64)
        missing = []
        for i, token in enumerate(uniq):
            token = self._token(token)
            found = self._index.get(token)
            if found is None:
                if self.mask_token is not None and token == self.mask_token:
                    found = 0 if self._masks_to_zero else -1  # -1: encodings drop it
                elif self.num_oov_indices == 0:
                    missing.append(token)
                    continue
                else:
                    found = self._oov_index(token)
            out[i] = found
        if missing:
            raise errors.InvalidArgumentError(
                f"{self.name}: values {missing[:5]} are not in the vocabulary and "
                "num_oov_indices=0 leaves them no index"
            )
        return out

    def _invert(self, uniq: list[Any]) -> np.ndarray:
        start, n = self._token_start, len(self._tokens)
        out = np.empty(len(uniq), dtype=object if self._text else np.int64)
        for i, index in enumerate(uniq):
            if self._masks_to_zero and index == 0:
                out[i] = self.mask_token
            elif start <= index < start + n:
                out[i] = self._tokens[index - start]
            else:
                out[i] = self.oov_token
        return out

    def call(self, inputs: Any) -> Tensor:
        if not self._tokens:
            raise errors.FailedPreconditionError(
                f"{self.name}: no vocabulary; pass vocabulary= or call adapt first"
            )
        arr = _common.host_array(inputs, self.name)
        self._check_kind(arr)
        uniq, inverse = np.unique(arr.reshape(-1), return_inverse=True)
        mapped = (self._invert if self.invert else self._lookup)(uniq.tolist())
        result = mapped[inverse].reshape(arr.shape)
        if self.invert:
            return constant(result)
        depth = (
            self.max_tokens
            if self.pad_to_max_tokens and self.max_tokens is not None
            else self.vocabulary_size()
        )
        dtype = "int64" if self.output_mode == "int" else self.dtype
        if self.output_mode != "tf_idf":
            return _common.encode(
                result, self.output_mode, depth, dtype, self.name, drop_negative=True
            )
        counts = _common.encode(result, "count", depth, dtype, self.name, drop_negative=True)
        weights = np.zeros(depth, dtype=dtype)  # indices past the vocabulary (padding): 0
        idf = self._idf if self._idf is not None else np.zeros(0, dtype)
        weights[: min(depth, idf.size)] = idf[:depth]
        return constant(counts.numpy() * weights)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        shape = tuple(input_shape)
        if self.output_mode == "int":
            return TensorShape(shape)
        depth = self.max_tokens if self.pad_to_max_tokens else self.vocabulary_size()
        if self.output_mode == "one_hot":
            keep = shape[:-1] if shape and shape[-1] == 1 else shape
            return TensorShape((*keep, depth))
        return TensorShape((*shape[:-1], depth) if len(shape) > 1 else (shape[0], depth))

    def get_config(self) -> dict[str, Any]:
        vocabulary = self._input_vocabulary
        if vocabulary is None and self._tokens:
            vocabulary = list(self._tokens)  # adapted: rebuilt layers get the same vocabulary
        elif isinstance(vocabulary, (np.ndarray, Tensor)):
            vocabulary = _common.host_array(vocabulary, self.name).tolist()
        return {
            **super().get_config(),
            "max_tokens": self.max_tokens,
            "num_oov_indices": self.num_oov_indices,
            "mask_token": self.mask_token,
            "oov_token": self.oov_token,
            "vocabulary": vocabulary,
            "invert": self.invert,
            "output_mode": self.output_mode,
            "idf_weights": self._config_idf(),
            "pad_to_max_tokens": self.pad_to_max_tokens,
            "sparse": self.sparse,
        }

    def _config_idf(self) -> Any:
        """The idf weights a rebuilt layer needs with the vocabulary :meth:`get_config` gives."""
        if self.output_mode != "tf_idf" or self._idf is None:
            return None
        if self._input_vocabulary is not None:  # rebuilt from the vocabulary given
            return _common.host_array(self._input_idf_weights, self.name).reshape(-1).tolist()
        return self._idf[self._token_start :].tolist()


class StringLookup(_IndexLookup):
    """Maps strings to indices of a vocabulary (Keras's ``StringLookup``).

    Example:
        >>> import psflow as pf
        >>> lookup = pf.keras.layers.StringLookup(vocabulary=["a", "b", "c"])
        >>> lookup(pf.constant([["a", "c"], ["d", "b"]])).numpy().tolist()
        [[1, 3], [0, 2]]
    """

    _text = True

    def __init__(
        self,
        max_tokens: int | None = None,
        num_oov_indices: int = 1,
        mask_token: str | None = None,
        oov_token: str = "[UNK]",
        vocabulary: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(max_tokens, num_oov_indices, mask_token, oov_token, vocabulary, **kwargs)


class IntegerLookup(_IndexLookup):
    """Maps integers to indices of a vocabulary (Keras's ``IntegerLookup``).

    Example:
        >>> import psflow as pf
        >>> lookup = pf.keras.layers.IntegerLookup(vocabulary=[12, 36, 1138])
        >>> lookup(pf.constant([12, 1138, 42])).numpy().tolist()
        [1, 3, 0]
    """

    _text = False

    def __init__(
        self,
        max_tokens: int | None = None,
        num_oov_indices: int = 1,
        mask_token: int | None = None,
        oov_token: int = -1,
        vocabulary: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(max_tokens, num_oov_indices, mask_token, oov_token, vocabulary, **kwargs)
