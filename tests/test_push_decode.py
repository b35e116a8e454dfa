"""A push's payload decoded from one buffer (the data plane's) and from streamed chunks alike."""

from __future__ import annotations

import numpy as np
import pytest

from psflow.errors import InvalidArgumentError
from psflow.proto import ps_pb2
from psflow.ps.push_types import Gradient, PushContext
from psflow.transport import codec, messages


def _spec(proto, name):
    return codec.check_spec(proto.dtype, proto.shape, max_bytes=1 << 40)


def _decode(header, arrays, *, one_buffer, chunk_bytes):
    payload = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    parsed = ps_pb2.PushHeader.FromString(header)
    view = memoryview(bytearray(payload))
    return messages.decode_push(
        parsed,
        [] if one_buffer else [view[i : i + 7] for i in range(0, len(view), 7)],
        spec=_spec,
        shm_view=None,
        chunk_bytes=chunk_bytes,
        borrowed=view if one_buffer else None,
    ), view


GRADS = [
    Gradient("h", np.arange(5, dtype=np.float16)),  # odd bytes: what follows is misaligned
    Gradient("f", np.linspace(-1, 1, 40, dtype=np.float32).reshape(4, 10)),
    Gradient("s", np.ones((2, 3), np.float64), np.array([4, 1], np.int64)),
    Gradient("b", np.array([True, False, True])),
    Gradient("e", np.zeros((0, 3), np.float32)),
]


@pytest.mark.parametrize("chunk_bytes", [8, 24, 1 << 20])
def test_one_buffer_and_streamed_chunks_decode_to_the_same_gradients(chunk_bytes):
    header, arrays = messages.encode_push(GRADS, PushContext(("c", 1)))
    whole, buffer = _decode(header, arrays, one_buffer=True, chunk_bytes=chunk_bytes)
    chunked, _ = _decode(header, arrays, one_buffer=False, chunk_bytes=chunk_bytes)
    for sent, a, b in zip(GRADS, whole.grads, chunked.grads, strict=True):
        got = [
            g.values if isinstance(g.values, np.ndarray) else g.values.to_array() for g in (a, b)
        ]
        for value in got:
            assert value.dtype == sent.values.dtype and value.shape == sent.values.shape
            np.testing.assert_array_equal(value, sent.values)
        if sent.indices is not None:
            np.testing.assert_array_equal(a.indices, sent.indices)
            np.testing.assert_array_equal(b.indices, sent.indices)
    # the one buffer's dense items are views of it, not copies
    parts = whole.grads[1].values.parts
    assert all(np.shares_memory(arr, np.frombuffer(buffer, np.uint8)) for _, arr in parts)
    assert [off for off, _ in parts] == list(range(0, 40, max(chunk_bytes // 4, 1)))[: len(parts)]


def test_a_bool_byte_other_than_0_or_1_in_one_buffer_is_refused_naming_the_gradient():
    header, _ = messages.encode_push(
        [Gradient("flag", np.array([True, False]))], PushContext(("c", 1))
    )
    parsed = ps_pb2.PushHeader.FromString(header)
    bad = memoryview(bytearray(b"\x01\x02"))
    with pytest.raises(InvalidArgumentError, match=r"flag.*bool"):
        messages.decode_push(
            parsed, [], spec=_spec, shm_view=None, chunk_bytes=1 << 20, borrowed=bad
        )
