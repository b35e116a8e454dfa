"""Gradient compression on the push: 16-bit codecs with error feedback.

Across hosts a push is bound by the wire; a float32 gradient sent as 16-bit
halves its bytes.  The worker encodes, the PS decodes back to the variable's
dtype before the update rule runs, so optimizer state stays full precision.

Codecs (registry, :func:`get_codec`):

* ``"fp16"``: IEEE half (10-bit mantissa, range +-65504; larger magnitudes
  saturate to +-inf, so gradients should be scaled sensibly);
* ``"bf16"``: bfloat16, the top 16 bits of a float32 rounded to nearest even
  (float32's range, 7-bit mantissa);
* ``"none"``: no compression (what a push does without a codec).

Rounding alone biases training: a component smaller than the gradient's
quantization step can be lost every step.  :class:`ErrorFeedback` keeps, per
variable, what the wire lost (``residual = corrected - decode(encode(corrected))``)
and adds it to the next gradient, so the sum of what the PS applied tracks the
sum of the true gradients to within one quantization error, not a growing one.

Example:
    >>> import numpy as np
    >>> ef = ErrorFeedback(get_codec("bf16"))
    >>> enc = ef.encode("w", np.full(4, 1.001, np.float32))
    >>> enc.wire.nbytes, enc.decode().dtype.name
    (8, 'float32')
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Mapping

import numpy as np

from psflow.errors import InvalidArgumentError
from psflow.proto import ps_pb2
from psflow.ps.tensors import Segments

__all__ = [
    "CODECS",
    "Codec",
    "Encoded",
    "ErrorFeedback",
    "codec_for_wire",
    "decode_segments",
    "feedback_from_option",
    "get_codec",
    "wire_dtype",
]


class Codec(abc.ABC):
    """A lossy element-wise encoding of floating-point gradients."""

    #: registry name
    name: str = ""
    #: the ``ps_pb2.Compression`` value that announces it on the wire
    wire_code: int = 0
    #: element type of the encoded payload
    dtype: np.dtype = np.dtype(np.float32)

    @abc.abstractmethod
    def _encode(self, array: np.ndarray) -> np.ndarray: ...

    @abc.abstractmethod
    def _decode(self, wire: np.ndarray) -> np.ndarray:
        """float32 values of ``wire``."""

    def encode(self, array: np.ndarray) -> Encoded:
        """The wire form of a floating-point array.

        Raises:
            InvalidArgumentError: ``array`` is not floating-point.
        """
        arr = np.asarray(array)
        if arr.dtype.kind != "f":
            raise InvalidArgumentError(
                f"codec {self.name!r} compresses floating-point gradients, got {arr.dtype.name}"
            )
        return Encoded(self, np.ascontiguousarray(self._encode(arr)), arr.dtype, arr.shape)

    def decode(self, wire: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """The values ``wire`` encodes, as ``dtype`` (flat or shaped like ``wire``)."""
        out = self._decode(wire)
        return out if out.dtype == dtype else out.astype(dtype)


class _Fp16(Codec):
    name, wire_code, dtype = "fp16", ps_pb2.COMPRESSION_FP16, np.dtype("<f2")

    def _encode(self, array: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # saturation to inf is documented
            return array.astype(self.dtype)

    def _decode(self, wire: np.ndarray) -> np.ndarray:
        return wire.astype(np.float32)


class _Bf16(Codec):
    name, wire_code, dtype = "bf16", ps_pb2.COMPRESSION_BF16, np.dtype("<u2")

    def _encode(self, array: np.ndarray) -> np.ndarray:
        bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
        # round to nearest, ties to even: add 0x7FFF plus the lowest kept bit
        # (in place on one temporary: this runs over every pushed element)
        tmp = bits >> np.uint32(16)
        tmp &= np.uint32(1)
        tmp += np.uint32(0x7FFF)
        tmp += bits
        tmp >>= np.uint32(16)
        out = tmp.astype(self.dtype)
        if not np.isfinite(array).all():
            # rounding could carry a NaN's low payload bits into inf: keep NaN a NaN
            nan = np.isnan(array).reshape(out.shape)
            out[nan] = 0x7FC0
        return out

    def _decode(self, wire: np.ndarray) -> np.ndarray:
        return (wire.astype(np.uint32) << np.uint32(16)).view(np.float32)


CODECS: dict[str, type[Codec]] = {"fp16": _Fp16, "bf16": _Bf16}
_BY_WIRE: dict[int, type[Codec]] = {c.wire_code: c for c in CODECS.values()}


def get_codec(name: str) -> Codec | None:
    """The codec registered as ``name`` (None for ``"none"``).

    Raises:
        InvalidArgumentError: an unknown name (the message lists the choices).
    """
    if name == "none":
        return None
    cls = CODECS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidArgumentError(
            f"unknown compression codec {name!r}; choose one of {['none', *CODECS]}"
        )
    return cls()


def codec_for_wire(code: int) -> Codec | None:
    """The codec a push item announces (None: uncompressed).

    Raises:
        InvalidArgumentError: a code this build does not know.
    """
    if code == ps_pb2.COMPRESSION_NONE:
        return None
    cls = _BY_WIRE.get(int(code))
    if cls is None:
        raise InvalidArgumentError(f"unknown compression code {int(code)} in a push")
    return cls()


def wire_dtype(code: int, dtype: np.dtype, what: str) -> np.dtype:
    """The payload's element type for a push item of ``dtype`` under wire ``code``.

    Raises:
        InvalidArgumentError: unknown code, or compression of a non-float tensor.
    """
    codec = codec_for_wire(code)
    if codec is None:
        return dtype
    if dtype.kind != "f":
        raise InvalidArgumentError(f"{what} is {dtype.name}: only floats can be {codec.name}")
    return codec.dtype


def decode_segments(code: int, segments: Segments, dtype: np.dtype) -> Segments:
    """The decoded ``dtype`` values of a received compressed payload, piece by piece."""
    codec = codec_for_wire(code)
    if codec is None:
        return segments
    return Segments(
        dtype, segments.shape, [(off, codec.decode(part, dtype)) for off, part in segments]
    )


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A gradient in its wire form: what :meth:`psflow.transport.client.PSClient.push` sends.

    Attributes:
        codec: how ``wire`` encodes the values.
        wire: the encoded elements (C-contiguous, same shape as the gradient).
        dtype: the gradient's own dtype (what the PS decodes to).
        shape: the gradient's shape.
    """

    codec: Codec
    wire: np.ndarray
    dtype: np.dtype
    shape: tuple[int, ...]

    def decode(self) -> np.ndarray:
        """The values the PS will apply."""
        return self.codec.decode(self.wire, self.dtype).reshape(self.shape)


class ErrorFeedback:
    """Per-variable residuals: what compression lost, added to the next gradient.

    Args:
        codec: the codec (one for every variable), or a mapping name -> codec
            (variables absent from it are sent uncompressed).

    Thread-safe; a residual has the gradient's shape and dtype.
    """

    def __init__(self, codec: Codec | Mapping[str, Codec | None]) -> None:
        self._codec = codec
        self._residuals: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def codec_for(self, name: str) -> Codec | None:
        """The codec used for variable ``name`` (None: uncompressed)."""
        if isinstance(self._codec, Codec):
            return self._codec
        return self._codec.get(name)

    def encode(self, name: str, grad: np.ndarray) -> Encoded | np.ndarray:
        """``grad`` plus the residual, encoded; the new residual is kept.

        Returns the array itself when ``name`` is not compressed.
        """
        codec = self.codec_for(name)
        grad = np.asarray(grad)
        if codec is None:
            return grad
        with self._lock:
            residual = self._residuals.get(name)
            if residual is None or residual.shape != grad.shape or residual.dtype != grad.dtype:
                corrected = np.array(grad, copy=True)  # becomes this variable's residual buffer
            else:
                corrected = np.add(grad, residual, out=residual)  # no new 64 MB per push
            encoded = codec.encode(corrected)
            corrected -= encoded.decode()  # what the wire lost: the next residual
            finite = np.isfinite(corrected)
            if not finite.all():
                # an inf/NaN gradient would poison every later step: keep no residual for it
                corrected[~finite] = 0
            self._residuals[name] = corrected
        return encoded

    def residual(self, name: str) -> np.ndarray | None:
        """The residual currently kept for ``name`` (a copy), or None."""
        with self._lock:
            r = self._residuals.get(name)
            return None if r is None else r.copy()

    def reset(self) -> None:
        """Forgets every residual (e.g. after restoring a checkpoint)."""
        with self._lock:
            self._residuals.clear()


def feedback_from_option(option: str | Mapping[str, str] | None) -> ErrorFeedback | None:
    """The error feedback a strategy's ``compression=`` option asks for (None: off).

    ``option`` is a codec name for every variable, or ``{ps_variable_name: codec}``.

    Raises:
        InvalidArgumentError: an unknown codec name, or an option of another type.
    """
    if option is None:
        return None
    if isinstance(option, str):
        codec = get_codec(option)
        return None if codec is None else ErrorFeedback(codec)
    if isinstance(option, Mapping):
        return ErrorFeedback({str(k): get_codec(v) for k, v in option.items()})
    raise InvalidArgumentError(
        f"compression must be a codec name or a {{variable: codec}} mapping, got {option!r}"
    )
