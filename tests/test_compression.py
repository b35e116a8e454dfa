"""Push compression: 16-bit codecs against plain references, error feedback, a real PS."""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest

from psflow.compression import ErrorFeedback, get_codec
from psflow.errors import InvalidArgumentError
from psflow.proto import ps_pb2
from psflow.transport import framing
from psflow.transport.service import method_path


def _bf16_reference(x: float) -> float:
    """Nearest bfloat16 to a float32, ties to even, by exhaustive neighbour choice."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    lo_bits = bits & 0xFFFF0000
    hi_bits = lo_bits + 0x10000
    lo = struct.unpack("<f", struct.pack("<I", lo_bits))[0]
    hi = struct.unpack("<f", struct.pack("<I", hi_bits & 0xFFFFFFFF))[0]
    d_lo, d_hi = abs(x - lo), abs(hi - x)
    if d_lo < d_hi or (d_lo == d_hi and not (lo_bits >> 16) & 1):
        return lo
    return hi


def test_bf16_rounds_to_nearest_even_like_the_reference():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(500).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 500),
            # exact ties: a kept mantissa ending in 0 and in 1, plus a half-way bit
            np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0, -0.0], np.float32),
        ]
    ).astype(np.float32)
    codec = get_codec("bf16")
    got = codec.encode(x).decode()
    want = np.array([_bf16_reference(float(v)) for v in x], np.float32)
    np.testing.assert_array_equal(got, want)
    assert codec.encode(x).wire.nbytes == x.size * 2
    assert np.isnan(codec.encode(np.array([np.nan], np.float32)).decode()).all()


def test_fp16_matches_numpy_half():
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    enc = get_codec("fp16").encode(x)
    np.testing.assert_array_equal(enc.decode(), x.astype(np.float16).astype(np.float32))
    assert enc.wire.nbytes == 2000


@pytest.mark.parametrize("name", ["int4", "BF16", "", None, 16])
def test_unknown_codec_name_is_a_typed_error(name):
    with pytest.raises(InvalidArgumentError, match="unknown compression codec") as info:
        get_codec(name)
    assert repr(name) in str(info.value) and "bf16" in str(info.value)


def test_codec_refuses_integer_gradients():
    with pytest.raises(InvalidArgumentError, match="int32"):
        get_codec("fp16").encode(np.arange(3, dtype=np.int32))


@pytest.mark.parametrize("codec_name", ["bf16", "fp16"])
def test_error_feedback_keeps_the_applied_sum_on_the_true_sum(codec_name):
    # A gradient with a component below the codec's step: without feedback it is
    # rounded away every time and the applied sum drifts linearly; with it the
    # gap stays within one quantization step whatever the number of steps.
    codec = get_codec(codec_name)
    rng = np.random.default_rng(2)
    steps, n = 1000, 64
    bias = np.float32(1.0 + 2**-12)  # 1 + less than half a bf16/fp16 step
    ef = ErrorFeedback(codec)
    true_sum = np.zeros(n, np.float64)
    ef_sum = np.zeros(n, np.float64)
    plain_sum = np.zeros(n, np.float64)
    worst = 0.0
    for _ in range(steps):
        g = (bias + rng.standard_normal(n) * 1e-5).astype(np.float32)
        true_sum += g
        ef_sum += ef.encode("w", g).decode()
        plain_sum += codec.encode(g).decode()
        worst = max(worst, float(np.abs(ef_sum - true_sum).max()))
    step = 2.0**-7 if codec_name == "bf16" else 2.0**-10  # spacing of 16-bit values near 1
    assert worst <= step, (worst, step)
    # the residual is exactly the gap between what was sent and what was meant
    np.testing.assert_allclose(true_sum - ef_sum, ef.residual("w"), atol=1e-5)
    # and without feedback the gap grows with the steps (2**-12 lost per step)
    plain_gap = np.abs(plain_sum - true_sum).max()
    assert plain_gap > 0.5 * steps * 2**-12 and plain_gap > 10 * worst, (plain_gap, worst)


def test_error_feedback_leaves_uncompressed_variables_alone():
    ef = ErrorFeedback({"a": get_codec("bf16"), "b": None})
    g = np.full(3, 1.001, np.float32)
    assert ef.encode("b", g) is g
    assert ef.encode("a", g).wire.dtype.itemsize == 2
    assert ef.residual("b") is None and ef.residual("a") is not None


@pytest.mark.parametrize("codec_name", ["bf16", "fp16"])
@pytest.mark.parametrize("size", [5, 3 * (1 << 20) // 4 + 3])  # unary, and streamed in chunks
def test_ps_applies_decoded_gradients(ps_client, unique, codec_name, size):
    # SGD with lr 1 on the PS: the value must be init - sum of what was sent
    # (decoded), element for element, and within a step of init - sum of the truth.
    name = unique + "w"
    rng = np.random.default_rng(3)
    init = rng.standard_normal(size).astype(np.float32)
    ps_client.create_variable(name, init, optimizer={"name": "sgd", "learning_rate": 1.0})
    ef = ErrorFeedback(get_codec(codec_name))
    expected = init.copy()
    true = init.astype(np.float64)
    for _ in range(4):
        g = (rng.standard_normal(size) * 1e-2).astype(np.float32)
        encoded = ef.encode(name, g)
        expected -= encoded.decode()
        true -= g
        ps_client.push({name: encoded})
    got = ps_client.pull(name)
    np.testing.assert_array_equal(got, expected)
    assert np.abs(got - true).max() < 1e-3


def test_push_with_bad_codec_changes_nothing(ps_client, unique):
    name = unique + "w"
    ps_client.create_variable(name, np.ones(4, np.float32), optimizer={"name": "sgd"})
    versions_before = ps_client.pull(name, return_versions=True)[1]
    for bad in ("int4", {name: "fp8"}):
        with pytest.raises(InvalidArgumentError, match=r"fp8|int4"):
            ps_client.push({name: np.ones(4, np.float32)}, compression=bad)
    with pytest.raises(InvalidArgumentError, match="sparse"):
        ps_client.push({name: (np.array([0]), np.ones((1,), np.float32))}, compression="bf16")
    value, version = ps_client.pull(name, return_versions=True)
    np.testing.assert_array_equal(value, np.ones(4, np.float32))
    assert version == versions_before


@pytest.mark.parametrize(
    "code, nbytes, match",
    [
        (7, 8, "unknown compression code 7"),  # a codec this PS does not know
        (ps_pb2.COMPRESSION_BF16, 16, "the 8 bytes"),  # float32-sized payload, bf16 announced
    ],
)
def test_wire_rejects_bad_compressed_pushes(ps_server, ps_client, unique, code, nbytes, match):
    from psflow.proto import tensor_pb2

    name = unique + "w"
    ps_client.create_variable(name, np.ones(4, np.float32), optimizer={"name": "sgd"})
    header = ps_pb2.PushHeader()
    header.id.client_id, header.id.sequence = "raw-compression", 1
    header.items.add(
        name=name,
        values=tensor_pb2.TensorSpec(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[4]),
        compression=code,
    )
    message = framing.encode_message(header.SerializeToString(), [b"\x01" * nbytes])
    with grpc.insecure_channel(ps_server.address) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(method_path("Push"))(message, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in info.value.details()
    np.testing.assert_array_equal(ps_client.pull(name), np.ones(4, np.float32))
