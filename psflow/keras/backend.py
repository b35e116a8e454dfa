"""Keras backend helpers kept for compatibility."""


def floatx() -> str:
    """The default float type of layers: ``"float32"``."""
    return "float32"


def epsilon() -> float:
    """The fuzz factor used by losses: ``1e-7``."""
    return 1e-7
