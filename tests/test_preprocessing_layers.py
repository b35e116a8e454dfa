"""Preprocessing layers: lookups, hashing, encodings, Normalization, Discretization.

References: TensorFlow's documented examples and values TensorFlow 2.21 computes
(hash values below), plain NumPy for the statistics, and the SipHash paper's
test vector. tests/test_layers_tf_reference.py compares with tf.keras directly
where TensorFlow is installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow.data import Dataset
from psflow.keras import layers
from psflow.keras.layers.preprocessing.hash_functions import fingerprint64, siphash24

WORDS = ["", "a", "Hello", "TensorFlow", "2.x", "hello world!!", "x" * 17, "y" * 40]
WORDS += ["z" * 64, "é" * 50, "t" * 150]
# tf.strings.to_hash_bucket_fast(WORDS, 2**63 - 1) under TensorFlow 2.21
TF_FAST = [
    1936946117179621456, 3694432073954588132, 6181326957702750344, 4265654129848386254,
    943390013796179357, 6681298521578234837, 2082709914559524774, 276292113409495006,
    294799756062990872, 2456893889797950300, 2469984397447613201,
]  # fmt: skip
# tf.strings.to_hash_bucket_strong(WORDS, 2**63 - 1, key=[1, 2]) under TensorFlow 2.21
TF_STRONG = [
    443797209252341628, 5158252350249958646, 3561599031292589467, 1016018213495009119,
    2342011335358101778, 6061617260409922248, 3111895715772102225, 546253200436764653,
    5018482603022759484, 4995883385123426104, 2117659778909700608,
]  # fmt: skip


def test_hashes_equal_tensorflows_for_every_length_class() -> None:
    for word, fast, strong in zip(WORDS, TF_FAST, TF_STRONG):
        assert fingerprint64(word.encode()) % (2**63 - 1) == fast, word
        assert siphash24((1, 2), word.encode()) % (2**63 - 1) == strong, word


def test_siphash_matches_the_reference_test_vector() -> None:
    key = (0x0706050403020100, 0x0F0E0D0C0B0A0908)  # bytes 00..0f, little-endian
    assert siphash24(key, bytes(range(15))) == 0xA129CA6149BE45E5


def test_hashing_reproduces_tensorflows_documented_examples() -> None:
    words = pf.constant([["A"], ["B"], ["C"], ["D"], ["E"]])
    assert layers.Hashing(num_bins=3)(words).numpy().ravel().tolist() == [1, 0, 1, 1, 2]
    masked = layers.Hashing(num_bins=3, mask_value="")(pf.constant([["A"], ["B"], [""]]))
    assert masked.numpy().ravel().tolist()[2] == 0
    # tf.strings.to_hash_bucket_fast / _strong docstrings
    assert layers.Hashing(3)(pf.constant(["Hello", "TensorFlow", "2.x"])).numpy().tolist() == [
        0,
        2,
        2,
    ]
    assert layers.Hashing(3, salt=[1, 2])(pf.constant(["Hello", "TF"])).numpy().tolist() == [2, 0]


def test_hashing_hashes_integers_as_their_decimal_text() -> None:
    ints = layers.Hashing(num_bins=17)(pf.constant([3, -7, 123456789012], dtype="int64"))
    text = layers.Hashing(num_bins=17)(pf.constant(["3", "-7", "123456789012"]))
    assert ints.numpy().tolist() == text.numpy().tolist()
    assert ints.dtype == pf.int64


def test_string_lookup_with_a_vocabulary_oov_and_mask() -> None:
    lookup = layers.StringLookup(vocabulary=["a", "b", "c"], mask_token="")
    out = lookup(pf.constant([["a", "c", ""], ["d", "b", "zz"]]))
    assert out.dtype == pf.int64
    assert out.numpy().tolist() == [[2, 4, 0], [1, 3, 1]]
    assert lookup.get_vocabulary() == ["", "[UNK]", "a", "b", "c"]
    assert lookup.vocabulary_size() == 5


def test_string_lookup_adapt_orders_by_count_then_token_and_caps_max_tokens() -> None:
    lookup = layers.StringLookup(max_tokens=4)
    lookup.adapt(np.array([["b", "a", "c"], ["a", "b", "d"], ["e", "[UNK]", "a"]]))
    # a: 3, b: 2, then c, d, e tie at 1 and the largest token wins; [UNK] never enters
    assert lookup.get_vocabulary() == ["[UNK]", "a", "b", "e"]


def test_string_lookup_spreads_oov_over_buckets_by_fingerprint64() -> None:
    lookup = layers.StringLookup(vocabulary=["a"], num_oov_indices=3)
    words = ["q", "hello", "TensorFlow"]
    got = lookup(pf.constant(words)).numpy().tolist()
    assert got == [fingerprint64(w.encode()) % 3 for w in words]
    assert lookup(pf.constant(["a"])).numpy().tolist() == [3]


def test_string_lookup_invert_maps_indices_back() -> None:
    inverse = layers.StringLookup(vocabulary=["a", "b"], invert=True)
    out = inverse(pf.constant([[1, 2], [0, 7]]))
    assert out.dtype == pf.string
    assert out.numpy().tolist() == [["a", "b"], ["[UNK]", "[UNK]"]]


@pytest.mark.parametrize(
    ("mode", "inputs", "want"),
    [
        ("one_hot", [["a"], ["c"]], [[0, 1, 0, 0], [0, 0, 0, 1]]),
        ("multi_hot", [["a", "c", "a"], ["x", "b", "b"]], [[0, 1, 0, 1], [1, 0, 1, 0]]),
        ("count", [["a", "c", "a"], ["x", "b", "b"]], [[0, 2, 0, 1], [1, 0, 2, 0]]),
    ],
)
def test_string_lookup_encodings(mode: str, inputs: list, want: list) -> None:
    out = layers.StringLookup(vocabulary=["a", "b", "c"], output_mode=mode)(pf.constant(inputs))
    assert out.dtype == pf.float32
    np.testing.assert_array_equal(out.numpy(), np.array(want, np.float32))


def test_integer_lookup_maps_oov_by_floormod_with_several_buckets() -> None:
    lookup = layers.IntegerLookup(vocabulary=[12, 36, 1138], num_oov_indices=2, mask_token=0)
    out = lookup(pf.constant([[12, 0, 7], [1138, 36, -3]], dtype="int64"))
    assert out.numpy().tolist() == [[3, 0, 1 + 7 % 2], [5, 4, 1 + (-3) % 2]]
    assert lookup.get_vocabulary() == [0, -1, -1, 12, 36, 1138]
    back = layers.IntegerLookup(vocabulary=[12, 36], invert=True)(pf.constant([1, 2, 9]))
    assert back.numpy().tolist() == [12, 36, -1]


def test_category_encoding_counts_with_weights() -> None:
    layer = layers.CategoryEncoding(num_tokens=4, output_mode="count")
    out = layer(
        pf.constant([[0, 1], [0, 0], [1, 2], [3, 1]]),
        count_weights=np.array([[0.1, 0.2], [0.1, 0.1], [0.2, 0.3], [0.4, 0.2]], np.float32),
    )
    want = [[0.1, 0.2, 0, 0], [0.2, 0, 0, 0], [0, 0.2, 0.3, 0], [0, 0.2, 0, 0.4]]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)
    one_hot = layers.CategoryEncoding(num_tokens=4, output_mode="one_hot")(pf.constant([3, 2, 0]))
    np.testing.assert_array_equal(one_hot.numpy(), np.eye(4, dtype=np.float32)[[3, 2, 0]])


def test_normalization_adapts_mean_and_variance_and_inverts() -> None:
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32) * [1, 5, 0.1] + [2, -3, 9]
    layer = layers.Normalization()
    layer.adapt(Dataset.from_tensor_slices(x).batch(10))  # batches, merged exactly
    y = layer(x).numpy()
    np.testing.assert_allclose(y, (x - x.mean(0)) / x.std(0), rtol=1e-4, atol=1e-4)
    back = layers.Normalization(mean=x.mean(0), variance=x.var(0), invert=True)
    np.testing.assert_allclose(back(y).numpy(), x, rtol=1e-4, atol=1e-4)
    xt = pf.constant(x)
    with pf.GradientTape() as tape:
        tape.watch(xt)
        total = pf.reduce_sum(layer(xt))
    np.testing.assert_allclose(tape.gradient(total, xt).numpy()[0], 1 / x.std(0), rtol=1e-4)


def test_discretization_bins_by_boundaries_and_adapts_quantiles() -> None:
    layer = layers.Discretization(bin_boundaries=[0.0, 1.0, 2.0])
    assert layer(pf.constant([[-1.5, 1.0, 3.4, 0.5]])).numpy().tolist() == [[0, 2, 3, 1]]
    adapted = layers.Discretization(num_bins=4)
    adapted.adapt(np.arange(1, 9, dtype=np.float32))  # cdf k/8 reaches 1/4, 1/2, 3/4 at 2, 4, 6
    np.testing.assert_allclose(adapted.bin_boundaries, [2.0, 4.0, 6.0])


def test_lookup_layers_work_in_a_dataset_map_like_a_ps_dataset_fn() -> None:
    colors = np.array(["red", "green", "blue", "red", "pink"])
    lookup = layers.StringLookup(vocabulary=["red", "green", "blue"])
    hashing = layers.Hashing(num_bins=8)
    ds = (
        Dataset.from_tensor_slices({"color": colors, "label": np.arange(5)})
        .batch(2)
        .map(lambda e: ({"id": lookup(e["color"]), "bucket": hashing(e["color"])}, e["label"]))
    )
    ids = [int(v) for features, _ in ds for v in features["id"].numpy()]
    assert ids == [1, 2, 3, 1, 0]
    assert ds.element_spec[0]["id"].dtype == pf.int64


LAYERS: list[tuple[Any, dict[str, Any], Any]] = [
    (layers.StringLookup, dict(vocabulary=["a", "b"], mask_token="", num_oov_indices=2), ["a", "q", ""]),
    (layers.StringLookup, dict(vocabulary=["a", "b"], output_mode="count"), [["a", "a", "b"]]),
    (layers.IntegerLookup, dict(vocabulary=[5, 9], invert=True), [0, 1, 2]),
    (layers.Hashing, dict(num_bins=5, salt=7, output_mode="one_hot"), ["x", "y"]),
    (layers.CategoryEncoding, dict(num_tokens=3, output_mode="multi_hot"), [[0, 2], [1, 1]]),
    (layers.Normalization, dict(mean=[1.0, 2.0], variance=[4.0, 9.0]), [[3.0, 5.0]]),
    (layers.Discretization, dict(bin_boundaries=[0.5, 1.5]), [[0.0, 1.0, 2.0]]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "kwargs", "inputs"), LAYERS, ids=lambda v: getattr(v, "__name__", "")
)
def test_get_config_rebuilds_an_equal_layer(cls: Any, kwargs: dict[str, Any], inputs: Any) -> None:
    layer = cls(**kwargs)
    config = layer.get_config()
    twin = cls(**config)
    assert twin.get_config() == config
    np.testing.assert_array_equal(
        twin(pf.constant(inputs)).numpy(), layer(pf.constant(inputs)).numpy()
    )


def test_adapted_lookup_config_carries_the_learned_vocabulary() -> None:
    lookup = layers.StringLookup()
    lookup.adapt(["b", "a", "b"])
    twin = layers.StringLookup(**lookup.get_config())
    assert twin.get_vocabulary() == lookup.get_vocabulary() == ["[UNK]", "b", "a"]


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda: layers.StringLookup(vocabulary=["a", "a"]), pf.errors.InvalidArgumentError, "'a'"),
        (lambda: layers.StringLookup(vocabulary=["a", "[UNK]"]), pf.errors.InvalidArgumentError, "[UNK]"),
        (lambda: layers.StringLookup(vocabulary=["a"])(pf.constant([1, 2])), pf.errors.InvalidArgumentError, "int32"),
        (
            lambda: layers.StringLookup(vocabulary=["a"], num_oov_indices=0)(pf.constant(["a", "zz"])),
            pf.errors.InvalidArgumentError,
            "'zz'",
        ),
        (lambda: layers.StringLookup()(pf.constant(["a"])), pf.errors.FailedPreconditionError, "adapt"),
        (lambda: layers.StringLookup(output_mode="tfidf"), pf.errors.InvalidArgumentError, "tfidf"),
        (lambda: layers.StringLookup(vocabulary=["a"]).adapt(["b"]), pf.errors.InvalidArgumentError, "adapt"),
        (lambda: layers.IntegerLookup(vocabulary=[1])(pf.constant(["1"])), pf.errors.InvalidArgumentError, "integer"),
        (lambda: layers.Hashing(num_bins=0), pf.errors.InvalidArgumentError, "num_bins"),
        (lambda: layers.Hashing(num_bins=2, salt="x"), pf.errors.InvalidArgumentError, "'x'"),
        (lambda: layers.CategoryEncoding(3)(pf.constant([[0, 3]])), pf.errors.InvalidArgumentError, "3"),
        (lambda: layers.Normalization(mean=[1.0]), pf.errors.InvalidArgumentError, "variance"),
        (lambda: layers.Normalization()(pf.constant([1.0])), pf.errors.FailedPreconditionError, "adapt"),
        (lambda: layers.Discretization(bin_boundaries=[2.0, 1.0]), pf.errors.InvalidArgumentError, "[2.0, 1.0]"),
        (lambda: layers.Discretization(bin_boundaries=[1.0]).adapt([1.0]), pf.errors.InvalidArgumentError, "num_bins"),
    ],
)  # fmt: skip
def test_bad_arguments_and_inputs_raise_typed_errors(call: Any, error: type, fragment: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value)


def test_a_failed_call_leaves_the_vocabulary_unchanged() -> None:
    lookup = layers.StringLookup(vocabulary=["a"], num_oov_indices=0)
    with pytest.raises(pf.errors.InvalidArgumentError):
        lookup(pf.constant(["b"]))
    with pytest.raises(pf.errors.InvalidArgumentError):
        lookup.set_vocabulary(["x", "x"])
    assert lookup.get_vocabulary() == ["a"]


def test_encodings_drop_the_mask_token_which_then_has_no_index() -> None:
    lookup = layers.StringLookup(vocabulary=["a", "b"], mask_token="", output_mode="multi_hot")
    assert lookup.get_vocabulary() == ["[UNK]", "a", "b"]
    out = lookup(pf.constant([["a", ""], ["", ""]]))
    np.testing.assert_array_equal(out.numpy(), [[0, 1, 0], [0, 0, 0]])


# -- Keras's older names and tf_idf -----------------------------------------------------


@pytest.mark.parametrize("cls", ["StringLookup", "IntegerLookup", "CategoryEncoding"])
def test_binary_is_keras_older_name_for_multi_hot(cls: str) -> None:
    layer_cls = getattr(pf.keras.layers, cls)
    if cls == "CategoryEncoding":
        make = lambda mode: layer_cls(num_tokens=4, output_mode=mode)  # noqa: E731
        data = pf.constant([[0, 1], [3, 3]])
    elif cls == "StringLookup":
        make = lambda mode: layer_cls(vocabulary=["a", "b"], output_mode=mode)  # noqa: E731
        data = pf.constant([["a"], ["b"], ["zz"]])
    else:
        make = lambda mode: layer_cls(vocabulary=[4, 9], output_mode=mode)  # noqa: E731
        data = pf.constant([[4], [9], [5]])
    binary, multi_hot = make("binary"), make("multi_hot")
    assert binary.output_mode == "multi_hot"
    np.testing.assert_array_equal(binary(data).numpy(), multi_hot(data).numpy())


def test_tf_idf_adapt_weighs_counts_by_keras_idf() -> None:
    docs = np.array([["a", "b"], ["a", "a"], ["c", "a"]])
    layer = pf.keras.layers.StringLookup(output_mode="tf_idf")
    layer.adapt(docs)
    assert layer.get_vocabulary() == ["[UNK]", "a", "c", "b"]
    # idf = log(1 + documents / (1 + document frequency)); OOV gets the tokens' mean
    idf = {"a": np.log(1 + 3 / 4), "c": np.log(1 + 3 / 2), "b": np.log(1 + 3 / 2)}
    oov = np.mean(list(idf.values()))
    got = layer(pf.constant([["a", "a"], ["c", "zz"]])).numpy()
    want = np.array([[0, 2 * idf["a"], 0, 0], [oov, 0, idf["c"], 0]], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    rebuilt = pf.keras.layers.StringLookup.from_config(layer.get_config())
    np.testing.assert_allclose(rebuilt(pf.constant([["a", "a"], ["c", "zz"]])).numpy(), want)


def test_tf_idf_with_a_vocabulary_takes_idf_weights() -> None:
    layer = pf.keras.layers.IntegerLookup(
        vocabulary=[5, 7], idf_weights=[0.5, 1.0], output_mode="tf_idf"
    )
    got = layer(pf.constant([[5, 5], [7, 9]])).numpy()
    np.testing.assert_allclose(got, [[0, 1.0, 0], [0.75, 0, 1.0]])


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"vocabulary": ["a"], "output_mode": "tf_idf"}, "needs idf_weights"),
        ({"vocabulary": ["a"], "idf_weights": [1.0], "output_mode": "count"}, "'count'"),
        ({"vocabulary": ["a", "b"], "idf_weights": [1.0], "output_mode": "tf_idf"}, "1 idf"),
        ({"output_mode": "tf-idfs"}, "tf-idfs"),
    ],
)
def test_bad_tf_idf_arguments_are_refused(kwargs: dict, pattern: str) -> None:
    with pytest.raises(pf.errors.InvalidArgumentError, match=pattern):
        pf.keras.layers.StringLookup(**kwargs)
