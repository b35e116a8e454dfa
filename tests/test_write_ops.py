"""The PS write ops: one table of names, wire codes and in-place arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from psflow import errors
from psflow.proto import ps_pb2
from psflow.ps import write_ops


def test_names_and_wire_codes_round_trip():
    for op in write_ops.WRITE_OPS:
        assert write_ops.from_wire(write_ops.to_wire(op)) == op
        assert write_ops.is_wire_write(write_ops.to_wire(op))
    assert not write_ops.is_wire_write(ps_pb2.WRITE_OP_CREATE)


@pytest.mark.parametrize(("op", "want"), [("assign", [5, 5]), ("assign_add", [6, 7]),
                                          ("assign_sub", [-4, -3])])  # fmt: skip
def test_apply_matches_numpy(op, want):
    dst = np.array([1.0, 2.0])
    write_ops.apply(op, dst, np.array([5.0, 5.0]))
    assert dst.tolist() == want


def test_unknown_ops_and_codes_are_typed_errors_that_quote_them():
    with pytest.raises(errors.InvalidArgumentError, match="'assign_mul'"):
        write_ops.to_wire("assign_mul")
    with pytest.raises(errors.InvalidArgumentError, match="unknown write op 99"):
        write_ops.from_wire(99)
    dst = np.zeros(2)
    with pytest.raises(errors.InvalidArgumentError):
        write_ops.apply("assign_mul", dst, np.ones(2))
    assert dst.tolist() == [0.0, 0.0]
