"""The tensor codec and the hand-built framing, checked against the generated protobuf code."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.errors import InvalidArgumentError
from psflow.proto import ps_pb2, tensor_pb2
from psflow.transport import codec, framing
from psflow.transport.service import METHODS, SERVICE, Kind

WIRE_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8]


@pytest.mark.parametrize("dtype", [*WIRE_DTYPES, np.bool_])
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (2, 0, 3)])
def test_tensor_round_trip(dtype, shape):
    rng = np.random.default_rng(0)
    arr = np.asarray(rng.standard_normal(shape) * 50).astype(dtype)
    msg = tensor_pb2.Tensor.FromString(codec.encode_tensor(arr).SerializeToString())
    back = codec.decode_tensor(msg)
    assert back.dtype == arr.dtype and back.shape == arr.shape
    assert back.tobytes() == arr.tobytes()


def test_decode_is_a_view_not_a_copy():
    buf = np.arange(6, dtype=np.int32).tobytes()
    arr = codec.tensor_from_buffer(np.dtype(np.int32), (2, 3), buf)
    assert not arr.flags.owndata and arr.base is not None


def test_encode_handles_non_contiguous_and_big_endian():
    arr = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]
    back = codec.decode_tensor(codec.encode_tensor(arr))
    np.testing.assert_array_equal(back, arr)
    assert back.dtype == np.dtype("<i4")


@pytest.mark.parametrize(
    "dtype, shape, nbytes, match",
    [
        (tensor_pb2.DATA_TYPE_FLOAT32, [2, 3], 20, "needs 24 bytes, got 20"),
        (tensor_pb2.DATA_TYPE_FLOAT32, [2, 3], 28, "got 28"),
        (tensor_pb2.DATA_TYPE_FLOAT32, [-1, 3], 0, "negative"),
        (tensor_pb2.DATA_TYPE_FLOAT32, [1 << 40, 1 << 40], 0, "above the limit"),
        (tensor_pb2.DATA_TYPE_UNSPECIFIED, [1], 4, "code 0"),
        (77, [1], 4, "code 77"),
        (tensor_pb2.DATA_TYPE_INT8, [1] * 33, 1, "rank 33"),
    ],
)
def test_bad_tensors_are_invalid_argument_naming_the_value(dtype, shape, nbytes, match):
    msg = tensor_pb2.Tensor(dtype=dtype, shape=shape, data=bytes(nbytes))
    with pytest.raises(InvalidArgumentError, match=match):
        codec.decode_tensor(msg)


def test_bool_bytes_other_than_0_1_are_rejected():
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_BOOL, shape=[2], data=b"\x01\x02")
    with pytest.raises(InvalidArgumentError, match="bool"):
        codec.decode_tensor(msg)


def test_unsupported_dtype_names_the_dtype():
    with pytest.raises(InvalidArgumentError, match="complex128"):
        codec.encode_tensor(np.zeros(2, np.complex128))


# --- framing ------------------------------------------------------------------
def test_encoded_messages_parse_with_generated_code():
    header = ps_pb2.PushHeader(items=[ps_pb2.PushItem(name="w", base_version=3)])
    payload = [np.arange(5, dtype=np.float32), np.arange(3, dtype=np.int64)]
    raw = framing.encode_message(
        header.SerializeToString(), [framing.byte_view(a) for a in payload]
    )
    parsed = ps_pb2.PushRequest.FromString(raw)
    assert parsed.header == header
    assert parsed.chunk.data == b"".join(a.tobytes() for a in payload)


def test_generated_messages_split_without_copy():
    msg = ps_pb2.PullResponse(
        header=ps_pb2.PullHeader(tensors=[ps_pb2.PulledTensor(name="x", version=2)]),
        chunk=tensor_pb2.Chunk(data=b"abcdef"),
    )
    raw = msg.SerializeToString()
    hdr, payload = framing.split_message(raw)
    assert ps_pb2.PullHeader.FromString(hdr) == msg.header
    assert bytes(payload) == b"abcdef"
    assert payload.obj is raw  # a view into the received buffer


def test_unknown_fields_are_skipped():
    # field 9 varint, field 10 fixed64, field 11 bytes, field 12 fixed32, then a chunk
    raw = b"\x48\x05" + b"\x51" + bytes(8) + b"\x5a\x02hi" + b"\x65" + bytes(4)
    raw += framing.encode_message(None, [b"xyz"])
    assert framing.split_message(raw) == (None, memoryview(b"xyz"))


@pytest.mark.parametrize(
    "raw",
    [b"\x0a\x05ab", b"\x12", b"\x0b", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x00"],
    ids=["truncated-header", "truncated-len", "group", "long-varint", "field-0"],
)
def test_malformed_framing_is_invalid_argument(raw):
    with pytest.raises(InvalidArgumentError, match="malformed"):
        framing.split_message(raw)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=0, max_size=6),
    itemsizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=6, max_size=6),
    chunk=st.integers(1, 4096),
)
def test_payload_messages_reassemble_exactly(sizes, itemsizes, chunk):
    rng = np.random.default_rng(len(sizes))
    dtypes = {1: np.uint8, 2: np.int16, 4: np.float32, 8: np.int64}
    arrays = [rng.integers(0, 100, n).astype(dtypes[itemsizes[i]]) for i, n in enumerate(sizes)]
    messages = list(framing.payload_messages(b"H", arrays, chunk))
    assembler = framing.PayloadAssembler([a.nbytes for a in arrays])
    for i, raw in enumerate(messages):
        hdr, payload = framing.split_message(raw)
        assert (hdr == b"H") == (i == 0)
        if payload is not None:
            # no chunk is larger than asked, except a single element that does not fit
            assert len(payload) <= max(chunk, 8)
        assembler.feed(payload)
    assembler.finish()
    for i, a in enumerate(arrays):
        pieces = assembler.pieces(i)
        assert b"".join(pieces) == a.tobytes()
        assert all(len(p) % a.itemsize == 0 for p in pieces)  # cut at elements only


def test_assembler_rejects_extra_and_missing_bytes():
    a = framing.PayloadAssembler([4, 4])
    with pytest.raises(InvalidArgumentError, match="more than the 8 bytes"):
        a.feed(memoryview(bytes(9)))
    b = framing.PayloadAssembler([4, 4])
    b.feed(memoryview(bytes(6)))
    with pytest.raises(InvalidArgumentError, match="6 of 8"):
        b.finish()


def test_method_table_matches_the_service_descriptor():
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    assert service.full_name == SERVICE
    assert {m.name for m in service.methods} == set(METHODS)
    for m in service.methods:
        kind, req, resp, _, _ = METHODS[m.name]
        assert req.DESCRIPTOR is m.input_type and resp.DESCRIPTOR is m.output_type
        expected = {
            (False, False): Kind.UNARY_UNARY,
            (False, True): Kind.UNARY_STREAM,
            (True, False): Kind.STREAM_UNARY,
        }[(m.client_streaming, m.server_streaming)]
        assert kind is expected
