"""A push's payload decoded from one buffer (the data plane's) and from streamed chunks alike;
a pull's reply viewed in its one buffer."""

from __future__ import annotations

import numpy as np
import pytest

from psflow.errors import InvalidArgumentError
from psflow.ps.push_types import Gradient, PushContext
from psflow.transport import codec, messages
from psflow.transport.dataplane import Request


def _spec(proto, name):
    return codec.check_spec(proto.dtype, proto.shape, max_bytes=1 << 40)


def _decode(header, arrays, *, one_buffer, chunk_bytes):
    payload = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    view = memoryview(bytearray(payload))
    return messages.decode_push(
        Request("Push", header, view if one_buffer else memoryview(b""), "test", None),
        None if one_buffer else [view[i : i + 7] for i in range(0, len(view), 7)],
        spec=_spec,
        shm_view=None,
        chunk_bytes=chunk_bytes,
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
    for sent, a, b in zip(GRADS, whole.args[0], chunked.args[0], strict=True):
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
    parts = whole.args[0][1].values.parts
    assert all(np.shares_memory(arr, np.frombuffer(buffer, np.uint8)) for _, arr in parts)
    assert [off for off, _ in parts] == list(range(0, 40, max(chunk_bytes // 4, 1)))[: len(parts)]


def test_a_bool_byte_other_than_0_or_1_in_one_buffer_is_refused_naming_the_gradient():
    header, _ = messages.encode_push(
        [Gradient("flag", np.array([True, False]))], PushContext(("c", 1))
    )
    bad = memoryview(bytearray(b"\x01\x02"))
    with pytest.raises(InvalidArgumentError, match=r"flag.*bool"):
        messages.decode_push(
            Request("Push", header, bad, "test", None),
            spec=_spec,
            shm_view=None,
            chunk_bytes=1 << 20,
        )


def _pull_reply(tensors):
    class T:
        def __init__(self, name, value):
            self.name, self.value, self.version = name, value, 3

    header = messages.pull_header([T(n, v) for n, v in tensors])
    return header, b"".join(v.tobytes() for _, v in tensors)


def test_a_pull_reply_in_one_buffer_is_viewed_per_tensor_and_its_specs_are_told():
    tensors = [("h", np.arange(3, dtype=np.float16)), ("w", np.arange(6.0).reshape(2, 3))]
    header, payload = _pull_reply(tensors)
    seen = []
    pulled = messages.PullDecoder(None, False, lambda *spec: seen.append(spec)).frame(
        (header, memoryview(bytearray(payload)))
    )
    for (_, sent), (got, version) in zip(tensors, pulled, strict=True):
        np.testing.assert_array_equal(got, sent)
        assert got.dtype == sent.dtype and version == 3
    assert seen == [(n, v.dtype, v.shape) for n, v in tensors]


@pytest.mark.parametrize("cut", [-1, 1])
def test_a_pull_reply_of_the_wrong_size_is_refused(cut):
    header, payload = _pull_reply([("a", np.ones(4, np.float32)), ("b", np.ones(2, np.int64))])
    wrong = memoryview(bytearray(payload[:cut] if cut < 0 else payload + b"x"))
    with pytest.raises(InvalidArgumentError, match="2 tensors its header announced"):
        messages.PullDecoder(None, False, lambda *spec: None).frame((header, wrong))
