"""``model.summary()``: the table of layers, output shapes and parameter counts, as Keras prints it."""

from __future__ import annotations

from typing import Any

import numpy as np


def chained_rows(model: Any) -> list[tuple[Any, str, str | None]]:
    """Rows for a model whose layers feed each other in order (Sequential, subclassed)."""
    layers = getattr(model, "layers", None) or model._sublayers
    shape = model._batch_input_shape
    rows: list[tuple[Any, str, str | None]] = []
    for layer in layers:
        if shape is not None:
            try:
                shape = tuple(layer.compute_output_shape(shape))
                shown = str(shape)
            except Exception:  # a layer whose shape rule needs a real call: shown unknown
                shown, shape = "?", None
        else:
            shown = "?" if not layer.built else "multiple"
        rows.append((layer, shown, None))
    return rows


def print_summary(
    model: Any, rows: list[tuple[Any, str, str | None]], line_length: int | None, print_fn: Any
) -> None:
    """Prints the table; a 'Connected to' column when any row names its inbound layers."""
    out = print_fn or print
    connected = any(c is not None for _, _, c in rows)
    line_length = line_length or (98 if connected else 65)
    # Keras 2's column ends: 45% and 85% of the line (33/55/67% with 'Connected to').
    fractions = (0.33, 0.55, 0.67, 1.0) if connected else (0.45, 0.85, 1.0)
    ends = [int(line_length * f) for f in fractions]

    def row(*fields: str) -> str:
        line = ""
        for field, end in zip(fields, ends):
            line += field
            line = line.ljust(end) if len(line) < end else line + " "
        return line.rstrip() if connected else line

    header = ["Layer (type)", "Output Shape", "Param #"] + (["Connected to"] if connected else [])
    out(f'Model: "{model.name}"')
    out("_" * line_length)
    out(row(*(" " + header[0], *header[1:])))
    out("=" * line_length)
    for layer, shown, inbound in rows:
        fields = [f" {layer.name} ({type(layer).__name__})", shown, str(layer.count_params())]
        out(row(*fields, *([inbound or "-"] if connected else [])))
        out(" " * line_length)
    out("=" * line_length)
    total = model.count_params()
    trainable = int(sum(int(np.prod(v.shape)) for v in model.trainable_weights))
    out(f"Total params: {total} ({_bytes(total)})")
    out(f"Trainable params: {trainable} ({_bytes(trainable)})")
    out(f"Non-trainable params: {total - trainable} ({_bytes(total - trainable)})")
    out("_" * line_length)


def _bytes(n_params: int) -> str:
    size = n_params * 4.0
    for unit in ("Byte", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} GB"
