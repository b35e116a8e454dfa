"""Communication options: TensorFlow's ``tf.distribute.experimental.CommunicationOptions``."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from psflow import errors


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to use (``AUTO`` lets psflow choose)."""

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"

    @classmethod
    def parse(cls, value: Any) -> CommunicationImplementation:
        """Returns the member for a member, a name (any case) or a same-named enum.

        Raises:
            InvalidArgumentError: ``value`` names no implementation.
        """
        if isinstance(value, cls):
            return value
        name = value.name if isinstance(value, enum.Enum) else value
        if isinstance(name, str) and name.strip().upper() in cls.__members__:
            return cls[name.strip().upper()]
        raise errors.InvalidArgumentError(
            f"Unknown communication implementation {value!r}: "
            f"expected one of {[m.name for m in cls]}"
        )


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How a collective communicates.

    Attributes:
        bytes_per_pack: when > 0, the tensors of one call are packed into
            buffers of at most this many bytes, each all-reduced on its own;
            0 packs each dtype's tensors into one buffer.
        timeout_seconds: how long a replica waits for the others (to arrive at
            a collective, or to make progress inside it) before the call fails
            with ``DeadlineExceededError``; ``None`` means psflow's default
            (:data:`DEFAULT_TIMEOUT_SECONDS`), never an unbounded wait.
        implementation: ``AUTO``, ``RING`` or ``NCCL`` (a name is accepted).

    Example:
        >>> opts = CommunicationOptions(bytes_per_pack=32 << 20, implementation="ring")
        >>> opts.implementation
        <CommunicationImplementation.RING: 'RING'>
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        bpp = self.bytes_per_pack
        if isinstance(bpp, bool) or not isinstance(bpp, int) or bpp < 0:
            raise errors.InvalidArgumentError(
                f"bytes_per_pack must be an integer >= 0, got {bpp!r}"
            )
        t = self.timeout_seconds
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0
        ):
            raise errors.InvalidArgumentError(
                f"timeout_seconds must be a positive number or None, got {t!r}"
            )
        impl = CommunicationImplementation.parse(self.implementation)
        object.__setattr__(self, "implementation", impl)

    @property
    def timeout(self) -> float:
        """The effective timeout in seconds (the default when ``timeout_seconds`` is None)."""
        t = self.timeout_seconds
        return DEFAULT_TIMEOUT_SECONDS if t is None else float(t)

    def merge(self, other: CommunicationOptions | None) -> CommunicationOptions:
        """Returns these options overridden by ``other``'s non-default fields (TF's merge)."""
        if other is None:
            return self
        defaults = CommunicationOptions()
        changes = {
            f.name: getattr(other, f.name)
            for f in dataclasses.fields(self)
            if getattr(other, f.name) != getattr(defaults, f.name)
        }
        return dataclasses.replace(self, **changes)


DEFAULT_TIMEOUT_SECONDS = 300.0
"""The wait bound used when ``timeout_seconds`` is None (no collective ever hangs)."""
