"""Keras backend helpers kept for compatibility."""

from psflow.keras.layers.base import clear_session

__all__ = ["clear_session", "epsilon", "floatx"]


def floatx() -> str:
    """The default float type of layers: ``"float32"``."""
    return "float32"


def epsilon() -> float:
    """The fuzz factor used by losses: ``1e-7``."""
    return 1e-7
