"""Learning-rate schedules: ``schedule(step) -> learning rate``."""

from __future__ import annotations

import math
from typing import Any

from psflow import errors


class LearningRateSchedule:
    """Base class: a callable from the optimizer's step to a learning rate."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LearningRateSchedule:
        """Rebuilds from :meth:`get_config`."""
        return cls(**config)


class ExponentialDecay(LearningRateSchedule):
    """``initial * decay_rate ** (step / decay_steps)`` (floored with ``staircase``)."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        decay_rate: float,
        staircase: bool = False,
        name: str | None = None,
    ) -> None:
        if decay_steps <= 0:
            raise errors.InvalidArgumentError(f"decay_steps must be > 0, got {decay_steps}")
        self.initial_learning_rate = float(initial_learning_rate)
        self.decay_steps = decay_steps
        self.decay_rate = float(decay_rate)
        self.staircase = staircase

    def __call__(self, step: int) -> float:
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return self.initial_learning_rate * self.decay_rate**p

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
        }


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[i]`` while ``step <= boundaries[i]``, then the next value."""

    def __init__(self, boundaries: list[int], values: list[float], name: str | None = None) -> None:
        if len(values) != len(boundaries) + 1:
            raise errors.InvalidArgumentError(
                f"PiecewiseConstantDecay needs len(values) == len(boundaries) + 1, got "
                f"{len(values)} values and {len(boundaries)} boundaries"
            )
        self.boundaries, self.values = list(boundaries), [float(v) for v in values]

    def __call__(self, step: int) -> float:
        for b, v in zip(self.boundaries, self.values):
            if step <= b:
                return v
        return self.values[-1]

    def get_config(self) -> dict[str, Any]:
        return {"boundaries": self.boundaries, "values": self.values}


class CosineDecay(LearningRateSchedule):
    """Cosine decay from ``initial`` to ``initial * alpha`` over ``decay_steps``."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        alpha: float = 0.0,
        name: str | None = None,
    ) -> None:
        self.initial_learning_rate, self.decay_steps, self.alpha = (
            float(initial_learning_rate),
            decay_steps,
            alpha,
        )

    def __call__(self, step: int) -> float:
        t = min(step, self.decay_steps) / self.decay_steps
        cos = 0.5 * (1 + math.cos(math.pi * t))
        return self.initial_learning_rate * ((1 - self.alpha) * cos + self.alpha)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
        }


class InverseTimeDecay(LearningRateSchedule):
    """``initial / (1 + decay_rate * step / decay_steps)``."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        decay_rate: float,
        staircase: bool = False,
        name: str | None = None,
    ) -> None:
        self.initial_learning_rate, self.decay_steps = float(initial_learning_rate), decay_steps
        self.decay_rate, self.staircase = float(decay_rate), staircase

    def __call__(self, step: int) -> float:
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return self.initial_learning_rate / (1 + self.decay_rate * p)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
        }
