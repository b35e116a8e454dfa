"""Weight initializers (Keras's ``keras.initializers``), drawing from ``psflow.random``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from psflow import dtypes, errors
from psflow import random as random_lib
from psflow.framework.tensor import Tensor, _place


def _fans(shape: tuple[int, ...]) -> tuple[float, float]:
    if len(shape) < 1:
        return 1.0, 1.0
    if len(shape) == 1:
        return float(shape[0]), float(shape[0])
    if len(shape) == 2:
        return float(shape[0]), float(shape[1])
    receptive = float(np.prod(shape[:-2]))
    return shape[-2] * receptive, shape[-1] * receptive


class Initializer:
    """Base class: ``initializer(shape, dtype)`` returns a tensor."""

    def __call__(self, shape: Any, dtype: Any = "float32", **kwargs: Any) -> Tensor:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Initializer:
        """Rebuilds from :meth:`get_config`."""
        return cls(**config)


class Constant(Initializer):
    """Every element equals ``value``."""

    def __init__(self, value: float = 0.0) -> None:
        self.value = value

    def __call__(self, shape: Any, dtype: Any = "float32", **kwargs: Any) -> Tensor:
        dt = dtypes.as_dtype(dtype)
        return Tensor._wrap(_place(np.full(tuple(shape), self.value, dtype=dt.np)))

    def get_config(self) -> dict[str, Any]:
        return {"value": self.value}


class Zeros(Constant):
    """All zeros."""

    def __init__(self) -> None:
        super().__init__(0.0)

    def get_config(self) -> dict[str, Any]:
        return {}


class Ones(Constant):
    """All ones."""

    def __init__(self) -> None:
        super().__init__(1.0)

    def get_config(self) -> dict[str, Any]:
        return {}


class RandomNormal(Initializer):
    """Normal samples with ``mean`` and ``stddev``."""

    def __init__(self, mean: float = 0.0, stddev: float = 0.05, seed: int | None = None) -> None:
        self.mean, self.stddev, self.seed = mean, stddev, seed

    def __call__(self, shape: Any, dtype: Any = "float32", **kwargs: Any) -> Tensor:
        return random_lib.normal(shape, self.mean, self.stddev, dtype, self.seed)

    def get_config(self) -> dict[str, Any]:
        return {"mean": self.mean, "stddev": self.stddev, "seed": self.seed}


class RandomUniform(Initializer):
    """Uniform samples in ``[minval, maxval)``."""

    def __init__(
        self, minval: float = -0.05, maxval: float = 0.05, seed: int | None = None
    ) -> None:
        self.minval, self.maxval, self.seed = minval, maxval, seed

    def __call__(self, shape: Any, dtype: Any = "float32", **kwargs: Any) -> Tensor:
        return random_lib.uniform(shape, self.minval, self.maxval, dtype, self.seed)

    def get_config(self) -> dict[str, Any]:
        return {"minval": self.minval, "maxval": self.maxval, "seed": self.seed}


class TruncatedNormal(Initializer):
    """Normal samples redrawn beyond two standard deviations."""

    def __init__(self, mean: float = 0.0, stddev: float = 0.05, seed: int | None = None) -> None:
        self.mean, self.stddev, self.seed = mean, stddev, seed

    def __call__(self, shape: Any, dtype: Any = "float32", **kwargs: Any) -> Tensor:
        return random_lib.truncated_normal(shape, self.mean, self.stddev, dtype, self.seed)

    def get_config(self) -> dict[str, Any]:
        return {"mean": self.mean, "stddev": self.stddev, "seed": self.seed}


class VarianceScaling(Initializer):
    """Samples scaled by the layer's fan (Keras's ``VarianceScaling``)."""

    def __init__(
        self,
        scale: float = 1.0,
        mode: str = "fan_in",
        distribution: str = "truncated_normal",
        seed: int | None = None,
    ) -> None:
        if scale <= 0:
            raise errors.InvalidArgumentError(f"VarianceScaling: scale must be > 0, got {scale}")
        if mode not in ("fan_in", "fan_out", "fan_avg"):
            raise errors.InvalidArgumentError(f"VarianceScaling: unknown mode {mode!r}")
        if distribution not in ("truncated_normal", "untruncated_normal", "uniform", "normal"):
            raise errors.InvalidArgumentError(
                f"VarianceScaling: unknown distribution {distribution!r}"
            )
        self.scale, self.mode, self.distribution, self.seed = scale, mode, distribution, seed

    def __call__(self, shape: Any, dtype: Any = "float32", **kwargs: Any) -> Tensor:
        shape = tuple(int(d) for d in shape)
        fan_in, fan_out = _fans(shape)
        n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[self.mode]
        scale = self.scale / max(1.0, n)
        if self.distribution == "truncated_normal":
            # stddev of a unit normal truncated to [-2, 2]
            return random_lib.truncated_normal(
                shape, 0.0, math.sqrt(scale) / 0.87962566103423978, dtype, self.seed
            )
        if self.distribution in ("untruncated_normal", "normal"):
            return random_lib.normal(shape, 0.0, math.sqrt(scale), dtype, self.seed)
        limit = math.sqrt(3.0 * scale)
        return random_lib.uniform(shape, -limit, limit, dtype, self.seed)

    def get_config(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "mode": self.mode,
            "distribution": self.distribution,
            "seed": self.seed,
        }


class GlorotUniform(VarianceScaling):
    """Uniform in ``±sqrt(6 / (fan_in + fan_out))`` (Keras's default kernel initializer)."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(1.0, "fan_avg", "uniform", seed)

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed}


class GlorotNormal(VarianceScaling):
    """Truncated normal with variance ``2 / (fan_in + fan_out)``."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(1.0, "fan_avg", "truncated_normal", seed)

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed}


class HeNormal(VarianceScaling):
    """Truncated normal with variance ``2 / fan_in``."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(2.0, "fan_in", "truncated_normal", seed)

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed}


class HeUniform(VarianceScaling):
    """Uniform in ``±sqrt(6 / fan_in)``."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(2.0, "fan_in", "uniform", seed)

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed}


class LecunNormal(VarianceScaling):
    """Truncated normal with variance ``1 / fan_in``."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(1.0, "fan_in", "truncated_normal", seed)

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed}


_BY_NAME: dict[str, type[Initializer]] = {
    "zeros": Zeros,
    "ones": Ones,
    "constant": Constant,
    "random_normal": RandomNormal,
    "random_uniform": RandomUniform,
    "truncated_normal": TruncatedNormal,
    "variance_scaling": VarianceScaling,
    "glorot_uniform": GlorotUniform,
    "glorot_normal": GlorotNormal,
    "he_normal": HeNormal,
    "he_uniform": HeUniform,
    "lecun_normal": LecunNormal,
}


def get(identifier: Any) -> Initializer:
    """An initializer from a name, an instance, a class or a callable.

    Raises:
        ValueError: an unknown name, quoted with the known ones.
    """
    if isinstance(identifier, Initializer):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Initializer):
        return identifier()
    if isinstance(identifier, str):
        key = identifier.lower()
        if key not in _BY_NAME:
            # Keras also accepts CamelCase class names
            by_class = {c.__name__.lower(): c for c in _BY_NAME.values()}
            if key in by_class:
                return by_class[key]()
            raise errors.InvalidArgumentError(
                f"Unknown initializer {identifier!r}; known: {sorted(_BY_NAME)}"
            )
        return _BY_NAME[key]()
    if callable(identifier):
        return _Callable(identifier)
    raise TypeError(f"Could not interpret initializer {identifier!r}")


class _Callable(Initializer):
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, shape: Any, dtype: Any = "float32", **kwargs: Any) -> Tensor:
        from psflow.framework.tensor import convert_to_tensor

        return convert_to_tensor(self.fn(shape, dtype=dtype), dtype=dtype)
